"""The rules engine: each rule on each GPU each cycle, Prometheus-style state, reloads.

State per (GPU, rule), as Prometheus' alerting rules keep it: `inactive` -> `pending`
when the expression first holds (`active_at`), -> `firing` on the first evaluation at
least `for` after `active_at` (at once when `for` is 0). A pending rule whose expression
stops holding goes back to inactive. A firing rule whose expression stops holding keeps
firing until `keep_firing_for` has passed since the first evaluation that did not hold,
then resolves to inactive; holding again meanwhile cancels that countdown. A rule whose
inputs are absent (a source it reads is disabled or down, or a series it needed has no
value for the GPU) is `not_evaluable`: never firing, never healthy, and its pending or
firing state is dropped. Time is the pipeline's clock (virtual in `simulate`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.exposition import Rows
from gpuwatchd.metrics import GPU_LABELS, PREFIX, MetricSpec, counter, gauge
from gpuwatchd.rules.language import (
    GPU,
    PCIE,
    Catalog,
    Evaluator,
    GpuRef,
    Missing,
    Snapshot,
)
from gpuwatchd.rules.ruleset import Rule, RulesError, RuleSet, load_rules
from gpuwatchd.store import Store

log = logging.getLogger(__name__)

INACTIVE, PENDING, FIRING, NOT_EVALUABLE = "inactive", "pending", "firing", "not_evaluable"

ACTIVE = gauge(
    "starvation_active",
    "1 while the cause fires on the GPU, else 0; a series for every GPU and rule.",
    (*GPU_LABELS, "cause", "dimension", "severity"),
)
INFO = gauge(
    "starvation_info",
    "1 while the cause fires: the evidence frozen when it started firing, and the remedy "
    "(a series per firing cause, so alerts can carry them).",
    (*GPU_LABELS, "cause", "dimension", "severity", "summary", "remedy"),
)
PENDING_METRIC = gauge(
    "starvation_pending",
    "1 while the cause's expression holds but its `for` has not passed yet.",
    (*GPU_LABELS, "cause"),
)
NOT_EVALUABLE_METRIC = gauge(
    "starvation_not_evaluable",
    "1 while the rule cannot be evaluated on the GPU (an input it needs is absent).",
    (*GPU_LABELS, "cause"),
)
SECONDS = counter(
    "starvation_seconds_total", "Time the cause has fired on the GPU.", (*GPU_LABELS, "cause")
)
STARVED = gauge("gpu_starved", "1 while any cause fires on the GPU.", GPU_LABELS)
ERRORS = counter(
    "rule_evaluation_errors_total",
    "Evaluations of the rule that failed with an error (not: inputs absent).",
    ("cause",),
)
RELOAD_OK = gauge(
    "rules_last_reload_successful", "1 if the last load of the rule file succeeded, else 0."
)
RELOAD_TIME = gauge(
    "rules_last_reload_success_timestamp_seconds", "When the rule file was last loaded."
)
RULES = gauge("rules", "Rules in use (the last good rule file).")
DURATION = gauge(
    "rules_evaluation_duration_seconds", "CPU time of the last rules evaluation cycle."
)

RULE_METRICS: tuple[MetricSpec, ...] = (
    ACTIVE,
    INFO,
    PENDING_METRIC,
    NOT_EVALUABLE_METRIC,
    SECONDS,
    STARVED,
    ERRORS,
    RELOAD_OK,
    RELOAD_TIME,
    RULES,
    DURATION,
)

_INFO = PREFIX + "gpu_info"
_LOST = PREFIX + "gpu_lost"


@dataclass
class AlertState:
    state: str = INACTIVE
    active_at: float | None = None
    keep_firing_since: float | None = None
    seconds_total: float = 0.0
    reason: str = ""  # why not evaluable
    summary: str = ""


@dataclass(frozen=True)
class Finding:
    """One rule on one GPU, evaluated once (`diagnose`): no `for`, no state."""

    gpu: str
    uuid: str
    cause: str
    dimension: str
    severity: str
    status: str  # HOLDS, NOT_HOLDING or NOT_EVALUABLE
    detail: str  # the evidence summary, or why the rule could not be evaluated
    remedy: str


HOLDS, NOT_HOLDING = "holds", "does_not_hold"


@dataclass(frozen=True)
class Transition:
    at: float
    gpu: str
    uuid: str
    cause: str
    old: str
    new: str
    detail: str  # the summary when firing, the reason when not evaluable


class RuleEngine:
    """Evaluates a RuleSet against the store; holds the state and the derived series."""

    def __init__(
        self,
        store: Store,
        rules: RuleSet,
        source_up: Callable[[str], bool],
        catalog: Catalog,
    ) -> None:
        self.store = store
        self.rules = rules
        self.source_up = source_up
        self.catalog = catalog
        self.evaluator = Evaluator(store.window)
        self.gpus: dict[str, GpuRef] = {}  # by uuid; a GPU once seen stays (lost GPUs too)
        self.states: dict[tuple[str, str], AlertState] = {}  # (uuid, cause)
        self.errors: dict[str, int] = defaultdict(int)
        self.last_eval: float | None = None
        self.duration = 0.0
        self.reload_ok = True
        self.reload_time: float | None = None
        self._scope = {f.spec.name: f.scope for f in catalog.families.values()}
        self._wanted: dict[str, str] = {}
        self.set_rules(rules)

    def set_rules(self, rules: RuleSet) -> None:
        """Use `rules` from now on; rules kept by name keep their state."""
        names = {r.name for r in rules.rules}
        self.states = {k: v for k, v in self.states.items() if k[1] in names}
        self.rules = rules
        # the families the snapshot indexes: what the rules read, and the GPUs' identity
        wanted = {_INFO, _LOST, PREFIX + "gpu_process_pid"}
        for rule in rules.rules:
            for compiled in (rule.expr, *(c for _, c in rule.summary if c is not None)):
                wanted.update(s.family.spec.name for s in compiled.selectors)
        self._wanted = {name: self._scope[name] for name in wanted}

    # one cycle --------------------------------------------------------------------
    def _snapshot(self, now: float) -> Snapshot:
        snap = Snapshot(now)
        wanted = self._wanted
        for (name, labels), value in self.store.latest(now):
            scope = wanted.get(name)
            if scope is None:
                continue
            if scope == GPU:
                snap.per_gpu.setdefault(name, {}).setdefault((labels[0], labels[1]), []).append(
                    (labels, value)
                )
                if name in (_INFO, _LOST):
                    gpu = self.gpus.get(labels[1])
                    bus = labels[3] if name == _INFO else (gpu.bus_id if gpu else None)
                    if gpu is None or gpu.gpu != labels[0] or gpu.bus_id != bus:
                        self.gpus[labels[1]] = GpuRef(labels[0], labels[1], bus)
            elif scope == PCIE:
                snap.per_bus.setdefault(name, {}).setdefault(labels[0], []).append((labels, value))
            else:
                snap.host.setdefault(name, []).append((labels, value))
        return snap

    def evaluate(self, now: float) -> list[Transition]:
        """Evaluate every rule on every GPU at `now`; the state changes it made."""
        started = time.thread_time()
        snapshot = self._snapshot(now)
        gpus = sorted(self.gpus.values(), key=lambda g: (_index(g.gpu), g.uuid))
        self.evaluator.begin(snapshot, gpus)
        dt = 0.0 if self.last_eval is None else max(0.0, now - self.last_eval)
        transitions: list[Transition] = []
        down_cache: dict[frozenset[str], list[str]] = {}
        for rule in self.rules.rules:
            sources = rule.expr.sources
            down = down_cache.get(sources)
            if down is None:
                down = down_cache[sources] = sorted(s for s in sources if not self.source_up(s))
            for gpu in gpus:
                key = (gpu.uuid, rule.name)
                state = self.states.get(key)
                if state is None:
                    state = self.states[key] = AlertState()
                old = state.state
                if state.state == FIRING:
                    state.seconds_total += dt
                self._step(rule, gpu, state, now, down)
                if state.state != old:
                    detail = state.summary if state.state == FIRING else state.reason
                    transitions.append(
                        Transition(now, gpu.gpu, gpu.uuid, rule.name, old, state.state, detail)
                    )
        self.last_eval = now
        self.duration = time.thread_time() - started
        return transitions

    def diagnose(self, now: float) -> list[Finding]:
        """Evaluate every rule on every GPU once at `now`, ignoring `for` (doctor).

        The alerting state (pending, firing, seconds, errors) is neither read nor changed.
        """
        snapshot = self._snapshot(now)
        gpus = sorted(self.gpus.values(), key=lambda g: (_index(g.gpu), g.uuid))
        self.evaluator.begin(snapshot, gpus)
        findings = []
        for gpu in gpus:
            for rule in self.rules.rules:
                spec = rule.spec
                down = sorted(s for s in rule.expr.sources if not self.source_up(s))
                status, detail = NOT_EVALUABLE, ""
                if down:
                    detail = f"source {', '.join(down)} down or disabled"
                else:
                    try:
                        holds = bool(self.evaluator.evaluate(rule.expr, gpu))
                    except Missing as e:
                        detail = f"no value for {e}"
                    except Exception as e:
                        detail = f"error: {type(e).__name__}: {e}"
                    else:
                        status = HOLDS if holds else NOT_HOLDING
                        detail = self.summary(rule, gpu)
                findings.append(
                    Finding(
                        gpu.gpu,
                        gpu.uuid,
                        rule.name,
                        spec.dimension,
                        spec.severity,
                        status,
                        detail,
                        rule.remedy,
                    )
                )
        return findings

    def _step(
        self, rule: Rule, gpu: GpuRef, state: AlertState, now: float, down: list[str]
    ) -> None:
        if down:
            self._not_evaluable(state, f"source {', '.join(down)} down or disabled")
            return
        try:
            holds = bool(self.evaluator.evaluate(rule.expr, gpu))
        except Missing as e:
            self._not_evaluable(state, f"no value for {e}")
            return
        except Exception as e:  # a rule must never stop the others
            self.errors[rule.name] += 1
            reason = f"error: {type(e).__name__}: {e}"
            if state.reason != reason:
                log.warning("rule %s on GPU %s: %s", rule.name, gpu.gpu, reason)
            self._not_evaluable(state, reason)
            return
        state.reason = ""
        spec = rule.spec
        old = state.state
        if holds:
            state.keep_firing_since = None
            if state.state in (INACTIVE, NOT_EVALUABLE):
                state.state, state.active_at = PENDING, now
            active_at = now if state.active_at is None else state.active_at
            if state.state == PENDING and now - active_at >= spec.for_:
                state.state = FIRING
        elif state.state == FIRING:
            if state.keep_firing_since is None:
                state.keep_firing_since = now
            if now - state.keep_firing_since >= spec.keep_firing_for:
                state.state, state.active_at, state.keep_firing_since = INACTIVE, None, None
        else:
            state.state, state.active_at = INACTIVE, None
        if state.state == FIRING and old != FIRING:
            state.summary = self.summary(rule, gpu)  # the evidence when it started firing

    @staticmethod
    def _not_evaluable(state: AlertState, reason: str) -> None:
        state.state, state.reason = NOT_EVALUABLE, reason
        state.active_at = state.keep_firing_since = None

    def summary(self, rule: Rule, gpu: GpuRef) -> str:
        parts = []
        for text, value in rule.summary:
            parts.append(text)
            if value is not None:
                try:
                    parts.append(_format(self.evaluator.evaluate(value, gpu)))
                except Exception:  # evidence is best effort
                    parts.append("?")
        return " ".join("".join(parts).split())

    # what the exporter shows --------------------------------------------------------
    def rows(self) -> dict[str, Rows]:
        out: dict[str, Rows] = defaultdict(list)
        for gpu in self.gpus.values():
            starved = 0.0
            for rule in self.rules.rules:
                state = self.states.get((gpu.uuid, rule.name)) or AlertState()
                base = (gpu.gpu, gpu.uuid, rule.name)
                firing = float(state.state == FIRING)
                starved = max(starved, firing)
                spec = rule.spec
                out[ACTIVE.name].append(((*base, spec.dimension, spec.severity), firing))
                if firing:
                    labels = (*base, spec.dimension, spec.severity, state.summary, rule.remedy)
                    out[INFO.name].append((labels, 1.0))
                out[PENDING_METRIC.name].append((base, float(state.state == PENDING)))
                out[NOT_EVALUABLE_METRIC.name].append((base, float(state.state == NOT_EVALUABLE)))
                out[SECONDS.name].append((base, state.seconds_total))
            out[STARVED.name].append(((gpu.gpu, gpu.uuid), starved))
        for rule in self.rules.rules:
            out[ERRORS.name].append(((rule.name,), float(self.errors.get(rule.name, 0))))
        out[RELOAD_OK.name].append(((), float(self.reload_ok)))
        if self.reload_time is not None:
            out[RELOAD_TIME.name].append(((), self.reload_time))
        out[RULES.name].append(((), float(len(self.rules.rules))))
        out[DURATION.name].append(((), self.duration))
        return out

    def firing(self) -> list[tuple[str, str, str]]:
        """(gpu, cause, summary) of every firing cause, by GPU then rule order."""
        rules = {r.name: (i, r) for i, r in enumerate(self.rules.rules)}
        order = {name: i for name, (i, _) in rules.items()}
        result = []
        for (uuid, cause), state in self.states.items():
            if state.state == FIRING and uuid in self.gpus and cause in rules:
                gpu = self.gpus[uuid]
                result.append((gpu.gpu, cause, self.summary(rules[cause][1], gpu)))
        return sorted(result, key=lambda r: (_index(r[0]), order.get(r[1], 0)))


def _index(gpu: str) -> int:
    return int(gpu) if gpu.isdigit() else 1 << 30


def _format(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.3g}"


class RuleFileWatcher:
    """Loads the rule file; reloads on request (SIGHUP) or when the file changes.

    A file that fails to load keeps the last good rules running, logs every problem,
    and sets `gpuwatchd_rules_last_reload_successful` to 0 until a good load.
    """

    def __init__(self, engine: RuleEngine, path: Path | None, now: Callable[[], float]) -> None:
        self.engine = engine
        self.path = path
        self.now = now
        self._stamp = self._file_stamp()
        self._requested = False
        engine.reload_time = now()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def request(self) -> None:
        """Reload at the next check (safe to call from a signal handler)."""
        self._requested = True

    def check(self) -> bool | None:
        """Reload if requested or the file changed: True/False = loaded/failed, None = no."""
        stamp = self._file_stamp()
        if not self._requested and stamp == self._stamp:
            return None
        self._requested = False
        self._stamp = stamp
        try:
            rules = load_rules(self.path, self.engine.catalog)
        except RulesError as e:
            self.engine.reload_ok = False
            log.error(
                "rules: reload of %s failed, keeping the last good rules (%d):\n%s",
                self.path or "the default rules",
                len(self.engine.rules.rules),
                e,
            )
            return False
        self.engine.set_rules(rules)
        self.engine.reload_ok = True
        self.engine.reload_time = self.now()
        log.info("rules: loaded %d rules from %s", len(rules.rules), rules.origin)
        return True
