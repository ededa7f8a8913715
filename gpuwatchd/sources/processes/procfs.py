"""Parsers of the /proc, sysfs and cgroup files the processes source reads.

Pure functions and records: bytes or text in, values out, ValueError on garbage. They
know nothing of the source's state, so the tests run them on captured fixtures; the
reading itself (and `_Gone`, a process that exited mid-read) is the package's
(gpuwatchd.sources.processes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

CLK_TCK = 100  # USER_HZ: /proc/PID/stat times are in 1/100 s on every Linux in use
MAX_CPUS = 1 << 16  # a cpulist naming a CPU beyond this is garbage
MAX_MAPS_BYTES = 64 << 20

_CONTAINER = re.compile(r"docker|containerd|kubepods|libpod|crio|cri-o|podman|lxc")
# a mapped CUDA runtime: /…/libcudart.so.12.1.105, /…/libcudart-d0da41ae.so.11.0,
# /…/nvidia/cuda_runtime/lib/libcudart.so.12
_CUDART = re.compile(rb"/libcudart(?:-[0-9a-f]{4,40})?\.so\.([0-9]{1,3})(?:\.([0-9]{1,3}))?")
_CPU_RANGE = re.compile(r"([0-9]{1,6})(?:-([0-9]{1,6}))?")


# -- parsers (pure: bytes or text in, values out, ValueError on garbage) ------------------


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of /proc/PID/stat (or task/TID/stat) this source uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    utime: int  # clock ticks (USER_HZ)
    stime: int
    threads: int
    starttime: int  # clock ticks after boot
    tty_nr: int = 0  # the controlling terminal's device number; 0: none

    @property
    def ticks(self) -> int:
        return self.utime + self.stime

    @property
    def on_console(self) -> bool:
        """Whether its controlling terminal is a virtual console (/dev/tty1-63: major 4):
        a session started at the machine, which a tenant logged in over the network, or
        a job its scheduler started, does not have (linux/kdev_t.h encodes the number)."""
        major = (self.tty_nr >> 8) & 0xFFF
        minor = (self.tty_nr & 0xFF) | ((self.tty_nr >> 12) & 0xFFF00)
        return major == 4 and 1 <= minor <= 63


def _is_count(text: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts "²" and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def _uint(token: bytes) -> int:
    if not token.isdigit() or len(token) > 20:
        raise ValueError(f"not a count: {token[:30]!r}")
    return int(token)


def parse_stat(data: bytes) -> Stat:
    """/proc/PID/stat. comm may hold spaces and parentheses, so the fields after it are
    found from the LAST ')'. Raises ValueError on anything else."""
    open_ = data.find(b"(")
    close = data.rfind(b")")
    if open_ < 1 or close < open_:
        raise ValueError("no '(comm)' field")
    rest = data[close + 1 :].split()
    if len(rest) < 20:
        raise ValueError(f"{len(rest) + 2} fields, expected at least 22")
    state = rest[0]
    if len(state) != 1 or not state.isalpha():
        raise ValueError(f"not a process state: {state[:10]!r}")
    return Stat(
        pid=_uint(data[:open_].strip()),
        comm=data[open_ + 1 : close].decode("utf-8", "replace"),
        state=state.decode(),
        ppid=_uint(rest[1]),
        utime=_uint(rest[11]),
        stime=_uint(rest[12]),
        threads=_uint(rest[17]),
        starttime=_uint(rest[19]),
        tty_nr=_uint(rest[4]),
    )


def thread_times(data: bytes) -> tuple[int, int]:
    """(utime + stime, starttime) of a task/TID/stat: parse_stat's fast path for the
    many threads read on every poll. ValueError on garbage."""
    fields = data[data.rindex(b")") + 2 :].split(b" ", 20)
    if len(fields) < 21:
        raise ValueError(f"{len(fields) + 2} fields, expected at least 22")
    utime, stime, start = fields[11], fields[12], fields[19]
    if not (utime.isdigit() and stime.isdigit() and start.isdigit()):
        raise ValueError("utime, stime or starttime is not a count")
    return int(utime) + int(stime), int(start)


def parse_status(data: bytes) -> dict[str, str]:
    """/proc/PID/status as {key: value}: "Key:<tab or spaces>value" lines; blank and
    malformed lines are skipped (a captured file may start with an empty line)."""
    fields: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition(":")
        if sep and key and not key[0].isspace() and " " not in key:
            fields[key] = value.strip()
    return fields


def parse_cpulist(text: str) -> frozenset[int]:
    """The kernel's cpulist format ("0-7,16-23", "" for none). ValueError on garbage."""
    text = text.strip()
    if not text:
        return frozenset()
    cpus: set[int] = set()
    for part in text.split(","):
        match = _CPU_RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"not a CPU list: {text[:40]!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first or last >= MAX_CPUS:
            raise ValueError(f"not a CPU range: {part[:20]!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def status_value(data: bytes, key: bytes) -> str | None:
    """One value of /proc/PID/status ("Cpus_allowed_list") without parsing the rest."""
    at = data.find(b"\n" + key + b":")
    if at < 0:
        if not data.startswith(key + b":"):
            return None
        at = -1
    start = at + len(key) + 2
    end = data.find(b"\n", start)
    return data[start : end if end >= 0 else len(data)].decode("utf-8", "replace").strip()


def cpus_allowed(status: dict[str, str]) -> frozenset[int] | None:
    """`Cpus_allowed_list` of a parsed status; None when absent or garbled."""
    text = status.get("Cpus_allowed_list")
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class CgroupLine:
    hierarchy: int  # 0 for the v2 (unified) hierarchy
    controllers: tuple[str, ...]  # () for v2
    path: str  # absolute, from that hierarchy's root


def parse_cgroup(data: bytes) -> list[CgroupLine]:
    """/proc/PID/cgroup: "0::/path" (v2) and "4:cpu,cpuacct:/path" (v1) lines.

    Lines that are not `id:controllers:/path`, or whose path climbs with "..", are
    skipped; a file with no valid line is a ValueError.
    """
    lines: list[CgroupLine] = []
    for line in data.decode("utf-8", "replace").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not (sep and _is_count(hierarchy) and len(hierarchy) < 10 and path.startswith("/")):
            continue
        path = path.removesuffix(" (deleted)")
        if ".." in path.split("/"):
            continue
        names = tuple(c for c in controllers.split(",") if c)
        lines.append(CgroupLine(int(hierarchy), names, path))
    if not lines:
        raise ValueError("no cgroup line")
    return lines


def cpu_cgroup(lines: Iterable[CgroupLine]) -> tuple[int, str, str] | None:
    """(version, hierarchy directory under /sys/fs/cgroup, path) that holds the process's
    CPU limit: the v1 hierarchy with the `cpu` controller where there is one (v1 and
    hybrid systems), else the unified v2 hierarchy."""
    unified = None
    for line in lines:
        if "cpu" in line.controllers:
            return 1, ",".join(line.controllers), line.path
        if line.hierarchy == 0 and not line.controllers:
            unified = line.path
    return None if unified is None else (2, "", unified)


def in_container(lines: Iterable[CgroupLine]) -> bool:
    """True when a cgroup path names a container runtime (docker, kubepods, ...)."""
    return any(_CONTAINER.search(line.path) for line in lines)


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("max 100000", "400000 100000") in CPUs; None: no limit."""
    parts = text.split()
    if len(parts) != 2 or not _is_count(parts[1]) or not 0 < int(parts[1]) < 1 << 40:
        raise ValueError(f"not a cpu.max: {text[:40]!r}")
    if parts[0] == "max":
        return None
    if not _is_count(parts[0]) or len(parts[0]) > 15:
        raise ValueError(f"not a cpu.max: {text[:40]!r}")
    return int(parts[0]) / int(parts[1])


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1: no limit) and `cpu.cfs_period_us`, in CPUs."""
    quota, period = quota.strip(), period.strip()
    if quota == "-1":
        return None
    if not (_is_count(quota) and _is_count(period) and len(quota) < 16 and len(period) < 16):
        raise ValueError(f"not a CFS quota/period: {quota[:20]!r} / {period[:20]!r}")
    if int(period) == 0:
        raise ValueError("CFS period 0")
    return int(quota) / int(period)


def parse_flat_keyed(text: str) -> dict[str, int]:
    """A "key value" per line file (`cpu.stat`); other lines are skipped."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and _is_count(parts[1]) and len(parts[1]) <= 20:
            values[parts[0]] = int(parts[1])
    return values


def parse_cudart(maps: bytes) -> str | None:
    """The CUDA runtime version a process mapped ("12.1", or "12" when the file name
    has only the major version), the highest if several; None if none is mapped."""
    best: tuple[int, int] | None = None
    text = ""
    for major, minor in _CUDART.findall(maps):
        key = (int(major), int(minor) if minor else -1)
        if best is None or key > best:
            best = key
            text = f"{int(major)}.{int(minor)}" if minor else str(int(major))
    return text or None


def parse_children(data: bytes) -> list[int]:
    """task/TID/children: "pid pid " (each followed by a space). ValueError on garbage."""
    return [_uint(token) for token in data.split()]


def version_number(version: str) -> float | None:
    """Version text as a number: "12.1" -> 12.1, "12" -> 12.0; None if not one."""
    try:
        return float(version)
    except ValueError:
        return None


class _Gone(Exception):
    """The process exited while it was being read."""
