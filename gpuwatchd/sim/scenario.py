"""Scenario files: a node, a timeline of phases, and the ground truth to check against.

The format is documented in docs/scenarios.md. A scenario is pure data: `Timeline`
answers "what is every value on the node at virtual time t", and the fakes (NVML,
sysfs) render that state in the real bindings' and the kernel's formats.
"""

from __future__ import annotations

import copy
import math
import re
import zlib
from bisect import bisect_right
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuwatchd.config import ConfigError, Duration, parse_duration
from gpuwatchd.sim.host import (
    _NESTED as HOST_NESTED,
)
from gpuwatchd.sim.host import (
    HOST_DEFAULTS,
    HostHardware,
    HostValues,
    check_host_ramp,
    deep_merge,
    set_path,
)
from gpuwatchd.sim.models import BUILTIN_MODELS, GpuModel

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


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuProcess(Strict):
    pid: int
    name: str = "python"
    gpu_memory_mib: float = 0
    kind: Literal["compute", "graphics"] = "compute"  # which NVML process list it is in


class GpuValues(Strict):
    """Everything a phase can set or ramp on a GPU, in human units (the fakes convert)."""

    utilization_gpu: float | None = Field(None, ge=0, le=100)  # percent
    utilization_memory: float | None = Field(None, ge=0, le=100)  # percent
    memory_used_mib: float | None = Field(None, ge=0)
    power_w: float | None = Field(None, ge=0)
    temperature_c: float | None = None
    sm_clock_mhz: float | None = Field(None, ge=0)
    mem_clock_mhz: float | None = Field(None, ge=0)
    pstate: int | None = Field(None, ge=0, le=15)
    clock_event_reasons: list[Literal[CLOCK_EVENT_REASONS]] | None = None  # type: ignore[valid-type]
    pcie_gen: int | None = Field(None, ge=1, le=6)
    pcie_width: int | None = Field(None, ge=1, le=32)
    pcie_tx_mb_s: float | None = Field(None, ge=0)  # MB/s, 10^6 bytes
    pcie_rx_mb_s: float | None = Field(None, ge=0)
    pcie_replay_count: float | None = Field(None, ge=0)  # a counter: ramp it to make it rise
    ecc_corrected_total: float | None = Field(None, ge=0)
    ecc_uncorrected_total: float | None = Field(None, ge=0)
    aer_correctable_total: float | None = Field(None, ge=0)  # AER counters of the GPU function
    aer_nonfatal_total: float | None = Field(None, ge=0)
    aer_fatal_total: float | None = Field(None, ge=0)
    persistence_mode: bool | None = None
    nvlink_down: list[int] | None = None  # link indices that are inactive
    # DCGM profiling activity, ratios 0-1 (fields 1001-1008) and NVLink traffic (1011/1012)
    gr_engine_active: float | None = Field(None, ge=0, le=1)
    sm_active: float | None = Field(None, ge=0, le=1)
    sm_occupancy: float | None = Field(None, ge=0, le=1)
    tensor_active: float | None = Field(None, ge=0, le=1)
    dram_active: float | None = Field(None, ge=0, le=1)
    fp64_active: float | None = Field(None, ge=0, le=1)
    fp32_active: float | None = Field(None, ge=0, le=1)
    fp16_active: float | None = Field(None, ge=0, le=1)
    nvlink_tx_mb_s: float | None = Field(None, ge=0)  # MB/s, 10^6 bytes
    nvlink_rx_mb_s: float | None = Field(None, ge=0)
    processes: list[GpuProcess] | None = None
    lost: bool | None = None  # fell off the bus: NVML answers GPU_IS_LOST
    hung: bool | None = None  # NVML calls on this GPU block
    xid: list[int] | None = None  # Xid events raised once, at the start of the phase


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

    @model_validator(mode="after")
    def _rampable(self) -> Phase:
        _check_ramp(self.ramp)
        check_host_ramp(self.host_ramp)
        return self

    def all_changes(self) -> list[Change]:
        if self.set is None and self.ramp is None:
            return self.changes
        single = Change(gpus=self.gpus, set=self.set or GpuValues(), ramp=self.ramp or {})
        return [single, *self.changes]


