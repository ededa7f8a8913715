"""The detection table (docs/detection.md), generated from the scenario corpus.

Every built-in scenario is replayed once with the default rules (`replay` caches the
result per scenario, so the test suite's corpus check and this table share one pass).
Per cause of the default rules: the scenarios whose expectations say it fires, the time
from the fault's `onset` to the first firing on each expected GPU, the time from the
fault's end (`ends`, where the scenario has one) until it stopped firing, and its false
firings: on its benign twins (scenarios whose expectations say it must never fire) and on
every other scenario (firing before `onset`, or on a GPU no expectation lets it fire on).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from collections import defaultdict
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from gpuwatchd.config import Config
from gpuwatchd.rules.ruleset import load_rules
from gpuwatchd.sim.check import (
    Instances,
    Intervals,
    Span,
    Summaries,
    firing_instances,
    firing_intervals,
    firing_summaries,
    time_to_resolve,
    under,
)
from gpuwatchd.sim.scenario import Privileges, Scenario, builtin_scenarios, load_scenario
from gpuwatchd.sim.scenario.subjects import Subject, subject_label, subjects


@dataclass(frozen=True)
class Replay:
    scenario: Scenario
    intervals: Intervals  # (gpu, cause) -> firing spans, seconds since the start
    simulated_seconds: float
    summaries: Summaries  # (gpu, cause) -> its firing summaries and values that had none
    instances: Instances  # the same per GPU and MIG GPU instance apart

    def spans(self, subject: Subject, cause: str) -> list[Span]:
        """A GPU's firing spans (its instances' with them), or one instance's."""
        gpu, instance = subject
        if instance:
            return self.instances.intervals.get((gpu, instance, cause), [])
        return self.intervals.get((gpu, cause), [])


Played = tuple[str, Privileges]  # a built-in scenario, and the daemon's privileges
EVERYTHING = os.environ.get("GPUWATCHD_CORPUS_PRIVILEGES") == "all"  # corpus(): both, all
_played: dict[Played, Replay] = {}
_playing: dict[Played, Future[Replay]] = {}  # started by play_ahead, not taken yet


def replay(name: str, privileges: Privileges = "ptrace") -> Replay:
    """Play the built-in scenario `name` to its end with the default config, the daemon
    holding `privileges` (cached)."""
    key = (name, privileges)
    if key not in _played:
        playing = _playing.pop(key, None)
        _played[key] = playing.result() if playing is not None else _play(key)
    return _played[key]


def replays(
    names: list[str] | None = None, privileges: Privileges = "ptrace"
) -> dict[str, Replay]:
    """Every built-in scenario (or `names`) played, those not played yet in parallel,
    one process per CPU, the longest first (cached as `replay`)."""
    names = builtin_scenarios() if names is None else names
    play_ahead(names, privileges=(privileges,))
    return {name: replay(name, privileges) for name in names}


def corpus(everything: bool = False) -> list[Played]:
    """The (scenario, privileges) pairs the test suite checks: every built-in scenario
    with the daemon reading what it may (ptrace), and as shipped (unprivileged) those
    whose result depends on it, which say so with expectations of either mode; all of
    them in both modes with `everything` (GPUWATCHD_CORPUS_PRIVILEGES=all: twice the
    time, more than CI's budget allows)."""
    names = builtin_scenarios()
    pairs: list[Played] = [(n, "ptrace") for n in names]
    both = [n for n in names if everything or _depends_on_privileges(load_scenario(n))]
    return pairs + [(n, "unprivileged") for n in both]


def _depends_on_privileges(scenario: Scenario) -> bool:
    return any(e.privileges != "any" for e in scenario.expect)


def play_ahead(
    names: list[str], nice: int = 0, privileges: tuple[Privileges, ...] = ("ptrace",)
) -> None:
    """Start playing `names` under each of `privileges` (play_pairs_ahead)."""
    play_pairs_ahead([(n, p) for n in names for p in privileges], nice)


def play_pairs_ahead(pairs: list[Played], nice: int = 0) -> None:
    """Start playing the (scenario, privileges) pairs not played or playing yet in worker
    processes, one per CPU, the longest first, at `nice` more than this process's
    niceness; `replay` takes each result when asked. The test suite starts the corpus
    this way at collection, at the lowest priority, so it plays on the CPU its real-time
    tests (servers, daemons, deadlines) leave."""
    todo = sorted(
        (key for key in set(pairs) if key not in _played and key not in _playing),
        key=lambda key: (-load_scenario(key[0]).duration, key[1]),
    )
    workers = min(len(todo), os.cpu_count() or 1)
    if workers < 2:
        return  # played in this process, when asked
    context = multiprocessing.get_context("spawn")  # no threads of ours come along
    quiet = logging.root.manager.disable  # the workers log as this process would
    pool = ProcessPoolExecutor(workers, context, _start_worker, (quiet, nice))
    _playing.update((key, pool.submit(_play, key)) for key in todo)
    pool.shutdown(wait=False)  # its workers end once the last scenario is played


def _start_worker(quiet: int, nice: int) -> None:
    """A worker logs as the process that started it does, at the priority asked for
    (where the system lets it lower its own)."""
    logging.disable(quiet)
    if nice:
        with contextlib.suppress(OSError, AttributeError):
            os.nice(nice)


def _play(key: Played) -> Replay:
    name, privileges = key
    return play(load_scenario(name), privileges)


def play(scenario: Scenario, privileges: Privileges = "ptrace") -> Replay:
    """Play `scenario` to its end with the default config (uncached)."""
    from gpuwatchd.simulate import Simulation

    simulation = Simulation(scenario, Config(), ptrace=privileges == "ptrace")
    try:
        result = simulation.run()
    finally:
        simulation.close()
    intervals = firing_intervals(result.transitions, result.started_at)
    summaries = firing_summaries(result.transitions)
    instances = firing_instances(result.transitions, result.started_at)
    return Replay(scenario, dict(intervals), result.simulated_seconds, summaries, instances)


