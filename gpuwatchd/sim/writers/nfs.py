"""The simulator's NFS client statistics: /proc/PID/mountstats as the kernel prints it.

`NfsStats(timeline).advance(t)` integrates each NFS mount's per-op counters from the
scenario's `nfs` host values; `mountstats(rows, t)` renders a mount namespace's file:
one `device D mounted on M with fstype T` line per row of its mountinfo, in the same
order (fs/proc_namespace.c `show_vfsstat`), and for an NFS mount `statvers=1.1` and
what fs/nfs/super.c `nfs_show_stats` and net/sunrpc/stats.c print after it: `opts:`,
`age:`, `caps:`, `sec:`, `events:` (27 counts), `bytes:` (8: normal, direct and server
read/write bytes, read/write pages), `RPC iostats version: 1.1  p/v: 100003/V (nfs)`,
`xprt:\ttcp …` (13 fields), `per-op statistics` and one `%12s: ` line per procedure
(`ops trans timeouts bytes_sent bytes_recv queue rtt execute errors`; times in ms),
then a blank line.

Per mount (`nfs.<name>` host values): READs at `read_ops_per_second` (default: the read
bytes over `rsize`) carrying `read_mb_s` (default: what the processes reading from the
mount read), each taking `read_rtt_ms` (default 1) after `read_queue_ms` (default 0)
waiting to be sent, execute = queue + rtt + 0.05 ms; WRITEs alike. Other procedures
stay at the few calls an open and a few stats make (GETATTR, ACCESS, LOOKUP, OPEN).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.host import NfsMount
from gpuwatchd.sim.scenario import Timeline

CLIENT_MS = 0.05  # the client's own time in a call, beyond queue and round trip
READ_CALL, READ_REPLY = 212, 136  # RPC bytes beyond the payload (v4.1 compound)
WRITE_CALL, WRITE_REPLY = 236, 168
NFS_BOOT_AGE = 1000  # the node booted 1000 s before the scenario; mounts at boot
# v4.1's per-op lines, in the kernel's order (nfs4_procedures), a subset
V4_OPS = ("NULL", "READ", "WRITE", "COMMIT", "OPEN", "OPEN_CONFIRM", "OPEN_NOATTR",
          "OPEN_DOWNGRADE", "CLOSE", "SETATTR", "FSINFO", "RENEW", "SETCLIENTID",
          "SETCLIENTID_CONFIRM", "LOCK", "LOCKT", "LOCKU", "ACCESS", "GETATTR", "LOOKUP",
          "LOOKUP_ROOT", "REMOVE", "RENAME", "LINK", "SYMLINK", "CREATE", "PATHCONF",
          "STATFS", "READLINK", "READDIR", "SERVER_CAPS", "DELEGRETURN", "GETACL",
          "SETACL", "FS_LOCATIONS", "RELEASE_LOCKOWNER", "SECINFO", "FSID_PRESENT",
          "EXCHANGE_ID", "CREATE_SESSION", "DESTROY_SESSION", "SEQUENCE",
          "GET_LEASE_TIME", "RECLAIM_COMPLETE")  # fmt: skip
V3_OPS = ("NULL", "GETATTR", "SETATTR", "LOOKUP", "ACCESS", "READLINK", "READ", "WRITE",
          "CREATE", "MKDIR", "SYMLINK", "MKNOD", "REMOVE", "RMDIR", "RENAME", "LINK",
          "READDIR", "READDIRPLUS", "FSSTAT", "FSINFO", "PATHCONF", "COMMIT")  # fmt: skip
# a few calls a second of metadata besides the data (an open and a few stats a shard)
METADATA_OPS = {"GETATTR": 6.0, "ACCESS": 1.0, "LOOKUP": 1.0, "OPEN": 0.5, "CLOSE": 0.5}


@dataclass(frozen=True)
class Row:
    """A mount as mountinfo and mountstats show it."""

    mount_id: int
    parent: int
    device: str  # major:minor
    point: str
    options: str
    optional: str
    fstype: str
    source: str
    super_options: str
    nfs: NfsMount | None = None

    def mountinfo(self) -> str:
        return (
            f"{self.mount_id} {self.parent} {self.device} / {self.point} {self.options} "
            f"{self.optional} - {self.fstype} {self.source} {self.super_options}\n"
        )


def nfs_options(mount: NfsMount) -> str:
    vers = f"vers={mount.version}"
    return (
        f"rw,relatime,{vers},rsize={mount.rsize},wsize={mount.rsize},namlen=255,hard,"
        f"proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.100,local_lock=none,"
        f"addr={mount.server}"
    )


def mount_names(timeline: Timeline, disks: list[str]) -> list[NfsMount]:
    """The node's NFS mounts: those declared, then every `reads_from` that is neither a
    disk nor declared (with the defaults), in the order the scenario names them."""
    host = timeline.scenario.node.host
    mounts = list(host.nfs_mounts)
    known = {m.name for m in mounts} | set(disks)
    values = [timeline.scenario.node.initial_host] + [p.host for p in timeline.scenario.phases]
    for host_values in values:
        for process in (host_values.processes or {}).values():
            name = process.reads_from
            if name is not None and name not in known:
                mounts.append(NfsMount(name=name))
                known.add(name)
    return mounts


class NfsStats:
    """The NFS mounts' cumulative per-op counters, integrated over the scenario."""

    def __init__(self, timeline: Timeline, mounts: list[NfsMount], disks: list[str]) -> None:
        self.timeline = timeline
        self.mounts = mounts
        self._first_disk = disks[0] if disks else "nfs"
        self._integrator = Integrator()
        self.totals: dict[Hashable, float] = {}

    def advance(self, t: float) -> None:
        host = self.timeline.host_state(t)
        values = host.get("nfs") or {}
        reads = self._process_reads(host.get("processes") or {})
        rates: dict[Hashable, float] = {}
        for mount in self.mounts:
            v: dict[str, Any] = values.get(mount.name) or {}
            for op, default_bytes in (("read", reads.get(mount.name, 0.0)), ("write", 0.0)):
                mb = v.get(f"{op}_mb_s")
                payload = default_bytes if mb is None else float(mb) * 1e6
                ops = v.get(f"{op}_ops_per_second")
                count = payload / mount.rsize if ops is None else float(ops)
                rtt_ms = v.get(f"{op}_rtt_ms")
                rtt = 1.0 if rtt_ms is None else float(rtt_ms)
                queue = float(v.get(f"{op}_queue_ms") or 0.0)
                name, upper = mount.name, op.upper()
                rates[(name, upper, "ops")] = count
                rates[(name, upper, "bytes")] = payload
                rates[(name, upper, "queue")] = count * queue
                rates[(name, upper, "rtt")] = count * rtt
                rates[(name, upper, "execute")] = count * (queue + rtt + CLIENT_MS)
            for op, per_second in METADATA_OPS.items():
                rates[(mount.name, op, "ops")] = per_second
                rates[(mount.name, op, "rtt")] = per_second * 0.3
                rates[(mount.name, op, "execute")] = per_second * (0.3 + CLIENT_MS)
        self.totals = self._integrator.advance(t, rates)

    def _process_reads(self, processes: dict[int, Any]) -> dict[str, float]:
        """Bytes/s each mount serves the processes that read from it."""
        reads: dict[str, float] = {}
        for values in processes.values():
            if values.get("running") is False:
                continue
            name = str(values.get("reads_from") or self._first_disk)
            workers = max(0, int(values.get("workers") or 0))
            rate = float(values.get("read_mb_s") or 0.0)
            rate += workers * float(values.get("worker_read_mb_s") or 0.0)
            reads[name] = reads.get(name, 0.0) + rate * 1e6
        return reads

    def _count(self, mount: str, op: str, what: str) -> int:
        return int(self.totals.get((mount, op, what), 0.0))

    def mountstats(self, rows: list[Row], t: float) -> str:
        """A namespace's /proc/PID/mountstats, its mountinfo being `rows`."""
        out: list[str] = []
        for row in rows:
            line = f"device {row.source} mounted on {row.point} with fstype {row.fstype}"
            if row.nfs is None:
                out.append(line + "\n")
            else:
                out.append(line + " statvers=1.1\n" + self._nfs_block(row, t))
        return "".join(out)

    def _nfs_block(self, row: Row, t: float) -> str:
        mount = row.nfs
        assert mount is not None
        name = mount.name
        ops = V3_OPS if mount.version == "3" else V4_OPS
        version = 3 if mount.version == "3" else 4
        read_bytes, write_bytes = (self._count(name, op, "bytes") for op in ("READ", "WRITE"))
        calls = sum(self._count(name, op, "ops") for op in ops)
        events = [0] * 27
        events[0] = self._count(name, "GETATTR", "ops")  # inoderevalidates
        events[4] = self._count(name, "OPEN", "ops")  # vfsopen
        events[5] = self._count(name, "LOOKUP", "ops")  # vfslookup
        events[9] = self._count(name, "READ", "ops")  # vfsreadpages
        events[17] = events[4]  # vfsrelease
        lines = [
            f"\topts:\t{nfs_options(mount)}\n",
            f"\tage:\t{int(NFS_BOOT_AGE + t)}\n",
            "\tcaps:\tcaps=0x3fffdf,wtmult=512,dtsize=1048576,bsize=0,namlen=255\n",
            "\tsec:\tflavor=1,pseudoflavor=1\n",
            f"\tevents:\t{' '.join(map(str, events))}\n",
            f"\tbytes:\t{read_bytes} {write_bytes} 0 0 {read_bytes} {write_bytes} "
            f"{read_bytes // 4096} {write_bytes // 4096}\n",
            f"\tRPC iostats version: 1.1  p/v: 100003/{version} (nfs)\n",
            f"\txprt:\ttcp 867 1 1 0 0 {calls} {calls} 0 {calls * 2} 0 64 0 {calls}\n",
            "\tper-op statistics\n",
        ]
        for op in ops:
            n = self._count(name, op, "ops")
            payload = self._count(name, op, "bytes")
            sent = payload + n * WRITE_CALL if op == "WRITE" else n * READ_CALL
            received = payload + n * READ_REPLY if op == "READ" else n * WRITE_REPLY
            if n == 0:
                sent = received = 0
            queue, rtt, execute = (self._count(name, op, w) for w in ("queue", "rtt", "execute"))
            lines.append(f"\t{op:>12}: {n} {n} 0 {sent} {received} {queue} {rtt} {execute} 0\n")
        lines.append("\n")
        return "".join(lines)


__all__ = ["NfsStats", "Row", "mount_names", "nfs_options"]
