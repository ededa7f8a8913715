"""The status page at `/`: this node, its GPUs, what starves each one now, the sources.

One server-rendered HTML page with inline CSS and no script, readable on a phone, that
reloads itself every `REFRESH_SECONDS`. It is built per request from what the rule
engine, the store and the pollers already hold in memory and never calls a source, so a
hung GPU or a source that is down renders like anything else; the causes that stopped
firing lately come from the transitions the daemon hands it (`record`). Every value that
comes from the node or a rule file is HTML-escaped.
"""

from __future__ import annotations

import html
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd import __version__
from gpuwatchd.metrics import PREFIX
from gpuwatchd.rules.engine import (
    FIRING,
    NOT_EVALUABLE,
    PENDING,
    AlertState,
    RuleEngine,
    Transition,
)
from gpuwatchd.rules.evaluator import GpuRef
from gpuwatchd.rules.ruleset import Rule
from gpuwatchd.scheduler import Poller
from gpuwatchd.store import Store

_INFO, _LOST = PREFIX + "gpu_info", PREFIX + "gpu_lost"
_PID, _JOB, _OWNER = (PREFIX + n for n in ("gpu_process_pid", "gpu_process_job", "gpu_owner_info"))
# the readings dcgm-exporter users look at first, by field of Readings
_READINGS = {
    PREFIX + "gpu_utilization_ratio": "utilization",
    PREFIX + "gpu_temperature_celsius": "temperature",
    PREFIX + "gpu_power_watts": "power",
    PREFIX + "gpu_power_limit_watts": "power_limit",
}
STALL = "nccl_stall"  # its GPUs wait for a culprit rank of the same job
# why a rule reading the in-process probe has no value: normal where no job uses it
NO_PROBE = "needs the in-process probe, which no process on this GPU reports to"
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
REFRESH_SECONDS = 30  # the page reloads itself: a screen left open stays current
RECENT = 20  # resolved causes kept for the page


@dataclass(frozen=True)
class Cause:
    """One rule firing or pending on one GPU."""

    name: str
    dimension: str
    severity: str
    holds_since: float  # when its expression began to hold
    fires_at: float  # holds_since + `for`: when it started (or will start) firing
    summary: str  # the evidence frozen when it started firing; empty while pending
    remedy: str
    instance: str = ""  # on a MIG GPU instance: "GI 3 (1g.10gb)"; "" for the whole GPU
    subject: str = ""  # what it was judged on, as pages name it: "0", "0/3"


@dataclass(frozen=True)
class Where:
    """Where a GPU is and who runs on it: what the on-call types next."""

    bus_id: str = ""  # PCI address
    pid: str = ""  # its main process
    job: str = ""  # the launch its process belongs to (gpu_process_job: a pid)
    owner: str = ""  # the scheduler's job ("slurm job 4242", a pod)

    def text(self) -> str:
        """ "PCI 0000:47:00.0, pid 6004, slurm job 4242" (what is known)."""
        parts = [f"PCI {self.bus_id}"] if self.bus_id else []
        parts += [f"pid {self.pid}"] if self.pid else []
        return ", ".join(parts + ([self.owner] if self.owner else []))


def gpu_places(samples: Iterable[tuple[tuple[str, tuple[str, ...]], float]]) -> dict[str, Where]:
    """Where each GPU is and who runs on it, by uuid, from the latest samples: gpu_info's
    PCI address, the main process and its job, the owner's scheduler job or pod."""
    found: dict[str, dict[str, str]] = {}
    for (name, labels), value in samples:
        if name == _INFO:
            found.setdefault(labels[1], {})["bus_id"] = labels[3]
        elif name in (_PID, _JOB):
            found.setdefault(labels[1], {})["pid" if name == _PID else "job"] = f"{value:.0f}"
        elif name == _OWNER and (labels[3] or labels[8]):  # scheduler, job_id, ..., pod
            owner = f"{labels[2]} job {labels[3]}" if labels[3] else f"pod {labels[7]}/{labels[8]}"
            found.setdefault(labels[1], {})["owner"] = owner
    return {uuid: Where(**fields) for uuid, fields in found.items()}


