"""What a GPU job reads, from which disks, and what its CPUs lose to I/O wait and interrupts.

A node-wide view blames the wrong thing: a backup saturating one disk is not the
training job's problem when the job reads another disk (or its page cache), and a busy
NIC whose interrupts land on CPUs the job never runs on does not starve it. The
`processes` source calls `JobIo.read` for each GPU's main process and its children
(DataLoader workers), and exports, per GPU:

* `/proc/PID/io` `read_bytes`: bytes the job's processes made the block layer read
  (page-cache hits are not counted, unlike `rchar`), as a rate between two polls;
* the disks the job's files are on: each open fd (`/proc/PID/fd/N`, a readlink, so the
  target's filesystem is never touched: a hung NFS server cannot block the poll) that
  names a file open for reading gets its mount from `/proc/PID/fdinfo/N` (`mnt_id:`;
  write-only fds, logs and checkpoints being written, are left out), the mount its
  device from `/proc/PID/mountinfo` (`major:minor`), and the device its whole disks
  from `<sysfs>/dev/block/MAJ:MIN` (a partition's parent; an md/dm device's `slaves`).
  Network and pseudo filesystems (anonymous devices `0:N`) have no disk. Resolved when a
  process is first seen and at every scan (`scan_every` polls), at most `MAX_FDS` fds
  per process;
* those disks' `%util` and await (iostat's, from `/proc/diskstats` read once per poll
  for every job, only when some job has a disk);
* the NFS mount the job waits on (`nfsio.py`): of the NFS mounts its open files are on
  (where `fd/` is refused: of its mount namespace's), the one with the most READs in
  flight, named by server:/export and mount point, with its READs' mean round trip and
  total time, READs in flight and bytes read, from the client's `mountstats`;
* the share of the job's processes in uninterruptible sleep (`D`: waiting for I/O) at
  the poll, from `/proc/PID/stat`, which also gives the CPU each last ran on and the
  major page faults (`majflt`: a fault that waited for a read, from swap or of a
  mapped file's page not in the page cache), as a rate between two polls;
* on those CPUs (`/proc/stat` per-CPU lines, read once per poll): the iowait share,
  and the largest share of one CPU's time spent in hard and soft interrupt handlers.

Work per poll: two small reads per process of the job (io, stat) plus two node files;
the fd walk only at scans. Only the GPU jobs' processes are read, never all of /proc.
A process that exits while read drops out of this poll; an unreadable file (`io` needs
the daemon to be root or hold CAP_SYS_PTRACE for another user's process) leaves out
the facts it feeds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.metrics import GPU_LABELS, MetricSpec, Sample, gauge
from gpuwatchd.sources.base import read_file
from gpuwatchd.sources.cpu import IOWAIT, IRQ, SOFTIRQ, StatLines, cpu_deltas
from gpuwatchd.sources.disks import (
    DiskStat,
    DiskstatsError,
    IostatRates,
    iostat,
    parse_diskstats,
    whole_disks,
)
from gpuwatchd.sources.mountstats import NFS_TYPES, MountRow, parse_mounts
from gpuwatchd.sources.nfsio import NfsRates, NfsReads

MAX_FDS = 1024  # fds looked at per process and scan (a loader keeps few files open)
MAX_DISKS = 16  # disks remembered per process


def _gpu(name: str, help: str) -> MetricSpec:
    """The job's I/O evidence: the rules read it; exported with `detail_metrics`."""
    return gauge(name, help, GPU_LABELS, "detail")


