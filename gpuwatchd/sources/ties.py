"""What other sources know that ties a kernel log line to a GPU.

The kernel log names a process by pid and an NVSwitch by its PCI address; which GPU
either concerns is known elsewhere: the processes source reads each GPU's main process
and its children (DataLoader workers), the nvml source asks NVML which PCI function
each active NVLink reaches (an NVSwitch on HGX boards). Each publishes what it read
here (`context.extras`, as the nvml source shares its process lists), and the kmsg
source looks lines up in it. Both are plain facts with a clock: no source calls another.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PIDS = "gpu_pids"  # context.extras key of the shared PidTable
NVSWITCHES = "nvswitch_links"  # context.extras key of the shared SwitchTable


@dataclass(frozen=True)
class PidOnGpu:
    bus_id: str  # the GPU's, sysfs form
    role: str  # "main": the GPU's main process; "worker": one of its children


class PidTable:
    """pid -> the GPU it works for, remembered `keep` seconds after it was last seen: a
    worker killed between two polls of the processes source is still known when the
    kernel's line about its death is read."""

    def __init__(self, keep: float = 600.0) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._pids: dict[int, tuple[PidOnGpu, float]] = {}

    def publish(self, now: float, pids: Iterable[tuple[int, PidOnGpu]]) -> None:
        with self._lock:
            for pid, where in pids:
                self._pids[pid] = (where, now)
            horizon = now - self._keep
            self._pids = {p: v for p, v in self._pids.items() if v[1] >= horizon}

    def lookup(self, pid: int) -> PidOnGpu | None:
        with self._lock:
            found = self._pids.get(pid)
        return None if found is None else found[0]


class SwitchTable:
    """NVSwitch PCI address -> the GPUs (sysfs bus ids) whose NVLinks reach it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gpus: dict[str, set[str]] = {}

    def link(self, switch: str, gpu: str) -> None:
        with self._lock:
            self._gpus.setdefault(switch, set()).add(gpu)

    def gpus(self, switch: str) -> frozenset[str]:
        with self._lock:
            return frozenset(self._gpus.get(switch, ()))


def pid_table(extras: dict[str, Any]) -> PidTable:
    table: PidTable = extras.setdefault(PIDS, PidTable())
    return table


def switch_table(extras: dict[str, Any]) -> SwitchTable:
    table: SwitchTable = extras.setdefault(NVSWITCHES, SwitchTable())
    return table
