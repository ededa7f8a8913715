"""The Grafana dashboards (grafana/): the committed JSON is the generator's, every panel is
complete, every query parses, and every query returns data from a real Prometheus
scraping a simulated node with the shipped recording rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from daemon_process import require_tool, running_daemon
from dashboards import DASHBOARDS, REGENERATE, generator, panel_queries, panels, substitute
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port, running_prometheus, wait_until

from gpuwatchd.sources.owner import LABELS as OWNER_LABELS

REPO = Path(__file__).resolve().parent.parent
SCENARIO = Path(__file__).resolve().parent / "fixtures" / "scenarios" / "dashboard-evidence.yaml"
RECORDING_RULES = REPO / "deploy" / "prometheus" / "recording.yaml"
JOB_RULES = REPO / "deploy" / "prometheus" / "jobs.yaml"
FLEET, NODE = DASHBOARDS
JOB_ID = "torchrun-4242"  # the job the owner stand-in gives the simulated node's GPUs

VARIABLES = {
    FLEET.name: {"datasource", "cluster", "job", "node", "job_id"},
    NODE.name: {"datasource", "job", "node", "gpu"},
}


def sdk_generator():
    """grafana/dashboards.py; it needs grafana-foundation-sdk (Python >= 3.11, [test] extras)."""
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("grafana-foundation-sdk is not installed; .ci/run should install it")
        pytest.skip("grafana-foundation-sdk not installed (Python >= 3.11, the [test] extras)")
    return generator()


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def example_values(node: str = "gpu-node-01:9766") -> dict[str, str]:
    """Values for every dashboard variable: one job, node and job id, All for cluster and
    gpu."""
    return {"cluster": ".*", "job": "gpuwatchd", "node": node, "gpu": ".*", "job_id": JOB_ID}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_committed_json_is_what_the_generator_writes(path: Path):
    assert path.read_text(encoding="utf-8") == sdk_generator().render(path.name), (
        f"{path.relative_to(REPO)} is out of date: run `{REGENERATE}` and commit the result"
    )


def test_the_command_line_checks_the_files_in_another_process():
    """`python -m grafana.dashboards --check`: same bytes under another hash seed."""
    sdk_generator()
    check = subprocess.run(
        [sys.executable, "-m", "grafana.dashboards", "--check"], cwd=REPO, capture_output=True,
        text=True, env=dict(os.environ, PYTHONHASHSEED="12345"),
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_targets_a_datasource_variable_and_a_description(path: Path):
    dashboard = load(path)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == VARIABLES[path.name]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    problems = []
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        title = panel.get("title") or f"panel {panel['id']}"
        if panel.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{title}: datasource is not the $datasource variable")
        if len((panel.get("description") or "").split()) < 8:
            problems.append(f"{title}: no description saying what it shows and how to read it")
        targets = panel.get("targets") or []
        if not targets or not all(t.get("expr") for t in targets):
            problems.append(f"{title}: a panel without a query")
        if len({t.get("refId") for t in targets}) != len(targets):
            problems.append(f"{title}: refIds are not unique")
        plotted = panel["type"] in ("timeseries", "stat", "bargauge")
        if plotted and not panel["fieldConfig"]["defaults"].get("unit"):
            problems.append(f"{title}: no unit")
        for target in targets:
            try:
                substitute(target["expr"], example_values())
            except KeyError as e:
                problems.append(f"{title}: {e}")
    assert not problems, "\n".join(problems)


def test_docs_name_every_panel():
    docs = (REPO / "docs" / "dashboards.md").read_text(encoding="utf-8")
    missing = [
        f"{path.name}: {panel['title']}"
        for path in DASHBOARDS
        for panel in panels(load(path))
        if f"| {panel['title']} |" not in docs
    ]
    assert not missing, "docs/dashboards.md lacks a row for:\n" + "\n".join(missing)


def test_panel_queries_substitutes_grafana_variables(tmp_path: Path):
    assert substitute(
        'rate(x{job=~"$job", node=~"${node}", gpu=~"${gpu:regex}"}[$__rate_interval])',
        {"job": "gpuwatchd", "node": "n1:9766", "gpu": ".*"},
    ) == 'rate(x{job=~"gpuwatchd", node=~"n1:9766", gpu=~".*"}[1m])'
    assert substitute("increase(x[$__range]) / $__interval", {"__range": "5m"}) == (
        "increase(x[5m]) / 15s"
    )
    assert substitute('label_replace(x, "a", "$1", "b", "(.+)")', {}) == (
        'label_replace(x, "a", "$1", "b", "(.+)")'
    )
    with pytest.raises(KeyError, match=r"\$nodes"):
        substitute('x{node="$nodes"}', {"node": "n1"})
    collapsed = {"panels": [
        {"type": "row", "title": "r", "panels": [
            {"type": "timeseries", "title": "inside", "targets": [{"expr": "up{job=~\"$job\"}"}]},
        ]},
        {"type": "stat", "title": "outside", "targets": [{"expr": "vector(1)"}, {"refId": "B"}]},
    ]}
    path = tmp_path / "collapsed.json"
    path.write_text(json.dumps(collapsed))
    assert panel_queries(path, {"job": "j"}) == [
        ("inside", 'up{job=~"j"}'), ("outside", "vector(1)"),
    ]
    queries = panel_queries(NODE, example_values())
    assert queries and all("$" not in expr.replace('"$1"', "") for _, expr in queries)
    titles = {title for title, _ in queries}
    assert "Causes on GPU $gpu" in titles  # the repeated panel: one query, all GPUs


def test_every_query_parses_with_promtool(tmp_path: Path):
    """promtool parses each query, variables substituted, as a recording rule's expr."""
    promtool = require_tool("promtool")
    queries = [
        (f"{path.name}: {title}", expr)
        for path in DASHBOARDS
        for title, expr in panel_queries(path, example_values())
    ]
    rules = {
        "groups": [{
            "name": "dashboards",
            "rules": [
                {"record": f"dashboard_query_{i}", "expr": expr}
                for i, (_, expr) in enumerate(queries)
            ],
        }]
    }
    rule_file = tmp_path / "queries.yaml"
    rule_file.write_text(yaml.safe_dump(rules, width=1000))
    check = subprocess.run([promtool, "check", "rules", str(rule_file)], capture_output=True,
                           text=True)
    if check.returncode != 0:  # name the panels: the output only numbers the rules
        index = "\n".join(f"dashboard_query_{i}: {name}" for i, (name, _) in enumerate(queries))
        pytest.fail(f"promtool check rules:\n{check.stdout}{check.stderr}\n{index}")


