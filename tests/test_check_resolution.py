"""`simulate --check` on resolution: `ends` and `resolved_by` in a scenario's `expect`.

The intervals are built by hand, so no replay is needed.
"""

from __future__ import annotations

import pytest

from gpuwatchd.config import ConfigError
from gpuwatchd.sim.check import Intervals, Verdict, check, time_to_resolve
from gpuwatchd.sim.scenario import Scenario, load_scenario

CAUSE = "clock_throttled"
END = 900.0  # the scenario's end


def scenario(**expectation: object) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "t",
            "node": {"gpu_count": 2},
            "phases": [{"name": "p", "duration": END}],
            "expect": [
                {"cause": CAUSE, "gpus": [1], **expectation},
                {"cause": CAUSE, "gpus": [0], "never": True},
            ],
        }
    )


RESOLVING = {"onset": "4m", "by": "6m", "ends": "10m", "resolved_by": "13m"}


def verdict(spans: list[tuple[float, float | None]], **expectation: object) -> Verdict:
    intervals: Intervals = {(1, CAUSE): spans}
    verdicts = check(scenario(**(expectation or RESOLVING)), intervals, END)
    assert len(verdicts) == 2 and verdicts[1].ok  # gpu 0: never, and it did not
    return verdicts[0]


def test_resolves_in_time():
    v = verdict([(300.0, 700.0)])
    assert v.ok, v
    assert v.expected == "fires from 240s, by 360s; fault ends 600s, stopped by 780s"
    assert v.observed == "fired 60s after onset, stopped 100s after the fault ended"


def test_stopping_exactly_at_the_deadline_is_in_time():
    assert verdict([(300.0, 780.0)]).ok


def test_stopped_before_the_fault_ended_counts_zero():
    v = verdict([(300.0, 500.0)])
    assert v.ok
    assert v.observed.endswith("stopped 0s after the fault ended")


def test_flapping_within_the_grace_period_is_allowed():
    v = verdict([(300.0, 650.0), (700.0, 760.0)])
    assert v.ok, v
    assert "stopped 160s after" in v.observed


def test_resolves_late():
    v = verdict([(300.0, 830.0)])
    assert not v.ok
    assert "gpu 1 still firing at 780s (stopped at 830s)" in v.observed


def test_never_resolves():
    v = verdict([(300.0, None)])
    assert not v.ok
    assert v.observed == "fired 60s after onset; gpu 1 still firing at 780s"


def test_never_resolves_with_the_deadline_at_the_end():
    v = verdict([(300.0, None)], onset="4m", ends="10m")
    assert not v.ok
    assert v.expected == "fires from 240s, by 600s; fault ends 600s, stopped by 900s"
    assert "gpu 1 still firing at 900s, the end" in v.observed


def test_fires_again_after_resolving():
    v = verdict([(300.0, 700.0), (800.0, None)])
    assert not v.ok
    assert "gpu 1 fired again at 800s" in v.observed
    assert "still firing" not in v.observed  # the first span stopped in time
    assert "stopped 100s after the fault ended" in v.observed


def test_fires_again_exactly_at_the_deadline():
    v = verdict([(300.0, 700.0), (780.0, 790.0)])
    assert not v.ok
    assert "gpu 1 fired again at 780s" in v.observed


def test_starting_to_fire_after_the_fault_ended_is_a_miss():
    # `by` defaults to `ends`: the cause must have fired while the fault lasted
    v = verdict([(650.0, 700.0)], onset="4m", ends="10m", resolved_by="13m")
    assert not v.ok
    assert "gpu 1 missed" in v.observed


def test_expectations_without_ends_are_unchanged():
    v = verdict([(300.0, None)], onset="4m", by="6m")
    assert v.ok
    assert v.expected == "fires from 240s, by 360s"
    assert v.observed == "fired 60s after onset"
    v = verdict([(300.0, 700.0), (800.0, None)], onset="4m", by="6m")
    assert v.ok and v.observed == "fired 60s after onset"
    v = verdict([], onset="4m", by="6m")
    assert not v.ok and v.observed == "did not fire; gpu 1 missed"
    v = verdict([(100.0, 200.0), (300.0, None)], onset="4m")
    assert not v.ok and v.observed == "fired 60s after onset; gpu 1 fired early at 100s"


def test_did_not_fire_reports_no_resolution():
    v = verdict([])
    assert not v.ok
    assert v.observed == "did not fire; gpu 1 missed"


def test_time_to_resolve():
    assert time_to_resolve([(300.0, 700.0)], 600.0) == 100.0
    assert time_to_resolve([(300.0, 500.0)], 600.0) == 0.0
    assert time_to_resolve([(300.0, 650.0), (700.0, 760.0)], 600.0) == 160.0
    assert time_to_resolve([(300.0, 650.0), (700.0, None)], 600.0) is None


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"onset": "4m", "ends": "4m"}, "ends: must be after onset (240s), got 240s"),
        ({"onset": "4m", "ends": "3m"}, "ends: must be after onset (240s), got 180s"),
        (
            {"onset": "4m", "ends": "10m", "resolved_by": "9m"},
            "resolved_by: must not be before ends (600s), got 540s",
        ),
        ({"onset": "4m", "resolved_by": "9m"}, "resolved_by: needs ends"),
        ({"onset": "4m", "by": "11m", "ends": "10m"}, "by: must not be after ends (600s)"),
        ({"never": True, "ends": "10m"}, "ends: not with never: true"),
    ],
)
def test_invalid_resolution_fields_name_the_field(tmp_path, fields, error):
    path = tmp_path / "bad.yaml"
    entry = ", ".join(
        f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()
    )
    path.write_text(
        "name: bad\nphases: [{name: p, duration: 15m}]\n"
        f"expect:\n  - {{cause: {CAUSE}, {entry}}}\n"
    )
    with pytest.raises(ConfigError) as raised:
        load_scenario(path)
    assert f"{path}: expect.0: {error}" in str(raised.value)


def test_resolved_by_equal_to_ends_is_valid():
    e = scenario(onset="4m", ends="10m", resolved_by="10m").expect[0]
    assert (e.ends, e.resolved_by) == (600.0, 600.0)


def test_a_mig_gpus_instances_keep_their_own_intervals():
    """Two instances of GPU 1 fire the same cause, overlapping: each resolution closes its
    own instance's interval, not the other's."""
    from gpuwatchd.rules.engine import FIRING, INACTIVE, Transition
    from gpuwatchd.sim.check import firing_intervals

    def t(at: float, instance: str, old: str, new: str) -> Transition:
        return Transition(at, "1", "GPU-b", CAUSE, old, new, "", (), instance)

    transitions = [
        t(10, "1", INACTIVE, FIRING),
        t(20, "2", INACTIVE, FIRING),
        t(30, "1", FIRING, INACTIVE),
    ]
    assert firing_intervals(transitions, 0) == {(1, CAUSE): [(10, 30), (20, None)]}