READ_BYTES = _gpu(
    "gpu_process_read_bytes_per_second",
    "Bytes the GPU's main process and its children read from storage (/proc/PID/io "
    "read_bytes: page-cache hits not counted).",
)
BLOCKED = _gpu(
    "gpu_process_io_blocked_ratio",
    "Share of the main process and its children in uninterruptible sleep (D, waiting "
    "for I/O) at the poll.",
)
DISKS = _gpu(
    "gpu_process_disks",
    "Disks the files the main process and its children have open are on (0: none, or "
    "only network/pseudo filesystems).",
)
DISK_UTIL = _gpu(
    "gpu_process_disk_utilization_ratio",
    "iostat %util / 100 of the busiest disk the job's open files are on.",
)
DISK_AWAIT = _gpu(
    "gpu_process_disk_await_seconds",
    "iostat await of the busiest disk the job's open files are on.",
)
DISK_BUSIEST = gauge(
    "gpu_process_disk_busiest",
    "1 on the busiest disk the job's open files are on, named by `device` (the disk a "
    "storage page points at).",
    (*GPU_LABELS, "device"),
    "detail",
)
NFS_MOUNT = gauge(
    "gpu_process_nfs_mount",
    "1 on the NFS mount the job waits on (of those its open files are on; where fd/ is "
    "refused, of its mount namespace): the most READs in flight, named by `device` "
    "(server:/export) and `mountpoint` (as the job sees it); `tie` says which: `open "
    "files` or `mount namespace`.",
    (*GPU_LABELS, "device", "mountpoint", "tie"),
    "detail",
)
NFS_RTT = _gpu(
    "gpu_process_nfs_read_rtt_seconds",
    "Mean READ round trip (sent to reply: server and network) on the job's NFS mount "
    "since the last poll (mountstats).",
)
NFS_EXECUTE = _gpu(
    "gpu_process_nfs_read_execute_seconds",
    "Mean time a READ took in all on the job's NFS mount (the client's queueing "
    "included) since the last poll (mountstats).",
)
NFS_IN_FLIGHT = _gpu(
    "gpu_process_nfs_reads_in_flight",
    "READs outstanding on average on the job's NFS mount since the last poll (READ "
    "time per second, every reader of the mount).",
)
NFS_READ_BYTES = _gpu(
    "gpu_process_nfs_read_bytes_per_second",
    "Bytes the job's NFS mount received in READ replies (every reader of the mount).",
)
CPU_IOWAIT = _gpu(
    "gpu_process_cpu_iowait_ratio",
    "iowait share of the CPUs the main process and its children last ran on.",
)
MAJOR_FAULTS = _gpu(
    "gpu_process_major_faults_per_second",
    "Major page faults of the main process and its children (/proc/PID/stat majflt: "
    "faults that waited for a read, from swap or of an uncached mapped file).",
)
CPU_IRQ = _gpu(
    "gpu_process_cpu_interrupt_ratio",
    "Largest share of one CPU's time in hard and soft interrupt handlers, over the CPUs "
    "the main process and its children last ran on.",
)
METRICS = (
    READ_BYTES, BLOCKED, MAJOR_FAULTS, DISKS, DISK_UTIL, DISK_AWAIT, DISK_BUSIEST, CPU_IOWAIT,
    CPU_IRQ, NFS_MOUNT, NFS_RTT, NFS_EXECUTE, NFS_IN_FLIGHT, NFS_READ_BYTES,
)  # fmt: skip


# -- parsers (pure; ValueError on garbage) -----------------------------------------------


def parse_io(data: bytes) -> dict[str, int]:
    """/proc/PID/io (`rchar: 750339` lines) as {key: value}; a malformed line is
    skipped (a negative value: the kernel prints `cancelled_write_bytes` as signed)."""
    values: dict[str, int] = {}
    for line in data.split(b"\n"):
        key, sep, value = line.partition(b":")
        value = value.strip()
        if sep and value.isdigit() and len(value) <= 20:
            values[key.strip().decode("ascii", "replace")] = int(value)
    if "read_bytes" not in values:
        raise ValueError("no read_bytes line")
    return values


def read_bytes_of(data: bytes) -> int:
    """`read_bytes` of a /proc/PID/io without parsing the rest (the per-poll read)."""
    at = data.find(b"read_bytes:")
    if at < 0 or (at and data[at - 1] != 0x0A):  # not `cancelled_…`/`…read_bytes` of a line
        at = data.find(b"\nread_bytes:") + 1
        if at <= 0:
            raise ValueError("no read_bytes line")
    value = data[at + 11 :].split(b"\n", 1)[0].strip()
    if not value.isdigit() or len(value) > 20:
        raise ValueError(f"read_bytes is not a count: {value[:30]!r}")
    return int(value)


def parse_mountinfo(data: bytes) -> dict[int, tuple[int, int]]:
    """/proc/PID/mountinfo as {mount id: (major, minor)} (proc_pid_mountinfo(5))."""
    return {row.mount_id: row.device for row in parse_mounts(data)}


def fdinfo_mount(data: bytes) -> int | None:
    """The `mnt_id:` of a /proc/PID/fdinfo/N (kernels 3.15+) of an fd open for reading;
    None without one, or for a write-only fd (`flags:` in octal, O_ACCMODE 1): a log,
    TensorBoard events or a checkpoint being written is not where the input comes from."""
    at = data.find(b"mnt_id:")
    if at < 0:
        return None
    value = data[at + 7 :].split(b"\n", 1)[0].strip()
    flags_at = data.find(b"flags:")
    if flags_at >= 0:
        flags = data[flags_at + 6 :].split(b"\n", 1)[0].strip()
        if flags.isdigit() and len(flags) < 16 and int(flags, 8) & 3 == 1:  # O_WRONLY
            return None
    return int(value) if value.isdigit() and len(value) < 12 else None


