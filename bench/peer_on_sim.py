"""Runs nvitop-exporter on a simulated node: bench/bench_vs_peer.py's peer.

Run with the peer's own virtualenv (nvitop-exporter and its pinned nvidia-ml-py):

    <peer venv>/bin/python bench/peer_on_sim.py SCENARIO SITE_PACKAGES [nvitop-exporter args]

Before nvitop is imported, the installed pynvml's C library is replaced by gpuwatchd's
fake libnvidia-ml playing SCENARIO in real time, at a real driver's costs (DRIVER_COSTS),
exactly as `gpuwatchd run --simulate` gets it. gpuwatchd's simulator comes from this
checkout, its dependencies from SITE_PACKAGES (gpuwatchd's virtualenv), both after the
peer's own packages on sys.path, so nvitop runs on its own versions. With
GPUWATCHD_SIM_NVML_STATS set, the fake writes its call count there every second.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    scenario, site_packages, *args = sys.argv[1:]
    sys.path.extend([str(Path(__file__).resolve().parents[1]), site_packages])
    import pynvml

    from gpuwatchd.sim.clock import SimClock
    from gpuwatchd.sim.fake_nvml import DRIVER_COSTS, FakeNvmlLib
    from gpuwatchd.sim.scenario import Timeline, load_scenario

    timeline = Timeline(load_scenario(scenario), loop=True)
    fake = FakeNvmlLib(pynvml, timeline, SimClock(virtual=False), costs=DRIVER_COSTS)
    pynvml.nvmlLib = fake  # what CDLL("libnvidia-ml.so.1") would have set

    from nvitop_exporter.cli import main as nvitop_exporter

    sys.argv = ["nvitop-exporter", *args]
    return int(nvitop_exporter() or 0)


if __name__ == "__main__":
    sys.exit(main())
