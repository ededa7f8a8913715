"""The metrics the processes source exports (specs only; the source emits the samples).

Per GPU under `{gpu, uuid}` (the main process's facts, the lists' counts, the owner),
per MIG GPU instance under `{gpu, uuid, gpu_instance, profile}` (the instance forms of
the main process's families, `INSTANCE_FORMS`), and node-wide for desktop processes.
Kept apart so that the source module holds the wiring, not some hundred lines of help
texts.
"""

from __future__ import annotations

from gpuwatchd.metrics import GPU_LABELS, MetricSpec, counter, gauge, gpu_gauge, instance_form
from gpuwatchd.sources.owner import LABELS as OWNER_LABELS
from gpuwatchd.sources.procio import METRICS as PROCIO_METRICS

_gpu = gpu_gauge


PROCESSES = _gpu(
    "gpu_processes", "Processes NVML lists on the GPU, by list.", ("kind",), export="detail"
)
DESKTOP = _gpu(
    "gpu_desktop_processes",
    "Desktop processes (display servers, compositors) on the GPU.",
    export="nonzero",
)
OTHERS = _gpu(
    "gpu_other_processes",
    "Processes on the GPU besides its main process and desktop processes.",
    export="nonzero",
)
INFO = _gpu(
    "gpu_process_info",
    "The GPU's main process (most GPU memory): its name and CUDA runtime; always 1. "
    "Absent on a MIG-enabled GPU, which has one per GPU instance (gpu_instance_process_info).",
    ("name", "cudart"),
    export="detail",
)
PID = _gpu("gpu_process_pid", "Process id of the GPU's main process.")
JOB = _gpu(
    "gpu_process_job",
    "Job of the GPU's main process, as a pid: equal values, one job. Ranks of one launch "
    "(launcher variables in their environment, one owner): their common parent, else the "
    "lowest rank's pid; a process without them: its own pid; environment unreadable: the "
    "parent it shares with other GPUs' main processes.",
)
LAUNCHED = _gpu(
    "gpu_process_launched",
    "1 if the GPU's main process is a rank of a launch (torchrun, srun, mpirun, ... "
    "variables in its environment), 0 if its environment names none; absent where the "
    "environment cannot be read.",
    export="detail",
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
THREADS = _gpu("gpu_process_threads", "Threads of the GPU's main process.", export="detail")
WORKERS = _gpu(
    "gpu_process_workers",
    "Child processes of the GPU's main process (DataLoader workers).",
    export="detail",
)
WORKERS_CPU = _gpu(
    "gpu_process_workers_cpu_cores",
    "CPU used by the main process's children, summed, in cores.",
    export="detail",
)
CPUS_ALLOWED = _gpu(
    "gpu_process_cpus_allowed", "CPUs the main process may run on (its affinity).", export="detail"
)
NUMA_ALIGNED = _gpu(
    "gpu_process_numa_aligned",
    "1 if every CPU the main process may run on is local to the GPU's NUMA node.",
    export="detail",
)
QUOTA = _gpu(
    "gpu_process_cpu_quota_cpus",
    "The main process's cgroup CPU limit, in CPUs (absent: no limit).",
)
THROTTLED = _gpu(
    "gpu_process_throttled_ratio",
    "Share of the cgroup's CPU periods in which it was throttled (main process's cgroup).",
    export="nonzero",
)
THROTTLED_SECONDS = counter(
    "gpu_process_throttled_seconds_total",
    "Time the main process's cgroup spent throttled (cgroup cpu.stat).",
    GPU_LABELS,
    export="detail",
)
MEMORY_PRESSURE = _gpu(
    "gpu_process_memory_pressure_ratio",
    "PSI of the main process's cgroup (v2 memory.pressure `some` avg60 / 100): share of "
    "the last minute its tasks stalled on memory (reclaim at its limit, swap-ins, refaults).",
    export="detail",
)
CONTAINER = _gpu(
    "gpu_process_in_container", "1 if the main process runs in a container.", export="detail"
)
CUDART = _gpu(
    "gpu_process_cudart_version",
    "CUDA runtime version the main process mapped, e.g. 12.1 (12: major only known; 0: "
    "none mapped; absent where its maps are unreadable).",
    export="detail",
)
AGE = _gpu(
    "gpu_process_age_seconds",
    "Seconds since the GPU's main process started (/proc/PID/stat starttime against /proc/uptime).",
    export="detail",
)
DESKTOP_CPU = gauge(
    "desktop_cpu_cores",
    "CPU used by desktop processes on the node, summed, in cores.",
    export="nonzero",
)
DESKTOP_COUNT = gauge(
    "desktop_processes", "Desktop processes running on the node.", export="nonzero"
)
DESKTOP_CPU_BY_NAME = gauge(
    "desktop_process_cpu_cores",
    "CPU used by desktop processes of one name, in cores.",
    ("name",),
    export="nonzero",
)
# The NVSwitch fabric manager (nvidia-fabricmanager's daemon): the nvlink_fabric_not_ready
# rule says whether it runs. Shown while it does (1 series on an NVSwitch node), never on
# a node without one
FABRIC_MANAGER = gauge(
    "fabric_manager_processes",
    "nv-fabricmanager processes running on the node (the NVSwitch fabric manager), as the "
    "/proc scan finds them.",
    export="nonzero",
    budget=1,
)

# A MIG-enabled GPU has no single main process: each GPU instance has its own, whose facts
# are exported under these forms (the rules read them as the whole-GPU families when they
# judge an instance); the whole GPU then shows only its lists' counts.
MAIN_FAMILIES = (
    OTHERS, INFO, PID, JOB, LAUNCHED, OWNER, CPU, BUSIEST, THREADS, WORKERS, WORKERS_CPU,
    CPUS_ALLOWED, NUMA_ALIGNED, QUOTA, THROTTLED, THROTTLED_SECONDS, MEMORY_PRESSURE,
    CONTAINER, CUDART, AGE, *PROCIO_METRICS,
)  # fmt: skip
_HELP = {
    OTHERS: "Processes on the MIG GPU instance besides its main process.",
    INFO: "The MIG GPU instance's main process (most GPU memory of the processes on its MIG "
    "devices): its name and CUDA runtime; always 1.",
    OWNER: "Who owns the MIG GPU instance: the Slurm job, Kubernetes pod, container or user "
    "of its main process, its job file, its MIG device's allocation (docs/fleet.md); always 1.",
    JOB: "Job of the MIG GPU instance's main process, as gpu_process_job: equal values "
    "(across GPUs and instances), one job.",
}
# whole-GPU family name -> its instance form
INSTANCE_FORMS: dict[str, MetricSpec] = {
    spec.name: instance_form(spec, _HELP.get(spec)) for spec in MAIN_FAMILIES
}