def is_file_target(target: str) -> bool:
    """An fd link that names a file on a filesystem: not a socket, pipe, anon inode,
    memfd, device node or kernel pseudo-file."""
    return (
        target.startswith("/")
        and not target.startswith(("/dev/", "/proc/", "/sys/", "/memfd:"))
        and target != "/"
    )


def stat_state(data: bytes) -> tuple[str, int, int, int]:
    """(state, major faults, start time, processor) from a /proc/PID/stat: fields 3,
    12, 22 and 39."""
    rest = data[data.rindex(b")") + 2 :].split()
    if len(rest) < 37 or not (rest[9].isdigit() and rest[19].isdigit() and rest[36].isdigit()):
        raise ValueError("no majflt, starttime or processor field")
    return rest[0][:1].decode("ascii", "replace"), int(rest[9]), int(rest[19]), int(rest[36])


def cpu_shares(
    now: StatLines, before: StatLines | None, cpus: Iterable[int]
) -> tuple[float | None, float | None]:
    """(iowait share over `cpus` together, largest irq + softirq share of one of them)
    between two /proc/stat readings; (None, None) when none of them moved."""
    if before is None:
        return None, None
    total = iowait = 0
    irq: float | None = None
    for cpu in cpus:
        a, b = now.line(cpu), before.line(cpu)
        if a is None or b is None:
            continue
        deltas = cpu_deltas(a, b)
        spent = sum(deltas)
        if spent <= 0:
            continue
        total += spent
        iowait += deltas[IOWAIT]
        share = (deltas[IRQ] + deltas[SOFTIRQ]) / spent
        irq = share if irq is None or share > irq else irq
    return (iowait / total if total else None), irq


# -- the tracker ---------------------------------------------------------------------------


@dataclass
class JobIoFacts:
    """One main process and its children, this poll."""

    read_bytes_per_second: float | None = None
    blocked_ratio: float | None = None
    major_faults_per_second: float | None = None
    disks: tuple[str, ...] | None = None  # None: not resolved (unreadable)
    disk: IostatRates | None = None  # the busiest of `disks`
    disk_name: str | None = None  # ... its name
    nfs: tuple[MountRow, NfsReads] | None = None  # the NFS mount it waits on, its READs
    nfs_tie: str = "open files"  # how it was tied to the job: or "mount namespace"
    cpus: frozenset[int] = frozenset()
    iowait_ratio: float | None = None
    interrupt_ratio: float | None = None


@dataclass
class _Proc:
    start: int  # the stat line's starttime text, to tell a reused pid
    at: float = 0.0
    read_bytes: int | None = None
    faults_at: float = 0.0
    major_faults: int | None = None
    disks: tuple[str, ...] | None = None
    nfs: tuple[MountRow, ...] = ()  # NFS mounts of its open files (or its namespace)
    scanned: bool = False  # its fds looked at once (refused: again only at scans)


