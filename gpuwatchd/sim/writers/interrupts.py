"""The simulator's /proc/interrupts: the node's IRQ rows, counts integrated from rates.

`InterruptsWriter(root, timeline).write(t)` writes `<root>/interrupts` as an x86-64
server with interrupt remapping prints it on a 5.x kernel (kernel/irq/proc.c
`show_interrupts` + arch/x86/kernel/irq.c `arch_show_interrupts`), byte for byte:

    header      `%*s` of prec + 8 spaces, then `CPU%-8d` per CPU
    device row  `%*d: ` label, `%10u ` per CPU, ` %8s` chip, ` %*lu` hwirq,
                `-%-8s` flow handler, `  %s` action names
    summary row `%*s: ` label, `%10u ` per CPU, `  <description>`
    ERR / MIS   `%*s: %10u`

where prec is 3, or more digits when nr_irqs needs them (x86: 24 GSIs + 16 legacy +
8 per CPU + 16 per GSI, as arch_probe_nr_irqs computes for one IO-APIC).

Rows, in IRQ-number order: the legacy IO-APIC lines (timer, rtc0, acpi, i801_smbus),
one `dmarN` per NUMA node, `xhci_hcd`, per NVMe disk (nvmeXnY -> controller nvmeX)
`nvmeXq0` (admin) .. `nvmeXqN` (its `queues`), SATA disks one shared `ahci[...]` row,
per NIC its vectors (mlx5: `mlx5_async0@pci:<bus>`, `mlx5_comp0@pci:<bus>` ..; ice:
`ice-<bus>:misc`, `ice-<name>-TxRx-<q>`; virtio: `virtioN-config`, `virtioN-input.<q>`,
`virtioN-output.<q>`), one `nvidia` row per GPU; then NMI LOC SPU PMI IWI RTR RES CAL
TLB TRM THR MCE MCP, ERR, MIS, PIN NPI PIW. MSI rows carry the hwirq the kernel's
pci_msi_domain_calc_hwirq gives (vector | bus:dev.fn << 11 | domain << 27) for the
device's PCI address: the GPU's from the topology, a NIC's `bus_id` (or a made-up
address), a made-up one per disk.

Rates come from `timeline.host_state(t)["interrupts"]`, keyed by action name: an entry
applies to every row whose action name is the key, or whose name before `@` is the key
(`mlx5_comp0` matches `mlx5_comp0@pci:0000:0c:00.0` of every mlx5 NIC), or, for a
device with a PCI address, `<short name>@pci:<address>` (`nvidia@pci:0000:13:00.0`
picks one GPU's row); the most specific key wins. Summary rows match their label
(`LOC`, `RES`). `rate` is the row's total per second, spread evenly over `cpus`; without
`cpus`, over the row's own CPU (queue k of N lands on CPU k*ncpus/N, a GPU on the first
CPUs of its NUMA node, the rest on CPU 0; a summary row's rate is over every CPU). An
entry with `cpus` and no `rate` moves the row at its usual rate. Rows without an entry
run at small background rates (LOC 50/s + 200/s at full load per CPU, a few RES/CAL/TLB
per CPU, a few per second on queues and GPUs).

Counts integrate with `Integrator`, keyed by (row, the CPUs it lands on): what a set of
CPUs received is split evenly over them when printed, so a summary row costs one
counter, not one per CPU, and a row keeps its old CPUs' counts when its affinity
changes. Counts print as the kernel's `unsigned int`: they wrap at 2**32.

Only a changed file is written, through a temporary file and `os.replace`.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline
from gpuwatchd.sim.sysfs import numa_cpus

U32_MASK = 0xFFFFFFFF
_BDF = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-1][0-9a-f])\.([0-7])")
_NVME_DISK = re.compile(r"(nvme\d+)n\d+")

# (label, description, background rate per CPU) in arch_show_interrupts order (Intel)
ARCH_ROWS = (
    ("NMI", "Non-maskable interrupts", 0.1),
    ("LOC", "Local timer interrupts", None),  # follows the core's load
    ("SPU", "Spurious interrupts", 0.0),
    ("PMI", "Performance monitoring interrupts", 0.1),
    ("IWI", "IRQ work interrupts", 1.0),
    ("RTR", "APIC ICR read retries", 0.0),
    ("RES", "Rescheduling interrupts", 10.0),
    ("CAL", "Function call interrupts", 5.0),
    ("TLB", "TLB shootdowns", 2.0),
    ("TRM", "Thermal event interrupts", 0.0),
    ("THR", "Threshold APIC interrupts", 0.0),
    ("MCE", "Machine check exceptions", 0.0),
    ("MCP", "Machine check polls", 1 / 300),
)
KVM_ROWS = (
    ("PIN", "Posted-interrupt notification event"),
    ("NPI", "Nested posted-interrupt event"),
    ("PIW", "Posted-interrupt wakeup event"),
)
LOC_IDLE, LOC_BUSY = 50.0, 200.0  # local timer per CPU: idle tick + extra at full load


def msi_hwirq(bdf: str, vector: int) -> int:
    """pci_msi_domain_calc_hwirq: vector | (bus << 8 | devfn) << 11 | domain << 27."""
    match = _BDF.fullmatch(bdf)
    if match is None:
        raise ValueError(f"not a PCI address: {bdf!r}")
    domain, bus, dev, fn = (int(g, 16) for g in match.groups())
    return vector | ((bus << 8 | dev << 3 | fn) << 11) | (domain << 27)


def nr_irqs(ncpus: int, gsi_top: int = 24) -> int:
    """x86 arch_probe_nr_irqs for one IO-APIC with MSI: the kernel's IRQ table size."""
    return gsi_top + 16 + 8 * ncpus + gsi_top * 16


