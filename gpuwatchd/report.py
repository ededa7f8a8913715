"""`gpuwatchd report JOB`: what a job's GPUs lost to starvation, per cause, from Prometheus.

The job's GPUs are those whose gpuwatchd_gpu_owner_info names it (a Slurm job id or a
torchrun run id as `job_id`, else a Kubernetes pod), and the MIG GPU instances whose
gpuwatchd_gpu_instance_owner_info does: an instance is one of the job's GPUs, as in
deploy/prometheus/jobs.yaml, its series matched on (job, instance, uuid, gpu_instance), so
a cause judged on a MIG GPU as a whole (no gpu_instance) is charged to no tenant.

One accounting, from the raw samples Prometheus holds (nothing interpolated, no grid):
each interval (a, b] between two successful scrapes of a GPU's daemon (`up` 1, at most
1.5 scrape intervals apart) whose end b has the job's owner sample is the job's GPU time,
and the increase of the daemon's gpuwatchd_starvation_seconds_total over it is the time
each cause fired in it: the daemon's own count, exact to its evaluation cycle however
short the episode. Time with any cause firing (and with any cause of a dimension) is, in
an interval where several causes rose on one GPU, the largest of their increases: at
most `overlap_gpu_hours` short. Totals, causes, dimensions and the worst GPUs and nodes
are sums of the same per-GPU figures. Scrape gaps are listed, and their time counted
nowhere. Formatting: gpuwatchd/report_format.py; every field: docs/report.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

from gpuwatchd.report_prometheus import Prometheus, PrometheusError, regex_of, string

OWNER = "gpuwatchd_gpu_owner_info"
INSTANCE_OWNER = "gpuwatchd_gpu_instance_owner_info"  # a MIG GPU instance's (docs/mig.md)
COUNTER = "gpuwatchd_starvation_seconds_total"  # per GPU and cause, from its first pending
PENDING = "gpuwatchd_starvation_pending"  # 1 while the expression holds, `for` not passed
INFO = "gpuwatchd_starvation_info"  # 1 while firing: the evidence frozen then, the remedy
GAP = 1.5  # scrape intervals: two samples further apart have a gap between them
WORST = 5  # GPUs and nodes listed as the worst

Key = tuple[str, str, str, str]  # (job, instance, uuid, gpu_instance)
Target = tuple[str, str]  # (job, instance): one daemon


class ReportError(Exception):
    """No report: an empty job id, Prometheus unreachable, or nothing owned by the job
    in the window."""


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
    def key(self) -> Key:
        return (self.job, self.instance, self.uuid, self.gpu_instance)

    @property
    def target(self) -> Target:
        return (self.job, self.instance)

    @property
    def device(self) -> str:
        """The GPU as the status page names it: "0", or "0/2" for its GPU instance 2."""
        return f"{self.gpu}/{self.gpu_instance}" if self.gpu_instance else self.gpu

    @property
    def name(self) -> str:
        return f"{self.node} GPU {self.device}"


@dataclass
class Onset:
    """The first time a cause fired on one of the job's GPUs, with its evidence. The
    fault began between `holds_since - window` and `holds_since`."""

    at: float  # when it fired: the end of its counter's first rise less the rise
    node: str
    gpu: str
    summary: str  # "" where no scrape saw it firing
    remedy: str
    holds_since: float  # its expression held from: the first pending sample before `at`
    window: float  # the rule's longest evidence window, s (the shipped rules'; 0: none)
    before: bool = False  # already firing when the job's time in the window began (`at`)


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
    start: float  # first and last sample owned by the job in the window
    end: float
    scrape_interval: float
    nodes: list[str]
    gpus: int  # whole GPUs and MIG GPU instances
    gpu_hours: float
    starved_gpu_hours: float
    causes: list[CauseLoss]
    dimensions: dict[str, float]  # GPU-hours with a cause of the dimension firing
    worst_gpus: list[Usage]
    worst_nodes: list[Usage]
    gaps: list[Gap]
    cut_start: bool = False  # the job was the GPUs' owner before --since
    cut_end: bool = False  # ... and still at --until
    overlap_gpu_hours: float = 0.0  # starved time may be this much more (several causes)
    accounting: str = "counters"
    verdict: str = ""
    version: int = 2
    gpu_instances: int = 0  # of `gpus`, MIG GPU instances (in JSON only where some)

    @property
    def starved_share(self) -> float:
        return self.starved_gpu_hours / self.gpu_hours if self.gpu_hours else 0.0

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        if not self.gpu_instances:  # a job without MIG: the document as before MIG
            del fields["gpu_instances"]
        return {**fields, "starved_share": self.starved_share}


def build_report(prometheus: Prometheus, job: str, since: float, until: float) -> JobReport:
    """The report of `job` from what `prometheus` holds between `since` and `until`."""
    check_job(job)
    if until <= since:
        raise ReportError("--until must be after --since")
    try:
        selector, owners, owned = _find_gpus(prometheus, job, since, until)
        gpus = {key: _gpu(labels) for key, labels in owners.items()}
        start = min(min(times) for times in owned.values())
        end = max(max(times) for times in owned.values())
        interval = _scrape_interval(owned)
        samples = _fetch(prometheus, list(gpus.values()), start, end, interval)
        cut_start = _held_before(prometheus, selector, since, start, interval)
    except PrometheusError as e:
        raise ReportError(str(e)) from e
    samples.owned = owned
    ledger = _Ledger(samples, gpus, interval, since)
    report = _assemble(job, selector, owners, ledger)
    report.since, report.until, report.start, report.end = since, until, start, end
    report.scrape_interval = interval
    report.cut_start, report.cut_end = cut_start, end >= until - GAP * interval
    report.gaps = _gaps(samples, gpus, interval)
    report.verdict = verdict(report)
    return report


def check_job(job: str) -> None:
    """Refuse a job id that would match GPUs of no job in particular: empty (`report
    ''`), or a pod with an empty name or namespace (`"$POD_NAMESPACE/$POD_NAME"` with
    the variables unset is "/")."""
    expected = ("expected a Slurm job id, a torchrun run id, or a pod as POD or "
                "NAMESPACE/POD")
    if not job.strip():
        raise ReportError(f"the job id is empty: {expected} (is its variable set?)")
    namespace, slash, pod = job.rpartition("/")
    if slash and not (namespace.strip() and pod.strip()):
        raise ReportError(
            f"{job!r}: a pod's namespace or name is empty: {expected} "
            '("$POD_NAMESPACE/$POD_NAME" with the variables unset is "/")'
        )


def _find_gpus(
    prometheus: Prometheus, job: str, since: float, until: float
) -> tuple[str, dict[Key, dict[str, str]], dict[Key, set[float]]]:
    """The owner selector that names `job`, the owner labels of each GPU (or MIG GPU
    instance) it held and the times of its owner samples from `since` to `until`, both
    included: a job_id first (Slurm job, torchrun run), else a pod ("namespace/pod" or
    "pod")."""
    # a millisecond more, then cut at `since`: Prometheus 2 includes a range's first
    # instant, VictoriaMetrics (and Prometheus 3) do not
    window = f"{math.ceil((until - since) * 1000) + 1}ms"
    namespace, _, pod = job.rpartition("/")
    candidates = [f"job_id={string(job)}", f"pod={string(pod)}"]
    if namespace:
        candidates[1] += f", namespace={string(namespace)}"
    for selector in candidates:
        found = [s for name in (OWNER, INSTANCE_OWNER)
                 for s in prometheus.query(f"{name}{{{selector}}}[{window}]", until)]
        if found:
            labels: dict[Key, dict[str, str]] = {}
            owned: dict[Key, set[float]] = defaultdict(set)
            for series in found:  # a GPU whose rank changed has two series: keep one
                times = {float(t) for t, _ in series["values"] if float(t) >= since}
                if times:
                    key = _gpu(series["metric"]).key
                    labels.setdefault(key, series["metric"])
                    owned[key] |= times
            if owned:
                return selector, labels, owned
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


def _scrape_interval(owned: dict[Key, set[float]]) -> float:
    spacings = [b - a for times in owned.values() for a, b in _pairs(sorted(times))]
    return statistics.median(spacings) if spacings else 15.0


def _held_before(prometheus: Prometheus, selector: str, since: float, start: float,
                 interval: float) -> bool:
    """Whether the job owned a GPU in the scrape interval before the window: the window
    cuts the job's start."""
    if start - since > GAP * interval:
        return False
    reach = f"{math.ceil(GAP * interval)}s"
    return any(prometheus.query(f"{name}{{{selector}}}[{reach}]", since - 0.001)
               for name in (OWNER, INSTANCE_OWNER))


