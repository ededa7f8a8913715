"""`simulate --check`: the timeline of firing causes against the scenario's `expect`.

Per expectation and GPU: firing before `onset`, or at all when `never`, is a false
positive; not firing between `onset` and `by` (the scenario's end without `by`) is a
miss. A cause that fires on a GPU no expectation lets it fire on is a false positive
too ("unexpected"), so every scenario is a benign twin for every rule it does not name.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gpuwatchd.rules.engine import FIRING, Transition
from gpuwatchd.sim.scenario import Expectation, Scenario

Intervals = dict[tuple[int, str], list[tuple[float, float | None]]]


@dataclass(frozen=True)
class Verdict:
    cause: str
    gpus: str
    expected: str
    observed: str
    ok: bool


def firing_intervals(transitions: list[Transition], start: float) -> Intervals:
    """(gpu index, cause) -> [(from, to or None)] in seconds since the scenario start."""
    out: Intervals = defaultdict(list)
    for t in transitions:
        key = (int(t.gpu), t.cause)
        if t.new == FIRING:
            out[key].append((t.at - start, None))
        elif t.old == FIRING and out[key] and out[key][-1][1] is None:
            out[key][-1] = (out[key][-1][0], t.at - start)
    return out


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


def check(scenario: Scenario, intervals: Intervals, end: float) -> list[Verdict]:
    count = scenario.node.gpu_count
    verdicts: list[Verdict] = []
    allowed: set[tuple[int, str]] = set()
    for e in scenario.expect:
        gpus = _gpus(e, count)
        if e.never:
            bad = [(g, intervals[(g, e.cause)][0][0]) for g in gpus if intervals.get((g, e.cause))]
            observed = _fired(bad) if bad else "never fired"
            verdicts.append(Verdict(e.cause, _span(gpus), "never", observed, not bad))
            continue
        by = e.by if e.by is not None else end
        expected = f"fires from {e.onset:.0f}s, by {by:.0f}s"
        problems, fired = [], []
        for g in gpus:
            allowed.add((g, e.cause))
            spans = intervals.get((g, e.cause), [])
            early = [s for s, _ in spans if s < e.onset]
            if early:
                problems.append(f"gpu {g} fired early at {early[0]:.0f}s")
            on_time = [s for s, _ in spans if e.onset <= s <= by]
            if on_time:
                fired.append(on_time[0] - e.onset)
            else:
                problems.append(f"gpu {g} missed")
        if fired:
            delays = (
                f"fired {min(fired):.0f}s"
                + (f"-{max(fired):.0f}s" if max(fired) != min(fired) else "")
                + " after onset"
            )
        else:
            delays = "did not fire"
        observed = "; ".join([delays, *problems]) if problems else delays
        verdicts.append(Verdict(e.cause, _span(gpus), expected, observed, not problems))
    unexpected: dict[str, list[tuple[int, float]]] = defaultdict(list)
    named_never = {(g, e.cause) for e in scenario.expect if e.never for g in _gpus(e, count)}
    for (g, cause), spans in sorted(intervals.items()):
        if spans and (g, cause) not in allowed and (g, cause) not in named_never:
            unexpected[cause].append((g, spans[0][0]))
    for cause, hits in unexpected.items():
        observed = _fired(hits)
        verdicts.append(
            Verdict(cause, _span([g for g, _ in hits]), "(not expected)", observed, False)
        )
    return verdicts


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
