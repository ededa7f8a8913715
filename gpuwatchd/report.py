"""`gpuwatchd report JOB`: what a job's GPUs lost to starvation, per cause, from Prometheus.

The job's GPUs are those whose gpuwatchd_gpu_owner_info names it (a Slurm job id or a
torchrun run id as `job_id`, else a Kubernetes pod), and the MIG GPU instances whose
gpuwatchd_gpu_instance_owner_info does: an instance is one of the job's GPUs, as in
deploy/prometheus/jobs.yaml, its series joined on (job, instance, uuid, gpu_instance), so
a cause judged on a MIG GPU as a whole (no gpu_instance) is charged to no tenant. Each
GPU's time is sampled on one grid (query_range, `step` = the scrape interval): a step
counts as the job's GPU time where the owner series is present, and as lost to a cause
where that cause fires. Where Prometheus has deploy/prometheus/jobs.yaml's accounting
rules for the job, the totals are theirs (`sum_over_time` over the window), so the
report, the Grafana job dashboard and any PromQL over those rules give the same
GPU-hours; the per-GPU and per-node figures come from the grid. Scrape gaps are
listed, and their time counted nowhere. Formatting: gpuwatchd/report_format.py; the
format of every field: docs/report.md.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatchd.report_prometheus import Prometheus, PrometheusError, regex_of, string

OWNER = "gpuwatchd_gpu_owner_info"
INSTANCE_OWNER = "gpuwatchd_gpu_instance_owner_info"  # a MIG GPU instance's (docs/mig.md)
# a series of a whole GPU has no gpu_instance (""): the same `on` joins it to its owner
JOIN = "on (job, instance, uuid, gpu_instance)"
# deploy/prometheus/jobs.yaml, group gpuwatchd.jobs.accounting: GPU-hours per minute
HELD_RULE = "job_id:gpuwatchd_gpu_hours:sampled1m"
STARVED_RULE = "job_id:gpuwatchd_starvation_gpu_hours:sampled1m"
DIMENSION_RULE = "job_id_dimension:gpuwatchd_starvation_gpu_hours:sampled1m"
CAUSE_RULE = "job_id_cause:gpuwatchd_starvation_gpu_hours:sampled1m"
MAX_STEPS = 10_000  # Prometheus refuses more than 11,000 points per series
WORST = 5  # GPUs and nodes listed as the worst


class ReportError(Exception):
    """No report: Prometheus unreachable, or nothing owned by the job in the window."""


@dataclass(frozen=True)
class Gpu:
    """One GPU or MIG GPU instance, equal to another by its key (job, instance, uuid,
    gpu_instance)."""

    job: str  # the scrape job
    instance: str
    node: str
    gpu: str
    uuid: str
    rank: str = field(default="", compare=False)
    gpu_instance: str = ""  # the MIG GPU instance's id; "" for a whole GPU
    profile: str = field(default="", compare=False)  # the instance's, e.g. 3g.40gb

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.job, self.instance, self.uuid, self.gpu_instance)

    @property
    def device(self) -> str:
        """The GPU as the status page names it: "0", or "0/2" for its GPU instance 2."""
        return f"{self.gpu}/{self.gpu_instance}" if self.gpu_instance else self.gpu

    @property
    def name(self) -> str:
        return f"{self.node} GPU {self.device}"


@dataclass
class Onset:
    """The first time a cause fired on one of the job's GPUs, with its evidence."""

    at: float
    node: str
    gpu: str
    summary: str
    remedy: str


@dataclass
class CauseLoss:
    cause: str
    dimension: str
    gpu_hours: float
    share: float  # of the job's GPU time
    gpus: int  # GPUs of the job it fired on
    onset: Onset | None


@dataclass
class Usage:
    """One GPU's or node's time and what starved it."""

    name: str
    gpu_hours: float
    starved_gpu_hours: float
    share: float
    top_cause: str


@dataclass
class Gap:
    node: str
    start: float
    end: float
    kind: str  # "no samples" (nothing scraped) or "scrape failed" (up == 0)


