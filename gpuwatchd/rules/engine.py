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

A rule is evaluated again on a GPU only when what its last evaluation read may have
changed (`evaluator.Reads`): the rows of a series it looked up, a window that gained or
lost a point, time(). Otherwise its last outcome stands and only the state machine runs,
so `for` and `keep_firing_for` advance with the clock exactly as if it had been.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.exposition import Rows
from gpuwatchd.metrics import GPU_LABELS, PREFIX, MetricSpec, counter, gauge
from gpuwatchd.rules.evaluator import Evaluator, GpuRef, Reads, format_value, subject_name
from gpuwatchd.rules.language import PEER_GROUPING, Catalog, Missing, OverBudget, Selector
from gpuwatchd.rules.ruleset import Rule, RulesError, RuleSet, load_rules
from gpuwatchd.rules.snapshot import Changed, LiveIndex
from gpuwatchd.rules.timing import TIME_HORIZON
from gpuwatchd.store import Store

log = logging.getLogger(__name__)

INACTIVE, PENDING, FIRING, NOT_EVALUABLE = "inactive", "pending", "firing", "not_evaluable"
UNKNOWN = "unknown"  # a summary's value that had none (never "?" on a page)

# The cause families are sparse (issue 24): a GPU x rule series exists only while it is
# in that state (a healthy node exports none), the counter from the cause's first
# pending on. Every series is paid for by every node's Prometheus.
ACTIVE = gauge(
    "starvation_active",
    "1 while the cause fires on the GPU (on a MIG GPU instance: gpu_instance its GI id, "
    "else empty); absent otherwise.",
    (*GPU_LABELS, "cause", "dimension", "severity", "gpu_instance"),
    budget=0,
)
INFO = gauge(
    "starvation_info",
    "1 while the cause fires: the evidence frozen when it started firing, and the remedy "
    "(a series per firing cause, so alerts can carry them).",
    (*GPU_LABELS, "cause", "dimension", "severity", "summary", "remedy", "gpu_instance"),
    budget=0,
)
PENDING_METRIC = gauge(
    "starvation_pending",
    "1 while the cause's expression holds but its `for` has not passed yet; absent otherwise.",
    (*GPU_LABELS, "cause", "gpu_instance"),
    budget=0,
)
NOT_EVALUABLE_METRIC = gauge(
    "starvation_not_evaluable",
    "1 while the rule cannot be evaluated on the GPU (an input it needs is absent; not "
    "shown for a rule that only lacks the in-process probe's reports); absent otherwise.",
    (*GPU_LABELS, "cause", "gpu_instance"),
    budget=0,
)
SECONDS = counter(
    "starvation_seconds_total",
    "Time the cause has fired on the GPU; from the cause's first pending on (0 until it "
    "fires, so no firing second is lost to a series' first sample).",
    (*GPU_LABELS, "cause", "gpu_instance"),
    budget=0,
)
STARVED = gauge(
    "gpu_starved", "1 while any cause fires on the GPU (or one of its MIG instances).", GPU_LABELS
)
ERRORS = counter(
    "rule_evaluation_errors_total",
    "Evaluations of the rule that failed with an error (not: inputs absent); from its "
    "first error on.",
    ("cause",),
    budget=0,
)
RELOAD_OK = gauge(
    "rules_last_reload_successful", "1 if the last load of the rule file succeeded, else 0."
)
RELOAD_TIME = gauge(
    "rules_last_reload_success_timestamp_seconds",
    "When the rule file was last loaded.",
    export="detail",
)
# a constant between reloads (rules_last_reload_successful says a reload took): detail
RULES = gauge("rules", "Rules in use (the last good rule file).", export="detail")
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
# a MIG GPU's instances (gpu, uuid, gpu_instance, compute_instance, profile, mig_uuid)
_INSTANCES = PREFIX + "gpu_instance_info"


