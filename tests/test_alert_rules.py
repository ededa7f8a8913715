"""The shipped Prometheus rules and Alertmanager route, checked by Prometheus' own tools.

`promtool test rules` runs the unit tests in tests/prometheus/; the checks here make sure
those tests cover every alert (firing and not firing) and every recording rule, and that
the alerts agree with the daemon's rules and the runbooks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
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


CHECK_RULES = "promtool check rules deploy/prometheus/*.yaml"  # as docs/alerting.md says


def test_promtool_checks_the_rule_files_as_the_docs_say():
    # every *.yaml there is a rule file: the example prometheus.yml beside them once
    # failed the glob
    assert CHECK_RULES in " ".join((ROOT / "docs" / "alerting.md").read_text().split())
    files = sorted(ROOT.glob(CHECK_RULES.split()[-1]))
    assert {ALERTS, RECORDING, JOBS} <= set(files)
    run(require_tool("promtool"), *CHECK_RULES.split()[1:-1], *files)


def test_promtool_checks_the_example_prometheus_config():
    run(require_tool("promtool"), "check", "config", "prometheus.yml", cwd=DEPLOY / "prometheus")


def test_every_rule_file_is_wired_where_users_follow():
    """prometheus.yml's rule_files, the README's install steps and docs/alerting.md name
    every rule file deploy/prometheus ships (jobs.yaml's page was once loaded nowhere)."""
    shipped = {p.name for p in (DEPLOY / "prometheus").glob("*.yaml")}
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
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
    assert critical == {
        "gpu_lost",
        "nccl_stall",
        "pcie_link_degraded",
        "nvlink_fabric_not_ready",
        "nvswitch_fatal",
    }
    static = {n for n, a in alerts().items() if a.get("labels", {}).get("severity") == "critical"}
    assert static == {
        "GpuXidResetRequired", "GpuNvmlHung", "GpuJobNcclStall", "GpuNcclStallCulprit"
    }


def test_cause_alerts_say_where_in_a_short_summary_and_the_evidence_apart():
    causes = [
        r for r in rules(ALERTS) if r["expr"].lstrip("(").startswith("gpuwatchd_starvation_active{")
    ]
    assert len(causes) == 12
    for alert in [*causes, alerts()["GpuNcclStallCulprit"]]:
        annotations = alert["annotations"]
        assert "starvation_info" in annotations["description"], alert["alert"]
        summary = alert["annotations"]["summary"]
        assert "pci_bus_id" in summary and "job_id" in summary, alert["alert"]
        assert "process_pid" in summary, alert["alert"]  # the rank's own, not its launcher's


def test_the_kubernetes_rules_take_another_runbook_base():
    out = run(sys.executable, DEPLOY / "kubernetes" / "generate.py", "--runbook-base",
              "https://wiki.example/gpu/")  # fmt: skip
    urls = re.findall(r"runbook_url: (\S+)", out)
    assert urls and all(u.startswith("https://wiki.example/gpu/docs/") for u in urls), urls
    assert "https://wiki.example/gpu/docs/alerting.md#gpuncclstallculprit" in urls


def test_amtool_checks_the_example_route():
    run(require_tool("amtool"), "check-config", DEPLOY / "alertmanager" / "alertmanager.yaml")


# One NCCL hang as the rules label it (tests/prometheus/firing.test.yaml, jobs.test.yaml):
# Slurm job 5120 of cluster train-a hangs on node1 (GPUs 0-1) and node2 (GPU 0) while
# node2's GPU 1, rank 3, is the rank they wait for. Job 7000 hangs across two nodes with
# no rank named. On node5, a launch without a job id (pid 900) hangs with its culprit on
# GPU 2 beside another launch (pid 950) that hangs with none. Cluster train-b's job 5120 is
# another job.
def _hang(alertname: str, **labels: str) -> dict[str, str]:
    return {"alertname": alertname, "severity": "critical", "cluster": "train-a", **labels}


def _gpu(node: str, gpu: str, **labels: str) -> dict[str, str]:
    return {"node": node, "instance": f"{node}:9766", "gpu": gpu, "uuid": f"{node}-GPU{gpu}",
            **labels}  # fmt: skip


JOB_5120 = {"scheduler": "slurm", "job_id": "5120", "job_pid": "6100"}
JOB_7000 = {"scheduler": "slurm", "job_id": "7000", "job_pid": "7001"}
HANG = {
    "stall node1/0": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node1", "0", **JOB_5120)),
    "stall node1/1": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node1", "1", **JOB_5120)),
    "stall node2/0": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node2", "0", **JOB_5120)),
    "culprit node2/1": _hang(
        "GpuNcclStallCulprit", cause="straggler_gpu", **_gpu("node2", "1", **JOB_5120)
    ),
    "job 5120": _hang("GpuJobNcclStall", scheduler="slurm", job_id="5120", user="ada"),
    "straggler node2/1": {
        **_hang("GpuStraggler", cause="straggler_gpu", **_gpu("node2", "1")),
        "severity": "warning",
    },
    "job straggler node2/1": {
        **_hang("GpuJobStraggler", scheduler="slurm", job_id="5120", **_gpu("node2", "1")),
        "severity": "warning",
    },
    "stall node3/0": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node3", "0", **JOB_7000)),
    "stall node4/0": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node4", "0", **JOB_7000)),
    "job 7000": _hang("GpuJobNcclStall", scheduler="slurm", job_id="7000", user="bo"),
    "stall node5/0": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node5", "0", job_pid="900")),
    "stall node5/1": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node5", "1", job_pid="900")),
    "culprit node5/2": _hang(
        "GpuNcclStallCulprit", cause="straggler_gpu", **_gpu("node5", "2", job_pid="900")
    ),
    "stall node5/3": _hang("GpuNcclStall", cause="nccl_stall", **_gpu("node5", "3", job_pid="950")),
    "train-b stall": {
        **_hang("GpuNcclStall", cause="nccl_stall", **_gpu("node9", "0", **JOB_5120)),
        "cluster": "train-b",
    },
}


def _leaf_route(labels: dict[str, str]) -> str:
    """The route amtool sends `labels` to: the last line of `routes test --tree`."""
    out = run(require_tool("amtool"), "config", "routes", "test", "--tree",
              f"--config.file={DEPLOY / 'alertmanager' / 'alertmanager.yaml'}",
              *(f"{k}={v}" for k, v in labels.items()))  # fmt: skip
    tree = [line for line in out.splitlines() if "receiver:" in line]
    return tree[-1].strip(" │├└─")


def test_amtool_routes_an_nccl_hang_to_one_page_per_job():
    """Every alert of one hung job, whatever its node, goes to the pager by the one route
    that groups by the job; a hang with no job id by the route per node and launch."""
    by_job = 'alertname=~"GpuNcclStall|GpuNcclStallCulprit|GpuJobNcclStall",job_id=~".+"'
    for name in ("stall node1/0", "stall node2/0", "culprit node2/1", "job 5120", "job 7000"):
        assert _leaf_route(HANG[name]) == "{" + by_job + "}  receiver: pager", name
    per_launch = '{alertname=~"GpuNcclStall|GpuNcclStallCulprit"}  receiver: pager'
    assert _leaf_route(HANG["stall node5/3"]) == per_launch
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yaml").read_text())
    pager = next(r for r in config["route"]["routes"] if r["receiver"] == "pager")
    groups = {",".join(r["matchers"]): r["group_by"] for r in pager["routes"]}
    assert groups[by_job] == ["cluster", "scheduler", "job_id"]


def test_an_nccl_hang_pages_once_with_its_culprit(tmp_path: Path):
    """A real Alertmanager with the shipped route and inhibitions, given one hang's alerts
    as Prometheus sends them: one group per hung job (per launch without a job id), and in
    each only the alert that names the rank the hang waits for stays active -- else the
    job-wide one; the rest, and the culprit's straggler tickets, are inhibited."""
    from servers import Webhook, get_json, running_alertmanager, wait_until

    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yaml").read_text())
    expected = {  # group -> the alerts it holds, those left active marked
        ("pager", "cluster=train-a,job_id=5120,scheduler=slurm"): {
            "stall node1/0": "suppressed", "stall node1/1": "suppressed",
            "stall node2/0": "suppressed", "culprit node2/1": "active",
            "job 5120": "suppressed",
        },
        ("pager", "cluster=train-a,job_id=7000,scheduler=slurm"): {
            "stall node3/0": "suppressed", "stall node4/0": "suppressed", "job 7000": "active",
        },
        ("pager", "cluster=train-a,job_pid=900,node=node5"): {
            "stall node5/0": "suppressed", "stall node5/1": "suppressed",
            "culprit node5/2": "active",
        },
        ("pager", "cluster=train-a,job_pid=950,node=node5"): {"stall node5/3": "active"},
        ("pager", "cluster=train-b,job_id=5120,scheduler=slurm"): {"train-b stall": "active"},
        ("tickets", "cluster=train-a,node=node2"): {
            "straggler node2/1": "suppressed", "job straggler node2/1": "suppressed",
        },
    }  # fmt: skip
    names = {tuple(sorted(labels.items())): name for name, labels in HANG.items()}

    def groups(base: str) -> dict:
        seen: dict = {}
        for group in get_json(f"{base}/api/v2/alerts/groups"):
            key = ",".join(f"{k}={v}" for k, v in sorted(group["labels"].items()))
            seen[(group["receiver"]["name"], key)] = {
                names[tuple(sorted(a["labels"].items()))]: a["status"]["state"]
                for a in group["alerts"]
            }
        return seen

    with Webhook() as webhook:
        for receiver in config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = webhook.url
        with running_alertmanager(tmp_path, config) as address:
            base = f"http://{address}"
            body = json.dumps([{"labels": labels} for labels in HANG.values()]).encode()
            request = urllib.request.Request(
                f"{base}/api/v2/alerts", body, {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=10).close()
            last: list[dict] = []

            def settled() -> bool:
                last[:] = [groups(base)]
                return last[0] == expected

            try:
                wait_until("the hang's alerts grouped and inhibited", settled, 15)
            except AssertionError:
                assert last[0] == expected  # pytest shows what differs


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
