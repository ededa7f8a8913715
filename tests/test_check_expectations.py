"""`simulate --check` judges what it is given (issue 39 item 6): the rules engine's own
series are sampled, an expectation may name a MIG GPU instance ("0/2"), an expectation
the check could never judge is refused at load, and a run cut short (`--until`) reports
what it did not reach as "not reached", not as a mismatch.

One replay of a 2-minute, one-GPU MIG node (about a second) serves the tests that need
one; the others build the firing spans by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.config import ConfigError
from gpuwatchd.sim.check import (
    Instances,
    Verdict,
    check,
    format_verdicts,
)
from gpuwatchd.sim.detection import Replay, play
from gpuwatchd.sim.scenario import Expectation, Scenario, load_scenario

STALL = "input_pipeline_stall"
ACTIVE = "gpuwatchd_starvation_active"

# GPU 0 split in two, a probed training loop on each instance; GI 2's waits 1.5 s for its
# next batch per second of compute from the start: input_pipeline_stall fires on "0/2"
# only, at 61 s
SCENARIO = """
name: check-engine-series
node:
  gpu_model: h100-sxm5-80gb
  gpu_count: 1
  host:
    processes:
      - {pid: 8001, name: python, cudart: "12.4"}
      - {pid: 8101, name: python, cudart: "12.4"}
  initial: {pstate: 0, clock_event_reasons: [], sm_clock_mhz: 1980, power_w: 420,
            temperature_c: 60, utilization_gpu: 70, utilization_memory: 30}
phases:
  - name: stalled
    duration: 2m
    changes:
      - gpus: [0]
        set:
          mig:
            instances:
              - {gpu_instance: 1, profile: 4g.40gb, utilization_gpu: 70, memory_used_mib: 30000,
                 processes: [{pid: 8001, name: python, gpu_memory_mib: 30000}]}
              - {gpu_instance: 2, profile: 3g.40gb, utilization_gpu: 35, memory_used_mib: 20000,
                 processes: [{pid: 8101, name: python, gpu_memory_mib: 20000}]}
    host:
      processes:
        8001: {main_thread_cpu_percent: 45, threads: 40, workers: 8, worker_cpu_percent: 30}
        8101: {main_thread_cpu_percent: 20, threads: 40, workers: 8, worker_cpu_percent: 12}
      probe:
        8001: &loop {step_seconds: 0.3, wait_fraction: 0.04, num_workers: 8, pin_memory: true,
                     prefetch_factor: 2, persistent_workers: true, batch_size: 128,
                     cuda_device: 0, reserved_mib: 28000, allocated_mib: 26000,
                     largest_free_block_mib: 1500, cuda_init_seconds: 0.6}
        8101: {<<: *loop, step_seconds: 0.6, wait_fraction: 0.6, reserved_mib: 18000,
               allocated_mib: 16000}
expect:
  - {cause: input_pipeline_stall, gpus: ["0/2"], onset: 0, by: 2m}
  - {cause: input_pipeline_stall, gpus: ["0/1"], never: true}
  - {metric: gpuwatchd_starvation_active, labels: {cause: input_pipeline_stall},
     gpus: ["0/2"], above: 0, onset: 0, by: 2m}
  - {metric: gpuwatchd_starvation_active, labels: {cause: input_pipeline_stall},
     gpus: ["0/1"], above: 0, never: true}
  - {metric: gpuwatchd_starvation_active, labels: {cause: input_pipeline_stall,
     gpu_instance: "2"}, gpus: [0], above: 0, onset: 0, by: 2m}
  - {metric: gpuwatchd_gpu_starved, gpus: [0], above: 0, onset: 0, by: 2m}
