"""The node's CPUs by NUMA node, for the cpu source's aggregates.

Per-core series cost the fleet's Prometheus a series per core and family (256 on a
256-CPU node, and node_exporter already exports per-CPU time): by default the cpu source
exports them per NUMA node instead, where a GPU's feeding threads and its interrupts
belong. `/sys/devices/system/node/nodeN/cpulist` (the kernel's cpulist format) says
which cores a node has; a kernel without NUMA (or a container without that sysfs) shows
no such directory, and every core is node 0.
"""

from __future__ import annotations

import os
import re

from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.sources.base import read_small

BUSY = gauge(
    "cpu_numa_busy_ratio",
    "Share of the last interval the NUMA node's cores were busy (their average).",
    ("numa_node",),
    budget=2,
)
INTERRUPTS = gauge(
    "cpu_numa_interrupt_ratio_max",
    "Interrupt (irq + softirq) share of the NUMA node's core that spent the most time in "
    "interrupt handlers over the last interval.",
    ("numa_node",),
    export="detail",
)
METRICS = (BUSY, INTERRUPTS)
_NODE = re.compile(r"node([0-9]+)")


def numa_nodes(sysfs: str) -> dict[int, str]:
    """Core -> its NUMA node's number (as text); {} where sysfs shows no NUMA nodes."""
    # here, not at the top: the processes package imports the cpu source's parsers
    from gpuwatchd.sources.processes.procfs import parse_cpulist

    base = os.path.join(sysfs, "devices/system/node")
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    out: dict[int, str] = {}
    for name in names:
        match = _NODE.fullmatch(name)
        if match is None:
            continue
        try:
            cpus = parse_cpulist(read_small(os.path.join(base, name, "cpulist")).decode())
        except (OSError, ValueError):
            continue
        out.update(dict.fromkeys(cpus, match.group(1)))
    return out


class NumaNodes:
    """The cpu source's per-node aggregates, for the cores of `numa_nodes`."""

    def __init__(self, node_of: dict[int, str]) -> None:
        self.node_of = node_of
        # the last poll's cores and, per node (by name), their positions among them
        self._cores: list[int] = []
        self._groups: list[tuple[str, list[int]]] = []

    def aggregates(self, cores: list[int], busy: list[float], irq: list[float]) -> list[Sample]:
        """Per NUMA node, its cores' mean busy ratio and largest interrupt ratio, from each
        core's (in `cores`) busy and interrupt ratios; a core sysfs does not place counts
        as node 0."""
        if cores != self._cores:  # the first poll, or CPU hot-plug
            positions: dict[str, list[int]] = {}
            for i, cpu in enumerate(cores):
                positions.setdefault(self.node_of.get(cpu, "0"), []).append(i)
            self._cores, self._groups = list(cores), sorted(positions.items())
        means = [
            Sample(BUSY.name, (node,), sum(map(busy.__getitem__, at)) / len(at))
            for node, at in self._groups
        ]
        return means + [
            Sample(INTERRUPTS.name, (node,), max(0.0, *map(irq.__getitem__, at)))
            for node, at in self._groups
        ]
