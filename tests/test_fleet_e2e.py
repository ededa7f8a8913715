"""Across nodes, with the real servers: two simulated nodes (`gpuwatchd run --simulate`,
each a real daemon on its own port) run the same two Slurm jobs, and one real Prometheus
scrapes both with the shipped fleet rules (deploy/prometheus/jobs.yaml).

Job 5120 has ranks 0-1 on node1's GPUs 0-1 and ranks 2-3 on node2's GPUs 0-1; its
healthy twin, job 5121, has GPUs 2-3 on each node. A few seconds in, job 5120's rank 3
(node2, GPU 1) stops while the rest of the job keeps running: GpuJobStraggler must name
job 5120, node2 and GPU 1 from nothing but each node's gpuwatchd_gpu_owner_info joined
with its utilization, and nothing may fire or even pend for job 5121.

The scenarios are the built-in slurm-2node-job-* with their phases shortened. In the
rules only time is cut: each `for` to FOR, and the 1-minute utilization average to WINDOW
(the promtool tests in tests/prometheus/jobs.test.yaml check the shipped values).
"""

from __future__ import annotations

import time
import urllib.parse
from contextlib import ExitStack
from pathlib import Path

import yaml
from daemon_process import running_daemon, shorten
from servers import Prometheus, running_prometheus, wait_until

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "deploy" / "prometheus" / "jobs.yaml"
ONSET = 25  # seconds from node2's start to rank 3 stopping (Prometheus starts after it)
FOR = "2s"
WINDOW = "10s"



def short_jobs_rules(tmp_path: Path) -> Path:
    """jobs.yaml with every `for` cut to FOR and the 1-minute average to WINDOW."""
    rules = yaml.safe_load(JOBS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["expr"] = rule["expr"].replace(
                "avg_over_time(gpuwatchd_gpu_utilization_ratio[1m])",
                f"avg_over_time(gpuwatchd_gpu_utilization_ratio[{WINDOW}])",
            )
            if "for" in rule:
                rule["for"] = FOR
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    assert f"[{WINDOW}]" in path.read_text()  # the window the test relies on was cut
    return path


def onset(prometheus: Prometheus, until: float) -> float:
    """When node2's GPU 1 was first scraped idle after it was scraped busy: the fault's
    onset as Prometheus saw it (ONSET leaves time for Prometheus to see it busy first)."""
    selector = 'gpuwatchd_gpu_utilization_ratio{node="node2", gpu="1"}'
    (series,) = prometheus.query_range(selector, until - 120, until, 1)
    values = [(float(t), float(v)) for t, v in series["values"]]
    assert values[0][1] >= 0.8, f"Prometheus never saw the GPU busy: {values[:3]}"
    return next(t for t, v in values if v < 0.5)


def test_cross_node_straggler_named_and_healthy_twin_quiet(tmp_path: Path) -> None:
    scenarios = {
        "node1": shorten(
            "slurm-2node-job-healthy-half",
            {"training": "10m", "still-training": "10m"},
            tmp_path,
        ),
        "node2": shorten(
            "slurm-2node-job-slow-gpu", {"training": f"{ONSET}s", "rank3-slow": "10m"}, tmp_path
        ),
    }
    with ExitStack() as stack:
        nodes = {}
        for node, scenario in scenarios.items():
            url = stack.enter_context(running_daemon(str(scenario)))
            nodes[urllib.parse.urlparse(url).netloc] = node
        prometheus = stack.enter_context(
            running_prometheus(
                tmp_path,
                {"gpuwatchd": list(nodes)},
                rule_files=[short_jobs_rules(tmp_path)],
                nodes=nodes,
            )
        )

        def job_alerts(state: str | None = None) -> list[dict]:
            return [
                a
                for a in prometheus.alerts()
                if a["labels"]["alertname"].startswith("GpuJob")
                and (state is None or a["state"] == state)
            ]

        (alert,) = wait_until("GpuJobStraggler firing", lambda: job_alerts("firing"), 90)
        fired = time.time()
        latency = fired - onset(prometheus, fired)

        labels = alert["labels"]
        assert labels["alertname"] == "GpuJobStraggler"
        assert {k: labels[k] for k in ("job_id", "scheduler", "node", "gpu", "user")} == {
            "job_id": "5120",
            "scheduler": "slurm",
            "node": "node2",
            "gpu": "1",
            "user": "ada",
        }
        assert nodes[labels["instance"]] == "node2"
        assert alert["annotations"]["summary"].startswith("job 5120: node2 GPU 1 at ")

        # the job as Prometheus sees it: both nodes' GPUs, three of them busy
        def value(expr: str) -> float:
            (sample,) = prometheus.query(expr)
            return float(sample["value"][1])

        assert value('job_id:gpuwatchd_nodes:count{job_id="5120"}') == 2
        assert value('job_id:gpuwatchd_gpus:count{job_id="5120"}') == 4
        assert value('job_id:gpuwatchd_gpus_busy:count{job_id="5120"}') == 3
        assert value('job_id:gpuwatchd_gpus_busy:count{job_id="5121"}') == 4

        # nothing else, not even pending, at any time: not the twin job, not the
        # straggler's peers (ALERTS holds every pending and firing alert's history)
        assert [a["labels"] for a in job_alerts()] == [labels]
        history = prometheus.query_range('ALERTS{alertname=~"GpuJob.*"}', fired - 120, fired, 1)
        raised = {(s["metric"]["job_id"], s["metric"]["node"], s["metric"]["gpu"]) for s in history}
        assert raised == {("5120", "node2", "1")}
    # the window (WINDOW: utilization averaged below 20 %), FOR, and a scrape and an
    # evaluation cycle each
    print(f"\nonset (first idle scrape) -> GpuJobStraggler firing: {latency:.1f} s")
