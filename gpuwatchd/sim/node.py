"""A simulated node: the scenario's timeline rendered as a fake NVML and real-format trees."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm import SimDcgm
from gpuwatchd.sim.fake_nvml import make_pynvml
from gpuwatchd.sim.probe import SimProbeReceiver
from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sim.sysfs import SysfsWriter
from gpuwatchd.sim.writers.cpu import CpuWriter
from gpuwatchd.sim.writers.disks import DiskstatsWriter
from gpuwatchd.sim.writers.infiniband import InfinibandWriter
from gpuwatchd.sim.writers.interrupts import InterruptsWriter
from gpuwatchd.sim.writers.processes import ProcessesWriter
from gpuwatchd.sources.base import Context


class Writer(Protocol):
    """Renders the timeline at time t into files, the way the kernel would show it."""

    def write(self, t: float) -> object: ...


# The trees are rewritten every tick: keep them in memory where the machine allows.
_TMPFS = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class SimNode:
    """Everything a source can observe on the simulated node, at the clock's time.

    The sources run unchanged against it: the NVML source gets a private copy of the
    real pynvml whose C library is the fake, file sources get roots under a temporary
    directory that `tick()` keeps in step with the timeline.
    """

    def __init__(self, scenario: Scenario, virtual: bool, loop: bool = False) -> None:
        self.scenario = scenario
        self.timeline = Timeline(scenario, loop=loop)
        self.clock = SimClock(virtual=virtual)
        self.root = Path(tempfile.mkdtemp(prefix=f"gpuwatchd-sim-{scenario.name}-", dir=_TMPFS))
        self.pynvml = make_pynvml(self.timeline, self.clock)
        self.dcgm = SimDcgm(self.timeline, self.clock, self.root)  # bindings under root/usr
        self.probe = SimProbeReceiver(self.timeline, self.clock.now, self.clock.elapsed)
        proc, sys = self.root / "proc", self.root / "sys"
        interrupts = InterruptsWriter(proc, self.timeline)
        # in tick order: /proc/stat's intr line sums what the interrupts writer wrote
        self._writers: list[Writer] = [
            SysfsWriter(sys, self.timeline),
            interrupts,
            CpuWriter(proc, self.timeline, interrupts=interrupts),
            DiskstatsWriter(proc, self.timeline, sysfs=sys),
            InfinibandWriter(sys, self.timeline),
            ProcessesWriter(proc, sys, self.timeline),
        ]
        self.tick()

    def context(self) -> Context:
        return Context(
            procfs=self.root / "proc",
            sysfs=self.root / "sys",
            pynvml=self.pynvml,
            # the node's clocks: wall time for timestamps, elapsed (monotonic) for rates
            extras={
                "now": self.clock.now,
                "clock": self.clock.elapsed,
                "probe_receiver": self.probe,  # the kernel's side of the probe socket
                **self.dcgm.context_extras(),  # rootfs, dcgm_hostengine, hostname
            },
        )

    def tick(self) -> None:
        """Bring the written trees up to the clock's time."""
        t = self.clock.elapsed()
        for writer in self._writers:
            writer.write(t)

    def close(self) -> None:
        self.dcgm.close()
        shutil.rmtree(self.root, ignore_errors=True)