@dataclass
class _Samples:
    """The raw samples of the job's GPUs and their daemons over the job."""

    owned: dict[Key, set[float]] = field(default_factory=dict)  # the job's owner samples
    scrapes: dict[Target, list[float]] = field(default_factory=dict)  # up == 1
    failed: dict[Target, list[float]] = field(default_factory=dict)  # up == 0
    counters: dict[Key, dict[str, dict[float, float]]] = field(default_factory=dict)
    pending: dict[tuple[Key, str], list[float]] = field(default_factory=dict)
    info: dict[tuple[Key, str], list[tuple[float, str, str]]] = field(default_factory=dict)
    dimensions: dict[str, str] = field(default_factory=dict)


def _fetch(prometheus: Prometheus, gpus: list[Gpu], start: float, end: float,
           interval: float) -> _Samples:
    """Every raw sample of `up` of the GPUs' daemons, and of their starvation counters,
    pending and evidence series, from a scrape before the job's start to its end."""
    reach = f"[{math.ceil(end - start + 2 * GAP * interval)}s]"
    instances = f"instance=~{regex_of([g.instance for g in gpus])}"
    on_job = f"{{{instances}, uuid=~{regex_of([g.uuid for g in gpus])}}}"
    samples = _Samples()
    samples.scrapes, samples.failed = _scrapes(prometheus.query(f"up{{{instances}}}{reach}", end))
    for series in prometheus.query(f"{COUNTER}{on_job}{reach}", end):
        by_cause = samples.counters.setdefault(_gpu(series["metric"]).key, {})
        by_time = by_cause.setdefault(series["metric"]["cause"], {})
        by_time.update((float(t), float(v)) for t, v in series["values"])
    for series in prometheus.query(f"{PENDING}{on_job}{reach}", end):
        times = samples.pending.setdefault(_of(series), [])
        times += sorted(float(t) for t, _ in series["values"])
    for series in prometheus.query(f"{INFO}{on_job}{reach}", end):
        m = series["metric"]
        samples.dimensions[m["cause"]] = m.get("dimension", "")
        first = min(float(t) for t, _ in series["values"])
        samples.info.setdefault(_of(series), []).append(
            (first, m.get("summary", ""), m.get("remedy", "")))
    for times in samples.pending.values():
        times.sort()
    for seen in samples.info.values():
        seen.sort()
    return samples


