"""Where the probe's reports land: the GPUs NVML lists each probed pid on, or on a
MIG-enabled GPU the GPU instances (GIs) it is on (the probe source's attribution,
gpuwatchd.sources.probe).

Per GPU and poll, one `nvmlDeviceGetComputeRunningProcesses` on the GPU's handle, as
before MIG. Its v3 entries carry each process's GPU and compute instance ids
(0xFFFFFFFF, "not available", on a GPU with MIG off): a GPU whose list names an instance
is MIG-enabled, and its probed processes are placed on their GIs, never on the whole
GPU. The GIs' profiles and MIG UUIDs come from a discovery made only when a probed pid
shows on an instance not known yet (processes.migdevices.discover: the MIG device
count, then per index its handle, ids, UUID and name). Without the MIG monitor
capability the parent's list answers NO_PERMISSION; then the MIG devices' own lists,
which the nvml source reads every poll and publishes in the ProcessTable (with their
profiles and UUIDs), place them: no NVML call at all. Without the nvml source (or
before its first poll) such a GPU's probed pids stay unplaced, counted in
`probe_unplaced_processes`, as the processes source's main processes do.

Per subject (a whole GPU, or a GI of a MIG GPU) the probed process with the most memory
on it supplies the series: under the per-GPU families for a whole GPU, under their
instance forms (`gpu_instance_probe_*{gpu, uuid, gpu_instance, profile}`) for a GI.
The allocator's state goes to the subject whose UUID torch reports (a GPU's, without
NVML's "GPU-"; a MIG device's, with or without "MIG-"), else to where it holds most.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.metrics import GPU_LABELS, MetricSpec, Sample, counter, gauge, instance_form
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.nvmlapi import ListedInstance, process_table, start_nvml
from gpuwatchd.sources.processes.gpus import _Gpu as _ProcessesGpu
from gpuwatchd.sources.processes.instances import group_instances
from gpuwatchd.sources.processes.migdevices import discover, instance_ids, split_by_instance

if TYPE_CHECKING:
    from gpuwatchd.sources.probe_report import Cuda, Report

log = logging.getLogger("gpuwatchd.sources.probe")


def _gpu(kind: Callable[..., Any], name: str, help: str, export: str = "detail") -> Any:
    """What a process reports of itself: its configuration and allocator numbers are the
    rules' evidence (exported with `detail_metrics`), its batch timings always."""
    return kind("probe_" + name, help, GPU_LABELS, export)


PID = _gpu(gauge, "pid", "Pid of the probed process whose reports this GPU's probe series are")
RANK = _gpu(gauge, "rank", "That process's RANK (torch.distributed), when set")
BATCHES = _gpu(counter, "batches_total", "Batches the probed process fetched", "always")
WAIT = _gpu(
    counter, "wait_seconds_total", "Seconds the process waited for the next batch", "always"
)
COMPUTE = _gpu(counter, "compute_seconds_total", "Seconds between batches (computing)", "always")
WORKERS = _gpu(gauge, "loader_workers", "DataLoader num_workers (0: loads in the main process)")
PIN = _gpu(gauge, "loader_pin_memory", "DataLoader pin_memory (1 true, 0 false)")
PREFETCH = _gpu(gauge, "loader_prefetch_factor", "DataLoader prefetch_factor (batches per worker)")
PERSISTENT = _gpu(gauge, "loader_persistent_workers", "DataLoader persistent_workers (1/0)")
BATCH_SIZE = _gpu(gauge, "loader_batch_size", "DataLoader batch_size")
RESERVED = _gpu(gauge, "cuda_reserved_bytes", "Bytes the caching allocator holds on this GPU")
ALLOCATED = _gpu(gauge, "cuda_allocated_bytes", "Bytes allocated to tensors on this GPU")
INACTIVE_SPLIT = _gpu(
    gauge, "cuda_inactive_split_bytes", "Free bytes inside split blocks (fragmentation)"
)
LARGEST_FREE = _gpu(gauge, "cuda_largest_free_block_bytes", "Largest free cached block")
RETRIES = _gpu(
    counter,
    "cuda_alloc_retries_total",
    "cudaMalloc failures the allocator retried after a flush",
    "nonzero",
)
OOMS = _gpu(counter, "cuda_ooms_total", "Out-of-memory errors the allocator raised", "nonzero")
INIT_SECONDS = _gpu(gauge, "cuda_init_seconds", "Seconds the process's CUDA initialisation took")
INIT_TIME = _gpu(
    gauge, "cuda_init_timestamp_seconds", "When the process's CUDA initialisation finished"
)
GPU_SPECS: tuple[MetricSpec, ...] = (
    PID, RANK, BATCHES, WAIT, COMPUTE, WORKERS, PIN, PREFETCH, PERSISTENT, BATCH_SIZE,
    RESERVED, ALLOCATED, INACTIVE_SPLIT, LARGEST_FREE, RETRIES, OOMS, INIT_SECONDS, INIT_TIME,
)  # fmt: skip
# per-GPU family name -> its instance form (gpuwatchd_gpu_instance_probe_*), for a GI
INSTANCE_FORMS: dict[str, MetricSpec] = {spec.name: instance_form(spec) for spec in GPU_SPECS}
_INSTANCE_NAMES = {name: form.name for name, form in INSTANCE_FORMS.items()}