"""


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("check") / "check-engine-series.yaml"
    out.write_text(SCENARIO)
    return out


@pytest.fixture(scope="module")
def replayed(path: Path) -> Replay:
    return play(load_scenario(path))


def judged(replayed: Replay, *expect: dict) -> list[Verdict]:
    """`expect` checked against the replay (their metrics among those it sampled; the
    scenario's other metric expectations left out)."""
    entries = [Expectation.model_validate(e) for e in expect]
    sampled = {e.what for e in replayed.scenario.expect if e.metric} - {e.what for e in entries}
    instances = Instances(
        {k: spans for k, spans in replayed.instances.intervals.items() if k[2] not in sampled}
    )
    intervals = {k: spans for k, spans in replayed.intervals.items() if k[1] not in sampled}
    cut = replayed.scenario.model_copy(update={"expect": entries})
    return check(cut, intervals, replayed.simulated_seconds, replayed.summaries, instances)


def verdicts_of(r: Replay) -> list[Verdict]:
    return check(r.scenario, r.intervals, r.simulated_seconds, r.summaries, r.instances)


def test_the_engines_own_series_are_sampled_per_gpu_and_instance(replayed):
    verdicts = verdicts_of(replayed)
    assert all(v.ok and v.reached for v in verdicts), format_verdicts("t", verdicts)
    assert [(v.gpus, v.observed) for v in verdicts] == [
        ("0/2", "fired 61s after onset"),
        ("0/1", "never fired"),
        ("0/2", "fired 61s after onset"),
        ("0/1", "never fired"),
        ("0", "fired 61s after onset"),
        ("0", "fired 61s after onset"),
    ]


def test_an_untrue_expectation_on_the_engines_series_is_a_mismatch(replayed):
    # before: never sampled, so each "never" passed and each "must fire" missed
    verdicts = judged(
        replayed,
        {"cause": STALL, "gpus": ["0/2"], "onset": 0, "by": "2m"},
        {"metric": ACTIVE, "labels": {"cause": STALL}, "gpus": ["0/2"], "above": 0, "never": True},
        {"metric": "gpuwatchd_gpu_starved", "gpus": [0], "above": 0, "never": True},
        {"metric": ACTIVE, "labels": {"cause": STALL}, "gpus": ["0/1"], "above": 0, "onset": 0},
    )
    assert [(v.gpus, v.observed, v.result) for v in verdicts[1:]] == [
        ("0/2", "gpu 0/2 fired at 61s", "MISMATCH"),
        ("0", "gpu 0 fired at 61s", "MISMATCH"),
        ("0/1", "did not fire; gpu 0/1 missed", "MISMATCH"),
    ]


def test_a_cause_on_another_instance_than_named_is_missed_and_unexpected(replayed):
    verdicts = judged(replayed, {"cause": STALL, "gpus": ["0/1"], "onset": 0, "by": "2m"})
    assert [(v.cause, v.gpus, v.observed, v.result) for v in verdicts] == [
        (STALL, "0/1", "did not fire; gpu 0/1 missed", "MISMATCH"),
        (STALL, "0/2", "gpu 0/2 fired at 61s", "MISMATCH"),  # "(not expected)"
    ]
    # the whole GPU, named, allows each of its instances
    (verdict,) = judged(replayed, {"cause": STALL, "gpus": [0], "onset": 0, "by": "2m"})
    assert verdict.ok and verdict.observed == "fired 61s after onset"


def test_check_until_reports_what_the_run_did_not_reach(path: Path):
    result = CliRunner().invoke(main, ["simulate", str(path), "--check", "--until", "40"])
    assert result.exit_code == 0, result.output
    table = result.output.split("\ncheck ")[1]
    assert table.startswith(
        "check-engine-series: 0 mismatch(es) in 6 expectation(s), 4 not reached"
    ), table
    assert "MISMATCH" not in table
    assert "gpu 0/2 not fired yet: by 120s lies past the run's end (40s)" in table
    assert "never fired in the 40s the run reached" in table


# --- by hand: a cut run, and instances ------------------------------------------------

END = 900.0


def scenario(*expect: dict) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "t",
            "node": {"gpu_count": 2},
            "phases": [{"name": "p", "duration": END}],
            "expect": list(expect),
        }
    )


CAUSE = "clock_throttled"
RESOLVING = {"cause": CAUSE, "gpus": [1], "onset": "4m", "by": "6m", "ends": "10m"}


