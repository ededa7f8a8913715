"""Scenario files: a node, a timeline of phases, and the ground truth to check against.

The format is documented in docs/scenarios.md. A scenario is pure data: `Timeline`
answers "what is every value on the node at virtual time t", and the fakes (NVML,
sysfs) render that state in the real bindings' and the kernel's formats.
"""

from __future__ import annotations

import copy
from bisect import bisect_right
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuwatchd.config import ConfigError, Duration, parse_duration
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
    host: HostHardware = HostHardware()
    initial: GpuValues = GpuValues()
    initial_host: HostValues = HostValues()

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
        return self


class Expectation(Strict):
    """Ground truth for the rules: `cause` fires on `gpus` (from `onset`, by `by`), or never.

    With `ends`, the fault ends then and the cause must have stopped firing by
    `resolved_by` (the scenario's end if left out) and not fire again.
    """

    cause: str
    gpus: GpuSelector = "all"
    never: bool = False
    onset: Duration | Literal[0] = 0  # when the fault starts: firing earlier is wrong
    by: Duration | None = None  # must be firing by then (default: `ends`, else the end)
    ends: Duration | None = None  # when the fault ends
    resolved_by: Duration | None = None  # must have stopped firing by then, for good

    @model_validator(mode="after")
    def _resolution(self) -> Expectation:
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


class Timeline:
    """Values of every GPU and bridge at virtual time t (seconds since scenario start)."""

    def __init__(self, scenario: Scenario, loop: bool = False) -> None:
        self.scenario = scenario
        self.loop = loop
        self.topology = Topology(scenario.node)
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
        self._cache = (t, gpus, bridges)
        return gpus, bridges

    def integral(self, key: str, t0: float, t1: float) -> list[float]:
        """Per GPU, the integral of a rate (`pcie_tx_mb_s`, ...) over [t0, t1]: exact, as
        values are linear within a phase (a ramp) and the midpoint rule is exact there."""
        cuts = [t0, *self._boundaries(t0, t1), t1]
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
        if index < 0 or any(key in ramp for _, _, ramp in self._compiled[index][1].changes):
            return [values[key] for values in self._compute(t)[0]]
        kept = self._phase_values.get((index, key))
        if kept is None:
            kept = self._phase_values[(index, key)] = [v[key] for v in self._compute(t)[0]]
        return kept

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
    "builtin_scenarios",
    "load_scenario",
    "parse_duration",
]