@dataclass(frozen=True)
class _Subject:
    """What a probed process's series land on: a whole GPU or a GI of a MIG GPU."""

    labels: tuple[str, ...]  # (gpu, uuid), or (gpu, uuid, gpu_instance, profile)
    uuids: tuple[str, ...]  # what torch may report for it: the GPU's; the GI's MIG devices'
    instance: bool


class Placer:
    """The probe source's NVML side: which subject each probed pid's reports land on."""

    def __init__(self, context: Context, max_age: float, clock: Callable[[], float]) -> None:
        self.context = context
        self._max_age = max_age  # of the nvml source's lists (its ProcessTable)
        self._clock = clock
        self._table = process_table(context)
        self.nv: Any = None
        self._gpus: dict[int, tuple[Any, str]] = {}  # index -> (handle, uuid), once known
        self._gpu_count = 0
        # a MIG GPU's MIG devices as last discovered here (no processes), by GPU index
        self._mig: dict[int, tuple[ListedInstance, ...]] = {}

    def close(self) -> None:
        self.nv, self._gpus, self._mig = None, {}, {}

    def samples(self, pids: dict[int, Report], out: list[Sample]) -> set[int]:
        """The series of each GPU (or GI) a probed pid is on; returns the pids placed."""
        if self.nv is None:
            self.nv, _, self._gpu_count = start_nvml(self.context)
        nv = self.nv
        best: dict[int, tuple[float, tuple[int, int]]] = {}  # pid -> (memory, subject key)
        # subject key (GPU index, GI id; -1 for the whole GPU) -> subject, pid, memory
        owners: dict[tuple[int, int], tuple[_Subject, int, float]] = {}

        def consider(key: tuple[int, int], subject: _Subject, pid: int, memory: float) -> None:
            held = owners.get(key)
            if held is None or memory > held[2]:
                owners[key] = (subject, pid, memory)
            if memory > best.get(pid, (-1.0, (0, 0)))[0]:
                best[pid] = (memory, key)

        placed: set[int] = set()
        for index in range(self._gpu_count):
            try:
                if index not in self._gpus:  # a GPU's handle and uuid do not change
                    handle = nv.nvmlDeviceGetHandleByIndex(index)
                    self._gpus[index] = (handle, nv.nvmlDeviceGetUUID(handle))
                handle, uuid = self._gpus[index]
                processes = nv.nvmlDeviceGetComputeRunningProcesses(handle)
            except nv.NVMLError as e:
                listed = self._shared_instances(index, e)
                if listed is None:
                    log.debug("probe: GPU %d: cannot list its processes: %s", index, e)
                    continue
            else:
                ids = instance_ids(processes)
                if not ids:  # a whole GPU (MIG off), as before MIG
                    self._mig.pop(index, None)  # a layout may change while nothing runs
                    whole = _Subject((str(index), uuid), (uuid,), False)
                    for process in processes:
                        if process.pid in pids:
                            placed.add(process.pid)
                            consider((index, -1), whole, process.pid,
                                     float(process.usedGpuMemory or 0))  # fmt: skip
                    continue
                listed = self._instances(index, handle, processes, ids, pids)
            gpu = _ProcessesGpu(index, labels=(str(index), uuid), instances=listed)
            for instance in group_instances(gpu):
                subject = _Subject(instance.labels, (*instance.mig_uuids, uuid), True)
                for pid, memory in instance.memory.items():
                    if pid in pids:
                        placed.add(pid)
                        consider((index, instance.gpu_instance), subject, pid, memory)
        for key, (subject, pid, _) in sorted(owners.items()):
            report = pids[pid]
            cuda = report.cuda
            mine = cuda is not None and (
                any(_same_uuid(cuda.uuid, u) for u in subject.uuids if u)
                if cuda.uuid
                else best.get(pid, (0.0, (-1, -1)))[1] == key
            )
            _emit(subject.labels, pid, report, cuda if mine else None, out, subject.instance)
        return placed

    def _instances(
        self,
        index: int,
        handle: Any,
        processes: list[Any],
        ids: dict[int, tuple[int, int]],
        pids: dict[int, Report],
    ) -> tuple[ListedInstance, ...]:
        """A MIG GPU's instances with the probed processes the parent's list puts on them
        (its GI/CI ids); discovery only when a probed pid is on an instance not known."""
        mine = {pid: key for pid, key in ids.items() if pid in pids}
        if not mine:
            return ()
        devices = self._mig.get(index, ())
        if not set(mine.values()) <= {(d.gpu_instance, d.compute_instance) for d in devices}:
            devices = self._mig[index] = discover(self.nv, handle)
        memory: dict[int, float] = {}
        for process in processes:
            if process.pid in mine:
                memory[process.pid] = memory.get(process.pid, 0.0) + (process.usedGpuMemory or 0)
        return split_by_instance(devices, mine, memory)

    def _shared_instances(self, index: int, error: Any) -> tuple[ListedInstance, ...] | None:
        """A MIG GPU whose parent refused its list (NO_PERMISSION: no MIG monitor
        capability): its MIG devices' own lists, as the nvml source read them this poll;
        None where they are not known (a whole GPU, the nvml source not running)."""
        if index not in self._gpus or getattr(error, "value", None) != getattr(
            self.nv, "NVML_ERROR_NO_PERMISSION", None
        ):
            return None
        uuid = self._gpus[index][1]
        for listed in self._table.fresh(self._clock(), self._max_age) or ():
            if listed.labels[1] == uuid:
                return listed.instances
        return None