def _of(series: dict) -> tuple[Key, str]:
    """The GPU (or MIG GPU instance) and cause of a cause family's series."""
    return _gpu(series["metric"]).key, series["metric"]["cause"]


def _scrapes(ups: list[dict]) -> tuple[dict[Target, list[float]], dict[Target, list[float]]]:
    """Per daemon, the times of its successful scrapes and of its failed ones."""
    ok: dict[Target, list[float]] = defaultdict(list)
    failed: dict[Target, list[float]] = defaultdict(list)
    for series in ups:
        target = (series["metric"].get("job", ""), series["metric"].get("instance", ""))
        for t, v in series["values"]:
            (ok if float(v) == 1 else failed)[target].append(float(t))
    return ({t: sorted(v) for t, v in ok.items()}, {t: sorted(v) for t, v in failed.items()})


@cache
def shipped_rules() -> dict[str, tuple[str, str, float]]:
    """{cause: (dimension, remedy, longest evidence window in s)} of the rules gpuwatchd
    ships (gpuwatchd/rules/default.yaml): for a cause no scrape saw firing, and the
    evidence windows, which the daemon does not export."""
    from gpuwatchd.rules.ruleset import load_rules

    return {r.name: (r.spec.dimension, r.remedy, r.expr.max_window)
            for r in load_rules(None).rules}