@dataclass
class JobReport:
    job: str
    selector: str
    scheduler: str
    user: str
    namespace: str
    since: float
    until: float
    start: float  # first and last sample owned by the job
    end: float
    step: float
    nodes: list[str]
    gpus: int  # whole GPUs and MIG GPU instances
    gpu_hours: float
    starved_gpu_hours: float
    causes: list[CauseLoss]
    dimensions: dict[str, float]  # GPU-hours with a cause of the dimension firing
    worst_gpus: list[Usage]
    worst_nodes: list[Usage]
    gaps: list[Gap]
    accounting: str  # "rules" (jobs.yaml's) or "samples" (the grid)
    verdict: str = ""
    version: int = 1
    gpu_instances: int = 0  # of `gpus`, MIG GPU instances (in JSON only where some)

    @property
    def starved_share(self) -> float:
        return self.starved_gpu_hours / self.gpu_hours if self.gpu_hours else 0.0

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        if not self.gpu_instances:  # a job without MIG: the document as before MIG
            del fields["gpu_instances"]
        return {**fields, "starved_share": self.starved_share}


def build_report(
    prometheus: Prometheus, job: str, since: float, until: float, step: float | None = None
) -> JobReport:
    """The report of `job` from what `prometheus` holds between `since` and `until`."""
    if until <= since:
        raise ReportError("--until must be after --since")
    window = f"{max(1, round(until - since))}s"
    try:
        selector, gpus = _find_gpus(prometheus, job, window, until)
        nodes = _node_samples(prometheus, gpus, selector, window, until)
        start = min(s[0] for s in nodes.values())
        end = max(s[-1] for s in nodes.values())
        interval = _scrape_interval(nodes)
        step = max(step or interval, (end - start) / MAX_STEPS, 0.001)
        grid = _Grid(prometheus, gpus, selector, start, end, step)
        gaps = _gaps(prometheus, gpus, nodes, window, until, interval)
        rules = _rule_totals(prometheus, gpus, selector, window, until)
    except PrometheusError as e:
        raise ReportError(str(e)) from e
    return _assemble(job, selector, gpus, since, until, start, end, step, grid, gaps, rules)


def owners(selector: str) -> str:
    """The owner series of whole GPUs and MIG GPU instances matching `selector`."""
    return f"{OWNER}{{{selector}}} or {INSTANCE_OWNER}{{{selector}}}"


def _find_gpus(
    prometheus: Prometheus, job: str, window: str, until: float
) -> tuple[str, dict[tuple[str, str, str, str], dict[str, str]]]:
    """The owner selector that names `job` and the owner labels of each GPU (or MIG GPU
    instance) it held: a job_id first (Slurm job, torchrun run), else a pod
    ("namespace/pod" or "pod")."""
    namespace, _, pod = job.rpartition("/")
    candidates = [f"job_id={string(job)}", f"pod={string(pod)}"]
    if namespace:
        candidates[1] += f", namespace={string(namespace)}"
    for selector in candidates:
        expr = (
            f"last_over_time({OWNER}{{{selector}}}[{window}])"
            f" or last_over_time({INSTANCE_OWNER}{{{selector}}}[{window}])"
        )
        found = prometheus.query(expr, until)
        if found:
            held: dict[tuple[str, str, str, str], dict[str, str]] = {}
            for series in found:  # a GPU whose rank changed has two series: keep one
                held.setdefault(_gpu(series["metric"]).key, series["metric"])
            return selector, held
    raise ReportError(
        f"no GPU owned by {job!r} in the window: Prometheus has no {OWNER} or "
        f"{INSTANCE_OWNER} with "
        f"{' or '.join(candidates)} (is the job id right, and the window? see --since)"
    )


def _gpu(labels: dict[str, str]) -> Gpu:
    return Gpu(
        job=labels.get("job", ""),
        instance=labels.get("instance", ""),
        node=labels.get("node") or labels.get("instance", ""),
        gpu=labels.get("gpu", ""),
        uuid=labels.get("uuid", ""),
        rank=labels.get("rank", ""),
        gpu_instance=labels.get("gpu_instance", ""),
        profile=labels.get("profile", ""),
    )


