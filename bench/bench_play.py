"""Benchmark: the CPU one replay of a built-in scenario costs (the test suite's unit).

    python bench/bench_play.py [--repeat 3] [--profile OUT.txt] [SCENARIO ...]

Run by hand (not a test). The suite replays every built-in scenario in virtual time
through the daemon's sources, store and rules (gpuwatchd.sim.detection.play), so the
daemon's per-cycle Python is most of its time: this prints each scenario's CPU seconds
(process time, best of `--repeat`) and its simulated seconds. `--profile` writes
cProfile's 40 costliest functions (cumulative and own time) of the first scenario.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from gpuwatchd.sim.detection import play
from gpuwatchd.sim.scenario import load_scenario

DEFAULT = ["healthy-8gpu", "nccl-hang-one-rank-8xh100", "bursty-input-pipeline"]


def cpu_of(name: str) -> tuple[float, float]:
    """(CPU seconds, simulated seconds) of one replay of `name`."""
    scenario = load_scenario(name)
    start = time.process_time()
    replay = play(scenario)
    return time.process_time() - start, replay.simulated_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", default=DEFAULT)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", help="write the first scenario's profile here")
    args = parser.parse_args()
    print(f"| scenario | simulated s | CPU s (best of {args.repeat}) | ms per simulated s |")
    print("|---|---|---|---|")
    for name in args.scenarios:
        runs = [cpu_of(name) for _ in range(args.repeat)]
        cpu, simulated = min(runs)
        print(f"| {name} | {simulated:.0f} | {cpu:.2f} | {cpu / simulated * 1e3:.2f} |", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        scenario = load_scenario(args.scenarios[0])
        profile.runcall(play, scenario)
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(40)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
