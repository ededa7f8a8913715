"""grafana/job.json, the job dashboard (`gpuwatchd report`'s numbers): the committed JSON
is the generator's, every panel is complete and every query parses. That its numbers are
the report's, on a real Prometheus, is tests/test_report_e2e.py's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from daemon_process import require_tool
from dashboards import GRAFANA, REGENERATE, generator, panel_queries, panels

JOB_DASHBOARD = GRAFANA / "job.json"
VALUES = {"job_id": "5120"}


def test_committed_json_is_what_the_generator_writes():
    pytest.importorskip("grafana_foundation_sdk", reason="needs Python >= 3.11, [test] extras")
    assert JOB_DASHBOARD.read_text(encoding="utf-8") == generator().render("job.json"), (
        f"grafana/job.json is out of date: run `{REGENERATE}`"
    )


def test_every_panel_is_complete():
    dashboard = json.loads(JOB_DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "job_id"}
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert len(panel["description"].split()) >= 8, panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        if panel["type"] in ("timeseries", "stat", "bargauge"):
            assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]


def test_every_query_parses_with_promtool(tmp_path: Path):
    queries = panel_queries(JOB_DASHBOARD, VALUES)
    rules = {"groups": [{"name": "job", "rules": [
        {"record": f"job_dashboard_query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)
    ]}]}
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(rules, width=1000))
    check = subprocess.run([require_tool("promtool"), "check", "rules", str(path)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr + "\n" + "\n".join(
        f"{i}: {title}" for i, (title, _) in enumerate(queries))
