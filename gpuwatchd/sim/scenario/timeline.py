"""`Timeline`: every value of a scenario's node at virtual time t.

The GPUs' and bridges' values (`state`), the node-wide host values (`host_state`), the
integral of a rate over an interval, whether values hold still over one, and the Xid
events raised in one. Values are linear within a phase (a ramp); the noise is drawn
afresh every `noise.every` seconds.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from gpuwatchd.sim.host import HOST_DEFAULTS, deep_merge, host_path_keys, set_path
from gpuwatchd.sim.models import GpuModel
from gpuwatchd.sim.scenario import kmsg
from gpuwatchd.sim.scenario.mig import mig_values
from gpuwatchd.sim.scenario.noise import _host_field, _Jitter
from gpuwatchd.sim.scenario.schema import Change, GpuValues, Phase, Scenario
from gpuwatchd.sim.scenario.topology import Topology, nvlink_peers, nvlinks_wired

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
    dcgm_pcie_tx_mb_s=None,  # None: NVML's (pcie_tx_mb_s)
    dcgm_pcie_rx_mb_s=None,
    pcie_replay_count=0.0,
    ecc_corrected_total=0.0,
    ecc_uncorrected_total=0.0,
    aer_correctable_total=0.0,
    aer_nonfatal_total=0.0,
    aer_fatal_total=0.0,
    remapped_rows_correctable_total=0.0,
    remapped_rows_uncorrectable_total=0.0,
    row_remap_pending=False,
    row_remap_failed=False,
    persistence_mode=True,
    nvlink_down=[],
    # registered with the NVLink fabric (read only where the GPU has one: fake_nvml_fabric)
    fabric={"state": "completed", "status": "NVML_SUCCESS"},
    processes=[],
    lost=False,
    hung=False,
    xid=[],
    mig=None,  # a MigLayout once a `mig:` value is set (None: MIG off)
)


@dataclass
class XidEvent:
    time: float  # seconds since scenario start
    gpu: int
    xid: int


@dataclass(frozen=True)
class KernelLine:
    time: float  # seconds since scenario start
    level: int
    text: str


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


@dataclass
class _Start:
    """The state at a phase's start: every phase before it applied in full. Copied
    before a phase is applied to it, never changed."""

    gpus: list[dict[str, Any]]
    bridges: dict[str, dict[str, int]]
    host: dict[str, Any]


def _gpu_values(values: GpuValues, model: GpuModel) -> dict[str, Any]:
    """The values a GPU entry sets, a `mig:` one resolved (scenario/mig.py)."""
    fixed = values.model_dump(exclude_none=True, exclude={"mig"})
    if values.mig is not None:
        fixed.update(mig_values(values.mig, model))
    return fixed


def get_path(values: dict[str, Any], path: str) -> Any:
    """The value at a dotted host path (set_path's keys), None where there is none."""
    found: Any = values
    for key in host_path_keys(path):
        if not isinstance(found, dict):
            return None
        found = found.get(key)
    return found


class Timeline:
    """Values of every GPU and bridge at virtual time t (seconds since scenario start)."""

    def __init__(self, scenario: Scenario, loop: bool = False) -> None:
        self.scenario = scenario
        self.loop = loop
        self.topology = Topology(scenario.node)
        self.nvlink_fabric = scenario.node.nvlink_fabric()
        self.nvlinks_wired = nvlinks_wired(scenario.node)
        self.nvlink_peers = nvlink_peers(scenario.node)
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
            "power_limit_w": float(model.power_limit_w),
            "sm_clock_mhz": 210.0,
            "mem_clock_mhz": float(model.max_mem_clock_mhz),
            **_gpu_values(scenario.node.initial, model),
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
        self._starts_at: list[_Start] = self._phase_starts()
        self._kernel_lines: list[KernelLine] | None = None  # kernel_lines(), when first asked
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
        model = self.scenario.node.model()
        for change in phase.all_changes():
            fixed = _gpu_values(change.set, model)
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

    def _phase_starts(self) -> list[_Start]:
        """The state at each phase's start, every phase before it applied in full, built
        once: a time t then applies only the phase it falls in, not all before it.

        Only as far as that gives what applying every phase would: the phases before
        phase k are whole at its start when `(start_k - start_j) / duration_j` reaches 1
        for each of them (starts are sums of durations, so a float rounding could leave
        one a hair short); from the first phase where it does not, `_compute_all`."""
        gpus = [dict(self._base) for _ in range(self.scenario.node.gpu_count)]
        bridges = {name: dict(link) for name, link in self._base_bridges.items()}
        host = copy.deepcopy(self._base_host)
        starts = [_Start(gpus, bridges, host)]
        for (start, phase), following in zip(self._compiled, self._starts[1:], strict=False):
            if min(1.0, (following - start) / phase.duration) != 1.0:
                break
            gpus = [dict(values) for values in gpus]
            bridges = {name: dict(link) for name, link in bridges.items()}
            self._apply(phase, 1.0, gpus, bridges)
            host = copy.deepcopy(host)
            self._apply_host(phase, 1.0, host)
            starts.append(_Start(gpus, bridges, host))
        return starts

    def _compute(self, t: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
        index = bisect_right(self._starts, t) - 1
        if not 0 <= index < len(self._starts_at):
            return self._compute_all(t)
        at = self._starts_at[index]
        gpus = [dict(values) for values in at.gpus]
        bridges = {name: dict(link) for name, link in at.bridges.items()}
        start, phase = self._compiled[index]
        self._apply(phase, min(1.0, (t - start) / phase.duration), gpus, bridges)
        return gpus, bridges

    def _compute_all(self, t: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
        """`_compute` applying every phase from the first."""
        gpus = [dict(self._base) for _ in range(self.scenario.node.gpu_count)]
        bridges = {name: dict(link) for name, link in self._base_bridges.items()}
        for start, phase in self._compiled:
            if start > t:
                break
            self._apply(phase, min(1.0, (t - start) / phase.duration), gpus, bridges)
        return gpus, bridges

    @staticmethod
    def _apply(
        phase: _CompiledPhase,
        progress: float,
        gpus: list[dict[str, Any]],
        bridges: dict[str, dict[str, int]],
    ) -> None:
        """A phase's GPU and bridge values, its ramps `progress` (0-1) of the way."""
        for indices, fixed, ramp in phase.changes:
            for i in indices:
                gpus[i].update(fixed)
                for key, (a, b) in ramp.items():
                    gpus[i][key] = a + (b - a) * progress
        for name, link in phase.bridges.items():
            if name in bridges:
                bridges[name].update(link)

    @staticmethod
    def _apply_host(phase: _CompiledPhase, progress: float, host: dict[str, Any]) -> None:
        """A phase's host values, its host ramps `progress` (0-1) of the way."""
        deep_merge(host, phase.host)
        for path, (a, b) in phase.host_ramp.items():
            set_path(host, path, a + (b - a) * progress)

    def host_state(self, t: float) -> dict[str, Any]:
        """Node-wide values (HostValues as nested dicts) at time t.

        Cached for the last t; callers must not modify the result.
        """
        t = self._local(t)
        if self._host_cache is not None and self._host_cache[0] == t:
            return self._host_cache[1]
        index = bisect_right(self._starts, t) - 1
        if 0 <= index < len(self._starts_at):
            host = copy.deepcopy(self._starts_at[index].host)
            start, phase = self._compiled[index]
            self._apply_host(phase, min(1.0, (t - start) / phase.duration), host)
        else:  # before the first phase, or past where the phases' starts are kept
            host = copy.deepcopy(self._base_host)
            for start, phase in self._compiled:
                if start > t:
                    break
                self._apply_host(phase, min(1.0, (t - start) / phase.duration), host)
        if self._host_noise:
            slot = self._host_slot(t)
            for path, jitter in self._host_noise.items():
                value = get_path(host, path)
                if value is not None:  # a value the scenario leaves to a writer's default
                    set_path(host, path, jitter.apply(value, self._seed, 0, slot))
        self._host_cache = (t, host)
        return host

    def kernel_lines(self, t0: float, t1: float) -> list[KernelLine]:
        """The lines the kernel logs in (t0, t1], in absolute (unlooped) seconds, in order:
        the phases' `kmsg` lines and the driver's line of each Xid (scenario/kmsg.py)."""
        if self._kernel_lines is None:
            self._kernel_lines = self._compile_kernel_lines()
        lines: list[KernelLine] = []
        period = self.duration if self.loop and self.duration > 0 else None
        if t1 <= t0:
            return lines
        for cycle in range(
            int(t0 // period) if period else 0, (int(t1 // period) if period else 0) + 1
        ):
            offset = cycle * period if period else 0.0
            lines += [
                KernelLine(offset + line.time, line.level, line.text)
                for line in self._kernel_lines
                if t0 < offset + line.time <= t1
            ]
        return lines

    def _compile_kernel_lines(self) -> list[KernelLine]:
        gpu_bdf = lambda i: self.topology.gpu(i).bdf  # noqa: E731
        lines = []
        for start, phase in self.phases():
            for line in phase.kmsg:
                text = kmsg.render(line.text, gpu_bdf, kmsg.nvswitch_bdf)
                lines += [
                    KernelLine(start + line.at + k * line.every, line.level, text)
                    for k in range(line.repeat)
                ]
            logged = kmsg.explicit_xids(phase.kmsg)
            for change in phase.all_changes():
                for xid in change.set.xid or []:
                    for gpu in self._gpus(change):
                        if (gpu, xid) in logged:
                            continue
                        processes = self.state(start)[0][gpu]["processes"]
                        first = (processes[0]["pid"], processes[0]["name"]) if processes else None
                        pci = gpu_bdf(gpu).rsplit(".", 1)[0]
                        text = kmsg.xid_line(pci, xid, gpu, first)
                        lines.append(KernelLine(start, kmsg.ERR, text))
        return sorted(lines, key=lambda line: line.time)

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
