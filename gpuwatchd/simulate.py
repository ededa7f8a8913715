"""`gpuwatchd simulate`: replay a scenario in virtual time, as fast as the CPU allows.

The same pipeline as `run` (sources, store, exporter) is driven by a stepped scheduler
on one thread, so every replay of a scenario is deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatchd.config import Config
from gpuwatchd.daemon import Pipeline
from gpuwatchd.rules import Transition
from gpuwatchd.scheduler import SteppedScheduler
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sim.watch import MetricWatch

# What the per-phase table shows for each GPU: (column, metric)
SNAPSHOT_COLUMNS = (
    ("util%", "gpuwatchd_gpu_utilization_ratio"),
    ("pstate", "gpuwatchd_gpu_performance_state"),
    ("power W", "gpuwatchd_gpu_power_watts"),
    ("pcie gen", "gpuwatchd_gpu_pcie_link_generation"),
    ("max gen", "gpuwatchd_gpu_pcie_link_generation_max"),
    ("width", "gpuwatchd_gpu_pcie_link_width"),
)


@dataclass
class PhaseSnapshot:
    phase: str
    at: float  # seconds since scenario start
    rows: list[tuple[str, list[float | None]]]  # (gpu label, one value per column)
    firing: list[tuple[str, str, str]] = field(default_factory=list)  # (gpu, cause, summary)


@dataclass
class SimulationResult:
    scenario: str
    simulated_seconds: float
    wall_seconds: float
    steps: int
    snapshots: list[PhaseSnapshot] = field(default_factory=list)
    exposition: bytes = b""
    transitions: list[Transition] = field(default_factory=list)  # rule state changes
    started_at: float = 0.0  # the clock's time at the scenario's start


class Simulation:
    def __init__(self, scenario: Scenario, config: Config, ptrace: bool = True) -> None:
        self.scenario = scenario
        self.config = config
        self.node = SimNode(scenario, virtual=True, ptrace=ptrace)
        try:
            self.pipeline = Pipeline(config, self.node.context(), self.node.clock.now)
        except Exception:  # a bad rule file: leave no simulated node behind
            self.node.close()
            raise
        self.scheduler = SteppedScheduler(self.pipeline.pollers)
        self.transitions: list[Transition] = []
        # the scenario's metric expectations, seen as causes by the check
        self.watch = MetricWatch(
            scenario, self.pipeline.pollers, self.pipeline.store, self.pipeline.engine
        )

    def step(self) -> None:
        """One evaluation cycle at the clock's current time: sources due, then the rules."""
        now = self.pipeline.now()
        self.node.tick(self.scheduler.due(now))  # the files the sources due will read
        self.scheduler.run_due(now)
        self.transitions += self.pipeline.evaluate_rules()
        if self.watch:
            self.transitions += self.watch.sample(now)

    def run(
        self, until: float | None = None, on_step: Callable[[float], None] | None = None
    ) -> SimulationResult:
        clock = self.node.clock
        end = self.node.timeline.duration if until is None else until
        phase_ends = [(start + p.duration, p.name) for start, p in self.node.timeline.phases()]
        result = SimulationResult(self.scenario.name, 0.0, 0.0, 0)
        result.started_at = clock.start_wall
        started = time.perf_counter()
        step = self.config.evaluation_interval
        while clock.elapsed() <= end:
            self.step()
            result.steps += 1
            if on_step is not None:
                on_step(clock.elapsed())
            next_t = clock.elapsed() + step
            while phase_ends and phase_ends[0][0] <= next_t:
                result.snapshots.append(self.snapshot(phase_ends.pop(0)[1]))
            clock.advance(step)
        result.simulated_seconds = min(clock.elapsed(), end)
        result.wall_seconds = time.perf_counter() - started
        result.exposition = self.pipeline.exporter.render().text
        result.transitions = list(self.transitions)
        return result

    def snapshot(self, phase: str) -> PhaseSnapshot:
        store = self.pipeline.store
        rows = []
        for gpu in range(self.scenario.node.gpu_count):
            labels = self._gpu_labels(gpu)
            values = [
                store.get(metric, labels) if labels else None for _, metric in SNAPSHOT_COLUMNS
            ]
            if values and values[0] is not None:
                values[0] *= 100
            rows.append((str(gpu), values))
        return PhaseSnapshot(phase, self.node.clock.elapsed(), rows, self.pipeline.engine.firing())

    def _gpu_labels(self, gpu: int) -> tuple[str, ...] | None:
        for (name, labels), _ in self.pipeline.store.latest(self.pipeline.now()):
            if name == "gpuwatchd_gpu_info" and labels[0] == str(gpu):  # MIG: no utilization
                return labels[:2]
        return None

    def close(self) -> None:
        self.pipeline.close()
        self.node.close()


def format_result(result: SimulationResult) -> str:
    lines = [
        f"scenario {result.scenario}: simulated {result.simulated_seconds:.0f}s in "
        f"{result.wall_seconds:.2f}s wall ({result.steps} steps)"
    ]
    header = ["gpu", *(column for column, _ in SNAPSHOT_COLUMNS)]
    for snap in result.snapshots:
        lines.append(f"\nend of phase {snap.phase!r} (t={snap.at:.0f}s)")
        lines.append("  ".join(f"{h:>8}" for h in header))
        for gpu, values in snap.rows:
            cells = ["-" if v is None else f"{v:g}" for v in values]
            lines.append("  ".join(f"{c:>8}" for c in [gpu, *cells]))
        causes = ", ".join(f"gpu {gpu}: {cause}" for gpu, cause, _ in snap.firing)
        lines.append(f"  firing: {causes or 'none'}")
    changes = [t for t in result.transitions if "firing" in (t.old, t.new)]
    if changes:
        lines.append("\nfiring causes:")
    for t in changes:
        at = t.at - result.started_at
        if t.new == "firing":
            lines.append(f"  {at:7.0f}s  gpu {t.where}  {t.cause} firing: {t.detail}")
        else:
            lines.append(f"  {at:7.0f}s  gpu {t.where}  {t.cause} resolved ({t.new})")
    return "\n".join(lines)
