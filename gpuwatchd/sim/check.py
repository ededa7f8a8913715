"""`simulate --check`: the timeline of firing causes against the scenario's `expect`.

Per expectation and GPU: firing before `onset`, or at all when `never`, is a false
positive; not firing between `onset` and `by` (the scenario's end without `by`) is a
miss. A cause that fires on a GPU no expectation lets it fire on is a false positive
too ("unexpected"), so every scenario is a benign twin for every rule it does not name.
With `ends` (the fault ends), a cause still firing at `resolved_by` (the scenario's end
without it), or firing again after it, has not resolved: a mismatch too. So is a firing
summary with a value that had none ("unknown" on the page), and one without the text an
expectation's `summary` says it must contain.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.rules.engine import FIRING, INACTIVE, Transition
from gpuwatchd.sim.scenario import Expectation, Scenario

Intervals = dict[tuple[int, str], list[tuple[float, float | None]]]
# (gpu, cause) -> each time it fired: (its summary, the values the summary had none for)
Summaries = dict[tuple[int, str], list[tuple[str, tuple[str, ...]]]]


@dataclass(frozen=True)
class Verdict:
    cause: str
    gpus: str
    expected: str
    observed: str
    ok: bool


def firing_intervals(transitions: list[Transition], start: float) -> Intervals:
    """(gpu index, cause) -> [(from, to or None)] in seconds since the scenario start,
    by when they began: a MIG GPU's instances' intervals are its own."""
    each: dict[tuple[int, str, str], list[tuple[float, float | None]]] = defaultdict(list)
    for t in transitions:
        key = (int(t.gpu), t.instance, t.cause)
        if t.new == FIRING:
            each[key].append((t.at - start, None))
        elif t.old == FIRING and each[key] and each[key][-1][1] is None:
            each[key][-1] = (each[key][-1][0], t.at - start)
    out: Intervals = defaultdict(list)
    for (gpu, _, cause), intervals in each.items():
        out[(gpu, cause)] = sorted(out[(gpu, cause)] + intervals, key=lambda i: i[0])
    return out


def firing_summaries(transitions: list[Transition]) -> Summaries:
    """(gpu index, cause) -> the summary and missing values of each time it fired."""
    out: Summaries = defaultdict(list)
    for t in transitions:
        if t.new == FIRING:
            out[(int(t.gpu), t.cause)].append((t.detail, t.missing))
    return dict(out)


def _summary_problems(e: Expectation, gpus: list[int], summaries: Summaries) -> list[str]:
    """Where a firing summary lacks the expectation's `summary` text."""
    return [
        f"gpu {g}'s summary lacks {e.summary!r}: {text!r}"
        for g in gpus
        for text, _ in summaries.get((g, e.what), [])
        if e.summary not in text
    ]


def _gpus(expectation: Expectation, count: int) -> list[int]:
    if expectation.gpus == "all":
        return list(range(count))
    return [g for g in expectation.gpus if 0 <= g < count]


def _fired(hits: list[tuple[int, float]]) -> str:
    """ "gpu 3 fired at 60s; gpus 0,1 fired at 75s": GPUs grouped by when they first fired."""
    by_time: dict[float, list[int]] = defaultdict(list)
    for gpu, at in hits:
        by_time[round(at)].append(gpu)
    return "; ".join(
        f"gpu{'s' if len(g) > 1 else ''} {_span(g)} fired at {t:.0f}s" for t, g in by_time.items()
    )


def _span(gpus: list[int]) -> str:
    return ",".join(str(g) for g in gpus) if gpus else "-"


def time_to_resolve(spans: list[tuple[float, float | None]], ends: float) -> float | None:
    """Seconds from the fault's end (`ends`) until the cause stopped firing for good: the
    end of its last firing span (0 if that was before `ends`); None while it still fires.
    `spans` must not be empty."""
    stops = [stop for _, stop in spans]
    if any(stop is None for stop in stops):
        return None
    return max(0.0, max(s for s in stops if s is not None) - ends)


def _range(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.0f}s" if round(low) == round(high) else f"{low:.0f}s-{high:.0f}s"


def _resolution(
    g: int, spans: list[tuple[float, float | None]], ends: float, deadline: float, end: float
) -> tuple[float | None, list[str]]:
    """(time to resolve, problems) of one GPU: still firing at `deadline`, or again after."""
    problems = []
    late = [stop for start, stop in spans if start < deadline and (stop is None or stop > deadline)]
    if late:
        stop = late[0]
        if stop is None:
            at = min(deadline, end)
            problems.append(
                f"gpu {g} still firing at {at:.0f}s" + (", the end" if at == end else "")
            )
        else:
            problems.append(f"gpu {g} still firing at {deadline:.0f}s (stopped at {stop:.0f}s)")
    again = [start for start, _ in spans if start >= deadline]
    if again:
        problems.append(f"gpu {g} fired again at {again[0]:.0f}s")
    before = [span for span in spans if span[0] < deadline]
    return (time_to_resolve(before, ends) if before and not late else None), problems


