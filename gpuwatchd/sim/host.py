"""The host side of a scenario: CPUs, memory, PSI, IRQs, disks, IB ports, processes.

Node-level facts (what hardware exists) live on `HostHardware`; what changes over time
lives in `HostValues`, set per phase and merged key by key: a phase that sets
`disks: {nvme0n1: {util_percent: 99}}` changes that one value of that one disk and
leaves everything else as it was. `host_ramp` ramps numeric values by dotted path
(`disks.nvme0n1.util_percent`, `processes.4242.main_thread_cpu_percent`).

Rates are given per second; the writers integrate them into the kernel's cumulative
counters (jiffies, sectors, interrupt counts, IB words) over the clock's time.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Disk(Strict):
    name: str  # nvme0n1, sda
    queues: int = Field(8, ge=1)  # nvme IRQ queues (nvme0q1..N)


class Nic(Strict):
    name: str  # the netdev or the HCA, e.g. mlx5_0 or eth0
    driver: Literal["mlx5", "ice", "virtio"] = "mlx5"
    queues: int = Field(8, ge=1)
    bus_id: str | None = None  # PCI address shown in the IRQ name (mlx5_comp3@pci:...)


class IbPort(Strict):
    device: str  # mlx5_0
    port: int = 1
    rate_gbps: float = 400  # the port's best rate (what it should link at)
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    # where the HCA sits on PCIe (its device's ports share it): behind GPU N's PCIe switch
    # (under the same root complex on `direct` boards), as HGX boards pair GPUs and NICs;
    # else on a root port of its own on `numa_node`; neither: no PCI function is shown
    beside_gpu: int | None = Field(None, ge=0)
    numa_node: int | None = Field(None, ge=0)


class NfsMount(Strict):
    """An NFS mount of the node (and of its jobs' namespaces): a dataset's `reads_from`
    names it. A `reads_from` that is neither a disk nor declared here is one with the
    defaults (server 10.0.0.2, export /<name>, on /mnt/<name>)."""

    name: str
    server: str = "10.0.0.2"
    export: str | None = None  # default: /<name>
    mountpoint: str | None = None  # default: /mnt/<name>
    version: Literal["3", "4.0", "4.1", "4.2"] = "4.1"
    rsize: int = Field(1_048_576, ge=4096)  # bytes a READ carries at most
    # the daemon's own mount namespace has it (the host's, the systemd unit's); false: only
    # the jobs' (a pod's volume seen from a DaemonSet's container)
    daemon_sees: bool = True

    def export_path(self) -> str:
        return self.export or f"/{self.name}"

    def point(self) -> str:
        return self.mountpoint or f"/mnt/{self.name}"


class SlurmOwner(Strict):
    """A Slurm step's cgroup, as the task/cgroup plugin makes it: v1 `/slurm/uid_U/job_J/
    step_S[/task_T]` (freezer, cpuset, devices, memory; `cpu` stays at slurmd's), or the
    cgroup/v2 plugin's `/system.slice/slurmstepd.scope/job_J/step_S/user/task_T`."""

    job: int = Field(ge=1)
    step: str = Field("0", pattern=r"^(?:[0-9]{1,9}|batch|extern|interactive)$")
    task: int = Field(0, ge=0)  # the node-local task
    cgroup: Literal["v1", "v2"] = "v2"


class PodOwner(Strict):
    """A Kubernetes container's cgroup (v2): systemd driver `kubepods.slice/kubepods-<qos>.
    slice/kubepods-<qos>-pod<UID>.slice/<runtime>-<ID>.scope`, cgroupfs driver
    `/kubepods/<qos>/pod<UID>/<ID>` (guaranteed pods: no qos level)."""

    uid: str = Field(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    container_id: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # None: from the pid
    qos: Literal["guaranteed", "burstable", "besteffort"] = "burstable"
    driver: Literal["systemd", "cgroupfs"] = "systemd"
    runtime: Literal["containerd", "cri-o"] = "containerd"


class ProcessOwner(Strict):
    """Who runs a process, as its cgroup shows: one of a Slurm step or a pod."""

    slurm: SlurmOwner | None = None
    pod: PodOwner | None = None

    @model_validator(mode="after")
    def _one(self) -> ProcessOwner:
        if (self.slurm is None) == (self.pod is None):
            raise ValueError("owner: give exactly one of slurm or pod")
        return self


class HostProcess(Strict):
    """Facts about a process that do not change during the scenario."""

    pid: int
    name: str = "python"
    # parent: 1 (init; the default), 0 (outside the pid namespace), or the pid of another
    # process here, e.g. the torchrun that launched this rank (reparented to 1 while
    # that process is not running)
    ppid: int = Field(1, ge=0)
    cgroup: str = "/system.slice/train.service"  # cgroup v2 path
    container: bool = False  # cgroup path under a container runtime (docker/kubepods)
    cpus_allowed: str | None = None  # "0-31"; None: every CPU
    cudart: str | None = None  # CUDA runtime it mapped, "12.1" -> libcudart.so.12.1
    uid: int = 1000
    # variables of its environment besides a login shell's PATH, HOME and LANG: the
    # launcher's (RANK, WORLD_SIZE, MASTER_ADDR, SLURM_JOB_ID, …), as /proc/PID/environ
    environment: dict[str, str] = {}
    # false: reading /proc/PID/environ fails with EACCES, as for another user's process
    # seen by the daemon without CAP_SYS_PTRACE (grouping falls back to the launcher)
    environ_readable: bool = True
    owner: ProcessOwner | None = None  # its scheduler's cgroup; replaces `cgroup`
    # its argv, as /proc/PID/cmdline shows it; None: the program `name` stands for,
    # /usr/bin/NAME. `name` is the comm: a process that renamed itself (prctl
    # PR_SET_NAME, /proc/self/comm) has a comm its argv does not show
    cmdline: list[str] | None = Field(None, min_length=1)
    # its controlling terminal: a virtual console ("tty2": a session started at the
    # machine, as gdm's Xorg on vt2) or a pseudo-terminal ("pts/3": ssh); None: none
    tty: str | None = Field(None, pattern=r"^(?:tty[1-9][0-9]?|pts/[0-9]{1,5})$")

    @property
    def argv(self) -> list[str]:
        return self.cmdline if self.cmdline is not None else [f"/usr/bin/{self.name}"]

    @property
    def tty_nr(self) -> int:
        """The terminal's device number as /proc/PID/stat shows it (linux/kdev_t.h's
        new_encode_dev): tty N is 4:N, pts/N 136+N/256:N%256; 0 without one."""
        if self.tty is None:
            return 0
        number = int(self.tty.removeprefix("pts/").removeprefix("tty"))
        pts = self.tty.startswith("pts/")
        major, minor = (136 + number // 256, number % 256) if pts else (4, number)
        return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)

    @model_validator(mode="after")
    def _environment(self) -> HostProcess:
        for key, value in self.environment.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(
                    f"environment.{key!r}: a variable's name is non-empty without '=' or "
                    "NUL, its value without NUL"
                )
        return self


class HostHardware(Strict):
    disks: list[Disk] = [Disk(name="nvme0n1"), Disk(name="nvme1n1")]
    nics: list[Nic] = []
    ib_ports: list[IbPort] = []
    nfs_mounts: list[NfsMount] = []
    processes: list[HostProcess] = []
    # the node's user database (getpwuid): uid -> name; root is "root", any other uid has
    # no name (the daemon shows the number), whatever the machine running the simulator has
    users: dict[int, str] = {}
    memory_total_mib: float = Field(1_048_576, gt=0)  # 1 TiB
    # swap space (meminfo SwapTotal); None: 32 GiB where the scenario swaps (swap_in_mb_s
    # or swap_out_mb_s above 0 anywhere), else none (0), as most GPU nodes
    swap_total_mib: float | None = Field(None, ge=0)
    # cpufreq (sysfs cpuN/cpufreq): every core's fastest clock; None: no cpufreq (a VM)
    cpu_max_mhz: float | None = Field(3500, gt=0)

    def user_name(self, uid: int) -> str:
        """What getpwuid gives on the node: the name, else the uid as text."""
        return {0: "root", **self.users}.get(uid, str(uid))

    @model_validator(mode="after")
    def _process_tree(self) -> HostHardware:
        """Unique pids; each parent is 0, 1 or another process here; no cycles."""
        parents: dict[int, int] = {}
        for i, process in enumerate(self.processes):
            if process.pid in parents:
                raise ValueError(f"processes.{i}: pid {process.pid} is listed twice")
            parents[process.pid] = process.ppid
        for i, process in enumerate(self.processes):
            seen = {process.pid}
            ppid = process.ppid
            while ppid > 1:
                if ppid not in parents:
                    raise ValueError(
                        f"processes.{i}.ppid: {ppid} is not a process of node.host.processes "
                        "(0, 1 or one of their pids)"
                    )
                if ppid in seen:
                    raise ValueError(f"processes.{i}.ppid: pid {process.pid} is its own ancestor")
                seen.add(ppid)
                ppid = parents[ppid]
        return self


class InterruptValues(Strict):
    rate: float | None = Field(None, ge=0)  # interrupts per second, summed over its CPUs
    cpus: list[int] | None = None  # CPUs it lands on (its affinity); default: CPU 0


class DiskValues(Strict):
    read_iops: float | None = Field(None, ge=0)
    write_iops: float | None = Field(None, ge=0)
    read_mb_s: float | None = Field(None, ge=0)  # 10^6 bytes per second
    write_mb_s: float | None = Field(None, ge=0)
    util_percent: float | None = Field(None, ge=0, le=100)  # share of time busy (io_ticks)
    await_ms: float | None = Field(None, ge=0)  # average time per request, queue included
    present: bool | None = None  # false: hot-unplugged (no diskstats line, no /sys/block entry)


class IbPortValues(Strict):
    state: Literal["DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER"] | None = None
    phys_state: Literal["Sleep", "Polling", "Disabled", "LinkUp", "LinkErrorRecovery"] | None = None
    rate_gbps: float | None = Field(None, ge=0)  # current rate
    rx_mb_s: float | None = Field(None, ge=0)
    tx_mb_s: float | None = Field(None, ge=0)
    xmit_wait_ratio: float | None = Field(None, ge=0, le=1)  # share of time waiting to send
    symbol_error_total: float | None = Field(None, ge=0)
    link_downed_total: float | None = Field(None, ge=0)
    link_error_recovery_total: float | None = Field(None, ge=0)
    port_rcv_errors_total: float | None = Field(None, ge=0)
    # the link's error rate crossed its LocalPhyErrors threshold (4-bit PMA counter)
    local_link_integrity_errors_total: float | None = Field(None, ge=0)
    # packets the port dropped on transmit, down or congested (HOQ lifetime expired)
    port_xmit_discards_total: float | None = Field(None, ge=0)


class NfsValues(Strict):
    """An NFS mount's client statistics (/proc/PID/mountstats per-op READ/WRITE lines)."""

    # READ payload from the server, 10^6 bytes/s; default: what the processes reading from
    # the mount read (their read_mb_s / worker_read_mb_s)
    read_mb_s: float | None = Field(None, ge=0)
    read_ops_per_second: float | None = Field(None, ge=0)  # default: read bytes / rsize
    read_rtt_ms: float | None = Field(None, ge=0)  # sent to reply; default 1
    read_queue_ms: float | None = Field(None, ge=0)  # waiting to be sent; default 0
    write_mb_s: float | None = Field(None, ge=0)
    write_ops_per_second: float | None = Field(None, ge=0)  # default: write bytes / wsize
    write_rtt_ms: float | None = Field(None, ge=0)
    write_queue_ms: float | None = Field(None, ge=0)


class ProcessValues(Strict):
    main_thread_cpu_percent: float | None = Field(None, ge=0, le=100)  # of one core
    threads: int | None = Field(None, ge=1)
    other_threads_cpu_percent: float | None = Field(None, ge=0)  # summed over other threads
    workers: int | None = Field(None, ge=0)  # child processes (DataLoader workers)
    worker_cpu_percent: float | None = Field(None, ge=0, le=100)  # each worker, of one core
    cpu_quota_cpus: float | None = Field(None, gt=0)  # cgroup cpu.max as CPUs; None: max
    throttled_ratio: float | None = Field(None, ge=0, le=1)  # share of periods throttled
    running: bool | None = None  # false: the process has exited
    # storage reads (/proc/PID/io read_bytes, 10^6 bytes/s) of the process and of each
    # worker, and the disk their input files are on (open fds; default: the first disk)
    read_mb_s: float | None = Field(None, ge=0)
    worker_read_mb_s: float | None = Field(None, ge=0)
    reads_from: str | None = None
    io_blocked_workers: int | None = Field(None, ge=0)  # workers in D state (waiting for I/O)
    # page faults that waited for a read (/proc/PID/stat majflt): from swap, or of a file
    # mapping whose page was not cached; of the process, and of each worker
    major_faults_per_second: float | None = Field(None, ge=0)
    worker_major_faults_per_second: float | None = Field(None, ge=0)
    # PSI of the process's own cgroup (v2 memory.pressure `some`, percent of time): its
    # tasks stalled on memory, e.g. reclaiming at the cgroup's memory.max
    memory_pressure_percent: float | None = Field(None, ge=0, le=100)


class ProbeValues(Strict):
    """What gpuwatchd.probe inside a process reports (see gpuwatchd.sim.probe)."""

    reporting: bool | None = None  # false: the process runs without the probe
    step_seconds: float | None = Field(None, gt=0)  # wall time per batch, wait included
    wait_fraction: float | None = Field(None, ge=0, le=1)  # share of it blocked in next()
    num_workers: int | None = Field(None, ge=0)  # the DataLoader's settings
    pin_memory: bool | None = None
    prefetch_factor: int | None = Field(None, ge=0)
    persistent_workers: bool | None = None
    batch_size: int | None = Field(None, ge=1)
    cuda_device: int | None = Field(None, ge=0)  # the GPU its CUDA device is; None: no CUDA
    reserved_mib: float | None = Field(None, ge=0)  # the caching allocator's state
    allocated_mib: float | None = Field(None, ge=0)
    inactive_split_mib: float | None = Field(None, ge=0)
    largest_free_block_mib: float | None = Field(None, ge=0)
    alloc_retries_per_minute: float | None = Field(None, ge=0)
    cuda_init_seconds: float | None = Field(None, ge=0)


class HostValues(Strict):
    """Node-wide values a phase can set (GPU values live in GpuValues)."""

    cpu_busy_percent: float | None = Field(None, ge=0, le=100)  # every core unless overridden
    core_busy_percent: dict[int, float] | None = None  # per-core overrides
    # per-core softirq time (percent) on top of what the interrupts landing there cost
    core_softirq_percent: dict[int, float] | None = None
    iowait_percent: float | None = Field(None, ge=0, le=100)  # every core unless overridden
    core_iowait_percent: dict[int, float] | None = None  # per-core overrides
    steal_percent: float | None = Field(None, ge=0, le=100)
    # cores' current clock (cpufreq scaling_cur_freq), MHz; default: cpu_max_mhz
    cpu_mhz: float | None = Field(None, gt=0)
    core_mhz: dict[int, float] | None = None  # per-core overrides
    psi_cpu_some: float | None = Field(None, ge=0, le=100)  # percent of time (avg10)
    psi_io_some: float | None = Field(None, ge=0, le=100)
    psi_io_full: float | None = Field(None, ge=0, le=100)
    psi_memory_some: float | None = Field(None, ge=0, le=100)
    psi_memory_full: float | None = Field(None, ge=0, le=100)
    mem_available_mib: float | None = Field(None, ge=0)
    # swapping (/proc/vmstat pswpin/pswpout, pages; 10^6 bytes/s here) and the kswapd
    # threads' CPU together (percent of one core), reclaiming memory in the background
    swap_in_mb_s: float | None = Field(None, ge=0)
    swap_out_mb_s: float | None = Field(None, ge=0)
    # meminfo SwapFree; default: SwapTotal less what was swapped out and not back in
    swap_free_mib: float | None = Field(None, ge=0)
    kswapd_cpu_percent: float | None = Field(None, ge=0)
    interrupts: dict[str, InterruptValues] | None = None  # IRQ action name -> rate
    disks: dict[str, DiskValues] | None = None
    ib_ports: dict[str, IbPortValues] | None = None  # "mlx5_0/1"
    nfs: dict[str, NfsValues] | None = None  # NFS mount name -> its client statistics
    processes: dict[int, ProcessValues] | None = None
    probe: dict[int, ProbeValues] | None = None  # pid -> its in-process probe's reports
    dcgm_hostengine_up: bool | None = None  # nv-hostengine running (false: stopped/restarting)


HOST_DEFAULTS: dict[str, Any] = dict(
    cpu_busy_percent=2.0,
    core_busy_percent={},
    core_softirq_percent={},
    iowait_percent=0.0,
    core_iowait_percent={},
    cpu_mhz=None,
    core_mhz={},
    steal_percent=0.0,
    psi_cpu_some=0.0,
    psi_io_some=0.0,
    psi_io_full=0.0,
    psi_memory_some=0.0,
    psi_memory_full=0.0,
    mem_available_mib=None,
    swap_in_mb_s=0.0,
    swap_out_mb_s=0.0,
    swap_free_mib=None,
    kswapd_cpu_percent=0.0,
    interrupts={},
    disks={},
    ib_ports={},
    nfs={},
    processes={},
    probe={},
    dcgm_hostengine_up=True,
)


def deep_merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Merge `update` into `into`: nested mappings key by key, anything else replaced."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def host_path_keys(path: str) -> list[Any]:
    """The keys of a dotted host path (`disks.nvme0n1.util_percent`). The name inside a
    mapping may itself hold dots (`interrupts.mlx5_comp0@pci:0000:17:00.0.rate`: IRQ
    actions name PCI functions), so a path through one is split at its first and last
    dot only. Integer-looking keys (pids, core numbers) are ints, as YAML gives them."""
    head, _, rest = path.partition(".")
    if head in _NESTED and "." in rest:
        name, _, leaf = rest.rpartition(".")
        parts = [head, name, leaf]
    else:
        parts = path.split(".")
    return [int(p) if p.isdigit() else p for p in parts]


def set_path(values: dict[str, Any], path: str, value: float) -> None:
    """Set a dotted host path, creating mappings on the way."""
    *parents, leaf = host_path_keys(path)
    for key in parents:
        values = values.setdefault(key, {})
    values[leaf] = value


# per-core maps: core -> percent
PER_CORE = ("core_busy_percent", "core_softirq_percent", "core_iowait_percent", "core_mhz")
_NESTED: dict[str, type[BaseModel]] = {
    "interrupts": InterruptValues,
    "disks": DiskValues,
    "ib_ports": IbPortValues,
    "nfs": NfsValues,
    "processes": ProcessValues,
    "probe": ProbeValues,
}


def check_host_ramp(ramp: dict[str, tuple[float, float]] | None) -> None:
    """A host ramp path must end at a numeric field of HostValues or one of its parts."""
    numeric = (float | None, int | None)
    for path in ramp or {}:
        parts = host_path_keys(path)
        if parts[0] in PER_CORE and len(parts) == 2 and isinstance(parts[1], int):
            continue
        if len(parts) == 3 and parts[0] in _NESTED:
            field = _NESTED[parts[0]].model_fields.get(parts[2])
        elif len(parts) == 1:
            field = HostValues.model_fields.get(parts[0])
        else:
            field = None
        if field is None or field.annotation not in numeric:
            raise ValueError(f"host_ramp.{path}: not a numeric host value")