class Node(Strict):
    hostname: str = "sim-node"
    driver_version: str = "550.90.07"
    cuda_driver_version: int = 12040  # as nvmlSystemGetCudaDriverVersion: 1000*major + 10*minor
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
_AMPLITUDE = re.compile(r"([0-9]+(?:\.[0-9]+)?)%")


def _amplitude(where: str, value: float | str) -> tuple[float, bool]:
    """A noise amplitude: a number in the value's unit, or "N%" of the value."""
    if isinstance(value, str):
        match = _AMPLITUDE.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"{where}: an amplitude is a number or a percentage (\"5%\")")
        return float(match.group(1)) / 100, True
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: an amplitude is a finite number >= 0")
    return float(value), False


def _bounds(field: Any) -> tuple[float, float, bool]:
    """(low, high, low is exclusive) of a pydantic field's ge/gt/le constraints."""
    low, high, exclusive = -math.inf, math.inf, False
    for item in field.metadata:
        if getattr(item, "ge", None) is not None:
            low = float(item.ge)
        if getattr(item, "gt", None) is not None:
            low, exclusive = float(item.gt), True
        if getattr(item, "le", None) is not None:
            high = float(item.le)
    return low, high, exclusive


def _host_field(path: str) -> Any:
    """The pydantic field a host path ends at (check_host_ramp has accepted it), or
    None for a per-core percentage."""
    parts = path.split(".")
    if len(parts) == 2:
        return None
    if len(parts) == 3:
        return HOST_NESTED[parts[0]].model_fields[parts[2]]
    return HostValues.model_fields[parts[0]]


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


@dataclass(frozen=True)
class _Jitter:
    """One noisy value: its amplitude, its bounds, and a stable id for the draws."""

    ident: int
    amplitude: float
    relative: bool
    low: float
    high: float
    exclusive: bool  # low is a strict bound (gt): stay above it
    integer: bool

    @classmethod
    def of(cls, name: str, amplitude: float | str, field: Any) -> _Jitter:
        amp, relative = _amplitude(name, amplitude)
        low, high, exclusive = (0.0, 100.0, False) if field is None else _bounds(field)
        integer = field is not None and field.annotation == (int | None)
        # crc32, not hash(): str hashes differ between Python processes
        return cls(zlib.crc32(name.encode()), amp, relative, low, high, exclusive, integer)

    def apply(self, value: Any, seed: int, index: int, slot: int) -> Any:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return value
        spread = self.amplitude * (abs(value) if self.relative else 1.0)
        if spread == 0:
            return value
        jittered = value + spread * _draw(seed, self.ident, index, slot)
        low = self.low
        if self.exclusive:  # e.g. a step time (gt 0): never reach the bound
            low = value if value <= low else low + (value - low) / 2
        jittered = min(self.high, max(low, jittered))
        return round(jittered) if self.integer else jittered


_MASK = (1 << 64) - 1


def _draw(seed: int, ident: int, index: int, slot: int) -> float:
    """A uniform draw in [-1, 1) fixed by its arguments: splitmix64's finaliser over their
    mix (cheap, and the same in every process and on every platform)."""
    z = (seed * 0x9E3779B97F4A7C15 + ident * 0xD1B54A32D192ED03 + index * 0x8CB92BA72F3D8DD7
         + slot * 0xBF58476D1CE4E5B9) & _MASK  # fmt: skip
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 11) / (1 << 52) - 1.0


