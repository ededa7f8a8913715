"""The rules engine on a virtual clock: state machine, not evaluable, windows, joins."""

from __future__ import annotations

import functools
import math

import pytest

from gpuwatchd.metrics import Sample
from gpuwatchd.rules import Catalog, RuleEngine, RulesError, parse_rules
from gpuwatchd.rules.engine import FIRING, INACTIVE, NOT_EVALUABLE, PENDING
from gpuwatchd.rules.evaluator import _increase, _quantile
from gpuwatchd.sim.scenario import Expectation
from gpuwatchd.store import Store

CATALOG = Catalog.builtin()
GPUS = [("0", "GPU-a", "0000:13:00.0"), ("1", "GPU-b", "0000:14:00.0")]


def rule(expr: str, for_: str = "0s", keep: str = "0s", name: str = "cause_x") -> str:
    return f"""
rules:
  - name: {name}
    dimension: compute
    severity: warning
    expr: "{expr}"
    for: {for_}
    keep_firing_for: {keep}
    summary: "util {{{{ gpu_utilization_ratio * 100 }}}}%"
    remedy: fix it
"""


class Node:
    """A store fed by hand, as the sources would, and an engine over it."""

    def __init__(self, text: str, up: tuple[str, ...] = ("nvml", "pcie", "processes", "cpu")):
        self.store = Store(history_seconds=600)
        self.up = set(up)
        self.engine = RuleEngine(
            self.store, parse_rules(text, "test.yaml", CATALOG), self.up.__contains__, CATALOG
        )

    def nvml(self, now: float, **per_gpu: list[float]) -> None:
        samples = []
        for i, (gpu, uuid, bus) in enumerate(GPUS):
            labels = (gpu, uuid)
            samples.append(Sample("gpuwatchd_gpu_info", (*labels, "A100", bus, "550", "12.4"), 1))
            for name, values in per_gpu.items():
                samples.append(Sample(f"gpuwatchd_{name}", labels, values[i]))
        self.store.update("nvml", now, samples)

    def state(self, gpu: int = 0, cause: str = "cause_x") -> str:
        return self.engine.states[(GPUS[gpu][1], cause)].state

    def step(self, now: float, **per_gpu: list[float]) -> str:
        self.nvml(now, **per_gpu)
        self.engine.evaluate(now)
        return self.state()


def test_for_and_keep_firing_for_follow_prometheus():
    node = Node(rule("gpu_utilization_ratio > 0.5", for_="30s", keep="60s"))
    high, low = [0.9, 0.1], [0.1, 0.1]
    assert node.step(0, gpu_utilization_ratio=high) == PENDING
    assert node.step(20, gpu_utilization_ratio=high) == PENDING
    assert node.step(30, gpu_utilization_ratio=high) == FIRING  # 30s after active_at
    assert node.state(gpu=1) == INACTIVE
    assert node.step(40, gpu_utilization_ratio=low) == FIRING  # keep_firing_for from 40
    assert node.step(90, gpu_utilization_ratio=low) == FIRING
    assert node.step(100, gpu_utilization_ratio=low) == INACTIVE  # 60s since 40
    # holding again during keep_firing_for cancels the countdown
    for t in (110, 140):
        node.step(t, gpu_utilization_ratio=high)
    assert node.state() == FIRING
    assert node.step(150, gpu_utilization_ratio=low) == FIRING
    assert node.step(160, gpu_utilization_ratio=high) == FIRING
    assert node.step(215, gpu_utilization_ratio=low) == FIRING
    assert node.step(275, gpu_utilization_ratio=low) == INACTIVE


def test_pending_that_stops_holding_goes_back_to_inactive_and_for_zero_fires_at_once():
    node = Node(rule("gpu_utilization_ratio > 0.5", for_="1m"))
    assert node.step(0, gpu_utilization_ratio=[0.9, 0]) == PENDING
    assert node.step(30, gpu_utilization_ratio=[0.1, 0]) == INACTIVE
    assert node.step(40, gpu_utilization_ratio=[0.9, 0]) == PENDING
    assert node.step(99, gpu_utilization_ratio=[0.9, 0]) == PENDING
    assert node.step(100, gpu_utilization_ratio=[0.9, 0]) == FIRING
    instant = Node(rule("gpu_utilization_ratio > 0.5"))
    assert instant.step(0, gpu_utilization_ratio=[0.9, 0]) == FIRING
    assert instant.step(1, gpu_utilization_ratio=[0.1, 0]) == INACTIVE


def test_derived_series_only_for_causes_in_a_state():
    """Sparse: a series per GPU x rule only while it fires, is pending or not evaluable
    (a healthy node exports none); the seconds counter from the first pending on."""
    node = Node(rule("gpu_utilization_ratio > 0.5", for_="10s"))
    node.step(0, gpu_utilization_ratio=[0.9, 0.1])  # pending on GPU 0 (its `for`)
    rows = node.engine.rows()
    assert dict(rows["gpuwatchd_starvation_pending"]) == {("0", "GPU-a", "cause_x", ""): 1}
    assert rows["gpuwatchd_starvation_active"] == [] and rows["gpuwatchd_starvation_info"] == []
    assert dict(rows["gpuwatchd_starvation_seconds_total"]) == {("0", "GPU-a", "cause_x", ""): 0}
    for t in range(10, 50, 10):
        node.step(t, gpu_utilization_ratio=[0.9, 0.1])
    rows = node.engine.rows()
    active = dict(rows["gpuwatchd_starvation_active"])
    assert active == {("0", "GPU-a", "cause_x", "compute", "warning", ""): 1}  # GPU 1: none
    assert rows["gpuwatchd_starvation_pending"] == []
    assert dict(rows["gpuwatchd_starvation_seconds_total"]) == {("0", "GPU-a", "cause_x", ""): 30}
    assert rows["gpuwatchd_rule_evaluation_errors_total"] == []  # no error: no series
    assert dict(rows["gpuwatchd_gpu_starved"]) == {("0", "GPU-a"): 1, ("1", "GPU-b"): 0}
    assert dict(rows["gpuwatchd_rules"]) == {(): 1}
    assert dict(rows["gpuwatchd_rules_last_reload_successful"]) == {(): 1}
    assert node.engine.firing() == [("0", "cause_x", "util 90%")]
    # the firing cause's evidence (frozen when it started firing) and remedy, GPU 0 only
    ((labels, value),) = rows["gpuwatchd_starvation_info"]
    assert value == 1
    assert labels[:5] == ("0", "GPU-a", "cause_x", "compute", "warning")
    assert labels[5] == "util 90%"
    assert labels[6] == node.engine.rules.rules[0].remedy != ""