@dataclass(frozen=True)
class Readings:
    """A GPU's latest utilization, temperature and power; None where not current (its
    source down or stale, or not supported: a MIG GPU has no utilization of its own)."""

    utilization: float | None = None  # 0-1
    temperature: float | None = None  # degrees Celsius
    power: float | None = None  # watts
    power_limit: float | None = None  # watts, the enforced limit


def _gpu_readings(
    samples: Iterable[tuple[tuple[str, tuple[str, ...]], float]],
) -> dict[str, Readings]:
    """Each GPU's Readings by uuid (the whole GPU's series, not an instance's)."""
    found: dict[str, dict[str, float]] = {}
    for (name, labels), value in samples:
        field = _READINGS.get(name)
        if field is not None and len(labels) == 2:  # gpu, uuid
            found.setdefault(labels[1], {})[field] = value
    return {uuid: Readings(**fields) for uuid, fields in found.items()}


@dataclass(frozen=True)
class Gpu:
    index: str
    uuid: str
    model: str
    lost: bool
    firing: tuple[Cause, ...]
    pending: tuple[Cause, ...]
    where: Where = Where()
    readings: Readings = Readings()


@dataclass(frozen=True)
class CauseGroup:
    """One cause firing on one or more GPUs: the page shows it once."""

    name: str
    severity: str
    dimension: str
    gpus: tuple[str, ...]
    summary: str  # the first GPU's evidence
    remedy: str
    waited_for_by: tuple[str, ...] = ()  # GPUs of its job stalled in a collective (culprit)


@dataclass(frozen=True)
class SourceState:
    name: str
    up: bool
    reason: str
    last_success: float | None


@dataclass(frozen=True)
class Unevaluable:
    """A rule that cannot be evaluated, grouped over the GPUs it fails on for one reason."""

    cause: str
    reason: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Resolved:
    """A cause that fired on a GPU and has stopped."""

    gpu: str
    cause: str
    fired_at: float
    resolved_at: float
    summary: str


@dataclass(frozen=True)
class NodeStatus:
    hostname: str
    version: str
    now: float
    gpus: tuple[Gpu, ...]
    sources: tuple[SourceState, ...]
    unevaluable: tuple[Unevaluable, ...]
    rules: str  # how many rules, from where
    rules_reload_ok: bool
    resolved: tuple[Resolved, ...] = ()  # newest first
    groups: tuple[CauseGroup, ...] = ()  # the firing causes, the culprit first


