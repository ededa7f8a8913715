"""The simulator's /proc/stat, /proc/pressure/*, /proc/meminfo, /proc/vmstat and kswapd.

`CpuWriter(root, timeline).write(t)` writes, under `root`, in the kernel's formats:

* `stat` (fs/proc/stat.c): `cpu  ` + the node's sums, one `cpuN` line per CPU
  (`user nice system idle iowait irq softirq steal guest guest_nice`, USER_HZ = 100
  ticks), then `intr`, `ctxt`, `btime`, `processes`, `procs_running`, `procs_blocked`,
  `softirq`. A core's ticks per second are its percentages: busy from
  `core_busy_percent[cpu]`, else `cpu_busy_percent` (split 84 % user, 1 % nice, 12 %
  system, 1 % irq, 2 % softirq), `core_iowait_percent[cpu]`, else `iowait_percent`,
  `steal_percent`, the rest idle (when
  they add up to more than 100, steal is kept first, then interrupt time, then busy,
  then iowait). The source reads busy back as (busy + steal) / 100: steal counts as
  busy there. Interrupt handling costs the CPU it lands on: each device interrupt per
  second that the interrupts writer puts on a CPU adds `IRQ_COST_US` of its class to
  that core's `irq` (hard handler) and `softirq` (NAPI poll, block completion) columns,
  and `core_softirq_percent[cpu]` adds softirq time directly; that time is taken from
  the core's busy time first (the handlers preempt the task), then from idle.
  The `intr` line has the per-IRQ totals of an `InterruptsWriter` when one is given,
  else zeros for the node's nr_irqs.
* `pressure/cpu`, `pressure/io`, `pressure/memory` (kernel/sched/psi.c, 5.13+: cpu has
  a `full` line too, always zero at the system level): avg10 is the scenario's
  `psi_<resource>_<kind>` percent; avg60 and avg300 follow it by exponential smoothing
  over 60 s and 300 s (starting settled at the first write); total (microseconds)
  integrates the percent. Averages print as the kernel does, truncated to 2 decimals.
* `meminfo` (fs/proc/meminfo.c, `%-16s%8lu kB` rows): MemTotal from
  `node.host.memory_total_mib`, MemAvailable from `mem_available_mib` (default 90 % of
  the total), SwapTotal from `node.host.swap_total_mib` (default: 32 GiB where the
  scenario swaps, else 0) and SwapFree from `swap_free_mib` (default: SwapTotal less the
  pages swapped out and not read back, pswpout - pswpin, within 0..SwapTotal), the
  other rows derived from those.
* `vmstat` (mm/vmstat.c, `name value` rows, a subset in the kernel's order): `pswpin` /
  `pswpout` count pages (the host's page size) at `swap_in_mb_s` / `swap_out_mb_s`, each
  swapped-in page also a page of `pgpgin` (KiB read from block devices); `pgmajfault`
  rises by the larger of the swap-ins and the processes' major faults summed.
* `<pid>/stat` of one `kswapdN` kernel thread per NUMA node (pids `KSWAPD_PID` + N,
  kthreadd's child: ppid 2, PF_KTHREAD), sharing `kswapd_cpu_percent` of a core equally.

Counters integrate with `Integrator` over the writer's time. Cores that have always had
the same load share one set of jiffy counters (a 128-CPU node at one load is one group);
a group splits, carrying its past, when a phase gives some of its cores another load.
Only a changed file is written, through a temporary file and `os.replace`.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline
from gpuwatchd.sim.writers.interrupts import InterruptsWriter, nr_irqs
from gpuwatchd.sim.writers.processes import stat_line
from gpuwatchd.sim.writers.psi import psi_fixed, psi_line
from gpuwatchd.sources.interrupts import IrqLine, classify
from gpuwatchd.sources.reclaim import PAGE_SIZE

USER_HZ = 100
BTIME = 1_700_000_000
# how a busy core's time splits over user, nice, system, irq, softirq
BUSY_SPLIT = ((0, 0.84), (1, 0.01), (2, 0.12), (5, 0.01), (6, 0.02))
IDLE, IOWAIT, STEAL = 3, 4, 7
NCOLUMNS = 10  # user nice system idle iowait irq softirq steal guest guest_nice
SOFTIRQS = (
    "HI",
    "TIMER",
    "NET_TX",
    "NET_RX",
    "BLOCK",
    "IRQ_POLL",
    "TASKLET",
    "SCHED",
    "HRTIMER",
    "RCU",
)
# per CPU per second at idle and extra at full load
SOFTIRQ_RATES = {
    "TIMER": (50.0, 200.0),
    "NET_RX": (1.0, 20.0),
    "BLOCK": (0.5, 5.0),
    "SCHED": (20.0, 100.0),
    "RCU": (20.0, 50.0),
    "NET_TX": (0.1, 1.0),
}
# microseconds of (hard handler, softirq) per device interrupt, by class: a NIC vector's
# interrupt schedules a NAPI poll that processes a batch of packets (the bulk of its
# cost); an NVMe completion runs the BLOCK softirq; the GPU's handler is short
IRQ_COST_US = {
    "nic": (1.5, 12.0),
    "nvme": (1.0, 2.0),
    "nvidia": (3.0, 0.0),
    "usb": (2.0, 1.0),
    "other": (2.0, 1.0),
}
PSI_FILES = (
    ("cpu", (("some", "psi_cpu_some"), ("full", None))),
    ("io", (("some", "psi_io_some"), ("full", "psi_io_full"))),
    ("memory", (("some", "psi_memory_some"), ("full", "psi_memory_full"))),
)


PAGE = PAGE_SIZE  # the simulated kernel's pages are the host's, as the reader assumes
KSWAPD_PID = 170  # kswapd0's pid; kswapdN is KSWAPD_PID + N (kernel threads start low)
VMSTAT_ROWS = (  # (row, its constant part, its counter key or None)
    ("nr_free_pages", 8_000_000, None),
    ("nr_inactive_anon", 1_200_000, None),
    ("nr_active_anon", 9_000_000, None),
    ("nr_inactive_file", 4_000_000, None),
    ("nr_active_file", 6_000_000, None),
    ("pgpgin", 91_000_000, "pgpgin"),
    ("pgpgout", 310_000_000, None),
    ("pswpin", 0, "pswpin"),
    ("pswpout", 0, "pswpout"),
    ("pgfault", 2_400_000_000, "pgfault"),
    ("pgmajfault", 310_000, "pgmajfault"),
    ("pgsteal_kswapd", 0, "pswpout"),
    ("pgscan_kswapd", 0, "pswpout"),
)


def vmstat_text(counters: Mapping[Any, float]) -> str:
    return "".join(
        f"{row} {base + int(counters.get(('vm', key), 0.0)) if key else base}\n"
        for row, base, key in VMSTAT_ROWS
    )


def meminfo_text(total_kb: int, available_kb: int, swap_kb: int = 0, swap_free_kb: int = 0) -> str:
    """A 5.x x86-64 /proc/meminfo for a node with this much memory and availability."""
    swap_free_kb = max(0, min(swap_free_kb, swap_kb))
    available_kb = max(0, min(available_kb, total_kb))
    used_kb = total_kb - available_kb
    free_kb = available_kb * 6 // 10
    cached_kb = available_kb * 35 // 100
    buffers_kb = available_kb * 2 // 100
    anon_kb = used_kb * 9 // 10
    slab_kb = max(0, used_kb - anon_kb)
    rows: list[tuple[str, int, bool]] = [
        ("MemTotal", total_kb, True),
        ("MemFree", free_kb, True),
        ("MemAvailable", available_kb, True),
        ("Buffers", buffers_kb, True),
        ("Cached", cached_kb, True),
        ("SwapCached", (swap_kb - swap_free_kb) // 50, True),
        ("Active", anon_kb // 2 + cached_kb // 2, True),
        ("Inactive", anon_kb - anon_kb // 2 + cached_kb - cached_kb // 2, True),
        ("Active(anon)", anon_kb // 2, True),
        ("Inactive(anon)", anon_kb - anon_kb // 2, True),
        ("Active(file)", cached_kb // 2, True),
        ("Inactive(file)", cached_kb - cached_kb // 2, True),
        ("Unevictable", 0, True),
        ("Mlocked", 0, True),
        ("SwapTotal", swap_kb, True),
        ("SwapFree", swap_free_kb, True),
        ("Dirty", 1024, True),
        ("Writeback", 0, True),
        ("AnonPages", anon_kb, True),
        ("Mapped", cached_kb // 10, True),
        ("Shmem", cached_kb // 20, True),
        ("KReclaimable", slab_kb // 2, True),
        ("Slab", slab_kb, True),
        ("SReclaimable", slab_kb // 2, True),
        ("SUnreclaim", slab_kb - slab_kb // 2, True),
        ("KernelStack", 65536, True),
        ("PageTables", anon_kb // 500, True),
        ("NFS_Unstable", 0, True),
        ("Bounce", 0, True),
        ("WritebackTmp", 0, True),
        ("CommitLimit", total_kb // 2, True),
        ("Committed_AS", used_kb + used_kb // 4, True),
        ("VmallocTotal", 34359738367, True),
        ("VmallocUsed", 524288, True),
        ("VmallocChunk", 0, True),
        ("Percpu", 262144, True),
        ("HardwareCorrupted", 0, True),
        ("AnonHugePages", anon_kb // 4, True),
        ("ShmemHugePages", 0, True),
        ("ShmemPmdMapped", 0, True),
        ("FileHugePages", 0, True),
        ("FilePmdMapped", 0, True),
    ]
    lines = [f"{name + ':':<16}{value:8d} kB\n" for name, value, _ in rows]
    lines += [
        "HugePages_Total:       0\n",
        "HugePages_Free:        0\n",
        "HugePages_Rsvd:        0\n",
        "HugePages_Surp:        0\n",
        f"{'Hugepagesize:':<16}{2048:8d} kB\n",
        f"{'Hugetlb:':<16}{0:8d} kB\n",
        f"{'DirectMap4k:':<16}{1048576:8d} kB\n",
        f"{'DirectMap2M:':<16}{total_kb // 2:8d} kB\n",
        f"{'DirectMap1G:':<16}{total_kb - total_kb // 2:8d} kB\n",
    ]
    return "".join(lines)


def core_split(
    busy: float, iowait: float, steal: float, irq: float = 0.0, softirq: float = 0.0
) -> list[float]:
    """Ticks per second of each /proc/stat column for a core at these percentages;
    `irq` and `softirq` are interrupt time on top of the busy split's own."""
    steal = max(0.0, min(100.0, steal))
    irq = max(0.0, min(100.0 - steal, irq))
    softirq = max(0.0, min(100.0 - steal - irq, softirq))
    busy = max(0.0, min(100.0 - steal - irq - softirq, busy))
    iowait = max(0.0, min(100.0 - steal - irq - softirq - busy, iowait))
    scale = USER_HZ / 100
    columns = [0.0] * NCOLUMNS
    for column, share in BUSY_SPLIT:
        columns[column] = busy * share * scale
    columns[5] += irq * scale
    columns[6] += softirq * scale
    columns[IOWAIT] = iowait * scale
    columns[STEAL] = steal * scale
    columns[IDLE] = max(0.0, 100.0 - busy - iowait - steal - irq - softirq) * scale
    return columns