def test_a_rule_reading_a_source_that_is_down_is_not_evaluable():
    node = Node(rule("gpu_utilization_ratio < 2 or gpu_sm_active_ratio < 0.1"))  # no dcgm
    assert node.step(0, gpu_utilization_ratio=[0.9, 0.1]) == NOT_EVALUABLE
    rows = node.engine.rows()
    assert dict(rows["gpuwatchd_starvation_not_evaluable"])[("0", "GPU-a", "cause_x", "")] == 1
    assert rows["gpuwatchd_starvation_active"] == []
    assert "dcgm" in node.engine.states[("GPU-a", "cause_x")].reason


def test_a_series_without_a_value_for_the_gpu_makes_it_not_evaluable():
    node = Node(rule("gpu_temperature_celsius > 80"))  # nvml up, series absent
    assert node.step(0, gpu_utilization_ratio=[0.9, 0.1]) == NOT_EVALUABLE
    assert "gpu_temperature_celsius" in node.engine.states[("GPU-a", "cause_x")].reason
    # present() and default() are not inputs that must exist
    guarded = Node(rule("present(gpu_temperature_celsius) and gpu_temperature_celsius > 80"))
    assert guarded.step(0, gpu_utilization_ratio=[0.9, 0.1]) == INACTIVE
    fallback = Node(rule("default(gpu_temperature_celsius, 99) > 80"))
    assert fallback.step(0, gpu_utilization_ratio=[0.9, 0.1]) == FIRING
    # recovering from not evaluable starts over at pending
    node2 = Node(rule("gpu_temperature_celsius > 80", for_="10s"))
    assert node2.step(0, gpu_utilization_ratio=[0.9, 0.1]) == NOT_EVALUABLE
    assert node2.step(5, gpu_temperature_celsius=[90, 30]) == PENDING


def test_window_functions_over_the_store_history():
    node = Node(
        rule(
            "avg_over(gpu_utilization_ratio, '30s') == 0.5 and min_over(gpu_utilization_ratio,"
            " '30s') == 0.2 and max_over(gpu_utilization_ratio, '30s') == 0.8"
            " and quantile_over(0.5, gpu_utilization_ratio, '30s') == 0.5"
        )
    )
    for t, value in ((0, 0.0), (10, 0.2), (20, 0.8), (30, 0.5), (40, 0.5)):
        node.step(t, gpu_utilization_ratio=[value, 0])
    assert node.state() == FIRING  # window [10, 40]: 0.2 0.8 0.5 0.5


def test_rate_and_change_handle_counter_resets():
    node = Node(
        rule(
            "change(gpu_pcie_replay_errors_total, '1m') == 30"
            " and rate(gpu_pcie_replay_errors_total, '1m') == 0.5"
        )
    )
    for t, value in ((0, 100), (20, 110), (40, 5), (60, 20)):  # reset between 20 and 40
        node.step(t, gpu_pcie_replay_errors_total=[value, 0])
    assert node.state() == FIRING  # 10 + 5 + 15 over 60s
    assert _increase([(0, 1), (1, 3)]) == (2, 1)
    assert _increase([(0, 1)]) == (0, 0)
    assert _quantile(0.9, [1, 2, 3, 4, 5]) == pytest.approx(4.6)
    assert math.isnan(_quantile(2, [1.0]))


def test_labelled_families_multi_series_change_sums_and_selectors_pick():
    node = Node(
        rule(
            "change(gpu_xid_errors_total, '5m') >= 3"
            " and series('gpu_clock_event_reason_active', reason='hw_slowdown') == 1"
            " and max(gpu_clock_event_reason_active) == 1"
            " and count(gpu_clock_event_reason_active) == 2"
        )
    )
    for t, (x13, x79) in enumerate(((0, 0), (1, 1), (2, 2))):
        samples = [
            Sample("gpuwatchd_gpu_info", ("0", "GPU-a", "A100", "0000:13:00.0", "550", "12.4"), 1),
            Sample("gpuwatchd_gpu_xid_errors_total", ("0", "GPU-a", "13"), x13),
            Sample("gpuwatchd_gpu_xid_errors_total", ("0", "GPU-a", "79"), x79 * 2),
            Sample("gpuwatchd_gpu_clock_event_reason_active", ("0", "GPU-a", "hw_slowdown"), 1),
            Sample("gpuwatchd_gpu_clock_event_reason_active", ("0", "GPU-a", "gpu_idle"), 0),
        ]
        node.store.update("nvml", t * 10, samples)  # a poll replaces the source's series
        node.engine.evaluate(t * 10)
    assert node.state() == FIRING  # 2 + 4 = 6 increases, summed over the xid series


def test_pcie_series_join_on_the_gpu_bus_id_and_host_series_reach_every_gpu():
    node = Node(
        rule(
            "max(pcie_link_degraded) > 0 and series('pcie_link_degraded', role='gpu')"
            " == 0 and cpu_iowait_ratio < 0.5"
        )
    )
    node.nvml(0, gpu_utilization_ratio=[0.9, 0.9])
    node.store.update(
        "pcie",
        0,
        [
            Sample("gpuwatchd_pcie_link_degraded", ("0000:13:00.0", "0000:13:00.0", "gpu"), 0),
            Sample("gpuwatchd_pcie_link_degraded", ("0000:13:00.0", "0000:11:00.0", "bridge"), 1),
            Sample("gpuwatchd_pcie_link_degraded", ("0000:14:00.0", "0000:14:00.0", "gpu"), 0),
            Sample("gpuwatchd_pcie_link_degraded", ("0000:14:00.0", "0000:12:00.0", "bridge"), 0),
        ],
    )
    node.store.update("cpu", 0, [Sample("gpuwatchd_cpu_iowait_ratio", (), 0.01)])
    node.engine.evaluate(0)
    assert node.state(0) == FIRING  # the bridge above GPU 0 is degraded
    assert node.state(1) == INACTIVE


