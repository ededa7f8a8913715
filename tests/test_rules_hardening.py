"""Hostile or broken rule files (issue 13, findings 8-9): every failure to load is a
RulesError naming the file (the rule and position where known), bounded in size, depth,
literals and evaluation cost; reloads are parsed off the evaluation thread, once the file
has settled, and a failed one sets reload_successful to 0."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from series import error_loading_fifo

from gpuwatchd.cli import main
from gpuwatchd.config import load_config
from gpuwatchd.rules import Catalog, RuleEngine, RuleFileWatcher, RulesError, language, load_rules
from gpuwatchd.rules import engine as engine_module
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.store import Store
from tests.test_rules_load import GOOD, one_rule

CATALOG = Catalog.builtin()


def problems(tmp_path: Path, text: str | bytes) -> list[str]:
    path = tmp_path / "rules.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(RulesError) as e:
        load_rules(path, CATALOG)
    assert all(p.startswith(f"{path}: ") for p in e.value.problems), e.value.problems
    return e.value.problems


# -- finding 8: every failure is a RulesError -------------------------------------------


def test_a_file_that_is_not_utf8_is_a_rules_error(tmp_path: Path) -> None:
    text = GOOD.encode().replace(b"summary: s", b"summary: caf\xe9")
    (problem,) = problems(tmp_path, text)
    assert "not UTF-8" in problem and "line 7" in problem


@pytest.mark.parametrize(
    "expr",
    [
        "-" * 100_000 + "gpu_utilization_ratio > 0",
        "not " * 50_000 + "gpu_utilization_ratio > 0",
        " + ".join(["1"] * 200_000) + " > gpu_utilization_ratio",
    ],
    ids=["100k unary minus", "50k not", "200k-term sum"],
)
def test_huge_expressions_are_refused_by_length(tmp_path: Path, expr: str) -> None:
    (problem,) = problems(tmp_path, one_rule(f"'{expr}'"))
    assert "rule 'cause_x': expr:" in problem and "characters, more than the 4096" in problem


@pytest.mark.parametrize(
    "expr",
    [
        "-" * 2000 + "gpu_utilization_ratio > 0",  # past the parser's own recursion
        "not " * 60 + "gpu_utilization_ratio > 0",  # parses; too deep for the bound
        "abs(" * 60 + "gpu_utilization_ratio" + ")" * 60 + " > 0",
    ],
)
def test_deep_expressions_are_refused_with_a_position(tmp_path: Path, expr: str) -> None:
    (problem,) = problems(tmp_path, one_rule(f"'{expr}'"))
    assert "rule 'cause_x': expr: " in problem
    assert "nested" in problem


def test_deeply_nested_yaml_is_a_rules_error(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, "rules: " + "[" * 20_000)
    assert "not valid YAML" in problem or "nested" in problem


def test_a_summary_placeholder_is_bounded_like_an_expression(tmp_path: Path) -> None:
    deep = "-" * 2000 + "gpu_utilization_ratio"
    (problem,) = problems(
        tmp_path, one_rule("gpu_utilization_ratio > 0", summary=f"'{{{{ {deep} }}}}'")
    )
    assert "rule 'cause_x': summary:" in problem


# -- finding 9: size, literals, cost ----------------------------------------------------


def test_a_huge_file_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rules.yaml"
    with open(path, "wb") as f:
        f.truncate(50 << 20)  # 50 MB (sparse)
    parsed: list[object] = []
    monkeypatch.setattr("yaml.safe_load", lambda text: parsed.append(text))
    with pytest.raises(RulesError, match=r"is 52428800 bytes, more than the 1048576 allowed"):
        load_rules(path, CATALOG)
    assert parsed == []


def test_a_fifo_as_the_rule_file_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    error = error_loading_fifo(path, lambda p: load_rules(p, CATALOG))
    assert isinstance(error, RulesError) and "not a regular file" in str(error)


def test_the_findings_literal_product_is_refused(tmp_path: Path) -> None:
    expr = " * ".join(["9" * 4000] * 200) + " > gpu_utilization_ratio"
    result = CliRunner().invoke(main, ["rules", "check", write(tmp_path, one_rule(f"'{expr}'"))])
    assert result.exit_code == 1
    assert "rule 'cause_x': expr: " in result.output


@pytest.mark.parametrize(
    ("literal", "message"),
    [
        ("9" * 4000, "a number literal of at most 1e+18 in magnitude"),
        ("1e400", "a number literal of at most 1e+18 in magnitude"),
        ("'" + "x" * 300 + "'", "a string literal of at most 256 characters"),
    ],
)
def test_oversized_literals_are_refused_with_their_position(
    tmp_path: Path, literal: str, message: str
) -> None:
    (problem,) = problems(tmp_path, one_rule(f'"gpu_utilization_ratio * 2 > {literal}"'))
    assert problem.endswith(f"rule 'cause_x': expr: line 1, column 29: expected {message}")


def test_number_literals_evaluate_as_floats() -> None:
    compiled = language.compile_expression("gpu_utilization_ratio * 3 > 2", CATALOG)
    literals = [
        n for n in compiled.code.co_consts if type(n) not in (int, type(None))  # int: an index
    ]
    assert sorted(literals) == [2.0, 3.0] and all(type(v) is float for v in literals)


def test_an_expression_costlier_than_the_bound_is_refused(tmp_path: Path) -> None:
    window = "avg_over(gpu_utilization_ratio, '30m') > 0"
    expr = " and ".join([window] * 40)  # 40 x 1800 samples, per GPU, every cycle
    assert len(expr) < language.MAX_EXPRESSION_CHARS
    (problem,) = problems(tmp_path, one_rule(f'"{expr}"'))
    assert "rule 'cause_x': expr: line 1, column " in problem
    assert "costs more than the" in problem


def test_a_file_costlier_than_the_bound_is_refused(tmp_path: Path) -> None:
    window = "avg_over(gpu_utilization_ratio, '10m') > 0"
    expr = " and ".join([window] * 10)  # under the bound per rule
    rules = [one_rule(f'"{expr}"', name=f"cause_{i}").split("\n", 1)[1] for i in range(60)]
    (problem,) = problems(tmp_path, "rules:\n" + "".join(rules))
    assert "rules cost" in problem and "more than the" in problem


def test_the_default_rules_are_well_within_every_bound() -> None:
    rules = load_rules(None, CATALOG)
    # under 30 % of a file's budget: room for a site's own rules beside them (nccl_stall's
    # peer tests, each an expression judged on up to 64 peers, took it past a quarter)
    assert rules.cost <= 0.3 * language.MAX_FILE_COST
    assert all(r.expr.cost * 3 <= language.MAX_EXPRESSION_COST for r in rules.rules)


def test_a_lookup_costs_every_series_its_family_may_have(tmp_path: Path) -> None:
    """Issue 23 (8f): a family's series count is unknown at load, so its documented
    maximum is the cost: a 5-minute window over every CPU's series reads 300 samples of
    each of up to 1,024 CPUs, not of 16."""
    (problem,) = problems(tmp_path, one_rule("\"max_over(cpu_busy_ratio, '5m') > 0.9\""))
    assert "rule 'cause_x': expr: line 1, column 1: costs more than the" in problem
    per_cpu = language.compile_expression("sum(cpu_busy_ratio) > 1", CATALOG)
    assert per_cpu.cost >= 1024  # a lookup looks at every series of its family
    one_value = language.compile_expression("cpu_busy_ratio_max > 0.9", CATALOG)
    assert one_value.cost < 10
    # a matcher listing values costs as many series as it lists
    two = "series('ib_port_errors_total', counter=['symbol_error', 'link_downed'])"
    counters = language.compile_expression(f"change({two}, '1m') > 0", CATALOG)
    ports = CATALOG.families["ib_port_active"].max_series
    assert 2 * 60 * ports <= counters.cost < 3 * 60 * ports


def test_an_evaluation_past_its_budget_stops_not_evaluable() -> None:
    """Issue 23 (8f): a node beyond the documented maxima (here 400 RoCE ports, SR-IOV
    functions, where a node is assumed to have at most 32) does not make an evaluation
    read without bound: past RUN_BUDGET_FACTOR times its load-time cost it stops, and the
    rule is not evaluable on that GPU, saying why."""
    from gpuwatchd.metrics import Sample
    from gpuwatchd.rules.engine import NOT_EVALUABLE
    from tests.test_rules_engine import GPUS, Node, rule

    text = rule("max_over(ib_port_transmit_wait_ratio, '1m') > 0.5")
    compiled = language.compile_expression(
        "max_over(ib_port_transmit_wait_ratio, '1m') > 0.5", CATALOG
    )
    ports = CATALOG.families["ib_port_transmit_wait_ratio"].max_series
    assert 400 * 60 > compiled.cost * language.RUN_BUDGET_FACTOR > ports * 60
    for count, stopped in ((ports, False), (400, True)):
        node = Node(text, up=("nvml", "infiniband"))
        for now in range(61):
            node.nvml(float(now), gpu_utilization_ratio=[0.5, 0.5])
            samples = [
                Sample("gpuwatchd_ib_port_transmit_wait_ratio", (f"mlx5_{i}", "1"), 0.9)
                for i in range(count)
            ]
            node.store.update("infiniband", float(now), samples)
            node.engine.evaluate(float(now))
        state = node.engine.states[(GPUS[0][1], "cause_x")]
        if stopped:
            assert state.state == NOT_EVALUABLE
            assert state.reason.startswith("evaluation stopped: it read more than")
            assert "docs/rules.md" in state.reason
        else:
            assert state.state != NOT_EVALUABLE, state.reason


@pytest.mark.parametrize("scenario", ["straggler-gpu", "pcie-replay-errors", "interrupt-storm"])
def test_the_cost_bounds_the_work_of_an_evaluation(scenario: str) -> None:
    """Count the evaluator's work (calls of its functions, window samples read) per GPU
    per cycle on a simulated node: never more than the static cost `rules check` bounds."""
    simulation = Simulation(load_scenario(scenario), load_config(None))
    engine = simulation.pipeline.engine
    evaluator = engine.evaluator
    work = [0]

    def counting(function: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: object) -> object:
            work[0] += 1
            return function(*args)

        return counted

    def counting_window(*args: object) -> list[tuple[float, float]]:
        points = window(*args)  # type: ignore[arg-type]
        work[0] += len(points)
        return points

    functions = evaluator._globals
    for name, function in list(functions.items()):
        if callable(function):
            functions[name] = counting(function)
    window = evaluator._window
    evaluator._window = counting_window  # type: ignore[method-assign]
    worst = 0.0

    def measure(_: float) -> None:
        nonlocal worst
        worst = max(worst, work[0] / max(1, len(engine.gpus)))
        work[0] = 0

    try:
        simulation.run(until=400, on_step=measure)
    finally:
        simulation.close()
    assert 0 < worst <= engine.rules.cost
    print(f"{scenario}: worst {worst:.0f} steps per GPU and cycle, cost {engine.rules.cost:.0f}")


# -- finding 9: reloads -----------------------------------------------------------------


class Jobs:
    """Starts a watcher's load when the test says: stands in for the loader thread."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, job: Callable[[], None]) -> None:
        self.pending.append(job)

    def run(self) -> None:
        jobs, self.pending = self.pending, []
        for job in jobs:
            job()


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return str(path)


