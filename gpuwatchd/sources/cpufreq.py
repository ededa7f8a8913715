"""The clock of the node's busy cores, for the cpu source: sysfs cpufreq.

A CPU-bound thread feeding a GPU (a DataLoader without workers, a serving loop) runs as
fast as its core's clock. A BIOS power profile, a `powersave` governor capped low, a
lowered `scaling_max_freq` or a thermally throttled socket halve that clock while
/proc/stat still reads the core 100 % busy: the same starvation, a different fix.

`/sys/devices/system/cpu/cpuN/cpufreq/scaling_cur_freq` is the core's current frequency
in kHz (the driver's last reading: intel_pstate and amd-pstate average it over the last
tick), `cpuinfo_max_freq` the fastest it can run (read once per core). Only busy cores
say anything: an idle core's clock drops by design. So the ratio is the mean of
current / max over the `MAX_CORES` busiest cores at least `BUSY` busy, one file per
core and poll. Nodes without cpufreq (most VMs, `intel_pstate=disable` without a
driver) have no such files: the series is absent, which is not an error.
"""

from __future__ import annotations

import os
from itertools import compress

from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.sources.base import read_small

BUSY = 0.5  # a core at least this busy over the interval
MAX_CORES = 16  # the busiest cores read per poll: bounds the cost on a 256-CPU node

BUSY_FREQUENCY = gauge(
    "cpu_busy_frequency_ratio",
    "Current clock / maximum clock (cpufreq) averaged over the busiest cores (at most 16, "
    "at least half busy).",
    export="detail",
)
METRICS = (BUSY_FREQUENCY,)


def _khz(path: str) -> float | None:
    try:
        value = float(read_small(path, 64))
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


class CpuFrequency:
    def __init__(self, sysfs: str) -> None:
        self._base = os.path.join(sysfs, "devices/system/cpu")
        self._max: dict[int, float | None] = {}

    def samples(self, cores: list[int], busy: list[float]) -> list[Sample]:
        """The busy cores' clock ratio, from each core's (in `cores`) busy ratio this
        interval."""
        of = dict(compress(zip(cores, busy, strict=True), map(BUSY.__le__, busy)))  # the busy ones
        ratios = []
        for core in sorted(of, key=lambda c: -of[c])[:MAX_CORES]:
            folder = f"{self._base}/cpu{core}/cpufreq"
            if core not in self._max:
                self._max[core] = _khz(f"{folder}/cpuinfo_max_freq")
            fastest = self._max[core]
            current = _khz(f"{folder}/scaling_cur_freq") if fastest else None
            if fastest and current:
                ratios.append(min(1.0, current / fastest))
        if not ratios:
            return []
        return [Sample(BUSY_FREQUENCY.name, (), sum(ratios) / len(ratios))]
