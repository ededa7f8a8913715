"""Block devices as `iostat -x` shows them, computed from `<procfs>/diskstats`.

Every poll reads `/proc/diskstats` (`context.procfs`, like node_exporter's
--path.procfs) once. Its lines are "major minor name" followed by 11 counters (kernels
before 4.18), 15 (4.18+: discard) or 17 (5.5+: flush), as Documentation/admin-guide/
iostats.rst lists them:

    rd_ios rd_merges rd_sectors rd_ticks  wr_ios wr_merges wr_sectors wr_ticks
    in_flight io_ticks time_in_queue  [dc_ios dc_merges dc_sectors dc_ticks]  [fl_ios fl_ticks]

Which devices: whole devices only. When `<sysfs>/block` exists its entries are the
whole devices (as sysstat's is_device() decides; a partition lives in
`/sys/block/<disk>/<part>/partition` and `/sys/class/block/<part>/partition`, never
directly under /sys/block). Without it, names decide: `sda1`, `vdb2`, `xvda1` and
anything ending in "<digit>p<digits>" (`nvme0n1p1`, `mmcblk0p1`) are partitions. Then
`include` / `exclude` (regular expressions searched in the name, as node_exporter's
device-include/exclude) pick devices; by default loop, ram, zram, dm-, sr, fd and nbd
devices are left out (dm- because container runtimes can create one per container).
md RAID devices are kept: the data a GPU node reads often sits on one (/raid).

The rates are sysstat's (`iostat -x`, iostat.c / compute_ext_disk_stats), over the time
between two polls, in base units:

    r/s, w/s           Δrd_ios / Δt, Δwr_ios / Δt
    rkB/s, wkB/s       Δrd_sectors × 512 / Δt bytes (sectors are always 512 bytes)
    r_await, w_await   Δrd_ticks / Δrd_ios, Δwr_ticks / Δwr_ios (ms -> s; 0 with no I/O)
    await              (Δrd_ticks + Δwr_ticks + Δdc_ticks) / (Δrd_ios + Δwr_ios + Δdc_ios)
    aqu-sz             Δtime_in_queue / Δt (both in ms)
    %util              Δio_ticks / Δt, as a ratio, capped at 1

Δt comes from the clock in `context.extras["clock"]` (the simulator's virtual clock),
else time.monotonic.

Counter wrap and hot-plug: the millisecond fields are `unsigned int` on every kernel,
so they wrap at 2^32 (49.7 days of io_ticks; much sooner for a deep queue's
time_in_queue); the others are `unsigned long`, 32 bits on 32-bit kernels. A counter
that went down is taken as a 32-bit wrap when the wrapped difference is under 2^31
(for the `unsigned long` fields only until a value over 2^32 has been seen: then the
kernel is 64-bit). Any other decrease means the device was reset (re-registered under
the same name): that interval gives no rates and the new values are the baseline. A
device new to the file gives rates from its second poll on; one gone from the file loses
its series at once. A poll at the same clock time as the last repeats the last rates.

A file that cannot be read, or holds text with no valid line, fails the poll
(SourceError naming the file); a malformed line is skipped and logged.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from gpuwatchd.config import DisksConfig, SourceConfig
from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError, read_kernel_file, settings_of

log = logging.getLogger(__name__)

SECTOR_BYTES = 512
U32 = 1 << 32
U64 = 1 << 64


class DiskStat(NamedTuple):
    """One /proc/diskstats line's counters; fields a kernel does not print are 0."""

    rd_ios: int
    rd_merges: int
    rd_sectors: int
    rd_ticks: int  # ms
    wr_ios: int
    wr_merges: int
    wr_sectors: int
    wr_ticks: int  # ms
    in_flight: int  # a gauge: requests in flight now
    io_ticks: int  # ms the device was busy
    time_in_queue: int  # ms, weighted by requests in flight
    dc_ios: int = 0
    dc_merges: int = 0
    dc_sectors: int = 0
    dc_ticks: int = 0
    fl_ios: int = 0
    fl_ticks: int = 0


