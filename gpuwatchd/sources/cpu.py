"""CPU and memory of the node: /proc/stat, /proc/pressure/*, /proc/meminfo.

/proc/stat (fs/proc/stat.c): `cpu  user nice system idle iowait irq softirq steal guest
guest_nice` for the node, then one `cpuN` line per online CPU, in USER_HZ ticks. Older
kernels print fewer columns (missing ones are 0); guest time is already inside user and
nice, so it is not added again. Per poll, from the increase of every column since the
previous poll (no clock needed: the ticks are the time base):

* busy ratio of a core = (total - idle - iowait) / total, total = user + nice + system +
  idle + iowait + irq + softirq + steal. Steal counts as busy: the vCPU wanted to run,
  so a core at 50 % user + 50 % steal is as saturated as one at 100 % user.
* node iowait and steal ratios from the `cpu` line; the busiest core's ratio; how many
  cores are over `saturated_threshold` (0.9) -- "one core at 100 %, the rest idle".
* interrupt ratio of a core = (irq + softirq) / total: what hard and soft interrupt
  handlers cost it (an IRQ storm lands on the few CPUs its vectors are bound to, so a
  node-wide share hides it); per core and the largest.

A column that went backwards counts as 0 (idle and iowait are known to step back a
little on NO_HZ kernels); a core that appears or disappears (CPU hot-plug) gives no
ratio until its second poll.

/proc/pressure/{cpu,io,memory,irq} (PSI, kernel/sched/psi.c): `some avg10=0.18
avg60=0.34 avg300=0.10 total=159886802` and a `full` line. avgN / 100 becomes
`gpuwatchd_pressure_ratio{resource,kind,window}`, total (microseconds) becomes
`gpuwatchd_pressure_stalled_seconds_total{resource,kind}`. No PSI (kernel < 4.20, or
booted without `psi=1`: the directory is missing or reading gives EOPNOTSUPP) means no
pressure series, and is not an error; it is logged once.

/proc/meminfo: `MemAvailable` (kernel >= 3.14), `MemTotal`, `SwapTotal` and `SwapFree`,
in bytes.

/proc/vmstat's swap-ins and the kswapd threads' CPU: `reclaim.py`; the busy cores' clock
(sysfs cpufreq): `cpufreq.py`.

Parsers skip lines they cannot read; a file with nothing usable (no `cpu` line, no
`MemTotal`, no PSI line) raises ParseError, which fails the poll with a SourceError
naming the file.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from functools import cached_property
from itertools import compress, repeat
from operator import add, itemgetter, not_, sub, truediv

from gpuwatchd.config import CpuConfig, SourceConfig
from gpuwatchd.metrics import Sample, counter, gauge
from gpuwatchd.sources import cpufreq, numa, reclaim, register
from gpuwatchd.sources.base import (
    Context,
    Source,
    SourceError,
    read_kernel_file,
    read_text,
    settings_of,
)

log = logging.getLogger(__name__)

STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE, IOWAIT, IRQ, SOFTIRQ, STEAL = 3, 4, 5, 6, 7
PRESSURE_RESOURCES = ("cpu", "io", "memory", "irq")
PSI_WINDOWS = (("avg10", "10s"), ("avg60", "60s"), ("avg300", "300s"))
_MAX_DIGITS = 20  # a u64 has 20 digits; longer is garbage


class ParseError(ValueError):
    """A file with nothing usable in it; the message says what was missing."""


# -- parsers ------------------------------------------------------------------------------


def _uint(token: str) -> int | None:
    if token.isascii() and token.isdigit() and len(token) <= _MAX_DIGITS:
        return int(token)
    return None


@dataclass(frozen=True)
class StatReading:
    total: tuple[int, ...]  # the `cpu` line: user .. steal
    cpus: dict[int, tuple[int, ...]]  # per online CPU

    @cached_property
    def columns(self) -> tuple[tuple[int, ...], ...]:
        """`cpus` by column: columns[k][i] is column k (user .. steal) of the i-th CPU."""
        return tuple(zip(*self.cpus.values(), strict=True)) or ((),) * len(STAT_FIELDS)


# A `cpu` or `cpuN` line: its first eight columns (user .. steal) when it has them, else
# its four to seven (user nice system idle: every kernel has them); each a u64. Matched in
# one pass over the file: 128 CPUs' lines cost a tenth of splitting and checking each.
_NUMBER = f"[0-9]{{1,{_MAX_DIGITS}}}"
_STAT_LINE = re.compile(
    rf"^cpu([0-9]{{0,7}})[ \t]+("
    rf"{_NUMBER}(?:[ \t]+{_NUMBER}){{7}}(?!\S)"  # eight columns, maybe more after
    rf"|{_NUMBER}(?:[ \t]+{_NUMBER}){{3,6}}(?=[ \t]*$))",  # four to seven, the whole line
    re.M,
)
_ZEROS = (0,) * len(STAT_FIELDS)
_TOTAL_START = re.compile(r"^cpu[ \t]", re.M)


def parse_stat(text: str) -> StatReading:
    """The `cpu` and `cpuN` lines of /proc/stat; the other lines are ignored, and so is a
    `cpu` line whose first columns are not four to eight numbers."""
    rows = _STAT_LINE.findall(text)
    width = len(STAT_FIELDS)
    labels = list(map(itemgetter(0), rows))
    numbers = " ".join(map(itemgetter(1), rows)).split()
    if len(numbers) == width * len(rows):  # every line has eight (kernels since 2.6.11)
        # a column at a time: one int() pass in C each, then the lines back together
        lines = list(zip(*[map(int, numbers[k::width]) for k in range(width)], strict=True))
    else:
        lines = [_padded(tuple(map(int, columns.split()[:width]))) for _, columns in rows]
    # the lines split by label without a Python step a line: the last `cpu` line is the
    # node's, a `cpuN` line again replaces its first's value (as assigning in order does)
    totals = list(compress(lines, map(not_, labels)))
    if not totals:
        raise ParseError("no `cpu` line")
    cpus = dict(zip(map(int, filter(None, labels)), compress(lines, labels), strict=True))
    return StatReading(totals[-1], cpus)


class StatLines:
    """One read of /proc/stat whose `cpuN` lines are parsed when first asked for: a GPU
    job's few CPUs without the hundreds of others. `line(n)` is parse_stat's
    `cpus.get(n)` for the kernel's `cpu%d` lines (the last of the right form, or None)."""

    def __init__(self, text: str) -> None:
        self._text = "\n" + text  # every line after a newline
        self._lines: dict[int, tuple[int, ...] | None] = {}
        starts = _TOTAL_START.finditer(text)
        if not any(_STAT_LINE.match(text, m.start()) for m in starts):
            raise ParseError("no `cpu` line")  # as parse_stat says it

    def line(self, cpu: int) -> tuple[int, ...] | None:
        if cpu in self._lines:
            return self._lines[cpu]
        text, label, line = self._text, str(cpu), None
        at = text.rfind(f"\ncpu{label}")
        while at >= 0 and line is None:  # from the end, past cpu12 when asked for cpu1
            found = _STAT_LINE.match(text, at + 1)
            if found is not None and found.group(1) == label:
                line = _padded(tuple(map(int, found.group(2).split()[: len(STAT_FIELDS)])))
            at = text.rfind(f"\ncpu{label}", 0, at)
        self._lines[cpu] = line
        return line


