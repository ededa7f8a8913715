"""The shipped Prometheus rules and Alertmanager route, checked by Prometheus' own tools.

`promtool test rules` runs the unit tests in tests/prometheus/; the checks here make sure
those tests cover every alert (firing and not firing) and every recording rule, and that
the alerts agree with the daemon's rules and the runbooks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from daemon_process import require_tool

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
RECORDING = DEPLOY / "prometheus" / "recording.yaml"
JOBS = DEPLOY / "prometheus" / "jobs.yaml"  # recording and alerting rules across nodes
UNIT_TESTS = sorted((ROOT / "tests" / "prometheus").glob("*.test.yaml"))
RUNBOOK_BASE = "https://github.com/gpuwatchd/gpuwatchd/blob/main/"  # the repository's docs


def run(*args: str | Path, cwd: Path = ROOT) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rules(path: Path) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict]:
    return {
        rule["alert"]: rule for path in (ALERTS, JOBS) for rule in rules(path) if "alert" in rule
    }


def unit_tests() -> list[dict]:
    return [test for path in UNIT_TESTS for test in yaml.safe_load(path.read_text())["tests"]]


def test_promtool_checks_the_rule_files():
    run(require_tool("promtool"), "check", "rules", ALERTS, RECORDING, JOBS)


def test_promtool_checks_the_example_prometheus_config():
    run(require_tool("promtool"), "check", "config", "scrape.yaml", cwd=DEPLOY / "prometheus")


def test_every_rule_file_is_wired_where_users_follow():
    """scrape.yaml's rule_files, the README's install steps and docs/alerting.md name every
    rule file deploy/prometheus ships (jobs.yaml's page was once loaded nowhere)."""
    shipped = {p.name for p in (DEPLOY / "prometheus").glob("*.yaml") if p.name != "scrape.yaml"}
    config = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
    assert set(config["rule_files"]) == shipped
    readme = (ROOT / "README.md").read_text()
    alerting = (ROOT / "docs" / "alerting.md").read_text()
    for name in shipped:
        assert f"deploy/prometheus/{name}" in readme, name
        assert f"`{name}`" in alerting, name


@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path: Path):
    run(require_tool("promtool"), "test", "rules", path.name, cwd=path.parent)


def test_every_alert_is_tested_firing_and_not_firing():
    fired, silent = set(), set()
    for test in unit_tests():
        for case in test.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    assert set(alerts()) - fired == set(), "alerts never tested firing"
    assert set(alerts()) - silent == set(), "alerts never tested staying silent"


def test_every_recording_rule_is_tested():
    tested = " ".join(
        case["expr"] for test in unit_tests() for case in test.get("promql_expr_test", [])
    )
    names = {
        rule["record"] for path in (RECORDING, JOBS) for rule in rules(path) if "record" in rule
    }
    assert {name for name in names if name not in tested} == set()


def test_cause_alerts_name_real_causes_and_cover_every_rule():
    default_rules = yaml.safe_load((ROOT / "gpuwatchd" / "rules" / "default.yaml").read_text())
    causes = {rule["name"] for rule in default_rules["rules"]}
    named = set()
    for alert in alerts().values():
        for selector in re.findall(r'cause(?:=|!~)"([^"]+)"', alert["expr"]):
            named.update(selector.split("|"))
    assert named - causes == set(), "alerts name causes the daemon does not have"
    # the catch-all takes every cause the dedicated alerts do not
    catch_all = alerts()["GpuStarvationCause"]["expr"]
    assert 'dimension!="input"' in catch_all


def test_every_alert_has_a_severity_and_a_runbook_section():
    for name, alert in alerts().items():
        on_series = "gpuwatchd_starvation_active{" in alert["expr"]
        assert on_series or alert.get("labels", {}).get("severity"), f"{name}: no severity"
        annotations = alert["annotations"]
        assert {"summary", "remedy", "runbook_url"} <= set(annotations), name
        url = annotations["runbook_url"]
        assert url.startswith(RUNBOOK_BASE), f"{name}: not an absolute link into the docs"
        doc, _, anchor = url.removeprefix(RUNBOOK_BASE).partition("#")
        assert anchor == name.lower(), name
        text = (ROOT / doc).read_text()
        anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
        assert anchor in anchors, f"{doc} has no section for {name}"


def test_pages_are_only_what_a_person_must_act_on_now():
    default_rules = yaml.safe_load((ROOT / "gpuwatchd" / "rules" / "default.yaml").read_text())
    critical = {r["name"] for r in default_rules["rules"] if r["severity"] == "critical"}
    assert critical == {"gpu_lost", "nccl_stall", "pcie_link_degraded"}
    static = {n for n, a in alerts().items() if a.get("labels", {}).get("severity") == "critical"}
    assert static == {
        "GpuXidResetRequired", "GpuNvmlHung", "GpuJobNcclStall", "GpuNcclStallCulprit"
    }


def test_cause_alerts_say_where_in_a_short_summary_and_the_evidence_apart():
    causes = [r for r in rules(ALERTS) if r["expr"].startswith("gpuwatchd_starvation_active{")]
    assert len(causes) == 9
    for alert in [*causes, alerts()["GpuNcclStallCulprit"]]:
        annotations = alert["annotations"]
        assert "starvation_info" in annotations["description"], alert["alert"]
    for alert in causes:
        summary = alert["annotations"]["summary"]
        assert "pci_bus_id" in summary and "job_id" in summary, alert["alert"]


def test_the_kubernetes_rules_take_another_runbook_base():
    out = run(sys.executable, DEPLOY / "kubernetes" / "generate.py", "--runbook-base",
              "https://wiki.example/gpu/")  # fmt: skip
    urls = re.findall(r"runbook_url: (\S+)", out)
    assert urls and all(u.startswith("https://wiki.example/gpu/docs/") for u in urls), urls
    assert "https://wiki.example/gpu/docs/alerting.md#gpuncclstallculprit" in urls


def test_amtool_checks_the_example_route():
    run(require_tool("amtool"), "check-config", DEPLOY / "alertmanager" / "alertmanager.yaml")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
