"""The pydantic models of a scenario file and their validation (docs/scenarios.md).

A `Scenario` is a `Node` (hardware, initial values), `Phase`s that set or ramp GPU,
bridge and host values, `Noise` on values, and `Expectation`s: the ground truth the
rules are checked against. Unknown keys are errors (`Strict`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gpuwatchd.config import Duration
from gpuwatchd.sim.host import HostHardware, HostValues, check_host_ramp
from gpuwatchd.sim.models import BUILTIN_MODELS, GpuModel
from gpuwatchd.sim.scenario.base import GpuProcess, ProfilingRatios, Strict
from gpuwatchd.sim.scenario.kmsg import NVSWITCHES, KmsgLine, placeholder_problem
from gpuwatchd.sim.scenario.mig import MigConfig, resolve
from gpuwatchd.sim.scenario.noise import _amplitude
from gpuwatchd.sim.scenario.subjects import Subjects, named_subjects
from gpuwatchd.sim.scenario.topology import Topology

# What the daemon may read: ptrace (the opt-in privileges of docs/deploy.md: root, or
# CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH for other users' environ, maps, io and fd/, and
# CAP_SYSLOG for the kernel log), or unprivileged (the unit and DaemonSet as shipped)
Privileges = Literal["ptrace", "unprivileged"]
PRIVILEGES: tuple[Privileges, ...] = ("ptrace", "unprivileged")

CLOCK_EVENT_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)


# nvmlGpuFabricState_t (nvml.h NVML_GPU_FABRIC_STATE_*), in order: 0 .. 3
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")


class Fabric(Strict):
    """A GPU's registration with the NVLink fabric as nvmlDeviceGetGpuFabricInfoV reports
    it, on the GPUs that answer it (Hopper and later SXM on an NVSwitch board; the others
    answer NOT_SUPPORTED). `status` is the nvmlReturn_t the registration ended with, which
    nvml.h says to read only once the state is completed."""

    state: Literal[FABRIC_STATES] = "completed"  # type: ignore[valid-type]
    status: str = "NVML_SUCCESS"

    @model_validator(mode="after")
    def _known_status(self) -> Fabric:
        import pynvml  # the binding's names are nvml.h's

        name = self.status
        if not (name == "NVML_SUCCESS" or name.startswith("NVML_ERROR_")) or not isinstance(
            getattr(pynvml, name, None), int
        ):
            raise ValueError(
                f"status: expected an nvmlReturn_t name (NVML_SUCCESS or NVML_ERROR_*, e.g. "
                f"NVML_ERROR_UNKNOWN), got {name!r}"
            )
        return self


class GpuValues(ProfilingRatios):
    """Everything a phase can set or ramp on a GPU, in human units (the fakes convert)."""

    utilization_gpu: float | None = Field(None, ge=0, le=100)  # percent
    utilization_memory: float | None = Field(None, ge=0, le=100)  # percent
    memory_used_mib: float | None = Field(None, ge=0)
    power_w: float | None = Field(None, ge=0)
    power_limit_w: float | None = Field(None, gt=0)  # enforced (nvidia-smi -pl); default: model
    temperature_c: float | None = None
    sm_clock_mhz: float | None = Field(None, ge=0)
    mem_clock_mhz: float | None = Field(None, ge=0)
    pstate: int | None = Field(None, ge=0, le=15)
    clock_event_reasons: list[Literal[CLOCK_EVENT_REASONS]] | None = None  # type: ignore[valid-type]
    pcie_gen: int | None = Field(None, ge=1, le=6)
    pcie_width: int | None = Field(None, ge=1, le=32)
    pcie_tx_mb_s: float | None = Field(None, ge=0)  # MB/s, 10^6 bytes
    pcie_rx_mb_s: float | None = Field(None, ge=0)
    # DCGM's own PCIe bytes (fields 1009/1010: TLP headers included, so above NVML's
    # payload, most for small transfers); default: pcie_tx_mb_s / pcie_rx_mb_s
    dcgm_pcie_tx_mb_s: float | None = Field(None, ge=0)
    dcgm_pcie_rx_mb_s: float | None = Field(None, ge=0)
    pcie_replay_count: float | None = Field(None, ge=0)  # a counter: ramp it to make it rise
    ecc_corrected_total: float | None = Field(None, ge=0)
    ecc_uncorrected_total: float | None = Field(None, ge=0)
    aer_correctable_total: float | None = Field(None, ge=0)  # AER counters of the GPU function
    aer_nonfatal_total: float | None = Field(None, ge=0)
    aer_fatal_total: float | None = Field(None, ge=0)
    # row remapping (Ampere and later datacenter GPUs, nvmlDeviceGetRemappedRows): rows
    # remapped for correctable / uncorrectable errors (counters), a remap waiting for the
    # next GPU reset, a bank out of spare rows
    remapped_rows_correctable_total: float | None = Field(None, ge=0)
    remapped_rows_uncorrectable_total: float | None = Field(None, ge=0)
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    persistence_mode: bool | None = None
    nvlink_down: list[int] | None = None  # link indices that are inactive
    fabric: Fabric | None = None  # NVLink fabric registration (NVSwitch boards, Hopper+)
    # DCGM profiling activity, ratios 0-1 (fields 1001-1008) and NVLink traffic (1011/1012)
    gr_engine_active: float | None = Field(None, ge=0, le=1)
    # and the profiling ratios (ProfilingRatios)
    nvlink_tx_mb_s: float | None = Field(None, ge=0)  # MB/s, 10^6 bytes
    nvlink_rx_mb_s: float | None = Field(None, ge=0)
    processes: list[GpuProcess] | None = None
    lost: bool | None = None  # fell off the bus: NVML answers GPU_IS_LOST
    hung: bool | None = None  # NVML calls on this GPU block
    xid: list[int] | None = None  # Xid events raised once, at the start of the phase
    # MIG mode and devices (scenario/mig.py); replaces the GPU's whole layout when set
    mig: MigConfig | None = None

    @model_validator(mode="after")
    def _mig_owns_processes(self) -> GpuValues:
        if (
            self.mig is not None
            and self.mig.instances
            and (self.processes is not None or self.memory_used_mib is not None)
        ):
            raise ValueError("mig: give processes and memory_used_mib per instance, not per GPU")
        return self


RAMPABLE = {
    name for name, f in GpuValues.model_fields.items() if f.annotation in (float | None, int | None)
}


class LinkValues(Strict):
    gen: int | None = Field(None, ge=1, le=6)
    width: int | None = Field(None, ge=1, le=32)


PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)  # the link widths the PCIe spec defines


class LinkCapability(Strict):
    """A function's own maximum (its LnkCap: sysfs max_link_speed / max_link_width)."""

    gen: int | None = Field(None, ge=1, le=6)
    width: Literal[PCIE_WIDTHS] | None = None  # type: ignore[valid-type]