def _padded(times: tuple[int, ...]) -> tuple[int, ...]:
    """An old kernel's four to seven columns, the missing ones 0."""
    return times + _ZEROS[len(times) :]


@dataclass(frozen=True)
class Pressure:
    avg10: float  # percent
    avg60: float
    avg300: float
    total: int  # microseconds stalled


def parse_pressure(text: str) -> dict[str, Pressure]:
    """`some` / `full` lines of a PSI file; a malformed line is skipped."""
    result: dict[str, Pressure] = {}
    for line in text.splitlines():
        psi = pressure_line(line)
        if psi is not None:
            result[psi[0]] = psi[1]
    if not result:
        raise ParseError("no `some` or `full` line")
    return result


# a line as the kernel prints it ("%s avg10=%lu.%02lu avg60=... avg300=... total=%llu"),
# matched whole in C; any other line is taken apart as below
_PSI_LINE = re.compile(
    r"(some|full) avg10=([0-9]{1,3}\.[0-9]{2}) avg60=([0-9]{1,3}\.[0-9]{2})"
    rf" avg300=([0-9]{{1,3}}\.[0-9]{{2}}) total=({_NUMBER})"
)


def pressure_line(line: str) -> tuple[str, Pressure] | None:
    """A PSI line's kind and values, None if it is malformed."""
    kernels = _PSI_LINE.fullmatch(line)
    if kernels is None:
        return any_pressure_line(line)
    kind, avg10, avg60, avg300, total = kernels.groups()
    avgs = (float(avg10), float(avg60), float(avg300))
    return (kind, Pressure(*avgs, int(total))) if max(avgs) <= 100 else None