class StatusPage:
    """Callable that returns the page's bytes; the HTTP handler calls it per request."""

    def __init__(
        self,
        store: Store,
        pollers: Sequence[Poller],
        now: Callable[[], float],
        engine: RuleEngine | None = None,
        hostname: str | None = None,
        to_wall: Callable[[float], float] | None = None,
    ) -> None:
        self.store = store
        self.pollers = pollers
        self.now = now  # the pipeline's clock, which steps of the wall clock do not move
        self.to_wall = to_wall  # its times as the wall clock reads now (None: they are)
        self.engine = engine
        self.hostname = hostname or socket.gethostname()
        self._models: dict[str, str] = {}  # by uuid: a lost GPU, or NVML down, keeps its model
        self._firing: dict[tuple[str, str, str], Transition] = {}  # (uuid, GI, cause) -> fired
        self._resolved: deque[Resolved] = deque(maxlen=RECENT)
        self._lock = threading.Lock()  # record() runs in the evaluation loop, pages in the server

    def record(self, transitions: Iterable[Transition]) -> None:
        """Remember when causes started firing, and keep the last RECENT that stopped."""
        with self._lock:
            for t in transitions:
                key = (t.uuid, t.instance, t.cause)
                if t.new == FIRING:
                    self._firing[key] = t
                elif t.old == FIRING and (fired := self._firing.pop(key, None)) is not None:
                    resolved = Resolved(t.where, t.cause, fired.at, t.at, fired.detail)
                    self._resolved.appendleft(resolved)

    def __call__(self) -> bytes:
        return render(self.status()).encode()

    def status(self) -> NodeStatus:
        """What the page shows, read from memory only."""
        steady = self.now()
        # every time shown moves onto today's wall clock; the ages between them stay
        shift = 0.0 if self.to_wall is None else self.to_wall(steady) - steady
        now = steady + shift
        gpus, unevaluable = self._gpus(steady, shift)
        with self._lock:
            resolved = tuple(
                Resolved(r.gpu, r.cause, r.fired_at + shift, r.resolved_at + shift, r.summary)
                for r in self._resolved
            )
        engine = self.engine
        rules = "no rule engine"
        if engine is not None:
            rules = f"{len(engine.rules.rules)} rules from {engine.rules.origin}"
        return NodeStatus(
            hostname=self.hostname,
            version=__version__,
            now=now,
            gpus=gpus,
            sources=tuple(_source_state(p, shift) for p in self.pollers),
            unevaluable=unevaluable,
            rules=rules,
            rules_reload_ok=engine is None or engine.reload_ok,
            resolved=resolved,
            groups=group_causes(gpus),
        )

    def _gpus(self, now: float, shift: float) -> tuple[tuple[Gpu, ...], tuple[Unevaluable, ...]]:
        indexes, lost = self._identities()
        where = self._where()
        # current values only: a reading of a source down is not what the GPU does now
        readings = _gpu_readings(self.store.latest(now))
        # the engine's evaluation thread replaces `rules` and `states` on a reload: read
        # each once, and only with .get, so a concurrent cycle never breaks an iteration
        rules = self.engine.rules.rules if self.engine is not None else ()
        states = self.engine.states if self.engine is not None else {}
        instances = self._instances()
        gpus: list[Gpu] = []
        unevaluable: dict[tuple[str, str], list[str]] = {}
        for uuid, index in sorted(indexes.items(), key=lambda item: (_number(item[1]), item[0])):
            firing, pending = [], []
            for ref in [GpuRef(index, uuid, None), *instances.get(uuid, ())]:
                on, waiting, reasons = _causes(rules, states, ref, now, shift)
                firing += on
                pending += waiting
                for cause, reason in reasons:
                    unevaluable.setdefault((cause, reason), []).append(ref.name)
            model = self._models.get(uuid, "")
            gpu = Gpu(index, uuid, model, uuid in lost, _worst_first(firing),
                      _worst_first(pending), where(uuid),
                      readings.get(uuid, Readings()))  # fmt: skip
            gpus.append(gpu)
        grouped = tuple(Unevaluable(c, r, tuple(g)) for (c, r), g in unevaluable.items())
        return tuple(gpus), grouped

    def _instances(self) -> dict[str, list[GpuRef]]:
        """The MIG GPU instances the engine judges, by their GPU's uuid."""
        out: dict[str, list[GpuRef]] = {}
        if self.engine is not None:
            for ref in list(self.engine.gpus.values()):
                if ref.instance:
                    out.setdefault(ref.uuid, []).append(ref)
        return out

    def _where(self) -> Callable[[str], Where]:
        """A GPU's PCI address, main process, job and owner, by uuid, from the store."""
        store = self.store
        places = gpu_places(s for source in store.sources() for s in store.source_latest(source))
        return lambda uuid: places.get(uuid, Where())

    def _identities(self) -> tuple[dict[str, str], set[str]]:
        """Index by uuid of every GPU known, and the uuids last reported lost.

        Identity is the last one known, stale or not: a source that is down shows as
        down in the sources table, and its GPUs keep their names.
        """
        indexes: dict[str, str] = {}
        if self.engine is not None:  # GPUs once seen stay, lost ones too; copied atomically
            indexes.update((ref.uuid, ref.gpu) for ref in list(self.engine.gpus.values()))
        lost = set()
        for source in self.store.sources():
            for (name, labels), value in self.store.source_latest(source):
                if name == _INFO:  # labels: gpu, uuid, model, ...
                    indexes[labels[1]] = labels[0]
                    self._models[labels[1]] = labels[2]
                elif name == _LOST:
                    indexes[labels[1]] = labels[0]
                    if value:
                        lost.add(labels[1])
        return indexes, lost


