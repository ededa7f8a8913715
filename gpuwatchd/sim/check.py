"""`simulate --check`: the timeline of firing causes against the scenario's `expect`.

Per expectation and subject (a GPU, its MIG instances with it, or one MIG GPU instance
named "0/2"): firing before `onset`, or at all when `never`, is a false positive; not
firing between `onset` and `by` (the scenario's end without `by`) is a miss. A cause
that fires on a GPU or instance no expectation lets it fire on is a false positive too
("unexpected"), so every scenario is a benign twin for every rule it does not name.
With `ends` (the fault ends), a cause still firing at `resolved_by` (the scenario's end
without it), or firing again after it, has not resolved: a mismatch too. So is a firing
summary with a value that had none ("unknown" on the page), and one without the text an
expectation's `summary` says it must contain.

A run cut short (`--until`) judges what it reached: a cause that has not fired yet where
`by` lies past the run's end, or a resolution whose `resolved_by` does, is "not
reached", not a mismatch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from gpuwatchd.rules.engine import FIRING, Transition
from gpuwatchd.sim.scenario import Expectation, Privileges, Scenario
from gpuwatchd.sim.scenario.subjects import Subject, named_subjects, subject_label, subjects

Span = tuple[float, float | None]  # seconds since the scenario start; None: still firing
Intervals = dict[tuple[int, str], list[Span]]  # (gpu, cause): a GPU's, its instances' with it
Firings = list[tuple[str, tuple[str, ...]]]  # each time it fired: summary, values it had none for
Summaries = dict[tuple[int, str], Firings]
SubjectKey = tuple[int, str, str]  # (gpu, GI id or "" for the GPU itself, cause)


@dataclass(frozen=True)
class Instances:
    """What fired on each subject apart, (gpu, GI id, cause) ->: a GPU itself (GI id "")
    and each of its MIG GPU instances. An expectation naming an instance ("0/2") is
    judged on its own; so is a firing no expectation allows."""

    intervals: dict[SubjectKey, list[Span]] = field(default_factory=dict)
    summaries: dict[SubjectKey, Firings] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    cause: str
    gpus: str
    expected: str
    observed: str
    ok: bool  # no mismatch in what the run reached
    reached: bool = True  # False: part of it lies past the end of a run cut short

    @property
    def result(self) -> str:
        return "MISMATCH" if not self.ok else "ok" if self.reached else "not reached"


def firing_instances(transitions: list[Transition], start: float) -> Instances:
    """Each subject's firing spans, by when they began, and firing summaries."""
    intervals: dict[SubjectKey, list[Span]] = defaultdict(list)
    summaries: dict[SubjectKey, Firings] = defaultdict(list)
    for t in transitions:
        key = (int(t.gpu), t.instance, t.cause)
        if t.new == FIRING:
            intervals[key].append((t.at - start, None))
            summaries[key].append((t.detail, t.missing))
        elif t.old == FIRING and intervals.get(key) and intervals[key][-1][1] is None:
            intervals[key][-1] = (intervals[key][-1][0], t.at - start)
    return Instances(dict(intervals), dict(summaries))


def firing_intervals(transitions: list[Transition], start: float) -> Intervals:
    """(gpu index, cause) -> [(from, to or None)] in seconds since the scenario start,
    by when they began: a MIG GPU's instances' intervals are its own."""
    out: Intervals = defaultdict(list)
    for (gpu, _, cause), spans in firing_instances(transitions, start).intervals.items():
        out[(gpu, cause)] = sorted(out[(gpu, cause)] + spans, key=lambda i: i[0])
    return out


def firing_summaries(transitions: list[Transition]) -> Summaries:
    """(gpu index, cause) -> the summary and missing values of each time it fired."""
    out: Summaries = defaultdict(list)
    for t in transitions:
        if t.new == FIRING:
            out[(int(t.gpu), t.cause)].append((t.detail, t.missing))
    return dict(out)


@dataclass(frozen=True)
class _Fired:
    """What a replay fired, looked up per subject."""

    intervals: Intervals
    summaries: Summaries
    instances: Instances

    def spans(self, subject: Subject, cause: str) -> list[Span]:
        gpu, instance = subject
        if instance:
            return self.instances.intervals.get((gpu, instance, cause), [])
        return self.intervals.get((gpu, cause), [])

    def texts(self, subject: Subject, cause: str) -> Firings:
        gpu, instance = subject
        if instance:
            return self.instances.summaries.get((gpu, instance, cause), [])
        return self.summaries.get((gpu, cause), [])


def _on_whole_gpus(scenario: Scenario, intervals: Intervals, summaries: Summaries) -> Instances:
    """Without instances' own spans: everything fired on the GPUs themselves (an error
    where the scenario names an instance: it would judge nothing)."""
    if any(gi for e in scenario.expect for _, gi in named_subjects(e.gpus)):
        raise ValueError(
            'check: the scenario names MIG GPU instances ("0/2"): pass what each fired on '
            "its own (`instances`, from firing_instances)"
        )
    return Instances(
        {(gpu, "", cause): spans for (gpu, cause), spans in intervals.items()},
        {(gpu, "", cause): texts for (gpu, cause), texts in summaries.items()},
    )