@dataclass
class AlertState:
    state: str = INACTIVE
    active_at: float | None = None
    keep_firing_since: float | None = None
    seconds_total: float = 0.0
    reason: str = ""  # why not evaluable
    missing_from: str = ""  # the source of the input whose absence made it so ("": other)
    summary: str = ""
    missing: tuple[str, ...] = ()  # the summary's values that had none
    reads: Reads | None = None  # what the last evaluation read; None: evaluate next cycle
    outcome: bool | str = False  # its result: holds, or why it was not evaluable
    counted: bool = False  # has been pending or firing: its seconds counter is exported

    @property
    def waits_for_probe(self) -> bool:
        """Not evaluable only for want of the in-process probe's reports: normal where no
        job on the GPU uses the probe, so neither a fault nor a series (issue 24)."""
        return self.state == NOT_EVALUABLE and self.missing_from == "probe"


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
    instance: str = ""  # the MIG GPU instance judged (its GI id), "" for the whole GPU

    @property
    def where(self) -> str:
        return subject_name(self.gpu, self.instance)


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
    missing: tuple[str, ...] = ()  # the firing summary's values that had none
    instance: str = ""  # the MIG GPU instance judged (its GI id), "" for the whole GPU

    @property
    def where(self) -> str:
        return subject_name(self.gpu, self.instance)


