"""Across nodes, with the real servers: two simulated nodes (`gpuwatchd run --simulate`,
each a real daemon on its own port) run the same two Slurm jobs, one real Prometheus
scrapes both with the shipped rules (deploy/prometheus/jobs.yaml and alerts.yaml) and
sends to one real Alertmanager with the shipped route (deploy/alertmanager), which
delivers to a webhook in the test.

Job 5120 has ranks 0-1 on node1's GPUs 0-1 and ranks 2-3 on node2's GPUs 0-1; its
healthy twin, job 5121, has GPUs 2-3 on each node. A few seconds in, job 5120 hangs:
rank 3 (node2, GPU 1) stops outside the collective while ranks 0-2 enter it and spin
(the nccl_stall signature). From nothing but each node's series:
- GpuJobStraggler names job 5120, node2 and GPU 1 (gpuwatchd_gpu_owner_info joined with
  utilization);
- GpuJobNcclStall names the rank the hang waits for as node2 names it (straggler_gpu),
  not a rank that went quiet first;
- the pager gets one notification for the hang, GpuNcclStallCulprit with the rank's
  address, pid and job, while the job's stalled GPUs on both nodes and GpuJobNcclStall
  are inhibited; nothing fires or even pends for job 5121.

The scenarios are the built-in slurm-2node-job-* with their phases shortened and the
hang added to their second phase. Only time is cut: in the daemon's rules each `for` and
straggler_gpu's 1-minute average (to a few seconds, the average shorter than the `for`
as the 1 minute is shorter than nccl_stall's 2), in the Prometheus rules each `for` to
FOR and the 1-minute utilization average to WINDOW, in Alertmanager its waits (the
promtool tests in tests/prometheus/ check the shipped values)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from daemon_process import running_daemon, shorten
from servers import (
    Prometheus,
    Webhook,
    get_json,
    running_alertmanager,
    running_prometheus,
    wait_until,
)
from test_alerting_e2e import alertmanager_config, short_rules
from victoria import running_scale_out, split_ports

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus"
ONSET = 25  # seconds from node2's start to the hang (Prometheus starts after it)
LAG = 3  # seconds more to node1's ranks entering the hung collective
FOR = "2s"
WINDOW = "10s"
STRAGGLER_WINDOW = "2s"  # straggler_gpu's 1-minute average, under the daemon's 5 s `for`
# a rank spinning in a hung collective: engine busy, SMs, pipes, power, traffic idle
SPINNING = {
    "utilization_gpu": 100, "gr_engine_active": 1.0, "sm_active": 0.01, "sm_occupancy": 0.01,
    "tensor_active": 0, "dram_active": 0, "power_w": 135, "pcie_rx_mb_s": 0,
    "nvlink_tx_mb_s": 0, "nvlink_rx_mb_s": 0,
}  # fmt: skip


def short_fleet_rules(tmp_path: Path) -> list[Path]:
    """jobs.yaml and alerts.yaml with every `for` cut to FOR and the 1-minute average to
    WINDOW."""
    paths = []
    for name in ("jobs.yaml", "alerts.yaml"):
        rules = yaml.safe_load((RULES / name).read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule["expr"] = rule["expr"].replace(
                    "avg_over_time(gpuwatchd_gpu_utilization_ratio[1m])",
                    f"avg_over_time(gpuwatchd_gpu_utilization_ratio[{WINDOW}])",
                )
                if "for" in rule and "absent(" not in rule["expr"]:
                    rule["for"] = FOR
        path = tmp_path / name
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        paths.append(path)
    assert f"[{WINDOW}]" in paths[0].read_text()  # the window the test relies on was cut
    return paths


def daemon_config(tmp_path: Path) -> Path:
    """The default rules with each `for` cut, and straggler_gpu's average to STRAGGLER_WINDOW."""
    path = short_rules(tmp_path)
    rules = yaml.safe_load(path.read_text())
    (straggler,) = [rule for rule in rules["rules"] if rule["name"] == "straggler_gpu"]
    cut = straggler["expr"].replace("avg_over(gpu_utilization_ratio, '1m')",
                                    f"avg_over(gpu_utilization_ratio, '{STRAGGLER_WINDOW}')")
    assert cut != straggler["expr"]  # the window the hang's culprit relies on was cut
    straggler["expr"] = cut
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(yaml.safe_dump({"rules_file": str(path)}))
    return config


def with_hang(path: Path, gpus: list[int]) -> Path:
    """The scenario with job 5120's `gpus` spinning in a collective in its second phase."""
    data = yaml.safe_load(path.read_text())
    data["phases"][1].setdefault("changes", []).append({"gpus": gpus, "set": SPINNING})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def onset(prometheus: Prometheus, until: float) -> float:
    """When node2's GPU 1 was first scraped idle after it was scraped busy: the fault's
    onset as Prometheus saw it (ONSET leaves time for Prometheus to see it busy first)."""
    selector = 'gpuwatchd_gpu_utilization_ratio{node="node2", gpu="1"}'
    (series,) = prometheus.query_range(selector, until - 120, until, 1)
    values = [(float(t), float(v)) for t, v in series["values"]]
    assert values[0][1] >= 0.8, f"Prometheus never saw the GPU busy: {values[:3]}"
    return next(t for t, v in values if v < 0.5)