def _span(names: list[Subject]) -> str:
    return ",".join(subject_label(s) for s in names) if names else "-"


def _gpus_word(names: list[Subject] | list[str]) -> str:
    return "gpus" if len(names) > 1 else "gpu"


def _fired(hits: list[tuple[Subject, float]]) -> str:
    """ "gpu 3 fired at 60s; gpus 0,1 fired at 75s": subjects grouped by when they first
    fired."""
    by_time: dict[float, list[Subject]] = defaultdict(list)
    for subject, at in hits:
        by_time[round(at)].append(subject)
    return "; ".join(f"{_gpus_word(s)} {_span(s)} fired at {t:.0f}s" for t, s in by_time.items())


def time_to_resolve(spans: list[Span], ends: float) -> float | None:
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
    name: str, spans: list[Span], ends: float, deadline: float, duration: float
) -> tuple[float | None, list[str]]:
    """(time to resolve, problems) of one subject: still firing at `deadline`, or again
    after (the run reached `deadline`)."""
    problems = []
    late = [stop for start, stop in spans if start < deadline and (stop is None or stop > deadline)]
    if late:
        stop = late[0]
        if stop is None:
            the_end = ", the end" if deadline >= duration else ""
            problems.append(f"gpu {name} still firing at {deadline:.0f}s{the_end}")
        else:
            problems.append(f"gpu {name} still firing at {deadline:.0f}s (stopped at {stop:.0f}s)")
    again = [start for start, _ in spans if start >= deadline]
    if again:
        problems.append(f"gpu {name} fired again at {again[0]:.0f}s")
    before = [span for span in spans if span[0] < deadline]
    return (time_to_resolve(before, ends) if before and not late else None), problems


@dataclass(frozen=True)
class _Window:
    """When one expectation's cause must fire and stop, and how far the run went."""

    onset: float
    by: float
    ends: float | None
    deadline: float  # resolved_by
    end: float  # where the run ended
    duration: float  # where the scenario ends

    @classmethod
    def of(cls, e: Expectation, end: float, duration: float) -> _Window:
        by = e.by if e.by is not None else e.ends if e.ends is not None else duration
        deadline = e.resolved_by if e.resolved_by is not None else duration
        return cls(e.onset, by, e.ends, deadline, end, duration)

    def expected(self) -> str:
        text = f"fires from {self.onset:.0f}s, by {self.by:.0f}s"
        if self.ends is not None:
            text += f"; fault ends {self.ends:.0f}s, stopped by {self.deadline:.0f}s"
        return text


@dataclass
class _Seen:
    """What one expectation's subjects showed."""

    problems: list[str] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)  # onset to the first firing
    resolved: list[float] = field(default_factory=list)  # fault end to firing stopped
    unfired: list[str] = field(default_factory=list)  # not fired, `by` past the run's end
    unresolved: list[str] = field(default_factory=list)  # `resolved_by` past the run's end

    def observed(self, w: _Window) -> str:
        text = f"fired {_range(self.delays)} after onset" if self.delays else "did not fire"
        if self.resolved:
            text += f", stopped {_range(self.resolved)} after the fault ended"
        shown = [text] if self.delays or self.resolved or not self.unfired else []
        return "; ".join([*shown, *self.problems, *self.not_reached(w)])

    def not_reached(self, w: _Window) -> list[str]:
        out = []
        if self.unfired:
            out.append(
                f"{_gpus_word(self.unfired)} {','.join(self.unfired)} not fired yet: by "
                f"{w.by:.0f}s lies past the run's end ({w.end:.0f}s)"
            )
        if self.unresolved:
            out.append(
                f"resolution of {_gpus_word(self.unresolved)} {','.join(self.unresolved)} not "
                f"reached: stopped by {w.deadline:.0f}s lies past the run's end ({w.end:.0f}s)"
            )
        return out


def _judge_subject(w: _Window, name: str, spans: list[Span], seen: _Seen) -> None:
    """One subject of an expectation that fires: early, on time, missed, resolved."""
    early = [s for s, _ in spans if s < w.onset]
    if early:
        seen.problems.append(f"gpu {name} fired early at {early[0]:.0f}s")
    on_time = [s for s, _ in spans if w.onset <= s <= w.by]
    if on_time:
        seen.delays.append(on_time[0] - w.onset)
    elif w.by > w.end:
        seen.unfired.append(name)
    else:
        seen.problems.append(f"gpu {name} missed")
    if w.ends is None or not spans:
        return
    if w.deadline > w.end:
        seen.unresolved.append(name)
        return
    took, unresolved = _resolution(name, spans, w.ends, w.deadline, w.duration)
    seen.problems += unresolved
    if took is not None:
        seen.resolved.append(took)


