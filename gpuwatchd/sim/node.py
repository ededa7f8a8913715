"""A simulated node: the scenario's timeline rendered as a fake NVML and real-format trees."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

from gpuwatchd.scheduler import name_os_thread
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm import SimDcgm
from gpuwatchd.sim.fake_nvml import DRIVER_COSTS, FREE, make_pynvml
from gpuwatchd.sim.probe import SimProbeReceiver
from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sim.sysfs import SysfsWriter
from gpuwatchd.sim.writers.cpu import CpuWriter
from gpuwatchd.sim.writers.cpufreq import CpufreqWriter
from gpuwatchd.sim.writers.disks import DiskstatsWriter
from gpuwatchd.sim.writers.infiniband import InfinibandWriter
from gpuwatchd.sim.writers.interrupts import InterruptsWriter
from gpuwatchd.sim.writers.kmsg import SimKmsg
from gpuwatchd.sim.writers.processes import ProcessesWriter
from gpuwatchd.sim.writers.procio import ProcIoWriter
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
    directory that `tick()` keeps in step with the timeline. In real time the fake NVML
    costs what a real driver does (`DRIVER_COSTS`); in virtual time it costs nothing, so
    replays run as fast as the CPU allows.
    """

    def __init__(
        self,
        scenario: Scenario,
        virtual: bool,
        loop: bool = False,
        start_at: float = 0.0,
        ptrace: bool = True,
    ) -> None:
        self.scenario = scenario
        self.timeline = Timeline(scenario, loop=loop)
        self.clock = SimClock(virtual=virtual, start_at=start_at)
        self.root = Path(tempfile.mkdtemp(prefix=f"gpuwatchd-sim-{scenario.name}-", dir=_TMPFS))
        costs = FREE if virtual else DRIVER_COSTS
        nvml = scenario.node.nvml
        self.pynvml = make_pynvml(
            self.timeline,
            self.clock,
            costs=costs,
            library=nvml != "no_library",
            driver_loaded=nvml != "driver_not_loaded",
        )
        self.dcgm = SimDcgm(self.timeline, self.clock, self.root)  # bindings under root/usr
        self.probe = SimProbeReceiver(self.timeline, self.clock.now, self.clock.elapsed)
        proc, sys = self.root / "proc", self.root / "sys"
        interrupts = InterruptsWriter(proc, self.timeline)
        # ptrace: the daemon may read other users' ptrace-gated /proc files (root, or
        # CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH); False models the shipped unit and
        # DaemonSet (docs/deploy.md)
        processes = ProcessesWriter(proc, sys, self.timeline, ptrace=ptrace)
        # /dev/kmsg: refused to the daemon without CAP_SYSLOG (as shipped) where
        # kernel.dmesg_restrict=1; the opt-in privileges (ptrace) include CAP_SYSLOG
        permitted = ptrace or not scenario.node.dmesg_restrict
        self.kmsg = SimKmsg(proc, self.timeline, permitted=permitted)
        # in tick order (/proc/stat's intr line sums what the interrupts writer wrote),
        # each with the sources that read its files and whether it keeps counters (rising
        # between writes: SysfsWriter's files only show the state at the time)
        self._writers: list[tuple[Writer, frozenset[str], bool]] = [
            (SysfsWriter(sys, self.timeline), frozenset({"pcie"}), False),
            (interrupts, frozenset({"interrupts", "cpu"}), True),
            (CpuWriter(proc, self.timeline, interrupts=interrupts), frozenset({"cpu"}), True),
            (CpufreqWriter(sys, self.timeline), frozenset({"cpu"}), False),
            (DiskstatsWriter(proc, self.timeline, sysfs=sys), frozenset({"disks"}), True),
            (InfinibandWriter(sys, self.timeline), frozenset({"infiniband"}), True),
            (processes, frozenset({"processes"}), True),
            # after the processes writer: it makes (and removes) the pid directories
            (ProcIoWriter(proc, self.timeline, processes), frozenset({"processes"}), True),
            # its lines wait in the ring until the source reads: written when it is due
            (self.kmsg, frozenset({"kmsg"}), False),
        ]
        self._written: dict[int, float] = {}  # writer (its index) -> when it last wrote
        self._ticker: threading.Thread | None = None  # start(): the real-time tick thread
        self._stopped = threading.Event()
        self.tick()

    def context(self) -> Context:
        fake = self.pynvml._gpuwatchd_fake
        return Context(
            procfs=self.root / "proc",
            sysfs=self.root / "sys",
            pynvml=self.pynvml,
            # the node's clocks: wall time for timestamps, elapsed (monotonic) for rates
            extras={
                "now": self.clock.now,
                "clock": self.clock.elapsed,
                "probe_receiver": self.probe,  # the kernel's side of the probe socket
                "kmsg_open": self.kmsg.open,  # the node's /dev/kmsg
                "user_name": self.scenario.node.host.user_name,  # the node's user database
                # virtual time: the nvml source stops waiting for a call that blocks at once
                **({"nvml_wait": fake.wait_for} if self.clock.virtual else {}),
                **self.dcgm.context_extras(),  # rootfs, dcgm_hostengine, hostname
            },
        )

    def tick(self, due: Collection[str] | None = None) -> None:
        """Bring the written trees up to the clock's time.

        With `due` (the sources about to poll), only the files they read: a writer
        whose readers are not due is left behind while the host's values stay the same
        since it last wrote, as its counters then rise at the rates they had, and
        written (its counters brought up to now) as soon as one changes. What a source
        reads is the same as with every writer written at every tick.
        """
        t = self.clock.elapsed()
        if self.clock.virtual:  # NVML calls blocked on a hung GPU see the new time
            self.pynvml._gpuwatchd_fake.settle()
        for i, (writer, readers, counters) in enumerate(self._writers):
            last = self._written.get(i)
            if due is None or last is None or not readers.isdisjoint(due):
                pass
            elif not counters or self.timeline.constant(last, t, gpus=False):
                continue
            writer.write(t)
            self._written[i] = t

    def start(self) -> None:
        """Real time: keep the trees in step with the clock, every second, from a thread
        of the node's own (named gpuwatchd-sim: it plays the kernel, not the daemon, and a
        benchmark of the daemon leaves its CPU out)."""
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_forever, name="sim", daemon=True)
            self._ticker.start()

    def _tick_forever(self) -> None:
        name_os_thread("gpuwatchd-sim")
        while not self._stopped.wait(1.0 - time.monotonic() % 1.0):
            self.tick()

    def close(self) -> None:
        self._stopped.set()
        self.pynvml._gpuwatchd_fake.release()  # no thread stays blocked in a hung GPU
        if self._ticker is not None:
            self._ticker.join(5)
        self.dcgm.close()
        shutil.rmtree(self.root, ignore_errors=True)