@dataclass
class Engine:
    """Where the rules run and the alerts go: Prometheus, or vmalert on VictoriaMetrics."""

    name: str
    store: Prometheus  # the recorded series and ALERTS (vmalert writes them to its store)
    alerts: Callable[[], list[dict]]  # the rule evaluator's alerts, pending and firing
    webhook: Webhook
    alertmanager: str


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_cross_node_hang_named_paged_once_and_healthy_twin_quiet(tmp_path: Path) -> None:
    """On Prometheus, and beside it on the scale-out path (tests/victoria.py): two vmagent
    shards, one target each, remote-writing to a VictoriaMetrics store, and vmalert
    evaluating the same rules there, sending to its own Alertmanager. Both see the same
    daemons: the same alerts, labels and annotations must come out of each."""
    # node2 starts first and its ranks stop first: node1's ranks enter the collective
    # LAG seconds after node2's (and the time node1's daemon takes to start) whatever
    # the machine's load, so that the culprit's node reports first and the test does not
    # rest on the route's group_wait covering a skew between the daemons' clocks
    scenarios = {
        "node2": with_hang(shorten(
            "slurm-2node-job-slow-gpu", {"training": f"{ONSET}s", "rank3-slow": "10m"}, tmp_path
        ), [0]),
        "node1": with_hang(shorten(
            "slurm-2node-job-healthy-half",
            {"training": f"{ONSET + LAG}s", "still-training": "10m"},
            tmp_path,
        ), [0, 1]),
    }  # fmt: skip
    config = daemon_config(tmp_path)
    rules = short_fleet_rules(tmp_path)
    vm_path = tmp_path / "victoria-metrics"
    vm_path.mkdir()
    with ExitStack() as stack:
        webhooks = [stack.enter_context(Webhook()) for _ in range(2)]
        alertmanagers = [
            stack.enter_context(running_alertmanager(path, alertmanager_config(webhook)))
            for path, webhook in zip((tmp_path, vm_path), webhooks, strict=True)
        ]
        # each on a port that makes the two vmagent shards scrape one node each
        nodes = split_ports(vm_path, list(scenarios))
        for address, node in nodes.items():
            stack.enter_context(running_daemon(
                str(scenarios[node]), "--config", str(config), "--listen", address))
        targets = {"gpuwatchd": list(nodes)}
        prometheus = stack.enter_context(
            running_prometheus(
                tmp_path, targets, rule_files=rules, alertmanager=alertmanagers[0], nodes=nodes
            )
        )
        scale_out = stack.enter_context(
            running_scale_out(vm_path, targets, rules, alertmanagers[1], nodes=nodes)
        )
        engines = [
            Engine("Prometheus", prometheus, prometheus.alerts, webhooks[0], alertmanagers[0]),
            Engine("VictoriaMetrics", scale_out.store, scale_out.vmalert.alerts, webhooks[1],
                   alertmanagers[1]),
        ]
        # the shards split the targets: each scrapes one node
        scraped = scale_out.scraped_by().values()
        assert sorted(map(sorted, scraped)) == sorted([n] for n in nodes), scraped
        latency = the_hang_as_seen_by(engines[0], nodes)
        for engine in engines[1:]:
            the_hang_as_seen_by(engine, nodes)
    # the window (WINDOW: utilization averaged below 20 %), FOR, and a scrape and an
    # evaluation cycle each
    print(f"\nonset (first idle scrape) -> GpuJobStraggler firing: {latency:.1f} s")


