"""How fast a GPU job's NFS mounts answer its reads, for `procio.JobIo`.

A DataLoader reading its dataset from NFS waits on the server, not on a local disk: its
workers sit in D, its CPUs show iowait, and no disk of the node is busy. The NFS client
counts every READ it sends per mount (`mountstats.py`); between two polls that gives
the mean READ round trip (`rtt`: the server and the network), the mean time a READ took
in all (`execute`: with the client's own queueing, e.g. out of RPC slots), the READs in
flight on average (execute time per second: a job waiting on reads keeps some in
flight) and the bytes read.

Where the statistics come from, and what each privilege mode reads:

* the daemon's own `/proc/self/mountstats` and `mountinfo` (always readable: its own):
  every NFS mount of its mount namespace, read once per poll. The systemd unit runs in
  the host's namespace (ProtectSystem keeps it a copy), where jobs outside containers
  and kubelet's mounts of pods' NFS volumes are;
* for a mount not there, the job's own `/proc/PID/mountstats` (mode 0400, its owner's:
  root or CAP_DAC_READ_SEARCH for another user's job) with its `mountinfo`: a
  container's mounts, read from a DaemonSet with `components/ptrace`.

Which mounts are the job's: its open files' (fdinfo `mnt_id`; `fd/` needs
CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH for another user's process), else, where `fd/`
is refused, every NFS mount of its mount namespace (`/proc/PID/mountinfo` is
world-readable): a container's are its own volumes; on a host, every NFS mount there.
Of those, the one where the most READ time accrues is the one the job waits on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwatchd.sources.base import read_file
from gpuwatchd.sources.mountstats import (
    MountRow,
    OpStats,
    nfs_by_device,
    parse_mounts,
    parse_mountstats,
)

MAX_MOUNTS = 4096  # superblocks remembered between polls
Device = tuple[int, int]


@dataclass(frozen=True)
class NfsReads:
    """One NFS mount's READs between two polls."""

    rtt_seconds: float | None  # mean READ round trip; None: no READ completed
    execute_seconds: float | None  # mean READ time in all (queueing included)
    in_flight: float  # READs outstanding on average (execute time per second)
    bytes_per_second: float  # READ replies' bytes (payload and RPC headers)


def reads_between(before: OpStats, now: OpStats, seconds: float) -> NfsReads | None:
    """The READ rates between two per-op readings; None across a counter reset (a
    remount: the counters start again)."""
    ops = now.ops - before.ops
    if seconds <= 0 or ops < 0 or now.execute_ms < before.execute_ms:
        return None
    rtt = (now.rtt_ms - before.rtt_ms) / 1000
    execute = (now.execute_ms - before.execute_ms) / 1000
    return NfsReads(
        rtt / ops if ops else None,
        execute / ops if ops else None,
        execute / seconds,
        max(0, now.bytes_received - before.bytes_received) / seconds,
    )


class NfsRates:
    """Per-superblock READ rates; `begin` each poll, then `busiest` per job."""

    def __init__(self, procfs: str, complain: Callable[[str, str], None]) -> None:
        self._proc = procfs
        self._complain = complain
        self._last: dict[Device, tuple[float, OpStats]] = {}
        self._now = 0.0
        self._read: dict[str, dict[Device, OpStats]] = {}  # this poll: namespace -> stats
        self._rates: dict[Device, NfsReads | None] = {}

    def begin(self, now: float) -> None:
        self._now = now
        self._read = {}
        self._rates = {}

    def busiest(self, main: int, rows: Iterable[MountRow]) -> tuple[MountRow, NfsReads] | None:
        """Of the job's NFS mounts `rows`, the one with the most READs in flight, and its
        rates; None where none has two readings yet."""
        best: tuple[MountRow, NfsReads] | None = None
        for row in rows:
            reads = self._rate(main, row.device)
            if reads is not None and (best is None or reads.in_flight > best[1].in_flight):
                best = (row, reads)
        return best

    def _rate(self, main: int, device: Device) -> NfsReads | None:
        if device in self._rates:
            return self._rates[device]
        op = self._stats("self").get(device)
        if op is None:
            op = self._stats(str(main)).get(device)
        reads = None
        if op is not None:
            last = self._last.get(device)
            if last is not None and self._now > last[0]:
                reads = reads_between(last[1], op, self._now - last[0])
            if last is None or self._now > last[0]:
                if len(self._last) > MAX_MOUNTS:
                    self._last.clear()
                self._last[device] = (self._now, op)
        self._rates[device] = reads
        return reads

    def _stats(self, pid: str) -> dict[Device, OpStats]:
        """The READ counters of the NFS mounts in `pid`'s namespace, read once a poll."""
        known = self._read.get(pid)
        if known is not None:
            return known
        base = f"{self._proc}/{pid}"
        stats: dict[Device, OpStats] = {}
        try:
            rows = parse_mounts(read_file(f"{base}/mountinfo", 4 << 20))
            mounts = parse_mountstats(read_file(f"{base}/mountstats", 16 << 20))
        except (OSError, ValueError) as e:
            if not isinstance(e, FileNotFoundError) and pid == "self":
                self._complain("mountstats", f"{base}/mountstats: {e}")
        else:
            for device, (_, ops) in nfs_by_device(rows, mounts).items():
                if "READ" in ops:
                    stats[device] = ops["READ"]
        self._read[pid] = stats
        return stats


__all__ = ["NfsRates", "NfsReads", "reads_between"]