def test_the_scenario_shows_what_it_says():
    """The e2e test's scenario: its faults fire where and when its `expect` says."""
    check = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "simulate", str(SCENARIO), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]


def owner_exposition(metrics_url: str, target: str) -> str:
    """gpuwatchd_gpu_owner_info for each GPU of the daemon at `metrics_url`, in the labels
    docs/fleet.md fixes, as its processes source will export it for a torchrun job in a
    Kubernetes pod; `job`, `instance` and `node` are the daemon's target's (served with
    honor_labels, so they join with the daemon's own series)."""

    def gpu_info() -> list[Metric]:  # the NVML source's first poll may not have landed yet
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            text = response.read().decode()
        families = text_string_to_metric_families(text)
        return [f for f in families if f.name == "gpuwatchd_gpu_info" and f.samples]

    (info,) = wait_until("the daemon's gpuwatchd_gpu_info", gpu_info, timeout=60)
    lines = ["# TYPE gpuwatchd_gpu_owner_info gauge"]
    for sample in info.samples:
        gpu, uuid = sample.labels["gpu"], sample.labels["uuid"]
        labels = {
            "job": "gpuwatchd", "instance": target, "node": target, "gpu": gpu, "uuid": uuid,
            "scheduler": "kubernetes", "job_id": JOB_ID, "step": "", "rank": gpu,
            "user": "1000", "namespace": "ml-team", "pod": "train-0", "container": "trainer",
        }
        assert labels.keys() == {"job", "instance", "node", "gpu", "uuid", *OWNER_LABELS}
        lines.append(
            "gpuwatchd_gpu_owner_info{"
            + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} 1"
        )
    assert len(lines) > 1, "the daemon lists no GPUs"
    return "\n".join(lines) + "\n"


@contextmanager
def serving_text(body: str) -> Iterator[str]:
    """A real HTTP server answering every GET with `body` (text exposition); its host:port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "{}:{}".format(*server.server_address)
    finally:
        server.shutdown()
        server.server_close()


def test_every_panel_query_returns_data(tmp_path: Path):
    """Every target of both dashboards, variables substituted, returns a non-empty result
    from a real Prometheus scraping `gpuwatchd run --simulate` with the recording rules
    and the job rules (deploy/prometheus/jobs.yaml).

    The job view joins on gpuwatchd_gpu_owner_info. The simulated node's owners are not
    used: the test serves a stand-in owner series per GPU (owner_exposition, labelled as
    docs/fleet.md fixes, a job with a job_id, a namespace and a user, which the scenario's
    process has not), and the daemon's own attribution is switched off
    (sources.processes.owner: false) so that each GPU has exactly one owner, as on a real
    node; a second one would make every join many-to-many.
    """
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(yaml.safe_dump({"sources": {"processes": {"owner": False}}}))
    with running_daemon(str(SCENARIO), "--config", str(config)) as metrics_url:
        target = urllib.parse.urlparse(metrics_url).netloc
        values = example_values(node=target)  # servers.py labels each target node=host:port
        queries = [
            (f"{path.stem}: {title}", expr)
            for path in DASHBOARDS
            for title, expr in panel_queries(path, values)
        ]
        with serving_text(owner_exposition(metrics_url, target)) as owners, running_prometheus(
            tmp_path, {"gpuwatchd": [target], "owners": [owners]},
            rule_files=[RECORDING_RULES, JOB_RULES],
            scrape_options={"honor_labels": True},  # the stand-in's job, instance and node
        ) as prometheus:
            assert not prometheus.query(
                f'count by (job, instance, uuid) (gpuwatchd_gpu_owner_info{{instance="{target}"}})'
                " > 1"
            ), "a GPU with two owners: the daemon exports its own despite owner: false"
            empty = queries
            deadline = time.monotonic() + 45
            while True:
                empty = [(title, expr) for title, expr in empty if not prometheus.query(expr)]
                if not empty or time.monotonic() > deadline:
                    break
                time.sleep(1)
    assert not empty, f"{len(empty)} of {len(queries)} queries returned no data:\n" + "\n".join(
        f"  {title}: {expr}" for title, expr in empty
    )
