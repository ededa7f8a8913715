"""gpuwatchd/report.py without a server: a fake Prometheus answers the report's queries
for one job on one node, so the sample-grid accounting (no jobs.yaml rules), the scrape
gaps, the verdict and the formats are checked number by number. The real Prometheus and
daemons: tests/test_report_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.report import ReportError, build_report, first_sentence, parse_time, verdict
from gpuwatchd.report_format import as_json, as_text
from gpuwatchd.report_prometheus import regex_of, string

T0, SCRAPE, SCRAPES = 1000.0, 15.0, 21  # samples at 1000, 1015, ... 1300
MISSING = 1150.0  # a scrape that failed: no sample, `up` 0
TARGET = {"job": "gpuwatchd", "instance": "n1:9766", "node": "n1"}
REMEDY = "Feed the loop faster: more DataLoader workers; cache the dataset."


def owner(gpu: int) -> dict[str, str]:
    return {**TARGET, "gpu": str(gpu), "uuid": f"GPU-{gpu}", "scheduler": "slurm",
            "job_id": "42", "rank": str(gpu), "user": "ada"}


def starved(gpu: int, t: float) -> bool:  # GPU 0 starved on input at 1060-1135
    return gpu == 0 and 1060 <= t <= 1135


class FakePrometheus:
    base = "http://fake"

    def __init__(self) -> None:
        self.times = [T0 + i * SCRAPE for i in range(SCRAPES) if T0 + i * SCRAPE != MISSING]

    def query(self, expr: str, at: float) -> list[dict]:
        if expr.startswith("last_over_time(gpuwatchd_gpu_owner_info{job_id="):
            return [{"metric": owner(g), "value": [at, "1"]} for g in (0, 1)]
        if expr.startswith("gpuwatchd_gpu_owner_info{"):  # raw samples of one GPU
            return [{"metric": owner(0), "values": [[t, "1"] for t in self.times]}]
        if expr.startswith("up{"):
            values = [[t, "1"] for t in self.times] + [[MISSING, "0"]]
            return [{"metric": TARGET, "values": sorted(values)}]
        assert "sum_over_time(job_id" in expr or "pod=" in expr, expr
        return []  # no accounting rules, no pod of that name

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        grid = [start + i * step for i in range(int((end - start) / step) + 1)]
        seen = [t for t in grid if t != MISSING]  # a failed scrape is stale: absent
        if expr.startswith("gpuwatchd_gpu_owner_info{"):
            return [{"metric": owner(g), "values": [[t, "1"] for t in seen]} for g in (0, 1)]
        labels = {**TARGET, "gpu": "0", "uuid": "GPU-0", "cause": "input_pipeline_stall",
                  "dimension": "input", "severity": "warning"}
        values = [[t, "1"] for t in seen if starved(0, t)]
        if expr.startswith("(gpuwatchd_starvation_active{"):
            return [{"metric": labels, "values": values}]
        assert expr.startswith("gpuwatchd_starvation_info{"), expr
        info = {**labels, "summary": "waits 2.5 s per s of compute", "remedy": REMEDY}
        return [{"metric": info, "values": values}]


def test_samples_accounting_gaps_and_verdict():
    report = build_report(FakePrometheus(), "42", T0 - 600, T0 + 900)
    assert report.accounting == "samples"
    assert (report.start, report.end, report.step) == (T0, T0 + 300, SCRAPE)
    assert (report.nodes, report.gpus, report.scheduler, report.user) == (["n1"], 2, "slurm", "ada")
    # 21 steps, one of them missed: 20 x 15 s per GPU, not interpolated
    assert report.gpu_hours == pytest.approx(2 * 20 * SCRAPE / 3600)
    (cause,) = report.causes
    assert cause.gpu_hours == pytest.approx(6 * SCRAPE / 3600)  # 1060, 1075, ..., 1135
    assert (cause.cause, cause.dimension, cause.gpus) == ("input_pipeline_stall", "input", 1)
    assert cause.share == pytest.approx(6 / 40)
    assert cause.onset is not None and cause.onset.at == 1060 and cause.onset.gpu == "0"
    assert report.dimensions == {"input": pytest.approx(cause.gpu_hours)}
    assert [u.name for u in report.worst_gpus] == ["n1 GPU 0 (rank 0)"]
    assert report.worst_gpus[0].share == pytest.approx(6 / 20)
    assert [(g.start, g.end, g.kind) for g in report.gaps] == [(1135.0, 1165.0, "scrape failed")]
    assert report.verdict == (
        "15 % of GPU time lost to input: input_pipeline_stall on 1 of 2 GPUs — "
        "Feed the loop faster")
    assert json.loads(as_json(report))["starved_share"] == pytest.approx(6 / 40)
    text = as_text(report)
    assert "Verdict:" in text and "samples every 15 s" in text and "scrape failed" in text
    markdown = as_text(report, markdown=True)
    assert markdown.startswith("# Job 42") and "| input_pipeline_stall | input | 15 % |" in markdown


def test_a_job_prometheus_does_not_know_is_an_error():
    class Empty(FakePrometheus):
        def query(self, expr: str, at: float) -> list[dict]:
            return []

    with pytest.raises(ReportError, match=r"no GPU owned by 'ns/pod-1'.*namespace=\"ns\""):
        build_report(Empty(), "ns/pod-1", 0, 100)


def test_the_command_reports_an_unreachable_prometheus():
    result = CliRunner().invoke(main, ["report", "42", "--prometheus", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot query Prometheus at http://127.0.0.1:9" in result.output


def test_times_and_literals():
    assert parse_time("1700000000", 0) == 1700000000
    assert parse_time("6h", 0, now=100000) == 100000 - 6 * 3600
    assert parse_time("2026-01-02T03:04:05Z", 0) == parse_time("2026-01-02 03:04:05", 0)
    assert parse_time(None, 7) == 7
    with pytest.raises(ReportError, match="ISO 8601"):
        parse_time("yesterday", 0)
    assert string('a"b\\c') == '"a\\"b\\\\c"'
    assert regex_of(["n1.x:9766", "n2"]) == '"n1\\\\.x:9766|n2"'
    assert first_sentence("Raise num_workers; then pin memory.") == "Raise num_workers"
    assert first_sentence("Check cooling. Then more.") == "Check cooling"


def test_verdict_without_starvation():
    report = build_report(FakePrometheus(), "42", T0 - 600, T0 + 900)
    report.causes, report.dimensions = [], {}
    assert verdict(report) == "no starvation cause fired on the job's 2 GPUs"


# MIG (docs/mig.md): job 900 holds GPU instance 1 of m1's GPU 0 (3g.40gb, rank 0) and the
# whole GPU 1 (rank 1); the MIG GPU 0 has no owner of its own. tests/prometheus/
# report.test.yaml runs the queries the report sends here on the same series in promtool.
MIG_TARGET = {"job": "gpuwatchd", "instance": "m1:9766", "node": "m1"}
MIG_OWNERS = [
    {**MIG_TARGET, "gpu": "0", "uuid": "m1-GPU0", "gpu_instance": "1", "profile": "3g.40gb",
     "scheduler": "slurm", "job_id": "900", "rank": "0", "user": "ivy"},
    {**MIG_TARGET, "gpu": "1", "uuid": "m1-GPU1", "scheduler": "slurm", "job_id": "900",
     "rank": "1", "user": "ivy"},
]
PROMTOOL_CASES = Path(__file__).parent / "prometheus" / "report.test.yaml"


class MigPrometheus:
    """What Prometheus answers for job 900 (tests/prometheus/report.test.yaml's MIG
    case): an owner query naming the instance form finds both devices, one naming only
    gpuwatchd_gpu_owner_info the whole GPU; GI 1 starved on input at 1060-1105."""

    base = "http://fake"

    def __init__(self) -> None:
        self.times = [T0 + i * SCRAPE for i in range(SCRAPES)]
        self.ranges: list[str] = []

    def owners(self, expr: str) -> list[dict[str, str]]:
        return [m for m in MIG_OWNERS
                if "gpu_instance" not in m or "gpuwatchd_gpu_instance_owner_info" in expr]

    def query(self, expr: str, at: float) -> list[dict]:
        if expr.startswith("last_over_time(gpuwatchd_gpu_owner_info{job_id="):
            return [{"metric": m, "value": [at, "1"]} for m in self.owners(expr)]
        if expr.startswith("gpuwatchd_gpu_instance_owner_info{"):  # GI 1's raw samples
            assert 'gpu_instance="1"' in expr, expr
            return [{"metric": MIG_OWNERS[0], "values": [[t, "1"] for t in self.times]}]
        if expr.startswith("gpuwatchd_gpu_owner_info{"):
            return [{"metric": MIG_OWNERS[1], "values": [[t, "1"] for t in self.times]}]
        if expr.startswith("up{"):
            return [{"metric": MIG_TARGET, "values": [[t, "1"] for t in self.times]}]
        return []  # no accounting rules

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        self.ranges.append(expr)
        grid = [start + i * step for i in range(int((end - start) / step) + 1)]
        if expr.startswith("gpuwatchd_gpu_owner_info{"):
            return [{"metric": m, "values": [[t, "1"] for t in grid]} for m in self.owners(expr)]
        labels = {**MIG_TARGET, "gpu": "0", "uuid": "m1-GPU0", "gpu_instance": "1",
                  "cause": "dataloader_single_process", "dimension": "input"}
        values = [[t, "1"] for t in grid if 1060 <= t <= 1105]
        if "gpu_instance)" not in expr:  # joined on (job, instance, uuid): no instance cause
            return []
        if expr.startswith("gpuwatchd_starvation_info{"):
            labels = {**labels, "summary": "0 worker processes", "remedy": "Raise num_workers."}
        return [{"metric": labels, "values": values}]


def test_mig_gpu_instances_are_the_jobs_gpus():
    fake = MigPrometheus()
    report = build_report(fake, "900", T0 + 300 - 1800, T0 + 300)
    assert (report.gpus, report.gpu_instances, report.nodes) == (2, 1, ["m1"])
    assert report.gpu_hours == pytest.approx(2 * SCRAPES * SCRAPE / 3600)
    (cause,) = report.causes
    assert (cause.cause, cause.gpus, cause.gpu_hours) == (
        "dataloader_single_process", 1, pytest.approx(4 * SCRAPE / 3600))
    assert cause.onset is not None and (cause.onset.node, cause.onset.gpu) == ("m1", "0/1")
    assert [u.name for u in report.worst_gpus] == ["m1 GPU 0/1 (3g.40gb, rank 0)"]
    assert report.verdict == ("10 % of GPU time lost to input: dataloader_single_process on 1 "
                              "of 2 GPUs — Raise num_workers")
    document = json.loads(as_json(report))
    assert document["gpu_instances"] == 1 and document["causes"][0]["onset"]["gpu"] == "0/1"
    text = as_text(report)
    assert "GPUs:             2 (1 of them MIG GPU instance)\n" in text
    assert "  m1 GPU 0/1 (3g.40gb, rank 0)  " in text and "on m1 GPU 0/1" in text
    # promtool runs these very queries on the same series: a cause of the MIG GPU as a
    # whole, or of the neighbour's instance, is never the job's
    cases = PROMTOOL_CASES.read_text()
    assert len(fake.ranges) == 3
    for expr in fake.ranges:
        assert f"expr: '{expr}'" in cases, expr


def test_a_job_without_mig_has_no_gpu_instances_in_its_document():
    report = build_report(FakePrometheus(), "42", T0 - 600, T0 + 900)
    assert report.gpu_instances == 0 and "gpu_instances" not in json.loads(as_json(report))
    assert "GPUs:             2\n" in as_text(report)