FIELD_COUNTS = (11, 15, 17)  # counters per line: < 4.18, 4.18+, 5.5+
# `unsigned int` (32 bits everywhere): the millisecond fields; in_flight is a gauge
MS_FIELDS = frozenset({3, 7, 9, 10, 14, 16})
GAUGE_FIELDS = frozenset({8})
ULONG_FIELDS = tuple(i for i in range(17) if i not in MS_FIELDS and i not in GAUGE_FIELDS)
MS_FIELD_INDICES = tuple(sorted(MS_FIELDS))

_NAME = re.compile(r"[A-Za-z0-9_.:!+@/-]{1,128}")
_PARTITION_DISK = re.compile(r"(?:[shv]d|xvd)[a-z]+[0-9]+")
_PARTITION_P = re.compile(r".*[0-9]p[0-9]+")


class DiskstatsError(ValueError):
    """The text holds something, but not one valid diskstats line."""


def parse_diskstats(text: str, malformed: list[str] | None = None) -> dict[str, DiskStat]:
    """Every valid line of a /proc/diskstats text, by device name.

    A line is valid with at least 11 counters: the first 11, 15 or 17 (as many as it
    has) are read, later ones ignored; each is an unsigned decimal below 2^64. Invalid
    lines are skipped (and appended to `malformed` when given); text with non-blank
    lines but no valid one raises DiskstatsError. Never raises anything else.
    """
    devices: dict[str, DiskStat] = {}
    bad = 0
    first_bad = ""
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        stat = _parse_line(parts)
        if stat is None:
            bad += 1
            if not first_bad:
                first_bad = line
            if malformed is not None:
                malformed.append(line)
            continue
        devices[parts[2]] = stat
    if not devices and bad:
        raise DiskstatsError(f"no valid diskstats line (first: {first_bad[:80]!r})")
    return devices


def _parse_line(parts: list[str]) -> DiskStat | None:
    count = len(parts) - 3
    if count < FIELD_COUNTS[0] or not _NAME.fullmatch(parts[2]):
        return None
    if count >= FIELD_COUNTS[2]:
        count = FIELD_COUNTS[2]
    elif count >= FIELD_COUNTS[1]:
        count = FIELD_COUNTS[1]
    else:
        count = FIELD_COUNTS[0]
    numbers = parts[3 : 3 + count]
    # every word all ASCII digits (int() alone would take "+1", "1_0", non-ASCII digits)
    digits = parts[0] + parts[1] + "".join(numbers)
    if not (digits.isascii() and digits.isdigit()):
        return None
    values = list(map(int, numbers))
    if max(map(len, numbers)) >= 20 and max(values) >= U64:
        return None
    return DiskStat(*values)


def is_partition_name(name: str) -> bool:
    """A partition by its name alone (used when sysfs has no block directory)."""
    return bool(_PARTITION_DISK.fullmatch(name) or _PARTITION_P.fullmatch(name))


def counter_delta(prev: int, cur: int, bits: int) -> int | None:
    """cur - prev for a kernel counter `bits` wide; a 32-bit wrap counts when the wrapped
    difference is under 2^31; None for any other decrease (a reset)."""
    if cur >= prev:
        return cur - prev
    if bits == 32 and prev < U32 and cur < U32:
        wrapped = cur + U32 - prev
        if wrapped < U32 // 2:
            return wrapped
    return None


@dataclass(frozen=True)
class IostatRates:
    """What `iostat -x` prints for one device over one interval, in base units."""

    reads_per_second: float
    writes_per_second: float
    read_bytes_per_second: float
    write_bytes_per_second: float
    read_await_seconds: float
    write_await_seconds: float
    await_seconds: float
    queue_size: float
    utilization_ratio: float