class Expectation(Strict):
    """Ground truth for the rules: `cause` fires on `gpus` (from `onset`, by `by`), or never.

    With `ends`, the fault ends then and the cause must have stopped firing by
    `resolved_by` (the scenario's end if left out) and not fire again.

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
    gpus: GpuSelector = "all"
    never: bool = False
    onset: Duration | Literal[0] = 0  # when the fault starts: firing earlier is wrong
    by: Duration | None = None  # must be firing by then (default: `ends`, else the end)
    ends: Duration | None = None  # when the fault ends
    resolved_by: Duration | None = None  # must have stopped firing by then, for good

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


# Everything a GPU starts with unless the node's `initial` or a phase says otherwise:
# an idle, healthy datacenter GPU.
IDLE_DEFAULTS = dict(
    utilization_gpu=0.0,
    utilization_memory=0.0,
    memory_used_mib=0.0,
    temperature_c=32.0,
    pstate=8,
    clock_event_reasons=["gpu_idle"],
    pcie_tx_mb_s=0.0,
    pcie_rx_mb_s=0.0,
    pcie_replay_count=0.0,
    ecc_corrected_total=0.0,
    ecc_uncorrected_total=0.0,
    aer_correctable_total=0.0,
    aer_nonfatal_total=0.0,
    aer_fatal_total=0.0,
    persistence_mode=True,
    nvlink_down=[],
    processes=[],
    lost=False,
    hung=False,
    xid=[],
)


@dataclass(frozen=True)
class PciFunction:
    """One PCI function in the simulated tree: a GPU or a bridge above it."""

    name: str  # "gpu3", "rp1", "sw1-up", "sw1-dp1"
    bdf: str  # 0000:4e:00.0
    parent: str | None  # name of the bridge above, None under the host bridge
    domain_root: str  # the pciDDDD:BB directory it hangs from
    max_gen: int
    max_width: int
    numa_node: int


class Topology:
    """The PCIe tree a node's GPUs sit in, derived from the node description.

    switched: two GPUs per PCIe switch (upstream port + one downstream port per GPU),
    each switch under its own CPU root port, as on HGX boards. direct: each GPU directly
    under a root port.
    """

    def __init__(self, node: Node) -> None:
        model = node.model()
        self.functions: dict[str, PciFunction] = {}
        self.gpu_names: list[str] = []
        per_numa = max(1, -(-node.gpu_count // node.numa_nodes))
        for i in range(node.gpu_count):
            numa = min(i // per_numa, node.numa_nodes - 1)
            if node.pcie_topology == "switched":
                self._switched_gpu(i, numa, model)
            else:
                self._direct_gpu(i, numa, model)
        if node.pcie_max:
            self._capabilities(node.pcie_max)

    def _capabilities(self, caps: dict[str, LinkCapability]) -> None:
        """Give functions the scenario's own maxima (`Node.pcie_max`)."""
        gpus = set(self.gpu_names)
        for name, fn in list(self.functions.items()):
            group = (
                "gpus" if name in gpus else "root_ports" if fn.parent is None else "switch_ports"
            )
            gen, width = fn.max_gen, fn.max_width
            for key in (group, name):  # the function's own entry beats its group's
                cap = caps.get(key)
                if cap is not None:
                    gen = cap.gen if cap.gen is not None else gen
                    width = cap.width if cap.width is not None else width
            self.functions[name] = replace(fn, max_gen=gen, max_width=width)

    def _add(self, fn: PciFunction) -> None:
        self.functions.setdefault(fn.name, fn)

    def _switched_gpu(self, i: int, numa: int, model: GpuModel) -> None:
        sw, port = divmod(i, 2)
        # bus numbers stop at 0xff: 8 switches per PCI domain (segment), as large nodes do
        domain, slot = divmod(sw, 8)
        root_bus = 0x10 + 0x20 * slot  # each switch in its own root complex
        root, d = f"pci{domain:04x}:{root_bus:02x}", f"{domain:04x}"
        gen = model.pcie_max_gen  # HGX switches match the GPUs' generation
        rp = PciFunction(f"rp{sw}", f"{d}:{root_bus:02x}:01.1", None, root, gen, 16, numa)
        up = PciFunction(f"sw{sw}-up", f"{d}:{root_bus + 1:02x}:00.0", rp.name, root, gen, 16, numa)
        dp = PciFunction(
            f"sw{sw}-dp{port}",
            f"{d}:{root_bus + 2:02x}:{port * 8:02x}.0",
            up.name,
            root,
            gen,
            16,
            numa,
        )
        gpu = PciFunction(
            f"gpu{i}",
            f"{d}:{root_bus + 3 + port:02x}:00.0",
            dp.name,
            root,
            model.pcie_max_gen,
            model.pcie_max_width,
            numa,
        )
        for fn in (rp, up, dp, gpu):
            self._add(fn)
        self.gpu_names.append(gpu.name)

    def _direct_gpu(self, i: int, numa: int, model: GpuModel) -> None:
        domain, slot = divmod(i, 15)  # 15 root ports per PCI domain: bus numbers stop at 0xff
        root_bus = 0x10 + 0x10 * slot
        root, d = f"pci{domain:04x}:{root_bus:02x}", f"{domain:04x}"
        gen = model.pcie_max_gen
        rp = PciFunction(f"rp{i}", f"{d}:{root_bus:02x}:01.1", None, root, gen, 16, numa)
        gpu = PciFunction(
            f"gpu{i}",
            f"{d}:{root_bus + 1:02x}:00.0",
            rp.name,
            root,
            model.pcie_max_gen,
            model.pcie_max_width,
            numa,
        )
        self._add(rp)
        self._add(gpu)
        self.gpu_names.append(gpu.name)

    def gpu(self, index: int) -> PciFunction:
        return self.functions[self.gpu_names[index]]

    def path_to_root(self, name: str) -> list[PciFunction]:
        """Root port first, `name` last."""
        chain: list[PciFunction] = []
        current: str | None = name
        while current is not None:
            fn = self.functions[current]
            chain.append(fn)
            current = fn.parent
        return chain[::-1]

    def bridges(self) -> list[PciFunction]:
        return [fn for fn in self.functions.values() if not fn.name.startswith("gpu")]