def _node_samples(prometheus: Prometheus, gpus: dict, selector: str, window: str,
                  until: float) -> dict[str, list[float]]:
    """Per node, the timestamps of one of its GPUs' raw owner samples: the node's span in
    the job, its scrape interval and the holes in its scrapes (not interpolated)."""
    one_per_node: dict[str, Gpu] = {}
    for labels in gpus.values():
        gpu = _gpu(labels)
        one_per_node.setdefault(gpu.node, gpu)
    samples = {}
    for node, gpu in one_per_node.items():
        name, matchers = OWNER, selector
        if gpu.gpu_instance:  # a range selector has one name: the instance's own series
            name = INSTANCE_OWNER
            matchers += f", gpu_instance={string(gpu.gpu_instance)}"
        expr = (f"{name}{{{matchers}, job={string(gpu.job)}, instance={string(gpu.instance)},"
                f" uuid={string(gpu.uuid)}}}[{window}]")
        times = sorted({float(t) for s in prometheus.query(expr, until) for t, _ in s["values"]})
        if times:
            samples[node] = times
    if not samples:
        raise ReportError("the job's owner series have no samples in the window")
    return samples


def _scrape_interval(nodes: dict[str, list[float]]) -> float:
    spacings = [b - a for times in nodes.values() for a, b in _pairs(times)]
    return statistics.median(spacings) if spacings else 15.0


class _Grid:
    """The job's GPUs sampled every `step` from `start` to `end`: per GPU the steps it was
    owned, per GPU and cause the steps the cause fired, and the first step of each cause's
    evidence (gpuwatchd_starvation_info)."""

    def __init__(self, prometheus: Prometheus, gpus: dict, selector: str, start: float,
                 end: float, step: float) -> None:
        self.start, self.step = start, step
        uuids = regex_of([labels["uuid"] for labels in gpus.values()])
        instances = regex_of([labels.get("instance", "") for labels in gpus.values()])
        own = owners(selector)
        on_job = f"{{instance=~{instances}, uuid=~{uuids}}}"
        join = f"* {JOIN} group_left () ({own})"

        def fetch(expr: str) -> list[dict]:
            return prometheus.query_range(expr, start, end, step)

        self.owned: dict[Gpu, set[int]] = defaultdict(set)
        for series in fetch(own):
            self.owned[_gpu(series["metric"])] |= self._steps(series)
        self.firing: dict[tuple[Gpu, str], set[int]] = defaultdict(set)
        self.dimension: dict[str, str] = {}
        for series in fetch(f"(gpuwatchd_starvation_active{on_job} == 1) {join}"):
            cause = series["metric"]["cause"]
            self.dimension[cause] = series["metric"].get("dimension", "")
            self.firing[(_gpu(series["metric"]), cause)] |= self._steps(series)
        self.onsets: dict[str, Onset] = {}
        for series in fetch(f"gpuwatchd_starvation_info{on_job} {join}"):
            m, first = series["metric"], min(self._steps(series))
            at = start + first * step
            known = self.onsets.get(m["cause"])
            if known is None or at < known.at:
                gpu = _gpu(m)
                self.onsets[m["cause"]] = Onset(
                    at, gpu.node, gpu.device, m.get("summary", ""), m.get("remedy", "")
                )

    def _steps(self, series: dict) -> set[int]:
        return {round((float(t) - self.start) / self.step) for t, _ in series["values"]}

    def hours(self, steps: int) -> float:
        return steps * self.step / 3600

    def starved(self, gpu: Gpu, causes: Iterable[str] | None = None) -> set[int]:
        """Steps on which any of `causes` (None: any cause) fired on `gpu`."""
        wanted = None if causes is None else set(causes)
        hit: set[int] = set()
        for (g, cause), steps in self.firing.items():
            if g == gpu and (wanted is None or cause in wanted):
                hit |= steps
        return hit & self.owned[gpu]


