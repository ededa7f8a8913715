"""Rule files: every problem found at load time, naming the rule, the field, the position."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.metrics import Sample
from gpuwatchd.rules import (
    Catalog,
    RuleEngine,
    RuleFileWatcher,
    RulesError,
    load_rules,
    parse_rules,
)
from gpuwatchd.store import Store

CATALOG = Catalog.builtin()


def one_rule(expr: str, **fields: str) -> str:
    body = {
        "name": "cause_x",
        "dimension": "compute",
        "severity": "warning",
        "expr": expr,
        "for": "1m",
        "summary": "s",
        "remedy": "r",
        **fields,
    }
    lines = ["rules:", "  - " + "\n    ".join(f"{k}: {v}" for k, v in body.items() if v != "-")]
    return "\n".join(lines) + "\n"


def problems(text: str) -> list[str]:
    with pytest.raises(RulesError) as e:
        parse_rules(text, "r.yaml", CATALOG)
    return e.value.problems


def test_the_default_rules_load_and_cover_the_first_causes():
    rules = load_rules(None, CATALOG)
    names = {r.name for r in rules.rules}
    assert {
        "pcie_link_degraded",
        "clock_throttled",
        "xid_error",
        "ecc_uncorrectable",
        "gpu_lost",
        "dataloader_single_process",
        "cpu_bound_main_thread",
        "cgroup_cpu_throttled",
        "desktop_on_gpu",
        "interrupt_storm",
        "nccl_stall",
    } <= names
    assert {r.spec.dimension for r in rules.rules} <= {
        "pcie",
        "input",
        "compute",
        "communication",
        "driver",
        "system",
    }


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            '"gpu_utilisation_ratio > 0.5"',
            "r.yaml: rule 'cause_x': expr: line 1, column 1: unknown series "
            "'gpu_utilisation_ratio' (did you mean 'gpu_utilization_ratio'?)",
        ),
        (
            '"gpu_utilization_ratio > 0.5 and"',
            "r.yaml: rule 'cause_x': expr: line 1, column 32: syntax error",
        ),
        (
            "\"gpu_utilization_ratio > 'high'\"",
            "r.yaml: rule 'cause_x': expr: line 1, column 25: expected a number here, got a string",
        ),
        (
            "\"avg_over(gpu_utilization_ratio, 'soon') > 1\"",
            "line 1, column 33: expected a duration literal",
        ),
        ("\"avg_over(0.5, '5m') > 1\"", "line 1, column 10: avg_over(): expected a series"),
        (
            '"gpu_clock_event_reason_active > 0"',
            "line 1, column 1: gpu_clock_event_reason_active has several series per GPU "
            "(labels: reason)",
        ),
        (
            "\"series('gpu_clock_event_reason_active', reson='x') > 0\"",
            "'gpu_clock_event_reason_active' has no label 'reson' (its labels: reason)",
        ),
        (
            "\"avgover(gpu_utilization_ratio, '1m') > 0\"",
            "line 1, column 1: unknown function avgover() (did you mean avg_over()?)",
        ),
        ('"gpu_utilization_ratio.real > 0"', "Attribute is not part of the rule language"),
        ('"gpuwatchd_gpu_utilization_ratio > 0"', "without the gpuwatchd_ prefix"),
        ("\"avg_over(gpu_xid_errors_total, '1m') > 0\"", "avg_over() needs one"),
    ],
)
def test_expression_problems_name_rule_field_and_position(expr, expected):
    found = problems(one_rule(expr))
    assert len(found) == 1, found
    assert expected in found[0]


def test_a_multi_line_expression_reports_the_line():
    text = one_rule(">\n      gpu_utilization_ratio > 0.5\n      and gpu_sm_activ_ratio < 1")
    text = text.replace("expr: >\n", "expr: |\n")
    (found,) = problems(text)
    assert "expr: line 2, column 5: unknown series 'gpu_sm_activ_ratio'" in found


def test_field_problems_name_the_rule_and_field_and_all_are_reported():
    text = one_rule("gpu_utilization_ratio > 0.5", dimension="gpu", remedy="-", **{"for": "x"})
    text += one_rule("nope > 1", name="second").split("rules:\n", 1)[1]
    text += one_rule("gpu_lost == 1", name="second").split("rules:\n", 1)[1]
    found = problems(text)
    assert any("rule 'cause_x': dimension: Input should be 'pcie'" in p for p in found), found
    assert any("rule 'cause_x': remedy: required" in p for p in found), found
    assert any("rule 'cause_x': for: expected a duration" in p for p in found), found
    assert any(
        "rule 'second': expr: line 1, column 1: unknown series 'nope'" in p for p in found
    ), found
    assert any("rule 'second': name: a rule of this name is already defined" in p for p in found), (
        found
    )


def test_summary_placeholders_are_compiled_too():
    (found,) = problems(one_rule("gpu_lost == 1", summary='"{{ gpu_lots }}"'))
    assert "rule 'cause_x': summary: line 1, column 1: in {{ gpu_lots }}: unknown series" in found


def test_not_yaml_and_not_a_rule_list():
    assert "not valid YAML" in problems("rules: [")[0]
    assert problems("rules: []") == [
        "r.yaml: rules: List should have at least 1 item after validation, not 0, got []"
    ]


# ---------------------------------------------------------------------------- reload

GOOD = one_rule("gpu_utilization_ratio > 0.5", **{"for": "0s"})


def reload(watcher: RuleFileWatcher) -> bool | None:
    """Check until a reload has finished: a change is loaded once it has settled (a
    second check), then swapped in (the next)."""
    for _ in range(3):
        if (loaded := watcher.check()) is not None:
            return loaded
    return None


def test_a_bad_file_on_reload_keeps_the_last_good_rules(tmp_path: Path, caplog):
    path = tmp_path / "rules.yaml"
    path.write_text(GOOD)
    store = Store()
    engine = RuleEngine(store, load_rules(path, CATALOG), lambda s: True, CATALOG)
    clock = [100.0]
    watcher = RuleFileWatcher(engine, path, lambda: clock[0], start=lambda load: load())
    assert watcher.check() is None  # unchanged
    path.write_text(GOOD.replace("cause_x", "cause_y") + "  - {name: broken}\n")
    with caplog.at_level(logging.ERROR):
        assert reload(watcher) is False
    assert "keeping the last good rules" in caplog.text
    assert "rule 'broken': expr: required" in caplog.text
    assert [r.name for r in engine.rules.rules] == ["cause_x"]
    rows = engine.rows()
    assert dict(rows["gpuwatchd_rules_last_reload_successful"]) == {(): 0}
    # the rules still run
    store.update(
        "nvml",
        0,
        [
            Sample("gpuwatchd_gpu_info", ("0", "GPU-a", "A100", "0000:13:00.0", "550", "12.4"), 1),
            Sample("gpuwatchd_gpu_utilization_ratio", ("0", "GPU-a"), 0.9),
        ],
    )
    engine.evaluate(0)
    assert engine.firing() == [("0", "cause_x", "s")]
    # a fixed file loads; SIGHUP (request) reloads an unchanged file too
    path.write_text(GOOD.replace("cause_x", "cause_y"))
    clock[0] = 200.0
    assert reload(watcher) is True
    assert [r.name for r in engine.rules.rules] == ["cause_y"]
    assert dict(engine.rows()["gpuwatchd_rules_last_reload_successful"]) == {(): 1}
    assert dict(engine.rows()["gpuwatchd_rules_last_reload_success_timestamp_seconds"]) == {
        (): 200.0
    }
    watcher.request()
    assert reload(watcher) is True
    path.unlink()
    assert reload(watcher) is False  # a vanished file is a failed reload
    assert [r.name for r in engine.rules.rules] == ["cause_y"]


# ---------------------------------------------------------------------------- CLI


def test_rules_check_accepts_the_default_file():
    default = Path(__file__).resolve().parent.parent / "gpuwatchd" / "rules" / "default.yaml"
    result = CliRunner().invoke(main, ["rules", "check", str(default)])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_rules_check_prints_one_line_per_problem(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(one_rule("nope > 1", severity="loud"))
    result = CliRunner().invoke(main, ["rules", "check", str(path)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 2, lines
    assert all(line.startswith(f"{path}: rule 'cause_x': ") for line in lines)
    assert "severity:" in result.output and "expr: line 1, column 1" in result.output
    missing = CliRunner().invoke(main, ["rules", "check", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 1 and "cannot read" in missing.output


SCENARIO = """
name: tiny
node: {gpu_count: 1, pcie_topology: direct, cpus: 4, numa_nodes: 1, dcgm: none}
phases:
  - name: busy
    duration: 2m
    set: {pstate: 0, utilization_gpu: 95, clock_event_reasons: []}
