"""Benchmark: the CPU of the nvml source's steady poll, part by part, on a simulated node.

    python bench/bench_nvml_poll.py [--gpus 8] [--repeat 25]

Run by hand (not a test). The node is healthy-8gpu (`--gpus` GPUs) in virtual time, its
fake NVML free of a driver's costs, warmed up by twelve polls; each part is timed as the
best of `--repeat` rounds (process time, all threads: the least a loaded host lets it
take). The parts: the reader's work for one poll (every GPU's NVML calls and what is made
of them: the fake library's own Python included, the same before and after a change of
the source), the same with the hand-off to the source's thread (`collect`), one GPU's
field-values decoding (`FieldValues.read`), and the store's update with the poll's
samples. Compare trees side by side, in one sitting (PYTHONPATH=TREE).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

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


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=25)
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
    finally:
        sim.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
