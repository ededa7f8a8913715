"""Who owns each GPU: the Slurm job, Kubernetes pod, container or user behind it, as the
labels of `gpuwatchd_gpu_owner_info{gpu, uuid, scheduler, job_id, step, rank, user,
namespace, pod, container}` (docs/fleet.md).

Read per GPU, cheapest and most trusted first:

* the GPU's *main process*: of the processes NVML lists on it, the one with the most GPU
  memory (lowest pid on a tie; the next one if it exited while being read). Its
  /proc/PID/cgroup (cgroup.py) places it in a Slurm step, a Kubernetes pod or a container;
  its /proc/PID/environ (process.py), where readable, adds the launcher's variables; its
  /proc/PID/status, the uid;
* the per-GPU job files of a scheduler prolog, if configured (jobfiles.py);
* the kubelet's pod-resources API, where its socket exists (podresources.py).

How they combine:

Who a GPU's owner is comes from what a tenant cannot set: the cgroup its scheduler or
login manager put it in, the kernel's uid, a prolog's job files. The environment is the
process's own (a tenant sets SLURM_JOB_ID=4242 or SLURM_JOB_USER=alice at will): it
names a job only where one of those confirms it, and never the user (issue 41, item 5).

* scheduler: "slurm" when the cgroup is a Slurm step, else "kubernetes" for a pod (or a
  GPU the kubelet allocated), else "container" for docker or podman, else "slurm" when a
  job file names a job, else "process".
* job_id: the Slurm job of the cgroup, else the GPU's job file (its first line), else
  TORCHELASTIC_RUN_ID (a torchrun job outside Slurm) unless it is a number, which a
  Slurm job's id could be. SLURM_JOB_ID counts only where it is the job of one of them.
* step: the cgroup's step directory (0, 1, …, batch, extern, interactive), else
  SLURM_STEP_ID of a confirmed SLURM_JOB_ID. rank: RANK, OMPI_COMM_WORLD_RANK, PMI_RANK
  or SLURM_PROCID (the environment only: a Slurm cgroup's task_N is the node-local task,
  not the rank). An environment naming another Slurm job than the cgroup's or the job
  file's is ignored whole.
* user: the name of the Slurm job's uid (cgroup v1 `uid_U`, else the job file's second
  word), else of the process's real uid, else (that uid not mapped into the daemon's user
  namespace: PrivateUsers=yes) of the login user of its systemd `user-U.slice`; looked up
  once per uid in this host's user database (in a container, the image's), the uid itself
  when it has no name; "" when none is known.
* namespace, pod, container: the names the kubelet gives the container the GPU is
  allocated to; without them, the pod UID and `<runtime>://<container ID>` of the cgroup
  (`containerd://…`, `cri-o://…`, `docker://…`, `podman://…`: the form of Kubernetes'
  `containerID`, so it joins with kube-state-metrics).

A GPU without a readable process is owned by its kubelet allocation, else by its job file
(scheduler "slurm"), else by nobody (None).

MIG: each GPU instance of a MIG-enabled GPU is owned as a GPU is, from its own main
process (of the processes NVML lists on its MIG devices), its own job file ("<index>.<GI>")
and the kubelet's allocation of one of its MIG devices (`podresources.instance_keys`):
never from the whole GPU's, so a tenant is never charged another instance's process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from operator import attrgetter
from pathlib import Path

from gpuwatchd.sources.owner.cgroup import Placement, parse_cgroup
from gpuwatchd.sources.owner.jobfiles import read_job_files, read_job_lines, read_job_map
from gpuwatchd.sources.owner.podresources import PodContainer, PodResources, instance_keys
from gpuwatchd.sources.owner.process import (
    Launch,
    ProcessFacts,
    ProcessReader,
    unmapped_uid,
    user_name,
)

LABELS = ("scheduler", "job_id", "step", "rank", "user", "namespace", "pod", "container")


@dataclass(frozen=True, slots=True)
class Owner:
    """The labels of gpuwatchd_gpu_owner_info besides gpu and uuid ("": unknown)."""

    scheduler: str = "process"  # "slurm", "kubernetes", "container" or "process"
    job_id: str = ""
    step: str = ""
    rank: str = ""
    user: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""

    def values(self) -> tuple[str, ...]:
        """The label values, in LABELS order."""
        values: tuple[str, ...] = _LABEL_VALUES(self)
        return values


_LABEL_VALUES = attrgetter(*LABELS)  # a tuple of them, made in C


@dataclass(frozen=True, slots=True)
class GpuProcesses:
    """One GPU and the processes NVML lists on it, with the GPU memory each uses."""

    index: int
    uuid: str
    memory: Mapping[int, float]  # pid -> bytes (0 where the driver cannot tell)


@dataclass(frozen=True, slots=True)
class InstanceProcesses:
    """One MIG GPU instance and the processes NVML lists on its MIG devices."""

    index: int  # its GPU's index
    uuid: str  # its GPU's UUID
    gpu_instance: int
    mig_uuids: tuple[str, ...]  # its MIG devices' (one per compute instance)
    memory: Mapping[int, float]  # pid -> bytes

    @property
    def key(self) -> tuple[str, int]:
        return (self.uuid, self.gpu_instance)


def owners_by_gpu(
    gpus: Iterable[GpuProcesses],
    facts: Callable[[int], ProcessFacts | None],
    *,
    jobs: Mapping[int, str] | None = None,
    pods: Mapping[str, PodContainer] | None = None,
    users: Callable[[int], str] = user_name,
    job_uids: Mapping[int, int] | None = None,
) -> dict[str, Owner | None]:
    """uuid -> the owner of each GPU (module docstring), from `facts(pid)` of its processes
    (None: gone), the GPU index -> job ID (and uid, `job_uids`) of job files and the
    device_key -> pod container of the kubelet; `users` names a uid."""
    jobs, pods, job_uids = jobs or {}, pods or {}, job_uids or {}
    owners: dict[str, Owner | None] = {}
    # one Owner for the GPUs of one main process's facts and job (a process drives
    # several); the facts are kept in `made`, so that their id is not reused meanwhile
    made: dict[tuple[int, str, int | None], tuple[ProcessFacts, Owner]] = {}
    for gpu in gpus:
        main = _main_facts(gpu.memory, facts)
        job = jobs.get(gpu.index, "")
        pod = pods.get(gpu.uuid) or pods.get(str(gpu.index))
        if main is not None:
            key = (id(main), job, job_uids.get(gpu.index))
            found = made.get(key)
            if found is None:
                found = made[key] = (main, _from_process(main, job, key[2], users))
            owner: Owner | None = found[1]
        else:
            owner = _from_job(job)
        owners[gpu.uuid] = _with_pod(owner, pod) if pod else owner
    return owners


def owners_by_instance(
    instances: Iterable[InstanceProcesses],
    facts: Callable[[int], ProcessFacts | None],
    *,
    jobs: Mapping[tuple[int, int], str] | None = None,
    pods: Mapping[str, PodContainer] | None = None,
    users: Callable[[int], str] = user_name,
    job_uids: Mapping[tuple[int, int], int] | None = None,
) -> dict[tuple[str, int], Owner | None]:
    """(GPU uuid, GPU instance) -> owner of each MIG GPU instance, as owners_by_gpu does
    for GPUs, from its own processes, job file ((index, GI) -> job, and uid) and MIG
    devices' allocation only."""
    jobs, pods, job_uids = jobs or {}, pods or {}, job_uids or {}
    owners: dict[tuple[str, int], Owner | None] = {}
    for inst in instances:
        main = _main_facts(inst.memory, facts)
        key = (inst.index, inst.gpu_instance)
        job = jobs.get(key, "")
        keys = instance_keys(inst.index, inst.uuid, inst.gpu_instance, inst.mig_uuids)
        pod = next((pods[k] for k in keys if k in pods), None)
        owner = (
            _from_process(main, job, job_uids.get(key), users)
            if main is not None
            else _from_job(job)
        )
        owners[inst.key] = _with_pod(owner, pod) if pod else owner
    return owners


