"""A scenario's metric expectations, sampled every step of a replay for `simulate --check`
(docs/scenarios.md#expectations)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from gpuwatchd.exposition import Rows
from gpuwatchd.rules.engine import FIRING, INACTIVE, RuleEngine, Transition
from gpuwatchd.sim.scenario import Expectation, Scenario
from gpuwatchd.sim.scenario.subjects import Subject, named_subjects
from gpuwatchd.sim.series import HEALTH, INSTANCE_LABEL, engine_families, families
from gpuwatchd.store import Store

# one series picked by an expectation's labels: its `gpu` and `gpu_instance` labels (None:
# it has none), its value
Picked = tuple[str | None, str | None, float]

_HEALTH: dict[str, Callable[[Any], float]] = {
    HEALTH[0]: lambda h: float(h.up),
    HEALTH[1]: lambda h: float(h.errors_total),
}


class MetricWatch:
    """Where a series meets an expectation's bounds it counts as "firing" (transitions
    named by the expectation's `what`), so that `check` judges it as it judges a cause.

    A source's series are read from the store, the rules engine's own
    (`gpuwatchd_starvation_active`, ...) from the engine, as the status page reads them,
    a source's health (`gpuwatchd_source_up`, `gpuwatchd_source_errors_total`) from its
    poller. Per GPU by the `gpu` label (a series without one stands for every GPU) and,
    for an expectation that names a MIG GPU instance ("0/2"), by `gpu_instance` too. A
    GPU holds while any of its series the labels pick is within the bounds."""

    def __init__(
        self, scenario: Scenario, pollers: Sequence[Any], store: Store, engine: RuleEngine
    ) -> None:
        self._pollers, self._store, self._engine = pollers, store, engine
        self._expect: dict[str, Expectation] = {}
        self._subjects: dict[str, set[Subject]] = defaultdict(set)
        count = scenario.node.gpu_count
        for e in scenario.expect:
            if e.metric:
                self._expect.setdefault(e.what, e)
                named = {s for s in named_subjects(e.gpus) if s[1] and s[0] < count}
                self._subjects[e.what] |= {(g, "") for g in range(count)} | named
        self._names = {e.metric for e in self._expect.values()}
        self._holds: dict[tuple[str, Subject], bool] = {}

    def __bool__(self) -> bool:
        return bool(self._expect)

    def sample(self, now: float) -> list[Transition]:
        rows = self._rows(now)
        out = []
        for what, e in self._expect.items():
            picked = self._picked(e, rows)
            for subject in sorted(self._subjects[what]):
                change = self._change(what, e, subject, picked, now)
                if change is not None:
                    out.append(change)
        return out

    def _change(
        self, what: str, e: Expectation, subject: Subject, picked: list[Picked], now: float
    ) -> Transition | None:
        """The transition of `subject` when it starts or stops holding."""
        values = _values(picked, subject)
        within = [v for v in values if _within(e, v)]
        holds = bool(within)
        if holds == self._holds.get((what, subject), False):
            return None
        self._holds[(what, subject)] = holds
        old, new = (INACTIVE, FIRING) if holds else (FIRING, INACTIVE)
        shown = (within or values)[:1]
        detail = f"value {shown[0]:g}" if shown else "no value"
        gpu, instance = subject
        return Transition(now, str(gpu), "", what, old, new, detail, (), instance)

    def _rows(self, now: float) -> dict[str, Rows]:
        """The expected families' series now: the sources' and the engine's."""
        rows: dict[str, Rows] = defaultdict(list)
        for (name, labels), value in self._store.latest(now):
            if name in self._names:
                rows[name].append((labels, value))
        if self._names & engine_families().keys():
            for name, engine_rows in self._engine.rows().items():
                if name in self._names:
                    rows[name] += engine_rows
        return rows

    def _picked(self, e: Expectation, rows: dict[str, Rows]) -> list[Picked]:
        """The series of `e`'s family its labels pick."""
        if e.metric in _HEALTH:  # one source's, named by its `source` label
            polled = [p for p in self._pollers if p.name == e.labels.get("source")]
            return [(None, None, _HEALTH[e.metric](p.health)) for p in polled]
        names = families()[e.metric]
        out = []
        for labels, value in rows.get(e.metric, []):
            named = dict(zip(names, labels, strict=False))
            if all(named.get(k) == v for k, v in e.labels.items()):
                out.append((named.get("gpu"), named.get(INSTANCE_LABEL), value))
        return out


def _values(picked: list[Picked], subject: Subject) -> list[float]:
    """The values of a subject's series: a GPU's (its instances' with them), or one GPU
    instance's."""
    gpu, instance = str(subject[0]), subject[1]
    if instance:
        return [v for g, i, v in picked if g == gpu and i == instance]
    return [v for g, _, v in picked if g in (gpu, None)]


def _within(e: Expectation, value: float) -> bool:
    return (e.above is None or value > e.above) and (e.below is None or value < e.below)
