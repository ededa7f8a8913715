"""The shipped Prometheus files as VictoriaMetrics' tools read them (Debian's
victoria-metrics, 1.79): vmalert parses every rule of recording.yaml, jobs.yaml and
alerts.yaml as MetricsQL and checks their templates; vmagent takes the shipped scrape
config without the server's rule_files, alerting and evaluation_interval, under its
strict parsing. That the rules give the same series and alerts on both engines is
tests/test_grafana.py's and tests/test_fleet_e2e.py's (docs/fleet.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from daemon_process import require_tool

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"


def test_vmalert_parses_every_rule_and_template():
    rules = [f"-rule={DEPLOY / name}" for name in ("recording.yaml", "jobs.yaml", "alerts.yaml")]
    check = subprocess.run([require_tool("vmalert"), "-dryRun", *rules, "-loggerLevel=ERROR"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


def test_vmagent_takes_the_shipped_scrape_config(tmp_path: Path):
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for key in ("rule_files", "alerting"):  # the server's, not a scraper's
        del config[key]
    del config["global"]["evaluation_interval"]
    path = tmp_path / "vmagent.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(
        [require_tool("vmagent"), f"-promscrape.config={path}", "-promscrape.config.dryRun",
         "-promscrape.config.strictParse", "-loggerLevel=ERROR"],
        capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