def test_a_selector_with_two_matchers_reads_the_series_both_match():
    """Each GPU has a series matching only the device, one matching only the role; GPU
    0 also one matching both: only there is the selector's series present."""
    node = Node(rule("present(series('pcie_link_degraded', device='0000:11:00.0', role='gpu'))"))
    node.nvml(0, gpu_utilization_ratio=[0.9, 0.9])
    partial = [("0000:11:00.0", "bridge"), ("0000:10:00.0", "gpu")]
    samples = [
        Sample("gpuwatchd_pcie_link_degraded", (bus, device, role), 0)
        for bus, links in (("0000:13:00.0", [*partial, ("0000:11:00.0", "gpu")]),
                           ("0000:14:00.0", partial))
        for device, role in links
    ]  # fmt: skip
    node.store.update("pcie", 0, samples)
    node.engine.evaluate(0)
    assert (node.state(0), node.state(1)) == (FIRING, INACTIVE)


def test_peers_are_the_other_gpus_of_the_same_job():
    """DDP: one process per GPU; the job (their common launcher) makes them peers."""
    straggler = (
        "gpu_utilization_ratio < 0.1 and count(peers(gpu_utilization_ratio)) == 1"
        " and min(peers(gpu_utilization_ratio)) > 0.8"
    )
    node = Node(rule(straggler))
    compiled = node.engine.rules.rules[0].expr
    assert "processes" not in compiled.sources  # the grouping is read, never required

    def processes(now: float, pids: tuple[int, int], jobs: tuple[int, int] | None) -> None:
        samples = [
            Sample("gpuwatchd_gpu_process_pid", (gpu, uuid), pid)
            for (gpu, uuid, _), pid in zip(GPUS, pids, strict=True)
        ]
        if jobs is not None:
            samples += [
                Sample("gpuwatchd_gpu_process_job", (gpu, uuid), job)
                for (gpu, uuid, _), job in zip(GPUS, jobs, strict=True)
            ]
        node.store.update("processes", now, samples)
        node.nvml(now, gpu_utilization_ratio=[0.0, 0.95])
        node.engine.evaluate(now)

    processes(0, (6001, 6002), (6000, 6000))  # two ranks of one torchrun
    assert (node.state(0), node.state(1)) == (FIRING, INACTIVE)
    processes(10, (6001, 6002), (6001, 6002))  # two jobs of their own
    assert node.state(0) == INACTIVE
    processes(20, (42, 42), (7, 8))  # the job series decides, not the pid
    assert node.state(0) == INACTIVE
    processes(30, (42, 43), (7, 7))
    assert node.state(0) == FIRING

    # the engine indexes the job series for peers() even when no rule names it
    assert "gpuwatchd_gpu_process_job" in node.engine.index.scopes
    # a rule without peers() does not make the engine read it
    other = Node(rule("gpu_utilization_ratio < 0.1"))
    assert "gpuwatchd_gpu_process_job" not in other.engine.index.scopes


def test_lowest_peer_names_the_least_busy_other_gpu_of_the_job():
    """lowest_peer() is the `gpu` index of the job's other GPU where the series is lowest;
    without peers it has no value (the rule is not evaluable, never firing)."""
    node = Node(rule("lowest_peer(gpu_utilization_ratio) == 1"))
    jobs = [Sample("gpuwatchd_gpu_process_job", (gpu, uuid), 7) for gpu, uuid, _ in GPUS]
    node.store.update("processes", 0, jobs)
    node.step(0, gpu_utilization_ratio=[0.0, 0.95])
    assert (node.state(0), node.state(1)) == (FIRING, INACTIVE)  # GPU 1's peer is GPU 0
    node.store.update("processes", 10, [])  # no job, no peers
    node.step(10, gpu_utilization_ratio=[0.0, 0.95])
    assert node.state(0) != FIRING
    with pytest.raises(RulesError, match="lowest_peer"):
        parse_rules(rule("lowest_peer(gpu_utilization_ratio, 2) > 0"), "t", CATALOG)



def test_peers_of_an_expression_judges_each_peer_as_its_own_gpu():
    """peers(expr) evaluates `expr` on each other GPU of the job as if it were the one
    judged (its own series, windows included); a peer where it has no value is left out;
    highest_peer(expr) names the peer where it is highest (issue 39: judge a peer with the
    rule's own idle test, not one series)."""
    busy = "gpu_utilization_ratio > 0.5 and gpu_power_watts > 200"
    node = Node(rule(f"sum(peers({busy})) >= 1 and highest_peer({busy}) == 1"))
    jobs = [Sample("gpuwatchd_gpu_process_job", (gpu, uuid), 7) for gpu, uuid, _ in GPUS]
    node.store.update("processes", 0, jobs)
    # GPU 1 busy by utilization alone, at low power: not busy by the expression
    node.step(0, gpu_utilization_ratio=[0.1, 0.9], gpu_power_watts=[80, 90])
    assert node.state(0) == INACTIVE
    node.step(10, gpu_utilization_ratio=[0.1, 0.9], gpu_power_watts=[80, 300])
    assert node.state(0) == FIRING
    assert node.state(1) == INACTIVE  # its peer (GPU 0) is not busy
    # a peer without the series is left out, not an error on the judged GPU
    node.nvml(20, gpu_utilization_ratio=[0.1, 0.9])
    node.engine.evaluate(20)
    assert node.state(0) == INACTIVE
    # windows read the peer's own history
    windowed = Node(rule("max(peers(max_over(gpu_power_watts, '1m'))) > 250"))
    windowed.store.update("processes", 0, jobs)
    windowed.step(0, gpu_utilization_ratio=[0.1, 0.9], gpu_power_watts=[80, 300])
    windowed.step(30, gpu_utilization_ratio=[0.1, 0.9], gpu_power_watts=[80, 100])
    assert windowed.state(0) == FIRING and windowed.state(1) == INACTIVE
    windowed.step(100, gpu_utilization_ratio=[0.1, 0.9], gpu_power_watts=[80, 100])
    assert windowed.state(0) == INACTIVE
    with pytest.raises(RulesError, match="peers\\(\\): expected a series or a number"):
        parse_rules(rule("max(peers('5m')) > 0"), "t", CATALOG)

def summary_rule(summary: str) -> str:
    return rule("gpu_utilization_ratio > 0.5").replace(
        'summary: "util {{ gpu_utilization_ratio * 100 }}%"', f"summary: >\n      {summary}"
    )


