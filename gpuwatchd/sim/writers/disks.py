"""The simulator's /proc/diskstats and /sys/block: the node's disks, counters from rates.

`DiskstatsWriter(root, timeline, sysfs=None).write(t)` writes `<root>/diskstats` (root:
the procfs root) as a 5.5+ kernel prints it (block/genhd.c `diskstats_show`): per line
`%4d %7d %s` major, minor, name, then 17 counters

    rd_ios rd_merges rd_sectors rd_ticks wr_ios wr_merges wr_sectors wr_ticks
    in_flight io_ticks time_in_queue dc_ios dc_merges dc_sectors dc_ticks fl_ios fl_ticks

for every disk of `node.host.disks`, each followed by one partition (`nvme0n1p1`,
`sda1`) that carries all of the disk's I/O, as a disk with one big partition shows, and
then `loop0` (all zeros, as snap-using hosts have). Device numbers are the kernel's:
NVMe namespaces and their partitions take consecutive minors of the dynamic block
major 259 in probe order (`nvme0n1` 259:0, `nvme0n1p1` 259:1, `nvme1n1` 259:2, ...);
sd disks the sd majors (8, then 65-71, then 128-135) with 16 minors per disk
(`sda` 8:0, `sdb` 8:16, `sdq` 65:0); virtio `vdX` 252:16*N; mmcblk 179:8*N; anything
else takes the next 259 minor. With `sysfs`, it also lays out `<sysfs>/block/<disk>/`
(`dev`, `size`, `queue/rotational`, and `<part>/partition`, `<part>/dev`), which the
disks source uses to tell whole devices from partitions, and the `<sysfs>/dev/block/
MAJ:MIN` links to them (`../../block/<disk>`, `../../block/<disk>/<part>`), by which a
mount's device number leads to its disk.

Counters integrate `timeline.host_state(t)["disks"][name]` with `Integrator` (a
missing value is 0), so that iostat's formulas give the scenario's values back:

    rd_ios       += read_iops × Δt              wr_ios       += write_iops × Δt
    rd_sectors   += read_mb_s × 10^6 / 512 × Δt wr_sectors   += write_mb_s × 10^6 / 512 × Δt
    rd_ticks     += read_iops × await_ms × Δt   wr_ticks     += write_iops × await_ms × Δt
    io_ticks     += util_percent × 10 × Δt      (ms busy per second)
    time_in_queue = rd_ticks + wr_ticks         (aqu-sz = IOPS × await, Little's law)
    in_flight     = round(aqu-sz)

Merges, discards and flushes stay 0. Values print as the kernel's types: the millisecond
fields and in_flight are `unsigned int` (they wrap at 2^32), the others `unsigned long`
(`ulong_bits`, 64, or 32 for a 32-bit kernel). `offset` is added to every counter, as
if the node had been up a while (tests use it to cross a wrap).

Hot-plug: a disk whose values say `present: false` (when the scenario schema has that
field) has no line and no /sys/block directory; when it comes back its counters
restart from 0, as a re-registered device's do.

Only a changed file is written, through a temporary file and `os.replace`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline

SECTOR_BYTES = 512
U32_MASK = (1 << 32) - 1
NVME_MAJOR = 259  # BLOCK_EXT_MAJOR: dynamic minors
SD_MAJORS = (8, 65, 66, 67, 68, 69, 70, 71, 128, 129, 130, 131, 132, 133, 134, 135)
VIRTIO_MAJOR = 252
MMC_MAJOR = 179
LOOP_MAJOR = 7
DISK_SIZE_SECTORS = 7_501_476_528  # a 3.84 TB NVMe drive

_FIELDS = 17
_MS = frozenset({3, 7, 8, 9, 10, 14, 16})  # unsigned int fields (in_flight included)

_SD = re.compile(r"sd([a-z]+)")
_VD = re.compile(r"vd([a-z]+)")
_MMC = re.compile(r"mmcblk([0-9]+)")


def _letters_index(letters: str) -> int:
    """sd name letters -> disk index (a=0, z=25, aa=26), as sd_format_disk_name counts."""
    index = 0
    for ch in letters:
        index = index * 26 + (ord(ch) - ord("a") + 1)
    return index - 1


def partition_name(disk: str) -> str:
    """The kernel's name for partition 1: `p1` after a name ending in a digit."""
    return disk + ("p1" if disk[-1:].isdigit() else "1")


