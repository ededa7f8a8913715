"""The simulator's per-process I/O: /proc/<pid>/{io,fd,fdinfo,mountinfo} of the GPU processes.

`ProcIoWriter(procfs_root, timeline, processes).write(t)` writes, for every running
process the `ProcessesWriter` `processes` writes, and for each of its workers:

* `io` (fs/proc/base.c `do_io_accounting`): `rchar wchar syscr syscw read_bytes
  write_bytes cancelled_write_bytes`, one `key: value` line each. `read_bytes`
  integrates `read_mb_s` (the main process) or `worker_read_mb_s` (each worker) ×
  10^6; `rchar` is read_bytes plus 1 MB/s of page-cache reads, `syscr` one per 128 KiB;
* `mountinfo` (fs/proc_namespace.c `show_mountinfo`): `/` on the first disk's
  partition 1, each other disk's partition 1 on `/mnt/<disk>`, proc, sysfs, devtmpfs
  and /dev/shm, then the NFS mounts (`node.host.nfs_mounts`, and a `reads_from` that
  names no disk of the node: `10.0.0.2:/<name>` on `/mnt/<name>`), on anonymous devices
  `0:N`, as network filesystems have;
* `mountstats` (`nfs.py`): of each main process (0400: refused to the unprivileged
  daemon), and the daemon's own `self/mountinfo` and `self/mountstats` (the host's
  namespace: the NFS mounts with `daemon_sees`), when the node has NFS mounts;
* `fd/N`: symlinks as the kernel shows them (`/dev/null`, `pipe:[…]`, `socket:[…]`,
  `anon_inode:[eventfd]`, `/dev/nvidiactl`, the main process's `/dev/nvidia0` and its
  log on the first disk (write-only: `flags` 0102001)), then two files of the
  dataset on the `reads_from` disk (default: the first disk),
  `<mount>/datasets/train/shard-<k>.tar`; `fdinfo/N` (`pos`, `flags`, `mnt_id`, `ino`)
  with the mount id of the fd's filesystem (sockfs, pipefs, anon_inodefs, devtmpfs or
  the dataset's mount).

A process's counters start from zero when it (re)starts, as the kernel's do. Device
numbers are the diskstats writer's (`device_numbers`), whose `<sysfs>/dev/block` links
resolve them to disks. Only changed files are written.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline
from gpuwatchd.sim.writers.disks import device_numbers, partition_name
from gpuwatchd.sim.writers.nfs import NfsStats, Row, mount_names, nfs_options
from gpuwatchd.sim.writers.processes import ProcessesWriter, worker_pid

CACHE_READ_BYTES = 1_000_000.0  # rchar beyond read_bytes per second: page-cache hits
SYSCALL_BYTES = 131_072  # one read syscall per 128 KiB
# mount ids of the pseudo filesystems fds point into (not in mountinfo, as on a host)
SOCKFS, PIPEFS, ANON_INODEFS = 9, 12, 13
NFS_MINOR = 52  # anonymous device minor of an NFS mount


def io_text(read_bytes: int, rchar: int, syscr: int) -> str:
    """/proc/<pid>/io for a process that reads `read_bytes` from storage."""
    return (
        f"rchar: {rchar}\nwchar: 52314\nsyscr: {syscr}\nsyscw: 211\n"
        f"read_bytes: {read_bytes}\nwrite_bytes: 4096\ncancelled_write_bytes: 0\n"
    )


def fdinfo_text(mount: int, pos: int, ino: int, flags: str = "02100000") -> str:
    """/proc/<pid>/fdinfo/N as seq_show prints it (5.x: pos, flags in octal, mnt_id, ino)."""
    return f"pos:\t{pos}\nflags:\t{flags}\nmnt_id:\t{mount}\nino:\t{ino}\n"


class ProcIoWriter:
    """Writes and updates the GPU processes' I/O files under the procfs root."""

    def __init__(self, procfs_root: Path, timeline: Timeline, processes: ProcessesWriter) -> None:
        self.proc = os.fspath(procfs_root)
        self.timeline = timeline
        self.processes = processes
        self.disks = [d.name for d in timeline.scenario.node.host.disks]
        self.numbers = device_numbers(self.disks)
        self.files = Files()
        self._integrator = Integrator()
        self._base: dict[Hashable, float] = {}
        # pid -> (workers, reads_from) as last written
        self._shape: dict[int, tuple[int, str]] = {}
        self._mounts: dict[str, tuple[int, str]] = {}  # reads_from -> (mount id, path)
        self.nfs = NfsStats(timeline, mount_names(timeline, self.disks), self.disks)
        self._rows = self._mount_table()
        self._mountinfo = "".join(row.mountinfo() for row in self._rows)
        # the daemon's own namespace: the host's, less what only the jobs mount
        self._own = [r for r in self._rows if r.nfs is None or r.nfs.daemon_sees]

    @property
    def writes(self) -> int:
        return self.files.writes

    def _mount_table(self) -> list[Row]:
        rows: list[Row] = []
        for i, disk in enumerate(self.disks):
            part = partition_name(disk)
            major, minor = self.numbers[part]
            mount_id = 24 if i == 0 else 29 + i
            point = "/" if i == 0 else f"/mnt/{disk}"
            fs = "ext4" if i == 0 else "xfs"
            options = "rw,errors=remount-ro" if i == 0 else "rw,attr2,inode64,noquota"
            parent = 1 if i == 0 else 24
            row = Row(mount_id, parent, f"{major}:{minor}", point, "rw,relatime",
                      f"shared:{i + 1}", fs, f"/dev/{part}", options)  # fmt: skip
            rows.append(row)
            self._mounts[disk] = (mount_id, point)
            if i == 0:
                rows += [
                    Row(25, 24, "0:22", "/sys", "rw,nosuid,nodev,noexec,relatime",
                        "shared:7", "sysfs", "sysfs", "rw"),
                    Row(26, 24, "0:23", "/proc", "rw,nosuid,nodev,noexec,relatime",
                        "shared:13", "proc", "proc", "rw"),
                    Row(27, 24, "0:5", "/dev", "rw,nosuid,relatime", "shared:2", "devtmpfs",
                        "udev", "rw,size=528275416k,nr_inodes=132068854,mode=755"),
                    Row(28, 27, "0:25", "/dev/shm", "rw,nosuid,nodev", "shared:4", "tmpfs",
                        "tmpfs", "rw"),
                ]  # fmt: skip
        for i, mount in enumerate(self.nfs.mounts):
            mount_id = 100 + i
            fstype = "nfs" if mount.version == "3" else "nfs4"
            rows.append(Row(mount_id, 24, f"0:{NFS_MINOR + i}", mount.point(), "rw,relatime",
                            f"shared:{mount_id}", fstype, f"{mount.server}:{mount.export_path()}",
                            nfs_options(mount), mount))  # fmt: skip
            self._mounts[mount.name] = (mount_id, mount.point())
        return rows

    def _mount_of(self, reads_from: str) -> tuple[int, str]:
        """(mount id, mount point) of the filesystem a dataset on `reads_from` is on."""
        return self._mounts.get(reads_from, (0, "/"))

    def _write_mountstats(self, t: float, mains: list[int]) -> None:
        """The NFS client's statistics: the daemon's own namespace (/proc/self: the
        host's, without the mounts it does not see) and each main process's (0400, its
        owner's: refused to the unprivileged daemon)."""
        self.nfs.advance(t)
        self.files.put(f"{self.proc}/self/mountinfo", "".join(r.mountinfo() for r in self._own))
        self.files.put(f"{self.proc}/self/mountstats", self.nfs.mountstats(self._own, t))
        text = self.nfs.mountstats(self._rows, t) if self.processes.ptrace else ""
        for pid in mains:
            if self.processes.ptrace:
                self.files.put(f"{self.proc}/{pid}/mountstats", text)
            else:
                self.files.deny(f"{self.proc}/{pid}/mountstats")

    def write(self, t: float) -> int:
        before = self.writes
        host_values = self.timeline.host_state(t).get("processes") or {}
        plans: dict[int, tuple[dict[str, Any], int, str]] = {}
        for pid in sorted(self.processes.pids(t)):
            values = host_values.get(pid) or {}
            if values.get("running") is False:
                continue
            workers = max(0, int(values.get("workers") or 0))
            reads_from = str(values.get("reads_from") or (self.disks[0] if self.disks else "nfs"))
            plans[pid] = (values, workers, reads_from)
        for pid in [p for p in self._shape if p not in plans]:
            self._forget(pid, self._shape.pop(pid)[0])
        rates: dict[Hashable, float] = {}
        for pid, (values, workers, _) in plans.items():
            rates[(pid, 0)] = float(values.get("read_mb_s") or 0.0) * 1e6
            per_worker = float(values.get("worker_read_mb_s") or 0.0) * 1e6
            for k in range(workers):
                rates[(pid, k + 1)] = per_worker
        totals = self._integrator.advance(t, rates)
        for pid, (_, workers, reads_from) in plans.items():
            shape = self._shape.get(pid)
            born = shape is None
            if shape is not None and shape[0] > workers:
                for k in range(workers, shape[0]):
                    self._forget_dir(f"{self.proc}/{worker_pid(pid, k)}")
                    self._base.pop((pid, k + 1), None)
            static = shape != (workers, reads_from)
            for k in range(workers + 1):
                target = pid if k == 0 else worker_pid(pid, k - 1)
                key = (pid, k)
                fresh = born or (shape is not None and k > shape[0])
                if fresh or key not in self._base:
                    self._base[key] = totals.get(key, 0.0)
                read = int(totals.get(key, 0.0) - self._base[key])
                base = f"{self.proc}/{target}"
                if static or fresh:
                    self._write_static(base, target, reads_from, k == 0)
                # page-cache reads as if the process had run since the scenario began
                rchar = read + int(CACHE_READ_BYTES * max(0.0, t))
                if self.processes.ptrace:
                    io = io_text(read, rchar, rchar // SYSCALL_BYTES + 300)
                    self.files.put(f"{base}/io", io)
                else:
                    self.files.deny(f"{base}/io")
            self._shape[pid] = (workers, reads_from)
        if self.nfs.mounts:
            self._write_mountstats(t, list(plans))
        return self.writes - before

    def _write_static(self, base: str, pid: int, reads_from: str, main: bool) -> None:
        mount, point = self._mount_of(reads_from)
        prefix = point.rstrip("/")
        self.files.put(f"{base}/mountinfo", self._mountinfo)
        fds: list[tuple[str, int, str]] = [
            ("/dev/null", 27, "0100000"),
            (f"pipe:[{pid % 100000 + 41000}]", PIPEFS, "01"),
            (f"pipe:[{pid % 100000 + 41001}]", PIPEFS, "01"),
            (f"socket:[{pid % 100000 + 52000}]", SOCKFS, "02"),
            ("anon_inode:[eventfd]", ANON_INODEFS, "02004002"),
            ("/dev/nvidiactl", 27, "02100002"),
        ]
        if main:  # its GPU, and its log on the first disk (write-only, appending)
            fds.append(("/dev/nvidia0", 27, "02100002"))
            root_mount, root = self._mounts.get(self.disks[0], (0, "/")) if self.disks else (0, "/")
            fds.append((f"{root.rstrip('/')}/var/log/train/{pid}.log", root_mount, "0102001"))
        for k in range(2):
            shard = (pid * 2 + k) % 1024
            fds.append((f"{prefix}/datasets/train/shard-{shard:05d}.tar", mount, "0100000"))
        fd_dir = f"{base}/fd"
        if not self.processes.ptrace:  # fd/ refuses listing (fdinfo/ goes unread then)
            self.files.deny(fd_dir)
            return
        os.makedirs(fd_dir, exist_ok=True)
        wanted = {str(n): target for n, (target, _, _) in enumerate(fds)}
        for name in os.listdir(fd_dir):
            if wanted.get(name) != _readlink(f"{fd_dir}/{name}"):
                os.unlink(f"{fd_dir}/{name}")
        for name, target in wanted.items():
            if not os.path.islink(f"{fd_dir}/{name}"):
                os.symlink(target, f"{fd_dir}/{name}")
        for n, (target, mount_id, flags) in enumerate(fds):
            ino = 1_000_000 + pid % 100_000 * 16 + n
            pos = 1 << 20 if target.endswith(".tar") else 0
            self.files.put(f"{base}/fdinfo/{n}", fdinfo_text(mount_id, pos, ino, flags))

    def _forget(self, pid: int, workers: int) -> None:
        """The process stopped (the processes writer removed its directories)."""
        self._forget_dir(f"{self.proc}/{pid}")
        for k in range(workers):
            self._forget_dir(f"{self.proc}/{worker_pid(pid, k)}")
        for key in [key for key in self._base if isinstance(key, tuple) and key[0] == pid]:
            del self._base[key]

    def _forget_dir(self, directory: str) -> None:
        self.files.forget(directory)


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


__all__ = ["ProcIoWriter", "fdinfo_text", "io_text"]