def test_a_summary_never_prints_a_value_it_does_not_have():
    """An optional [[ clause ]] drops out where one of its values has none (when()'s
    condition is false, no peer, an absent series); a value outside one reads "unknown"
    and is reported missing, so `simulate --check` can flag it (issue 22, class 6)."""
    node = Node(
        summary_rule(
            "util {{ gpu_utilization_ratio * 100 }}%[[, temp {{ gpu_temperature_celsius }} C]]"
            "[[; busiest peer GPU {{ when(max(peers(gpu_utilization_ratio)) > 0.5,"
            " highest_peer(gpu_utilization_ratio)) }}]]"
            "; power {{ gpu_power_watts }} W"
        )
    )
    jobs = [Sample("gpuwatchd_gpu_process_job", (gpu, uuid), 7) for gpu, uuid, _ in GPUS]
    node.store.update("processes", 0, jobs)
    node.step(0, gpu_utilization_ratio=[0.9, 0.8])
    state = node.engine.states[("GPU-a", "cause_x")]
    assert state.state == FIRING
    assert state.summary == "util 90%; busiest peer GPU 1; power unknown W"
    assert state.missing == ("gpu_power_watts",)
    rule_ = node.engine.rules.rules[0]
    node.step(10, gpu_utilization_ratio=[0.9, 0.2], gpu_temperature_celsius=[61, 60])
    summary, _ = node.engine.evidence(rule_, node.engine.gpus["GPU-a"])
    assert summary == "util 90%, temp 61 C; power unknown W"  # the peer under 0.5: no clause
    node.step(20, gpu_utilization_ratio=[0.9, 0.2], gpu_power_watts=[300, 90])
    assert node.engine.evidence(rule_, node.engine.gpus["GPU-a"]) == ("util 90%; power 300 W", ())
    # a mistake inside a clause is a load error like any other, naming the placeholder
    with pytest.raises(RulesError, match="gpu_tempreature"):
        parse_rules(summary_rule("[[ t {{ gpu_tempreature_celsius }} ]]"), "t", CATALOG)
    with pytest.raises(RulesError, match="when"):
        parse_rules(summary_rule("{{ when(1) }}"), "t", CATALOG)



def test_names_lists_the_places_a_summary_points_at():
    """names(s, template) tells each nonzero series of `s` for this GPU by its labels and
    the same-labelled series of other families (issue 39, class 4: the on-call acts on
    the name); without one, an optional clause drops out."""
    reasons = "gpu_clock_event_reason_active"
    node = Node(
        summary_rule(
            "held by {{ names(" + reasons + ", '{reason}') }}"
            "[[; Xids {{ names(gpu_xid_errors_total, '{xid} x{gpu_xid_errors_total}') }}]]"
        )
    )

    def reason_rows(now: float, active: dict[str, float]) -> None:
        node.store.update("clocks", now, [
            Sample(f"gpuwatchd_{reasons}", ("0", "GPU-a", reason), value)
            for reason, value in active.items()
        ])

    reason_rows(0, {"sw_power_cap": 1, "hw_slowdown": 1, "gpu_idle": 0})
    node.step(0, gpu_utilization_ratio=[0.9, 0.1])
    state = node.engine.states[("GPU-a", "cause_x")]
    assert state.summary == "held by hw_slowdown, sw_power_cap"  # sorted; 0 left out
    many = {f"r{i:02}": 1.0 for i in range(11)}
    reason_rows(10, many)
    node.store.update("xids", 10, [
        Sample("gpuwatchd_gpu_xid_errors_total", ("0", "GPU-a", "79"), 2),
    ])
    node.step(10, gpu_utilization_ratio=[0.9, 0.1])
    rule_ = node.engine.rules.rules[0]
    summary, _ = node.engine.evidence(rule_, node.engine.gpus["GPU-a"])
    assert summary == (
        "held by r00, r01, r02, r03, r04, r05, r06, r07 and 3 more; Xids 79 x2"
    )
    with pytest.raises(RulesError, match=r"\{gpu_power_watts\} is neither a label"):
        parse_rules(summary_rule("{{ names(" + reasons + ", '{gpu_power_watts}') }}"), "t", CATALOG)
    with pytest.raises(RulesError, match="template string"):
        parse_rules(summary_rule("{{ names(" + reasons + ") }}"), "t", CATALOG)

def test_check_flags_a_firing_summary_with_a_missing_value():
    from gpuwatchd.rules.engine import Transition
    from gpuwatchd.sim.check import check, firing_summaries
    from gpuwatchd.sim.scenario import load_scenario

    scenario = load_scenario("nccl-stall")
    transitions = [
        Transition(10, "0", "GPU-a", "nccl_stall", PENDING, FIRING, "GPU unknown", ("x",)),
        Transition(10, "1", "GPU-b", "nccl_stall", PENDING, FIRING, "GPU 0", ()),
    ]
    summaries = firing_summaries(transitions)
    assert summaries[(0, "nccl_stall")] == [("GPU unknown", ("x",))]
    verdicts = check(scenario, {}, 60, summaries)
    assert [v.observed for v in verdicts if v.gpus == "0" and not v.ok] == ["no value for x"]
    # an expectation's `summary`: the text each firing summary must contain
    scenario = scenario.model_copy(update={"expect": [
        Expectation(cause="nccl_stall", gpus=[0, 1], summary="GPU 0")]})  # fmt: skip
    intervals = {(0, "nccl_stall"): [(10.0, None)], (1, "nccl_stall"): [(10.0, None)]}
    summaries = firing_summaries(transitions[1:])
    assert all(v.ok for v in check(scenario, intervals, 60, summaries))
    summaries[(0, "nccl_stall")] = [("GPU 1 idle", ())]
    (verdict,) = check(scenario, intervals, 60, summaries)
    assert not verdict.ok and "gpu 0's summary lacks 'GPU 0': 'GPU 1 idle'" in verdict.observed