def _causes(
    rules: Sequence[Rule],
    states: Mapping[tuple[str, str], AlertState],
    ref: GpuRef,
    now: float,
    shift: float,
) -> tuple[list[Cause], list[Cause], list[tuple[str, str]]]:
    """One GPU's (or MIG GPU instance's) firing and pending causes (their times `shift`ed
    onto the wall clock), and its unevaluable rules."""
    firing: list[Cause] = []
    pending: list[Cause] = []
    unevaluable: list[tuple[str, str]] = []
    for rule in rules:
        state = states.get((ref.id, rule.name))
        if state is None:
            continue
        kind = state.state
        if kind == FIRING:
            firing.append(_cause(rule, state, now, shift, ref))
        elif kind == PENDING:
            pending.append(_cause(rule, state, now, shift, ref))
        elif kind == NOT_EVALUABLE:
            reason = NO_PROBE if state.waits_for_probe else state.reason
            unevaluable.append((rule.name, reason))
    return firing, pending, unevaluable


def _cause(rule: Rule, state: AlertState, now: float, shift: float, ref: GpuRef) -> Cause:
    spec = rule.spec
    active_at = state.active_at  # once: the evaluation thread may be between two writes
    holds_since = (now if active_at is None else active_at) + shift
    return Cause(
        name=spec.name,
        dimension=spec.dimension,
        severity=spec.severity,
        holds_since=holds_since,
        fires_at=holds_since + spec.for_,  # the engine fires on the first cycle after this
        summary=state.summary,
        remedy=" ".join(spec.remedy.split()),
        instance=f"GI {ref.instance} ({ref.profile})" if ref.instance else "",
        subject=ref.name,
    )


def group_causes(gpus: Sequence[Gpu]) -> tuple[CauseGroup, ...]:
    """Each firing cause once, over the GPUs it fires on. A cause on a GPU whose job has
    other GPUs stalled in a collective is the rank they wait for: it comes first, then the
    worst severity, then the most GPUs."""
    by_cause: dict[str, list[tuple[Gpu, Cause]]] = {}
    for gpu in gpus:
        for cause in gpu.firing:  # once per GPU, or per MIG instance it fires on
            by_cause.setdefault(cause.name, []).append((gpu, cause))
    stalled = [gpu for gpu, _ in by_cause.get(STALL, [])]
    groups = []
    for name, hit in by_cause.items():
        first = hit[0][1]
        on = [gpu for gpu, _ in hit]
        jobs = {gpu.where.job for gpu in on if gpu.where.job} if name != STALL else set()
        waiting = tuple(g.index for g in stalled if g.where.job in jobs and g not in on)
        subjects = tuple(cause.subject or gpu.index for gpu, cause in hit)
        groups.append(
            CauseGroup(
                name,
                first.severity,
                first.dimension,
                subjects,
                first.summary,
                first.remedy,
                waiting,
            )  # fmt: skip
        )
    return tuple(sorted(groups, key=_group_order))


def _group_order(group: CauseGroup) -> tuple[bool, int, int]:
    return (not group.waited_for_by, _SEVERITY_RANK.get(group.severity, 3), -len(group.gpus))


def _worst_first(causes: list[Cause]) -> tuple[Cause, ...]:
    return tuple(sorted(causes, key=lambda c: _SEVERITY_RANK.get(c.severity, 3)))