# groups `pcie_max` can name besides single functions
PCIE_GROUPS = ("gpus", "root_ports", "switch_ports")
NVLINK_FABRICS = ("auto", "nvswitch", "direct", "bridge", "none")


GpuSelector = Literal["all"] | list[int]


def _check_ramp(ramp: dict[str, tuple[float, float]] | None) -> None:
    for key in ramp or {}:
        if key not in RAMPABLE:
            raise ValueError(f"ramp.{key}: not a numeric GPU value ({', '.join(sorted(RAMPABLE))})")


class Change(Strict):
    gpus: GpuSelector = "all"
    set: GpuValues = GpuValues()
    ramp: dict[str, tuple[float, float]] = {}  # value: [from, to] across the phase

    @model_validator(mode="after")
    def _rampable(self) -> Change:
        _check_ramp(self.ramp)
        return self


class Phase(Strict):
    name: str
    duration: Duration
    # shorthand for a single change: gpus/set/ramp at the phase level
    gpus: GpuSelector = "all"
    set: GpuValues | None = None
    ramp: dict[str, tuple[float, float]] | None = None
    changes: list[Change] = []
    bridges: dict[str, LinkValues] = {}  # bridge name (see Topology) -> link state
    host: HostValues = HostValues()
    host_ramp: dict[str, tuple[float, float]] = {}  # dotted host path: [from, to]
    kmsg: list[KmsgLine] = []  # lines the kernel logs during the phase (scenario/kmsg.py)

    @model_validator(mode="after")
    def _rampable(self) -> Phase:
        _check_ramp(self.ramp)
        check_host_ramp(self.host_ramp)
        for i, line in enumerate(self.kmsg):
            last = line.at + (line.repeat - 1) * line.every
            if last >= self.duration:
                raise ValueError(
                    f"kmsg.{i}: logged until {last:g}s into the phase: expected before its "
                    f"end ({self.duration:g}s)"
                )
        return self

    def all_changes(self) -> list[Change]:
        if self.set is None and self.ramp is None:
            return self.changes
        single = Change(gpus=self.gpus, set=self.set or GpuValues(), ramp=self.ramp or {})
        return [single, *self.changes]