def iostat(
    prev: DiskStat, cur: DiskStat, seconds: float, ulong_bits: int = 64
) -> IostatRates | None:
    """sysstat's extended statistics between two samples `seconds` apart.

    None when a counter went down other than by a 32-bit wrap (the device was reset)
    or when `seconds` is not positive. `ulong_bits` is the kernel's `unsigned long`
    width (32 lets those fields wrap too); the millisecond fields are always 32 bits.
    """
    if not seconds > 0:
        return None
    delta = [0] * 17
    for i in ULONG_FIELDS:
        d = counter_delta(prev[i], cur[i], ulong_bits)
        if d is None:
            return None
        delta[i] = d
    for i in MS_FIELD_INDICES:
        d = counter_delta(prev[i], cur[i], 32)
        if d is None:
            return None
        delta[i] = d
    rd_ios, wr_ios, dc_ios = delta[0], delta[4], delta[11]
    rd_ticks, wr_ticks, dc_ticks = delta[3], delta[7], delta[14]
    nr_ios = rd_ios + wr_ios + dc_ios
    return IostatRates(
        reads_per_second=rd_ios / seconds,
        writes_per_second=wr_ios / seconds,
        read_bytes_per_second=delta[2] * SECTOR_BYTES / seconds,
        write_bytes_per_second=delta[6] * SECTOR_BYTES / seconds,
        read_await_seconds=rd_ticks / rd_ios / 1000.0 if rd_ios else 0.0,
        write_await_seconds=wr_ticks / wr_ios / 1000.0 if wr_ios else 0.0,
        await_seconds=(rd_ticks + wr_ticks + dc_ticks) / nr_ios / 1000.0 if nr_ios else 0.0,
        queue_size=delta[10] / 1000.0 / seconds,
        utilization_ratio=min(1.0, delta[9] / 1000.0 / seconds),
    )


def whole_disks(sysfs: str, major: int, minor: int, depth: int = 0) -> tuple[str, ...]:
    """The whole disks block device MAJ:MIN lives on, by `<sysfs>/dev/block/MAJ:MIN`.

    A partition (its directory has a `partition` file) is on its parent disk; a stacked
    device (md RAID, dm/LVM) is on the disks of its `slaves`, because the disks are what
    saturates (md's own diskstats line has no busy time). () when no such block device
    exists (a filesystem on an anonymous device: NFS, tmpfs, overlay). Only sysfs links
    and directory listings are read.
    """
    return _whole(os.path.join(sysfs, "dev", "block", f"{major}:{minor}"), depth)


def _whole(link: str, depth: int) -> tuple[str, ...]:
    path = os.path.realpath(link)
    if not os.path.isdir(path):
        return ()
    if os.path.exists(os.path.join(path, "partition")):
        path = os.path.dirname(path)
    try:
        slaves = sorted(os.listdir(os.path.join(path, "slaves")))
    except OSError:
        slaves = []
    if slaves and depth < 4:
        disks: set[str] = set()
        for slave in slaves[:64]:
            disks.update(_whole(os.path.join(path, "slaves", slave), depth + 1))
        return tuple(sorted(disks))
    return (os.path.basename(path).replace("!", "/"),)


# metric name (without prefix) -> IostatRates attribute
_RATE_METRICS = (
    ("disk_reads_per_second", "reads_per_second", "Reads completed per second (iostat r/s)."),
    ("disk_writes_per_second", "writes_per_second", "Writes completed per second (iostat w/s)."),
    (
        "disk_read_bytes_per_second",
        "read_bytes_per_second",
        "Bytes read per second (iostat rkB/s, in bytes).",
    ),
    (
        "disk_write_bytes_per_second",
        "write_bytes_per_second",
        "Bytes written per second (iostat wkB/s, in bytes).",
    ),
    (
        "disk_read_await_seconds",
        "read_await_seconds",
        "Average time a read took, queueing included (iostat r_await); 0 without reads.",
    ),
    (
        "disk_write_await_seconds",
        "write_await_seconds",
        "Average time a write took, queueing included (iostat w_await); 0 without writes.",
    ),
    (
        "disk_await_seconds",
        "await_seconds",
        "Average time a read, write or discard took (iostat await); 0 without I/O.",
    ),
    (
        "disk_queue_size",
        "queue_size",
        "Average number of requests queued or in service (iostat aqu-sz).",
    ),
    (
        "disk_utilization_ratio",
        "utilization_ratio",
        "Share of time the device had I/O in flight (iostat %util / 100).",
    ),
)
# node_exporter's diskstats say what iostat does: every family for the rules and
# detail_metrics only (issue 46)
_SHOWN: tuple[str, ...] = ()
_FULL_NAMES = tuple(("gpuwatchd_" + name, attr) for name, attr, _ in _RATE_METRICS)