def test_peers_are_the_other_gpus_of_the_same_process():
    """Without the job series (a processes source that does not export it): by pid."""
    node = Node(
        rule(
            "gpu_utilization_ratio < 0.1 and count(peers(gpu_utilization_ratio)) == 1"
            " and min(peers(gpu_utilization_ratio)) > 0.8"
        )
    )
    node.nvml(0, gpu_utilization_ratio=[0.0, 0.95])
    node.store.update(
        "processes",
        0,
        [
            Sample("gpuwatchd_gpu_process_pid", ("0", "GPU-a"), 42),
            Sample("gpuwatchd_gpu_process_pid", ("1", "GPU-b"), 42),
        ],
    )
    node.engine.evaluate(0)
    assert (node.state(0), node.state(1)) == (FIRING, INACTIVE)
    node.store.update(
        "processes",
        10,
        [
            Sample("gpuwatchd_gpu_process_pid", ("0", "GPU-a"), 42),
            Sample("gpuwatchd_gpu_process_pid", ("1", "GPU-b"), 43),
        ],
    )
    node.nvml(10, gpu_utilization_ratio=[0.0, 0.95])
    node.engine.evaluate(10)
    assert node.state(0) == INACTIVE  # not the same process any more


def test_division_by_zero_is_not_evaluable_and_an_error_is_counted(monkeypatch):
    text = (
        rule("gpu_utilization_ratio / (gpu_utilization_ratio - 0.5) > 1", name="div")
        + (rule("gpu_utilization_ratio > 0.4", name="other").split("rules:\n", 1)[1])
    )
    node = Node(text)
    node.nvml(0, gpu_utilization_ratio=[0.5, 0.5])
    node.engine.evaluate(0)
    assert node.state(0, "div") == NOT_EVALUABLE  # x / 0: no value, not an error
    assert node.state(0, "other") == FIRING
    evaluate = node.engine.evaluator.evaluate

    def broken(compiled, gpu, reads=None):
        if "0.4" in compiled.text:
            raise RuntimeError("boom")
        return evaluate(compiled, gpu, reads)

    monkeypatch.setattr(node.engine.evaluator, "evaluate", broken)
    node.nvml(10, gpu_utilization_ratio=[0.6, 0.6])  # new values: evaluated again
    node.engine.evaluate(10)
    assert node.state(0, "other") == NOT_EVALUABLE
    assert dict(node.engine.rows()["gpuwatchd_rule_evaluation_errors_total"]) == {
        ("other",): 2,  # a rule without errors exports none
    }


def test_reloading_keeps_state_of_rules_kept_by_name():
    node = Node(rule("gpu_utilization_ratio > 0.5", for_="1m"))
    node.step(0, gpu_utilization_ratio=[0.9, 0])
    node.engine.set_rules(parse_rules(rule("gpu_utilization_ratio > 0.6", for_="1m"), "t", CATALOG))
    assert node.step(60, gpu_utilization_ratio=[0.9, 0]) == FIRING
    node.engine.set_rules(parse_rules(rule("gpu_utilization_ratio > 0.6", name="y"), "t", CATALOG))
    assert ("GPU-a", "cause_x") not in node.engine.states


# -- evaluating only what can change ------------------------------------------------------


def counting(node: Node) -> list[str]:
    """Every evaluation of a rule's expression (not of its summary), by its text."""
    seen: list[str] = []
    evaluate = node.engine.evaluator.evaluate

    def count(compiled, gpu, reads=None):
        if reads is not None:
            seen.append(compiled.text)
        return evaluate(compiled, gpu, reads)

    node.engine.evaluator.evaluate = count  # type: ignore[method-assign]
    return seen


def test_unchanged_inputs_are_not_evaluated_again_but_for_and_keep_still_advance():
    node = Node(rule("gpu_utilization_ratio > 0.5", for_="30s", keep="60s"))
    seen = counting(node)
    high, low = [0.9, 0.1], [0.1, 0.1]
    assert node.step(0, gpu_utilization_ratio=high) == PENDING
    assert len(seen) == 2  # once per GPU
    for t in range(1, 30):  # the source polls with the same values: nothing to evaluate
        assert node.step(t, gpu_utilization_ratio=high) == PENDING
    node.engine.evaluate(30)  # no poll at all: `for` is still judged at 30 s
    assert node.state() == FIRING and len(seen) == 2
    assert node.step(40, gpu_utilization_ratio=low) == FIRING  # changed: evaluated
    assert len(seen) == 3  # on GPU 0 only: GPU 1 reads 0.1 as before
    node.engine.evaluate(99)
    assert node.state() == FIRING
    node.engine.evaluate(100)
    assert node.state() == INACTIVE and len(seen) == 3  # keep_firing_for ran out


def test_only_what_an_evaluation_read_counts_and_windows_age():
    # a false guard: the window behind it was not read, so new points do not matter
    node = Node(rule("gpu_compute_processes > 0 and avg_over(gpu_utilization_ratio, '30s') > 0.5"))
    seen = counting(node)
    for t in range(0, 20):
        node.step(t, gpu_utilization_ratio=[0.9, 0.9], gpu_compute_processes=[0, 0])
    assert len(seen) == 2
    # the guard holds: the window is read, and a new point may change it
    node.step(20, gpu_utilization_ratio=[0.9, 0.7], gpu_compute_processes=[1, 1])
    assert node.state() == FIRING and len(seen) == 4
    # GPU 1's window holds 0.9 and 0.7: a new point is news; GPU 0's holds 0.9 only:
    # more points of 0.9 change nothing ...
    node.step(21, gpu_utilization_ratio=[0.9, 0.7], gpu_compute_processes=[1, 1])
    assert len(seen) == 5
    node.step(22, gpu_utilization_ratio=[0.9, 0.7], gpu_compute_processes=[1, 1])
    assert len(seen) == 6
    node.engine.evaluate(50)  # no polls since: GPU 1's oldest point (0 s) left at 30 s
    assert len(seen) == 7
    # ... until the newest point its evaluation saw (20 s) leaves GPU 0's window
    node.engine.evaluate(50.5)
    assert len(seen) == 8
    node.engine.evaluate(52.5)  # then the last points (22 s) leave both: empty windows
    assert len(seen) == 10 and node.state() == NOT_EVALUABLE