class RuleEngine:
    """Evaluates a RuleSet against the store; holds the state and the derived series."""

    skipping = True  # skip the pairs whose inputs cannot have changed (tests turn it off)

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
        self.evaluator = Evaluator(store.window, store.window_values)
        self.evaluator.grouping = [
            Selector(catalog.families[name], (), False)
            for name in PEER_GROUPING
            if name in catalog.families
        ]
        # what the rules judge, by GpuRef.id: every GPU once seen (lost GPUs too), and the
        # GPU instances of MIG GPUs while they exist
        self.gpus: dict[str, GpuRef] = {}
        self.states: dict[tuple[str, str], AlertState] = {}  # (GpuRef.id, cause)
        self.errors: dict[str, int] = defaultdict(int)
        self.last_eval: float | None = None
        self.duration = 0.0
        self.reload_ok = True
        self.reload_time: float | None = None
        self._scope = {f.spec.name: f.scope for f in catalog.families.values()}
        self.index = LiveIndex(store, {})
        self.changes = 0  # bumped whenever a state shown by rows() may have changed
        self._firing = False  # some cause fires (its seconds grow every cycle)
        self._sorted: list[GpuRef] = []
        # the subjects of a rule about the GPU's physics, and of one about its workload:
        # a MIG GPU's workloads are its instances' (docs/mig.md)
        self._whole: list[GpuRef] = []
        self._workloads: list[GpuRef] = []
        self._instances = False  # some MIG GPU instance is judged
        self._per_instance: set[str] = set()  # rules that judge a MIG GPU's instances
        # per rule, the sources of the instance forms it reads on a GPU instance
        self._instance_sources: dict[str, frozenset[str]] = {}
        self._renewed: set[str] = set()  # instances re-created since the last cycle
        self._regrouped = True  # the subjects or the rules changed: prune the states
        # per rule whose every subject is idle, the union of what they read (evaluate)
        self._quiet: dict[str, Reads] = {}
        self._read_sources: frozenset[str] = frozenset()  # what any rule reads
        self.set_rules(rules)

    def set_rules(self, rules: RuleSet) -> None:
        """Use `rules` from now on; rules kept by name keep their state."""
        names = {r.name for r in rules.rules}
        self.states = {k: v for k, v in self.states.items() if k[1] in names}
        for state in self.states.values():
            state.reads = None  # read by the old expressions
        self._quiet = {}
        self.rules = rules
        # the families the snapshot indexes: what the rules read (and on a GPU instance,
        # its instance forms), the GPUs' and instances' identity, their main processes
        families = [s.family for s in self.evaluator.grouping if s.family.name == "gpu_process_pid"]
        self._per_instance = set()
        self._instance_sources = {}
        windowed: set[str] = set()
        for rule in rules.rules:
            compiled = (rule.expr, *rule.summary_values())
            read = [s.family for c in compiled for s in c.selectors]
            families += read
            windowed |= {w for c in compiled for w in c.windows}
            if rule.per_instance:
                self._per_instance.add(rule.name)
            forms = {f.instance_form.source for f in read if f.instance_form is not None}
            self._instance_sources[rule.name] = frozenset(forms - rule.expr.sources)
        self._read_sources = frozenset().union(
            *(r.expr.sources for r in rules.rules), *self._instance_sources.values()
        )
        for family in list(families):
            if family.instance_form is not None:
                families.append(family.instance_form)
                if family.spec.name in windowed:
                    windowed.add(family.instance_form.spec.name)
        wanted = {_INFO, _LOST, _INSTANCES} | {f.spec.name for f in families}
        scopes = {name: self._scope[name] for name in wanted if name in self._scope}
        self.index = LiveIndex(self.store, scopes)
        self.store.keep_history(windowed)  # history only where a window reads it
        self._regrouped = True
        self.changes += 1

    # one cycle --------------------------------------------------------------------
    def _refresh(self, now: float) -> tuple[Changed, set[str], bool]:
        """Bring the snapshot to `now`: (changed keys, polled sources, GPUs changed)."""
        changed, polled = self.index.update(now)
        per_gpu = self.index.snapshot.per_gpu
        moved = False
        if any(name in (_INFO, _LOST, _INSTANCES) for name, _ in changed):
            for name in (_INFO, _LOST):
                for (index, uuid), rows in per_gpu.get(name, {}).items():
                    gpu = self.gpus.get(uuid)
                    bus = rows[0][0][3] if name == _INFO else (gpu.bus_id if gpu else None)
                    if gpu is None or gpu.gpu != index or gpu.bus_id != bus:
                        self.gpus[uuid] = GpuRef(index, uuid, bus)
                        moved = True
            moved = self._find_instances(per_gpu.get(_INSTANCES, {})) or moved
        if moved or len(self._sorted) != len(self.gpus):
            self._sorted = sorted(  # a GPU, then its instances
                self.gpus.values(),
                key=lambda g: (_index(g.gpu), g.uuid, _index(g.instance) if g.instance else -1),
            )
            split = {g.uuid for g in self._sorted if g.instance}
            self._instances = bool(split)
            self._whole = [g for g in self._sorted if not g.instance]
            self._workloads = [g for g in self._sorted if g.instance or g.uuid not in split]
            moved = True
        return changed, polled, moved

    def _find_instances(self, rows_by_gpu: dict[tuple[str, str], list]) -> bool:
        """Track the MIG GPU instances of gpu_instance_info's rows (labels gpu, uuid,
        gpu_instance, compute_instance, profile, ...): True if they changed. An instance
        destroyed takes its rules' state with it."""
        if not self.source_up("nvml"):  # stale or down: the instances are as last known
            return False
        found: dict[str, GpuRef] = {}
        for (_, uuid), rows in rows_by_gpu.items():
            whole = self.gpus.get(uuid)
            bus = whole.bus_id if whole else None
            for labels, _ in sorted(rows, key=lambda row: row[0][3]):  # by compute instance
                ref = GpuRef(labels[0], uuid, bus, labels[2], labels[4], labels[5])
                found.setdefault(ref.id, ref)
        known = {k: g for k, g in self.gpus.items() if g.instance}
        if known == found:
            return False
        for gone in known.keys() - found.keys():
            del self.gpus[gone]
        self._renewed |= {k for k in known.keys() & found.keys() if known[k] != found[k]}
        self.gpus.update(found)
        return True

    def _prune(self, now: float) -> list[Transition]:
        """Drop the states of what a rule no longer judges: a GPU instance destroyed or
        re-created (another tenant's), a MIG GPU's own state for a rule that now judges its
        instances (or the instances' once MIG is off), a rule whose `mig:` changed. A cause
        that was pending, firing or not evaluable ends there (a transition to inactive)."""
        judged = self._judged()
        out: list[Transition] = []
        for key, state in list(self.states.items()):
            subject, name = key
            if subject in judged.get(name, ()) and subject not in self._renewed:
                continue
            del self.states[key]
            if state.state != INACTIVE:
                uuid, _, instance = subject.partition("/")
                whole = self.gpus.get(uuid)
                gpu = whole.gpu if whole is not None else ""
                why = "no longer judged there (MIG instances changed)"
                out.append(
                    Transition(now, gpu, uuid, name, state.state, INACTIVE, why, (), instance)
                )
        self._renewed.clear()
        self._regrouped = False
        return out

    def _judged(self) -> dict[str, set[str]]:
        """Per rule, the GpuRef ids of what it judges."""
        return {r.name: {g.id for g in self._subjects(r.name)} for r in self.rules.rules}

    def _subjects(self, rule: str) -> list[GpuRef]:
        """What `rule` judges: every GPU, or (a rule about a workload) each MIG GPU's
        instances in its place."""
        return self._workloads if rule in self._per_instance else self._whole

    def evaluate(self, now: float) -> list[Transition]:
        """Evaluate every rule on every GPU at `now`; the state changes it made."""
        started = time.thread_time()
        changed, polled, moved = self._refresh(now)
        self.evaluator.begin(self.index.snapshot, self._sorted)
        dt = 0.0 if self.last_eval is None else max(0.0, now - self.last_eval)
        transitions = self._prune(now) if moved or self._regrouped else []
        if moved or not self.skipping:
            self._quiet.clear()
        down = self._down_sources()
        errors = sum(self.errors.values())
        firing = False
        for rule in self.rules.rules:
            name = rule.name
            on_gpu = sorted(rule.expr.sources & down) if down else []
            on_instance = on_gpu  # and the sources of the instance forms it reads there
            if down and self._instances and (extra := self._instance_sources.get(name)):
                on_instance = sorted((rule.expr.sources | extra) & down)
            quiet = self._quiet.pop(name, None)
            if quiet is not None and not on_instance and quiet.still(now, changed, polled):
                self._quiet[name] = quiet  # none of its subjects can change: skip them all
                continue
            firing = self._evaluate_rule(
                rule, now, dt, moved, on_gpu, on_instance, changed, polled, transitions
            ) or firing
        if transitions or moved or sum(self.errors.values()) != errors:
            self.changes += 1
        self._firing = firing
        self.last_eval = now
        self.duration = time.thread_time() - started
        return transitions

    def _down_sources(self) -> frozenset[str]:
        """The sources the rules read that are down or disabled now."""
        return frozenset(s for s in self._read_sources if not self.source_up(s))

    def _evaluate_rule(
        self,
        rule: Rule,
        now: float,
        dt: float,
        moved: bool,
        on_gpu: list[str],
        on_instance: list[str],
        changed: Changed,
        polled: set[str],
        transitions: list[Transition],
    ) -> bool:
        """One rule on each of its subjects; True if it fires on one. Where every subject
        ends idle (inactive on a false outcome, or not evaluable for want of a series) the
        union of what they read is kept: the next cycles skip the whole rule while it
        stands."""
        name, states, skipping = rule.name, self.states, self.skipping
        idle: Reads | None = Reads() if skipping else None
        firing = False
        for gpu in self._subjects(name):
            down = on_instance if gpu.instance else on_gpu
            state = states.get((gpu.id, name))
            if state is None:
                state = states[(gpu.id, name)] = AlertState()
            old = state.state
            if old == FIRING:
                state.seconds_total += dt
            if moved:  # peers() and the GPUs' identity: evaluate everything again
                state.reads = None
            if not (
                skipping
                and not down
                and _idle(state)
                and state.reads is not None
                and state.reads.still(now, changed, polled)
            ):  # most pairs, most cycles, nothing can change
                self._step(rule, gpu, state, now, down, changed, polled)
                firing = firing or state.state == FIRING
                if state.state != old:
                    fires = state.state == FIRING
                    transitions.append(
                        Transition(
                            now,
                            gpu.gpu,
                            gpu.uuid,
                            name,
                            old,
                            state.state,
                            state.summary if fires else state.reason,
                            state.missing if fires else (),
                            gpu.instance,
                        )
                    )
            if idle is not None:
                reads = state.reads
                if reads is not None and not reads.always and _idle(state):
                    idle.keys |= reads.keys
                    idle.sources |= reads.sources
                    idle.until = min(idle.until, reads.until)
                else:
                    idle = None
        if idle is not None:
            self._quiet[name] = idle
        return firing

    def diagnose(self, now: float) -> list[Finding]:
        """Evaluate every rule on every GPU once at `now`, ignoring `for` (doctor).

        The alerting state (pending, firing, seconds, errors) is neither read nor changed.
        """
        self._refresh(now)
        gpus = self._sorted
        self.evaluator.begin(self.index.snapshot, gpus)
        judged = self._judged()
        findings = []
        for gpu in gpus:
            for rule in self.rules.rules:
                if gpu.id not in judged[rule.name]:
                    continue
                spec = rule.spec
                down = sorted(s for s in rule.expr.sources if not self.source_up(s))
                status, detail = NOT_EVALUABLE, ""
                if down:
                    detail = f"source {', '.join(down)} down or disabled"
                else:
                    try:
                        holds = bool(self.evaluator.evaluate(rule.expr, gpu))
                    except Missing as e:
                        detail = str(e) if isinstance(e, OverBudget) else f"no value for {e}"
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
                        gpu.instance,
                    )
                )
        return findings

    def _step(
        self,
        rule: Rule,
        gpu: GpuRef,
        state: AlertState,
        now: float,
        down: list[str],
        changed: Changed,
        polled: set[str],
    ) -> None:
        if down:
            state.reads = None
            # a source's own health is source_up's to show: the probe's is no fault
            self._not_evaluable(state, f"source {', '.join(down)} down or disabled", down)
            return
        reads = state.reads
        if reads is not None and reads.still(now, changed, polled):
            outcome = state.outcome  # the same inputs: the same outcome
        else:
            reads = Reads()
            try:
                outcome = bool(self.evaluator.evaluate(rule.expr, gpu, reads))
            except Missing as e:
                outcome = str(e) if isinstance(e, OverBudget) else f"no value for {e}"
                state.missing_from = e.source
            except Exception as e:  # a rule must never stop the others
                self.errors[rule.name] += 1
                reason = f"error: {type(e).__name__}: {e}"
                if state.reason != reason:
                    log.warning("rule %s on GPU %s: %s", rule.name, gpu.gpu, reason)
                state.reads = None  # an error is counted each time: evaluate again
                self._not_evaluable(state, reason, [])
                return
            state.reads, state.outcome = reads, outcome
            if reads.always and rule.expr.timed:
                later = now + TIME_HORIZON
                if self.evaluator.stands_until(rule.expr, gpu, later):
                    reads.always, reads.until = False, min(reads.until, later)
        if isinstance(outcome, str):
            self._not_evaluable(state, outcome)
            return
        holds = outcome
        state.reason = ""
        spec = rule.spec
        old = state.state
        if holds:
            state.keep_firing_since = None
            state.counted = True
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
            # the evidence when it started firing
            state.summary, state.missing = self.evidence(rule, gpu)

    @staticmethod
    def _not_evaluable(state: AlertState, reason: str, sources: list[str] | None = None) -> None:
        state.state, state.reason = NOT_EVALUABLE, reason
        if sources is not None:  # else: the evaluation's Missing set it, or none
            state.missing_from = sources[0] if len(sources) == 1 else ""
        state.active_at = state.keep_firing_since = None

    def summary(self, rule: Rule, gpu: GpuRef) -> str:
        """The rule's summary for `gpu` now, on one line."""
        return self.evidence(rule, gpu)[0]

    def evidence(self, rule: Rule, gpu: GpuRef) -> tuple[str, tuple[str, ...]]:
        """(the summary, the values outside optional clauses that had none: they read
        UNKNOWN)."""
        out: list[str] = []
        missing: list[str] = []
        for clause in rule.summary:
            texts: list[str] = []
            for text, value in clause.parts:
                texts.append(text)
                if value is None:
                    continue
                try:
                    texts.append(format_value(self.evaluator.evaluate(value, gpu)))
                except Exception:  # evidence is best effort: no value, or a bug
                    if clause.optional:
                        texts = []
                        break
                    texts.append(UNKNOWN)
                    missing.append(value.text)
            out += texts
        return " ".join("".join(out).split()), tuple(missing)

    # what the exporter shows --------------------------------------------------------
    def rows(self) -> dict[str, Rows]:
        """Every family the engine exports."""
        out = self._state_rows()
        out.update(self._seconds_rows())
        out[DURATION.name].append(((), self.duration))
        return out

    def exposition(self) -> list[tuple[Callable[[], object], Callable[[], dict[str, Rows]]]]:
        """rows() in parts for the exporter, (version, rows) each: the states, rendered
        again on a transition or a reload; the seconds, every cycle while a cause fires;
        the evaluation's duration, every cycle."""
        return [
            (
                lambda: (self.changes, self.reload_ok, self.reload_time, id(self.rules)),
                self._state_rows,
            ),
            (lambda: (self.changes, self._firing and self.last_eval), self._seconds_rows),
            (lambda: self.duration, lambda: {DURATION.name: [((), self.duration)]}),
        ]

    def _state_rows(self) -> dict[str, Rows]:
        out: dict[str, Rows] = defaultdict(list)
        starved: dict[tuple[str, str], float] = {}
        for gpu in self._sorted:
            starved.setdefault((gpu.gpu, gpu.uuid), 0.0)
            for rule in self.rules.rules:
                state = self.states.get((gpu.id, rule.name))
                if state is None or state.state == INACTIVE:
                    continue
                base, instance = (gpu.gpu, gpu.uuid, rule.name), gpu.instance
                spec = rule.spec
                if state.state == FIRING:
                    starved[(gpu.gpu, gpu.uuid)] = 1.0
                    kind = (*base, spec.dimension, spec.severity)
                    out[ACTIVE.name].append(((*kind, instance), 1.0))
                    evidence = (state.summary, rule.remedy, instance)
                    out[INFO.name].append(((*kind, *evidence), 1.0))
                elif state.state == PENDING:
                    out[PENDING_METRIC.name].append(((*base, instance), 1.0))
                elif state.state == NOT_EVALUABLE and not state.waits_for_probe:
                    out[NOT_EVALUABLE_METRIC.name].append(((*base, instance), 1.0))
        out[STARVED.name] += [(labels, value) for labels, value in starved.items()]
        for rule in self.rules.rules:
            if errors := self.errors.get(rule.name, 0):
                out[ERRORS.name].append(((rule.name,), float(errors)))
        out[RELOAD_OK.name].append(((), float(self.reload_ok)))
        if self.reload_time is not None:
            out[RELOAD_TIME.name].append(((), self.reload_time))
        out[RULES.name].append(((), float(len(self.rules.rules))))
        return out

    def _seconds_rows(self) -> dict[str, Rows]:
        rows: Rows = []
        for gpu in self._sorted:
            for rule in self.rules.rules:
                state = self.states.get((gpu.id, rule.name))
                if state is not None and state.counted:
                    labels = (gpu.gpu, gpu.uuid, rule.name, gpu.instance)
                    rows.append((labels, state.seconds_total))
        return {SECONDS.name: rows}

    def firing(self) -> list[tuple[str, str, str]]:
        """(gpu, cause, summary) of every firing cause, by GPU (its instances after it)
        then rule order; a MIG GPU instance's gpu is "index/GI id"."""
        result = []
        for gpu in self._sorted:
            for rule in self.rules.rules:
                state = self.states.get((gpu.id, rule.name))
                if state is not None and state.state == FIRING:
                    result.append((gpu.name, rule.name, self.summary(rule, gpu)))
        return result