class Node(Strict):
    hostname: str = "sim-node"
    driver_version: str = "555.42.06"  # R555: NVML has the PCIe byte counters
    cuda_driver_version: int = 12050  # as nvmlSystemGetCudaDriverVersion: 1000*major + 10*minor
    gpu_model: str | GpuModel = "a100-sxm4-80gb"
    gpu_count: int = Field(8, ge=0, le=256)
    pcie_topology: Literal["switched", "direct"] = "switched"
    numa_nodes: int = Field(2, ge=1)
    cpus: int = Field(128, ge=1)
    dcgm: Literal["none", "3", "4"] = "4"  # DCGM installed (major version), or not at all
    # NVML's library: present, absent (no driver installed, a container without the NVIDIA
    # runtime), or present with the kernel driver not loaded
    nvml: Literal["present", "no_library", "driver_not_loaded"] = "present"
    host: HostHardware = HostHardware()
    initial: GpuValues = GpuValues()
    initial_host: HostValues = HostValues()
    # each PCI function's own maximum, by topology name (gpu3, rp1, sw0-up, sw0-dp1) or
    # group (gpus, root_ports, switch_ports; a name beats its group); default: the model's
    pcie_max: dict[str, LinkCapability] = {}
    # what the GPUs' NVLinks connect to (docs/scenarios.md); auto: SXM models on
    # NVSwitches (8+ GPUs) or to each other, PCIe models to nothing (no bridge)
    nvlink: Literal[NVLINK_FABRICS] = "auto"  # type: ignore[valid-type]
    # MIG-enabled GPUs: whether NVML's aggregate queries on the whole GPU (memory, process
    # lists) are allowed (the MIG monitor capability, /proc/driver/nvidia/capabilities/
    # mig/monitor, world-readable on a host; a container gets it only if given it), else
    # they answer NO_PERMISSION
    mig_monitor: bool = True
    # kernel.dmesg_restrict (Debian's and Ubuntu's default 1): reading /dev/kmsg needs
    # CAP_SYSLOG, which only `simulate --privileges ptrace` plays (docs/deploy.md)
    dmesg_restrict: bool = True

    def nvlink_fabric(self) -> str:
        """nvswitch | direct | bridge | none, with auto resolved."""
        model = self.model()
        if model.nvlinks == 0:
            return "none"
        if self.nvlink != "auto":
            return self.nvlink
        if model.sxm:
            return "nvswitch" if self.gpu_count >= 8 else "direct"
        return "none"

    def model(self) -> GpuModel:
        if isinstance(self.gpu_model, GpuModel):
            return self.gpu_model
        return BUILTIN_MODELS[self.gpu_model]

    @model_validator(mode="after")
    def _known_model(self) -> Node:
        if isinstance(self.gpu_model, str) and self.gpu_model not in BUILTIN_MODELS:
            raise ValueError(
                f"gpu_model: unknown model {self.gpu_model!r} "
                f"(built in: {', '.join(BUILTIN_MODELS)})"
            )
        places: dict[str, tuple[int | None, int | None]] = {}
        for i, port in enumerate(self.host.ib_ports):
            place = (port.beside_gpu, port.numa_node)
            if places.setdefault(port.device, place) != place:
                raise ValueError(
                    f"host.ib_ports.{i}: {port.device} is placed elsewhere by an earlier "
                    "port: the ports of one device share its beside_gpu and numa_node"
                )
            if port.beside_gpu is not None and port.beside_gpu >= self.gpu_count:
                raise ValueError(
                    f"host.ib_ports.{i}.beside_gpu: no GPU {port.beside_gpu} "
                    f"(gpu_count: {self.gpu_count})"
                )
            if port.numa_node is not None and port.numa_node >= self.numa_nodes:
                raise ValueError(
                    f"host.ib_ports.{i}.numa_node: no NUMA node {port.numa_node} "
                    f"(numa_nodes: {self.numa_nodes})"
                )
        if self.pcie_max:
            names = Topology(self).functions
            for key in self.pcie_max:
                if key not in names and key not in PCIE_GROUPS:
                    raise ValueError(
                        f"pcie_max.{key}: no such PCI function or group (functions: "
                        f"{', '.join(names)}; groups: {', '.join(PCIE_GROUPS)})"
                    )
        return self