def _seconds(values: list[float]) -> str:
    if not values:
        return "did not fire"
    low, high = min(values), max(values)
    return f"{low:.0f} s" if round(low) == round(high) else f"{low:.0f}–{high:.0f} s"


def _false_firings(r: Replay, allowed: dict[tuple[int, str, str], float]) -> list[tuple[str, str]]:
    """(cause, "gpu 3 at 60 s") of each subject where a cause fired before its onset, or
    where no expectation lets it fire (one that names the whole GPU allows its instances)."""
    out = []
    for (gpu, instance, cause), spans in sorted(r.instances.intervals.items()):
        onset = allowed.get((gpu, instance, cause), allowed.get((gpu, "", cause)))
        bad = [a for a, _ in spans if onset is None or a < onset]
        if bad:
            out.append((cause, f"gpu {subject_label((gpu, instance))} at {bad[0]:.0f} s"))
    return out


def detection_table() -> str:
    """docs/detection.md, as Markdown."""
    rules = load_rules(None).rules
    played = list(replays().values())
    fires: dict[str, list[str]] = defaultdict(list)  # cause -> table cells
    resolves: dict[str, list[str]] = defaultdict(list)
    twins: dict[str, list[str]] = defaultdict(list)
    false_twin: dict[str, list[str]] = defaultdict(list)
    false_other: dict[str, list[str]] = defaultdict(list)
    for r in played:
        s = under(r.scenario, "ptrace")  # the table: the daemon reading what it may
        count = s.node.gpu_count
        allowed: dict[tuple[int, str, str], float] = {}  # (gpu, GI id, cause) -> onset
        never: set[str] = set()
        for e in s.expect:
            if e.metric:  # what a fault shows outside the rules: no cause's row
                continue
            named = subjects(e.gpus, count)
            if e.never:
                never.add(e.cause)
                continue
            delays: list[float] = []
            resolved: list[float] = []
            still_firing = False
            for subject in named:
                allowed[(subject[0], subject[1], e.cause)] = float(e.onset)
                spans = r.spans(subject, e.cause)
                starts = [a for a, _ in spans if a >= e.onset]
                if starts:
                    delays.append(starts[0] - e.onset)
                if e.ends is not None and spans:
                    took = time_to_resolve(spans, e.ends)
                    if took is None:
                        still_firing = True
                    else:
                        resolved.append(took)
            span = "all GPUs" if e.gpus == "all" else "gpu " + ",".join(map(subject_label, named))
            fires[e.cause].append(
                f"`{s.name}` ({span}, onset {float(e.onset):.0f} s): {_seconds(delays)}"
            )
            if e.ends is not None:
                took_text = "still firing at the end" if still_firing else _seconds(resolved)
                resolves[e.cause].append(f"`{s.name}` ({span}, ends {e.ends:.0f} s): {took_text}")
        for cause in sorted(never):
            twins[cause].append(f"`{s.name}`")
        for cause, where in _false_firings(r, allowed):
            target = false_twin if cause in never else false_other
            target[cause].append(f"`{s.name}` {where}")
    lines = [
        "# Detection table",
        "",
        "Generated from the scenario corpus by `gpuwatchd rules detection` (kept current by",
        "tests/test_detection.py): every built-in scenario replayed in virtual time with the",
        "default rules and the default configuration.",
        "",
        "- **fired by**: the scenarios whose expectations say the cause fires, with the time",
        "  from the fault's onset (`onset` in the scenario's `expect`) to the first firing,",
        "  over the expected GPUs (a range when they differ). It includes the rule's `for`.",
        "- **time to resolve**: for the scenarios where the fault ends (`ends` in the",
        "  scenario's `expect`), the time from its end until the cause stopped firing (0 if",
        "  it had stopped before), over the expected GPUs. It includes the rule's",
        "  `keep_firing_for`.",
        "- **benign twins**: scenarios that say the cause must never fire (on some or all",
        "  GPUs: a fault scenario is also the twin of its healthy peer GPUs).",
        "- **false firings**: firings on a twin, or on any other scenario before the onset",
        "  or on a GPU no expectation names. Must be none.",
        "",
        f"{len(rules)} causes, {len(played)} scenarios.",
        "",
        "| cause | dimension | fired by (time from onset to firing) "
        "| time to resolve (fault end to firing stopped) | benign twins "
        "| false firings on twins | false firings elsewhere |",
        "|---|---|---|---|---|---|---|",
    ]
    missing = []
    for rule in rules:
        cause = rule.name
        if not fires.get(cause):
            missing.append(cause)
        lines.append(
            f"| `{cause}` | {rule.spec.dimension} | {'<br>'.join(fires[cause]) or '—'} "
            f"| {'<br>'.join(resolves[cause]) or '—'} "
            f"| {', '.join(twins[cause]) or '—'} "
            f"| {'<br>'.join(false_twin[cause]) or 'none'} "
            f"| {'<br>'.join(false_other[cause]) or 'none'} |"
        )
    lines += ["", "## Causes with no scenario yet", ""]
    if missing:
        lines += [f"- `{cause}`" for cause in missing]
    else:
        lines.append("Every cause of the default rules has a scenario that fires it.")
    unknown = sorted(set(fires) - {r.name for r in rules})
    if unknown:
        lines += ["", "## Expectations naming no rule", ""]
        lines += [f"- `{cause}`" for cause in unknown]
    return "\n".join(lines) + "\n"