def _gaps(prometheus: Prometheus, gpus: dict, nodes: dict[str, list[float]], window: str,
          until: float, interval: float) -> list[Gap]:
    """Per node, the stretches of the job between two samples over 1.5 scrape intervals
    apart: "scrape failed" where `up` was 0 in it (the node or its daemon did not answer),
    else "no samples" (Prometheus did not scrape: down, or overloaded)."""
    targets = {g.node: g for g in map(_gpu, gpus.values()) if g.node in nodes}
    gaps = []
    for node, times in sorted(nodes.items()):
        holes = [(a, b) for a, b in _pairs(times) if b - a > 1.5 * interval]
        if not holes:
            continue
        gpu = targets[node]
        expr = f"up{{job={string(gpu.job)}, instance={string(gpu.instance)}}}[{window}]"
        failed = [float(t) for s in prometheus.query(expr, until) for t, v in s["values"]
                  if float(v) == 0]
        for a, b in holes:
            kind = "scrape failed" if any(a < t < b for t in failed) else "no samples"
            gaps.append(Gap(node, a, b, kind))
    return sorted(gaps, key=lambda g: (g.start, g.node))


def _rule_totals(prometheus: Prometheus, gpus: dict, selector: str, window: str, until: float
                 ) -> dict[str, dict[str, float]] | None:
    """jobs.yaml's accounting rules summed over the window, or None where Prometheus has
    none for the job (rules not loaded, or a pod without a job id)."""
    if not selector.startswith("job_id="):
        return None
    schedulers = sorted({labels.get("scheduler", "") for labels in gpus.values()})
    rule_selector = f"{selector}, scheduler=~{regex_of(schedulers)}"

    def total(rule: str, by: str) -> dict[str, float]:
        expr = f"sum by ({by}) (sum_over_time({rule}{{{rule_selector}}}[{window}]))"
        found = prometheus.query(expr, until)
        return {s["metric"].get(by, ""): float(s["value"][1]) for s in found}

    held = total(HELD_RULE, "job_id")
    if not held:
        return None
    return {
        "held": held,
        "starved": total(STARVED_RULE, "job_id"),
        "dimension": total(DIMENSION_RULE, "dimension"),
        "cause": total(CAUSE_RULE, "cause"),
    }


def _assemble(job: str, selector: str, owners: dict, since: float, until: float, start: float,
              end: float, step: float, grid: _Grid, gaps: list[Gap],
              rules: dict[str, dict[str, float]] | None) -> JobReport:
    gpus = sorted(grid.owned, key=lambda g: (g.node, g.gpu.zfill(4), g.gpu_instance.zfill(4)))
    held = grid.hours(sum(len(grid.owned[g]) for g in gpus))
    starved = grid.hours(sum(len(grid.starved(g)) for g in gpus))
    causes = sorted(grid.dimension)
    per_cause = {c: grid.hours(sum(len(grid.starved(g, [c])) for g in gpus)) for c in causes}
    per_dimension = {
        d: grid.hours(sum(len(grid.starved(g, [c for c in causes if grid.dimension[c] == d]))
                          for g in gpus))
        for d in sorted(set(grid.dimension.values()))
    }
    if rules is not None:  # the rules' totals: the numbers dashboards show
        held = sum(rules["held"].values())
        starved = sum(rules["starved"].values())
        per_cause = {c: h for c, h in rules["cause"].items() if h > 0}
        per_dimension = {d: h for d, h in rules["dimension"].items() if h > 0}
    losses = [
        CauseLoss(
            cause=c,
            dimension=grid.dimension.get(c, ""),
            gpu_hours=h,
            share=h / held if held else 0.0,
            gpus=sum(1 for g in gpus if grid.starved(g, [c])),
            onset=grid.onsets.get(c),
        )
        for c, h in per_cause.items()
    ]
    losses.sort(key=lambda loss: (-loss.gpu_hours, loss.cause))
    labels = next(iter(owners.values()))
    report = JobReport(
        job=job,
        selector=selector,
        scheduler=labels.get("scheduler", ""),
        user=labels.get("user", ""),
        namespace=labels.get("namespace", ""),
        since=since,
        until=until,
        start=start,
        end=end,
        step=step,
        nodes=sorted({g.node for g in gpus}),
        gpus=len(gpus),
        gpu_hours=held,
        starved_gpu_hours=starved,
        causes=losses,
        dimensions=dict(sorted(per_dimension.items(), key=lambda kv: -kv[1])),
        worst_gpus=_worst(grid, {_ranked(g): [g] for g in gpus}),
        worst_nodes=_worst(grid, _by_node(gpus)),
        gaps=gaps,
        accounting="rules" if rules is not None else "samples",
        gpu_instances=sum(1 for g in gpus if g.gpu_instance),
    )
    report.verdict = verdict(report)
    return report