def the_hang_as_seen_by(engine: Engine, nodes: dict[str, str]) -> float:
    """Check what `engine` made of the hang; return the time from its onset (the first
    idle scrape) to GpuJobStraggler firing."""
    store = engine.store

    def firing(alertname: str) -> list[dict]:
        return [
            a
            for a in engine.alerts()
            if a["labels"]["alertname"] == alertname and a["state"] == "firing"
        ]

    (alert,) = wait_until(f"GpuJobStraggler firing on {engine.name}",
                          lambda: firing("GpuJobStraggler"), 90)
    fired = time.time()
    latency = fired - onset(store, fired)

    labels = alert["labels"]
    assert {k: labels[k] for k in ("job_id", "scheduler", "node", "gpu", "user")} == {
        "job_id": "5120",
        "scheduler": "slurm",
        "node": "node2",
        "gpu": "1",
        "user": "ada",
    }
    assert nodes[labels["instance"]] == "node2"
    assert alert["annotations"]["summary"].startswith("job 5120: node2 GPU 1 at ")

    # the job as the store sees it: both nodes' GPUs, three of them spinning
    def value(expr: str) -> float:
        (sample,) = store.query(expr)
        return float(sample["value"][1])

    assert value('job_id:gpuwatchd_nodes:count{job_id="5120"}') == 2
    assert value('job_id:gpuwatchd_gpus:count{job_id="5120"}') == 4
    assert value('job_id:gpuwatchd_gpus_busy:count{job_id="5120"}') == 3
    assert value('job_id:gpuwatchd_gpus_busy:count{job_id="5121"}') == 4

    # the job-wide hang names the rank node2 names, with node2's evidence
    (job,) = wait_until(f"GpuJobNcclStall firing on {engine.name}",
                        lambda: firing("GpuJobNcclStall"), 60)
    assert job["labels"]["job_id"] == "5120"
    hung = "job 5120 is hung in a collective on 3 of its 4 GPUs; it waits for node2 GPU 1 (rank 3)"
    # within an evaluation or two: vmalert, evaluating every second here, may first read a
    # second of the store that one vmagent shard has written and the other not yet (a
    # sample is searchable in VictoriaMetrics about a second after it arrives): "on 1 of
    # its 4 GPUs" for an evaluation (never seen at the shipped 15 s scrapes, 1 m `for`)
    wait_until(f"GpuJobNcclStall's summary on {engine.name}", lambda: [
        a for a in firing("GpuJobNcclStall") if a["annotations"]["summary"] == hung], 10)

    # one page for the hang: the rank it waits for, with what the on-call must read
    def pages() -> list[tuple[dict, dict]]:
        return [(n, a) for n, a in engine.webhook.alerts() if n["receiver"] == "pager"]

    def culprit_paged() -> list[dict]:
        return [a for _, a in pages() if a["labels"]["alertname"] == "GpuNcclStallCulprit"]

    (page,) = wait_until(f"GpuNcclStallCulprit at {engine.name}'s pager", culprit_paged, 60)
    assert {k: page["labels"][k] for k in ("node", "gpu", "job_id", "severity")} == {
        "node": "node2", "gpu": "1", "job_id": "5120", "severity": "critical",
    }  # fmt: skip
    assert re.fullmatch(
        r"node2 GPU 1 \(\S+:\S+\), pid 6102, rank 3, slurm job 5120 is the rank its job's"
        r" hung collective waits for: start there",
        page["annotations"]["summary"],
    ), page["annotations"]["summary"]

    def evidence() -> dict | None:  # the straggler's, once it fires on node2
        (alert,) = firing("GpuNcclStallCulprit")
        annotations = alert["annotations"]
        return None if "pending" in annotations["description"] else annotations

    annotations = wait_until(f"the culprit's evidence on {engine.name}", evidence, 30)
    # (its 1-minute average, which the daemon's summary still takes, spans training)
    assert re.fullmatch(
        r"GPU at [\d.]+% utilization \(1m average\) while its 1 peer GPU\(s\) are busy"
        r" \(the least at 100% utilization\)",
        annotations["description"],
    ), annotations["description"]
    assert annotations["remedy"].startswith("Find why this rank lags"), annotations["remedy"]

    # the rest of the hang reached Alertmanager and is inhibited there
    def inhibited() -> set[tuple[str, str, str]]:
        held = get_json(f"http://{engine.alertmanager}/api/v2/alerts")
        return {
            (a["labels"]["alertname"], a["labels"].get("node", ""), a["labels"].get("gpu", ""))
            for a in held
            if a["status"]["state"] == "suppressed"
        }

    hang = {
        ("GpuNcclStall", "node1", "0"),
        ("GpuNcclStall", "node1", "1"),
        ("GpuNcclStall", "node2", "0"),
        ("GpuJobNcclStall", "", ""),
    }
    wait_until(f"the hang's other alerts inhibited on {engine.name}",
               lambda: hang <= inhibited(), 30)
    assert [a["labels"]["alertname"] for _, a in pages()] == ["GpuNcclStallCulprit"]
    assert len({n["groupKey"] for n, _ in pages()}) == 1

    # nothing for the twin job, not even pending, at any time; GpuJobStraggler only
    # for node2's GPU 1 (ALERTS holds every pending and firing alert's history)
    history = store.query_range("ALERTS", fired - 120, time.time(), 1)
    assert [s["metric"] for s in history if s["metric"].get("gpu") in ("2", "3")] == []
    assert [s["metric"] for s in history if s["metric"].get("job_id") == "5121"] == []
    raised = {
        (s["metric"]["node"], s["metric"]["gpu"])
        for s in history
        if s["metric"]["alertname"] == "GpuJobStraggler"
    }
    assert raised == {("node2", "1")}
    return latency
