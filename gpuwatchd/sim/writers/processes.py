"""The simulator's GPU processes: /proc/<pid>/… and their cgroups, in the kernel's formats.

`ProcessesWriter(procfs_root, sysfs_root, timeline).write(t)` writes, for every process
in `node.host.processes` and every pid a GPU's `processes` list names (those without
host facts get `HostProcess` defaults and the GPU entry's name):

* `<procfs>/<pid>/stat` (fs/proc/array.c, 52 fields, comm cut at 15 bytes; the ppid
  is the fact's `ppid`, 1 while that parent is not running; tty_nr its `tty`), `status`
  (`Key:\\tvalue` lines: `Name`, `State`, `Tgid`, `PPid`, `Uid`, `Threads`,
  `Cpus_allowed` / `Cpus_allowed_list`, `Vm*` …), `comm`, `cmdline` (`cmdline`, or
  /usr/bin/NAME; NUL-terminated arguments), `cgroup` (v2: `0::/path`) and
  `maps` (the interpreter, libc and, with `cudart: "12.1"`,
  `/usr/local/cuda-12.1/lib64/libcudart.so.12.1.105`; `cudart: "12"` maps the pip
  wheel's `…/nvidia/cuda_runtime/lib/libcudart.so.12`), with the kernel's padding;
* `<procfs>/<pid>/task/<tid>/{stat,children}`: `threads` threads (default 8); the main
  thread (tid = pid) runs at `main_thread_cpu_percent` (default 20), the others share
  `other_threads_cpu_percent` (default 10) equally; other tids are pid*1000+500+j; the
  main thread's `children` lists its workers, then the processes whose `ppid` is this
  pid (a launcher's ranks), by pid;
* `workers` child processes (default 0), pids pid*1000+1 … (listed, each followed by a
  space, in the main thread's `children`), ppid = pid, comm `pt_data_worker` (as
  PyTorch names its DataLoader workers), each at `worker_cpu_percent` of a core; the
  first `io_blocked_workers` of them in state D (waiting for I/O) in their `stat`;
  `majflt` (stat's field 12) rises by `major_faults_per_second` on the main process
  (from 120) and `worker_major_faults_per_second` on each worker (from 0);
* `<sysfs>/fs/cgroup/<cgroup>/cpu.max` ("max 100000", or `cpu_quota_cpus` × 100000)
  and `cpu.stat` (`usage_usec` … `burst_usec`): the cgroup's processes' CPU time;
  with a quota, `nr_periods` rises 10/s (100 ms periods) and `nr_throttled` by
  `throttled_ratio` of them, each throttled period adding half a period to
  `throttled_usec`. A cgroup shared by several processes takes its quota and
  throttling from the first of them (by pid) that sets one; `memory.pressure` (PSI,
  `some` at `memory_pressure_percent` in all three averages, `full` 0) likewise.

CPU times integrate the percentages with `Integrator` in USER_HZ (100) ticks, split
90 % user / 10 % system; the process's times are its threads' summed before they are
cut to whole ticks (as the kernel sums nanoseconds), so they can exceed the sum of the
threads' printed ticks by a few. The counters move at the rates of the previous write
(a step function), so a change of rate shows from the write after it. A
process with `container: true` whose cgroup names no container runtime is put in
`/system.slice/docker-<id>.scope`. `running: false` removes the pid's directories and
its workers'; a process (or worker) that appears again is a new one: a later
`starttime` and counters from zero, as after a restart. The node booted 1000 s before
the scenario starts: `<procfs>/uptime` reads 1000 s plus the scenario's time, so a
process's age is the scenario time since it first appeared. Only a changed file is
written, through a temporary file and `os.replace`.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.files import Files
from gpuwatchd.sim.host import HostProcess
from gpuwatchd.sim.scenario import Timeline
from gpuwatchd.sim.sysfs import cpulist, cpumask
from gpuwatchd.sim.writers.psi import psi_line

USER_HZ = 100
BOOT_SECONDS = 1000.0  # uptime when the scenario starts
PERIOD_US = 100_000  # CFS bandwidth period (cpu.max's second number)
USER_SHARE = 0.9
WORKER_NAME = "pt_data_worker"
MAX_WORKERS = 499  # worker pids pid*1000+1 … pid*1000+499
MAX_THREADS = 500  # thread ids pid, pid*1000+501 … pid*1000+999
DEFAULTS: dict[str, Any] = dict(
    main_thread_cpu_percent=20.0,
    threads=8,
    other_threads_cpu_percent=10.0,
    workers=0,
    worker_cpu_percent=0.0,
    cpu_quota_cpus=None,
    throttled_ratio=0.0,
    running=True,
    major_faults_per_second=0.0,
    worker_major_faults_per_second=0.0,
    memory_pressure_percent=None,
)
# patch level of the libcudart file each CUDA release ships (the file maps show)
CUDART_PATCH = {"11.8": 89, "12.1": 105, "12.2": 140, "12.4": 127, "12.6": 77, "12.8": 90}
CONTAINER_MARKERS = ("docker", "containerd", "kubepods", "libpod", "crio", "podman", "lxc")


def worker_pid(pid: int, k: int) -> int:
    """The pid of worker k (0-based) of process `pid`."""
    return pid * 1000 + 1 + k


def worker_pids(pid: int, workers: int) -> list[int]:
    """The pids of the process's first `workers` workers."""
    return [worker_pid(pid, k) for k in range(workers)]


