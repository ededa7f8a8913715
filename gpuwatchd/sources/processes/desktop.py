"""Desktop processes, the fabric manager, and the /proc scan that finds them.

The scan also finds nvidia-fabricmanager's daemon (comm `nv-fabricmanage`, its name cut
at 15 bytes); like a desktop process, one found is looked at again on every poll
(`/proc/PID/comm`) until it exits, and `fabric_manager_processes` counts them. Any user
may read another's comm, so the unprivileged daemon sees root's fabric manager (unless
/proc is mounted with hidepid).

Display servers, compositors and desktop indexers (`DESKTOP_PROCESSES`) are never a
GPU's main process; `DesktopWatch` finds them in a scan of /proc every `scan_every`
polls (which also collects every ppid on kernels without task/*/children), follows the
ones found, and emits the node-wide desktop CPU series. See "Desktop and other tenants"
in gpuwatchd.sources.processes. A mixin of ProcessesSource, which sets the state it
declares.

A desktop name and an installed program's argv[0] are a process's own to choose (prctl,
`exec -a /usr/lib/xorg/Xorg`): a tenant so named was left out of its GPU's owner and
made desktop_on_gpu fire (issue 41). So a process counts only with the display server's
signature too (`DesktopWatch._signed`): on the host, not in a container, pod or job, and
running a system program's binary (/proc/PID/exe, where the daemon may read it: as root
or with CAP_SYS_PTRACE); where it may not (another user's process under the shipped
unit), running as root, on a virtual console, or as the login user of a session that has
a process on one (its compositor and indexer).
"""

from __future__ import annotations

import os
import stat as mode
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.config import ProcessesConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sources import processes as package
from gpuwatchd.sources.owner.cgroup import parse_cgroup
from gpuwatchd.sources.owner.process import parse_uid
from gpuwatchd.sources.processes.metrics import (
    DESKTOP_COUNT,
    DESKTOP_CPU,
    DESKTOP_CPU_BY_NAME,
    FABRIC_MANAGER,
)
from gpuwatchd.sources.processes.procfs import CLK_TCK, _is_count, parse_stat

# Display servers, compositors, greeters and desktop indexers that use a GPU or CPU on
# a training box. A name is matched against comm, which the kernel cuts at 15 bytes;
# these names are the only values of the `name` label.
DESKTOP_PROCESSES = (
    "Xorg",
    "X",
    "Xwayland",
    "gnome-shell",
    "mutter",
    "kwin_x11",
    "kwin_wayland",
    "plasmashell",
    "gdm",
    "gdm3",
    "gdm-x-session",
    "gdm-wayland-session",
    "gdm-session-worker",
    "sddm",
    "sddm-greeter",
    "lightdm",
    "xfwm4",
    "cinnamon",
    "weston",
    "sway",
    "Hyprland",
    "tracker-miner-fs",  # tracker-miner-fs-3 has the same 15-byte comm
    "tracker-extract",
    "gnome-software",
)
_DESKTOP_BY_COMM: dict[str, str] = {}
for _name in DESKTOP_PROCESSES:
    _DESKTOP_BY_COMM.setdefault(_name[:15], _name)


# nvidia-fabricmanager's daemon, nv-fabricmanager, as comm shows it (cut at 15 bytes)
FABRIC_MANAGER_COMM = "nv-fabricmanage"


def desktop_name(comm: str) -> str | None:
    """The DESKTOP_PROCESSES name a comm stands for, or None."""
    return _DESKTOP_BY_COMM.get(comm.strip()[:15])


# where a distribution installs programs: a desktop program's argv[0] lies under one
# (Xorg: /usr/lib/xorg/Xorg, /usr/libexec/Xorg; NixOS: /nix/store/…, /run/current-system/…)
SYSTEM_DIRS = (
    "/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/", "/nix/store/", "/run/current-system/", "/snap/"
)  # fmt: skip


def installed_desktop(cmdline: bytes) -> bool:
    """Whether /proc/PID/cmdline shows a desktop program run from where the system
    installs programs: argv[0] an absolute path under SYSTEM_DIRS naming one. A process
    that renamed itself (prctl PR_SET_NAME: its comm) keeps its own argv[0]."""
    argv0 = cmdline.split(b"\0", 1)[0].decode("utf-8", "replace")
    return (
        argv0.startswith(SYSTEM_DIRS)
        and "/../" not in argv0
        and desktop_name(argv0.rsplit("/", 1)[1]) is not None
    )


def signed_binary(target: str, binary: os.stat_result) -> bool:
    """Whether /proc/PID/exe shows a desktop program as the system installs it: `binary`
    (the file it runs) root's and writable by no one else, `target` (where it was) under
    SYSTEM_DIRS naming one. A tenant's own copy, or an interpreter run with another
    argv[0], is not."""
    path = target.removesuffix(" (deleted)")  # replaced by an upgrade while it runs
    return (
        binary.st_uid == 0
        and not binary.st_mode & (mode.S_IWGRP | mode.S_IWOTH)
        and path.startswith(SYSTEM_DIRS)
        and "/../" not in path
        and desktop_name(path.rsplit("/", 1)[1]) is not None
    )


@dataclass
class _Desktop:
    name: str  # from DESKTOP_PROCESSES
    start: int = -1
    at: float = 0.0
    ticks: int = 0


