"""Swapping and background reclaim, for the cpu source: /proc/vmstat and kswapd.

A node short of memory takes pages back from processes: kswapd (one kernel thread per
NUMA node) reclaims in the background, writes anonymous pages to swap, and a process
that touches one of them waits for it to be read back (a major fault). The training
job's DataLoader workers then sit in D like a job waiting on a slow disk, though its
disks are idle: `host_memory_pressure` tells the two apart with these series, PSI
memory (the cpu source) and the job's own major faults (procio).

* `/proc/vmstat` `pswpin`: pages read back from swap, as bytes per second between two
  polls (node_exporter exports the counter; the rules need the rate here, on the node).
* the kswapd threads' CPU (`/proc/<pid>/stat` utime + stime, in cores): found by one
  scan of every `/proc/<pid>/stat` for kernel threads (PF_KTHREAD) named `kswapd*` at
  the first poll (a few thousand small reads, once), again when one is gone and, where
  none was found, every `RESCAN_SECONDS`. A /proc of a container's own pid namespace
  shows no kernel thread: the series is absent there (the DaemonSet reads the host's
  /proc mount, `procfs`).
Δt comes from `context.extras["clock"]` (the simulator's) or time.monotonic. A missing
or unreadable file leaves its series out.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.sources.base import read_file
from gpuwatchd.sources.infiniband import counter_rate

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
RESCAN_SECONDS = 600.0

SWAP_IN = gauge(
    "memory_swap_in_bytes_per_second",
    "Bytes read back from swap (/proc/vmstat pswpin x page size), node-wide.",
    export="detail",
)
KSWAPD = gauge(
    "kswapd_cpu_ratio",
    "CPU of the kswapd threads (background memory reclaim), in cores.",
    export="detail",
)
METRICS = (SWAP_IN, KSWAPD)


def vmstat_value(data: bytes, name: bytes) -> int | None:
    """One counter of /proc/vmstat (`name value` lines), or None."""
    key = name + b" "
    at = 0 if data.startswith(key) else data.find(b"\n" + key) + 1
    if at == 0 and not data.startswith(key):
        return None
    value = data[at + len(key) :].split(b"\n", 1)[0].strip()
    return int(value) if value.isdigit() and len(value) <= 20 else None


PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread


def kthread_times(data: bytes, prefix: bytes) -> int | None:
    """utime + stime of a /proc/PID/stat if it is a kernel thread (the PF_KTHREAD flag:
    a process may name itself kswapd0, and pid 2 may be anything in a pid namespace)
    whose comm starts with `prefix`, else None."""
    open_, close = data.find(b"("), data.rfind(b")")
    if open_ < 0 or close < open_ or not data[open_ + 1 : close].startswith(prefix):
        return None
    rest = data[close + 2 :].split(b" ", 14)
    if len(rest) < 14 or not all(rest[i].isdigit() for i in (6, 11, 12)):
        return None
    if not int(rest[6]) & PF_KTHREAD:
        return None
    return int(rest[11]) + int(rest[12])


class Reclaim:
    """The swap-in rate and the kswapd threads' CPU between two `samples` calls."""

    def __init__(self, procfs: str, clock: Callable[[], float]) -> None:
        self._proc = procfs
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # a series' last (time, counter)
        self._kswapd: list[int] | None = None  # their pids; None: not scanned yet
        self._scanned_at = 0.0

    def samples(self) -> list[Sample]:
        now = self._clock()
        out: list[Sample] = []
        try:
            pswpin = vmstat_value(read_file(f"{self._proc}/vmstat", 1 << 16), b"pswpin")
        except OSError:
            pswpin = None
        for spec, counter, unit in (
            (SWAP_IN, pswpin, PAGE_SIZE),  # pages
            (KSWAPD, self._kswapd_ticks(now), 1 / CLK_TCK),  # ticks
        ):
            rate = self._per_second(spec.name, now, counter)
            if rate is not None:
                out.append(Sample(spec.name, (), rate * unit))
        return out

    def _per_second(self, name: str, now: float, counter: int | None) -> float | None:
        """The counter's increase per second since its last reading (None: unread now,
        the first reading, or a counter that fell)."""
        if counter is None:
            return None
        last, self._last[name] = self._last.get(name), (now, counter)
        return None if last is None else counter_rate(last[1], counter, now - last[0], False)

    def _kswapd_ticks(self, now: float) -> int | None:
        """The kswapd threads' CPU ticks summed; None where there are none to read."""
        if self._kswapd is None or (not self._kswapd and now - self._scanned_at >= RESCAN_SECONDS):
            self._scan(now)
        total = 0
        for pid in self._kswapd or ():
            try:
                ticks = kthread_times(read_file(f"{self._proc}/{pid}/stat", 4096), b"kswapd")
            except OSError:
                ticks = None
            if ticks is None:  # gone (or reused): look again next poll
                self._kswapd = None
                return None
            total += ticks
        return total if self._kswapd else None

    def _scan(self, now: float) -> None:
        self._scanned_at = now
        found: list[int] = []
        try:
            entries = os.scandir(self._proc)
        except OSError:
            self._kswapd = []
            return
        with entries:
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                try:
                    data = read_file(f"{self._proc}/{entry.name}/stat", 4096)
                except OSError:
                    continue
                if kthread_times(data, b"kswapd") is not None:
                    found.append(int(entry.name))
        self._kswapd = sorted(found)
        self._last.pop(KSWAPD.name, None)  # other threads: a new baseline