def _ranked(gpu: Gpu) -> str:
    """The GPU with its rank, "node1 GPU 0 (rank 0)"; a MIG GPU instance with its profile
    too, "node1 GPU 0/2 (3g.40gb, rank 0)"."""
    details = [d for d in (gpu.profile, f"rank {gpu.rank}" if gpu.rank else "") if d]
    return f"{gpu.name} ({', '.join(details)})" if details else gpu.name


def _pairs(times: list[float]) -> list[tuple[float, float]]:
    return list(zip(times, times[1:], strict=False))


def _by_node(gpus: list[Gpu]) -> dict[str, list[Gpu]]:
    nodes: dict[str, list[Gpu]] = defaultdict(list)
    for g in gpus:
        nodes[g.node].append(g)
    return nodes


def _worst(grid: _Grid, groups: dict[str, list[Gpu]]) -> list[Usage]:
    usage = []
    for name, members in groups.items():
        held = grid.hours(sum(len(grid.owned[g]) for g in members))
        starved = grid.hours(sum(len(grid.starved(g)) for g in members))
        top = max(
            grid.dimension,
            key=lambda c: (sum(len(grid.starved(g, [c])) for g in members), c),
            default="",
        )
        if not any(grid.starved(g, [top]) for g in members):
            top = ""
        usage.append(Usage(name, held, starved, starved / held if held else 0.0, top))
    usage.sort(key=lambda u: (-u.share, u.name))
    return [u for u in usage if u.starved_gpu_hours > 0][:WORST]


def percent(share: float) -> str:
    return f"{share * 100:.0f} %" if share >= 0.01 or share == 0 else f"{share * 100:.1f} %"


def first_sentence(text: str, limit: int = 140) -> str:
    """The remedy's first instruction: up to its first ';' or sentence end."""
    text = " ".join(text.split())
    cuts = [i for i in (text.find("; "), text.find(". "), text.find(": ")) if i > 0]
    short = text[: min(cuts)] if cuts else text.rstrip(".")
    return short if len(short) <= limit else short[: limit - 1].rstrip() + "…"


def verdict(report: JobReport) -> str:
    """One line: the dimension that cost the most, its leading cause, on how many GPUs,
    and the remedy's first instruction."""
    if not report.causes:
        return f"no starvation cause fired on the job's {report.gpus} GPUs"
    dimension = next(iter(report.dimensions), report.causes[0].dimension)
    top = next((c for c in report.causes if c.dimension == dimension), report.causes[0])
    share = report.dimensions.get(dimension, top.gpu_hours) / report.gpu_hours
    line = (f"{percent(share)} of GPU time lost to {dimension}: {top.cause} on {top.gpus} of "
            f"{report.gpus} GPUs")
    remedy = top.onset.remedy if top.onset else ""
    return f"{line} — {first_sentence(remedy)}" if remedy else line


def parse_time(value: str | None, default: float, now: float | None = None) -> float:
    """A Unix time, an ISO 8601 date-time, or a duration back from `now` ("90m", "7d")."""
    now = time.time() if now is None else now
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        pass
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    if value[-1] in units:
        try:
            return now - float(value[:-1]) * units[value[-1]]
        except ValueError:
            pass
    from datetime import datetime, timezone

    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise ReportError(
            f"{value!r}: expected a Unix time, an ISO 8601 time or a duration such as 6h"
        ) from e
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()