def _source_state(poller: Poller, shift: float) -> SourceState:
    health = poller.health
    last = health.last_success
    return SourceState(
        poller.name, health.up, health.last_error or "", None if last is None else last + shift
    )


def _number(index: str) -> int:
    return int(index) if index.isdigit() else 1 << 30


# rendering ----------------------------------------------------------------------------

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="{refresh}">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
</body>
</html>
"""

STYLE = """
:root { --ok: #1e7b34; --critical: #b3261e; --warning: #a35200; --info: #2a5db0;
  --muted: #5f6368; --line: #dadce0; --card: #fff; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 72rem; padding: 1rem; color: #202124; background: #f6f7f9;
  font: 16px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
h1 { margin: 0; font-size: 1.5rem; overflow-wrap: anywhere; }
h2 { margin: 1.5rem 0 .5rem; font-size: 1.15rem; }
h3 { margin: 0; font-size: 1.05rem; display: flex; justify-content: space-between;
  align-items: center; gap: .5rem; }
h4 { margin: 0 .4rem 0 0; font-size: 1rem; display: inline; overflow-wrap: anywhere; }
a { color: #1a57b8; }
p { margin: .3rem 0; }
code, .uuid { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace;
  font-size: .85em; overflow-wrap: anywhere; }
.meta, .muted, .uuid { color: var(--muted); }
.verdict { margin: 1rem 0; padding: .75rem 1rem; border-radius: 6px; color: #fff;
  background: var(--ok); font-weight: 600; }
.verdict.critical { background: var(--critical); }
.verdict.warning { background: var(--warning); }
.verdict a { color: inherit; }
.verdict .note { font-weight: 400; }
.gpus { display: grid; gap: .75rem; grid-template-columns: repeat(auto-fill, minmax(17rem, 1fr)); }
.gpu { background: var(--card); border: 1px solid var(--line); border-left: 6px solid var(--ok);
  border-radius: 6px; padding: .75rem 1rem; min-width: 0; }
.gpu.starved { grid-column: 1 / -1; }
.gpu.critical, .gpu.lost { border-left-color: var(--critical); }
.gpu.warning { border-left-color: var(--warning); }
.gpu.info { border-left-color: var(--info); }
.cause { margin-top: .75rem; padding-top: .6rem; border-top: 1px solid var(--line); }
.group { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  border-left: 6px solid var(--info); padding: .75rem 1rem; margin-bottom: .75rem; }
.group.critical { border-left-color: var(--critical); }
.group.warning { border-left-color: var(--warning); }
.where { color: var(--muted); font-size: .9rem; overflow-wrap: anywhere; }
.readings { font-variant-numeric: tabular-nums; }
.readings span { white-space: nowrap; }
.when { color: var(--muted); font-size: .9rem; }
.remedy { padding: .4rem .6rem; background: #f1f3f4; border-radius: 4px; }
.pending { margin-top: .6rem; font-size: .9rem; }
.badge { display: inline-block; padding: 0 .45rem; border-radius: 3px; font-size: .8rem;
  font-weight: 600; line-height: 1.6; color: #fff; background: var(--muted);
  vertical-align: middle; }
.badge.ok, .badge.up { background: var(--ok); }
.badge.critical, .badge.down, .badge.lost, .badge.starved { background: var(--critical); }
.badge.warning, .badge.pending { background: var(--warning); }
.badge.info { background: var(--info); }
.scroll { overflow-x: auto; }
table { width: 100%; border-collapse: collapse; background: var(--card); }
th, td { padding: .4rem .6rem; border-bottom: 1px solid var(--line); text-align: left;
  vertical-align: top; }
.reason { width: 50%; overflow-wrap: anywhere; }
details { margin-top: .5rem; }
footer { margin: 2rem 0 1rem; color: var(--muted); font-size: .85rem; }
@media (max-width: 40rem) {
  body { padding: .6rem; }
  .gpu { padding: .6rem .75rem; }
  th, td { padding: .35rem .4rem; }
}
"""


def render(node: NodeStatus) -> str:
    starved = sum(1 for gpu in node.gpus if gpu.firing)
    title = f"{node.hostname}: {starved} starved" if starved else f"{node.hostname}: ok"
    body = "\n".join(
        (
            _header(node),
            _verdict(node),
            _cause_groups(node),
            _gpu_grid(node),
            _unevaluable(node),
            _resolved(node),
            _sources_table(node),
            _footer(node),
        )
    )
    return PAGE.format(
        title=_e(f"{title} · gpuwatchd"), style=STYLE, body=body, refresh=REFRESH_SECONDS
    )


def _header(node: NodeStatus) -> str:
    return (
        f'<header><h1 id="hostname">{_e(node.hostname)}</h1>'
        f'<p class="meta">gpuwatchd <span id="version">{_e(node.version)}</span> · rendered '
        f"{_time(node.now, full=True)} · "
        '<a href="/metrics">/metrics</a> · <a href="/healthz">/healthz</a></p></header>'
    )


def _verdict(node: NodeStatus) -> str:
    """One line a person reads first: which GPUs starve on what, or that none does."""
    starved = [gpu for gpu in node.gpus if gpu.firing]
    pending = sum(len(gpu.pending) for gpu in node.gpus)
    down = [s.name for s in node.sources if not s.up]
    notes = [f"{_count(pending, 'cause')} pending"] if pending else []
    notes += [f"source {', '.join(down)} down"] if down else []
    level = "warning" if down else ""
    if not node.gpus:
        text = "No GPU seen"
    elif not starved:
        text = f"No GPU starved ({_count(len(node.gpus), 'GPU')})"
    else:
        links = "; ".join(
            f'<a href="#cause-{_e(g.name)}">{_e(g.name)}</a> on {_gpu_list(g.gpus)}'
            + (" (the rank the others wait for)" if g.waited_for_by else "")
            for g in node.groups
        )
        text = f"{len(starved)} of {_count(len(node.gpus), 'GPU')} starved: {links}"
        level = _worst(c for gpu in starved for c in gpu.firing)
    note = f' <span class="note">({_e("; ".join(notes))})</span>' if notes else ""
    return f'<p id="verdict" class="verdict {_e(level)}">{text}{note}</p>'


def _gpu_list(indexes: Sequence[str], links: bool = False) -> str:
    """ "GPU 3", "GPUs 0, 1, 2" (each a link to its card, with `links`)."""
    shown = (  # an instance "0/3" links to its GPU's card
        f'<a href="#gpu-{_e(i.partition("/")[0])}">{_e(i)}</a>' if links else _e(i) for i in indexes
    )
    return ("GPU " if len(indexes) == 1 else "GPUs ") + ", ".join(shown)


def _cause_groups(node: NodeStatus) -> str:
    """Each firing cause once, the culprit first: seven GPUs spinning in one hung
    collective are one cause, and the rank they wait for leads."""
    if not node.groups:
        return ""
    cards = "\n".join(_cause_group(group) for group in node.groups)
    return f'<section id="causes"><h2>Causes</h2>\n{cards}\n</section>'


def _cause_group(group: CauseGroup) -> str:
    culprit = ""
    if group.waited_for_by:
        culprit = (
            '<p class="culprit"><span class="badge critical">culprit</span> its job\'s '
            f"{_gpu_list(group.waited_for_by, links=True)} wait in a collective for this "
            "rank</p>"
        )
    return (
        f'<article class="group {_e(group.severity)}" id="cause-{_e(group.name)}">'
        f"<h3><span>{_e(group.name)}</span> <span>{_gpu_list(group.gpus, links=True)}</span></h3>"
        f'<span class="badge {_e(group.severity)}">{_e(group.severity)}</span> '
        f'<span class="badge dimension">{_e(group.dimension)}</span>{culprit}'
        f'<p class="summary">{_prose(group.summary)}</p>'
        f'<p class="remedy"><strong>Remedy:</strong> {_prose(group.remedy)}</p></article>'
    )


def _gpu_grid(node: NodeStatus) -> str:
    shared = {g.name for g in node.groups if len(g.gpus) > 1}
    cards = "\n".join(_gpu_card(gpu, node.now, shared) for gpu in node.gpus)
    return f'<section id="gpus"><h2>GPUs</h2><div class="gpus">\n{cards}\n</div></section>'


def _gpu_card(gpu: Gpu, now: float, shared: set[str]) -> str:
    state = "lost" if gpu.lost else "starved" if gpu.firing else "ok"
    level = _worst(gpu.firing) if gpu.firing else ""
    model = _e(gpu.model) if gpu.model else '<span class="muted">model unknown</span>'
    parts = [
        f'<section class="gpu {state} {_e(level)}" id="gpu-{_e(gpu.index)}">',
        f'<h3><span>GPU {_e(gpu.index)}</span><span class="badge {state}">{state}</span></h3>',
        f'<p class="model">{model}</p><p class="uuid">{_e(gpu.uuid)}</p>{_where(gpu.where)}',
        _readings(gpu),
        *(_firing(gpu, cause, now, cause.name in shared) for cause in gpu.firing),
        *(_pending(cause, now) for cause in gpu.pending),
        "</section>",
    ]
    return "".join(parts)


def _where(where: Where) -> str:
    """PCI address, process, job and owner: where to look, and whose it is."""
    parts = [f"PCI <code>{_e(where.bus_id)}</code>"] if where.bus_id else []
    parts += [f"pid {_e(where.pid)}"] if where.pid else []
    parts += [f"job of pid {_e(where.job)}"] if where.job and where.job != where.pid else []
    parts += [_e(where.owner)] if where.owner else []
    return f'<p class="where">{" · ".join(parts)}</p>' if parts else ""


def _readings(gpu: Gpu) -> str:
    """Utilization, temperature, power (of its limit), as nvidia-smi shows them."""
    r = gpu.readings
    parts = [] if r.utilization is None else [f"utilization {r.utilization * 100:.0f}%"]
    parts += [] if r.temperature is None else [f"{r.temperature:.0f} °C"]
    if r.power is not None:
        limit = "" if r.power_limit is None else f" of {r.power_limit:.0f} W"
        parts.append(f"power {r.power:.0f} W{limit}")
    # a line breaks between readings, never inside one
    shown = " · ".join(f"<span>{part}</span>" for part in parts)
    text = shown or '<span class="muted">no current readings</span>'
    return f'<p class="readings" id="readings-{_e(gpu.index)}">{text}</p>'


def _firing(gpu: Gpu, cause: Cause, now: float, shared: bool) -> str:
    """A cause on the GPU: its own evidence; the remedy here, or with the cause's group
    where it fires on other GPUs too."""
    remedy = (
        f'<p class="remedy"><a href="#cause-{_e(cause.name)}">Remedy with the cause</a></p>'
        if shared
        else f'<p class="remedy"><strong>Remedy:</strong> {_prose(cause.remedy)}</p>'
    )
    where = (cause.subject or gpu.index).replace("/", "-gi")  # GPU 0/3: "0-gi3"
    anchor = f"gpu-{where}-{cause.name}"
    return (
        f'<article class="cause firing" id="{_e(anchor)}">'
        f"<h4>{_e(cause.name)}{_on(cause)}</h4>{_badges(cause)}"
        f'<p class="when">firing for {_duration(now - cause.fires_at)}, since '
        f"{_time(cause.fires_at)}</p>"
        f'<p class="summary">{_prose(cause.summary)}</p>{remedy}</article>'
    )


def _pending(cause: Cause, now: float) -> str:
    return (
        f'<p class="pending" data-cause="{_e(cause.name)}"><span class="badge pending">pending'
        f"</span> <strong>{_e(cause.name)}</strong>{_on(cause)} {_badges(cause)} "
        f'<span class="when">holds since {_time(cause.holds_since)}, fires after '
        f"{_time(cause.fires_at)} if it still holds</span></p>"
    )


def _on(cause: Cause) -> str:
    """The MIG GPU instance a cause is on, if it is on one."""
    return f' <span class="instance">on {_e(cause.instance)}</span>' if cause.instance else ""


def _badges(cause: Cause) -> str:
    return (
        f'<span class="badge {_e(cause.severity)}">{_e(cause.severity)}</span> '
        f'<span class="badge dimension">{_e(cause.dimension)}</span>'
    )


def _unevaluable(node: NodeStatus) -> str:
    """Rules that cannot say yes or no: a GPU shown ok may be ok only as far as we can see.
    Those waiting for the probe are listed apart: not a fault where no job uses it."""
    faults = [u for u in node.unevaluable if u.reason != NO_PROBE]
    waiting = sorted({u.cause for u in node.unevaluable if u.reason == NO_PROBE})
    parts = []
    if faults:
        items = "".join(
            f"<li><strong>{_e(u.cause)}</strong> on GPU {_e(', '.join(u.gpus))}: "
            f"{_e(u.reason)}</li>"
            for u in faults
        )
        rules = _count(len({u.cause for u in faults}), "rule")
        parts.append(
            f'<details id="unevaluable"><summary>{rules} could not be evaluated: why'
            f"</summary><ul>{items}</ul></details>"
        )
    if waiting:
        parts.append(
            f'<p id="probe-rules" class="muted">{_e(", ".join(waiting))}: read the in-process '
            "probe, which no process reports to here (docs/probe.md)</p>"
        )
    return "".join(parts)


def _resolved(node: NodeStatus) -> str:
    """The causes that stopped firing lately: what happened while nobody looked."""
    if not node.resolved:
        return ""
    items = "".join(
        f"<li><strong>{_e(r.cause)}</strong> on GPU {_e(r.gpu)}: fired {_time(r.fired_at)} for "
        f"{_duration(r.resolved_at - r.fired_at)}, resolved {_duration(node.now - r.resolved_at)}"
        f' ago <span class="muted">({_prose(r.summary)})</span></li>'
        for r in node.resolved
    )
    return f'<section id="resolved"><h2>Recently resolved</h2><ul>{items}</ul></section>'


def _sources_table(node: NodeStatus) -> str:
    rows = "".join(_source_row(source, node.now) for source in node.sources)
    return (
        '<section id="sources"><h2>Sources</h2><div class="scroll"><table>'
        '<thead><tr><th>source</th><th>state</th><th class="reason">reason</th>'
        "<th>last success</th></tr>"
        f"</thead><tbody>{rows}</tbody></table></div></section>"
    )


def _source_row(source: SourceState, now: float) -> str:
    state = "up" if source.up else "down"
    last = "never" if source.last_success is None else f"{_duration(now - source.last_success)} ago"
    return (
        f'<tr id="source-{_e(source.name)}"><td>{_e(source.name)}</td>'
        f'<td><span class="badge {state}">{state}</span></td>'
        f'<td class="reason">{_e(source.reason)}</td><td>{last}</td></tr>'
    )


def _footer(node: NodeStatus) -> str:
    reload = "" if node.rules_reload_ok else " · <strong>the last rule reload failed</strong>"
    return f'<footer id="rules">{_e(node.rules)}{reload}</footer>'


def _worst(causes: Iterable[Cause]) -> str:
    return min((c.severity for c in causes), key=lambda s: _SEVERITY_RANK.get(s, 3))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _prose(text: str) -> str:
    """Escaped text with the rule files' `backticks` shown as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))


def _time(t: float, full: bool = False) -> str:
    stamp = time.gmtime(t)
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", stamp)
    shown = time.strftime("%Y-%m-%d %H:%M:%S UTC" if full else "%H:%M:%S UTC", stamp)
    return f'<time datetime="{iso}">{shown}</time>'


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"
