"""NFS client statistics per mount: /proc/PID/mountstats, tied to mountinfo's devices.

`mountstats` (fs/proc_namespace.c `show_vfsstat`, fs/nfs/super.c `nfs_show_stats`,
net/sunrpc/stats.c `rpc_clnt_show_stats`) has one `device D mounted on M with fstype T`
line per mount of the reader's mount namespace, in mountinfo's order; an NFS mount's
line ends in `statvers=1.1` and is followed by tab-indented `opts:`, `age:`, `events:`,
`bytes:` and `xprt:` lines, `per-op statistics`, one line per RPC procedure

    READ: ops trans timeouts bytes_sent bytes_recv queue rtt execute [errors]

(cumulative since the mount; times in milliseconds: `queue` waiting to be sent, `rtt`
from sending to the reply, `execute` from queueing to completion; `errors` since 5.3)
and a blank line. Field meanings are prometheus/procfs's (`NFSOperationStats`).

The counters belong to the NFS superblock, so every namespace that mounts it shows the
same; `nfs_by_device` keys them by the superblock's device (`0:N`, mountinfo's third
field), which is how an fd's mount (fdinfo `mnt_id` -> mountinfo) finds them. Reading
the file never talks to the server: a hung server cannot block the poll.
"""

from __future__ import annotations

from dataclasses import dataclass

NFS_TYPES = frozenset({"nfs", "nfs4"})
OP_FIELDS = 8  # ops trans timeouts bytes_sent bytes_recv queue rtt execute (errors: 5.3+)


@dataclass(frozen=True)
class MountRow:
    """A mountinfo line: proc_pid_mountinfo(5)'s fields 1, 3, 5, 9 and 10."""

    mount_id: int
    device: tuple[int, int]  # major, minor (0:N for NFS, as for every anonymous device)
    mountpoint: str  # as escaped by the kernel (\040 for a space), as mountstats has it
    fstype: str
    source: str  # NFS: server:/export


@dataclass(frozen=True)
class OpStats:
    """One per-op line's cumulative counts (prometheus/procfs NFSOperationStats)."""

    ops: int  # Requests
    transmissions: int  # Transmissions: more than ops when requests are retransmitted
    major_timeouts: int
    bytes_sent: int
    bytes_received: int
    queue_ms: int  # CumulativeQueueMilliseconds
    rtt_ms: int  # CumulativeTotalResponseMilliseconds
    execute_ms: int  # CumulativeTotalRequestMilliseconds
    errors: int = 0


@dataclass(frozen=True)
class NfsMount:
    """A mount's `device` line and, for NFS, its per-op statistics."""

    device: str  # server:/export
    mountpoint: str
    fstype: str
    ops: dict[str, OpStats] | None  # None: no statistics (not NFS)


def parse_mounts(data: bytes) -> list[MountRow]:
    """/proc/PID/mountinfo's rows in order; lines that are not mountinfo are skipped."""
    rows: list[MountRow] = []
    for line in data.decode("utf-8", "replace").split("\n"):
        fields = line.split(" ")
        if len(fields) < 10 or not fields[0].isdigit() or len(fields[0]) > 11:
            continue
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        major, colon, minor = fields[2].partition(":")
        if not (colon and major.isdigit() and minor.isdigit()) or len(fields) < sep + 3:
            continue
        rows.append(
            MountRow(int(fields[0]), (int(major), int(minor)), fields[4], fields[sep + 1],
                     fields[sep + 2])
        )  # fmt: skip
    return rows


def _op_line(words: list[str], where: str) -> OpStats:
    numbers = words[1:]
    if len(numbers) < OP_FIELDS or not all(n.isdigit() and len(n) <= 20 for n in numbers):
        raise ValueError(f"{where}: per-op line {' '.join(words)[:80]!r} is not 8-9 counts")
    values = [int(n) for n in numbers[: OP_FIELDS + 1]]
    return OpStats(*values)


def parse_mountstats(data: bytes) -> list[NfsMount]:
    """Every mount of a /proc/PID/mountstats, in order; ValueError on a malformed
    `device` line or per-op line (a truncated read ends the list where it was cut)."""
    mounts: list[NfsMount] = []
    ops: dict[str, OpStats] | None = None
    in_ops = False
    for line in data.decode("utf-8", "replace").split("\n"):
        words = line.split()
        if not words:
            in_ops = False
            continue
        if words[0] == "device" and not line[:1].isspace():
            if (
                len(words) < 8
                or words[2:4] != ["mounted", "on"]
                or words[5:7]
                != [
                    "with",
                    "fstype",
                ]
            ):
                raise ValueError(f"not a mountstats device line: {line[:100]!r}")
            ops = {} if len(words) > 8 and words[8].startswith("statvers=") else None
            mounts.append(NfsMount(words[1], words[4], words[7], ops))
            in_ops = False
        elif ops is not None and words == ["per-op", "statistics"]:
            in_ops = True
        elif ops is not None and in_ops and words[0].endswith(":"):
            ops[words[0][:-1]] = _op_line(words, mounts[-1].mountpoint)
    return mounts


def nfs_by_device(
    rows: list[MountRow], mounts: list[NfsMount]
) -> dict[tuple[int, int], tuple[MountRow, dict[str, OpStats]]]:
    """The NFS mounts' statistics by superblock device. mountinfo and mountstats list the
    same mounts in the same order when read together; where they differ (a mount came or
    went between the two reads) a mount point that is unique in both still pairs them."""
    pairs: list[tuple[MountRow, NfsMount]] = []
    if len(rows) == len(mounts) and all(
        r.mountpoint == m.mountpoint for r, m in zip(rows, mounts, strict=True)
    ):
        pairs = list(zip(rows, mounts, strict=True))
    else:
        by_point: dict[str, list[NfsMount]] = {}
        for m in mounts:
            by_point.setdefault(m.mountpoint, []).append(m)
        row_count: dict[str, int] = {}
        for r in rows:
            row_count[r.mountpoint] = row_count.get(r.mountpoint, 0) + 1
        for r in rows:
            found = by_point.get(r.mountpoint, [])
            if len(found) == 1 and row_count[r.mountpoint] == 1:
                pairs.append((r, found[0]))
    return {
        row.device: (row, mount.ops)
        for row, mount in pairs
        if mount.ops is not None and row.fstype in NFS_TYPES and mount.fstype in NFS_TYPES
    }


__all__ = [
    "NFS_TYPES",
    "MountRow",
    "NfsMount",
    "OpStats",
    "nfs_by_device",
    "parse_mounts",
    "parse_mountstats",
]