def irq_prec(nr: int) -> int:
    """Width of the first column: 3, or the digits nr_irqs needs (show_interrupts)."""
    prec, j = 3, 1000
    while prec < 10 and j <= nr:
        prec += 1
        j *= 10
    return prec


@dataclass
class IrqRow:
    """One row of the simulated table."""

    label: str  # "53", "LOC", "ERR"
    keys: tuple[str, ...]  # scenario keys that address it, most specific first
    background: float  # interrupts/s over its CPUs (per CPU for summary rows)
    cpus: tuple[int, ...]  # where it lands by default
    name: str = ""  # action name; a summary row's description
    chip: str = ""
    hwirq: int | None = None  # None: no irq domain (blank column)
    handler: str = "edge"  # the flow handler's name (desc->name)
    per_cpu: bool = False  # a summary row: `background` on every CPU
    single: bool = False  # ERR/MIS: one number

    def suffix(self, prec: int) -> str:
        """What follows the count columns, newline included."""
        if self.per_cpu:
            return f"  {self.name}\n"
        hwirq = "" if self.hwirq is None else str(self.hwirq)
        return f" {self.chip:>8} {hwirq:>{prec}}-{self.handler:<8}  {self.name}\n"


class InterruptsWriter:
    """Writes and updates `<root>/interrupts` for `timeline`'s node."""

    def __init__(self, root: Path, timeline: Timeline) -> None:
        self.root = Path(root)
        self.timeline = timeline
        node = timeline.scenario.node
        self.ncpus = node.cpus
        self.path = os.fspath(self.root / "interrupts")
        self.files = Files()
        self._integrator = Integrator()
        self.rows = self._layout()
        last_irq = max((int(r.label) for r in self.rows if r.label.isdigit()), default=0)
        self.nr_irqs = max(nr_irqs(self.ncpus), last_irq + 1)
        self.prec = irq_prec(self.nr_irqs)
        self._suffixes = [row.suffix(self.prec) for row in self.rows]
        self._zero = f"{0:10d} "
        self._header = " " * (self.prec + 8) + "".join(f"CPU{c:<8d}" for c in range(self.ncpus))
        self._every = tuple(range(self.ncpus))
        self._parts: list[list[tuple[tuple[int, ...], int]]] = [[] for _ in self.rows]
        self._rendered: dict[int, tuple[tuple[tuple[tuple[int, ...], int], ...], str]] = {}
        self._rates_for: tuple[dict[str, Any], dict[tuple[int, tuple[int, ...]], float]] | None = (
            None
        )
        self._matches: dict[str, list[int]] = {}
        for i, row in enumerate(self.rows):
            for key in row.keys:
                self._matches.setdefault(key, []).append(i)

    # -- layout ------------------------------------------------------------------------

    @property
    def writes(self) -> int:
        """Files written so far (changed content only)."""
        return self.files.writes

    def _layout(self) -> list[IrqRow]:
        node = self.timeline.scenario.node
        hw = node.host
        n = self.ncpus
        rows: list[IrqRow] = []

        def legacy(irq: int, pin: int, handler: str, name: str) -> None:
            # an IO-APIC line's hwirq is its pin (the PIT's IRQ 0 is wired to pin 2)
            rows.append(IrqRow(str(irq), (name,), 0.0, (0,), name, "IR-IO-APIC", pin, handler))

        legacy(0, 2, "edge", "timer")
        legacy(8, 8, "edge", "rtc0")
        legacy(9, 9, "fasteoi", "acpi")
        legacy(16, 16, "fasteoi", "i801_smbus")

        next_irq = 24

        def msi(
            name: str,
            bdf: str | None,
            vector: int,
            rate: float,
            cpus: Iterable[int],
            chip: str = "IR-PCI-MSI",
            extra_keys: tuple[str, ...] = (),
        ) -> None:
            nonlocal next_irq
            hwirq = msi_hwirq(bdf, vector) if bdf else vector
            short = name.split("@", 1)[0]
            keys = [name, *extra_keys]
            if bdf and "@" not in name:
                keys.append(f"{short}@pci:{bdf}")
            if short != name:
                keys.append(short)
            cpu_list = tuple(c for c in cpus if 0 <= c < n) or (0,)
            rows.append(
                IrqRow(str(next_irq), tuple(dict.fromkeys(keys)), rate, cpu_list, name, chip, hwirq)
            )
            next_irq += 1

        for d in range(node.numa_nodes):
            msi(f"dmar{d}", None, d, 0.0, (0,), chip="DMAR-MSI")
        msi("xhci_hcd", "0000:00:14.0", 0, 0.5, (0,))

        controllers: list[tuple[str, int]] = []
        sata = False
        for disk in hw.disks:
            m = _NVME_DISK.fullmatch(disk.name)
            if m is None:
                sata = True
            elif m.group(1) not in {c for c, _ in controllers}:
                controllers.append((m.group(1), disk.queues))
        for i, (ctrl, queues) in enumerate(controllers):
            bdf = _made_up_bdf(i, 0x08)
            msi(f"{ctrl}q0", bdf, 0, 0.0, (0,))
            for q in range(1, queues + 1):
                msi(f"{ctrl}q{q}", bdf, q, 1.0, ((q - 1) * n // queues,))
        if sata:
            msi("ahci[0000:00:17.0]", "0000:00:17.0", 0, 1.0, (0,))

        virtio = 0
        for j, nic in enumerate(hw.nics):
            bdf = nic.bus_id or _made_up_bdf(j, 0x18)
            spread = [q * n // nic.queues for q in range(nic.queues)]
            if nic.driver == "mlx5":
                msi(f"mlx5_async0@pci:{bdf}", bdf, 0, 0.1, (0,))
                for q in range(nic.queues):
                    msi(f"mlx5_comp{q}@pci:{bdf}", bdf, q + 1, 2.0, (spread[q],))
            elif nic.driver == "ice":
                msi(f"ice-{bdf}:misc", bdf, 0, 0.1, (0,))
                for q in range(nic.queues):
                    msi(f"ice-{nic.name}-TxRx-{q}", bdf, q + 1, 2.0, (spread[q],))
            else:  # virtio-net, in a VM: no interrupt remapping
                msi(f"virtio{virtio}-config", bdf, 0, 0.0, (0,), chip="PCI-MSI")
                for q in range(nic.queues):
                    msi(f"virtio{virtio}-input.{q}", bdf, 1 + 2 * q, 2.0, (spread[q],), "PCI-MSI")
                    msi(f"virtio{virtio}-output.{q}", bdf, 2 + 2 * q, 1.0, (spread[q],), "PCI-MSI")
                virtio += 1

        topology = self.timeline.topology
        for g, gpu_name in enumerate(topology.gpu_names):
            fn = topology.functions[gpu_name]
            local = numa_cpus(fn.numa_node, n, node.numa_nodes) or [0]
            msi("nvidia", fn.bdf, 0, 5.0, (local[g % len(local)],), extra_keys=(f"gpu{g}",))

        every = tuple(range(n))
        for label, description, rate in ARCH_ROWS:
            rows.append(IrqRow(label, (label,), rate or 0.0, every, description, per_cpu=True))
        for label in ("ERR", "MIS"):
            rows.append(IrqRow(label, (label,), 0.0, (), single=True))
        for label, description in KVM_ROWS:
            rows.append(IrqRow(label, (label,), 0.0, every, description, per_cpu=True))
        return rows

    # -- per tick ----------------------------------------------------------------------

    def rates(self, host: Mapping[str, Any]) -> dict[tuple[int, tuple[int, ...]], float]:
        """(row index, the CPUs it lands on) -> interrupts/s over those CPUs, spread evenly
        over them, at a host state; zero rates left out."""
        n = self.ncpus
        busy_all = float(host.get("cpu_busy_percent") or 0.0)
        core_busy = host.get("core_busy_percent") or {}
        chosen: dict[int, Mapping[str, Any]] = {}
        for key, values in (host.get("interrupts") or {}).items():
            for i in self._matches.get(str(key), ()):
                rank = self.rows[i].keys.index(str(key))
                if i not in chosen or rank < chosen[i]["_rank"]:
                    chosen[i] = {**values, "_rank": rank}
        rates: dict[tuple[int, tuple[int, ...]], float] = {}

        def add(i: int, cpus: tuple[int, ...], rate: float) -> None:
            if rate > 0:
                rates[(i, cpus)] = rates.get((i, cpus), 0.0) + rate

        for i, row in enumerate(self.rows):
            if row.single:
                continue
            entry = chosen.get(i)
            cpus = row.cpus
            if entry is not None and entry.get("cpus"):
                cpus = tuple(sorted({c for c in entry["cpus"] if 0 <= c < n})) or (0,)
            if entry is not None and entry.get("rate") is not None:
                add(i, cpus, float(entry["rate"]))
            elif row.label == "LOC":  # the tick: faster on busy cores (NO_HZ idle skips it)
                by_load: dict[float, list[int]] = {}
                for cpu in cpus:
                    by_load.setdefault(float(core_busy.get(cpu, busy_all)), []).append(cpu)
                for busy, group in by_load.items():
                    per_cpu = LOC_IDLE + LOC_BUSY * min(100.0, busy) / 100
                    add(i, tuple(group), per_cpu * len(group))
            elif row.per_cpu:
                add(i, cpus, row.background * len(cpus))
            else:
                add(i, cpus, row.background)
        return rates

    def write(self, t: float) -> int:
        """Bring the file to the node's state at time t; returns how many files changed."""
        host = self.timeline.host_state(t)
        if self._rates_for is None or self._rates_for[0] != host:
            self._rates_for = (copy.deepcopy(host), self.rates(host))
        rates = self._rates_for[1]
        totals = self._integrator.advance(t, cast("Mapping[Hashable, float]", rates))
        parts: list[list[tuple[tuple[int, ...], int]]] = [[] for _ in self.rows]
        for key, total in totals.items():
            i, cpus = cast("tuple[int, tuple[int, ...]]", key)
            parts[i].append((cpus, int(total)))
        self._parts = parts
        return int(self.files.put(self.path, self.render()))

    def counts(self, index: int) -> list[int]:
        """Per-CPU counts of row `index` as of the last write, before the u32 wrap: each
        CPU of an affinity set gets an equal share of what the set received."""
        cells = [0] * self.ncpus
        for cpus, total in self._parts[index]:
            share = total // len(cpus)
            for cpu in cpus:
                cells[cpu] += share
        return cells

    def render(self) -> str:
        prec, n, zero = self.prec, self.ncpus, self._zero
        every = self._every
        out = [self._header, "\n"]
        for i, row in enumerate(self.rows):
            parts = self._parts[i]
            if len(parts) > 1:
                parts.sort()
            key = tuple(parts)
            cached = self._rendered.get(i)
            if cached is not None and cached[0] == key:
                out.append(cached[1])
                continue
            label = f"{row.label:>{prec}}: "
            if row.single:
                text = f"{label}{sum(total for _, total in parts) & U32_MASK:10d}\n"
            elif not parts:
                text = label + zero * n + self._suffixes[i]
            elif len(parts) == 1 and parts[0][0] == every:  # the same on every CPU
                cell = f"{(parts[0][1] // n) & U32_MASK:10d} "
                text = label + cell * n + self._suffixes[i]
            elif len(parts) == 1 and len(parts[0][0]) == 1:  # one CPU (an IRQ's usual case)
                cells = [zero] * n
                cells[parts[0][0][0]] = f"{parts[0][1] & U32_MASK:10d} "
                text = label + "".join(cells) + self._suffixes[i]
            else:
                columns = "".join([f"{c & U32_MASK:10d} " for c in self.counts(i)])
                text = label + columns + self._suffixes[i]
            self._rendered[i] = (key, text)
            out.append(text)
        return "".join(out)

    def irq_totals(self) -> list[int]:
        """Per IRQ number 0 .. nr_irqs-1, its count summed over CPUs (for /proc/stat's
        `intr` line), as of the last write."""
        totals = [0] * self.nr_irqs
        for i, row in enumerate(self.rows):
            if row.label.isdigit():
                totals[int(row.label)] = sum(t // len(c) * len(c) for c, t in self._parts[i])
        return totals

    def arch_total(self) -> int:
        """What the summary rows add to `intr`'s total (x86 arch_irq_stat_cpu + ERR)."""
        return sum(
            sum(t // len(c) * len(c) for c, t in self._parts[i])
            for i, row in enumerate(self.rows)
            if not row.label.isdigit()
        )


def _made_up_bdf(index: int, base: int) -> str:
    """A PCI address for a simulated disk or NIC that the GPU topology leaves free:
    GPUs use buses 0x10-0x14, 0x30-0x34, ... of each domain; these take 0x08 + index."""
    slot, offset = divmod(index, 16 if base == 0x08 else 8)
    domain, slot = divmod(slot, 8)
    return f"{domain:04x}:{0x10 + 0x20 * slot + base + offset:02x}:00.0"


__all__ = ["ARCH_ROWS", "InterruptsWriter", "IrqRow", "irq_prec", "msi_hwirq", "nr_irqs"]