def swap_total_kb(timeline: Timeline) -> int:
    """SwapTotal: the node's `swap_total_mib`, else 32 GiB where the scenario swaps."""
    scenario = timeline.scenario
    total = scenario.node.host.swap_total_mib
    if total is None:
        values = [scenario.node.initial_host, *(p.host for p in scenario.phases)]
        swaps = any((v.swap_in_mb_s or 0) > 0 or (v.swap_out_mb_s or 0) > 0 for v in values)
        swaps |= any(k.startswith("swap_") for p in scenario.phases for k in p.host_ramp)
        total = 32768 if swaps else 0
    return int(total * 1024)


class CpuWriter:
    """Writes and updates `<root>/stat`, `<root>/pressure/*` and `<root>/meminfo`."""

    def __init__(
        self, root: Path, timeline: Timeline, interrupts: InterruptsWriter | None = None
    ) -> None:
        self.root = Path(root)
        self.timeline = timeline
        self.interrupts = interrupts
        node = timeline.scenario.node
        self.ncpus = node.cpus
        self.numa_nodes = node.numa_nodes
        self.memory_total_kb = int(node.host.memory_total_mib * 1024)
        self.swap_total_kb = swap_total_kb(timeline)
        self._jiffies = Integrator()
        self._counters = Integrator()  # ctxt, processes, softirqs, PSI totals
        self._avgs: dict[tuple[str, str], tuple[float, float, float]] = {}  # avg60, avg300, value
        self._last_t: float | None = None
        self._host: dict[str, Any] | None = None  # the host state the rates below are for
        self._counter_rates: dict[Any, float] = {}
        self._busy_cpus = 0.0
        # Cores with the same history share their counters: a group of CPUs, its column
        # rates now, and Integrator keys (group, column). A group splits when its cores'
        # rates diverge; groups never merge (their pasts differ).
        self._groups: dict[int, list[int]] = {0: list(range(self.ncpus))}
        self._group_rates: dict[int, tuple[float, ...]] = {}
        self._next_group = 1
        self.files = Files()
        self._nr_irqs = nr_irqs(self.ncpus)
        self._labels = [f"cpu{c}" for c in range(self.ncpus)]
        self._classes: dict[int, str] = {}  # interrupt row -> its class

    @property
    def writes(self) -> int:
        """Files written so far (changed content only)."""
        return self.files.writes

    def write(self, t: float) -> int:
        """Bring the files to the node's state at time t; returns how many changed."""
        host = self.timeline.host_state(t)
        before = self.writes
        dt = 0.0 if self._last_t is None else max(0.0, t - self._last_t)
        if self._last_t is None or t >= self._last_t:
            self._last_t = t
        self._jiffies.advance(t, self._jiffy_rates())  # up to t at the rates in force
        if self._host != host:
            self._regroup(host)
            self._jiffies.advance(t, self._jiffy_rates())  # no time passes: new rates
            self._counter_rates = self.counter_rates(host, self._busy_cpus)
            self._host = copy.deepcopy(host)
        jiffies = self._jiffies.totals
        counters = self._counters.advance(t, self._counter_rates)
        os.makedirs(self.root / "pressure", exist_ok=True)
        self.files.put(
            os.path.join(self.root, "stat"), self._stat(jiffies, counters, host, self._busy_cpus)
        )
        for resource, kinds in PSI_FILES:
            lines = []
            for kind, key in kinds:
                value = float(host.get(key) or 0.0) if key else 0.0
                avg60, avg300 = self._smooth(resource, kind, value, dt)
                total = int(counters.get(("psi", resource, kind), 0.0))
                lines.append(psi_line(kind, value, avg60, avg300, total))
            self.files.put(os.path.join(self.root, f"pressure/{resource}"), "".join(lines))
        available = host.get("mem_available_mib")
        available_kb = (
            self.memory_total_kb * 9 // 10 if available is None else int(available * 1024)
        )
        swap_free = host.get("swap_free_mib")
        if swap_free is None:  # what was swapped out and not read back is in use
            pages = counters.get(("vm", "pswpout"), 0.0) - counters.get(("vm", "pswpin"), 0.0)
            swap_free_kb = self.swap_total_kb - int(pages * PAGE / 1024)
        else:
            swap_free_kb = int(swap_free * 1024)
        meminfo = meminfo_text(self.memory_total_kb, available_kb, self.swap_total_kb, swap_free_kb)
        self.files.put(os.path.join(self.root, "meminfo"), meminfo)
        self.files.put(os.path.join(self.root, "vmstat"), vmstat_text(counters))
        self._kswapd(counters, host)
        return self.writes - before

    def _kswapd(self, counters: Mapping[Any, float], host: Mapping[str, Any]) -> None:
        busy = float(host.get("kswapd_cpu_percent") or 0.0) / self.numa_nodes >= 50
        for node in range(self.numa_nodes):
            pid = KSWAPD_PID + node
            ticks = math.floor(counters.get(("kswapd", node), 0.0))
            os.makedirs(self.root / str(pid), exist_ok=True)
            line = stat_line(
                pid, f"kswapd{node}", "R" if busy else "S", 2, 0, ticks, 1, 39, 0,
                majflt=0, kthread=True,
            )
            self.files.put(os.path.join(self.root, f"{pid}/stat"), line)

    def _jiffy_rates(self) -> Mapping[Hashable, float]:
        return {
            (group, column): rate
            for group, rates in self._group_rates.items()
            for column, rate in enumerate(rates)
            if rate
        }

    def _regroup(self, host: Mapping[str, Any]) -> None:
        """Column rates of every core at `host`; split the groups whose cores diverge."""
        busy_all = float(host.get("cpu_busy_percent") or 0.0)
        core_busy = host.get("core_busy_percent") or {}
        iowait_all = float(host.get("iowait_percent") or 0.0)
        core_iowait = host.get("core_iowait_percent") or {}
        steal = float(host.get("steal_percent") or 0.0)
        interrupt_time = self.interrupt_percent(host)
        splits: dict[tuple[float, float, float, float], tuple[float, ...]] = {}
        totals = self._jiffies.totals
        groups: dict[int, list[int]] = {}
        self._group_rates = {}
        self._busy_cpus = 0.0
        for group, members in self._groups.items():
            by_rates: dict[tuple[float, ...], list[int]] = {}
            for cpu in members:
                busy = float(core_busy.get(cpu, busy_all))
                iowait = float(core_iowait.get(cpu, iowait_all))
                hard, soft = interrupt_time.get(cpu, (0.0, 0.0))
                columns = splits.get((busy, iowait, hard, soft))
                if columns is None:
                    columns = splits[(busy, iowait, hard, soft)] = tuple(
                        core_split(busy, iowait, steal, hard, soft)
                    )
                by_rates.setdefault(columns, []).append(cpu)
            for k, (columns, cpus) in enumerate(by_rates.items()):
                gid = group
                if k:  # a new group starts from its cores' shared past
                    gid, self._next_group = self._next_group, self._next_group + 1
                    for column in range(NCOLUMNS):
                        totals[(gid, column)] = totals.get((group, column), 0.0)
                groups[gid] = cpus
                self._group_rates[gid] = columns
                self._busy_cpus += len(cpus) * sum(columns[c] for c, _ in BUSY_SPLIT) / USER_HZ
        self._groups = groups

    def interrupt_percent(self, host: Mapping[str, Any]) -> dict[int, tuple[float, float]]:
        """cpu -> (hardirq, softirq) percent of its time that interrupts cost it."""
        result: dict[int, list[float]] = {}
        if self.interrupts is not None:
            rows = self.interrupts.rows
            for (i, cpus), rate in self.interrupts.rates(host).items():
                row = rows[i]
                if not row.label.isdigit():
                    continue  # LOC, RES, ...: in the busy split's own irq share
                cls = self._classes.get(i)
                if cls is None:
                    cls = self._classes[i] = classify(IrqLine(row.label, (), name=row.name))
                hard, soft = IRQ_COST_US.get(cls, IRQ_COST_US["other"])
                per_cpu = rate / len(cpus) * 1e-4  # interrupts/s x µs -> percent
                for cpu in cpus:
                    cell = result.setdefault(cpu, [0.0, 0.0])
                    cell[0] += per_cpu * hard
                    cell[1] += per_cpu * soft
        for cpu, percent in (host.get("core_softirq_percent") or {}).items():
            if 0 <= int(cpu) < self.ncpus:
                result.setdefault(int(cpu), [0.0, 0.0])[1] += float(percent)
        # to 0.1 %: background rates (a few per second) cost nothing visible, and cores
        # that differ by less keep sharing one set of counters
        rounded = {cpu: (round(h, 1), round(s, 1)) for cpu, (h, s) in result.items()}
        return {cpu: hs for cpu, hs in rounded.items() if hs != (0.0, 0.0)}

    def counter_rates(self, host: Mapping[str, Any], busy_cpus: float) -> dict[Any, float]:
        n = self.ncpus
        rates: dict[Any, float] = {
            "ctxt": n * 200.0 + busy_cpus * 2000.0,
            "processes": 20.0,
        }
        for name in SOFTIRQS:
            idle, extra = SOFTIRQ_RATES.get(name, (0.0, 0.0))
            rates[("softirq", name)] = n * idle + busy_cpus * extra
        for resource, kinds in PSI_FILES:
            for kind, key in kinds:
                percent = float(host.get(key) or 0.0) if key else 0.0
                rates[("psi", resource, kind)] = max(0.0, min(100.0, percent)) * 1e4  # µs/s
        swap_in = float(host.get("swap_in_mb_s") or 0.0) * 1e6 / PAGE  # pages/s
        rates[("vm", "pswpin")] = swap_in
        rates[("vm", "pswpout")] = float(host.get("swap_out_mb_s") or 0.0) * 1e6 / PAGE
        # every process's major faults are the node's too (the kernel counts each once)
        faults = sum(
            float(p.get("major_faults_per_second") or 0.0)
            + int(p.get("workers") or 0) * float(p.get("worker_major_faults_per_second") or 0.0)
            for p in (host.get("processes") or {}).values()
        )
        rates[("vm", "pgmajfault")] = 2.0 + max(swap_in, faults)
        rates[("vm", "pgpgin")] = 400.0 + swap_in * PAGE / 1024
        rates[("vm", "pgfault")] = n * 300.0 + busy_cpus * 3000.0
        kswapd = float(host.get("kswapd_cpu_percent") or 0.0) / self.numa_nodes
        for node in range(self.numa_nodes):
            rates[("kswapd", node)] = kswapd * USER_HZ / 100  # ticks/s
        return rates

    def _smooth(self, resource: str, kind: str, value: float, dt: float) -> tuple[float, float]:
        """avg60 and avg300 now: the value in force since the last write (as the kernel
        averages what happened in each period) decays into them over dt."""
        prev = self._avgs.get((resource, kind))
        if prev is None:
            avg60 = avg300 = value
        else:
            avg60_before, avg300_before, held = prev
            avg60 = held + (avg60_before - held) * math.exp(-dt / 60)
            avg300 = held + (avg300_before - held) * math.exp(-dt / 300)
        self._avgs[(resource, kind)] = (avg60, avg300, value)
        return avg60, avg300

    def _stat(
        self,
        jiffies: Mapping[Any, float],
        counters: Mapping[Any, float],
        host: Mapping[str, Any],
        busy_cpus: float,
    ) -> str:
        n = self.ncpus
        sums = [0] * NCOLUMNS
        line_of: list[str] = [""] * n
        for group, cpus in self._groups.items():
            columns = [int(jiffies.get((group, column), 0.0)) for column in range(NCOLUMNS)]
            sums = [a + b * len(cpus) for a, b in zip(sums, columns, strict=True)]
            tail = " " + " ".join(map(str, columns)) + "\n"
            for cpu in cpus:
                line_of[cpu] = tail
        lines = ["cpu  " + " ".join(map(str, sums)) + "\n"]
        lines += [label + tail for label, tail in zip(self._labels, line_of, strict=True)]
        if self.interrupts is not None:
            irqs = self.interrupts.irq_totals()
            total = sum(irqs) + self.interrupts.arch_total()
        else:
            irqs, total = [0] * self._nr_irqs, 0
        lines.append(f"intr {total} " + " ".join(map(str, irqs)) + "\n")
        iowaiting = sum(  # cores' worth of iowait: about the tasks blocked on I/O
            len(self._groups[g]) * rates[IOWAIT] for g, rates in self._group_rates.items()
        ) / USER_HZ
        softirqs = [int(counters.get(("softirq", name), 0.0)) for name in SOFTIRQS]
        lines.append(f"ctxt {int(counters.get('ctxt', 0.0))}\n")
        lines.append(f"btime {BTIME}\n")
        lines.append(f"processes {1000 + int(counters.get('processes', 0.0))}\n")
        lines.append(f"procs_running {1 + round(busy_cpus)}\n")
        lines.append(f"procs_blocked {round(iowaiting)}\n")
        lines.append(f"softirq {sum(softirqs)} " + " ".join(map(str, softirqs)) + "\n")
        return "".join(lines)


__all__ = [
    "KSWAPD_PID",
    "CpuWriter",
    "core_split",
    "meminfo_text",
    "swap_total_kb",
    "psi_fixed",
    "psi_line",
    "vmstat_text",
]