@register
class DisksSource(Source):
    name = "disks"
    # node_exporter has every iostat figure: shown by default are what the dashboards read
    metrics = tuple(
        gauge(name, help, ("device",), *(("always", 2) if name in _SHOWN else ("detail", None)))
        for name, _, help in _RATE_METRICS
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        cfg = settings_of(config, DisksConfig)
        self._include = re.compile(cfg.include) if cfg.include else None
        self._exclude = re.compile(cfg.exclude) if cfg.exclude else None
        self._max_devices = cfg.max_devices
        self.path = os.path.join(os.fspath(context.procfs), "diskstats")
        self._block_dir = os.path.join(os.fspath(context.sysfs), "block")
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._ulong_bits = 32  # until a value over 2^32 proves the kernel 64-bit
        # device -> (time, counters) of the last poll, and the last rates computed
        self._last: dict[str, tuple[float, DiskStat]] = {}
        self._rates: dict[str, IostatRates] = {}
        self._wanted: dict[str, bool] = {}  # name filter results, by name
        self._logged_malformed = 0
        self._logged_cap = False

    def collect(self) -> list[Sample]:
        now = self._clock()
        text = read_kernel_file(self.path, "procfs", self.context.procfs)
        malformed: list[str] = []
        try:
            stats = parse_diskstats(text, malformed)
        except DiskstatsError as e:
            raise SourceError(f"{self.path}: {e}") from e
        self._log_malformed(malformed)

        devices = self._select(stats)
        # sector counts grow fastest of the `unsigned long` fields (every I/O is at least
        # one sector): one over 2^32 proves the kernel 64-bit
        if self._ulong_bits == 32 and any(
            stat.rd_sectors >= U32 or stat.wr_sectors >= U32 or stat.dc_sectors >= U32
            for stat in stats.values()
        ):
            self._ulong_bits = 64

        samples: list[Sample] = []
        last, rates = self._last, self._rates
        chosen = set(devices)
        for gone in [name for name in last if name not in chosen]:
            del last[gone]
            rates.pop(gone, None)
        for name in devices:
            cur = stats[name]
            previous = last.get(name)
            if previous is None:
                last[name] = (now, cur)
                continue
            then, prev = previous
            seconds = now - then
            if seconds <= 0:  # polled again at the same instant: repeat the last rates
                result = rates.get(name)
            else:
                result = iostat(prev, cur, seconds, self._ulong_bits)
                last[name] = (now, cur)
                if result is None:
                    rates.pop(name, None)  # reset: this interval has no rates
                else:
                    rates[name] = result
            if result is not None:
                labels = (name,)
                for metric, attr in _FULL_NAMES:
                    samples.append(Sample(metric, labels, getattr(result, attr)))
        return samples

    def _select(self, stats: dict[str, DiskStat]) -> list[str]:
        """Whole devices that pass the filters, sorted, at most max_devices."""
        try:
            whole: set[str] | None = {n.replace("!", "/") for n in os.listdir(self._block_dir)}
        except OSError:
            whole = None
        chosen = []
        for name in stats:
            if whole is not None:
                if name not in whole:
                    continue
            elif is_partition_name(name):
                continue
            wanted = self._wanted.get(name)
            if wanted is None:
                wanted = (self._include is None or bool(self._include.search(name))) and not (
                    self._exclude is not None and self._exclude.search(name)
                )
                if len(self._wanted) > 4096:
                    self._wanted.clear()
                self._wanted[name] = wanted
            if wanted:
                chosen.append(name)
        chosen.sort()
        if len(chosen) > self._max_devices:
            if not self._logged_cap:
                log.warning(
                    "source disks: %d devices, reporting the first %d by name (max_devices)",
                    len(chosen),
                    self._max_devices,
                )
                self._logged_cap = True
            chosen = chosen[: self._max_devices]
        return chosen

    def _log_malformed(self, malformed: list[str]) -> None:
        if len(malformed) != self._logged_malformed:
            self._logged_malformed = len(malformed)
            if malformed:
                log.warning(
                    "source disks: %s: skipped %d malformed line(s), first: %r",
                    self.path,
                    len(malformed),
                    malformed[0][:120],
                )


__all__ = [
    "DiskStat",
    "DisksConfig",
    "DisksSource",
    "DiskstatsError",
    "IostatRates",
    "counter_delta",
    "iostat",
    "is_partition_name",
    "parse_diskstats",
    "whole_disks",
]
