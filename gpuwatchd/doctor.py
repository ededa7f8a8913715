"""`gpuwatchd doctor`: a one-shot diagnosis of this node, as the seed's checklist.

On this node the sources run for a short real-time window (each polled three times: at
the start, the middle and the end, so rate-based sources have rates whatever their
configured interval), then every rule is evaluated once without waiting out its `for`
(`RuleEngine.diagnose`). With `--simulate` the simulated node is played in virtual time
through `Simulation` up to `--at` (the scenario's end by default), which is instant and
deterministic, then diagnosed the same way.

Exit status: 0 when no cause holds, 1 when at least one cause holds on some GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.daemon import Pipeline
from gpuwatchd.rules.engine import HOLDS, NOT_EVALUABLE, Finding
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources import Context
from gpuwatchd.store import Store

DIMENSIONS = ("pcie", "input", "compute", "communication", "driver", "system")
OK, PROBLEM, NOT_CHECKED = "ok", "problem", "not checked"

# Evidence read straight from the store for each dimension: (label, series, scale, unit,
# how several series of one name are summed up: the worst of them). Host series are
# shown even when no GPU is found.
Aggregate = Callable[[list[float]], float]
EVIDENCE: dict[str, tuple[tuple[str, str, float, str, Aggregate], ...]] = {
    "pcie": (
        ("link gen", "gpuwatchd_gpu_pcie_link_generation", 1, "", min),
        ("max gen", "gpuwatchd_gpu_pcie_link_generation_max", 1, "", max),
        ("width", "gpuwatchd_gpu_pcie_link_width", 1, "", min),
    ),
    "input": (
        ("cpu busy", "gpuwatchd_cpu_busy_ratio", 100, "%", max),
        ("iowait", "gpuwatchd_cpu_iowait_ratio", 100, "%", max),
        ("disk util", "gpuwatchd_disk_utilization_ratio", 100, "%", max),
        ("disk await", "gpuwatchd_disk_await_seconds", 1000, "ms", max),
    ),
    "compute": (("gpu util", "gpuwatchd_gpu_utilization_ratio", 100, "%", max),),
    "communication": (),
    "driver": (),
    "system": (
        ("cpu steal", "gpuwatchd_cpu_steal_ratio", 100, "%", max),
        ("busiest irq line", "gpuwatchd_interrupt_max_line_per_second", 1, "/s", max),
        ("interrupts", "gpuwatchd_interrupts_per_second", 1, "/s", max),
    ),
}


@dataclass
class DimensionReport:
    dimension: str
    status: str  # OK, PROBLEM or NOT_CHECKED
    evidence: list[str] = field(default_factory=list)
    causes: list[dict[str, str]] = field(default_factory=list)  # gpu, cause, summary, remedy


@dataclass
class Report:
    node: str  # "this node" or "simulated node 'NAME' at Ns"
    gpus: list[str]
    no_gpu: str | None  # why no GPU was found, or None
    sources_down: dict[str, str]
    dimensions: list[DimensionReport]
    findings: list[Finding]

    @property
    def holds(self) -> bool:
        return any(f.status == HOLDS for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.holds else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpus": self.gpus,
            "no_gpu": self.no_gpu,
            "sources_down": self.sources_down,
            "dimensions": [asdict(d) for d in self.dimensions],
            "findings": [asdict(f) for f in self.findings],
            "exit_code": self.exit_code,
        }


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.3g}"


def _evidence(store: Store, now: float, dimension: str) -> list[str]:
    latest: dict[str, list[float]] = {}
    for (name, _labels), value in store.latest(now):
        latest.setdefault(name, []).append(value)
    out = []
    for label, series, scale, unit, aggregate in EVIDENCE[dimension]:
        values = latest.get(series)
        if values:
            prefix = f"{aggregate.__name__} " if len(values) > 1 else ""
            out.append(f"{label} {prefix}{_fmt(aggregate(values) * scale)}{unit}")
    return out


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)


def build_report(pipeline: Pipeline, node: str) -> Report:
    now = pipeline.now()
    findings = pipeline.engine.diagnose(now)
    down = {
        p.name: p.health.last_error or "no successful poll"
        for p in pipeline.pollers
        if not p.health.up
    }
    gpus = sorted({f.gpu for f in findings}, key=_gpu_order)
    no_gpu = None
    if not gpus:
        no_gpu = down.get("nvml") or "the NVML source found no GPU"
        if "nvml" not in {p.name for p in pipeline.pollers}:
            no_gpu = "the NVML source is disabled in the configuration"
    dimensions = []
    for dim in DIMENSIONS:
        mine = [f for f in findings if f.dimension == dim]
        holding = [f for f in mine if f.status == HOLDS]
        evaluated = [f for f in mine if f.status != NOT_EVALUABLE]
        status = PROBLEM if holding else OK if evaluated else NOT_CHECKED
        report = DimensionReport(dim, status, _evidence(pipeline.store, now, dim))
        report.causes = [
            {"gpu": f.gpu, "cause": f.cause, "summary": f.detail, "remedy": f.remedy}
            for f in holding
        ]
        dimensions.append(report)
    return Report(node, gpus, no_gpu, down, dimensions, findings)


def diagnose_node(
    config: Config, window: float, sleep: Callable[[float], None] = time.sleep
) -> Report:
    """Poll every enabled source three times over `window` seconds, then diagnose."""
    pipeline = Pipeline(config, Context(procfs=config.procfs, sysfs=config.sysfs), time.time)
    try:
        for i in range(3):
            if i:
                sleep(window / 2)
            for poller in pipeline.pollers:
                poller.poll()
        return build_report(pipeline, "this node")
    finally:
        pipeline.close()


def diagnose_simulated(scenario: Scenario, config: Config, at: float | None) -> Report:
    """Play `scenario` in virtual time up to `at` (default: its end), then diagnose."""
    from gpuwatchd.simulate import Simulation

    simulation = Simulation(scenario, config)
    try:
        result = simulation.run(until=at)
        node = f"simulated node {scenario.name!r} at {result.simulated_seconds:.0f}s"
        return build_report(simulation.pipeline, node)
    finally:
        simulation.close()


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def format_report(report: Report) -> str:
    lines = []
    if report.no_gpu is not None:
        lines.append(f"no NVIDIA GPU or driver found: {report.no_gpu}")
        lines.append("GPU checks are not checked; host checks follow.")
        lines.append("")
    gpus = ", ".join(report.gpus) if report.gpus else "none"
    lines.append(f"gpuwatchd doctor: {report.node}, GPUs: {gpus}")
    if report.sources_down:
        lines.append("sources down:")
        lines += [f"  {name}: {why}" for name, why in sorted(report.sources_down.items())]
    lines.append("")
    rows: list[tuple[str, ...]] = []
    for d in report.dimensions:
        evidence = [f"gpu {c['gpu']} {c['cause']}: {c['summary']}" for c in d.causes]
        evidence += d.evidence
        rows.append((d.dimension, d.status, "; ".join(evidence) or "-"))
    lines += _table(("dimension", "status", "evidence"), rows)
    remedies = {(c["cause"], c["remedy"]) for d in report.dimensions for c in d.causes}
    if remedies:
        lines.append("")
        lines.append("remedies:")
        lines += [f"  {cause}: {remedy}" for cause, remedy in sorted(remedies)]
    if report.gpus:
        lines.append("")
        lines.append("per-GPU findings:")
        for gpu in report.gpus:
            mine = [f for f in report.findings if f.gpu == gpu]
            holding = [f for f in mine if f.status == HOLDS]
            unknown = [f.cause for f in mine if f.status == NOT_EVALUABLE]
            if holding:
                for f in holding:
                    lines.append(
                        f"  gpu {gpu}: {f.cause} ({f.dimension}, {f.severity}): {f.detail}"
                    )
            else:
                lines.append(f"  gpu {gpu}: no cause holds")
            if unknown:
                lines.append(f"  gpu {gpu}: not evaluable: {', '.join(unknown)}")
    lines.append("")
    verdict = "a cause holds (exit 1)" if report.holds else "no cause holds (exit 0)"
    lines.append(f"result: {verdict}")
    return "\n".join(lines)
