"""Benchmark: CPU of one rules evaluation cycle, and simpleeval vs rule-engine per eval.

Run by hand: `python bench/bench_rules.py` (rule-engine only needs to be installed for
part 2: `pip install rule-engine`). Results are recorded in docs/rules.md. Not a test.

1. The default rules on every GPU of a simulated 8-GPU node, with the store as the
   sources fill it (300 simulated seconds of history), CPU time per cycle
   (`RuleEngine.evaluate`: snapshot of the store, every rule on every GPU, summaries of
   firing causes).
2. One expression of the shape the rules use (a window function, three comparisons,
   all through the same lookups into the same store), compiled once, evaluated for one
   GPU: through gpuwatchd's simpleeval path, and through rule-engine with the same
   functions, for the choice recorded in docs/rules.md.
"""

from __future__ import annotations

import statistics
import time

from gpuwatchd.config import Config
from gpuwatchd.rules import load_rules
from gpuwatchd.rules.language import compile_expression
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation

EXPR = (
    "avg_over(gpu_utilization_ratio, '2m') < 0.6 and gpu_performance_state == 0"
    " and gpu_process_busiest_thread_cpu_ratio >= 0.9 and gpu_process_workers == 0"
)


def warm(scenario: str, seconds: float) -> Simulation:
    simulation = Simulation(load_scenario(scenario), Config())
    simulation.run(until=seconds)
    return simulation


def cycle_cost(scenario: str) -> tuple[float, float, int, int]:
    simulation = warm(scenario, 300)
    engine = simulation.pipeline.engine
    now = simulation.pipeline.now()
    samples = []
    for _ in range(300):
        started = time.process_time()
        engine.evaluate(now)
        samples.append(time.process_time() - started)
    firing = len(engine.firing())
    simulation.close()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)], len(engine.gpus), firing


def per_eval(n: int = 20000) -> dict[str, float]:
    """µs per evaluation of EXPR for one GPU, by library."""
    simulation = warm("dataloader-single-process", 300)
    try:
        return _per_eval(simulation, n)
    finally:
        simulation.close()


def _per_eval(simulation: Simulation, n: int) -> dict[str, float]:
    engine = simulation.pipeline.engine
    engine.evaluate(simulation.pipeline.now())
    evaluator = engine.evaluator
    gpu = sorted(engine.gpus.values(), key=lambda g: g.gpu)[0]
    compiled = compile_expression(EXPR, engine.catalog)
    result = {}
    started = time.perf_counter()
    for _ in range(n):
        value = evaluator.evaluate(compiled, gpu)
    result["simpleeval (gpuwatchd's compiled tree)"] = (time.perf_counter() - started) / n
    result["simpleeval value"] = value
    try:
        import rule_engine
    except ImportError:
        return result
    catalog = engine.catalog

    def selector(name: str):
        return next(s for s in compile_expression(name, catalog).selectors)

    def lookup(name: str) -> float:
        return evaluator._one(selector_cache[name])

    def avg_over(name: str, duration: str) -> float:
        points = engine.store.window(
            selector_cache[name].family.spec.name,
            evaluator.rows(selector_cache[name])[0][0],
            evaluator.snapshot.now - 120,
        )
        return sum(v for _, v in points) / len(points)

    names = [
        "gpu_utilization_ratio",
        "gpu_performance_state",
        "gpu_process_busiest_thread_cpu_ratio",
        "gpu_process_workers",
    ]
    selector_cache = {name: selector(name) for name in names}
    evaluator.gpu = gpu
    t = rule_engine.DataType
    types = {name: t.FLOAT for name in names}
    types["avg_over"] = t.FUNCTION(
        "avg_over", return_type=t.FLOAT, argument_types=(t.STRING, t.STRING)
    )

    def resolve(thing: object, name: str) -> object:
        return avg_over if name == "avg_over" else lookup(name)

    context = rule_engine.Context(
        type_resolver=rule_engine.type_resolver_from_dict(types), resolver=resolve
    )
    # rule-engine has no way to pass a series itself: the window function takes its name
    text = EXPR.replace(
        "avg_over(gpu_utilization_ratio, '2m')", 'avg_over("gpu_utilization_ratio", "2m")'
    )
    rule = rule_engine.Rule(text, context=context)
    started = time.perf_counter()
    for _ in range(n):
        value = rule.evaluate(None)
    result["rule-engine 5.1 (same lookups)"] = (time.perf_counter() - started) / n
    result["rule-engine value"] = value
    return result


def main() -> None:
    print("| scenario | GPUs | rules | firing | median CPU per cycle | p99 |")
    print("|---|---|---|---|---|---|")
    for scenario in ("healthy-8gpu", "dataloader-single-process", "pcie-gen3-under-load"):
        median, p99, gpus, firing = cycle_cost(scenario)
        rules = len(load_rules(None).rules)
        print(
            f"| {scenario} | {gpus} | {rules} | {firing} | {median * 1e3:.2f} ms |"
            f" {p99 * 1e3:.2f} ms |"
        )
    print()
    print(f"one expression: `{EXPR}`")
    for name, value in per_eval().items():
        if "value" in name:
            print(f"- {name}: {value}")
        else:
            print(f"- {name}: {value * 1e6:.1f} µs per evaluation")


if __name__ == "__main__":
    main()