expect:
  - {cause: pcie_link_degraded, gpus: [0], onset: 30s, by: 1m}
"""


def test_simulate_check_reports_a_miss_and_an_unexpected_cause(tmp_path: Path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(SCENARIO)
    rules = tmp_path / "rules.yaml"
    rules.write_text(one_rule("gpu_utilization_ratio > 0.9", name="busy_gpu"))
    result = CliRunner().invoke(main, ["simulate", str(scenario), "--check", "--rules", str(rules)])
    assert result.exit_code == 1, result.output
    assert "60s  gpu 0  busy_gpu firing: s" in result.output
    table = result.output.split("check tiny: ")[1]
    assert table.startswith("2 mismatch(es) in 2 expectation(s)")
    assert "pcie_link_degraded" in table and "gpu 0 missed" in table
    assert "busy_gpu" in table and "(not expected)" in table and "gpu 0 fired at 60s" in table


def test_simulate_check_flags_firing_before_onset(tmp_path: Path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(SCENARIO.replace("pcie_link_degraded", "busy_gpu"))
    rules = tmp_path / "rules.yaml"
    rules.write_text(one_rule("gpu_utilization_ratio > 0.9", name="busy_gpu", **{"for": "0s"}))
    result = CliRunner().invoke(main, ["simulate", str(scenario), "--check", "--rules", str(rules)])
    assert result.exit_code == 1, result.output
    assert "gpu 0 fired early at 0s" in result.output


def test_run_refuses_a_bad_rules_file(tmp_path: Path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(one_rule("nope > 1"))
    config = tmp_path / "config.yaml"
    config.write_text(f"rules_file: {rules}\n")
    result = CliRunner().invoke(main, ["simulate", "idle-8gpu", "--config", str(config)])
    assert result.exit_code == 1
    assert "rules not loaded" in result.output and "unknown series 'nope'" in result.output


def test_sighup_reloads_the_rules_of_a_running_daemon(tmp_path: Path):
    import signal

    from gpuwatchd import signals
    from gpuwatchd.config import load_config
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.sim.scenario import load_scenario

    path = tmp_path / "rules.yaml"
    holds = GOOD.replace("> 0.5", "< 0.5")  # idle GPUs: it fires, so it is exported
    path.write_text(holds)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"rules_file: {path}\nlisten: 127.0.0.1:0\n")
    daemon = Daemon(load_config(config_file), load_scenario("idle-8gpu"))
    previous = signal.getsignal(signal.SIGHUP)
    try:
        signals.catch(signal.SIGHUP)
        for poller in daemon.pipeline.pollers:  # the scheduler's threads are not started
            poller.poll()
        daemon.evaluate_once()
        engine = daemon.pipeline.engine
        assert [r.name for r in engine.rules.rules] == ["cause_x"]
        # the same size and mtime: only SIGHUP can tell the daemon the file changed
        stat = path.stat()
        path.write_text(holds.replace("cause_x", "cause_z"))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        daemon.evaluate_once()
        daemon.evaluate_once()
        assert [r.name for r in engine.rules.rules] == ["cause_x"]
        signal.raise_signal(signal.SIGHUP)
        assert signals.RECEIVED.get_nowait() == signal.SIGHUP
        daemon.reload(load_config(config_file))  # what `run` does for a SIGHUP
        daemon.evaluate_once()  # the file is read and compiled on the loader thread
        assert daemon.pipeline.rules_watcher.wait_idle(10)
        for poller in daemon.pipeline.pollers:  # fresh inputs, however long that took:
            poller.poll()  # the daemon's clock is real, its series go stale after 3 s
        daemon.evaluate_once()  # and the rules swapped in between two cycles
        assert [r.name for r in engine.rules.rules] == ["cause_z"]
        text = daemon.pipeline.exporter.latest().text.decode()  # what a scrape gets
        assert 'gpuwatchd_starvation_active{cause="cause_z",dimension="compute",gpu="0"' in text
        assert "gpuwatchd_rules_last_reload_successful 1.0" in text
    finally:
        signal.signal(signal.SIGHUP, previous)
        daemon.server.stop()  # never started: closes its socket
        daemon.pipeline.close()
        assert daemon.node is not None
        daemon.node.close()