def watched(tmp_path: Path, start: Callable[[Callable[[], None]], None]) -> RuleFileWatcher:
    path = Path(write(tmp_path, GOOD))
    engine = RuleEngine(Store(), load_rules(path, CATALOG), lambda s: True, CATALOG)
    return RuleFileWatcher(engine, path, lambda: 100.0, start=start)


def names(watcher: RuleFileWatcher) -> list[str]:
    return [r.name for r in watcher.engine.rules.rules]


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_reload_is_parsed_off_the_evaluation_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watcher = watched(tmp_path, start=RuleFileWatcher.in_a_thread)
    loaded_on: list[int] = []
    real = engine_module.load_rules

    def recording(*args: object) -> object:
        loaded_on.append(threading.get_ident())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "load_rules", recording)
    watcher.request()
    assert watcher.check() is None  # started, not finished
    assert watcher.wait_idle(10)
    assert watcher.check() is True and names(watcher) == ["cause_x"]
    assert loaded_on and threading.get_ident() not in loaded_on


def test_evaluation_goes_on_while_a_reload_is_parsed(tmp_path: Path) -> None:
    jobs = Jobs()
    watcher = watched(tmp_path, start=jobs)
    path = watcher.path
    assert path is not None
    path.write_text(GOOD.replace("cause_x", "cause_y"))
    bump_mtime(path)
    assert watcher.check() is None  # changed: not loaded until it has settled
    assert jobs.pending == []
    assert watcher.check() is None  # settled: the load starts, elsewhere
    assert len(jobs.pending) == 1
    watcher.engine.evaluate(0.0)  # the old rules run meanwhile
    assert watcher.check() is None and names(watcher) == ["cause_x"]
    jobs.run()
    assert watcher.check() is True and names(watcher) == ["cause_y"]