@dataclass
class XidEvent:
    time: float  # seconds since scenario start
    gpu: int
    xid: int


@dataclass
class _CompiledPhase:
    duration: float
    changes: list[tuple[list[int], dict[str, Any], dict[str, tuple[float, float]]]]
    bridges: dict[str, dict[str, int]]
    host: dict[str, Any]
    host_ramp: dict[str, tuple[float, float]]

    def ramps(self, gpus: bool) -> bool:
        """Whether some host value (or, with `gpus`, GPU value) changes during the phase."""
        return bool(self.host_ramp) or gpus and any(ramp for _, _, ramp in self.changes)


def get_path(values: dict[str, Any], path: str) -> Any:
    """The value at a dotted host path (set_path's keys), None where there is none."""
    found: Any = values
    for part in path.split("."):
        if not isinstance(found, dict):
            return None
        found = found.get(int(part) if part.isdigit() else part)
    return found


class Timeline:
    """Values of every GPU and bridge at virtual time t (seconds since scenario start)."""

    def __init__(self, scenario: Scenario, loop: bool = False) -> None:
        self.scenario = scenario
        self.loop = loop
        self.topology = Topology(scenario.node)
        self.nvlink_fabric = scenario.node.nvlink_fabric()
        self.nvlinks_wired = nvlinks_wired(scenario.node)
        self._starts: list[float] = []
        t = 0.0
        for phase in scenario.phases:
            self._starts.append(t)
            t += phase.duration
        self.duration = t
        model = scenario.node.model()
        self._base = {
            **IDLE_DEFAULTS,
            "pcie_gen": model.pcie_max_gen,
            "pcie_width": model.pcie_max_width,
            "power_w": model.power_limit_w * 0.15,
            "sm_clock_mhz": 210.0,
            "mem_clock_mhz": float(model.max_mem_clock_mhz),
            **scenario.node.initial.model_dump(exclude_none=True),
        }
        self._base_bridges = {
            fn.name: {"gen": fn.max_gen, "width": fn.max_width} for fn in self.topology.bridges()
        }
        self._base_host = copy.deepcopy(HOST_DEFAULTS)
        deep_merge(self._base_host, scenario.node.initial_host.model_dump(exclude_none=True))
        self._compiled = [(start, self._compile(phase)) for start, phase in self.phases()]
        self._phase_values: dict[tuple[int, str], list[Any]] = {}  # (phase, key) -> per GPU
        self._xids = [  # (when, on which GPUs, which Xid), as the phases raise them
            (start, list(self._gpus(change)), xid)
            for start, phase in self.phases()
            for change in phase.all_changes()
            for xid in change.set.xid or []
        ]
        self._host_cache: tuple[float, dict[str, Any]] | None = None
        self._cache: tuple[float, list[dict[str, Any]], dict[str, dict[str, int]]] | None = None
        noise = scenario.noise
        self._seed, self._every = noise.seed, float(noise.every)
        self._host_every = float(noise.host_every)
        self._gpu_noise = {
            key: _Jitter.of(f"gpu.{key}", amp, GpuValues.model_fields[key])
            for key, amp in noise.gpu.items()
        }
        self._host_noise = {
            path: _Jitter.of(f"host.{path}", amp, _host_field(path))
            for path, amp in noise.host.items()
        }

    def phases(self) -> list[tuple[float, Phase]]:
        """(start, phase) in timeline order."""
        return list(zip(self._starts, self.scenario.phases, strict=True))

    def _compile(self, phase: Phase) -> _CompiledPhase:
        changes = []
        for change in phase.all_changes():
            fixed = change.set.model_dump(exclude_none=True)
            fixed.pop("xid", None)  # events, not state
            changes.append((list(self._gpus(change)), fixed, dict(change.ramp)))
        bridges = {name: link.model_dump(exclude_none=True) for name, link in phase.bridges.items()}
        host = phase.host.model_dump(exclude_none=True)
        return _CompiledPhase(phase.duration, changes, bridges, host, dict(phase.host_ramp))

    def _local(self, t: float) -> float:
        if self.loop and self.duration > 0:
            return t % self.duration
        return t

    def _gpus(self, change: Change) -> range | list[int]:
        count = self.scenario.node.gpu_count
        if change.gpus == "all":
            return range(count)
        return [i for i in change.gpus if 0 <= i < count]

    def state(self, t: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
        """(per-GPU value dicts, bridge name -> {gen, width}) at time t.

        The result is cached for the last t and must not be modified by callers.
        """
        t = self._local(t)
        if self._cache is not None and self._cache[0] == t:
            return self._cache[1], self._cache[2]
        gpus, bridges = self._compute(t)
        if self._gpu_noise:
            slot = self._slot(t)
            for i, values in enumerate(gpus):
                for key, jitter in self._gpu_noise.items():
                    if key in values:
                        values[key] = jitter.apply(values[key], self._seed, i, slot)
        self._cache = (t, gpus, bridges)
        return gpus, bridges

    def _slot(self, t: float) -> int:
        """Which draw of the GPU noise holds at (local) time t."""
        return int(t // self._every)

    def _host_slot(self, t: float) -> int:
        return int(t // self._host_every)

    def integral(self, key: str, t0: float, t1: float) -> list[float]:
        """Per GPU, the integral of a rate (`pcie_tx_mb_s`, ...) over [t0, t1]: exact, as
        values are linear within a phase (a ramp) and the midpoint rule is exact there."""
        edges = self._boundaries(t0, t1)
        if key in self._gpu_noise:  # the noise is constant between its draws
            edges = sorted({*edges, *self._noise_edges(t0, t1)})
        cuts = [t0, *edges, t1]
        totals = [0.0] * self.scenario.node.gpu_count
        for a, b in zip(cuts, cuts[1:], strict=False):
            if b > a:
                for i, value in enumerate(self._values_at(key, self._local((a + b) / 2))):
                    totals[i] += value * (b - a)
        return totals

    def _values_at(self, key: str, t: float) -> list[Any]:
        """Every GPU's `key` at t, kept per phase where no change ramps it (then it is the
        same all through the phase)."""
        index = bisect_right(self._starts, t) - 1
        kept: list[Any] | None
        if index < 0 or any(key in ramp for _, _, ramp in self._compiled[index][1].changes):
            kept = [values[key] for values in self._compute(t)[0]]
        else:
            kept = self._phase_values.get((index, key))
            if kept is None:
                kept = self._phase_values[(index, key)] = [v[key] for v in self._compute(t)[0]]
        jitter = self._gpu_noise.get(key)
        if jitter is None:
            return kept
        slot = self._slot(t)  # on a copy: the kept values are the phase's, noise-free
        return [jitter.apply(value, self._seed, i, slot) for i, value in enumerate(kept)]

    def _noise_edges(self, t0: float, t1: float) -> list[float]:
        """Times in (t0, t1) where the noise draws afresh (each loop's, in unlooped time)."""
        every = self._every
        if not (self.loop and self.duration > 0):
            first = math.floor(t0 / every) + 1
            return [k * every for k in range(first, math.ceil(t1 / every)) if t0 < k * every < t1]
        period = self.duration
        edges = []
        for cycle in range(int(t0 // period), int(t1 // period) + 1):
            offset = cycle * period
            lo, hi = max(t0 - offset, 0.0), min(t1 - offset, period)
            for k in range(math.floor(lo / every) + 1, math.ceil(hi / every)):
                if t0 < offset + k * every < t1:
                    edges.append(offset + k * every)
        return edges

    def constant(self, t0: float, t1: float, gpus: bool = True) -> bool:
        """True if every value is the same at all times in [t0, t1]: no phase starts or
        ends within (t0, t1] and no ramp runs in it (`gpus=False`: no host ramp; GPU
        values set per phase, such as their processes, cannot ramp)."""
        if t1 <= t0:
            return True
        if self.loop and self.duration > 0:
            if t1 - t0 >= self.duration:
                return False
            t0, t1 = self._local(t0), self._local(t1)
            if t1 < t0:  # wrapped: the loop's start is a boundary
                return False
        edges = [*self._starts, self.duration]
        if any(t0 < e <= t1 for e in edges):
            return False
        if self._host_noise and self._host_slot(t0) != self._host_slot(t1):
            return False  # the noise drew afresh
        if gpus and self._gpu_noise and self._slot(t0) != self._slot(t1):
            return False
        for start, phase in self._compiled:
            if start < t1 and t0 < start + phase.duration and phase.ramps(gpus):
                return False
        return True

    def _boundaries(self, t0: float, t1: float) -> list[float]:
        """Times in (t0, t1) where a phase starts or the last one ends (each loop's)."""
        edges = [*self._starts, self.duration]
        if not (self.loop and self.duration > 0):
            return [e for e in edges if t0 < e < t1]
        period = self.duration
        cycles = range(int(t0 // period), int(t1 // period) + 1)
        return sorted({c * period + e for c in cycles for e in edges if t0 < c * period + e < t1})

    def _compute(self, t: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
        gpus = [dict(self._base) for _ in range(self.scenario.node.gpu_count)]
        bridges = {name: dict(link) for name, link in self._base_bridges.items()}
        for start, phase in self._compiled:
            if start > t:
                break
            progress = min(1.0, (t - start) / phase.duration)
            for indices, fixed, ramp in phase.changes:
                for i in indices:
                    gpus[i].update(fixed)
                    for key, (a, b) in ramp.items():
                        gpus[i][key] = a + (b - a) * progress
            for name, link in phase.bridges.items():
                if name in bridges:
                    bridges[name].update(link)
        return gpus, bridges

    def host_state(self, t: float) -> dict[str, Any]:
        """Node-wide values (HostValues as nested dicts) at time t.

        Cached for the last t; callers must not modify the result.
        """
        t = self._local(t)
        if self._host_cache is not None and self._host_cache[0] == t:
            return self._host_cache[1]
        host = copy.deepcopy(self._base_host)
        for start, phase in self._compiled:
            if start > t:
                break
            deep_merge(host, phase.host)
            progress = min(1.0, (t - start) / phase.duration)
            for path, (a, b) in phase.host_ramp.items():
                set_path(host, path, a + (b - a) * progress)
        if self._host_noise:
            slot = self._host_slot(t)
            for path, jitter in self._host_noise.items():
                value = get_path(host, path)
                if value is not None:  # a value the scenario leaves to a writer's default
                    set_path(host, path, jitter.apply(value, self._seed, 0, slot))
        self._host_cache = (t, host)
        return host

    def xid_events(self, t0: float, t1: float) -> list[XidEvent]:
        """Xid events raised in (t0, t1], in absolute (unlooped) seconds."""
        events: list[XidEvent] = []
        if t1 <= t0:
            return events
        period = self.duration if self.loop and self.duration > 0 else None
        first_cycle = int(t0 // period) if period else 0
        last_cycle = int(t1 // period) if period else 0
        for cycle in range(first_cycle, last_cycle + 1):
            offset = cycle * period if period else 0.0
            for start, gpus, xid in self._xids:
                at = offset + start
                if t0 < at <= t1:
                    events.extend(XidEvent(at, i, xid) for i in gpus)
        return events


def nvlinks_wired(node: Node) -> list[frozenset[int]]:
    """Per GPU, the NVLinks the board connects (the others are never active): all of
    them on NVSwitch and direct boards, the bridge's (`GpuModel.nvlink_bridge_links`)
    for GPUs paired by a bridge (0-1, 2-3, ...; an odd last GPU has none), none without."""
    model, fabric = node.model(), node.nvlink_fabric()
    every = frozenset(range(model.nvlinks))
    if fabric in ("nvswitch", "direct"):
        return [every] * node.gpu_count
    if fabric == "bridge":
        bridged = frozenset(model.nvlink_bridge_links) if model.nvlink_bridge_links else every
        return [bridged if (i ^ 1) < node.gpu_count else frozenset() for i in range(node.gpu_count)]
    return [frozenset()] * node.gpu_count


SCENARIO_PACKAGE = "gpuwatchd.sim.scenarios"


def builtin_scenarios() -> list[str]:
    files = resources.files(SCENARIO_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or a scenario file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        where = str(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read scenario: {e.strerror}") from e
    else:
        resource = resources.files(SCENARIO_PACKAGE) / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise ConfigError(
                f"unknown scenario {str(name_or_path)!r}: not a file, and not one of the "
                f"built-in scenarios ({', '.join(builtin_scenarios())})"
            )
        where, text = f"built-in scenario {name_or_path}", resource.read_text()
    try:
        data = yaml.safe_load(text)
        return Scenario.model_validate(data)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    except ValidationError as e:
        problems = (
            f"{where}: {'.'.join(str(p) for p in err['loc'])}: "
            f"{err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise ConfigError("\n".join(problems)) from e


__all__ = [
    "CLOCK_EVENT_REASONS",
    "Expectation",
    "GpuValues",
    "Node",
    "Phase",
    "PciFunction",
    "Scenario",
    "Timeline",
    "Topology",
    "XidEvent",
    "nvlinks_wired",
    "builtin_scenarios",
    "load_scenario",
    "parse_duration",
]