def test_a_window_past_the_runs_end_is_not_reached():
    cut = scenario(RESOLVING)
    (v,) = check(cut, {}, 200.0)  # cut before onset
    assert (v.ok, v.reached, v.result) == (True, False, "not reached")
    assert v.observed == "gpu 1 not fired yet: by 360s lies past the run's end (200s)"
    # fired, not yet stopped: the resolution (by the scenario's end) is not reached
    (v,) = check(cut, {(1, CAUSE): [(300.0, None)]}, 700.0)
    assert v.result == "not reached", v
    assert v.observed == (
        "fired 60s after onset; resolution of gpu 1 not reached: stopped by 900s lies past "
        "the run's end (700s)"
    )
    # what the run reached is judged: a miss whose `by` it passed, an early firing
    (v,) = check(scenario({**RESOLVING, "by": "5m"}), {}, 400.0)
    assert v.result == "MISMATCH" and v.observed == "did not fire; gpu 1 missed"
    (v,) = check(cut, {(1, CAUSE): [(100.0, 150.0)]}, 200.0)
    assert v.result == "MISMATCH" and "gpu 1 fired early at 100s" in v.observed
    # the whole run: as before
    (v,) = check(cut, {(1, CAUSE): [(300.0, None)]}, END)
    assert v.result == "MISMATCH" and "gpu 1 still firing at 900s, the end" in v.observed


def test_instances_are_judged_apart_when_named():
    cut = scenario(
        {"cause": CAUSE, "gpus": ["1/2"], "onset": "4m", "by": "6m"},
        {"cause": CAUSE, "gpus": ["1/3", 0], "never": True},
    )
    spans = {(1, "2", CAUSE): [(300.0, None)], (1, "3", CAUSE): [(310.0, 320.0)]}
    instances = Instances(spans, {})
    fires, never, *unexpected = check(cut, {(1, CAUSE): [(300.0, None)]}, END, {}, instances)
    assert (fires.gpus, fires.observed, fires.ok) == ("1/2", "fired 60s after onset", True)
    assert (never.gpus, never.observed, never.ok) == ("1/3,0", "gpu 1/3 fired at 310s", False)
    assert unexpected == []  # GI 3 is named (never), GI 2 allowed
    with pytest.raises(ValueError, match="names MIG GPU instances"):  # would judge nothing
        check(cut, {(1, CAUSE): [(300.0, None)]}, END)
    # GPU 1 itself firing: neither instance's expectation allows it
    spans[(1, "", CAUSE)] = [(400.0, None)]
    *_, extra = check(cut, {}, END, {}, instances)
    assert (extra.gpus, extra.expected, extra.observed) == (
        "1",
        "(not expected)",
        "gpu 1 fired at 400s",
    )


@pytest.mark.parametrize(
    "entry, error",
    [
        (
            "{metric: gpuwatchd_gpu_starve, above: 0}",
            "expect.0: metric: 'gpuwatchd_gpu_starve' is no series the check samples",
        ),
        (
            "{metric: gpuwatchd_gpu_starved, labels: {cause: x}, above: 0}",
            "labels: gpuwatchd_gpu_starved has no label cause: expected some of gpu, uuid",
        ),
        (
            '{metric: gpuwatchd_gpu_starved, gpus: ["0/2"], above: 0}',
            "expect.0: gpus: gpuwatchd_gpu_starved has no gpu_instance label",
        ),
        (
            "{metric: gpuwatchd_source_up, below: 1}",
            "expect.0: labels: gpuwatchd_source_up needs source, one of nvml, dcgm",
        ),
        (
            "{metric: gpuwatchd_source_up, labels: {source: nvm}, below: 1}",
            "got 'nvm'",
        ),
        (
            '{cause: gpu_lost, gpus: ["0-2"], never: true}',
            'expect.0: gpus: expected GPU indexes (3) or MIG GPU instances as "GPU/GI id" '
            "(\"0/2\"), got '0-2'",
        ),
        ("{cause: gpu_lost, gpus: [], never: true}", "expect.0: gpus: expected at least one"),
        (
            '{cause: gpu_lost, gpus: [1, "2/1"], never: true}',
            "expect.0.gpus: GPU 2 is not on the node: expected indexes below node.gpu_count (2)",
        ),
    ],
)
def test_an_expectation_the_check_cannot_judge_is_refused_at_load(tmp_path, entry, error):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\nnode: {gpu_count: 2}\nphases: [{name: p, duration: 15m}]\n"
        f"expect:\n  - {entry}\n"
    )
    with pytest.raises(ConfigError) as raised:
        load_scenario(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: expect.0") and error in message, message