def _main_facts(
    memory: Mapping[int, float], facts: Callable[[int], ProcessFacts | None]
) -> ProcessFacts | None:
    """The facts of the process with the most GPU memory that can be read."""
    for pid in sorted(memory, key=lambda pid: (-memory[pid], pid)):
        found = facts(pid)
        if found is not None:
            return found
    return None


def _from_process(
    facts: ProcessFacts, job: str, job_uid: int | None, users: Callable[[int], str]
) -> Owner:
    """The owner of a main process (module docstring), `job` and `job_uid` from its GPU's
    job file ("" and None: none)."""
    place = facts.place
    confirmed = place.job_id or job  # the scheduler's word: its cgroup, its prolog's file
    launch = _confirmed(facts.launch or Launch(), confirmed)
    scheduler = place.scheduler
    if scheduler == "process" and job:
        scheduler = "slurm"
    run_id = "" if launch.run_id.isdigit() else launch.run_id  # could pass for a Slurm job
    uid = _uid(place, facts, job_uid if job and job == confirmed else None)
    return Owner(
        scheduler=scheduler,
        job_id=confirmed or run_id,
        step=place.step or launch.slurm_step,
        rank=launch.rank,
        user=users(uid) if uid is not None else "",
        pod=place.pod_uid,
        container=place.container,
    )


def _confirmed(launch: Launch, job: str) -> Launch:
    """The environment as far as the scheduler's `job` confirms it: naming another job, it
    was inherited from that job (pam_slurm_adopt) and is ignored whole; naming one where
    the scheduler knows none, it is a tenant's say and its job and step are dropped."""
    if not launch.slurm_job or launch.slurm_job == job:
        return launch
    if job:
        return Launch()
    return replace(launch, slurm_job="", slurm_step="")