def any_pressure_line(line: str) -> tuple[str, Pressure] | None:
    """`pressure_line` of a line in any spacing and order of its fields."""
    kind, _, rest = line.strip().partition(" ")
    if kind not in ("some", "full"):
        return None
    values: dict[str, str] = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if eq:
            values[key] = value
    try:
        avgs = [float(values[key]) for key, _ in PSI_WINDOWS]
        total = _uint(values["total"])
    except (KeyError, ValueError):
        return None
    if total is None or not all(math.isfinite(a) and 0 <= a <= 100 for a in avgs):
        return None
    return kind, Pressure(avgs[0], avgs[1], avgs[2], total)


def parse_meminfo(text: str) -> dict[str, int]:
    """Every `Name:   value kB` line of /proc/meminfo, in bytes (unitless counts as is)."""
    return _meminfo(text.splitlines())


# the lines a poll reads (MEMINFO_POLLED), found in C: a node's ~55 lines parsed one by
# one in Python cost more than the rest of the file's handling
MEMINFO_POLLED = ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")
_MEMINFO_POLLED = re.compile(rf"^(?:{'|'.join(MEMINFO_POLLED)}):.*$", re.M)


def polled_meminfo(text: str) -> dict[str, int]:
    """`parse_meminfo(text)` of the MEMINFO_POLLED names only (and the same ParseError)."""
    # rejoined with "\n" alone, the regex's lines are splitlines()' (\r, \x0c... too)
    return _meminfo(_MEMINFO_POLLED.findall("\n".join(text.splitlines())))


def _meminfo(lines: list[str]) -> dict[str, int]:
    result: dict[str, int] = {}
    for line in lines:
        name, colon, rest = line.partition(":")
        fields = rest.split()
        if not colon or not fields or not name or " " in name:
            continue
        value = _uint(fields[0])
        if value is None:
            continue
        if len(fields) == 2 and fields[1] == "kB":
            value *= 1024
        elif len(fields) != 1:
            continue
        result[name] = value
    if "MemTotal" not in result:
        raise ParseError("no MemTotal line")
    return result


def cpu_deltas(now: tuple[int, ...], before: tuple[int, ...]) -> list[int]:
    """Ticks each column of a cpu line took between two readings; a column that went
    backwards (a counter reset) counts as 0."""
    return [a - b if a > b else 0 for a, b in zip(now, before, strict=True)]


def cpu_ratios(
    now: tuple[int, ...], before: tuple[int, ...]
) -> tuple[float, float, float, float] | None:
    """(busy, iowait, steal, interrupts) ratios between two readings of one cpu line;
    None if no time passed. Interrupts: the share in hard (irq) and soft (softirq)
    handlers, what interrupts cost that CPU."""
    deltas = cpu_deltas(now, before)
    total = sum(deltas)
    if total <= 0:
        return None
    busy = total - deltas[IDLE] - deltas[IOWAIT]
    irq = deltas[IRQ] + deltas[SOFTIRQ]
    return busy / total, deltas[IOWAIT] / total, deltas[STEAL] / total, irq / total


def core_ratios(
    now: StatReading, before: StatReading
) -> tuple[list[int], list[float], list[float]]:
    """`cpu_ratios` of every core at once: (cores, busy ratios, interrupt ratios) of the
    cores in both readings whose time moved, in `now`'s order. Worked column by column
    (each step one C pass over all cores): a 128-CPU node costs a fifth of core by core.
    """
    cores = list(now.cpus)
    if cores == list(before.cpus):
        now_columns, before_columns = now.columns, before.columns
    else:  # CPU hot-plug: the cores in both readings
        cores = [cpu for cpu in cores if cpu in before.cpus]
        now_columns = tuple(zip(*[now.cpus[cpu] for cpu in cores], strict=True))
        before_columns = tuple(zip(*[before.cpus[cpu] for cpu in cores], strict=True))
    if not cores:
        return [], [], []
    deltas = [list(map(sub, a, b)) for a, b in zip(now_columns, before_columns, strict=True)]
    if min(map(min, deltas)) < 0:  # a column went backwards: 0, as in cpu_deltas
        deltas = [list(map(max, column, repeat(0))) for column in deltas]
    total = list(map(sum, zip(*deltas, strict=True)))
    busy = list(map(sub, total, map(add, deltas[IDLE], deltas[IOWAIT])))
    irq = list(map(add, deltas[IRQ], deltas[SOFTIRQ]))
    if not all(total):  # no time passed on a core: no ratio for it
        cores, busy, irq, total = (list(compress(x, total)) for x in (cores, busy, irq, total))
    return cores, list(map(truediv, busy, total)), list(map(truediv, irq, total))