class JobIo:
    """Per-job I/O attribution; `begin` each poll, `read` per job, `end` to forget."""

    def __init__(
        self, procfs: str, sysfs: str, complain: Callable[[str, str], None] | None = None
    ) -> None:
        self._proc = procfs
        self._sys = sysfs
        self._complain = complain or (lambda kind, message: None)
        self._procs: dict[int, _Proc] = {}
        self._devices: dict[tuple[int, int], tuple[str, ...]] = {}  # MAJ:MIN -> disks
        self._stat: StatLines | None = None  # a job's CPUs' lines parsed, kept for the next
        self._stat_before: StatLines | None = None
        self._stat_read = False
        self._nfs = NfsRates(procfs, self._complain)
        self._disk_last: dict[str, tuple[float, DiskStat]] = {}
        # this poll's /proc/diskstats: disk -> (seconds, last reading, this one), read
        # once for every job; a disk's rates worked out when a job has it (_rates_of)
        self._disk_pairs: dict[str, tuple[float, DiskStat, DiskStat]] | None = None
        self._disk_rates: dict[str, IostatRates | None] = {}
        self._now = 0.0
        self._seen: set[int] = set()
        self.facts: dict[int, JobIoFacts] = {}  # main pid -> this poll's facts

    def begin(self, now: float) -> None:
        self._now = now
        self._stat_read = False
        self._disk_pairs = None
        self._disk_rates = {}
        self._seen = set()
        self.facts = {}
        self._nfs.begin(now)

    def end(self) -> None:
        """Forget processes not read this poll."""
        for pid in [p for p in self._procs if p not in self._seen]:
            del self._procs[pid]
        if not any(f.disks for f in self.facts.values()):
            self._disk_last.clear()

    def read(
        self,
        main: int,
        children: Sequence[int],
        rescan: bool,
        stats: Mapping[int, bytes] | None = None,
    ) -> JobIoFacts:
        """A job's facts; `stats`: /proc/PID/stat of some of its processes, as the
        caller read them just now (the others are read here)."""
        facts = JobIoFacts()
        rate = faults = 0.0
        rated = faults_rated = False
        blocked = counted = 0
        disks: set[str] = set()
        nfs: dict[tuple[int, int], MountRow] = {}
        by_namespace = False
        resolved = False
        cpus: set[int] = set()
        for pid in [main, *children]:
            base = f"{self._proc}/{pid}"
            try:
                raw = stats.get(pid) if stats else None
                raw = read_file(f"{base}/stat", 4096) if raw is None else raw[:4096]
                state, majflt, start, cpu = stat_state(raw)
            except (OSError, ValueError):
                continue  # exited, or not a process
            proc = self._procs.get(pid)
            if proc is None or proc.start != start:
                proc = self._procs[pid] = _Proc(start)
            self._seen.add(pid)
            counted += 1
            blocked += state == "D"
            cpus.add(cpu)
            if proc.major_faults is not None and self._now > proc.faults_at:
                faults += max(0, majflt - proc.major_faults) / (self._now - proc.faults_at)
                faults_rated = True
            proc.major_faults, proc.faults_at = majflt, self._now
            try:
                value = read_bytes_of(read_file(f"{base}/io", 4096))
            except (OSError, ValueError) as e:
                if not isinstance(e, FileNotFoundError):
                    self._complain("io", f"{base}/io: {e}")
            else:
                # a process first seen is the baseline (its past reads are not this poll's)
                if proc.read_bytes is not None and self._now > proc.at:
                    rate += max(0, value - proc.read_bytes) / (self._now - proc.at)
                    rated = True
                proc.read_bytes, proc.at = value, self._now
            if not proc.scanned or rescan:
                proc.disks, proc.nfs = self._open_disks(base, pid == main)
                proc.scanned = True
            nfs.update((row.device, row) for row in proc.nfs)
            by_namespace |= proc.disks is None and bool(proc.nfs)
            if proc.disks is not None:
                resolved = True
                disks.update(proc.disks)
        if rated:
            facts.read_bytes_per_second = rate
        if faults_rated:
            facts.major_faults_per_second = faults
        if counted:
            facts.blocked_ratio = blocked / counted
            facts.cpus = frozenset(cpus)
        if resolved:
            facts.disks = tuple(sorted(disks))
            facts.disk_name, facts.disk = self._busiest(facts.disks)
        if nfs:
            facts.nfs = self._nfs.busiest(main, nfs.values())
            facts.nfs_tie = "mount namespace" if by_namespace else "open files"
        if cpus:
            self._read_stat()
            if self._stat is not None:
                facts.iowait_ratio, facts.interrupt_ratio = cpu_shares(
                    self._stat, self._stat_before, sorted(cpus)
                )
        self.facts[main] = facts
        return facts

    def samples(self, main: int, labels: tuple[str, ...], out: list[Sample]) -> None:
        facts = self.facts.get(main)
        if facts is None:
            return
        values = (
            (READ_BYTES, facts.read_bytes_per_second),
            (BLOCKED, facts.blocked_ratio),
            (MAJOR_FAULTS, facts.major_faults_per_second),
            (DISKS, None if facts.disks is None else len(facts.disks)),
            (DISK_UTIL, None if facts.disk is None else facts.disk.utilization_ratio),
            (DISK_AWAIT, None if facts.disk is None else facts.disk.await_seconds),
            (CPU_IOWAIT, facts.iowait_ratio),
            (CPU_IRQ, facts.interrupt_ratio),
        )
        for spec, value in values:
            if value is not None:
                out.append(Sample(spec.name, labels, float(value)))
        if facts.disk_name is not None:
            out.append(Sample(DISK_BUSIEST.name, (*labels, facts.disk_name), 1.0))
        if facts.nfs is not None:
            row, reads = facts.nfs
            names = (*labels, row.source, row.mountpoint, facts.nfs_tie)
            out.append(Sample(NFS_MOUNT.name, names, 1.0))
            for spec, value in (
                (NFS_RTT, reads.rtt_seconds),
                (NFS_EXECUTE, reads.execute_seconds),
                (NFS_IN_FLIGHT, reads.in_flight),
                (NFS_READ_BYTES, reads.bytes_per_second),
            ):
                if value is not None:
                    out.append(Sample(spec.name, labels, value))

    # -- disks -------------------------------------------------------------------------

    def _open_disks(
        self, base: str, main: bool
    ) -> tuple[tuple[str, ...] | None, tuple[MountRow, ...]]:
        """Whole disks under the files the process has open (None if unreadable), and
        the NFS mounts they are on (where fd/ is refused: the NFS mounts of the main
        process's namespace, which its workers share)."""
        try:
            fds = os.listdir(f"{base}/fd")
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                return None, ()
            why = "needs root, or CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH"
            self._complain("fd", f"{base}/fd: {e} ({why})")
            rows = self._mounts(base) if main else None
            return None, tuple(r for r in rows or () if r.fstype in NFS_TYPES)
        mount_ids: set[int] = set()
        for fd in fds[:MAX_FDS]:
            try:
                if not is_file_target(os.readlink(f"{base}/fd/{fd}")):
                    continue
                mount = fdinfo_mount(read_file(f"{base}/fdinfo/{fd}", 4096))
            except OSError:
                continue  # closed meanwhile
            if mount is not None:
                mount_ids.add(mount)
        if not mount_ids:
            return (), ()
        rows = self._mounts(base)
        if rows is None:
            return None, ()
        by_id = {row.mount_id: row for row in rows}
        disks: set[str] = set()
        nfs: list[MountRow] = []
        for mount in mount_ids:
            row = by_id.get(mount)
            if row is None:
                continue
            if row.fstype in NFS_TYPES:
                nfs.append(row)
            if row.device[0] == 0:
                continue  # anonymous device: NFS, overlay upper, tmpfs
            names = self._devices.get(row.device)
            if names is None:
                names = whole_disks(self._sys, *row.device)
                if len(self._devices) > 4096:
                    self._devices.clear()
                self._devices[row.device] = names
            disks.update(names)
        return tuple(sorted(disks))[:MAX_DISKS], tuple(nfs[:MAX_DISKS])

    def _mounts(self, base: str) -> list[MountRow] | None:
        try:
            return parse_mounts(read_file(f"{base}/mountinfo", 4 << 20))
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                self._complain("mountinfo", f"{base}/mountinfo: {e}")
            return None

    def _busiest(self, disks: Sequence[str]) -> tuple[str | None, IostatRates | None]:
        """The busiest of `disks` by %util: its name and rates (None, None: none known)."""
        if not disks:
            return None, None
        if self._disk_pairs is None:
            self._disk_pairs = self._read_diskstats()
        best: tuple[str | None, IostatRates | None] = (None, None)
        for name in disks:
            rates = self._rates_of(name)
            if rates is not None and (
                best[1] is None or rates.utilization_ratio > best[1].utilization_ratio
            ):
                best = (name, rates)
        return best

    def _read_diskstats(self) -> dict[str, tuple[float, DiskStat, DiskStat]]:
        path = f"{self._proc}/diskstats"
        try:
            stats = parse_diskstats(read_file(path).decode("utf-8", "replace"))
        except (OSError, DiskstatsError) as e:
            self._complain("diskstats", f"{path}: {e}")
            return {}
        pairs: dict[str, tuple[float, DiskStat, DiskStat]] = {}
        now = self._now
        for name, cur in stats.items():
            before = self._disk_last.get(name)
            if before is not None and now > before[0]:
                pairs[name] = (now - before[0], before[1], cur)
            if before is None or now > before[0]:
                self._disk_last[name] = (now, cur)
        return pairs

    def _rates_of(self, disk: str) -> IostatRates | None:
        """The disk's iostat rates this poll (None: first seen, or reset)."""
        if disk not in self._disk_rates:
            pair = (self._disk_pairs or {}).get(disk)
            self._disk_rates[disk] = None if pair is None else iostat(pair[1], pair[2], pair[0])
        return self._disk_rates[disk]

    # -- CPUs --------------------------------------------------------------------------

    def _read_stat(self) -> None:
        if self._stat_read:
            return
        self._stat_read = True
        path = f"{self._proc}/stat"
        try:
            reading = StatLines(read_file(path).decode("utf-8", "replace"))
        except (OSError, ValueError) as e:
            self._complain("stat", f"{path}: {e}")
            return
        self._stat_before, self._stat = self._stat, reading


__all__ = [
    "METRICS",
    "JobIo",
    "JobIoFacts",
    "cpu_shares",
    "fdinfo_mount",
    "is_file_target",
    "parse_io",
    "parse_mountinfo",
    "read_bytes_of",
    "stat_state",
]
