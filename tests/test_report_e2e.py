"""`gpuwatchd report` end to end: one real Prometheus with deploy/prometheus/jobs.yaml and
two simulated nodes (`gpuwatchd run --simulate`, real daemons) running Slurm job 5120
(ranks 0-1 on node1's GPUs 0-1, ranks 2-3 on node2's GPUs 0-1) beside job 5121 (GPUs
2-3 of each node), the built-in slurm-2node-job-* scenarios on a short timeline:

    0 s      job 5121 runs; job 5120 not yet started         (BEFORE: both daemons serve)
    8 s      job 5120 starts on GPUs 0-1 of both nodes        (TRAINING)
    11 s     clock_throttled on node1 GPU 0, node2 GPUs 0-1 (THROTTLED: job 5120's ranks
             0, 2, 3) and node2 GPU 2 (job 5121's)
    21 s     all busy again                                 (RECOVERED)
    25 s     job 5120 ends: its processes leave GPUs 0-1 of both nodes; 5121 runs on

clock_throttled's `for` and `keep_firing_for` are cut to 0, so each throttled GPU is
starved for THROTTLED seconds (the daemon's own count is its starvation counter), and
the accounting group of jobs.yaml is evaluated every second (its `interval: 1m` and
`/ 60` cut to 1s and `/ 3600`; tests/prometheus/report.test.yaml checks the shipped
rules). Prometheus starts first, so it scrapes each daemon from its first second.

The report must find the job's 2 nodes and 4 GPUs, its run time and GPU-hours, and
3 x THROTTLED GPU-seconds lost to clock_throttled (compute) on 3 of 4 GPUs, each within
a scrape interval of the daemons' own counts; its totals must equal the rules' sums.

Beside them, node3 runs the built-in mig-owners-pod-slurm-a100 throughout (MIG,
docs/mig.md): Slurm job 7001 holds only GPU instance 5 (2g.20gb) of its GPU 0, where a
helper process contends with its main process (gpu_contention, its `for` cut to 0), and
job 7002 the whole GPU 1. The report of job 7001 must count its instance as its one GPU,
"node3 GPU 0/5", with the contention's time.

`python tests/test_report_e2e.py DIR` writes the text and Markdown reports of a run to
DIR (docs/report.md's sample output; report-sample-mig.txt: job 7001's).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from daemon_process import running_daemon, shorten
from dashboards import GRAFANA, panel_queries
from servers import Prometheus, free_port, running_prometheus, wait_until

from gpuwatchd.cli import main

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "deploy" / "prometheus" / "jobs.yaml"
DEFAULT_RULES = ROOT / "gpuwatchd" / "rules" / "default.yaml"
BEFORE, TRAINING, THROTTLED, RECOVERED = 8, 3, 10, 4  # seconds
SCRAPE = 1.0  # Prometheus's scrape and evaluation interval, seconds
JITTER = 0.05  # how far apart Prometheus may time two scrapes beyond SCRAPE, seconds
JOB, TWIN = "5120", "5121"
THROTTLED_GPUS = {"node1": [0], "node2": [0, 1, 2]}  # node2 GPU 2 is job 5121's
MIG_SCENARIO, MIG_JOB, MIG_WHOLE_GPU_JOB = "mig-owners-pod-slurm-a100", "7001", "7002"
CAUSE_RULE = "job_id_cause:gpuwatchd_starvation_gpu_hours:sampled1m"


def short_rules(tmp_path: Path) -> tuple[Path, Path]:
    """(jobs.yaml with the accounting group evaluated every second, the daemon's default
    rules with clock_throttled firing and resolving at once)."""
    jobs = yaml.safe_load(JOBS.read_text())
    (group,) = [g for g in jobs["groups"] if g["name"] == "gpuwatchd.jobs.accounting"]
    assert group["interval"] == "1m"
    group["interval"] = f"{SCRAPE:g}s"
    for rule in group["rules"]:
        assert rule["expr"].rstrip().endswith("/ 60"), rule["record"]
        rule["expr"] = rule["expr"].rstrip()[: -len("60")] + f"{3600 / SCRAPE:g}"
    daemon = yaml.safe_load(DEFAULT_RULES.read_text())
    for rule in daemon["rules"]:  # node3's MIG instance: gpu_contention at once too
        if rule["name"] in ("clock_throttled", "gpu_contention"):
            rule["for"] = rule["keep_firing_for"] = "0s"
    paths = tmp_path / "jobs.yaml", tmp_path / "rules.yaml"
    for path, data in zip(paths, (jobs, daemon), strict=True):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


def timeline(scenario: str, node: str, tmp_path: Path) -> Path:
    """The built-in scenario with the module's timeline in place of its phases."""
    path = shorten(scenario, {p: "1s" for p in ("training", "still-training", "rank3-slow")},
                   tmp_path)
    data = yaml.safe_load(path.read_text())
    busy = data["phases"][0]
    processes = busy["changes"]  # one process per GPU: pids 6101, 6102, 6201, 6202
    heat = {"clock_event_reasons": ["sw_thermal_slowdown", "hw_thermal_slowdown"],
            "temperature_c": 91, "sm_clock_mhz": 990, "power_w": 380}
    ended = [c for c in processes if c["gpus"][0] >= 2] + [
        {"gpus": [0, 1], "set": {"processes": []}}
    ]
    data["phases"] = [
        {**busy, "name": "before", "duration": f"{BEFORE}s", "changes": ended},
        {**busy, "name": "training", "duration": f"{TRAINING}s"},
        {**busy, "name": "throttled", "duration": f"{THROTTLED}s",
         "changes": processes + [{"gpus": THROTTLED_GPUS[node], "set": heat}]},
        {**busy, "name": "recovered", "duration": f"{RECOVERED}s"},
        {**busy, "name": "job-5120-ended", "duration": "10m", "changes": ended},
    ]
    path = tmp_path / f"{node}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def report(prometheus: Prometheus, job: str, since: float, until: float, *extra: str) -> Any:
    args = ["report", job, "--prometheus", prometheus.base, "--since", f"{since:.3f}",
            "--until", f"{until:.3f}", *extra]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in extra else result.output