def thread_id(pid: int, j: int) -> int:
    """The tid of thread j (0: the main thread, tid = pid)."""
    return pid if j == 0 else pid * 1000 + 500 + j


def expand_cpulist(text: str) -> list[int]:
    """A scenario's "0-31,64-95" as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def stat_line(
    pid: int,
    comm: str,
    state: str,
    ppid: int,
    utime: int,
    stime: int,
    threads: int,
    starttime: int,
    processor: int,
    vsize: int = 0,
    rss_pages: int = 0,
    majflt: int = 120,
    kthread: bool = False,
    tty_nr: int = 0,
) -> str:
    """One /proc/<pid>/stat line as fs/proc/array.c prints it: 52 fields. A kernel
    thread (kthreadd's child) has process group and session 0, the PF_KTHREAD flag and
    no page faults."""
    group = 0 if kthread else pid if ppid <= 1 else ppid  # a worker: its parent's group
    flags = 0x208040 if kthread else 4194560 if ppid else 4194304  # PF_KTHREAD / PF_RANDOMIZE
    minflt = 0 if kthread else 183_000
    fields = [
        f"{pid} ({comm[:15]})", state, ppid, group, group, tty_nr, -1, flags,
        minflt, 0, majflt, 0,  # minflt cminflt majflt cmajflt
        utime, stime, 0, 0,  # utime stime cutime cstime
        20, 0, threads, 0, starttime, vsize, rss_pages, 18446744073709551615,
        1, 1, 0, 0, 0,  # startcode endcode startstack kstkesp kstkeip (hidden)
        0, 0, 16781312, 134234626,  # signal blocked sigignore sigcatch
        1, 0, 0, 17, processor, 0, 0, 0, 0, 0,  # wchan … cguest_time
        0, 0, 0, 0, 0, 0, 0,  # start_data … env_end (hidden)
        0,  # exit_code
    ]  # fmt: skip
    assert len(fields) == 51  # the first holds two: pid and (comm)
    return " ".join(map(str, fields)) + "\n"


def status_text(
    pid: int,
    name: str,
    state: str,
    ppid: int,
    uid: int,
    threads: int,
    cpus: list[int],
    nr_cpus: int,
    numa_nodes: int,
) -> str:
    """/proc/<pid>/status as fs/proc/array.c prints it (`Key:\\tvalue`)."""
    states = {"R": "R (running)", "S": "S (sleeping)"}
    vm = (
        ("VmPeak", 18_437_212), ("VmSize", 18_302_144), ("VmLck", 0), ("VmPin", 0),
        ("VmHWM", 6_120_332), ("VmRSS", 5_980_112), ("RssAnon", 5_210_004),
        ("RssFile", 760_004), ("RssShmem", 10_104), ("VmData", 9_622_300),
        ("VmStk", 132), ("VmExe", 2_868), ("VmLib", 1_030_660), ("VmPTE", 14_212),
        ("VmSwap", 0), ("HugetlbPages", 0),
    )  # fmt: skip
    nodes = (1 << numa_nodes) - 1
    group = pid if ppid <= 1 else ppid
    lines = [
        f"Name:\t{name[:15]}",
        "Umask:\t0022",
        f"State:\t{states.get(state, state)}",
        f"Tgid:\t{pid}",
        "Ngid:\t0",
        f"Pid:\t{pid}",
        f"PPid:\t{ppid}",
        "TracerPid:\t0",
        f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}",
        f"Gid:\t{uid}\t{uid}\t{uid}\t{uid}",
        "FDSize:\t512",
        f"Groups:\t{uid} ",
        f"NStgid:\t{pid}",
        f"NSpid:\t{pid}",
        f"NSpgid:\t{group}",
        f"NSsid:\t{group}",
        "Kthread:\t0",
        *(f"{key}:\t{value:8d} kB" for key, value in vm),
        f"Threads:\t{threads}",
        "SigQ:\t0/2062769",
        "SigPnd:\t0000000000000000",
        "ShdPnd:\t0000000000000000",
        "SigBlk:\t0000000000000000",
        "SigIgn:\t0000000001001000",
        "SigCgt:\t0000000108004002",
        "CapInh:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "CapEff:\t0000000000000000",
        "CapBnd:\t000001ffffffffff",
        "CapAmb:\t0000000000000000",
        "NoNewPrivs:\t0",
        "Seccomp:\t0",
        "Seccomp_filters:\t0",
        "Speculation_Store_Bypass:\tthread vulnerable",
        "SpeculationIndirectBranch:\tconditional enabled",
        f"Cpus_allowed:\t{cpumask(cpus, nr_cpus)}",
        f"Cpus_allowed_list:\t{cpulist(cpus)}",
        f"Mems_allowed:\t{','.join(['00000000'] * 31)},{nodes:08x}",
        f"Mems_allowed_list:\t{cpulist(list(range(numa_nodes)))}",
        "voluntary_ctxt_switches:\t52311",
        "nonvoluntary_ctxt_switches:\t1208",
    ]
    return "\n".join(lines) + "\n"


def maps_line(start: int, end: int, perms: str, offset: int, inode: int, path: str) -> str:
    """A /proc/<pid>/maps line: show_map_vma()'s header, padded to column 73, then the path."""
    device = "103:02" if inode else "00:00"
    head = f"{start:08x}-{end:08x} {perms} {offset:08x} {device} {inode} "
    if not path:
        return head + "\n"
    return head.ljust(73) + path + "\n"


def maps_text(cudart: str | None) -> str:
    """The memory maps of a Python training process (a representative subset)."""
    regions = [
        (0x55D5C5A00000, 0x55D5C5A2E000, "r--p", 0, 1311, "/usr/bin/python3.10"),
        (0x55D5C5A2E000, 0x55D5C5D1B000, "r-xp", 0x2E000, 1311, "/usr/bin/python3.10"),
        (0x55D5C7A1C000, 0x55D5C9F3E000, "rw-p", 0, 0, "[heap]"),
        (0x7F3A2C000000, 0x7F3A2C021000, "rw-p", 0, 0, ""),
        (0x7F3A31228000, 0x7F3A313BD000, "r-xp", 0x28000, 2044,
         "/usr/lib/x86_64-linux-gnu/libc.so.6"),
    ]  # fmt: skip
    if cudart:
        if "." in cudart:
            patch = CUDART_PATCH.get(cudart, 0)
            path = f"/usr/local/cuda-{cudart}/lib64/libcudart.so.{cudart}.{patch}"
        else:  # the pip wheel nvidia-cuda-runtime-cu12 names the file by major only
            path = (
                "/opt/venv/lib/python3.10/site-packages/nvidia/cuda_runtime/lib/"
                f"libcudart.so.{cudart}"
            )
        regions += [
            (0x7F3A4E200000, 0x7F3A4E229000, "r--p", 0, 7340, path),
            (0x7F3A4E229000, 0x7F3A4E28C000, "r-xp", 0x29000, 7340, path),
            (0x7F3A4E28C000, 0x7F3A4E2A1000, "r--p", 0x8C000, 7340, path),
        ]
    regions.append((0x7FFC5E0E2000, 0x7FFC5E103000, "rw-p", 0, 0, "[stack]"))
    return "".join(maps_line(*region) for region in regions)


V1_CPU = "cpu,cpuacct"  # the v1 hierarchy of the cpu controller (as systemd mounts it)
SLURMD_CGROUP = "/system.slice/slurmd.service"
# a login shell's environment, before a process's own `environment`
BASE_ENVIRONMENT = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


def environ_text(fact: HostProcess) -> str:
    """/proc/<pid>/environ: `KEY=value` entries, each followed by a NUL."""
    variables = {**BASE_ENVIRONMENT, "HOME": f"/home/u{fact.uid}", **fact.environment}
    return "".join(f"{key}={value}\0" for key, value in variables.items())


def cgroup_of(fact: HostProcess) -> tuple[str, str]:
    """(/proc/<pid>/cgroup, the cgroup holding its CPU limit: a v2 path, or for cgroup
    v1 `/cpu,cpuacct/<path>`). An owner's layout (host.SlurmOwner, PodOwner) replaces
    `cgroup`; a Slurm step on v1 has its `cpu` controller at slurmd's cgroup."""
    owner = fact.owner
    slurm = owner.slurm if owner is not None else None
    if slurm is not None and slurm.cgroup == "v1":
        step = f"/slurm/uid_{fact.uid}/job_{slurm.job}/step_{slurm.step}"
        task = f"{step}/task_{slurm.task}"
        lines = (
            f"12:freezer:{step}", f"11:devices:{task}", f"10:memory:{task}",
            f"9:cpuset:{step}", f"4:{V1_CPU}:{SLURMD_CGROUP}", f"1:name=systemd:{SLURMD_CGROUP}",
        )  # fmt: skip
        return "\n".join(lines) + "\n", f"/{V1_CPU}{SLURMD_CGROUP}"
    path = container_cgroup(fact)
    return f"0::{path}\n", path


def _owner_path(fact: HostProcess) -> str | None:
    """The cgroup v2 path of a process's owner; None: it has none (or a v1 Slurm one)."""
    owner = fact.owner
    if owner is None:
        return None
    if owner.slurm is not None:
        slurm = owner.slurm
        if slurm.cgroup == "v1":
            return None
        step = f"/system.slice/slurmstepd.scope/job_{slurm.job}/step_{slurm.step}"
        return f"{step}/user/task_{slurm.task}"
    pod = owner.pod
    assert pod is not None
    container = pod.container_id or hashlib.sha256(f"pod/{fact.pid}".encode()).hexdigest()
    qos = "" if pod.qos == "guaranteed" else pod.qos
    if pod.driver == "cgroupfs":
        return "/".join(("/kubepods", *([qos] if qos else []), f"pod{pod.uid}", container))
    uid = pod.uid.replace("-", "_")
    slice_ = f"kubepods-{qos}-pod{uid}.slice" if qos else f"kubepods-pod{uid}.slice"
    scope = f"{'crio' if pod.runtime == 'cri-o' else 'cri-containerd'}-{container}.scope"
    parent = f"/kubepods.slice/kubepods-{qos}.slice" if qos else "/kubepods.slice"
    return f"{parent}/{slice_}/{scope}"


def container_cgroup(fact: HostProcess) -> str:
    """The process's cgroup v2 path (its owner's, if it has one on v2); a container's is
    made to name its runtime."""
    path = "/" + (_owner_path(fact) or fact.cgroup).strip("/")
    if fact.container and not any(marker in path for marker in CONTAINER_MARKERS):
        digest = hashlib.sha256(f"container/{fact.pid}".encode()).hexdigest()
        path = f"/system.slice/docker-{digest}.scope"
    return path


@dataclass
class _Running:
    """A process the tree holds: when it was born and its counters' values then."""

    born: float
    workers: int = 0  # as last written
    threads: int = 0
    # states, threads, workers, (ppid, child processes)
    shape: tuple[str, str, str, int, int, tuple[int, tuple[int, ...]]] | None = None


class ProcessesWriter:
    """Writes and updates the GPU processes of `timeline`'s node under the two roots."""

    def __init__(
        self, procfs_root: Path, sysfs_root: Path, timeline: Timeline, ptrace: bool = True
    ) -> None:
        self.proc = os.fspath(procfs_root)
        self.cgroup_root = os.path.join(os.fspath(sysfs_root), "fs", "cgroup")
        self.timeline = timeline
        # False: the daemon as the unit and DaemonSet ship it (its own user, no
        # CAP_SYS_PTRACE): every process is another user's, and its ptrace-gated files
        # (environ, maps; io, fd/ and fdinfo/ in ProcIoWriter) refuse it
        self.ptrace = ptrace
        node = timeline.scenario.node
        self._nr_cpus = node.cpus
        self._numa_nodes = node.numa_nodes
        self._facts = {p.pid: p for p in node.host.processes}
        self._integrator = Integrator()
        self._base: dict[Hashable, float] = {}  # counter -> its total at birth
        self._running: dict[int, _Running] = {}
        self.files = Files()
        self._maps: dict[str | None, str] = {}
        self._child_start: dict[int, int] = {}  # worker pid -> its starttime
        self._cpu_lists: dict[str | None, list[int]] = {}
        self._gpu_only: dict[int, HostProcess] = {}  # pids on a GPU without host facts
        self._cgroup_paths: dict[int, str] = {}

    @property
    def writes(self) -> int:
        """Files written so far (changed content only)."""
        return self.files.writes

    def pids(self, t: float) -> dict[int, HostProcess]:
        """Every process the node has at time t (running or not), by pid."""
        gpus, _ = self.timeline.state(t)
        facts = dict(self._facts)
        for gpu in gpus:
            for entry in gpu["processes"]:
                pid = int(entry["pid"])
                if pid not in facts:
                    fact = self._gpu_only.get(pid)
                    if fact is None:
                        fact = HostProcess(pid=pid, name=entry.get("name", "python"))
                        self._gpu_only[pid] = fact
                    facts[pid] = fact
        return facts

    def write(self, t: float) -> int:
        """Bring the trees to the node's state at time t; returns how many files changed."""
        before = self.writes
        # the clock of the processes' start times (fs/proc/uptime.c: seconds since boot,
        # then idle seconds summed over the CPUs, both with 2 decimals)
        uptime = BOOT_SECONDS + t
        self.files.put(f"{self.proc}/uptime", f"{uptime:.2f} {uptime * self._nr_cpus * 0.9:.2f}\n")
        host_values = self.timeline.host_state(t).get("processes") or {}
        facts = self.pids(t)
        plans: dict[int, tuple[HostProcess, dict[str, Any]]] = {}
        for pid, fact in sorted(facts.items()):
            values = {**DEFAULTS, **host_values.get(pid, {})}
            if values["running"] is False:
                if pid in self._running:
                    self._remove(pid)
                continue
            plans[pid] = (fact, values)
        for pid in [p for p in self._running if p not in plans]:
            self._remove(pid)
        # parents: a process whose parent is not running was reparented to init
        parents = {pid: fact.ppid if fact.ppid <= 1 or fact.ppid in plans else 1
                   for pid, (fact, _) in plans.items()}  # fmt: skip
        children: dict[int, list[int]] = {}
        for pid, ppid in parents.items():
            if ppid > 1:
                children.setdefault(ppid, []).append(pid)

        # rates: thread and worker ticks per second, cgroup counters per second
        rates: dict[Hashable, float] = {}
        cgroups: dict[str, dict[str, Any]] = {}
        for pid, (fact, values) in plans.items():
            threads = max(1, int(values["threads"]))
            workers = max(0, int(values["workers"]))
            if threads > MAX_THREADS or workers > MAX_WORKERS:
                raise ValueError(
                    f"process {pid}: at most {MAX_THREADS} threads and {MAX_WORKERS} workers "
                    "can be simulated"
                )
            main = float(values["main_thread_cpu_percent"]) * USER_HZ / 100
            others = float(values["other_threads_cpu_percent"]) * USER_HZ / 100
            rates[(pid, "t", 0)] = main
            for j in range(1, threads):
                rates[(pid, "t", j)] = others / (threads - 1)
            per_worker = float(values["worker_cpu_percent"]) * USER_HZ / 100
            for k in range(workers):
                rates[(pid, "w", k)] = per_worker
                rates[(pid, "wf", k)] = float(values["worker_major_faults_per_second"])
            rates[(pid, "f")] = float(values["major_faults_per_second"])
            path = self._cgroup_paths.get(pid)
            if path is None:
                path = self._cgroup_paths[pid] = cgroup_of(fact)[1]
            group = cgroups.setdefault(path, {"ticks": 0.0})
            group["ticks"] += main + (others if threads > 1 else 0.0) + per_worker * workers
            for key in ("cpu_quota_cpus", "throttled_ratio", "memory_pressure_percent"):
                if values[key] is not None and key not in group:
                    group[key] = float(values[key])
        for path, group in cgroups.items():
            quota = group.get("cpu_quota_cpus")
            throttled = group.get("throttled_ratio", 0.0) if quota is not None else 0.0
            periods = 1e6 / PERIOD_US if quota is not None else 0.0
            rates[("cg", path, "usage")] = group["ticks"] * (1e6 / USER_HZ)
            rates[("cg", path, "periods")] = periods
            rates[("cg", path, "throttled")] = periods * throttled
            rates[("cg", path, "throttled_usec")] = periods * throttled * PERIOD_US / 2
            stalled = group.get("memory_pressure_percent", 0.0)
            rates[("cg", path, "memory_stall_usec")] = stalled * 1e4  # µs stalled per second
        totals = self._integrator.advance(t, rates)

        for pid, (fact, values) in plans.items():
            family = (parents[pid], tuple(children.get(pid, ())))
            self._write_process(t, pid, fact, values, totals, family)
        for path, group in cgroups.items():
            self._write_cgroup(path, group, totals)
        return self.writes - before

    # -- one process --------------------------------------------------------------------

    def _count(self, totals: dict[Hashable, float], key: Hashable, new: bool) -> float:
        """A counter's value since its process (or thread, worker) was born."""
        total = totals.get(key, 0.0)
        if new or key not in self._base:
            self._base[key] = total
        return total - self._base[key]

    def _write_process(
        self,
        t: float,
        pid: int,
        fact: HostProcess,
        values: dict[str, Any],
        totals: dict[Hashable, float],
        family: tuple[int, tuple[int, ...]] = (1, ()),
    ) -> None:
        """`family`: the process's parent pid and its child processes (not workers)."""
        running = self._running.get(pid)
        new = running is None
        if running is None:
            running = self._running[pid] = _Running(born=t)
        threads = max(1, int(values["threads"]))
        workers = max(0, int(values["workers"]))
        start = round((BOOT_SECONDS + running.born) * USER_HZ)
        cpus = self._cpus(fact.cpus_allowed)
        name = fact.name[:15]
        base = f"{self.proc}/{pid}"
        put = self.files.put
        main_state = "R" if float(values["main_thread_cpu_percent"]) >= 50 else "S"
        other_state = "S"
        if threads > 1 and float(values["other_threads_cpu_percent"]) / (threads - 1) >= 50:
            other_state = "R"
        worker_state = "R" if float(values["worker_cpu_percent"]) >= 50 else "S"

        # what changes only with the process's shape: written when that changes
        ppid, _ = family
        shape = (main_state, other_state, worker_state, threads, workers, family)
        if running.shape != shape:
            self._write_static(pid, fact, running, shape, cpus)

        # threads; the process's times are the sum of its threads' before rounding to ticks
        process_ticks = 0.0
        for j in range(threads):
            exact = self._count(totals, (pid, "t", j), new or j >= running.threads)
            process_ticks += exact
            ticks = math.floor(exact)
            user = math.floor(ticks * USER_SHARE)
            line = stat_line(
                thread_id(pid, j), name, other_state if j else main_state, ppid, user,
                ticks - user, threads, start + j, cpus[j % len(cpus)], tty_nr=fact.tty_nr,
            )  # fmt: skip
            put(f"{base}/task/{thread_id(pid, j)}/stat", line)
        running.threads = threads

        # workers
        for k in range(workers):
            child = worker_pid(pid, k)
            fresh = new or k >= running.workers
            ticks = math.floor(self._count(totals, (pid, "w", k), fresh))
            user = math.floor(ticks * USER_SHARE)
            if fresh or child not in self._child_start:
                self._child_start[child] = round((BOOT_SECONDS + t) * USER_HZ)
            blocked = k < int(values.get("io_blocked_workers") or 0)  # waiting for I/O
            faults = math.floor(self._count(totals, (pid, "wf", k), fresh))
            line = stat_line(
                child, WORKER_NAME, "D" if blocked else worker_state, pid, user, ticks - user, 1,
                self._child_start[child], cpus[(threads + k) % len(cpus)], majflt=faults,
            )  # fmt: skip
            put(f"{self.proc}/{child}/stat", line)
            put(f"{self.proc}/{child}/task/{child}/stat", line)
        running.workers = workers

        ticks = math.floor(process_ticks)
        utime = math.floor(ticks * USER_SHARE)
        faults = 120 + math.floor(self._count(totals, (pid, "f"), new))
        line = stat_line(
            pid, name, main_state, ppid, utime, ticks - utime, threads, start, cpus[0],
            18_302_144 * 1024, 5_980_112 // 4, faults, tty_nr=fact.tty_nr,
        )  # fmt: skip
        put(f"{base}/stat", line)

    def _write_static(
        self,
        pid: int,
        fact: HostProcess,
        running: _Running,
        shape: tuple[str, str, str, int, int, tuple[int, tuple[int, ...]]],
        cpus: list[int],
    ) -> None:
        """status, comm, cgroup, maps, children of the process and its workers."""
        main_state, _, worker_state, threads, workers, (ppid, kids) = shape
        old_threads, old_workers = running.shape[3:5] if running.shape else (0, 0)
        name = fact.name[:15]
        base = f"{self.proc}/{pid}"
        cgroup = cgroup_of(fact)[0]
        maps = self._maps_of(fact.cudart)
        nr_cpus, numa_nodes = self._nr_cpus, self._numa_nodes
        put = self.files.put
        status = status_text(
            pid, name, main_state, ppid, fact.uid, threads, cpus, nr_cpus, numa_nodes
        )
        put(f"{base}/status", status)
        put(f"{base}/comm", name + "\n")
        cmdline = "".join(arg + "\0" for arg in fact.argv)
        put(f"{base}/cmdline", cmdline)
        put(f"{base}/cgroup", cgroup)
        if fact.environ_readable and self.ptrace:
            put(f"{base}/environ", environ_text(fact))
        else:
            self.files.deny(f"{base}/environ")
        if self.ptrace:
            put(f"{base}/maps", maps)
        else:
            self.files.deny(f"{base}/maps")
        listed = "".join(f"{child} " for child in [*worker_pids(pid, workers), *kids])
        for j in range(threads):
            put(f"{base}/task/{thread_id(pid, j)}/children", listed if j == 0 else "")
        for j in range(threads, old_threads):  # threads that ended
            self._rmtree(f"{base}/task/{thread_id(pid, j)}")
        for k in range(workers):
            child = worker_pid(pid, k)
            cbase = f"{self.proc}/{child}"
            status = status_text(
                child, WORKER_NAME, worker_state, pid, fact.uid, 1, cpus, nr_cpus, numa_nodes
            )
            put(f"{cbase}/status", status)
            put(f"{cbase}/task/{child}/children", "")
            put(f"{cbase}/comm", WORKER_NAME + "\n")
            put(f"{cbase}/cmdline", cmdline)  # a fork: its parent's argv
            put(f"{cbase}/cgroup", cgroup)
            put(f"{cbase}/maps", maps)
        for k in range(workers, old_workers):  # workers that exited
            self._rmtree(f"{self.proc}/{worker_pid(pid, k)}")
            self._child_start.pop(worker_pid(pid, k), None)
        running.shape = shape

    def _cpus(self, allowed: str | None) -> list[int]:
        cpus = self._cpu_lists.get(allowed)
        if cpus is None:
            cpus = expand_cpulist(allowed) if allowed else []
            cpus = [c for c in cpus if c < self._nr_cpus] or list(range(self._nr_cpus))
            self._cpu_lists[allowed] = cpus
        return cpus

    def _maps_of(self, cudart: str | None) -> str:
        text = self._maps.get(cudart)
        if text is None:
            text = self._maps[cudart] = maps_text(cudart)
        return text

    def _write_cgroup(
        self, path: str, group: dict[str, Any], totals: dict[Hashable, float]
    ) -> None:
        quota = group.get("cpu_quota_cpus")
        if path.startswith(f"/{V1_CPU}/"):
            self._write_cgroup_v1(path, quota, totals)
            return
        directory = self.cgroup_root + path
        some = group.get("memory_pressure_percent", 0.0)
        stalled = int(totals.get(("cg", path, "memory_stall_usec"), 0.0))
        self.files.put(
            f"{directory}/memory.pressure",
            psi_line("some", some, some, some, stalled) + psi_line("full", 0, 0, 0, 0),
        )
        cpu_max = "max" if quota is None else str(round(quota * PERIOD_US))
        self.files.put(f"{directory}/cpu.max", f"{cpu_max} {PERIOD_US}\n")
        usage = int(totals.get(("cg", path, "usage"), 0.0))
        user = int(usage * USER_SHARE)
        periods = int(totals.get(("cg", path, "periods"), 0.0))
        throttled = min(periods, int(totals.get(("cg", path, "throttled"), 0.0)))
        throttled_usec = int(totals.get(("cg", path, "throttled_usec"), 0.0))
        self.files.put(
            f"{directory}/cpu.stat",
            f"usage_usec {usage}\nuser_usec {user}\nsystem_usec {usage - user}\n"
            f"nr_periods {periods}\nnr_throttled {throttled}\n"
            f"throttled_usec {throttled_usec}\nnr_bursts 0\nburst_usec 0\n",
        )

    def _write_cgroup_v1(
        self, path: str, quota: float | None, totals: dict[Hashable, float]
    ) -> None:
        """cgroup v1's cpu controller: cfs quota and period, cpu.stat (throttled_time in
        ns), cpuacct.usage (ns)."""
        directory = self.cgroup_root + path
        periods = int(totals.get(("cg", path, "periods"), 0.0))
        throttled = min(periods, int(totals.get(("cg", path, "throttled"), 0.0)))
        throttled_ns = int(totals.get(("cg", path, "throttled_usec"), 0.0)) * 1000
        cfs_quota = -1 if quota is None else round(quota * PERIOD_US)
        self.files.put(f"{directory}/cpu.cfs_quota_us", f"{cfs_quota}\n")
        self.files.put(f"{directory}/cpu.cfs_period_us", f"{PERIOD_US}\n")
        self.files.put(
            f"{directory}/cpu.stat",
            f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_time {throttled_ns}\n",
        )
        usage = int(totals.get(("cg", path, "usage"), 0.0))
        self.files.put(f"{directory}/cpuacct.usage", f"{usage * 1000}\n")

    # -- files ----------------------------------------------------------------------------

    def _remove(self, pid: int) -> None:
        running = self._running.pop(pid)
        for k in range(running.workers):
            self._rmtree(f"{self.proc}/{worker_pid(pid, k)}")
            self._child_start.pop(worker_pid(pid, k), None)
        self._rmtree(f"{self.proc}/{pid}")

    def _rmtree(self, directory: str) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        self.files.forget(directory)


__all__ = [
    "DEFAULTS",
    "WORKER_NAME",
    "ProcessesWriter",
    "cgroup_of",
    "container_cgroup",
    "environ_text",
    "expand_cpulist",
    "maps_line",
    "maps_text",
    "stat_line",
    "status_text",
    "thread_id",
    "worker_pid",
]