# GPU values that are counters (they must only rise): a ramp makes them rise, noise never
COUNTERS = frozenset(
    name for name in RAMPABLE if name.endswith("_total") or name == "pcie_replay_count"
)


class Noise(Strict):
    """Jitter on any numeric value (docs/scenarios.md, "Noise"): deterministic for a seed,
    uniform in [-amplitude, +amplitude], drawn afresh every `every` seconds (host values
    every `host_every`)."""

    seed: int = 0
    every: Duration = 1.0
    # the host's sources poll every 5 s (a draw per second would be averaged away, and
    # would make every host writer rewrite its files each second)
    host_every: Duration = 5.0
    gpu: dict[str, float | str] = {}  # GPU value -> amplitude
    host: dict[str, float | str] = {}  # dotted host path (as host_ramp) -> amplitude

    @model_validator(mode="after")
    def _valid(self) -> Noise:
        for key, amplitude in self.gpu.items():
            if key not in RAMPABLE:
                raise ValueError(
                    f"gpu.{key}: not a numeric GPU value ({', '.join(sorted(RAMPABLE))})"
                )
            if key in COUNTERS:
                raise ValueError(f"gpu.{key}: a counter (it must only rise): ramp it instead")
            _amplitude(f"gpu.{key}", amplitude)
        for path, amplitude in self.host.items():
            try:
                check_host_ramp({path: (0.0, 0.0)})
            except ValueError:
                raise ValueError(f"host.{path}: not a numeric host value") from None
            _amplitude(f"host.{path}", amplitude)
        return self


class Expectation(Strict):
    """Ground truth for the rules: `cause` fires on `gpus` (from `onset`, by `by`), or never.

    With `ends`, the fault ends then and the cause must have stopped firing by
    `resolved_by` (the scenario's end if left out) and not fire again. With `summary`,
    each firing summary on those GPUs must contain that text (what the page says).

    Or, instead of a cause, a series the daemon exports (`metric`, with `labels` to pick
    one of a family) that must be `above` and/or `below` a value on those GPUs, with the
    same timing: what shows a fault no rule is for (a source down, a GPU's NVML call
    blocked). A series without a `gpu` label (`gpuwatchd_source_up{source="nvml"}`) is
    the same for every GPU.
    """

    cause: str = ""
    metric: str = ""  # e.g. gpuwatchd_gpu_nvml_hung_seconds
    labels: dict[str, str] = {}  # further labels of the series, e.g. {source: nvml}
    above: float | None = None
    below: float | None = None
    gpus: Subjects = "all"  # GPU indexes, or MIG GPU instances as the page names them, "0/2"
    never: bool = False
    onset: Duration | Literal[0] = 0  # when the fault starts: firing earlier is wrong
    by: Duration | None = None  # must be firing by then (default: `ends`, else the end)
    ends: Duration | None = None  # when the fault ends
    resolved_by: Duration | None = None  # must have stopped firing by then, for good
    summary: str = ""  # text each of the cause's firing summaries must contain
    # the daemon's privileges it holds under: ptrace (other users' environ, maps, io and
    # fd/ readable: Privileges), unprivileged (the shipped unit: refused), any
    privileges: Literal["any", "ptrace", "unprivileged"] = "any"

    @property
    def what(self) -> str:
        """The cause, or the metric's condition as the check shows it."""
        if self.cause:
            return self.cause
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        bounds = [f"> {self.above:g}"] if self.above is not None else []
        bounds += [f"< {self.below:g}"] if self.below is not None else []
        name = f"{self.metric}{{{labels}}}" if labels else self.metric
        return f"{name} {' and '.join(bounds)}"

    @model_validator(mode="after")
    def _resolution(self) -> Expectation:
        if bool(self.cause) == bool(self.metric):
            raise ValueError("cause or metric: exactly one of them")
        if self.metric and self.above is None and self.below is None:
            raise ValueError("metric: needs above and/or below (the value it must show)")
        if self.cause and (self.labels or self.above is not None or self.below is not None):
            raise ValueError("labels, above, below: only with metric")
        if self.summary and (self.metric or self.never):
            raise ValueError("summary: only with a cause that fires (not metric, not never)")
        if self.ends is None:
            if self.resolved_by is not None:
                raise ValueError("resolved_by: needs ends (when the fault ends)")
            return self
        if self.never:
            raise ValueError("ends: not with never: true (a cause that never fires)")
        if self.ends <= self.onset:
            raise ValueError(f"ends: must be after onset ({self.onset:g}s), got {self.ends:g}s")
        if self.by is not None and self.by > self.ends:
            raise ValueError(f"by: must not be after ends ({self.ends:g}s), got {self.by:g}s")
        if self.resolved_by is not None and self.resolved_by < self.ends:
            raise ValueError(
                f"resolved_by: must not be before ends ({self.ends:g}s), got {self.resolved_by:g}s"
            )
        return self

    @model_validator(mode="after")
    def _judgeable(self) -> Expectation:
        """`gpus` names GPUs or GPU instances; `metric`, a series the check samples."""
        named = named_subjects(self.gpus)
        if self.gpus != "all" and not named:
            raise ValueError("gpus: expected at least one GPU, or all")
        if self.metric:
            from gpuwatchd.sim.series import problem  # the sources' specs: only when needed

            if why := problem(self.metric, self.labels, any(gi for _, gi in named)):
                raise ValueError(why)
        return self


