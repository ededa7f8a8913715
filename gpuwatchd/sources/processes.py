"""GPU processes: what feeds each GPU on the CPU side, and who else is on it.

Every poll takes which processes hold each GPU (NVML's compute and graphics lists) from
the nvml source, which lists them once per poll for both sources (its `ProcessTable`),
then reads /proc and the cgroup tree (`context.procfs`, `context.sysfs`) for the process
that matters on each GPU. Without a fresh table (the nvml source disabled, or not polled
within this source's interval) it asks NVML itself, through `context.pynvml` or the
installed nvidia-ml-py.

The main process
----------------
Per GPU, the *main* process is the one NVML lists with the most GPU memory (compute
before graphics, lowest pid on a tie), leaving out desktop processes (below). Its facts
are exported under the GPU's own labels `{gpu, uuid}` -- never with a pid label, so the
number of series is fixed per GPU whatever runs -- and a process that drives several
GPUs is read once per poll and reported under each of them. Per main process, per poll:

* `/proc/PID/stat`: CPU time (utime + stime, in USER_HZ = 1/100 s, the whole thread
  group), thread count, start time (which tells a reused pid from the process known;
  against `/proc/uptime`, read once per poll, its age: rules leave a process's start-up
  alone);
* `/proc/PID/task/*/stat`: each thread's CPU time, for the busiest thread (up to
  `max_threads` threads, the main thread first);
* `/proc/PID/task/PID/children`: its child processes (DataLoader workers) and their own
  `/proc/CHILD/stat`. Children of the process's other threads are looked up at every
  scan (below). Without `task/*/children` (a kernel built without CONFIG_PROC_CHILDREN)
  the scan reads every process's ppid instead;
* `/proc/PID/status`: `Cpus_allowed_list`, compared with the GPU's NUMA-local CPUs
  (`<sysfs>/bus/pci/devices/<bdf>/local_cpulist`, read once per GPU);
* `/proc/PID/cgroup`: cgroup v2 `0::/path` or the v1 line of the `cpu` controller; a
  path with a container runtime in it (docker, containerd, kubepods, libpod, crio,
  podman, lxc) means the process runs in a container. The CPU limit is the tightest
  `cpu.max` ("max 100000", "400000 100000"; v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`)
  on the path from that cgroup up to the root, and throttling comes from the
  `cpu.stat` of the cgroup that sets it (`nr_periods`, `nr_throttled`, `throttled_usec`;
  v1 `throttled_time` in ns), or of the process's own cgroup when nothing limits it;
* `/proc/PID/maps`, read once per process (again at every scan while not found): the
  CUDA runtime it mapped, `libcudart.so.12.1.105` -> "12.1", torch's bundled
  `libcudart-<hash>.so.11.0` -> "11.0", the pip wheel's `libcudart.so.12` -> "12" (the
  highest when several are mapped). Reading another user's maps needs root or
  CAP_SYS_PTRACE; without it the version is left out (logged once).

The job
-------
Distributed training runs one process per GPU (DDP under torchrun, mpirun, Slurm's
srun, DeepSpeed's launcher), so GPUs that serve one job have different main processes.
Processes are one job only when they synchronize, and what shows that they do is their
launcher's signature: the variables it sets in each rank's environment (RANK,
LOCAL_RANK, WORLD_SIZE; OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK; SLURM_PROCID in a step of
several tasks), read once per process from `/proc/PID/environ` with the owner
(gpuwatchd.sources.owner.process; only those variables are kept). Sharing a parent is
not enough: the kernels of one Jupyter server, or jobs started from one shell, are
siblings that never wait for each other. So the *job* of a GPU's main process
(`gpu_process_job`, a pid; equal values, one job) is:

* a process with a launcher's signature: one job with the main processes of the same
  owner (the cgroup's Slurm job and step, pod or container) whose environment names the
  same launch -- torch.distributed's MASTER_ADDR:MASTER_PORT, else torchrun's
  TORCHELASTIC_RUN_ID, else the PMIx namespace, else SLURM_JOB_ID.SLURM_STEP_ID; naming
  none, its siblings (same parent) with a signature. The job is named by their common
  parent's pid where it is a launcher (below), else by the lowest of their pids (ranks
  started through per-rank wrappers, or reparented after their launcher exited);
* a process whose environment was read and has no signature: a job of its own, named by
  its own pid (a notebook kernel, a single-GPU script);
* a process whose environment is unknown (unreadable: another user's process without
  CAP_SYS_PTRACE, which is the unprivileged daemon's normal case; or `owner_environ:
  false`): the old rule, as nothing better is known -- main processes with the same
  parent (the ppid in `/proc/PID/stat`) form one job named by that parent's pid, and one
  that shares its parent with no other is a job of its own. A parent that merely adopts
  orphans is no launcher: pid 1, pid 0 (a parent outside this pid namespace) and a
  process named `systemd` or `init` never make their children one job.

A process driving several GPUs is one job across them. The rules' `peers()` groups GPUs
by this series (docs/rules.md). The cgroup alone never makes a job (Slurm's task/cgroup
plugin puts each rank in its own `task_N` cgroup; a session, a service, a pod or a Slurm
step running Jupyter holds unrelated processes): it only keeps two launches apart.
Known limits: with the environment unknown, sibling notebooks count as one job and ranks
started through per-rank wrappers as one job each (a missed straggler rather than a
false one); a launcher that itself drives a GPU joins its children's job only then.

Rates (CPU ratios of one core, throttled share of periods) are deltas between two polls
over the time of `context.extras["clock"]` (the simulator's clock; default
time.monotonic), so they appear from the second poll on. A thread or child that was not
there at the previous poll was born since, and all its CPU time counts.

Of names, only `comm` and `Name:` are read, never command lines; of environments, only
the launcher's variables above are kept and none is logged (the rest holds secrets). The
`name` label of `gpu_process_info` is the main process's comm: one series per GPU at a
time.

The owner
---------
`gpu_owner_info{gpu, uuid, scheduler, job_id, step, rank, user, namespace, pod,
container}` (one series per owned GPU, the labels of gpuwatchd.sources.owner.LABELS):
who runs the GPU's main process -- its Slurm job, step, rank and user, its Kubernetes
pod, its container -- from its cgroup, environment and uid, a prolog's per-GPU job files
(`job_mapping_dir`) and the kubelet's pod-resources API (`pod_resources_socket`); see
gpuwatchd.sources.owner and docs/fleet.md. `owner: false` leaves it out.

Desktop and other tenants
-------------------------
Display servers, compositors and their helpers (`DESKTOP_PROCESSES`) take GPU time and
CPU from a training box. They are found in NVML's lists on every poll and, to see the
ones burning CPU without holding a GPU, in a scan of `/proc/*/comm` every `scan_every`
polls (one small read per process: ~1 ms per 500 processes); the ones found are read
(`/proc/PID/stat`) on every poll until they exit. Per GPU, `gpu_desktop_processes`
counts the desktop processes NVML lists on it and `gpu_other_processes` the other
processes sharing it with the main one. Node-wide, `desktop_cpu_cores` sums the desktop
processes' CPU use; `desktop_process_cpu_cores{name}` splits it by name, a label taken
only from the fixed list (bounded).

Errors
------
NVML missing or failing to start fails the poll (SourceError, one line, retried next
poll), as does a missing procfs root. Per GPU: a lost GPU is skipped (the nvml source
reports it), a list NVML refuses is left out. Per process: a process that exits while it
is read (FileNotFoundError, ProcessLookupError) loses all its facts this poll; a garbled
or unreadable file loses the facts it feeds (logged once per kind of file at WARNING,
then at DEBUG); neither fails the poll. The pids NVML reports must be this procfs's: in a
container the daemon needs the host's pid namespace (Kubernetes `hostPID: true`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.config import ProcessesConfig, SourceConfig
from gpuwatchd.metrics import GPU_LABELS, Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError, not_mounted
from gpuwatchd.sources.nvmlapi import (
    ListedGpu,
    process_table,
    quietly,
    start_nvml,
    sysfs_bus_id,
)
from gpuwatchd.sources.owner import LABELS as OWNER_LABELS
from gpuwatchd.sources.owner import (
    Attribution,
    GpuProcesses,
    Owner,
    PodResources,
    ProcessFacts,
)
from gpuwatchd.sources.procio import METRICS as PROCIO_METRICS
from gpuwatchd.sources.procio import JobIo

log = logging.getLogger(__name__)

CLK_TCK = 100  # USER_HZ: /proc/PID/stat times are in 1/100 s on every Linux in use
KINDS = ("compute", "graphics")
MAX_CPUS = 1 << 16  # a cpulist naming a CPU beyond this is garbage
MAX_MAPS_BYTES = 64 << 20

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
# parents that adopt orphans (subreapers) rather than launch a job: their children are
# never one job however many GPUs they use
ADOPTERS = frozenset({"systemd", "init"})

_CONTAINER = re.compile(r"docker|containerd|kubepods|libpod|crio|cri-o|podman|lxc")
# a mapped CUDA runtime: /…/libcudart.so.12.1.105, /…/libcudart-d0da41ae.so.11.0,
# /…/nvidia/cuda_runtime/lib/libcudart.so.12
_CUDART = re.compile(rb"/libcudart(?:-[0-9a-f]{4,40})?\.so\.([0-9]{1,3})(?:\.([0-9]{1,3}))?")
_CPU_RANGE = re.compile(r"([0-9]{1,6})(?:-([0-9]{1,6}))?")


# -- metrics ----------------------------------------------------------------------------


def _gpu(name: str, help: str, extra: tuple[str, ...] = ()) -> Any:
    return gauge(name, help, GPU_LABELS + extra)


PROCESSES = _gpu("gpu_processes", "Processes NVML lists on the GPU, by list.", ("kind",))
DESKTOP = _gpu(
    "gpu_desktop_processes", "Desktop processes (display servers, compositors) on the GPU."
)
OTHERS = _gpu(
    "gpu_other_processes",
    "Processes on the GPU besides its main process and desktop processes.",
)
INFO = _gpu(
    "gpu_process_info",
    "The GPU's main process (most GPU memory): its name and CUDA runtime; always 1.",
    ("name", "cudart"),
)
PID = _gpu("gpu_process_pid", "Process id of the GPU's main process.")
JOB = _gpu(
    "gpu_process_job",
    "Job of the GPU's main process, as a pid: equal values, one job. Ranks of one launch "
    "(launcher variables in their environment, one owner): their common parent, else the "
    "lowest rank's pid; a process without them: its own pid; environment unreadable: the "
    "parent it shares with other GPUs' main processes.",
)
OWNER = _gpu(
    "gpu_owner_info",
    "Who owns the GPU: the Slurm job, Kubernetes pod, container or user of its main "
    "process (docs/fleet.md); always 1.",
    OWNER_LABELS,
)
CPU = _gpu(
    "gpu_process_cpu_cores",
    "CPU used by the GPU's main process, all threads, in cores (1 = one core busy).",
)
BUSIEST = _gpu(
    "gpu_process_busiest_thread_cpu_ratio",
    "CPU used by the main process's busiest thread, share of one core.",
)
THREADS = _gpu("gpu_process_threads", "Threads of the GPU's main process.")
WORKERS = _gpu(
    "gpu_process_workers", "Child processes of the GPU's main process (DataLoader workers)."
)
WORKERS_CPU = _gpu(
    "gpu_process_workers_cpu_cores",
    "CPU used by the main process's children, summed, in cores.",
)
CPUS_ALLOWED = _gpu("gpu_process_cpus_allowed", "CPUs the main process may run on (its affinity).")
NUMA_ALIGNED = _gpu(
    "gpu_process_numa_aligned",
    "1 if every CPU the main process may run on is local to the GPU's NUMA node.",
)
QUOTA = _gpu(
    "gpu_process_cpu_quota_cpus",
    "The main process's cgroup CPU limit, in CPUs (absent: no limit).",
)
THROTTLED = _gpu(
    "gpu_process_throttled_ratio",
    "Share of the cgroup's CPU periods in which it was throttled (main process's cgroup).",
)
THROTTLED_SECONDS = counter(
    "gpu_process_throttled_seconds_total",
    "Time the main process's cgroup spent throttled (cgroup cpu.stat).",
    GPU_LABELS,
)
CONTAINER = _gpu("gpu_process_in_container", "1 if the main process runs in a container.")
CUDART = _gpu(
    "gpu_process_cudart_version",
    "CUDA runtime version the main process mapped, e.g. 12.1 (12: major only known).",
)
AGE = _gpu(
    "gpu_process_age_seconds",
    "Seconds since the GPU's main process started (/proc/PID/stat starttime against "
    "/proc/uptime).",
)
DESKTOP_CPU = gauge(
    "desktop_cpu_cores", "CPU used by desktop processes on the node, summed, in cores."
)
DESKTOP_COUNT = gauge("desktop_processes", "Desktop processes running on the node.")
DESKTOP_CPU_BY_NAME = gauge(
    "desktop_process_cpu_cores",
    "CPU used by desktop processes of one name, in cores.",
    ("name",),
)

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

    @property
    def ticks(self) -> int:
        return self.utime + self.stime


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


# launch_key() of a process whose environment was read and names no launcher
ALONE: tuple[str, ...] = ()


def launch_key(facts: ProcessFacts | None) -> tuple[str, ...] | None:
    """What a GPU main process's ranks share ("The job" above): its owner (the cgroup's
    scheduler, Slurm job and step, pod, container) and the launch its environment names
    (Launch.communicator; "" when none, then the parent tells); ALONE for a readable
    environment without a launcher's signature; None when the environment is unknown
    (unreadable, not read, or the process gone)."""
    if facts is None or facts.launch is None:
        return None
    if not facts.launch.launched:
        return ALONE
    place = facts.place
    return (
        place.scheduler, place.job_id, place.step, place.pod_uid, place.container,
        facts.launch.communicator,
    )  # fmt: skip


def group_jobs(
    parents: dict[int, int],
    adopter: Callable[[int], bool],
    keys: dict[int, tuple[str, ...] | None] | None = None,
) -> dict[int, int]:
    """pid -> job of GPU main processes given as {pid: ppid} and their launch_key() (none
    given: all unknown).

    Unknown: their parent's pid when it is the parent of another unknown one, is neither
    0 nor 1 and is no `adopter(ppid)` (a subreaper), else their own pid. ALONE: their own
    pid. A key: the processes with the same key (and, when it names no launch, the same
    parent) are one job, named by their common parent where it is a launcher, else by
    their lowest pid."""
    keys = keys or {}
    by_parent: dict[int, list[int]] = {}
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for pid, ppid in parents.items():
        key = keys.get(pid)
        if key is None:
            by_parent.setdefault(ppid, []).append(pid)
        elif key == ALONE:
            by_key[("pid", pid)] = [pid]
        else:  # a launch that names nothing shared: its ranks are siblings
            by_key.setdefault(key if key[-1] else (*key, str(ppid)), []).append(pid)
    jobs: dict[int, int] = {}
    for ppid, pids in by_parent.items():
        launcher = len(pids) > 1 and ppid > 1 and not adopter(ppid)
        for pid in pids:
            jobs[pid] = ppid if launcher else pid
    for pids in by_key.values():
        shared = {parents[pid] for pid in pids}
        ppid = shared.pop() if len(shared) == 1 else 0
        job = ppid if len(pids) > 1 and ppid > 1 and not adopter(ppid) else min(pids)
        jobs.update(dict.fromkeys(pids, job))
    return jobs


def _candidates(
    lists: dict[str, dict[int, float]], names: dict[int, str | None]
) -> dict[int, float]:
    """The processes a GPU's main one is chosen among (ProcessesSource._main): its
    non-desktop compute processes, else its non-desktop graphics ones; pid -> memory."""
    for kind in KINDS:
        found = {pid: memory for pid, memory in lists.get(kind, {}).items()
                 if desktop_name(names.get(pid) or "") is None}  # fmt: skip
        if found:
            return found
    return {}


class _Memo:
    """A reader of process facts that reads each pid once per poll."""

    def __init__(self, read: Callable[[int], ProcessFacts | None]) -> None:
        self._read = read
        self._facts: dict[int, ProcessFacts | None] = {}

    def __call__(self, pid: int) -> ProcessFacts | None:
        if pid not in self._facts:
            self._facts[pid] = self._read(pid)
        return self._facts[pid]


def desktop_name(comm: str) -> str | None:
    """The DESKTOP_PROCESSES name a comm stands for, or None."""
    return _DESKTOP_BY_COMM.get(comm.strip()[:15])


def version_number(version: str) -> float | None:
    """Version text as a number: "12.1" -> 12.1, "12" -> 12.0; None if not one."""
    try:
        return float(version)
    except ValueError:
        return None


# -- reading ------------------------------------------------------------------------------


class _Gone(Exception):
    """The process exited while it was being read."""


def _read(path: str, limit: int = 1 << 20) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunk = os.read(fd, 65536)
        if len(chunk) < 65536:
            return chunk
        parts = [chunk]
        size = len(chunk)
        while chunk and size < limit:
            chunk = os.read(fd, 65536)
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def _proc_read(path: str, limit: int = 1 << 20) -> bytes:
    """A /proc/PID file; the process having exited is _Gone, not an error."""
    try:
        return _read(path, limit)
    except (FileNotFoundError, ProcessLookupError) as e:
        raise _Gone(path) from e


def _text(path: str) -> str | None:
    """A sysfs/cgroup file as text; None if it cannot be read."""
    try:
        return _read(path, 65536).decode("utf-8", "replace")
    except OSError:
        return None


# -- what the source remembers ------------------------------------------------------------


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    labels: tuple[str, ...] = ()
    bus_id: str = ""
    local_cpus: frozenset[int] | None = None
    local_read_at: int = -1  # poll of the last local_cpulist attempt
    choice: dict[str, int] = field(default_factory=dict)  # kind -> function in use
    disabled: set[str] = field(default_factory=set)  # kinds NVML does not support here


@dataclass
class _Known:
    """A process read at an earlier poll: enough to compute rates and keep slow facts."""

    start: int
    at: float
    ticks: int
    threads: dict[int, tuple[int, int]] = field(default_factory=dict)  # tid -> (start, ticks)
    children: dict[int, tuple[int, int]] = field(default_factory=dict)
    other_children: set[int] = field(default_factory=set)  # children of non-main threads
    capped: bool = False  # more threads than max_threads
    cudart: str | None = None
    maps_read_at: int | None = None  # poll of the last maps read


@dataclass
class _Desktop:
    name: str  # from DESKTOP_PROCESSES
    start: int = -1
    at: float = 0.0
    ticks: int = 0


@dataclass
class Facts:
    """One main process, this poll."""

    pid: int
    name: str
    threads: int
    ppid: int = 0
    workers: int | None = None
    cpu: float | None = None
    busiest: float | None = None
    workers_cpu: float | None = None
    cpus: frozenset[int] | None = None
    container: bool | None = None
    quota: float | None = None  # CPUs; None: no limit, or not known
    throttled_ratio: float | None = None
    throttled_seconds: float | None = None
    cudart: str | None = None
    age: float | None = None  # seconds since it started


@dataclass
class _CgroupReading:
    quota: float | None  # CPUs; None: no limit
    stat_path: str = ""  # the cpu.stat throttling is read from
    seconds: float | None = None  # throttled time, cumulative
    ratio: float | None = None  # throttled share of periods since the last poll


@register
class ProcessesSource(Source):
    name = "processes"
    metrics = (
        PROCESSES, DESKTOP, OTHERS, INFO, PID, JOB, OWNER, CPU, BUSIEST, THREADS, WORKERS,
        WORKERS_CPU, CPUS_ALLOWED, NUMA_ALIGNED, QUOTA, THROTTLED, THROTTLED_SECONDS, CONTAINER,
        CUDART, AGE, DESKTOP_CPU, DESKTOP_COUNT, DESKTOP_CPU_BY_NAME, *PROCIO_METRICS,
    )  # fmt: skip

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self.settings = (
            config
            if isinstance(config, ProcessesConfig)
            else ProcessesConfig.model_validate(config.model_dump())
        )
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._proc = os.fspath(context.procfs)
        self._sys = os.fspath(context.sysfs)
        self._cgroup_root = os.path.join(self._sys, "fs", "cgroup")
        self._table = process_table(context)  # the nvml source's lists, when it runs
        self._nv: Any = None
        self._codes: dict[int, str] = {}
        self._gpus: list[_Gpu] = []  # as NVML counts them, when this source asks it itself
        self._shared: dict[int, _Gpu] = {}  # the GPUs of the nvml source's lists, by index
        self._functions: dict[str, list[tuple[str, Any]]] = {}
        self.polls = 0
        self.scans = 0
        self._names: dict[int, str] = {}  # comm of the pids NVML lists
        self._known: dict[int, _Known] = {}  # main processes
        self._desktop: dict[int, _Desktop] = {}
        self._cgroups: dict[str, tuple[float, int, int]] = {}  # cpu.stat -> (at, periods, thr)
        self._children_file = True  # False: the kernel has no task/*/children
        self._ppid_children: dict[int, list[int]] = {}  # from the last scan, if needed
        self._complained: set[str] = set()
        # online CPUs (<sysfs>/devices/system/cpu/online): an affinity mask may name
        # possible CPUs that are not there; empty when unknown
        self._online: frozenset[int] = frozenset()
        self._cpulists: dict[str, frozenset[int]] = {}
        self._uptime: float | None = None  # /proc/uptime at this poll
        self._owners = self._attribution()
        # procio: what each job reads, from which disks, and its CPUs' iowait/IRQ time
        self._io = JobIo(self._proc, self._sys, self._complain)

    def _attribution(self) -> Attribution:
        """Owners (when `owner`) and the launch facts jobs are grouped by (always)."""
        s = self.settings
        pods = None
        if s.owner and s.pod_resources_socket is not None:
            pods = PodResources(
                os.fspath(s.pod_resources_socket), s.pod_resources_timeout,
                s.pod_resources_refresh, clock=self._clock,
            )  # fmt: skip
        return Attribution(
            self.context.procfs,
            job_dir=s.job_mapping_dir if s.owner else None,
            pod_resources=pods,
            read_environ=s.owner_environ,
        )

    # -- NVML ---------------------------------------------------------------------------

    def _start(self) -> None:
        nv, self._codes, count = start_nvml(self.context)
        self._functions = {
            kind: [
                (name, getattr(nv, name, None))
                for name in (
                    f"nvmlDevice{api}RunningProcesses_v3",
                    f"nvmlDevice{api}RunningProcesses_v2",
                )
            ]
            for kind, api in (("compute", "GetCompute"), ("graphics", "GetGraphics"))
        }
        self._gpus = [_Gpu(i, labels=(str(i), "")) for i in range(count)]
        self._nv = nv
        log.info("processes: NVML started, %d GPUs", count)

    def close(self) -> None:
        self._owners.close()
        nv, self._nv = self._nv, None
        if nv is not None:
            quietly(nv, nv.nvmlShutdown)

    def _identify(self, gpu: _Gpu) -> None:
        nv = self._nv
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(gpu.index)
            uuid = nv.nvmlDeviceGetUUID(handle)
        except nv.NVMLError as e:
            log.debug("processes: GPU %d: no handle yet: %s", gpu.index, e)
            return
        pci_info = getattr(nv, "nvmlDeviceGetPciInfo_v3", None) or nv.nvmlDeviceGetPciInfo
        pci = quietly(nv, pci_info, handle)
        gpu.bus_id = sysfs_bus_id(pci.busId) if pci is not None else ""
        gpu.labels = (str(gpu.index), uuid)
        gpu.handle = handle

    def _list(self, gpu: _Gpu) -> dict[str, dict[int, float]] | None:
        """kind -> {pid: GPU memory bytes} for the lists NVML gave; None: the GPU is lost."""
        nv = self._nv
        lists: dict[str, dict[int, float]] = {}
        for kind in KINDS:
            if kind in gpu.disabled:
                continue
            functions = self._functions[kind]
            while True:
                choice = gpu.choice.get(kind, 0)
                name, function = functions[choice]
                try:
                    if function is None:
                        raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
                    processes = function(gpu.handle)
                except nv.NVMLError as e:
                    code = e.value
                    if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND and choice + 1 < len(functions):
                        gpu.choice[kind] = choice + 1
                        continue
                    if code == nv.NVML_ERROR_GPU_IS_LOST:
                        return None
                    if code == nv.NVML_ERROR_UNINITIALIZED:
                        self._nv = None
                        raise SourceError(f"NVML was shut down under us: {name}: {e}") from None
                    if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                        gpu.disabled.add(kind)
                        log.info("processes: GPU %d: %s: %s; not asking again", gpu.index, name, e)
                    else:
                        log.debug("processes: GPU %d: %s failed: %s", gpu.index, name, e)
                    break
                used: dict[int, float] = {}
                for process in processes:
                    memory = process.usedGpuMemory or 0  # None where the driver can't tell
                    used[process.pid] = used.get(process.pid, 0.0) + memory
                lists[kind] = used
                break
        return lists

    # -- polling --------------------------------------------------------------------------

    def collect(self) -> list[Sample]:
        now = self._clock()
        shared = self._table.fresh(now, self.config.interval)
        if shared is None and self._nv is None:
            self._start()
        if not os.path.isdir(self._proc):
            raise not_mounted(self._proc, "procfs", self.context.procfs)
        self.polls += 1
        self._uptime = self._read_uptime()
        scan = self.settings.desktop or not self._children_file
        scanning = (self.polls - 1) % self.settings.scan_every == 0

        # 1. who is on which GPU
        on_gpu = self._listed(shared) if shared is not None else self._ask_nvml()
        listed = {pid for _, lists in on_gpu for used in lists.values() for pid in used}
        names = self._names_of(listed)

        # 2. desktop processes: NVML's, and every scan_every polls /proc's
        if scanning:
            self._online = self._online_cpus()
        if scan and scanning:
            self._scan()
        for pid in listed:
            label = desktop_name(names.get(pid) or "")
            if label is not None and pid not in self._desktop:
                self._desktop[pid] = _Desktop(label)

        # 3. the main process of each GPU, read once however many GPUs it drives
        mains: dict[int, int | None] = {}  # gpu index -> pid
        for gpu, lists in on_gpu:
            mains[gpu.index] = self._main(lists, names)
        memo: dict[str, _CgroupReading | None] = {}
        facts: dict[int, Facts | None] = {}
        self._io.begin(now)
        for main in mains.values():
            if main is not None and main not in facts:
                facts[main] = self._facts(main, now, scanning, memo)
        self._io.end()
        for gone in [p for p in self._known if p not in facts]:
            del self._known[gone]
        read = {r.stat_path for r in memo.values() if r is not None}
        for path in [p for p in self._cgroups if p not in read]:
            del self._cgroups[path]

        launches = _Memo(self._owners.processes.read)
        owners = self._owned(on_gpu, names, launches)
        jobs = self._jobs(facts, launches)
        samples: list[Sample] = []
        for gpu, lists in on_gpu:
            self._gpu_samples(gpu, lists, names, mains[gpu.index], facts, jobs, scanning, samples)
            owner = owners.get(gpu.labels[1])
            if owner is not None:
                samples.append(Sample(OWNER.name, gpu.labels + owner.values(), 1.0))
        self._desktop_samples(now, samples)
        return samples

    def _owned(
        self,
        on_gpu: list[tuple[_Gpu, dict[str, dict[int, float]]]],
        names: dict[int, str | None],
        read: Callable[[int], ProcessFacts | None],
    ) -> dict[str, Owner | None]:
        """uuid -> owner of each GPU, from the processes its main one is chosen among."""
        if not self.settings.owner:
            return {}
        gpus = [GpuProcesses(gpu.index, gpu.labels[1], _candidates(lists, names))
                for gpu, lists in on_gpu]  # fmt: skip
        return self._owners.owners(gpus, read)

    def _listed(self, shared: list[ListedGpu]) -> list[tuple[_Gpu, dict[str, dict[int, float]]]]:
        """The nvml source's lists, on this source's GPU records (lost GPUs left out)."""
        on_gpu = []
        for listed in shared:
            gpu = self._shared.get(listed.index)
            if gpu is None or gpu.labels != listed.labels:
                gpu = self._shared[listed.index] = _Gpu(listed.index, labels=listed.labels)
            gpu.bus_id = listed.bus_id
            if listed.lists is not None and listed.labels[1]:
                on_gpu.append((gpu, listed.lists))
        return on_gpu

    def _ask_nvml(self) -> list[tuple[_Gpu, dict[str, dict[int, float]]]]:
        """Each GPU's lists, asked of NVML by this source (lost GPUs left out)."""
        on_gpu = []
        for gpu in self._gpus:
            if gpu.handle is None:
                self._identify(gpu)
                if gpu.handle is None:
                    continue
            lists = self._list(gpu)
            if lists is not None:
                on_gpu.append((gpu, lists))
        return on_gpu

    def _names_of(self, pids: set[int]) -> dict[int, str | None]:
        """comm of each pid NVML lists, read once while it stays listed."""
        names: dict[int, str | None] = {pid: self._names[pid] for pid in pids if pid in self._names}
        for pid in pids - names.keys():
            try:
                names[pid] = (
                    _read(f"{self._proc}/{pid}/comm", 4096).decode("utf-8", "replace").rstrip("\n")
                )
            except OSError:
                names[pid] = None  # gone or unreadable: not cached, asked again next poll
        self._names = {pid: name for pid, name in names.items() if name is not None}
        return names

    @staticmethod
    def _main(lists: dict[str, dict[int, float]], names: dict[int, str | None]) -> int | None:
        """Most GPU memory, compute before graphics, lowest pid on a tie; no desktop."""
        best: tuple[int, float, int] | None = None
        for rank, kind in enumerate(KINDS):
            for pid, memory in lists.get(kind, {}).items():
                if desktop_name(names.get(pid) or "") is not None:
                    continue
                key = (-rank, memory, -pid)
                if best is None or key > best:
                    best = key
        return None if best is None else -best[2]

    def _jobs(
        self, facts: dict[int, Facts | None], read: Callable[[int], ProcessFacts | None]
    ) -> dict[int, int]:
        """The job of each main process read this poll (see "The job" above)."""
        parents = {pid: found.ppid for pid, found in facts.items() if found is not None}
        keys = {pid: launch_key(read(pid)) for pid in parents}
        if not self.settings.owner:
            self._owners.processes.keep(set(parents))  # owners() keeps them otherwise
        return group_jobs(parents, self._adopter, keys)

    def _read_uptime(self) -> float | None:
        """Seconds since boot (/proc/uptime's first field), the clock of starttime."""
        text = _text(f"{self._proc}/uptime")
        if text is None:
            return None
        first = text.split()[0] if text.split() else ""
        if not _is_count(first.replace(".", "", 1)):
            self._complain("uptime", f"{self._proc}/uptime: not an uptime: {text[:40]!r}")
            return None
        return float(first)

    def _adopter(self, pid: int) -> bool:
        """True when the process is a subreaper by name (systemd, init): not a launcher.
        Unreadable (exited this instant, or hidden) counts as a launcher."""
        try:
            comm = _read(f"{self._proc}/{pid}/comm", 4096).decode("utf-8", "replace")
        except OSError:
            return False
        return comm.strip() in ADOPTERS

    # -- one main process -------------------------------------------------------------

    def _facts(
        self, pid: int, now: float, scanning: bool, memo: dict[str, _CgroupReading | None]
    ) -> Facts | None:
        base = f"{self._proc}/{pid}"
        try:
            return self._read_facts(pid, base, now, scanning, memo)
        except _Gone:
            log.debug("processes: pid %d exited while being read", pid)
        except ValueError as e:  # the other parsers' errors are handled where they feed
            self._complain("stat", f"{base}/stat: {e}")
        except OSError as e:
            self._complain("proc", f"{base}: {e}")
        self._known.pop(pid, None)
        return None

    def _read_facts(
        self, pid: int, base: str, now: float, scanning: bool,
        memo: dict[str, _CgroupReading | None],
    ) -> Facts:  # fmt: skip
        stat = parse_stat(_proc_read(f"{base}/stat"))
        known = self._known.get(pid)
        if known is not None and known.start != stat.starttime:
            known = None  # the pid was reused
        dt = now - known.at if known is not None else 0.0
        rated = known is not None and dt > 0
        facts = Facts(pid, stat.comm, stat.threads, stat.ppid)
        if self._uptime is not None:
            facts.age = max(0.0, self._uptime - stat.starttime / CLK_TCK)
        state = _Known(stat.starttime, now, stat.ticks)
        if known is not None:
            state.cudart, state.maps_read_at = known.cudart, known.maps_read_at
            state.other_children = known.other_children
        if rated:
            assert known is not None
            facts.cpu = max(0, stat.ticks - known.ticks) / CLK_TCK / dt

        # threads: the busiest one (the hot loop: one small read and split per thread)
        tids = self._tids(pid, base)
        state.capped = len(tids) > self.settings.max_threads
        threads = state.threads
        remembered = known.threads if known is not None else {}
        before = remembered if rated else None
        count_new = known is not None and not known.capped
        busiest = -1
        for tid in tids[: self.settings.max_threads]:
            try:
                ticks, start = thread_times(_read(f"{base}/task/{tid}/stat", 4096))
            except (OSError, ValueError):
                # exited, or unreadable this once: remember it as known with no reading
                # (ticks -1), so that next poll neither takes it for a new thread (all
                # its CPU time at once) nor spreads two intervals' time over one
                if tid in remembered:
                    threads[tid] = (remembered[tid][0], -1)
                continue
            threads[tid] = (start, ticks)
            if before is None:
                continue
            seen = before.get(tid)
            if seen is not None and seen[0] == start:
                if seen[1] < 0:
                    continue
                delta = ticks - seen[1]
            elif count_new:
                delta = ticks  # born since the last poll
            else:
                continue
            if delta > busiest:
                busiest = delta
        if before is not None and busiest >= 0:
            facts.busiest = busiest / CLK_TCK / dt

        # children (DataLoader workers)
        children = self._children(pid, base, tids, state, scanning)
        self._io.read(pid, children or [], scanning)
        if children is not None:
            workers, spent = 0, 0
            for child in children:
                try:
                    cstat = parse_stat(_read(f"{self._proc}/{child}/stat", 4096))
                except (OSError, ValueError):
                    if known is not None and child in known.children:
                        state.children[child] = (known.children[child][0], -1)  # as threads
                    continue
                if cstat.ppid != pid or cstat.state in "ZX":
                    continue
                workers += 1
                state.children[child] = (cstat.starttime, cstat.ticks)
                if rated:
                    assert known is not None
                    last = known.children.get(child)
                    if last is not None and last[0] == cstat.starttime:
                        if last[1] >= 0:
                            spent += max(0, cstat.ticks - last[1])
                    else:
                        spent += cstat.ticks  # forked since the last poll
            facts.workers = workers
            if rated:
                facts.workers_cpu = spent / CLK_TCK / dt

        # affinity
        try:
            text = status_value(_proc_read(f"{base}/status"), b"Cpus_allowed_list")
            facts.cpus = None if text is None else self._cpulist(text)
            if facts.cpus is None:
                self._complain("status", f"{base}/status: no valid Cpus_allowed_list")
        except _Gone:
            raise
        except OSError as e:
            self._complain("status", f"{base}/status: {e}")

        # cgroup: container, CPU limit, throttling
        try:
            lines = parse_cgroup(_proc_read(f"{base}/cgroup"))
        except _Gone:
            raise
        except (OSError, ValueError) as e:
            self._complain("cgroup", f"{base}/cgroup: {e}")
        else:
            facts.container = in_container(lines)
            where = cpu_cgroup(lines)
            if where is not None:
                key = f"{where[0]}:{where[1]}:{where[2]}"
                if key not in memo:
                    memo[key] = self._cgroup(*where, now)
                reading = memo[key]
                if reading is not None:
                    facts.quota = reading.quota
                    facts.throttled_ratio = reading.ratio
                    facts.throttled_seconds = reading.seconds

        # CUDA runtime, from the memory maps: once, or at each scan until found
        if state.cudart is None and (state.maps_read_at is None or scanning):
            state.maps_read_at = self.polls
            try:
                state.cudart = parse_cudart(_proc_read(f"{base}/maps", MAX_MAPS_BYTES))
            except _Gone:
                raise
            except OSError as e:
                self._complain("maps", f"{base}/maps: {e} (the CUDA runtime needs root or "
                               "CAP_SYS_PTRACE to be read)")  # fmt: skip
        facts.cudart = state.cudart

        self._known[pid] = state
        return facts

    @staticmethod
    def _tids(pid: int, base: str) -> list[int]:
        """The process's threads, the main thread first."""
        try:
            entries = os.listdir(f"{base}/task")
        except (FileNotFoundError, ProcessLookupError) as e:
            raise _Gone(base) from e
        tids = sorted(int(e) for e in entries if _is_count(e) and int(e) != pid)
        return [pid, *tids]

    def _children(
        self, pid: int, base: str, tids: list[int], state: _Known, scanning: bool
    ) -> list[int] | None:
        """Child pids: the main thread's children file every poll, other threads' at scans."""
        if not self._children_file:
            return self._ppid_children.get(pid, [])
        try:
            children = parse_children(_read(f"{base}/task/{pid}/children", 1 << 20))
        except FileNotFoundError:
            if os.path.exists(f"{base}/task/{pid}/stat"):
                log.info(
                    "processes: this kernel has no /proc/PID/task/*/children; DataLoader "
                    "workers are found by a scan of every process's ppid every %d polls",
                    self.settings.scan_every,
                )
                self._children_file = False
                self._scan()
                return self._ppid_children.get(pid, [])
            raise _Gone(base) from None
        except ProcessLookupError:
            raise _Gone(base) from None
        except (OSError, ValueError) as e:
            self._complain("children", f"{base}/task/{pid}/children: {e}")
            return None
        if scanning:
            state.other_children = set()
            for tid in tids[1 : self.settings.max_threads]:
                try:
                    data = _read(f"{base}/task/{tid}/children", 1 << 20)
                    state.other_children.update(parse_children(data))
                except (OSError, ValueError):
                    continue
        if state.other_children:
            children = sorted(set(children) | state.other_children)
        return children

    def _cgroup(self, version: int, hierarchy: str, path: str, now: float) -> _CgroupReading | None:
        """The tightest CPU limit from `path` up to the root, and that cgroup's throttling."""
        root = os.path.join(self._cgroup_root, hierarchy) if hierarchy else self._cgroup_root
        parts = [p for p in path.split("/") if p]
        leaf = os.path.join(root, *parts)
        if not os.path.isdir(leaf):
            self._complain("cgroupfs", f"{leaf}: no such cgroup (is the host's cgroup "
                           f"filesystem mounted at {self._cgroup_root}?)")  # fmt: skip
            return None
        reading = _CgroupReading(quota=None)
        binding = leaf
        for depth in range(len(parts), 0, -1):
            directory = os.path.join(root, *parts[:depth])
            try:
                if version == 2:
                    text = _text(os.path.join(directory, "cpu.max"))
                    quota = None if text is None else parse_cpu_max(text)
                else:
                    q = _text(os.path.join(directory, "cpu.cfs_quota_us"))
                    p = _text(os.path.join(directory, "cpu.cfs_period_us"))
                    quota = None if q is None or p is None else parse_cfs_quota(q, p)
            except ValueError as e:
                self._complain("cpu.max", f"{directory}: {e}")
                continue
            if quota is not None and (reading.quota is None or quota < reading.quota):
                reading.quota, binding = quota, directory
        stat_path = reading.stat_path = os.path.join(binding, "cpu.stat")
        text = _text(stat_path)
        if text is None:
            return reading
        values = parse_flat_keyed(text)
        periods, throttled = values.get("nr_periods"), values.get("nr_throttled")
        if version == 2 and "throttled_usec" in values:
            reading.seconds = values["throttled_usec"] / 1e6
        elif version == 1 and "throttled_time" in values:
            reading.seconds = values["throttled_time"] / 1e9
        if periods is None or throttled is None:
            return reading
        before = self._cgroups.get(stat_path)
        self._cgroups[stat_path] = (now, periods, throttled)
        if before is not None and now > before[0]:
            d_periods, d_throttled = periods - before[1], throttled - before[2]
            if d_periods > 0 and d_throttled >= 0:
                reading.ratio = min(1.0, d_throttled / d_periods)
            elif d_periods == 0:
                reading.ratio = 0.0
        return reading

    # -- /proc scan and desktop processes ---------------------------------------------

    def _scan(self) -> None:
        """Desktop processes by comm (and, without task/*/children, every ppid)."""
        self.scans += 1
        try:
            entries = os.listdir(self._proc)
        except OSError as e:
            self._complain("scan", f"{self._proc}: {e}")
            return
        by_ppid: dict[int, list[int]] = {}
        with_ppid = not self._children_file
        for entry in entries:
            if not _is_count(entry):
                continue
            pid = int(entry)
            try:
                if with_ppid:
                    stat = parse_stat(_read(f"{self._proc}/{entry}/stat", 4096))
                    comm = stat.comm
                    by_ppid.setdefault(stat.ppid, []).append(pid)
                else:
                    comm = _read(f"{self._proc}/{entry}/comm", 4096).decode("utf-8", "replace")
            except (OSError, ValueError):
                continue
            if not self.settings.desktop:
                continue
            label = desktop_name(comm)
            if label is not None and pid not in self._desktop:
                self._desktop[pid] = _Desktop(label)
        if with_ppid:
            self._ppid_children = by_ppid

    def _desktop_samples(self, now: float, out: list[Sample]) -> None:
        total = 0.0
        rated = 0
        by_name: dict[str, float] = {}
        for pid, proc in list(self._desktop.items()):
            try:
                stat = parse_stat(_read(f"{self._proc}/{pid}/stat", 4096))
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

    # -- samples --------------------------------------------------------------------------

    def _gpu_samples(
        self,
        gpu: _Gpu,
        lists: dict[str, dict[int, float]],
        names: dict[int, str | None],
        main: int | None,
        facts: dict[int, Facts | None],
        jobs: dict[int, int],
        scanning: bool,
        out: list[Sample],
    ) -> None:
        labels = gpu.labels
        pids: set[int] = set()
        for kind in KINDS:
            if kind in lists:
                out.append(Sample(PROCESSES.name, labels + (kind,), float(len(lists[kind]))))
                pids.update(lists[kind])
        desktop = {pid for pid in pids if desktop_name(names.get(pid) or "") is not None}
        out.append(Sample(DESKTOP.name, labels, float(len(desktop))))
        others = len(pids - desktop - ({main} if main is not None else set()))
        out.append(Sample(OTHERS.name, labels, float(others)))
        found = facts.get(main) if main is not None else None
        if found is None:
            return
        f = found
        out.append(Sample(INFO.name, labels + (f.name, f.cudart or ""), 1.0))
        out.append(Sample(PID.name, labels, float(f.pid)))
        out.append(Sample(JOB.name, labels, float(jobs.get(f.pid, f.pid))))
        out.append(Sample(THREADS.name, labels, float(f.threads)))
        optional = (
            (CPU, f.cpu),
            (BUSIEST, f.busiest),
            (WORKERS, f.workers),
            (WORKERS_CPU, f.workers_cpu),
            (CONTAINER, None if f.container is None else float(f.container)),
            (QUOTA, f.quota),
            (THROTTLED, f.throttled_ratio),
            (THROTTLED_SECONDS, f.throttled_seconds),
            (CUDART, None if f.cudart is None else version_number(f.cudart)),
            (AGE, f.age),
        )
        for spec, value in optional:
            if value is not None:
                out.append(Sample(spec.name, labels, float(value)))
        self._io.samples(f.pid, labels, out)
        if f.cpus is not None:
            out.append(Sample(CPUS_ALLOWED.name, labels, float(len(f.cpus))))
            local = self._local_cpus(gpu, scanning)
            cpus = f.cpus & self._online if self._online else f.cpus
            if local is not None and cpus:
                out.append(Sample(NUMA_ALIGNED.name, labels, float(cpus <= local)))

    def _local_cpus(self, gpu: _Gpu, scanning: bool) -> frozenset[int] | None:
        """The GPU's NUMA-local CPUs, read once (again at scans while unreadable)."""
        if gpu.local_cpus is None and gpu.bus_id and (gpu.local_read_at < 0 or scanning):
            gpu.local_read_at = self.polls
            path = os.path.join(self._sys, "bus", "pci", "devices", gpu.bus_id, "local_cpulist")
            text = _text(path)
            try:
                gpu.local_cpus = None if text is None else parse_cpulist(text) or None
            except ValueError as e:
                self._complain("local_cpulist", f"{path}: {e}")
        return gpu.local_cpus

    def _cpulist(self, text: str) -> frozenset[int] | None:
        """parse_cpulist, remembered: processes share a few affinity lists."""
        cpus = self._cpulists.get(text)
        if cpus is None:
            try:
                cpus = parse_cpulist(text)
            except ValueError:
                return None
            if len(self._cpulists) >= 64:
                self._cpulists.clear()
            self._cpulists[text] = cpus
        return cpus

    def _online_cpus(self) -> frozenset[int]:
        text = _text(os.path.join(self._sys, "devices", "system", "cpu", "online"))
        try:
            return frozenset() if text is None else parse_cpulist(text)
        except ValueError:
            return frozenset()

    def _complain(self, kind: str, message: str) -> None:
        """A bad file: WARNING the first time for its kind of file, DEBUG after."""
        level = logging.DEBUG if kind in self._complained else logging.WARNING
        self._complained.add(kind)
        log.log(level, "processes: %s; facts it feeds are left out", message)


__all__ = [
    "ADOPTERS",
    "ALONE",
    "CLK_TCK",
    "DESKTOP_PROCESSES",
    "CgroupLine",
    "Facts",
    "ProcessesConfig",
    "ProcessesSource",
    "Stat",
    "cpu_cgroup",
    "cpus_allowed",
    "desktop_name",
    "group_jobs",
    "launch_key",
    "in_container",
    "parse_cfs_quota",
    "parse_cgroup",
    "parse_children",
    "parse_cpu_max",
    "parse_cpulist",
    "parse_cudart",
    "parse_flat_keyed",
    "parse_stat",
    "parse_status",
    "status_value",
    "thread_times",
    "version_number",
]