def _increase(values: dict[float, float], a: float, b: float) -> float:
    """The counter's rise over (a, b]: from 0 where it first appears at b (it is
    exported from 0), all of its value where it fell (the daemon restarted)."""
    after = values.get(b)
    if after is None:
        return 0.0
    before = values.get(a, 0.0)
    return after if after < before else after - before


def _union(rises: list[float], length: float) -> tuple[float, float]:
    """(the time counted for causes that rose by `rises` in one interval of `length`,
    how much more it may have been): the largest rise, exact where one cause's episode
    holds the others'."""
    if not rises:
        return 0.0, 0.0
    most = max(rises)
    return most, max(0.0, min(sum(rises), length) - most)


class _Ledger:
    """Per GPU of the job: its time, the time each cause fired, any cause and any cause
    of each dimension, in seconds; and each cause's first rise on the job's GPUs."""

    def __init__(self, samples: _Samples, gpus: dict[Key, Gpu], interval: float,
                 since: float) -> None:
        self.samples, self.interval, self.since = samples, interval, since
        self.held: dict[Gpu, float] = defaultdict(float)
        self.fired: dict[tuple[Gpu, str], float] = defaultdict(float)
        self.starved: dict[Gpu, float] = defaultdict(float)
        self.by_dimension: dict[tuple[Gpu, str], float] = defaultdict(float)
        self.overlap = 0.0
        self.first: dict[str, tuple[float, Gpu, bool]] = {}  # (at, where, before)
        for key, gpu in gpus.items():
            self.held[gpu] = 0.0
            self._account(gpu, samples.owned.get(key, set()), samples.counters.get(key, {}))

    def dimension(self, cause: str) -> str:
        known = self.samples.dimensions.get(cause)
        return known if known is not None else shipped_rules().get(cause, ("",))[0]

    def _account(self, gpu: Gpu, owned: set[float], counters: dict) -> None:
        scrapes = self.samples.scrapes.get(gpu.target, [])
        for a, b in _pairs(scrapes):
            if b not in owned or b <= self.since or b - a > GAP * self.interval:
                continue
            opening = not self.held[gpu]  # the GPU's first interval of the job's
            self.held[gpu] += b - a
            rises = {c: r for c, values in counters.items() if (r := _increase(values, a, b)) > 0}
            for cause, rise in rises.items():
                self.fired[(gpu, cause)] += rise
                at = max(a, b - rise)
                # the earliest; of GPUs starting together, the first by name, whatever
                # order the store returned their series in (VictoriaMetrics: any)
                first = self.first.get(cause)
                if first is None or (at, _order(gpu)) < (first[0], _order(first[1])):
                    self.first[cause] = (at, gpu, opening and at == a)
            starved, more = _union(list(rises.values()), b - a)
            self.starved[gpu] += starved
            self.overlap += more
            for dimension in {self.dimension(c) for c in rises}:
                part = [r for c, r in rises.items() if self.dimension(c) == dimension]
                self.by_dimension[(gpu, dimension)] += _union(part, b - a)[0]

    def onset(self, cause: str) -> Onset | None:
        if cause not in self.first:
            return None
        at, gpu, before = self.first[cause]
        summary, remedy = self._evidence(gpu, cause, at)
        window = shipped_rules().get(cause, ("", "", 0.0))[2]
        holds = self._holds_since(gpu, cause, at)
        return Onset(at, gpu.node, gpu.device, summary, remedy, holds, window, before)

    def _evidence(self, gpu: Gpu, cause: str, at: float) -> tuple[str, str]:
        """The summary and remedy of the firing that began at `at` on `gpu`, else of the
        cause's first firing seen on the job's GPUs, else the shipped rule's remedy."""
        info = self.samples.info
        seen = [i for i in info.get((gpu.key, cause), []) if i[0] >= at]
        seen = seen or sorted(i for (key, c), found in info.items() if c == cause
                              for i in found if key in {g.key for g in self.held})
        if seen:
            return seen[0][1], seen[0][2]
        return "", shipped_rules().get(cause, ("", "", 0.0))[1]

    def _holds_since(self, gpu: Gpu, cause: str, at: float) -> float:
        """The first of the run of pending samples that led to firing at `at` (`at`
        itself where the rule's `for` was shorter than a scrape interval)."""
        run = [t for t in self.samples.pending.get((gpu.key, cause), []) if t <= at]
        holds = at
        for t in reversed(run):
            if holds - t > GAP * self.interval:
                break
            holds = t
        return holds


