"""ProcessesSource: wires the parts of the processes source and emits its samples.

Per poll (`collect`): the GPUs' process lists (gpus.NvmlLists), desktop processes
(desktop.DesktopWatch), the main process of each GPU read once (facts.MainProcessReader),
owners and launch facts (gpuwatchd.sources.owner), jobs (jobs.group_jobs), then one set
of samples per GPU and the node-wide desktop ones. What the series mean is documented in
gpuwatchd.sources.processes, which re-exports this class (registered as `processes`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuwatchd.config import ProcessesConfig, SourceConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sources import processes as package
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, not_mounted, settings_of
from gpuwatchd.sources.nvmlapi import process_table, quietly
from gpuwatchd.sources.owner import (
    Attribution,
    GpuProcesses,
    InstanceProcesses,
    Owner,
    PodResources,
    ProcessFacts,
)
from gpuwatchd.sources.owner.process import user_name
from gpuwatchd.sources.processes.desktop import DesktopWatch, _Desktop
from gpuwatchd.sources.processes.facts import Facts, MainProcessReader, _CgroupReading, _Known
from gpuwatchd.sources.processes.gpus import KINDS, NvmlLists, _Gpu
from gpuwatchd.sources.processes.instances import Instance, group_instances, instance_samples
from gpuwatchd.sources.processes.jobs import (
    ADOPTERS,
    ALONE,
    _Memo,
    group_jobs,
    is_launcher,
    launch_key,
)
from gpuwatchd.sources.processes.metrics import (
    AGE,
    BUSIEST,
    CONTAINER,
    CPU,
    CPUS_ALLOWED,
    CUDART,
    DESKTOP,
    DESKTOP_COUNT,
    DESKTOP_CPU,
    DESKTOP_CPU_BY_NAME,
    FABRIC_MANAGER,
    INFO,
    INSTANCE_FORMS,
    JOB,
    LAUNCHED,
    MEMORY_PRESSURE,
    NUMA_ALIGNED,
    OTHERS,
    OWNER,
    PID,
    PROCESSES,
    QUOTA,
    THREADS,
    THROTTLED,
    THROTTLED_SECONDS,
    WORKERS,
    WORKERS_CPU,
)
from gpuwatchd.sources.processes.procfs import _is_count, parse_cpulist, version_number
from gpuwatchd.sources.procio import METRICS as PROCIO_METRICS
from gpuwatchd.sources.procio import JobIo
from gpuwatchd.sources.ties import PidOnGpu, pid_table

log = logging.getLogger("gpuwatchd.sources.processes")


@dataclass(frozen=True)
class _Round:
    """What one poll found, for the samples of a MIG-enabled GPU's instances."""

    facts: dict[int, Facts | None]  # main pid -> its facts (None: gone, unreadable)
    jobs: dict[int, int]
    launched: dict[int, bool]
    desktop: set[int]
    scanning: bool


# Sample._make without its Python frame (a namedtuple's __new__ is Python): no bytecode
# a sample where a main process's samples are copied under each GPU's labels
_make_sample: Callable[[tuple[Any, ...]], Sample] = functools.partial(tuple.__new__, Sample)


def _candidates(lists: dict[str, dict[int, float]], desktop: set[int]) -> dict[int, float]:
    """The processes a GPU's main one is chosen among (ProcessesSource._main): its
    non-desktop compute processes, else its non-desktop graphics ones; pid -> memory."""
    for kind in KINDS:
        found = {pid: memory for pid, memory in lists.get(kind, {}).items()
                 if pid not in desktop}  # fmt: skip
        if found:
            return found
    return {}