def test_a_file_still_changing_is_not_parsed(tmp_path: Path) -> None:
    jobs = Jobs()
    watcher = watched(tmp_path, start=jobs)
    path = watcher.path
    assert path is not None
    with open(path, "a") as f:  # a copy in progress: it grows between checks
        for piece in ("  - name: half", "way\n", "    dimension: input\n"):
            f.write(piece)
            f.flush()
            bump_mtime(path)
            assert watcher.check() is None
            assert jobs.pending == []


@pytest.mark.parametrize(
    "text",
    [
        GOOD.encode().replace(b"summary: s", b"summary: \xff"),
        one_rule("'" + "-" * 2000 + "gpu_utilization_ratio > 0'").encode(),
    ],
    ids=["not UTF-8", "too deep"],
)
def test_every_failed_reload_sets_reload_successful_to_0(tmp_path: Path, text: bytes) -> None:
    jobs = Jobs()
    watcher = watched(tmp_path, start=jobs)
    assert watcher.path is not None
    watcher.path.write_bytes(text)
    watcher.request()
    watcher.check()
    jobs.run()
    assert watcher.check() is False
    assert names(watcher) == ["cause_x"]
    assert dict(watcher.engine.rows()["gpuwatchd_rules_last_reload_successful"]) == {(): 0}


def test_an_unexpected_error_while_loading_is_a_failed_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = Jobs()
    watcher = watched(tmp_path, start=jobs)

    def broken(*args: object) -> object:
        raise MemoryError

    monkeypatch.setattr(engine_module, "load_rules", broken)
    watcher.request()
    watcher.check()
    jobs.run()
    assert watcher.check() is False and names(watcher) == ["cause_x"]
    assert watcher.engine.reload_ok is False