class Scenario(Strict):
    name: str
    description: str = ""
    node: Node = Node()
    phases: list[Phase] = Field(min_length=1)
    noise: Noise = Noise()
    expect: list[Expectation] = []

    @property
    def duration(self) -> float:
        return sum(p.duration for p in self.phases)

    @model_validator(mode="after")
    def _expectations_on_the_node(self) -> Scenario:
        """An expectation on a GPU the node does not have would judge nothing."""
        count = self.node.gpu_count
        for i, e in enumerate(self.expect):
            for gpu, _ in named_subjects(e.gpus):
                if gpu >= count:
                    raise ValueError(
                        f"expect.{i}.gpus: GPU {gpu} is not on the node: expected indexes "
                        f"below node.gpu_count ({count})"
                    )
        return self

    @model_validator(mode="after")
    def _kmsg_on_the_node(self) -> Scenario:
        """A kernel line's placeholders name GPUs and NVSwitches the node has."""
        model = self.node.model()
        on_switches = self.node.nvlink_fabric() == "nvswitch"
        switches = NVSWITCHES.get(model.compute_capability[0], NVSWITCHES[9])[0]
        for i, phase in enumerate(self.phases):
            for j, line in enumerate(phase.kmsg):
                why = placeholder_problem(
                    line.text, self.node.gpu_count, switches if on_switches else 0
                )
                if why:
                    raise ValueError(f"phases.{i}.kmsg.{j}.text: {why}")
        return self

    @model_validator(mode="after")
    def _nfs_values_name_mounts(self) -> Scenario:
        """`nfs` host values are a mount's: declared, or a `reads_from` naming no disk."""
        host = self.node.host
        disks = {d.name for d in host.disks}
        values = [("node.initial_host", self.node.initial_host)] + [
            (f"phases.{i}.host", phase.host) for i, phase in enumerate(self.phases)
        ]
        names = {m.name for m in host.nfs_mounts} | {
            p.reads_from
            for _, v in values
            for p in (v.processes or {}).values()
            if p.reads_from is not None and p.reads_from not in disks
        }
        if len(host.nfs_mounts) != len({m.name for m in host.nfs_mounts}):
            raise ValueError("node.host.nfs_mounts: a name is declared twice")
        for where, v in values:
            for name in v.nfs or {}:
                if name not in names:
                    raise ValueError(
                        f"{where}.nfs.{name}: no such NFS mount (node.host.nfs_mounts "
                        f"names, or a process's reads_from that is no disk: "
                        f"{', '.join(sorted(names)) or 'none'})"
                    )
        return self

    @model_validator(mode="after")
    def _mig_fits_the_model(self) -> Scenario:
        """Every `mig:` value resolves on the node's model (profiles, placements)."""
        model = self.node.model()
        settings = [("node.initial", self.node.initial)] + [
            (f"phases.{i}.changes.{j}.set", change.set)
            for i, phase in enumerate(self.phases)
            for j, change in enumerate(phase.all_changes())
        ]
        for where, values in settings:
            if values.mig is not None:
                try:
                    resolve(values.mig, model)
                except ValueError as e:
                    raise ValueError(f"{where}.mig: {e}") from None
        return self