@register
class ProcessesSource(NvmlLists, MainProcessReader, DesktopWatch, Source):
    name = "processes"
    metrics = (
        PROCESSES, DESKTOP, OTHERS, INFO, PID, JOB, LAUNCHED, OWNER, CPU, BUSIEST, THREADS, WORKERS,
        WORKERS_CPU, CPUS_ALLOWED, NUMA_ALIGNED, QUOTA, THROTTLED, THROTTLED_SECONDS,
        MEMORY_PRESSURE, CONTAINER, CUDART, AGE, DESKTOP_CPU, DESKTOP_COUNT, DESKTOP_CPU_BY_NAME,
        FABRIC_MANAGER, *PROCIO_METRICS, *INSTANCE_FORMS.values(),
    )  # fmt: skip

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self.settings = settings_of(config, ProcessesConfig)
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._proc = os.fspath(context.procfs)
        self._sys = os.fspath(context.sysfs)
        self._cgroup_root = os.path.join(self._sys, "fs", "cgroup")
        self._table = process_table(context)  # the nvml source's lists, when it runs
        self._pids = pid_table(context.extras)  # what it finds, for the kmsg source
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
        self._fabric_managers: set[int] = set()
        self._consoles: set[int] = set()
        self._cgroups: dict[str, tuple[float, int, int]] = {}  # cpu.stat -> (at, periods, thr)
        # main pid -> its stat and cgroup as this poll read them, for the owners' reader
        self._read_now: dict[int, tuple[bytes, bytes]] = {}
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
        # main pid -> its samples' names, labels after the GPU's and values, this poll
        self._rows: dict[int, tuple[tuple[Any, ...], ...]] = {}

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
            # the node's user database: the simulator's is its scenario's
            users=self.context.extras.get("user_name", user_name),
        )

    def close(self) -> None:
        self._owners.close()
        nv, self._nv = self._nv, None
        if nv is not None:
            quietly(nv, nv.nvmlShutdown)

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
        scanning = (self.polls - 1) % self.settings.scan_every == 0

        # 1. who is on which GPU
        on_gpu = self._listed(shared) if shared is not None else self._ask_nvml()
        parts = [part for gpu, _ in on_gpu for part in group_instances(gpu)]  # MIG GIs
        listed = {pid for _, lists in on_gpu for used in lists.values() for pid in used}
        listed.update(pid for part in parts for pid in part.memory)
        names = self._names_of(listed)

        # 2. desktop processes and the fabric manager: NVML's, and every scan_every polls
        # /proc's (a scan finds them, and ppids on kernels without task/*/children)
        if scanning:
            self._online = self._online_cpus()
            self._scan()
        graphics = {pid for _, lists in on_gpu for pid in lists.get("graphics", {})}
        desktop: set[int] = set()  # listed pids that are desktop processes (evidence)
        for pid in listed:
            label = self._desktop_label(pid, names.get(pid) or "", pid in graphics)
            if label is not None:
                desktop.add(pid)
                if pid not in self._desktop:
                    self._desktop[pid] = _Desktop(label)

        # 3. the main process of each whole GPU and each MIG GPU instance (a MIG-enabled
        # GPU has none of its own), read once however many it drives
        mains: dict[int, int | None] = {}  # gpu index -> pid
        for gpu, lists in on_gpu:
            mains[gpu.index] = None if gpu.instances is not None else self._main(lists, desktop)
        part_mains = {i.key: self._main({"compute": i.memory}, desktop) for i in parts}
        memo: dict[str, _CgroupReading | None] = {}
        facts: dict[int, Facts | None] = {}
        self._io.begin(now)
        self._read_now = {}
        for main in (*mains.values(), *part_mains.values()):
            if main is not None and main not in facts:
                facts[main] = self._facts(main, now, scanning, memo)
        self._io.end()
        for gone in [p for p in self._known if p not in facts]:
            del self._known[gone]
        self._pids.publish(now, self._on_gpus(on_gpu, mains))
        read = {r.stat_path for r in memo.values() if r is not None}
        for path in [p for p in self._cgroups if p not in read]:
            del self._cgroups[path]

        launches = _Memo(self._owner_facts)
        owners, parts_owned = self._owned(on_gpu, parts, desktop, launches)
        jobs, launched = self._jobs(facts, launches)
        poll = _Round(facts, jobs, launched, desktop, scanning)
        self._rows = {}
        samples: list[Sample] = []
        for gpu, lists in on_gpu:
            if gpu.instances is not None:
                mine = [i for i in parts if i.gpu is gpu]
                self._mig_samples(gpu, lists, mine, part_mains, parts_owned, poll, samples)
                continue
            main = mains[gpu.index]
            self._gpu_samples(gpu, lists, desktop, main, facts, jobs, scanning, samples)
            if main in launched:
                samples.append(Sample(LAUNCHED.name, gpu.labels, float(launched[main])))
            owner = owners.get(gpu.labels[1])
            if owner is not None:
                samples.append(Sample(OWNER.name, gpu.labels + owner.values(), 1.0))
        self._desktop_samples(now, samples)
        self._fabric_manager_samples(samples)
        return samples

    def _on_gpus(
        self, on_gpu: list[tuple[_Gpu, dict[str, dict[int, float]]]], mains: dict[int, int | None]
    ) -> list[tuple[int, PidOnGpu]]:
        """Each whole GPU's main process and its children (DataLoader workers): the pids
        the kmsg source ties the OOM killer's kills to (ties.PidTable)."""
        found: list[tuple[int, PidOnGpu]] = []
        for gpu, _ in on_gpu:
            main = mains.get(gpu.index)
            known = None if main is None else self._known.get(main)
            if main is None or known is None or not gpu.bus_id:
                continue
            found.append((main, PidOnGpu(gpu.bus_id, "main")))
            found += [(child, PidOnGpu(gpu.bus_id, "worker")) for child in known.children]
        return found

    def _owned(
        self,
        on_gpu: list[tuple[_Gpu, dict[str, dict[int, float]]]],
        parts: list[Instance],
        desktop: set[int],
        read: Callable[[int], ProcessFacts | None],
    ) -> tuple[dict[str, Owner | None], dict[tuple[str, int], Owner | None]]:
        """uuid -> owner of each whole GPU and (uuid, GI) -> owner of each MIG GPU
        instance, from the processes their main one is chosen among."""
        if not self.settings.owner:
            return {}, {}
        gpus = [GpuProcesses(gpu.index, gpu.labels[1], _candidates(lists, desktop))
                for gpu, lists in on_gpu if gpu.instances is None]  # fmt: skip
        instances = [
            InstanceProcesses(i.gpu.index, i.gpu.labels[1], i.gpu_instance, i.mig_uuids,
                              _candidates({"compute": i.memory}, desktop))
            for i in parts
        ]  # fmt: skip
        return self._owners.attribute(gpus, instances, read)

    def _names_of(self, pids: set[int]) -> dict[int, str | None]:
        """comm of each pid NVML lists, read once while it stays listed."""
        names: dict[int, str | None] = {pid: self._names[pid] for pid in pids if pid in self._names}
        for pid in pids - names.keys():
            try:
                names[pid] = (
                    package._read(f"{self._proc}/{pid}/comm", 4096)
                    .decode("utf-8", "replace")
                    .rstrip("\n")
                )
            except OSError:
                names[pid] = None  # gone or unreadable: not cached, asked again next poll
        self._names = {pid: name for pid, name in names.items() if name is not None}
        return names

    @staticmethod
    def _main(lists: dict[str, dict[int, float]], desktop: set[int]) -> int | None:
        """Most GPU memory, compute before graphics, lowest pid on a tie; no desktop."""
        best: tuple[int, float, int] | None = None
        for rank, kind in enumerate(KINDS):
            for pid, memory in lists.get(kind, {}).items():
                if pid in desktop:
                    continue
                key = (-rank, memory, -pid)
                if best is None or key > best:
                    best = key
        return None if best is None else -best[2]

    def _jobs(
        self, facts: dict[int, Facts | None], read: Callable[[int], ProcessFacts | None]
    ) -> tuple[dict[int, int], dict[int, bool]]:
        """The job of each main process read this poll ("The job" in the package's
        docstring), and whether its environment names a launcher (where it was read)."""
        parents = {pid: found.ppid for pid, found in facts.items() if found is not None}
        keys = {pid: launch_key(read(pid)) for pid in parents}
        if not self.settings.owner:
            self._owners.processes.keep(set(parents))  # owners() keeps them otherwise
        launched = {pid: key != ALONE for pid, key in keys.items() if key is not None}
        return group_jobs(parents, self._adopter, keys, self._launches), launched

    def _read_uptime(self) -> float | None:
        """Seconds since boot (/proc/uptime's first field), the clock of starttime."""
        text = package._text(f"{self._proc}/uptime")
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
            comm = package._read(f"{self._proc}/{pid}/comm", 4096).decode("utf-8", "replace")
        except OSError:
            return False
        return comm.strip() in ADOPTERS

    def _owner_facts(self, pid: int) -> ProcessFacts | None:
        """The owners' reader's facts of `pid`, from its stat and cgroup as this poll
        read them where it did (a process can be moved: its cgroup is read every poll)."""
        return self._owners.processes.read(pid, *self._read_now.get(pid, (None, None)))

    def _launches(self, pid: int) -> bool:
        """True when the process is a launcher by its command (comm, argv), which any
        user may read: its children are ranks of one job though their environment is not
        readable. Unreadable (exited this instant, or hidden): not one."""
        try:
            comm = package._read(f"{self._proc}/{pid}/comm", 4096)
            cmdline = package._read(f"{self._proc}/{pid}/cmdline", 4096)
        except OSError:
            return False
        argv = cmdline.decode("utf-8", "replace").split("\0")
        return is_launcher(comm.decode("utf-8", "replace").strip(), argv)

    # -- samples --------------------------------------------------------------------------

    def _gpu_samples(
        self,
        gpu: _Gpu,
        lists: dict[str, dict[int, float]],
        desktop_pids: set[int],
        main: int | None,
        facts: dict[int, Facts | None],
        jobs: dict[int, int],
        scanning: bool,
        out: list[Sample],
    ) -> None:
        mains = {main} if main is not None else set()
        self._count_samples(gpu.labels, lists, (), desktop_pids, mains, out)
        found = facts.get(main) if main is not None else None
        if found is not None:
            self._main_samples(gpu, found, jobs, scanning, out)

    @staticmethod
    def _count_samples(
        labels: tuple[str, ...],
        lists: dict[str, dict[int, float]],
        also: Iterable[int],
        desktop_pids: set[int],
        mains: set[int],
        out: list[Sample],
    ) -> None:
        """The lists' counts; `also`: pids on the GPU besides its lists' (MIG devices')."""
        pids: set[int] = set(also)
        for kind in KINDS:
            if kind in lists:
                out.append(Sample(PROCESSES.name, labels + (kind,), float(len(lists[kind]))))
                pids.update(lists[kind])
        desktop = pids & desktop_pids
        out.append(Sample(DESKTOP.name, labels, float(len(desktop))))
        out.append(Sample(OTHERS.name, labels, float(len(pids - desktop - mains))))

    def _main_samples(
        self, gpu: _Gpu, f: Facts, jobs: dict[int, int], scanning: bool, out: list[Sample]
    ) -> None:
        """The main process's facts under the GPU's labels; worked out once a poll for the
        GPUs it drives (`_rows`, labels after the GPU's only), the GPU's labels put before."""
        labels = gpu.labels
        rows = self._rows.get(f.pid)
        if rows is None:
            made: list[Sample] = []
            self._main_rows(f, jobs, made)
            rows = self._rows[f.pid] = tuple(zip(*made, strict=True)) or ((), (), ())
        names, tails, values = rows
        out += map(_make_sample, zip(names, map(labels.__add__, tails), values, strict=True))
        if f.cpus is not None:
            local = self._local_cpus(gpu, scanning)
            cpus = f.cpus & self._online if self._online else f.cpus
            if local is not None and cpus:
                out.append(Sample(NUMA_ALIGNED.name, labels, float(cpus <= local)))

    def _main_rows(self, f: Facts, jobs: dict[int, int], out: list[Sample]) -> None:
        labels: tuple[str, ...] = ()
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
            (MEMORY_PRESSURE, f.memory_pressure),
            # 0: no CUDA runtime mapped; absent: the maps could not be read
            (CUDART, None if f.cudart is None else version_number(f.cudart) or 0.0),
            (AGE, f.age),
        )
        for spec, value in optional:
            if value is not None:
                out.append(Sample(spec.name, labels, float(value)))
        self._io.samples(f.pid, labels, out)
        if f.cpus is not None:
            out.append(Sample(CPUS_ALLOWED.name, labels, float(len(f.cpus))))

    def _mig_samples(
        self,
        gpu: _Gpu,
        lists: dict[str, dict[int, float]],
        parts: list[Instance],
        mains: dict[tuple[str, int], int | None],
        owners: dict[tuple[str, int], Owner | None],
        poll: _Round,
        out: list[Sample],
    ) -> None:
        """A MIG-enabled GPU: its lists' counts (others: besides every instance's main
        process), then per GPU instance the instance forms of its main process's
        families and its owner."""
        chosen = {m for i in parts if (m := mains[i.key]) is not None}
        also = [pid for i in parts for pid in i.memory]
        self._count_samples(gpu.labels, lists, also, poll.desktop, chosen, out)
        for part in parts:
            main = mains[part.key]
            mine: list[Sample] = []
            if part.memory:
                others = set(part.memory) - poll.desktop - ({main} if main else set())
                mine.append(Sample(OTHERS.name, gpu.labels, float(len(others))))
            found = poll.facts.get(main) if main is not None else None
            if found is not None:
                self._main_samples(gpu, found, poll.jobs, poll.scanning, mine)
            if main in poll.launched:
                mine.append(Sample(LAUNCHED.name, gpu.labels, float(poll.launched[main])))
            owner = owners.get(part.key)
            if owner is not None:
                mine.append(Sample(OWNER.name, gpu.labels + owner.values(), 1.0))
            out.extend(instance_samples(mine, part.labels))

    def _local_cpus(self, gpu: _Gpu, scanning: bool) -> frozenset[int] | None:
        """The GPU's NUMA-local CPUs, read once (again at scans while unreadable)."""
        if gpu.local_cpus is None and gpu.bus_id and (gpu.local_read_at < 0 or scanning):
            gpu.local_read_at = self.polls
            path = os.path.join(self._sys, "bus", "pci", "devices", gpu.bus_id, "local_cpulist")
            text = package._text(path)
            try:
                gpu.local_cpus = None if text is None else parse_cpulist(text) or None
            except ValueError as e:
                self._complain("local_cpulist", f"{path}: {e}")
        return gpu.local_cpus

    def _online_cpus(self) -> frozenset[int]:
        text = package._text(os.path.join(self._sys, "devices", "system", "cpu", "online"))
        try:
            return frozenset() if text is None else parse_cpulist(text)
        except ValueError:
            return frozenset()

    def _complain(self, kind: str, message: str) -> None:
        """A bad file: WARNING the first time for its kind of file, DEBUG after."""
        level = logging.DEBUG if kind in self._complained else logging.WARNING
        self._complained.add(kind)
        log.log(level, "processes: %s; facts it feeds are left out", message)