def _summary_problems(e: Expectation, names: list[Subject], fired: _Fired) -> list[str]:
    """Where a firing summary lacks the expectation's `summary` text."""
    return [
        f"gpu {subject_label(s)}'s summary lacks {e.summary!r}: {text!r}"
        for s in names
        for text, _ in fired.texts(s, e.what)
        if e.summary not in text
    ]


def _never(
    e: Expectation, names: list[Subject], fired: _Fired, end: float, duration: float
) -> Verdict:
    bad = [(s, spans[0][0]) for s in names if (spans := fired.spans(s, e.what))]
    cut = f" in the {end:.0f}s the run reached" if end < duration else ""
    observed = _fired(bad) if bad else f"never fired{cut}"
    return Verdict(e.what, _span(names), "never", observed, not bad)


def _fires(e: Expectation, names: list[Subject], fired: _Fired, w: _Window) -> Verdict:
    seen = _Seen()
    for s in names:
        _judge_subject(w, subject_label(s), fired.spans(s, e.what), seen)
    if e.summary:
        seen.problems += _summary_problems(e, names, fired)
    reached = not (seen.unfired or seen.unresolved)
    return Verdict(e.what, _span(names), w.expected(), seen.observed(w), not seen.problems, reached)


def _covered(key: SubjectKey, named: set[SubjectKey]) -> bool:
    """Named by an expectation: the subject itself, or the whole GPU it is part of."""
    gpu, _, cause = key
    return key in named or (gpu, "", cause) in named


def _unexpected(scenario: Scenario, fired: _Fired, watched: set[str]) -> list[Verdict]:
    """A cause firing on a subject no expectation names for it (`watched`: the metric
    conditions, judged only where named)."""
    count = scenario.node.gpu_count
    named = {(*s, e.what) for e in scenario.expect for s in subjects(e.gpus, count)}
    hits: dict[str, list[tuple[Subject, float]]] = defaultdict(list)
    for key, spans in sorted(fired.instances.intervals.items()):
        if spans and key[2] not in watched and not _covered(key, named):
            hits[key[2]].append(((key[0], key[1]), spans[0][0]))
    return [
        Verdict(cause, _span([s for s, _ in h]), "(not expected)", _fired(h), False)
        for cause, h in hits.items()
    ]


def _without_values(fired: _Fired) -> list[Verdict]:
    """A firing summary with a value that had none."""
    out = []
    for (gpu, instance, cause), firings in sorted(fired.instances.summaries.items()):
        missing = sorted({value for _, values in firings for value in values})
        if missing:
            out.append(
                Verdict(
                    cause,
                    subject_label((gpu, instance)),
                    "a summary with every value",
                    "no value for " + "; ".join(missing),
                    False,
                )
            )
    return out


def check(
    scenario: Scenario,
    intervals: Intervals,
    end: float,
    summaries: Summaries | None = None,
    instances: Instances | None = None,
    privileges: Privileges = "ptrace",
) -> list[Verdict]:
    """The verdicts on what a replay fired (`intervals`, `summaries` per GPU; `instances`
    per subject, from `firing_instances`: without it, all on the GPUs themselves) up to
    `end`, the seconds the run reached (the scenario's end unless cut short)."""
    summaries = summaries or {}
    watched = {e.what for e in scenario.expect if e.metric}  # under any privileges
    scenario = under(scenario, privileges)
    if instances is None:
        instances = _on_whole_gpus(scenario, intervals, summaries)
    fired = _Fired(intervals, summaries, instances)
    count, duration = scenario.node.gpu_count, scenario.duration
    verdicts = []
    for e in scenario.expect:
        names = subjects(e.gpus, count)
        if e.never:
            verdicts.append(_never(e, names, fired, end, duration))
        else:
            verdicts.append(_fires(e, names, fired, _Window.of(e, end, duration)))
    return verdicts + _unexpected(scenario, fired, watched) + _without_values(fired)


def under(scenario: Scenario, privileges: Privileges) -> Scenario:
    """`scenario` with the expectations that hold under the daemon's `privileges`."""
    expect = [e for e in scenario.expect if e.privileges in ("any", privileges)]
    return scenario.model_copy(update={"expect": expect})


def format_verdicts(scenario: str, verdicts: list[Verdict]) -> str:
    header = ("cause", "gpus", "expected", "observed", "result")
    rows = [(v.cause, v.gpus, v.expected, v.observed, v.result) for v in verdicts]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    unreached = sum(v.ok and not v.reached for v in verdicts)
    lines = [
        f"check {scenario}: {sum(not v.ok for v in verdicts)} mismatch(es) "
        f"in {len(verdicts)} expectation(s)"
        + (f", {unreached} not reached (the run ended before them)" if unreached else "")
    ]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
