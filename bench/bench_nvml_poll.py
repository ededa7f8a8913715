"""Benchmark: the CPU of the nvml source's steady poll, part by part, on a simulated node.

    python bench/bench_nvml_poll.py [--gpus 8] [--repeat 25] [--bytecodes]

Run by hand (not a test). The node is healthy-8gpu (`--gpus` GPUs) in virtual time, its
fake NVML free of a driver's costs, warmed up by twelve polls; each part is timed as the
best of `--repeat` rounds (process time, all threads: the least a loaded host lets it
take). The parts: the reader's work for one poll (every GPU's NVML calls and what is made
of them: the fake library's own Python included, the same before and after a change of
the source), the same with the hand-off to the source's thread (`collect`), one GPU's
field-values decoding (`FieldValues.read`), and the store's update with the poll's
samples. Compare trees side by side, in one sitting (PYTHONPATH=TREE). `--bytecodes`
also counts the bytecodes gpuwatchd's own code (not the simulator's) runs in the reader's
poll, by function, and in an evaluation cycle (the rules, then the exporter's refresh) on
bench_vs_peer's node whose values change every second (every rule reading them runs
again): counts no load on the host changes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from bench_vs_peer import scenario_file

from gpuwatchd.config import Config
from gpuwatchd.sim.scenario import Scenario, load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.sources.nvml.reader import _Poll


def best(part: Callable[[], Any], number: int, repeat: int) -> float:
    """µs of one call: the best of `repeat` rounds of `number` calls (process time)."""
    rounds = []
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(number):
            part()
        rounds.append(time.process_time() - start)
    return min(rounds) / number * 1e6


def bytecodes(part: Callable[[], Any]) -> Counter[str]:
    """Bytecodes run by gpuwatchd's own functions (gpuwatchd/, not gpuwatchd/sim/) in
    one call of `part`, made on this thread."""
    counts: Counter[str] = Counter()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            counts[f"{code.co_filename.rpartition('gpuwatchd/')[2]}:{code.co_name}"] += 1
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if "/gpuwatchd/" not in name or "/gpuwatchd/sim/" in name:
            return None
        frame.f_trace_opcodes = True
        return local

    sys.settrace(calls)
    try:
        part()
    finally:
        sys.settrace(None)
    return counts


def rules_bytecodes(gpus: int, cycles: int = 10) -> Counter[str]:
    """bytecodes() of an evaluation cycle, summed over `cycles`, each after the sources
    due have polled, on a node whose values change every second."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(load_scenario(scenario_file(Path(tmp), gpus, changing=True)), Config())
    pipeline, counts = sim.pipeline, Counter[str]()
    try:
        for _ in range(40):  # a window's worth of history
            sim.step()
            sim.node.clock.advance(1)
        for _ in range(cycles):
            sim.node.clock.advance(1)
            now = pipeline.now()
            sim.node.tick(sim.scheduler.due(now))
            sim.scheduler.run_due(now)
            counts += bytecodes(lambda: (pipeline.evaluate_rules(), pipeline.exporter.refresh()))
    finally:
        sim.close()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--bytecodes", action="store_true")
    args = parser.parse_args()
    data = load_scenario("healthy-8gpu").model_dump(mode="json", exclude_defaults=True)
    data["node"]["gpu_count"] = args.gpus
    sim = Simulation(Scenario.model_validate(data), Config())
    try:
        for _ in range(12):
            sim.step()
            sim.node.clock.advance(1)
        source = next(s for s in sim.pipeline.sources if s.name == "nvml")
        gpu = source._gpus[0]
        store, samples = sim.pipeline.store, source.collect()
        at = [sim.pipeline.now()]

        def update() -> None:  # the same series again, a second later
            at[0] += 1
            store.update("nvml", at[0], samples)

        direct = source._direct
        parts = {
            "reader, one poll": (lambda: source._read_gpus(_Poll()), 10),
            "collect (reader and hand-off)": (source.collect, 10),
            "FieldValues.read, one GPU": (lambda: direct.values.read(gpu.fast_request), 500),
            "Store.update, one poll": (update, 100),
        }
        print(f"nvml source, {args.gpus} GPUs, {len(samples)} samples a poll; best of "
              f"{args.repeat}; load average {os.getloadavg()[0]:.2f}\n")  # fmt: skip
        print("| part | µs |\n|---|---|")
        for name, (part, number) in parts.items():
            print(f"| {name} | {best(part, number, args.repeat):.1f} |")
        if args.bytecodes:
            counts = bytecodes(lambda: source._read_gpus(_Poll()))
            print(f"\nbytecodes of the reader's poll: {sum(counts.values())}\n")
            print("| function | bytecodes |\n|---|---|")
            for function, count in counts.most_common(10):
                print(f"| {function} | {count} |")
            counts = rules_bytecodes(args.gpus)
            print(f"\nbytecodes of an evaluation cycle: {sum(counts.values()) / 10:.0f}\n")
            print("| function | bytecodes a cycle |\n|---|---|")
            for function, count in counts.most_common(10):
                print(f"| {function} | {count / 10:.0f} |")
    finally:
        sim.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
