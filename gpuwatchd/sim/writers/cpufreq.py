"""The simulator's cpufreq tree: each core's clock, as sysfs shows it.

`CpufreqWriter(root, timeline).write(t)` writes, under `root` (the sysfs root), one
policy per core as intel_pstate and amd-pstate lay it out:
`devices/system/cpu/cpufreq/policyN/` with `cpuinfo_max_freq`, `cpuinfo_min_freq`,
`scaling_max_freq`, `scaling_cur_freq` (kHz) and `scaling_governor`, and the link
`devices/system/cpu/cpuN/cpufreq -> ../cpufreq/policyN`. The current clock is
`core_mhz[cpu]`, else `cpu_mhz`, else the fastest (`node.host.cpu_max_mhz`); a node
whose `cpu_max_mhz` is null has no cpufreq (a VM): nothing is written.
"""

from __future__ import annotations

import os

from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline

MIN_KHZ = 800_000


class CpufreqWriter:
    def __init__(self, root: str | os.PathLike[str], timeline: Timeline) -> None:
        self.base = os.path.join(os.fspath(root), "devices/system/cpu")
        self.timeline = timeline
        node = timeline.scenario.node
        self.ncpus = node.cpus
        fastest = node.host.cpu_max_mhz
        self.max_khz = None if fastest is None else round(fastest * 1000)
        self.files = Files()
        self._laid_out = False

    @property
    def writes(self) -> int:
        return self.files.writes

    def write(self, t: float) -> int:
        """Bring every core's current clock to time t; returns how many files changed."""
        if self.max_khz is None:
            return 0
        before = self.files.writes
        if not self._laid_out:
            self._lay_out()
        host = self.timeline.host_state(t)
        node_mhz = host.get("cpu_mhz")
        per_core = host.get("core_mhz") or {}
        for cpu in range(self.ncpus):
            mhz = per_core.get(cpu, node_mhz)
            khz = self.max_khz if mhz is None else round(float(mhz) * 1000)
            self.files.put(f"{self.base}/cpufreq/policy{cpu}/scaling_cur_freq", f"{khz}\n")
        return self.files.writes - before

    def _lay_out(self) -> None:
        put = self.files.put
        for cpu in range(self.ncpus):
            policy = f"{self.base}/cpufreq/policy{cpu}"
            put(f"{policy}/cpuinfo_max_freq", f"{self.max_khz}\n")
            put(f"{policy}/cpuinfo_min_freq", f"{MIN_KHZ}\n")
            put(f"{policy}/scaling_max_freq", f"{self.max_khz}\n")
            put(f"{policy}/scaling_governor", "performance\n")
            os.makedirs(f"{self.base}/cpu{cpu}", exist_ok=True)
            link = f"{self.base}/cpu{cpu}/cpufreq"
            if not os.path.lexists(link):
                os.symlink(f"../cpufreq/policy{cpu}", link)
        self._laid_out = True
