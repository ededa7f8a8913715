"""Interrupt rates from /proc/interrupts, aggregated to a bounded set of series.

The kernel's table has one row per IRQ line and one count column per online CPU
(kernel/irq/proc.c `show_interrupts`, then the architecture's summary rows). Every real
shape is read:

    old x86     `  16:  328511  322879  IR-IO-APIC-fasteoi   ehci_hcd:usb1, mmc0`
    x86 >= 3.x  `  25:    1800       0   PCI-MSI 114689-edge      virtio5-req.0`
    x86 >= 6.2  ` 120:  0  0  IR-PCI-MSIX-0000:3b:00.0    0-edge      mlx5_comp0@pci:0000:3b:00.0`
    arm64 GIC   `  53:  129969327  0   ITS-MSI 65537 Edge      nvme0q1`
    summaries   `LOC:  174326351  135776678   Local timer interrupts`, `IPI0:2768808080 ...`
    one number  `ERR:          0`, `MIS:          0`, arm64 `Err:          0`

A row may have fewer count columns than the header has CPUs; its counts belong to the
first CPUs. Counts are per-CPU `unsigned int`s: they wrap at 2**32.

Rates
-----
Each poll's counts are compared with the previous poll's, per IRQ row (keyed by its
label, "53" or "LOC"), over the time between the two polls. That time comes from
`context.extras["clock"]` when the context has one (the simulator puts its virtual
clock's `elapsed` there), else from `time.monotonic`. A row new since the last poll, a
row whose action names changed (the IRQ number was reused by another device after a
hot-plug), a row whose column count changed, or a count that fell and cannot be a u32
wrap (a device re-registered) gives no rate this poll: it is the new baseline. A change
of the CPU header (CPU hot-plug) re-baselines the whole table.

Classes and series
------------------
Device rows are put in a class by their action names (the first name that matches
decides): `nvidia` (nvidia*), `nvme` (nvmeNqM queues), `nic` (mlx5_*, mlx4-*, eth*,
en[opsx]*, ice-*, i40e-*, iavf-*, ixgbe*, igb*, bnxt*, ena-*, efa*, virtioN-input/output,
...), `usb` (xhci/ehci/ohci/uhci hcd) or `other`. Summary rows (LOC, NMI, RES, CAL, TLB,
IPIn, ...) are class `system`; the one-number rows (ERR, MIS) are not rates and are
skipped. `include` / `exclude` regexes (searched, unanchored, as node_exporter's
`--collector.interrupts.name-include`) select rows by their action names, or by their
label (LOC, NMI) for summary rows; an excluded row counts nowhere.

    gpuwatchd_interrupts_per_second{class}            every class, system included
    gpuwatchd_interrupt_lines{class}                  rows per class (queues, vectors)
    gpuwatchd_interrupt_max_line_per_second{class}    busiest row of a device class
    gpuwatchd_interrupt_storm_lines{class}            rows of a device class over
                                                      `storm_threshold` (10 000/s)
    gpuwatchd_interrupt_storm_line_per_second{class,irq,action}
                                                      each such row (the busiest 8),
                                                      named as the kernel prints it
    gpuwatchd_cpu_interrupts_per_second{cpu,class}    device classes only, and only for
                                                      (CPU, class) pairs at or over
                                                      `cpu_floor` (100/s)
    gpuwatchd_interrupt_cpu_max_per_second{class}     interrupts/s of a device class on
                                                      the CPU it hits hardest

A storm starves a job where it lands, not by its total: sixteen vectors at 12 000/s
spread one per CPU cost each CPU little, one vector at 45 000/s on the CPU that feeds
the GPU costs that CPU a large share. `interrupt_cpu_max_per_second` says how
concentrated a class's interrupts are; the time they cost each CPU is /proc/stat's
irq + softirq (`cpu` source), and the job's CPUs' share of it the `processes` source's
`gpu_process_cpu_interrupt_ratio`.

A row's rate is the sum over its CPUs. The per-CPU series are bounded three ways: only
device classes (a CPU's timer ticks are not news), only pairs at or over `cpu_floor`
(kept until they fall under half of it, so a pair hovering at the floor does not flap),
and at most `max_cpu_series` pairs, the busiest first. That is enough to see "the NIC's
interrupts all land on CPU 0, where the training process runs" without exporting the raw
CPU x IRQ table, which node_exporter's interrupts collector already does.

Cost: a row whose text did not change since the last poll (an idle queue) is not parsed
again and contributes no work; only changed rows are split and subtracted. A row that
moved on many CPUs (LOC, RES, ...) keeps its counts as ints for the next poll, so each
count is converted once; a summary row is summed, not split by CPU. The rows' classes
(and the `interrupt_lines` series) are worked out again only when a row's label or
action names change.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_, is_not, itemgetter, ne, sub
from typing import NamedTuple, cast

from gpuwatchd.config import InterruptsConfig, SourceConfig
from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError, read_kernel_file, settings_of

log = logging.getLogger(__name__)

DEVICE_CLASSES = ("nvidia", "nvme", "nic", "usb", "other")
SYSTEM = "system"
CLASSES = (*DEVICE_CLASSES, SYSTEM)

U32 = 1 << 32
# A per-CPU count that fell is read as a u32 wrap only if the wrapped delta means at
# most this many interrupts per second on that CPU; anything more is a reset.
MAX_RATE_PER_CPU = 5_000_000.0
MAX_STORM_SERIES = 8  # storm rows exported by name, the busiest: the series stay bounded
_MAX_DIGITS = 20  # a u64 has 20 digits; longer is garbage

_CLASS_RULES = (
    ("nvidia", re.compile(r"nvidia")),
    ("nvme", re.compile(r"nvme\d+q\d+")),
    (
        "nic",
        re.compile(
            r"mlx5_|mlx4-|eth\d|en[opsx]\w|ib\d|ice-|i40e-|iavf-|ixgbe|igb|igc|e1000|bnxt|"
            r"ena-|efa|qede|gve|hinic|virtio\d+-(?:input|output)"
        ),
    ),
    ("usb", re.compile(r"[xeou]hci[-_]hcd")),
)
# old kernels print the chip and the flow handler as one token: IR-IO-APIC-edge
_CHIP_AND_TRIGGER = re.compile(r"(.+)-(edge|fasteoi|level|simple|percpu|edge-irq|none)")
# newer: hwirq and flow handler as one token: 114689-edge
_HWIRQ_TRIGGER = re.compile(r"([0-9]+)-(\S+)")
# rows with one system-wide number, not one per CPU
_SINGLE_ROWS = frozenset({"ERR", "MIS", "Err"})
_IRQ = attrgetter("irq")
_ROW_KEY = attrgetter("irq", "name")
_COUNT = itemgetter(1)  # of a (column, increase)
_NEW = object()  # a text line the parser has not seen


class ParseError(ValueError):
    """The text is not a /proc/interrupts table (no CPU header line)."""


class IrqLine(NamedTuple):
    """One row of the table.

    `irq` is the label without its colon ("53", "LOC", "IPI0"); `columns` the per-CPU
    counts as printed (ASCII decimal strings, header order, maybe fewer than the CPUs);
    `name` the action names of a device row ("ehci_hcd:usb1, mmc0"; "" for a row without
    a handler) or the description of a summary row ("Local timer interrupts"). The
    columns stay text so that comparing two polls converts only the columns that moved.
    """

    irq: str
    columns: tuple[str, ...]
    chip: str = ""
    hwirq: str = ""
    trigger: str = ""
    name: str = ""

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(map(int, self.columns))

    @property
    def is_device(self) -> bool:
        return self.irq.isdigit()

    def actions(self) -> list[str]:
        return [a for a in self.name.split(", ") if a] if self.is_device else []


@dataclass(frozen=True)
class InterruptTable:
    cpus: tuple[int, ...]  # CPU numbers of the count columns (the header)
    lines: tuple[IrqLine, ...]  # rows with per-CPU counts, in file order
    totals: dict[str, int]  # one-number rows: ERR, MIS (x86), Err (arm64)


def parse_header(line: str) -> tuple[int, ...]:
    """CPU numbers from the header line `           CPU0       CPU1 ...`."""
    cpus = []
    for token in line.split():
        number = token[3:]
        if not (token.startswith("CPU") and number.isascii() and number.isdigit()):
            raise ParseError(f"not a CPU header line: unexpected {token[:20]!r}")
        if len(number) > 6:
            raise ParseError("not a CPU header line: CPU number too large")
        cpus.append(int(number))
    if not cpus:
        raise ParseError("no CPU header line")
    return tuple(cpus)


@functools.lru_cache(maxsize=4096)
def split_tail(tail: str) -> tuple[str, str, str, str]:
    """(chip, hwirq, trigger, action names) from what follows a device row's counts.

    Cached: a row's tail does not change while its counts do.
    """
    tokens = tail.split()
    if not tokens:
        return "", "", "", ""
    chip, hwirq, trigger = tokens[0], "", ""
    i = 1
    old = _CHIP_AND_TRIGGER.fullmatch(chip)
    if old is not None:
        chip, trigger = old.group(1), old.group(2)
    else:
        if i < len(tokens) and tokens[i].isdigit():  # GIC/ITS: "27 Level", "65537 Edge"
            hwirq = tokens[i]
            i += 1
        if i < len(tokens):
            token = tokens[i]
            joined = _HWIRQ_TRIGGER.fullmatch(token)
            if joined is not None and not hwirq:
                hwirq, trigger = joined.group(1), joined.group(2)
                i += 1
            elif token in ("Edge", "Level"):
                trigger = token
                i += 1
                if i < len(tokens) and tokens[i].startswith("-"):  # "Level -fasteoi"
                    trigger += tokens[i]
                    i += 1
            elif token.startswith("-") and len(token) > 1:  # no irq domain: "-edge"
                trigger = token[1:]
                i += 1
    return chip, hwirq, trigger, " ".join(tokens[i:])


def _decimal(columns: list[str]) -> bool:
    """Every column is an ASCII decimal that int() accepts (under its 4300-digit limit).

    Longer than a u64 (20 digits) is garbage too, but is only checked for the columns
    that move (`line_deltas`): checking every column of every row costs more than the
    rest of the parse.
    """
    joined = "".join(columns)
    return (
        joined.isascii()
        and joined.isdigit()
        and (len(joined) <= 4000 or max(map(len, columns)) <= _MAX_DIGITS)
    )


def parse_line(line: str, ncpus: int) -> IrqLine | None:
    """One row of the table, or None if it is not a row with per-CPU counts.

    Rows with one number (ERR, MIS), blank lines and garbage give None.
    """
    label, colon, rest = line.partition(":")
    label = label.strip()
    if not colon or not label.isascii() or not label.isalnum() or len(label) > 16:
        return None
    if label in _SINGLE_ROWS:
        return None
    pieces = rest.split(None, ncpus)
    columns = pieces[:ncpus]
    if len(columns) == ncpus and _decimal(columns):
        tail = pieces[ncpus] if len(pieces) > ncpus else ""
    else:
        # fewer columns than CPUs (or garbage): the counts are the leading decimal tokens
        tokens = rest.split()
        n = 0
        while n < ncpus and n < len(tokens) and tokens[n].isascii() and tokens[n].isdigit():
            n += 1
        columns = tokens[:n]
        if not columns or max(map(len, columns)) > _MAX_DIGITS:
            return None
        tail = " ".join(tokens[n:])
    if len(columns) == 1 and not tail and ncpus > 1:
        return None  # a one-number row we do not know
    if label.isdigit():
        chip, hwirq, trigger, name = split_tail(tail)
        return IrqLine(label, tuple(columns), chip, hwirq, trigger, name)
    return IrqLine(label, tuple(columns), name=" ".join(tail.split()))


def _single(line: str) -> tuple[str, int] | None:
    """A one-number row (`ERR:          0`)."""
    label, colon, rest = line.partition(":")
    fields = rest.split()
    label = label.strip()
    if (
        colon
        and label.isascii()
        and label.isalpha()
        and len(fields) == 1
        and fields[0].isascii()
        and fields[0].isdigit()
        and len(fields[0]) <= 20
    ):
        return label, int(fields[0])
    return None


class InterruptsParser:
    """`parse_interrupts` that reuses the rows whose text did not change since last time.

    The result is equal to `parse_interrupts(text)`; an unchanged row is the very same
    `IrqLine` object as in the previous result, which lets the source skip it.
    """

    def __init__(self) -> None:
        self._rows: dict[str, IrqLine | None] = {}
        self._ncpus = -1
        self._header: tuple[str, tuple[int, ...]] | None = None  # its text, its CPUs

    def parse(self, text: str) -> InterruptTable:
        raw = text.splitlines()
        start = 0
        while start < len(raw) and not raw[start].strip():
            start += 1
        if start == len(raw):
            raise ParseError("empty file")
        header = self._header
        if header is None or header[0] != raw[start]:  # the first parse, or CPU hot-plug
            header = self._header = (raw[start], parse_header(raw[start]))
        cpus = header[1]
        ncpus = len(cpus)
        cache = self._rows if ncpus == self._ncpus else {}
        body = raw[start + 1 :]
        # the rows as last time looked up in C; only the new texts are parsed
        found: list[IrqLine | None | object] = list(map(cache.get, body, repeat(_NEW)))
        for i in compress(range(len(found)), map(is_, found, repeat(_NEW))):
            found[i] = parse_line(body[i], ncpus)
        totals: dict[str, int] = {}
        for i in compress(range(len(found)), map(is_, found, repeat(None))):
            single = _single(body[i])
            if single is not None:
                totals[single[0]] = single[1]
        rows = cast(list[IrqLine | None], found)
        self._rows, self._ncpus = dict(zip(body, rows, strict=True)), ncpus
        return InterruptTable(cpus, tuple(filter(None, rows)), totals)


def parse_interrupts(text: str) -> InterruptTable:
    """The whole table; bad rows are skipped. Raises ParseError without a CPU header."""
    return InterruptsParser().parse(text)


def classify(line: IrqLine) -> str:
    """The class of a row: a device class by its action names, or "system"."""
    if not line.is_device:
        return SYSTEM
    for action in line.actions():
        for cls, pattern in _CLASS_RULES:
            if pattern.match(action):
                return cls
    return "other"


Ints = Callable[[IrqLine], list[int]]


def _ints(line: IrqLine) -> list[int]:
    return list(map(int, line.columns))


def line_deltas(
    current: IrqLine, previous: IrqLine, limit: float, ints: Ints = _ints
) -> list[tuple[int, int]] | None:
    """(column, increase) for every column that moved from `previous` to `current`.

    A u32 wrap is unwrapped when the wrapped increase is at most `limit`; None if a count
    was reset (a device re-registered) or the rows have different column counts. `ints`
    converts a row's columns, where they moved on many CPUs (`RowCounts` remembers them).
    """
    now, before = current.columns, previous.columns
    if len(now) != len(before):
        return None
    moved = list(compress(range(len(now)), map(ne, now, before)))
    if len(moved) > 8 and max(map(len, now)) <= _MAX_DIGITS >= max(map(len, before)):
        # a row that moved on many CPUs (LOC, RES, ...): subtract every column in C
        increases = list(map(sub, ints(current), ints(previous)))
        if min(increases) >= 0:
            return [(i, increases[i]) for i in moved]
    deltas = []
    for i in moved:
        if len(now[i]) > _MAX_DIGITS or len(before[i]) > _MAX_DIGITS:
            return None  # not a u64: garbage
        a, b = int(now[i]), int(before[i])
        d = a - b
        if d < 0:
            if b < U32 and a < U32 and d + U32 <= limit:
                d += U32
            else:
                return None
        deltas.append((i, d))
    return deltas


def line_total(current: IrqLine, previous: IrqLine, limit: float, ints: Ints = _ints) -> int | None:
    """The sum of `line_deltas` (what a summary row's class needs), without a list of
    its columns where none fell."""
    now, before = current.columns, previous.columns
    if len(now) == len(before) and max(map(len, now)) <= _MAX_DIGITS >= max(map(len, before)):
        increases = list(map(sub, ints(current), ints(previous)))
        if min(increases, default=0) >= 0:
            return sum(increases)
    deltas = line_deltas(current, previous, limit, ints)
    return None if deltas is None else sum(d for _, d in deltas)


class RowCounts:
    """A row's counts as ints, kept from the poll that read them to the next: the row it
    is compared with then was converted once already, as the newer one."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[str, ...], list[int]]] = {}  # label -> its last
        self._used: dict[str, tuple[tuple[str, ...], list[int]]] = {}

    def next_poll(self) -> None:
        """Keep only what this poll converted (rows that left are forgotten)."""
        self._kept, self._used = self._used, {}

    def __call__(self, line: IrqLine) -> list[int]:
        for known in (self._used, self._kept):
            entry = known.get(line.irq)
            if entry is not None and entry[0] is line.columns:
                break
        else:
            entry = (line.columns, list(map(int, line.columns)))
        self._used.setdefault(line.irq, entry)  # the newer row: asked for first, kept
        return entry[1]


@dataclass
class Rates:
    """One poll's aggregation."""

    per_class: dict[str, float]
    max_line: dict[str, float]
    storm_lines: dict[str, int]
    per_cpu: dict[tuple[int, str], float]  # (cpu, device class) -> interrupts/s
    # the rows over the threshold, the busiest first: (class, irq, action names, per second)
    storms: list[tuple[str, str, str, float]] = field(default_factory=list)


@register
class InterruptsSource(Source):
    name = "interrupts"
    metrics = (
        gauge(
            "interrupts_per_second",
            "Interrupts per second, summed over the rows of a class and over CPUs "
            "(class: nvidia, nvme, nic, usb, other, system = LOC/NMI/RES/... summary rows).",
            ("class",),
            budget=6,
        ),
        gauge(
            "interrupt_lines",
            "IRQ rows of the class in /proc/interrupts.",
            ("class",),
            export="detail",
        ),
        gauge(
            "interrupt_max_line_per_second",
            "Interrupts per second of the busiest IRQ row of the device class.",
            ("class",),
            export="detail",
        ),
        gauge(
            "interrupt_storm_lines",
            "IRQ rows of the device class over the storm threshold (default 10000/s).",
            ("class",),
            export="nonzero",
        ),
        gauge(
            "interrupt_storm_line_per_second",
            "Interrupts per second of an IRQ row over the storm threshold, by its number and "
            "action names (as /proc/interrupts prints them): the line an on-call acts on.",
            ("class", "irq", "action"),
            export="nonzero",
        ),
        gauge(
            "interrupt_cpu_max_per_second",
            "Interrupts per second of the device class on the one CPU it hits hardest.",
            ("class",),
            export="detail",
        ),
        gauge(
            "cpu_interrupts_per_second",
            "Interrupts per second of a device class on one CPU; only CPU/class pairs at "
            "or over the configured floor (default 100/s).",
            ("cpu", "class"),
            export="detail",
        ),
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        cfg = settings_of(config, InterruptsConfig)
        self.cfg = cfg
        self.path = os.path.join(os.fspath(context.procfs), "interrupts")
        clock = context.extras.get("clock", time.monotonic)
        self._clock: Callable[[], float] = clock if callable(clock) else time.monotonic
        self._include = [re.compile(p) for p in cfg.include]
        self._exclude = [re.compile(p) for p in cfg.exclude]
        self._parser = InterruptsParser()
        self._class: dict[tuple[str, str], str | None] = {}  # (label, name) -> class
        # the last poll's rows' (label, name), their classes and interrupt_lines samples
        self._kept_classes: (
            tuple[tuple[tuple[str, str], ...], list[str | None], list[Sample]] | None
        ) = None
        self._prev: dict[str, IrqLine] = {}
        self._prev_cpus: tuple[int, ...] | None = None
        self._prev_time: float | None = None
        self._shown: set[tuple[int, str]] = set()
        self._counts = RowCounts()
        self.last_rates: Rates | None = None  # for tests and the doctor

    def _class_of(self, line: IrqLine) -> str | None:
        key = (line.irq, line.name)
        cls = self._class.get(key, "")
        if cls != "":
            return cls
        subject = line.name if line.is_device else line.irq
        if (self._include and not any(p.search(subject) for p in self._include)) or any(
            p.search(subject) for p in self._exclude
        ):
            result = None
        else:
            result = classify(line)
        if len(self._class) > 65536:  # rows come and go; keep the cache bounded
            self._class.clear()
        self._class[key] = result
        return result

    def collect(self) -> list[Sample]:
        text = read_kernel_file(self.path, "procfs", self.context.procfs)
        try:
            table = self._parser.parse(text)
        except ParseError as e:
            raise SourceError(f"{self.path}: not a /proc/interrupts table: {e}") from e
        now = float(self._clock())

        kinds, counted = self._classes(table.lines)
        lines = list(compress(table.lines, kinds))  # the rows counted (None: excluded)
        classes: list[str] = list(filter(None, kinds))
        samples = counted[:]

        prev_time, prev_cpus = self._prev_time, self._prev_cpus
        self._prev_time, self._prev_cpus = now, table.cpus
        previous = self._prev
        self._prev = dict(zip(map(_IRQ, lines), lines, strict=True))
        dt = now - prev_time if prev_time is not None else 0.0
        if prev_cpus != table.cpus or not (dt > 0 and math.isfinite(dt)):
            self.last_rates = None
            return samples  # first poll, CPU hot-plug or a clock that did not move
        rates = self._rates(lines, classes, previous, table.cpus, dt)
        self.last_rates = rates
        samples.extend(self._rate_samples(rates))
        return samples

    def _classes(self, lines: tuple[IrqLine, ...]) -> tuple[list[str | None], list[Sample]]:
        """Each row's class (None: excluded) and the `interrupt_lines` samples; the last
        poll's (the same objects) while the rows' labels and action names are as they
        were: their counts move every poll, what they are rarely changes."""
        shape = tuple(map(_ROW_KEY, lines))
        kept = self._kept_classes
        if kept is not None and kept[0] == shape:
            return kept[1], kept[2]
        classes = [self._class_of(line) for line in lines]
        lines_per_class = dict.fromkeys(CLASSES, 0)
        for cls in filter(None, classes):
            lines_per_class[cls] += 1
        samples = [
            Sample("gpuwatchd_interrupt_lines", (cls,), float(n))
            for cls, n in lines_per_class.items()
        ]
        self._kept_classes = (shape, classes, samples)
        return classes, samples

    def _rates(
        self,
        lines: list[IrqLine],
        classes: list[str],
        previous: dict[str, IrqLine],
        cpus: tuple[int, ...],
        dt: float,
    ) -> Rates:
        per_class = dict.fromkeys(CLASSES, 0.0)
        max_line = dict.fromkeys(DEVICE_CLASSES, 0.0)
        storm = dict.fromkeys(DEVICE_CLASSES, 0)
        per_cpu: dict[tuple[int, str], float] = {}
        storms: list[tuple[str, str, str, float]] = []
        threshold = self.cfg.storm_threshold * dt  # compare counts, divide once
        limit = MAX_RATE_PER_CPU * dt
        counts_sum = dict.fromkeys(CLASSES, 0)
        max_count = dict.fromkeys(DEVICE_CLASSES, 0)
        ints = self._counts
        ints.next_poll()
        befores = list(map(previous.get, map(_IRQ, lines)))
        # a row whose text did not change is its last poll's object: nothing happened
        moved = map(is_not, lines, befores)
        for line, cls, before in compress(zip(lines, classes, befores, strict=True), moved):
            if before is None:
                continue  # new row: the baseline
            if before.name != line.name:
                continue  # the IRQ number now belongs to another device
            if cls == SYSTEM:  # counted by class only
                row_total = line_total(line, before, limit, ints)
                counts_sum[cls] += row_total or 0  # None: reset
                continue
            deltas = line_deltas(line, before, limit, ints)
            if deltas is None:
                continue  # reset: re-registered device
            total = sum(map(_COUNT, deltas))
            if not total:
                continue
            counts_sum[cls] += total
            if total > max_count[cls]:
                max_count[cls] = total
            if total > threshold:
                storm[cls] += 1
                storms.append((cls, line.irq, line.name, total / dt))
            for i, d in deltas:
                key = (cpus[i], cls)
                per_cpu[key] = per_cpu.get(key, 0) + d
        for cls in CLASSES:
            per_class[cls] = counts_sum[cls] / dt
        for cls in DEVICE_CLASSES:
            max_line[cls] = max_count[cls] / dt
        storms.sort(key=lambda row: -row[3])
        return Rates(
            per_class,
            max_line,
            storm,
            {key: count / dt for key, count in per_cpu.items()},
            storms[:MAX_STORM_SERIES],
        )

    def _rate_samples(self, rates: Rates) -> list[Sample]:
        samples = [
            Sample("gpuwatchd_interrupts_per_second", (cls,), value)
            for cls, value in rates.per_class.items()
        ]
        samples += [
            Sample("gpuwatchd_interrupt_max_line_per_second", (cls,), value)
            for cls, value in rates.max_line.items()
        ]
        samples += [
            Sample("gpuwatchd_interrupt_storm_lines", (cls,), float(count))
            for cls, count in rates.storm_lines.items()
        ]
        samples += [
            Sample("gpuwatchd_interrupt_storm_line_per_second", (cls, irq, action), rate)
            for cls, irq, action, rate in rates.storms
        ]
        hardest = dict.fromkeys(DEVICE_CLASSES, 0.0)
        for (_, cls), rate in rates.per_cpu.items():
            if rate > hardest[cls]:
                hardest[cls] = rate
        samples += [
            Sample("gpuwatchd_interrupt_cpu_max_per_second", (cls,), value)
            for cls, value in hardest.items()
        ]
        floor = self.cfg.cpu_floor
        keep_floor = floor / 2
        chosen = [
            (rate, key)
            for key, rate in rates.per_cpu.items()
            if rate >= floor or (key in self._shown and rate >= keep_floor)
        ]
        if len(chosen) > self.cfg.max_cpu_series:
            chosen.sort(reverse=True)
            del chosen[self.cfg.max_cpu_series :]
        self._shown = {key for _, key in chosen}
        samples += [
            Sample("gpuwatchd_cpu_interrupts_per_second", (str(cpu), cls), rate)
            for rate, (cpu, cls) in sorted(chosen, key=lambda item: item[1])
        ]
        return samples


__all__ = [
    "CLASSES",
    "DEVICE_CLASSES",
    "SYSTEM",
    "InterruptTable",
    "InterruptsConfig",
    "InterruptsParser",
    "InterruptsSource",
    "IrqLine",
    "ParseError",
    "Rates",
    "classify",
    "line_deltas",
    "line_total",
    "parse_header",
    "parse_interrupts",
    "parse_line",
    "split_tail",
]