def test_time_is_read_again_only_where_a_comparison_can_flip():
    """A rule reading time() only in a comparison that flips once (the last Xid's age
    against 10 minutes) is evaluated again within TIME_HORIZON of its flip, not every
    cycle, and flips at the second it does when evaluated every cycle."""
    node = Node(rule("time() - default(gpu_last_xid_timestamp_seconds, 0) < 600"))
    seen = counting(node)
    ended: dict[int, int] = {}
    for t in range(1201):
        node.step(t, gpu_last_xid_timestamp_seconds=[0.0, 500.0])
        for gpu in (0, 1):
            if node.state(gpu) == INACTIVE:
                ended.setdefault(gpu, t)
    assert ended == {0: 600, 1: 1100}
    # each GPU: once a minute, and each cycle in the minute before its flip
    assert len(seen) <= 2 * (1201 // 60 + 60 + 2)


TIMED = [
    "time() - default(gpu_last_xid_timestamp_seconds, 0) < 600",
    "time() - default(gpu_last_xid_timestamp_seconds, 0) > 300 and gpu_utilization_ratio < 0.5",
    "max(time() - 450, 0) - gpu_last_xid_timestamp_seconds >= -100",
    # a series missing only while the first comparison is false and the second true
    "(time() - gpu_last_xid_timestamp_seconds > 300 or (time() - gpu_last_xid_timestamp_seconds"
    " > 100 and gpu_power_watts > 0)) and time() - gpu_last_xid_timestamp_seconds < 700",
    # not monotone in time(), true for less than TIME_HORIZON: evaluated every cycle
    "abs(time() - gpu_last_xid_timestamp_seconds - 300) < 20",
    "100 < time() - gpu_last_xid_timestamp_seconds < 130",
    # both sides grow with time(): they cross twice
    "max(time(), gpu_last_xid_timestamp_seconds + 100)"
    " <= min(time(), gpu_last_xid_timestamp_seconds + 130)",
    # a comparison that can be told beside a time() that cannot: evaluated every cycle
    "time() - gpu_last_xid_timestamp_seconds < 400 and abs(time() - 1000) > 10",
]
EVERY_CYCLE = ("abs", "100 <", "max(time(), ", "time() - gpu_last_xid_timestamp_seconds < 400 and")


@pytest.mark.parametrize("expr", TIMED)
def test_time_rules_skipped_come_out_as_evaluated_every_cycle(monkeypatch, expr):
    from gpuwatchd.rules.evaluator import Reads

    def replay() -> tuple[list[tuple[int, str, str, str]], int]:
        node = Node(rule(expr, for_="5s", keep="10s"))
        seen = counting(node)
        states = []
        for t in range(1300):
            node.step(t, gpu_last_xid_timestamp_seconds=[0, 500], gpu_utilization_ratio=[0.9, 0.1])
            for gpu in (0, 1):
                state = node.engine.states[(GPUS[gpu][1], "cause_x")]
                states.append((t, GPUS[gpu][0], state.state, state.reason))
        return states, len(seen)

    skipping, evaluations = replay()
    with monkeypatch.context() as patched:
        patched.setattr(Reads, "still", lambda self, now, changed, polled: False)
        patched.setattr(RuleEngine, "skipping", False)
        every_cycle, all_of_them = replay()
    assert skipping == every_cycle
    assert {s for _, _, s, _ in skipping} >= {INACTIVE, FIRING}
    monotone = not expr.startswith(EVERY_CYCLE)
    assert (evaluations < all_of_them / 2) if monotone else evaluations == all_of_them


def test_a_window_of_equal_points_gives_their_value_however_many(monkeypatch):
    """Skipped while its points are all the same, a window's function must come out as
    it would evaluated each cycle: the average of three 0.7s is 0.7, not fsum's
    0.6999999999999998."""
    from gpuwatchd.rules.evaluator import Reads

    monkeypatch.setattr(Reads, "still", lambda self, now, changed, polled: False)
    for expr in (
        "avg_over(gpu_utilization_ratio, '2m') < 0.7",
        "quantile_over(0.3, gpu_utilization_ratio, '2m') < 0.7",
        "stddev_over(gpu_utilization_ratio, '2m') > 0",
    ):
        node = Node(rule(expr))
        states = {node.step(t, gpu_utilization_ratio=[0.7, 0.7]) for t in range(10)}
        assert states == {INACTIVE}, expr


@pytest.mark.parametrize(
    "scenario, until",
    [
        ("straggler-gpu", 450),
        ("bursty-input-pipeline", 200),
        ("ecc-uncorrectable-xid", 260),
        ("nccl-stall", 450),
        ("mig-dataloader-one-instance-h100", 240),
    ],
)
def test_skipping_changes_no_transition(monkeypatch, scenario, until):
    """Replays with every rule evaluated on every cycle and with the skipping: the same
    transitions at the same times, details included."""
    from gpuwatchd.config import Config
    from gpuwatchd.rules.evaluator import Reads
    from gpuwatchd.sim.scenario import load_scenario
    from gpuwatchd.simulate import Simulation

    def replay() -> list:
        simulation = Simulation(load_scenario(scenario), Config())
        try:
            result = simulation.run(until=until)
        finally:
            simulation.close()
        start = result.started_at
        return [
            (t.at - start, t.where, t.cause, t.old, t.new, t.detail) for t in result.transitions
        ]

    skipping = replay()
    monkeypatch.setattr(Reads, "still", lambda self, now, changed, polled: False)
    monkeypatch.setattr(RuleEngine, "skipping", False)
    assert replay() == skipping
    assert skipping  # the scenario does fire something


def _default_rule(name: str) -> str:
    """One rule of the default rule file, as a rule file of its own."""
    from importlib import resources

    import yaml

    text = (resources.files("gpuwatchd.rules") / "default.yaml").read_text()
    (spec,) = [r for r in yaml.safe_load(text)["rules"] if r["name"] == name]
    return yaml.safe_dump({"rules": [spec]})


SPIN = dict(util=1.0, engine=1.0, sm=0.01, power=90.0)  # a rank spinning in a hung collective
IDLE = dict(util=0.0, engine=0.0, sm=0.0, power=60.0)  # a rank outside it
BUSY = dict(util=0.97, engine=0.95, sm=0.85, power=330.0)  # a rank computing


def _nccl_states(
    ranks: list[dict[str, float]],
    job: list[int] | None = None,
    sms: float | None = None,
    pcie: float = 1e6,
) -> list[str]:
    """nccl_stall on a node whose GPUs are `ranks` of one job, held 2 minutes; `sms`:
    each GPU's SM count (None: the driver cannot say); `pcie`: bytes/s each way."""
    store = Store(history_seconds=600)
    engine = RuleEngine(
        store,
        parse_rules(_default_rule("nccl_stall"), "test.yaml", CATALOG),
        {"nvml", "dcgm", "processes"}.__contains__,
        CATALOG,
    )
    uuids = [f"GPU-{i}" for i in range(len(ranks))]
    jobs = job or [7000] * len(ranks)
    for now in (0.0, 60.0, 121.0):
        nvml, dcgm, processes = [], [], []
        for i, (rank, uuid) in enumerate(zip(ranks, uuids, strict=True)):
            labels = (str(i), uuid)
            info = (*labels, "A100", f"0000:{i:02x}:00.0", "550", "12.4")
            nvml += [
                Sample("gpuwatchd_gpu_info", info, 1),
                Sample("gpuwatchd_gpu_utilization_ratio", labels, rank["util"]),
                Sample("gpuwatchd_gpu_power_watts", labels, rank["power"]),
                Sample("gpuwatchd_gpu_power_limit_watts", labels, 400.0),
                Sample("gpuwatchd_gpu_pcie_tx_bytes_per_second", labels, pcie),
                Sample("gpuwatchd_gpu_pcie_rx_bytes_per_second", labels, pcie),
            ]
            if sms is not None:
                nvml.append(Sample("gpuwatchd_gpu_multiprocessors", labels, sms))
            dcgm += [
                Sample("gpuwatchd_gpu_gr_engine_active_ratio", labels, rank["engine"]),
                Sample("gpuwatchd_gpu_sm_active_ratio", labels, rank["sm"]),
                Sample("gpuwatchd_gpu_tensor_active_ratio", labels, 0.0),
            ]
            processes += [
                Sample("gpuwatchd_gpu_process_pid", labels, 7001.0 + i),
                Sample("gpuwatchd_gpu_process_job", labels, float(jobs[i])),
            ]
        store.update("nvml", now, nvml)
        store.update("dcgm", now, dcgm)
        store.update("processes", now, processes)
        engine.evaluate(now)
    return [engine.states[(uuid, "nccl_stall")].state for uuid in uuids]


def test_nccl_stall_fires_on_the_ranks_spinning_around_one_that_is_not_in_the_collective():
    """Issue 15, item 2: seven ranks spin in NCCL while one is stuck outside it (0 %):
    the spinning ranks page; the idle one does not (straggler_gpu names it). PCIe boards
    (no NVLink series) are judged the same."""
    states = _nccl_states([SPIN] * 3 + [IDLE] + [SPIN] * 4)
    assert states == [FIRING] * 3 + [INACTIVE] + [FIRING] * 4
    assert _nccl_states([SPIN, IDLE]) == [FIRING, INACTIVE]  # half of two ranks
    assert _nccl_states([SPIN] * 4) == [FIRING] * 4  # every rank hung alike


def test_nccl_stall_fires_around_a_rank_busy_outside_the_collective():
    """Issue 22, class 1: a rank computing in an endless loop leaves the others spinning
    with no idle peer; a minute of spin with no byte over PCIe or NVLink is a hang."""
    assert _nccl_states([SPIN, BUSY], pcie=0.0) == [FIRING, INACTIVE]
    assert _nccl_states([SPIN] * 3 + [BUSY], pcie=0.0) == [FIRING] * 3 + [INACTIVE]


def test_nccl_stall_does_not_fire_while_the_job_progresses_or_mostly_idles():
    # a slow rank computes while the others wait for it, every all-reduce completing
    # and moving the gradients (here 30 MB/s each way): uneven, not hung
    assert _nccl_states([SPIN] * 3 + [BUSY], pcie=3e7) == [INACTIVE] * 4
    # one rank spins while most of the job sits idle (between steps): not most peers
    assert _nccl_states([SPIN, IDLE, IDLE, IDLE], pcie=3e7) == [INACTIVE] * 4
    # ... but two minutes of it with not a byte moved is that rank hung (session 7)
    assert _nccl_states([SPIN, IDLE, IDLE, IDLE], pcie=0.0)[0] == FIRING
    # the idle GPU belongs to another job: the spinning ones are a job of their own
    assert _nccl_states([SPIN, SPIN, IDLE], job=[1, 1, 2]) == [FIRING, FIRING, INACTIVE]


def test_nccl_stall_bound_on_sm_activity_follows_the_sm_count():
    """Issue 22, class 2: a hung kernel keeps one block per NCCL channel (up to 64)
    resident, so a spinning A100 (108 SMs) reads SM active ~0.22 with 24 channels; the
    bound is 1.25 x 64 / SMs, at most 0.5, and 0.15 where the SM count is unknown."""
    spin22 = dict(SPIN, sm=0.22)
    assert _nccl_states([spin22] * 4, sms=108) == [FIRING] * 4
    assert _nccl_states([spin22] * 4, sms=132) == [FIRING] * 4  # H100/H200
    assert _nccl_states([spin22] * 4) == [INACTIVE] * 4  # SM count unknown: bound 0.15
    assert _nccl_states([dict(SPIN, sm=0.55)] * 4, sms=108) == [INACTIVE] * 4  # above 0.5
    assert _nccl_states([dict(SPIN, sm=0.2)] * 4, sms=400) == [INACTIVE] * 4  # 0.2 of 400
    # launch-bound small kernels: few SMs busy, but the engine idles between launches
    assert _nccl_states([dict(spin22, engine=0.7)] * 4, sms=108) == [INACTIVE] * 4


def _dataloader_states(
    util: float,
    thread: float = 1.0,
    workers: float = 0.0,
    born: float | None = -3600.0,
    probe_workers: float | None = None,
    until: float = 240.0,
    launched: float | None = 1.0,
    rule: str = "dataloader_single_process",
) -> dict[float, str]:
    """`rule` (dataloader_single_process or cpu_bound_main_thread) on one GPU whose main
    process is pid 4242, fed every 5 s, its state every 10 s. `born`: when the process
    started (None: no age known); probe_workers: the probe's setting (None: no probe,
    its source down, as where the daemon runs without the socket); `launched`: whether a
    launcher's variables are in its environment (None: unreadable)."""
    up = {"nvml", "processes"} | ({"probe"} if probe_workers is not None else set())
    store = Store(history_seconds=600)
    engine = RuleEngine(
        store,
        parse_rules(_default_rule(rule), "test.yaml", CATALOG),
        up.__contains__,
        CATALOG,
    )
    labels = ("0", "GPU-0")
    states = {}
    for step in range(int(until // 5) + 1):
        now = step * 5.0
        store.update("nvml", now, [
            Sample("gpuwatchd_gpu_info", (*labels, "A100", "0000:13:00.0", "550", "12.4"), 1),
            Sample("gpuwatchd_gpu_utilization_ratio", labels, util),
        ])  # fmt: skip
        processes = [
            Sample("gpuwatchd_gpu_process_pid", labels, 4242.0),
            Sample("gpuwatchd_gpu_process_busiest_thread_cpu_ratio", labels, thread),
            Sample("gpuwatchd_gpu_process_workers", labels, workers),
        ]
        if born is not None:
            processes.append(Sample("gpuwatchd_gpu_process_age_seconds", labels, now - born))
        if launched is not None:
            processes.append(Sample("gpuwatchd_gpu_process_launched", labels, launched))
        store.update("processes", now, processes)
        if probe_workers is not None:
            store.update("probe", now, [
                Sample("gpuwatchd_probe_loader_workers", labels, probe_workers)])  # fmt: skip
        engine.evaluate(now)
        if step % 2 == 0:
            states[now] = engine.states[("GPU-0", rule)].state
    return states


def test_dataloader_single_process_needs_a_loop_feeding_the_gpu():
    """Issue 15, item 7: a thread at a full core with no workers is a num_workers=0 loop
    only while the GPU runs steps in between; the probe is optional and its word wins."""
    assert _dataloader_states(0.3)[240.0] == FIRING  # no probe (source down): evaluable
    assert _dataloader_states(0.3, born=None)[240.0] == FIRING  # age unknown: not held
    # a busy thread next to an idle GPU: preprocessing before the first step, a server
    assert set(_dataloader_states(0.003).values()) == {INACTIVE}
    assert set(_dataloader_states(0.75).values()) == {INACTIVE}  # the GPU is not starved
    assert set(_dataloader_states(0.3, thread=0.5).values()) == {INACTIVE}
    assert set(_dataloader_states(0.3, workers=6).values()) == {INACTIVE}
    # the probe's num_workers beats the process tree's children
    assert _dataloader_states(0.3, workers=3, probe_workers=0)[240.0] == FIRING
    assert set(_dataloader_states(0.3, probe_workers=8).values()) == {INACTIVE}


def test_a_busy_thread_without_a_training_loop_is_cpu_bound_main_thread():
    """Issue 22, class 5: the name sends the on-call to num_workers, so it needs a
    DataLoader (the probe) or a launcher's variables (one rank of torchrun too); without
    either, or with an environment it cannot read, the same physics is
    cpu_bound_main_thread, and only one of the two fires."""
    for alone in (0.0, None):  # no launcher's variables; an unreadable environment
        assert set(_dataloader_states(0.3, launched=alone).values()) == {INACTIVE}
        assert _dataloader_states(0.3, launched=alone, probe_workers=0)[240.0] == FIRING
    cpu_bound = functools.partial(_dataloader_states, rule="cpu_bound_main_thread")
    assert cpu_bound(0.3, launched=0.0)[240.0] == FIRING
    assert cpu_bound(0.3, launched=None)[240.0] == FIRING
    assert set(cpu_bound(0.3).values()) == {INACTIVE}  # a rank of a launch
    assert set(cpu_bound(0.3, launched=0.0, probe_workers=0).values()) == {INACTIVE}
    assert set(cpu_bound(0.75, launched=0.0).values()) == {INACTIVE}  # the GPU is fed
    assert set(cpu_bound(0.003, launched=0.0).values()) == {INACTIVE}  # idle: a server waits
    assert set(cpu_bound(0.3, launched=0.0, workers=4).values()) == {INACTIVE}


def test_dataloader_single_process_leaves_a_process_start_alone():
    """The first 2 minutes of a process are its start-up: held until then, then `for`."""
    states = _dataloader_states(0.3, born=0.0, until=300.0)
    assert {states[t] for t in states if t < 120} == {INACTIVE}
    assert states[120.0] == PENDING and states[170.0] == PENDING
    assert states[180.0] == FIRING


def test_a_branch_not_taken_needs_no_source():
    """`a if cond else b` reads each branch's series only where taken: DCGM down does not
    make a rule not evaluable on a GPU whose branch reads NVML (a MIG GPU's busyness is
    DCGM's, a whole GPU's NVML's)."""
    from gpuwatchd.rules.language import compile_expression

    text = (
        "gpu_temperature_celsius > 0 and (gpu_utilization_ratio if present("
        "gpu_utilization_ratio) else max(gpu_instance_utilization_ratio)) >= 0.5"
    )
    assert compile_expression(text, CATALOG).sources == {"nvml"}
    node = Node(rule(text.replace("'", '"')))  # dcgm is not up
    assert node.step(0, gpu_temperature_celsius=[50, 50], gpu_utilization_ratio=[0.9, 0.1]) == (
        FIRING
    )
    assert node.state(gpu=1) == INACTIVE


@pytest.mark.parametrize("dcgm_up", [True, False])
def test_a_rule_whose_gpus_are_all_idle_is_skipped_whole(dcgm_up: bool):
    """Once every GPU a rule judges is idle and its inputs stand, a cycle skips the rule
    in one check; a source down that only its MIG instance forms read (dcgm, for
    gpu_utilization_ratio's) does not stop that on a node without MIG."""
    up = ("nvml", "pcie", "processes", "cpu", *(("dcgm",) if dcgm_up else ()))
    node = Node(rule("gpu_utilization_ratio > 0.5"), up=up)
    assert node.engine._instance_sources["cause_x"] == {"dcgm"}
    evaluated = []
    whole = node.engine._evaluate_rule
    node.engine._evaluate_rule = lambda *a: evaluated.append(a[1]) or whole(*a)
    for t in range(10):
        node.step(t, gpu_utilization_ratio=[0.1, 0.1])
    assert evaluated == [0]  # the first cycle; the same values after it
    node.step(10, gpu_utilization_ratio=[0.9, 0.1])
    assert evaluated == [0, 10] and node.state(0) == FIRING
