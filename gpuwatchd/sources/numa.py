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


def aggregates(node_of: dict[int, str], ratios: dict[int, tuple[float, float]]) -> list[Sample]:
    """Per NUMA node, its cores' mean busy ratio and largest interrupt ratio, from
    core -> (busy, interrupt) ratios; a core sysfs does not place counts as node 0."""
    busy: dict[str, list[float]] = {}
    irq: dict[str, float] = {}
    for cpu, (core_busy, core_irq) in ratios.items():
        node = node_of.get(cpu, "0")
        busy.setdefault(node, []).append(core_busy)
        irq[node] = max(irq.get(node, 0.0), core_irq)
    samples = [Sample(BUSY.name, (n,), sum(v) / len(v)) for n, v in sorted(busy.items())]
    return samples + [Sample(INTERRUPTS.name, (n,), v) for n, v in sorted(irq.items())]