def _gaps(samples: _Samples, gpus: dict[Key, Gpu], interval: float) -> list[Gap]:
    """Per node, the stretches of the job between two owner samples over 1.5 scrape
    intervals apart: "scrape failed" where `up` was 0 in it (the node or its daemon did
    not answer), else "no samples" (Prometheus did not scrape: down, or overloaded)."""
    times: dict[str, set[float]] = defaultdict(set)
    targets: dict[str, Target] = {}
    for key, gpu in gpus.items():
        times[gpu.node] |= samples.owned.get(key, set())
        targets.setdefault(gpu.node, gpu.target)
    gaps = []
    for node, owned in sorted(times.items()):
        failed = samples.failed.get(targets[node], [])
        for a, b in _pairs(sorted(owned)):
            if b - a > GAP * interval:
                kind = "scrape failed" if any(a < t < b for t in failed) else "no samples"
                gaps.append(Gap(node, a, b, kind))
    return sorted(gaps, key=lambda g: (g.start, g.node))


def _order(gpu: Gpu) -> tuple[str, str, str]:
    """GPUs by node, then GPU and GPU instance by number."""
    return gpu.node, gpu.gpu.zfill(4), gpu.gpu_instance.zfill(4)


def _assemble(job: str, selector: str, owners: dict, ledger: _Ledger) -> JobReport:
    gpus = sorted(ledger.held, key=_order)
    held = sum(ledger.held.values()) / 3600
    per_cause: dict[str, float] = defaultdict(float)
    for (_, cause), seconds in ledger.fired.items():
        per_cause[cause] += seconds / 3600
    per_dimension: dict[str, float] = defaultdict(float)
    for (_, dimension), seconds in ledger.by_dimension.items():
        per_dimension[dimension] += seconds / 3600
    losses = [
        CauseLoss(
            cause=c,
            dimension=ledger.dimension(c),
            gpu_hours=h,
            share=h / held if held else 0.0,
            gpus=sum(1 for g in gpus if ledger.fired.get((g, c))),
            onset=ledger.onset(c),
        )
        for c, h in per_cause.items()
    ]
    losses.sort(key=lambda loss: (-loss.gpu_hours, loss.cause))
    labels = next(iter(owners.values()))
    return JobReport(
        job=job,
        selector=selector,
        scheduler=labels.get("scheduler", ""),
        user=labels.get("user", ""),
        namespace=labels.get("namespace", ""),
        since=0.0,
        until=0.0,
        start=0.0,
        end=0.0,
        scrape_interval=0.0,
        nodes=sorted({g.node for g in gpus}),
        gpus=len(gpus),
        gpu_hours=held,
        starved_gpu_hours=sum(ledger.starved.values()) / 3600,
        causes=losses,
        dimensions=dict(sorted(per_dimension.items(), key=lambda kv: -kv[1])),
        worst_gpus=_worst(ledger, {_ranked(g): [g] for g in gpus}),
        worst_nodes=_worst(ledger, _by_node(gpus)),
        gaps=[],
        overlap_gpu_hours=ledger.overlap / 3600,
        gpu_instances=sum(1 for g in gpus if g.gpu_instance),
    )


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


def _worst(ledger: _Ledger, groups: dict[str, list[Gpu]]) -> list[Usage]:
    usage = []
    for name, members in groups.items():
        held = sum(ledger.held[g] for g in members) / 3600
        starved = sum(ledger.starved[g] for g in members) / 3600
        lost: dict[str, float] = defaultdict(float)
        for (g, cause), seconds in ledger.fired.items():
            if g in members:
                lost[cause] += seconds
        top = max(lost, key=lambda c: (lost[c], c), default="")
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
    share = report.dimensions.get(dimension, top.gpu_hours) / (report.gpu_hours or 1)
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