class DesktopWatch:
    """ProcessesSource's /proc scan and desktop processes."""

    settings: ProcessesConfig
    scans: int
    _proc: str
    _desktop: dict[int, _Desktop]
    _fabric_managers: set[int]  # pids of nv-fabricmanager found by a scan, while they run
    _consoles: set[int]  # login users with a process on a virtual console (the last scan)
    _children_file: bool
    _ppid_children: dict[int, list[int]]
    _complain: Callable[[str, str], None]

    def _scan(self) -> None:
        """Desktop processes by comm, the login users with a process on a virtual console
        (and, without task/*/children, every ppid), from each process's stat."""
        self.scans += 1
        try:
            entries = os.listdir(self._proc)
        except OSError as e:
            self._complain("scan", f"{self._proc}: {e}")
            return
        by_ppid: dict[int, list[int]] = {}
        consoles: set[int] = set()
        named: list[tuple[int, str]] = []
        managers: set[int] = set()
        for entry in entries:
            if not _is_count(entry):
                continue
            pid = int(entry)
            try:
                stat = parse_stat(package._read(f"{self._proc}/{entry}/stat", 4096))
                login = self._login_user(pid) if stat.on_console else None
            except (OSError, ValueError):
                continue
            by_ppid.setdefault(stat.ppid, []).append(pid)
            if login is not None:
                consoles.add(login)
            if self.settings.desktop and pid not in self._desktop and desktop_name(stat.comm):
                named.append((pid, stat.comm))
            if stat.comm == FABRIC_MANAGER_COMM:
                managers.add(pid)
        self._fabric_managers = managers
        self._consoles = consoles  # before judging: a compositor may be listed before its X
        for pid, comm in named:
            label = self._desktop_label(pid, comm, graphics=False)
            if label is not None:
                self._desktop[pid] = _Desktop(label)
        if not self._children_file:
            self._ppid_children = by_ppid

    def _desktop_label(self, pid: int, comm: str, graphics: bool) -> str | None:
        """The DESKTOP_PROCESSES name of a process, or None: its comm names one, it is on
        an NVML graphics list (a display server's context) or its cmdline shows the
        program installed (installed_desktop), and it has the signature (`_signed`)."""
        label = desktop_name(comm)
        if label is None:
            return None
        try:
            cmdline = b"" if graphics else package._read(f"{self._proc}/{pid}/cmdline", 4096)
            if not (graphics or installed_desktop(cmdline)):
                return None
            return label if self._signed(pid) else None
        except (OSError, ValueError):
            return None

    def _signed(self, pid: int) -> bool:
        """What a tenant cannot give its own process (module docstring): a host process
        running a system program's binary; where /proc/PID/exe is not the daemon's to read
        (EACCES; the simulator has none), one of root's, on a virtual console, or of a
        login user with a process on one. OSError, ValueError: gone or garbled."""
        base = f"{self._proc}/{pid}"
        place = parse_cgroup(package._read(f"{base}/cgroup", 65536).decode("utf-8", "replace"))
        if place.scheduler != "process":
            return False  # a container's, a pod's or a job's: a tenant's own
        try:
            target, binary = os.readlink(f"{base}/exe"), os.stat(f"{base}/exe")
        except OSError:
            pass
        else:
            return signed_binary(target, binary)
        if parse_uid(package._read(f"{base}/status", 65536)) == 0:
            return True
        if parse_stat(package._read(f"{base}/stat", 4096)).on_console:
            return True
        return place.uid is not None and place.uid in self._consoles

    def _login_user(self, pid: int) -> int | None:
        """The login user of a host process's systemd slice (user-U.slice), or None."""
        text = package._read(f"{self._proc}/{pid}/cgroup", 65536).decode("utf-8", "replace")
        place = parse_cgroup(text)
        return place.uid if place.scheduler == "process" else None

    def _desktop_samples(self, now: float, out: list[Sample]) -> None:
        total = 0.0
        rated = 0
        by_name: dict[str, float] = {}
        for pid, proc in list(self._desktop.items()):
            try:
                stat = parse_stat(package._read(f"{self._proc}/{pid}/stat", 4096))
            except (OSError, ValueError):
                del self._desktop[pid]  # exited (or unreadable: found again by a scan)
                continue
            if desktop_name(stat.comm) != proc.name:
                del self._desktop[pid]  # the pid now belongs to something else
                continue
            if proc.start == stat.starttime and now > proc.at:
                rate = max(0, stat.ticks - proc.ticks) / CLK_TCK / (now - proc.at)
                total += rate
                rated += 1
                by_name[proc.name] = by_name.get(proc.name, 0.0) + rate
            proc.start, proc.at, proc.ticks = stat.starttime, now, stat.ticks
        out.append(Sample(DESKTOP_COUNT.name, (), float(len(self._desktop))))
        if rated or not self._desktop:
            out.append(Sample(DESKTOP_CPU.name, (), total))
        for name, rate in sorted(by_name.items()):
            out.append(Sample(DESKTOP_CPU_BY_NAME.name, (name,), rate))

    def _fabric_manager_samples(self, out: list[Sample]) -> None:
        """How many fabric managers run: those a scan found that still run under that
        name (one small read each)."""
        self._fabric_managers = {pid for pid in self._fabric_managers if self._manager(pid)}
        out.append(Sample(FABRIC_MANAGER.name, (), float(len(self._fabric_managers))))

    def _manager(self, pid: int) -> bool:
        try:
            comm = package._read(f"{self._proc}/{pid}/comm", 4096)
        except OSError:
            return False  # exited
        return comm.decode("utf-8", "replace").rstrip("\n") == FABRIC_MANAGER_COMM