def _index(gpu: str) -> int:
    return int(gpu) if gpu.isdigit() else 1 << 30


def _idle(state: AlertState) -> bool:
    """Nothing but new inputs can change the state: inactive on a false outcome, or not
    evaluable (for want of a series: the same reason again; after an error or with a
    source down its reads are None, so it is evaluated again)."""
    return state.state == NOT_EVALUABLE or (state.state == INACTIVE and state.outcome is False)




class RuleFileWatcher:
    """Loads the rule file; reloads on request (SIGHUP) or when the file changes.

    `check` runs on the evaluation thread and only stats the file and swaps in rules
    that are ready: reading and compiling happen on a loader thread (`start`), so a big
    or hostile file never stalls evaluation, and the swap is one assignment between two
    cycles. A changed file is loaded once it has stayed the same (mtime, size, inode)
    across two checks, so a file caught while being copied is not parsed half-written;
    a request loads at once. Any failure to load keeps the last good rules running, logs
    every problem, and sets `gpuwatchd_rules_last_reload_successful` to 0 until a load
    succeeds.
    """

    def __init__(
        self,
        engine: RuleEngine,
        path: Path | None,
        now: Callable[[], float],
        start: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.path = path
        self.now = now
        self._start = start or self.in_a_thread
        self._stamp = self._file_stamp()  # of the file last loaded
        self._seen = self._stamp  # at the last check
        self._requested = False
        self._loading: threading.Event | None = None  # set when the load in flight is done
        self._done: queue.SimpleQueue[RuleSet | RulesError] = queue.SimpleQueue()
        engine.reload_time = now()

    @staticmethod
    def in_a_thread(job: Callable[[], None]) -> None:
        threading.Thread(target=job, name="rules-loader", daemon=True).start()

    def _file_stamp(self) -> tuple[int, ...] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        # its owner and mode too: whether it may be trusted is part of the load (issue 41)
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid, st.st_gid)

    def request(self) -> None:
        """Reload at the next check (safe to call from a signal handler)."""
        self._requested = True

    def check(self) -> bool | None:
        """Swap in a finished load (True: loaded, False: failed; None: none finished), and
        start a load if one was requested or the file changed and has settled."""
        finished = self._finish()
        if self._loading is not None:
            return finished
        stamp = self._file_stamp()
        settled, self._seen = stamp == self._seen, stamp
        if self._requested or (stamp != self._stamp and settled):
            self._requested = False
            self._stamp = stamp
            self._loading = threading.Event()
            self._start(self._load)  # swapped in by a later check
        return finished

    def wait_idle(self, timeout: float) -> bool:
        """Wait for the load in flight, if any, to finish (tests, shutdown)."""
        loading = self._loading
        return loading is None or loading.wait(timeout)

    def _load(self) -> None:
        """On the loader thread: load the file and hand the result to `check`."""
        assert self._loading is not None
        done = self._loading
        try:
            result: RuleSet | RulesError = load_rules(self.path, self.engine.catalog)
        except RulesError as e:
            result = e
        except Exception as e:  # whatever goes wrong, the reload has failed
            where = self.path or "the default rules"
            result = RulesError([f"{where}: cannot load: {type(e).__name__}: {e}"])
        self._done.put(result)
        done.set()

    def _finish(self) -> bool | None:
        try:
            result = self._done.get_nowait()
        except queue.Empty:
            return None
        self._loading = None
        engine = self.engine
        engine.changes += 1  # reload_successful, or the rules, change what rows() shows
        if isinstance(result, RulesError):
            engine.reload_ok = False
            log.error(
                "rules: reload of %s failed, keeping the last good rules (%d):\n%s",
                self.path or "the default rules",
                len(engine.rules.rules),
                result,
            )
            return False
        engine.set_rules(result)
        engine.reload_ok = True
        engine.reload_time = self.now()
        log.info("rules: loaded %d rules from %s", len(result.rules), result.origin)
        return True