def run_job(tmp_path: Path) -> dict[str, Any]:
    """Run the timeline; return the reports and what Prometheus and the daemons counted."""
    jobs_rules, daemon_rules = short_rules(tmp_path)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(yaml.safe_dump({
        "rules_file": str(daemon_rules),
        "sources": {"processes": {"interval": "1s"}},  # owners seen within a second
    }))
    ports = {"node1": free_port(), "node2": free_port(), "node3": free_port()}
    targets = {f"127.0.0.1:{port}": node for node, port in ports.items()}
    with ExitStack() as stack:
        prometheus = stack.enter_context(running_prometheus(
            tmp_path, {"gpuwatchd": list(targets)}, rule_files=[jobs_rules],
            interval=f"{SCRAPE:g}s", nodes=targets))
        since = time.time()
        launched = {}  # when each daemon's timeline started, at the latest
        for node, scenario in (("node1", "slurm-2node-job-healthy-half"),
                               ("node2", "slurm-2node-job-slow-gpu")):
            stack.enter_context(running_daemon(
                str(timeline(scenario, node, tmp_path)), "--config", str(config),
                "--listen", f"127.0.0.1:{ports[node]}"))
            launched[node] = time.time()
        mig = shorten(MIG_SCENARIO, {"two-tenants": "10m"}, tmp_path)
        stack.enter_context(running_daemon(
            str(mig), "--config", str(config), "--listen", f"127.0.0.1:{ports['node3']}"))

        owner = f'gpuwatchd_gpu_owner_info{{job_id="{JOB}"}}'
        wait_until("job 5120 on both nodes",
                   lambda: len(prometheus.query(f"count by (node) ({owner})")) == 2, 30)
        # ended: its owner series gone, and the accounting rules evaluated after that
        wait_until("job 5120 to end", lambda: not prometheus.query(owner), 60)
        wait_until("the accounting rules past its end", lambda: prometheus.query(
            f'absent(job_id:gpuwatchd_gpu_hours:sampled1m{{job_id="{JOB}"}})'), 30)
        # job 7001's instance contended and accounted for (at once: it ran all along)
        wait_until("gpu_contention on node3 GPU 0/5 in the accounting", lambda: prometheus.query(
            f'{CAUSE_RULE}{{job_id="{MIG_JOB}", cause="gpu_contention"}} > 0'), 30)
        until = time.time()
        window = f"{round(until - since) + 1}s"
        counted = {
            (s["metric"]["node"], s["metric"]["gpu"]): float(s["value"][1])
            for s in prometheus.query(
                'max_over_time(gpuwatchd_starvation_seconds_total{cause="clock_throttled"}'
                f"[{window}]) > 0")
        }
        rules, mig_rules = (
            {
                s["metric"]["cause"]: float(s["value"][1])
                for s in prometheus.query(
                    f'sum by (cause) (sum_over_time({CAUSE_RULE}{{job_id="{job}"}}[{window}])) > 0',
                )
            }
            for job in (JOB, MIG_JOB)
        )
        mig_counted = prometheus.query(
            'max_over_time(gpuwatchd_starvation_seconds_total{cause="gpu_contention"}'
            f"[{window}]) > 0")
        # when Prometheus first saw job 7001's instance owner
        mig_first = prometheus.query(
            "min_over_time(timestamp(gpuwatchd_gpu_instance_owner_info"
            f'{{job_id="{MIG_JOB}"}})[{window}:{SCRAPE:g}s])')
        # the job dashboard's panels over the same window (its time range)
        panels = panel_queries(GRAFANA / "job.json", {"job_id": JOB, "__range": window})
        dashboard = {
            title: {s["metric"].get("cause", ""): float(s["value"][1])
                    for s in prometheus.query(expr)}
            for title, expr in panels
            if title in ("GPU-hours of the job", "GPU-hours lost per cause")
        }
        # Prometheus saw each node's job 5121 before job 5120 started: scraped from BEFORE
        first, last = (
            {
                (s["metric"]["node"], s["metric"]["job_id"]): float(s["value"][1])
                for s in prometheus.query(
                    f"{how}_over_time(timestamp(max by (node, job_id) "
                    f"(gpuwatchd_gpu_owner_info))[{window}:{SCRAPE:g}s])")
            }
            for how in ("min", "max")
        )
        return {
            "first": first,
            "last": last,
            "launched": launched,
            "dashboard": dashboard,
            "since": since,
            "until": until,
            "counted": counted,
            "rules": rules,
            "mig_rules": mig_rules,
            "mig_counted": mig_counted,
            "mig_first": mig_first,
            "mig": report(prometheus, MIG_JOB, since, until, "--json"),
            "mig_text": report(prometheus, MIG_JOB, since, until),
            "mig_whole_gpu": report(prometheus, MIG_WHOLE_GPU_JOB, since, until, "--json"),
            "json": report(prometheus, JOB, since, until, "--json"),
            "twin": report(prometheus, TWIN, since, until, "--json"),
            "text": report(prometheus, JOB, since, until),
            "markdown": report(prometheus, JOB, since, until, "--markdown"),
        }


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_report_matches_the_timeline_and_the_rules(tmp_path: Path) -> None:
    run = run_job(tmp_path)
    got = run["json"]

    # the daemons' own counts: each throttled GPU starved THROTTLED s, within a poll
    counted = run["counted"]
    assert set(counted) == {("node1", "0"), ("node2", "0"), ("node2", "1"), ("node2", "2")}
    assert all(abs(s - THROTTLED) <= 2 for s in counted.values()), counted
    job_counted = sum(s for (node, gpu), s in counted.items() if gpu != "2")

    assert got["nodes"] == ["node1", "node2"]
    assert got["gpus"] == 4
    assert (got["scheduler"], got["user"]) == ("slurm", "ada")
    assert got["accounting"] == "counters"
    assert got["gaps"] == []

    for node in ("node1", "node2"):
        assert run["first"][(node, TWIN)] < run["first"][(node, JOB)], "scraped too late"

    # run time: from node1's job start to node2's job end (node2 started later)
    duration = TRAINING + THROTTLED + RECOVERED
    offset = run["launched"]["node2"] - run["launched"]["node1"]
    run_time = got["end"] - got["start"]
    poll = 1.0  # the processes source's interval: owners appear and leave within a poll
    assert duration - poll - SCRAPE <= run_time <= duration + offset + poll + SCRAPE, run_time
    # GPU-hours: 4 GPUs over `duration`, within a poll and a scrape per GPU
    held = got["gpu_hours"] * 3600
    assert abs(held - 4 * duration) <= 4 * (poll + SCRAPE), held
    # ... and within a scrape per GPU of the owner samples Prometheus holds: the interval
    # that ends with a GPU's first owner sample counts, as Prometheus spaced it (its
    # timestamps jitter by milliseconds on a loaded machine: 4.012 s for 4 GPUs once)
    seen = sum(2 * (run["last"][(n, JOB)] - run["first"][(n, JOB)]) for n in ("node1", "node2"))
    assert abs(held - seen) <= 4 * (SCRAPE + JITTER), (held, seen)

    # the one cause, on job 5120's three throttled GPUs, within a scrape of the daemons
    (cause,) = got["causes"]
    assert (cause["cause"], cause["dimension"], cause["gpus"]) == ("clock_throttled", "compute", 3)
    lost = cause["gpu_hours"] * 3600
    assert abs(lost - job_counted) < 1e-6, (lost, counted)
    assert got["dimensions"] == {"compute": pytest.approx(cause["gpu_hours"], abs=1e-12)}
    assert got["starved_gpu_hours"] == pytest.approx(cause["gpu_hours"], abs=1e-12)
    assert abs(cause["share"] - lost / (got["gpu_hours"] * 3600)) < 1e-9
    onset = cause["onset"]
    assert (onset["node"], onset["gpu"]) in {("node1", "0"), ("node2", "0"), ("node2", "1")}
    assert "990 MHz" in onset["summary"] and onset["remedy"].startswith("Check cooling")
    assert got["start"] + TRAINING - 2 <= onset["at"] <= got["start"] + TRAINING + offset + 2

    # the recording rules and the job dashboard sample every evaluation (SCRAPE here):
    # within one per transition (a cause's start and end, the job's) and GPU
    (rules,) = run["rules"].values()
    assert set(run["rules"]) == {"clock_throttled"}
    assert abs(rules - cause["gpu_hours"]) * 3600 <= 3 * 2 * SCRAPE, (rules, cause)
    (held,) = run["dashboard"]["GPU-hours of the job"].values()
    assert abs(held - got["gpu_hours"]) * 3600 <= 4 * 2 * SCRAPE, (held, got["gpu_hours"])
    by_cause = run["dashboard"]["GPU-hours lost per cause"]
    assert {c: h for c, h in by_cause.items() if h} == run["rules"]

    # per GPU and node: the same counts, adding up to the total
    worst = got["worst_gpus"]
    assert sorted(u["name"] for u in worst) == [
        "node1 GPU 0 (rank 0)", "node2 GPU 0 (rank 2)", "node2 GPU 1 (rank 3)"]
    for usage in worst:
        node, _, gpu = usage["name"].split(" ")[:3]
        assert abs(usage["starved_gpu_hours"] * 3600 - counted[(node, gpu)]) < 1e-6
    assert [n["name"] for n in got["worst_nodes"]] == ["node2", "node1"]
    assert abs(sum(n["starved_gpu_hours"] for n in got["worst_nodes"])
               - got["starved_gpu_hours"]) < 1e-9

    assert got["verdict"].startswith(f"{round(cause['share'] * 100)} % of GPU time lost to "
                                      "compute: clock_throttled on 3 of 4 GPUs — Check cooling")
    # the twin job: its one throttled GPU, never job 5120's
    twin = run["twin"]
    assert (twin["gpus"], twin["causes"][0]["gpus"]) == (4, 1)
    assert abs(twin["causes"][0]["gpu_hours"] * 3600 - counted[("node2", "2")]) < 1e-6

    for text in (run["text"], run["markdown"]):
        assert "clock_throttled" in text and "Check cooling" in text and "node2" in text
    assert "gpu_instances" not in got and "gpu_instances" not in twin

    # MIG: job 7001's one GPU is node3's GPU instance 0/5, contended from its start
    mig = run["mig"]
    assert (mig["nodes"], mig["gpus"], mig["gpu_instances"]) == (["node3"], 1, 1)
    assert (mig["scheduler"], mig["user"], mig["accounting"]) == ("slurm", "ada", "counters")
    (contention,) = mig["causes"]
    assert (contention["cause"], contention["dimension"], contention["gpus"]) == (
        "gpu_contention", "system", 1)
    assert (contention["onset"]["node"], contention["onset"]["gpu"]) == ("node3", "0/5")
    assert set(run["mig_rules"]) == {"gpu_contention"}
    (first,) = run["mig_first"]
    held = mig["gpu_hours"] * 3600
    assert abs(held - (run["until"] - float(first["value"][1]))) <= 3 * SCRAPE, held
    # the daemon's own count, on the instance (the cause carries its gpu_instance)
    (counted_mig,) = run["mig_counted"]
    assert (counted_mig["metric"]["node"], counted_mig["metric"]["gpu_instance"]) == ("node3", "5")
    assert abs(contention["gpu_hours"] * 3600 - float(counted_mig["value"][1])) <= 3 * SCRAPE
    assert [u["name"] for u in mig["worst_gpus"]] == ["node3 GPU 0/5 (2g.20gb, rank 0)"]
    assert " of GPU time lost to system: gpu_contention on 1 of 1 GPUs — " in mig["verdict"]
    text = run["mig_text"]
    assert "GPUs:             1 (MIG GPU instance)\n" in text
    assert "node3 GPU 0/5 (2g.20gb, rank 0)" in text and "on node3 GPU 0/5" in text
    # job 7002 on the same node's whole GPU 1: as without MIG, and none of GI 5's causes
    whole = run["mig_whole_gpu"]
    assert (whole["gpus"], whole["causes"]) == (1, []) and "gpu_instances" not in whole


if __name__ == "__main__":  # sample output for docs/report.md
    import tempfile

    out = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        result = run_job(Path(tmp))
    (out / "report-sample.txt").write_text(result["text"])
    (out / "report-sample.md").write_text(result["markdown"])
    (out / "report-sample.json").write_text(json.dumps(result["json"], indent=2))
    (out / "report-sample-mig.txt").write_text(result["mig_text"])
    print(f"daemons' counts (s): {result['counted']}; rules (GPU-h): {result['rules']}")