def device_numbers(disks: list[str]) -> dict[str, tuple[int, int]]:
    """(major, minor) of every disk and of its partition 1, as the kernel assigns them."""
    numbers: dict[str, tuple[int, int]] = {}
    next_ext = 0
    for disk in disks:
        part = partition_name(disk)
        sd, vd, mmc = _SD.fullmatch(disk), _VD.fullmatch(disk), _MMC.fullmatch(disk)
        if sd:
            index = _letters_index(sd.group(1))
            major = SD_MAJORS[min(index // 16, len(SD_MAJORS) - 1)]
            minor = (index % 16) * 16
            numbers[disk], numbers[part] = (major, minor), (major, minor + 1)
        elif vd:
            minor = _letters_index(vd.group(1)) * 16
            numbers[disk], numbers[part] = (VIRTIO_MAJOR, minor), (VIRTIO_MAJOR, minor + 1)
        elif mmc:
            minor = int(mmc.group(1)) * 8
            numbers[disk], numbers[part] = (MMC_MAJOR, minor), (MMC_MAJOR, minor + 1)
        else:
            numbers[disk] = (NVME_MAJOR, next_ext)
            numbers[part] = (NVME_MAJOR, next_ext + 1)
            next_ext += 2
    return numbers


def disk_rates(values: Mapping[str, Any]) -> tuple[float, ...]:
    """Per-second increments of (rd_ios, rd_sectors, rd_ticks, wr_ios, wr_sectors,
    wr_ticks, io_ticks) for one disk's DiskValues (None / missing: 0)."""

    def value(key: str) -> float:
        v = values.get(key)
        return float(v) if v is not None else 0.0

    read_iops, write_iops = value("read_iops"), value("write_iops")
    await_ms = value("await_ms")
    return (
        read_iops,
        value("read_mb_s") * 1e6 / SECTOR_BYTES,
        read_iops * await_ms,
        write_iops,
        value("write_mb_s") * 1e6 / SECTOR_BYTES,
        write_iops * await_ms,
        value("util_percent") * 10.0,
    )


class DiskstatsWriter:
    """Writes and updates `<root>/diskstats` (and `<sysfs>/block`) for `timeline`'s node."""

    def __init__(
        self,
        root: Path,
        timeline: Timeline,
        sysfs: Path | None = None,
        *,
        ulong_bits: int = 64,
        offset: int = 0,
    ) -> None:
        if ulong_bits not in (32, 64):
            raise ValueError("ulong_bits: 32 or 64")
        self.root = Path(root)
        self.sysfs = Path(sysfs) if sysfs is not None else None
        self.timeline = timeline
        self.path = os.fspath(self.root / "diskstats")
        self.disks = [disk.name for disk in timeline.scenario.node.host.disks]
        self.numbers = device_numbers(self.disks)
        self.files = Files()
        self._ulong_mask = (1 << ulong_bits) - 1
        self._offset = int(offset)
        self._integrator = Integrator()
        self._base: dict[str, tuple[float, ...]] = {}  # totals when a disk (re)appeared
        self._present: dict[str, bool] = {}
        self._loop = f"{LOOP_MAJOR:4d} {0:7d} loop0" + " 0" * _FIELDS + "\n"

    @property
    def writes(self) -> int:
        """Files written so far (changed content only)."""
        return self.files.writes

    def write(self, t: float) -> int:
        """Bring the files to the node's state at time t; returns how many files changed."""
        values: Mapping[str, Mapping[str, Any]] = self.timeline.host_state(t).get("disks") or {}
        rates: dict[Hashable, float] = {}  # (disk, field) -> per second
        present: dict[str, bool] = {}
        for disk in self.disks:
            v = values.get(disk) or {}
            present[disk] = v.get("present") is not False
            if present[disk]:
                for i, rate in enumerate(disk_rates(v)):
                    rates[(disk, i)] = rate
        totals = self._integrator.advance(t, rates)
        changed = 0
        lines: list[str] = []
        for disk in self.disks:
            if not present[disk]:
                continue
            now = tuple(float(totals.get((disk, i), 0.0)) for i in range(7))
            if not self._present.get(disk, False):
                self._base[disk] = now  # (re)appeared: its counters start at 0
            base = self._base[disk]
            counts = [max(0, int(n - b)) for n, b in zip(now, base, strict=True)]
            text = self._counters(counts, values.get(disk) or {})
            major, minor = self.numbers[disk]
            lines.append(f"{major:4d} {minor:7d} {disk} {text}\n")
            part = partition_name(disk)
            pmajor, pminor = self.numbers[part]
            lines.append(f"{pmajor:4d} {pminor:7d} {part} {text}\n")
        lines.append(self._loop)
        content = "".join(lines)
        if self.sysfs is not None:
            changed += self._sysfs(present)
        self._present = present
        if self.files.put(self.path, content):
            changed += 1
        return changed

    def _counters(self, counts: list[int], values: Mapping[str, Any]) -> str:
        rd_ios, rd_sectors, rd_ticks, wr_ios, wr_sectors, wr_ticks, io_ticks = counts
        await_ms = float(values.get("await_ms") or 0.0)
        iops = float(values.get("read_iops") or 0.0) + float(values.get("write_iops") or 0.0)
        in_flight = round(iops * await_ms / 1000.0)
        fields = [0] * _FIELDS
        fields[0], fields[2], fields[3] = rd_ios, rd_sectors, rd_ticks
        fields[4], fields[6], fields[7] = wr_ios, wr_sectors, wr_ticks
        fields[8], fields[9], fields[10] = in_flight, io_ticks, rd_ticks + wr_ticks
        off, ulong, u32 = self._offset, self._ulong_mask, U32_MASK
        out = []
        for i, n in enumerate(fields):
            if i == 8:
                out.append(str(n & u32))
            elif i in _MS:
                out.append(str((n + off) & u32))
            else:
                out.append(str((n + off) & ulong))
        return " ".join(out)

    def _sysfs(self, present: dict[str, bool]) -> int:
        assert self.sysfs is not None
        block = self.sysfs / "block"
        changed = 0
        for disk in self.disks:
            d = block / disk.replace("/", "!")
            was = self._present.get(disk)
            if present[disk] and was is not True:
                part = partition_name(disk)
                (d / "queue").mkdir(parents=True, exist_ok=True)
                (d / part).mkdir(exist_ok=True)
                major, minor = self.numbers[disk]
                pmajor, pminor = self.numbers[part]
                rotational = "1" if _SD.fullmatch(disk) else "0"
                for path, content in (
                    (d / "dev", f"{major}:{minor}\n"),
                    (d / "size", f"{DISK_SIZE_SECTORS}\n"),
                    (d / "queue" / "rotational", f"{rotational}\n"),
                    (d / part / "dev", f"{pmajor}:{pminor}\n"),
                    (d / part / "partition", "1\n"),
                ):
                    changed += self.files.put(os.fspath(path), content)
                links = self.sysfs / "dev" / "block"
                links.mkdir(parents=True, exist_ok=True)
                for (dmajor, dminor), target in (
                    ((major, minor), f"../../block/{d.name}"),
                    ((pmajor, pminor), f"../../block/{d.name}/{part}"),
                ):
                    link = links / f"{dmajor}:{dminor}"
                    if not link.is_symlink():
                        link.symlink_to(target)
            elif not present[disk] and was is True:
                shutil.rmtree(d, ignore_errors=True)
                self.files.forget(os.fspath(d))
                changed += 1
        return changed


__all__ = ["DiskstatsWriter", "device_numbers", "disk_rates", "partition_name"]