def _uid(place: Placement, facts: ProcessFacts, job_uid: int | None) -> int | None:
    """A Slurm job's owner (v1 `uid_U`, else the job file's), else the process's uid,
    else (the kernel's not mapped into the daemon's user namespace) its login user's."""
    if place.scheduler == "slurm" and place.uid is not None:
        return place.uid
    if job_uid is not None:
        return job_uid
    return facts.uid if facts.uid is not None else place.uid


def _from_job(job: str) -> Owner | None:
    return Owner("slurm", job_id=job) if job else None


def _with_pod(owner: Owner | None, pod: PodContainer) -> Owner:
    owner = owner or Owner()
    scheduler = owner.scheduler if owner.scheduler == "slurm" else "kubernetes"
    return replace(
        owner, scheduler=scheduler, namespace=pod.namespace, pod=pod.pod, container=pod.container
    )


class UserNames:
    """uid -> name, each uid looked up once (a lookup can go to LDAP or sssd)."""

    def __init__(self, lookup: Callable[[int], str] = user_name, limit: int = 4096) -> None:
        self._lookup = lookup
        self._limit = limit
        self._names: dict[int, str] = {}

    def __call__(self, uid: int) -> str:
        name = self._names.get(uid)
        if name is None:
            if len(self._names) >= self._limit:
                self._names.clear()
            name = self._names[uid] = self._lookup(uid)
        return name


class Attribution:
    """Owners of the GPUs of this node, poll after poll: keeps each process's environment
    and uid, user names and the kubelet's answer between polls.

    `job_dir`: the per-GPU job files' directory (None: not used). `pod_resources`: the
    kubelet client (None: not asked). `read_environ`: False never reads environments.
    """

    def __init__(
        self,
        procfs: Path = Path("/proc"),
        *,
        job_dir: Path | None = None,
        pod_resources: PodResources | None = None,
        read_environ: bool = True,
        users: Callable[[int], str] = user_name,
    ) -> None:
        self.processes = ProcessReader(procfs, read_environ, unmapped_uid())
        self.job_dir = job_dir
        self.pod_resources = pod_resources
        self.users = UserNames(users)

    def owners(
        self,
        gpus: Iterable[GpuProcesses],
        read: Callable[[int], ProcessFacts | None] | None = None,
    ) -> dict[str, Owner | None]:
        """uuid -> owner of each GPU given (None: nobody). `read`: how a process's facts
        are read (default self.processes.read; a caller that reads them too passes a memo)."""
        return self.attribute(gpus, (), read)[0]

    def attribute(
        self,
        gpus: Iterable[GpuProcesses],
        instances: Iterable[InstanceProcesses],
        read: Callable[[int], ProcessFacts | None] | None = None,
    ) -> tuple[dict[str, Owner | None], dict[tuple[str, int], Owner | None]]:
        """Owners of whole GPUs (by uuid) and of MIG GPU instances (by (uuid, GI)), with
        one read of the job files and the kubelet's answer for both."""
        gpus, instances = list(gpus), list(instances)
        files = read_job_lines(self.job_dir) if self.job_dir is not None else {}
        firsts = {key: lines[0] for key, lines in files.items()}
        uids = {key: uid for key, (_, uid) in firsts.items() if uid is not None}
        # a GPU's own file (`0`) names the whole GPU; an instance's (`0.5`) only that
        # instance, never the GPU (whose other instances are other tenants')
        by_gpu = {index: job for (index, gi), (job, _) in firsts.items() if gi < 0}
        gpu_uids = {index: uid for (index, gi), uid in uids.items() if gi < 0}
        pods = self.pod_resources.devices() if self.pod_resources is not None else {}
        facts, users = read or self.processes.read, self.users
        owners = owners_by_gpu(gpus, facts, jobs=by_gpu, pods=pods, users=users, job_uids=gpu_uids)
        by_instance = {key: job for key, (job, _) in firsts.items() if key[1] >= 0}
        parts = owners_by_instance(
            instances, facts, jobs=by_instance, pods=pods, users=users, job_uids=uids
        )
        pids = {pid for gpu in gpus for pid in gpu.memory}
        self.processes.keep(pids | {pid for inst in instances for pid in inst.memory})
        return owners, parts

    def close(self) -> None:
        if self.pod_resources is not None:
            self.pod_resources.close()


__all__ = [
    "LABELS",
    "Attribution",
    "GpuProcesses",
    "InstanceProcesses",
    "Launch",
    "Owner",
    "Placement",
    "PodContainer",
    "PodResources",
    "ProcessFacts",
    "ProcessReader",
    "UserNames",
    "owners_by_gpu",
    "owners_by_instance",
    "parse_cgroup",
    "read_job_files",
    "read_job_lines",
    "read_job_map",
]