def busy_ratio(now: tuple[int, ...], before: tuple[int, ...]) -> tuple[float, float, float] | None:
    """(busy, iowait, steal) of `cpu_ratios`."""
    ratios = cpu_ratios(now, before)
    return None if ratios is None else ratios[:3]


# -- the source -----------------------------------------------------------------------------


@register
class CpuSource(Source):
    name = "cpu"
    metrics = (
        gauge(
            "cpu_busy_ratio",
            "Share of the last interval the core was busy (not idle, not iowait; steal "
            "counts as busy).",
            ("cpu",),
            budget=0,
        ),
        # what node_exporter's node_cpu_seconds_total and node_pressure_* say: kept for the
        # rules and detail_metrics (issue 46)
        gauge(
            "cpu_busy_ratio_avg",
            "Share of the last interval the node's CPUs were busy.",
            export="detail",
        ),
        gauge(
            "cpu_busy_ratio_max",
            "Busy ratio of the busiest core over the last interval.",
            export="detail",
        ),
        gauge(
            "cpu_cores_saturated",
            "Cores busier than the saturation threshold (default 0.9) over the last interval.",
            export="detail",
        ),
        gauge("cpu_cores", "Online CPUs (cpuN lines in /proc/stat).", export="detail"),
        gauge(
            "cpu_interrupt_ratio",
            "Share of the last interval the core spent in hard and soft interrupt handlers "
            "(/proc/stat irq + softirq).",
            ("cpu",),
            budget=0,
        ),
        gauge(
            "cpu_interrupt_ratio_max",
            "Interrupt (irq + softirq) share of the core that spent the most time in "
            "interrupt handlers over the last interval.",
            export="detail",
        ),
        gauge(
            "cpu_iowait_ratio",
            "Share of the node's CPU time in iowait over the last interval.",
            export="detail",
        ),
        gauge(
            "cpu_steal_ratio",
            "Share of the node's CPU time stolen by the hypervisor.",
            export="detail",
        ),
        gauge(
            "pressure_ratio",
            "PSI: share of time some or all tasks stalled on the resource, averaged over the "
            "window (avg10/avg60/avg300 / 100).",
            ("resource", "kind", "window"),
            export="detail",
        ),
        counter(
            "pressure_stalled_seconds_total",
            "PSI: total time some or all tasks stalled on the resource.",
            ("resource", "kind"),
            export="detail",
        ),
        gauge(
            "memory_available_bytes",
            "MemAvailable: memory available for new work.",
            export="detail",
        ),
        gauge("memory_total_bytes", "MemTotal: usable physical memory.", export="detail"),
        gauge("memory_swap_total_bytes", "SwapTotal: swap space (0: none).", export="detail"),
        gauge("memory_swap_free_bytes", "SwapFree: swap space unused.", export="detail"),
        *reclaim.METRICS,
        *cpufreq.METRICS,
        *numa.METRICS,
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self.cfg = settings_of(config, CpuConfig)
        procfs = os.fspath(context.procfs)
        self.stat_path = os.path.join(procfs, "stat")
        self.meminfo_path = os.path.join(procfs, "meminfo")
        self.pressure_dir = os.path.join(procfs, "pressure")
        self._prev: StatReading | None = None
        self._labels: dict[int, tuple[str]] = {}  # a core's label values, made once
        self._psi_missing_logged = False
        self._reclaim = reclaim.Reclaim(procfs, context.extras.get("clock", time.monotonic))
        self._frequency = cpufreq.CpuFrequency(os.fspath(context.sysfs))
        self._numa = numa.NumaNodes(
            numa.numa_nodes(os.fspath(context.sysfs))
        )  # once: hot-plug is rare

    def _read_required(self, path: str) -> str:
        return read_kernel_file(path, "procfs", self.context.procfs)

    def collect(self) -> list[Sample]:
        text = self._read_required(self.stat_path)
        try:
            stat = parse_stat(text)
        except ParseError as e:
            raise SourceError(f"{self.stat_path}: not a /proc/stat file: {e}") from e
        text = self._read_required(self.meminfo_path)
        try:
            meminfo = polled_meminfo(text)
        except ParseError as e:
            raise SourceError(f"{self.meminfo_path}: not a /proc/meminfo file: {e}") from e
        samples = [Sample("gpuwatchd_cpu_cores", (), float(len(stat.cpus)))]
        samples += self._stat_samples(stat)
        samples.append(Sample("gpuwatchd_memory_total_bytes", (), float(meminfo["MemTotal"])))
        if "MemAvailable" in meminfo:
            samples.append(
                Sample("gpuwatchd_memory_available_bytes", (), float(meminfo["MemAvailable"]))
            )
        for key, name in (("SwapTotal", "swap_total"), ("SwapFree", "swap_free")):
            if key in meminfo:  # (CONFIG_SWAP=n kernels print neither)
                samples.append(Sample(f"gpuwatchd_memory_{name}_bytes", (), float(meminfo[key])))
        if self.cfg.pressure:
            samples += self._pressure_samples()
        samples += self._reclaim.samples()
        return samples

    def _stat_samples(self, stat: StatReading) -> list[Sample]:
        prev, self._prev = self._prev, stat
        if prev is None:
            return []
        samples: list[Sample] = []
        node = busy_ratio(stat.total, prev.total)
        if node is not None:
            samples.append(Sample("gpuwatchd_cpu_busy_ratio_avg", (), node[0]))
            samples.append(Sample("gpuwatchd_cpu_iowait_ratio", (), node[1]))
            samples.append(Sample("gpuwatchd_cpu_steal_ratio", (), node[2]))
        cores, busy, irq = core_ratios(stat, prev)
        if self.cfg.per_core:
            for cpu, core_busy, core_irq in zip(cores, busy, irq, strict=True):
                labels = self._labels.get(cpu)
                if labels is None:
                    labels = self._labels[cpu] = (str(cpu),)
                samples.append(Sample("gpuwatchd_cpu_busy_ratio", labels, core_busy))
                samples.append(Sample("gpuwatchd_cpu_interrupt_ratio", labels, core_irq))
        if cores:
            threshold = self.cfg.saturated_threshold
            saturated = sum(map(threshold.__lt__, busy))  # cores busier than it
            samples.append(Sample("gpuwatchd_cpu_busy_ratio_max", (), max(busy)))
            samples.append(Sample("gpuwatchd_cpu_cores_saturated", (), float(saturated)))
            samples.append(Sample("gpuwatchd_cpu_interrupt_ratio_max", (), max(irq)))
        samples += self._numa.aggregates(cores, busy, irq)
        return samples + self._frequency.samples(cores, busy)

    def _pressure_samples(self) -> list[Sample]:
        samples: list[Sample] = []
        for resource in PRESSURE_RESOURCES:
            path = os.path.join(self.pressure_dir, resource)
            try:
                text = read_text(path)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EOPNOTSUPP, errno.ENOTSUP):
                    if resource == "cpu" and not self._psi_missing_logged:
                        self._psi_missing_logged = True
                        log.info(
                            "source cpu: no PSI at %s (%s): pressure series absent",
                            path,
                            e.strerror or e,
                        )
                    continue
                raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
            try:
                lines = parse_pressure(text)
            except ParseError as e:
                raise SourceError(f"{path}: not a PSI file: {e}") from e
            for kind, psi in lines.items():
                for (_, window), value in zip(
                    PSI_WINDOWS, (psi.avg10, psi.avg60, psi.avg300), strict=True
                ):
                    samples.append(
                        Sample("gpuwatchd_pressure_ratio", (resource, kind, window), value / 100)
                    )
                samples.append(
                    Sample(
                        "gpuwatchd_pressure_stalled_seconds_total",
                        (resource, kind),
                        psi.total / 1e6,
                    )
                )
        return samples


__all__ = [
    "StatLines",
    "PRESSURE_RESOURCES",
    "CpuConfig",
    "CpuSource",
    "ParseError",
    "Pressure",
    "StatReading",
    "busy_ratio",
    "core_ratios",
    "cpu_deltas",
    "cpu_ratios",
    "parse_meminfo",
    "polled_meminfo",
    "parse_pressure",
    "parse_stat",
]
