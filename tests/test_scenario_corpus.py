"""Every built-in scenario through `simulate --check`, and the corpus covers every rule."""

from __future__ import annotations

import pytest

from gpuwatchd.rules import load_rules
from gpuwatchd.sim.check import check, format_verdicts
from gpuwatchd.sim.detection import EVERYTHING, corpus, replay
from gpuwatchd.sim.scenario import builtin_scenarios, load_scenario


@pytest.mark.parametrize(("name", "privileges"), corpus(EVERYTHING))
def test_builtin_scenario_passes_its_check(name: str, privileges):
    """Each scenario with the daemon reading other users' ptrace-gated /proc files (root,
    or CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH) and as the unit and DaemonSet ship it
    (refused: issue 39 item 5)."""
    # all played at once, over the CPUs; cached for detection.md
    played = replay(name, privileges)
    verdicts = check(
        played.scenario,
        played.intervals,
        played.simulated_seconds,
        played.summaries,
        played.instances,  # an expectation on a MIG GPU instance ("0/2") is judged on its own
        privileges,
    )
    assert all(v.ok and v.reached for v in verdicts), format_verdicts(name, verdicts)


def test_every_default_rule_has_a_scenario_that_fires_it_and_a_twin_that_must_not():
    fires: set[str] = set()
    twins: set[str] = set()
    for name in builtin_scenarios():
        for e in load_scenario(name).expect:
            if e.cause:  # not the metric expectations
                (twins if e.never else fires).add(e.cause)
    rules = {r.name for r in load_rules(None).rules}
    assert rules - fires == set(), "rules no scenario fires"
    assert rules - twins == set(), "rules no scenario says must not fire"
    assert (fires | twins) - rules == set(), "expectations naming no rule"