def _same_uuid(reported: str | None, nvml_uuid: str) -> bool:
    """torch prints a device's uuid without NVML's "GPU-" (or a MIG device's "MIG-")."""
    return reported is not None and _bare(reported) == _bare(nvml_uuid)


def _bare(uuid: str) -> str:
    bare = uuid.lower()
    for prefix in ("mig-", "gpu-"):
        bare = bare.removeprefix(prefix)
    return bare


def _emit(
    labels: tuple[str, ...],
    pid: int,
    report: Report,
    cuda: Cuda | None,
    out: list[Sample],
    instance: bool = False,
) -> None:
    """The report's series under `labels`: a GPU's, or a GI's (the instance forms)."""

    def put(spec: Any, value: float | bool | None) -> None:
        if value is not None:
            name = _INSTANCE_NAMES[spec.name] if instance else spec.name
            out.append(Sample(name, labels, float(value)))

    put(PID, pid)
    put(RANK, report.rank)
    put(BATCHES, report.batches)
    put(WAIT, report.wait_seconds)
    put(COMPUTE, report.compute_seconds)
    loader = report.loader
    if loader is not None:
        put(WORKERS, loader.num_workers)
        put(PIN, loader.pin_memory)
        put(PREFETCH, loader.prefetch_factor)
        put(PERSISTENT, loader.persistent_workers)
        put(BATCH_SIZE, loader.batch_size)
    if cuda is not None:
        put(RESERVED, cuda.reserved_bytes)
        put(ALLOCATED, cuda.allocated_bytes)
        put(INACTIVE_SPLIT, cuda.inactive_split_bytes)
        put(LARGEST_FREE, cuda.largest_free_block_bytes)
        put(RETRIES, cuda.alloc_retries)
        put(OOMS, cuda.ooms)
        put(INIT_SECONDS, cuda.init_seconds)
        put(INIT_TIME, cuda.init_timestamp)