def check(
    scenario: Scenario, intervals: Intervals, end: float, summaries: Summaries | None = None
) -> list[Verdict]:
    summaries = summaries or {}
    count = scenario.node.gpu_count
    verdicts: list[Verdict] = []
    allowed: set[tuple[int, str]] = set()
    for e in scenario.expect:
        gpus, what = _gpus(e, count), e.what
        if e.never:
            bad = [(g, intervals[(g, what)][0][0]) for g in gpus if intervals.get((g, what))]
            observed = _fired(bad) if bad else "never fired"
            verdicts.append(Verdict(what, _span(gpus), "never", observed, not bad))
            continue
        by = e.by if e.by is not None else e.ends if e.ends is not None else end
        expected = f"fires from {e.onset:.0f}s, by {by:.0f}s"
        deadline = e.resolved_by if e.resolved_by is not None else end
        if e.ends is not None:
            expected += f"; fault ends {e.ends:.0f}s, stopped by {deadline:.0f}s"
        problems, fired, resolved = [], [], []
        for g in gpus:
            allowed.add((g, what))
            spans = intervals.get((g, what), [])
            early = [s for s, _ in spans if s < e.onset]
            if early:
                problems.append(f"gpu {g} fired early at {early[0]:.0f}s")
            on_time = [s for s, _ in spans if e.onset <= s <= by]
            if on_time:
                fired.append(on_time[0] - e.onset)
            else:
                problems.append(f"gpu {g} missed")
            if e.ends is not None:
                took, unresolved = _resolution(g, spans, e.ends, deadline, end)
                problems += unresolved
                if took is not None:
                    resolved.append(took)
        if e.summary:
            problems += _summary_problems(e, gpus, summaries)
        delays = f"fired {_range(fired)} after onset" if fired else "did not fire"
        if resolved:
            delays += f", stopped {_range(resolved)} after the fault ended"
        observed = "; ".join([delays, *problems]) if problems else delays
        verdicts.append(Verdict(what, _span(gpus), expected, observed, not problems))
    unexpected: dict[str, list[tuple[int, float]]] = defaultdict(list)
    named_never = {(g, e.what) for e in scenario.expect if e.never for g in _gpus(e, count)}
    watched = {e.what for e in scenario.expect if e.metric}  # judged only where named
    for (g, cause), spans in sorted(intervals.items()):
        if cause in watched:
            continue
        if spans and (g, cause) not in allowed and (g, cause) not in named_never:
            unexpected[cause].append((g, spans[0][0]))
    for cause, hits in unexpected.items():
        observed = _fired(hits)
        verdicts.append(
            Verdict(cause, _span([g for g, _ in hits]), "(not expected)", observed, False)
        )
    for (g, cause), firings in sorted(summaries.items()):
        missing = sorted({value for _, values in firings for value in values})
        if missing:
            observed = "no value for " + "; ".join(missing)
            verdicts.append(Verdict(cause, str(g), "a summary with every value", observed, False))
    return verdicts


class MetricWatch:
    """The scenario's metric expectations, looked at every step of a replay: where a
    series meets its bounds it counts as "firing" (transitions named by the
    expectation's `what`), so that `check` judges it as it judges a cause.

    Source health (`gpuwatchd_source_up`, `gpuwatchd_source_errors_total`) is read from
    the pollers, every other series from the store (per GPU by its `gpu` label; one
    without it stands for every GPU)."""

    HEALTH = {
        "gpuwatchd_source_up": lambda h: float(h.up),
        "gpuwatchd_source_errors_total": lambda h: float(h.errors_total),
    }

    def __init__(self, scenario: Scenario, pollers: Sequence[Any], store: Any) -> None:
        self._pollers, self._store = pollers, store
        self._count = scenario.node.gpu_count
        self._expect = {e.what: e for e in scenario.expect if e.metric}
        self._labels = {  # metric -> its label names, from the sources that export it
            spec.name: spec.labels for p in pollers for spec in p.source.metrics
        }
        self._holds: dict[tuple[int, str], bool] = {}

    def __bool__(self) -> bool:
        return bool(self._expect)

    def sample(self, now: float) -> list[Transition]:
        out = []
        for what, e in self._expect.items():
            values = self._values(e, now)
            for g in range(self._count):
                value = values.get(str(g), values.get(None))
                holds = (
                    value is not None
                    and (e.above is None or value > e.above)
                    and (e.below is None or value < e.below)
                )
                if holds != self._holds.get((g, what), False):
                    self._holds[(g, what)] = holds
                    old, new = (INACTIVE, FIRING) if holds else (FIRING, INACTIVE)
                    out.append(
                        Transition(
                            now,
                            str(g),
                            "",
                            what,
                            old,
                            new,
                            f"value {value:g}" if value is not None else "no value",
                        )
                    )
        return out

    def _values(self, e: Expectation, now: float) -> dict[str | None, float]:
        """The series' value per GPU index (None: a series without a gpu label)."""
        health = self.HEALTH.get(e.metric)
        if health is not None:  # one source's, named by its `source` label
            polled = [p for p in self._pollers if p.name == e.labels.get("source")]
            return {None: health(polled[0].health)} if polled else {}
        names = self._labels.get(e.metric, ())
        out: dict[str | None, float] = {}
        for (name, labels), value in self._store.latest(now):
            if name != e.metric:
                continue
            named = dict(zip(names, labels, strict=False))
            if all(named.get(k) == v for k, v in e.labels.items()):
                out[named.get("gpu")] = value
        return out


def format_verdicts(scenario: str, verdicts: list[Verdict]) -> str:
    header = ("cause", "gpus", "expected", "observed", "result")
    rows = [
        (v.cause, v.gpus, v.expected, v.observed, "ok" if v.ok else "MISMATCH") for v in verdicts
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"check {scenario}: {sum(not v.ok for v in verdicts)} mismatch(es) "
        f"in {len(verdicts)} expectation(s)"
    ]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
