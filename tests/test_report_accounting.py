"""`gpuwatchd report` on a real Prometheus holding a known timeline (tests/backfill.py),
with deploy/prometheus/jobs.yaml's accounting rules evaluated over it minute by minute as
a live server would have (a report must not follow them: minute ticks decide short
episodes). Scrapes every 15 s, from 08:00:00 UTC (T0) for 40 minutes:

Slurm job 5120 holds GPUs 0-1 of nodes a and b from T0+100 to T0+1900 (owner samples
T0+105 ... T0+1890); node b's scrape at T0+1500 fails (a gap, counted nowhere). Each
cause pends for its `for` before firing:

    input_pipeline_stall       all 4 GPUs, T0+365 - T0+637      272 s each (1m `for`)
    dataloader_single_process  a GPU 0, T0+400 - T0+500 (inside the stall: input once)
    clock_throttled            b GPUs 0-1, T0+905 - T0+983       78 s each
    straggler_gpu              a GPU 1, T0+1204 - T0+1230        26 s (2m `for`)

Job 5121 holds a GPU 2 throughout (throttled with b's GPUs: never 5120's); job 5122
takes b GPU 1 at T0+1900, where input_pipeline_stall fires again at T0+1950 - T0+2010
(5122's, on the counter 5120's stall left at 272). Pod ml/train-0 (no job id) holds b
GPU 2: what `report ''` matched. On node m, job 900 holds MIG GPU instance 0/1
(3g.40gb) and the whole GPU 1, job 901 instance 0/2 (docs/mig.md).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from backfill import (
    SCRAPE,
    Device,
    Episode,
    Owner,
    Timeline,
    backfilled_prometheus,
    backfilled_victoria_metrics,
)
from click.testing import CliRunner

from gpuwatchd.cli import main

T0 = 1793520000  # 2026-11-01 08:00:00 UTC
JOBS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "jobs.yaml"
A0, A1, A2 = Device("a", 0), Device("a", 1), Device("a", 2)
B0, B1, B2 = Device("b", 0), Device("b", 1), Device("b", 2)
GI1, GI2 = Device("m", 0, "1", "3g.40gb"), Device("m", 0, "2", "3g.40gb")
M0, M1 = Device("m", 0), Device("m", 1)  # M0: the MIG GPU as a whole
HELD = (T0 + 100, T0 + 1900)
INPUT, SHORT, HOT, SLOW = 272, 100, 78, 26  # seconds each episode fired


def timeline() -> Timeline:
    job = [Owner(d, *HELD, job_id="5120", rank=str(r)) for r, d in enumerate((A0, A1, B0, B1))]
    others = [
        Owner(A2, T0, T0 + 2400, job_id="5121", user="bob"),
        Owner(B1, T0 + 1900, T0 + 2400, job_id="5122", user="bob"),
        Owner(B2, T0, T0 + 2400, namespace="ml", pod="train-0", user=""),
        Owner(GI1, T0, T0 + 900, job_id="900", user="ivy"),
        Owner(M1, T0, T0 + 900, job_id="900", rank="1", user="ivy"),
        Owner(GI2, T0, T0 + 2400, job_id="901", user="jon"),
    ]
    stall = [Episode(d, "input_pipeline_stall", "input", T0 + 365, T0 + 365 + INPUT,
                     summary="waits 2.5 s per s of compute", remedy="Feed the loop faster.")
             for d in (A0, A1, B0, B1)]
    episodes = [
        *stall,
        Episode(A0, "dataloader_single_process", "input", T0 + 400, T0 + 400 + SHORT),
        *(Episode(d, "clock_throttled", "compute", T0 + 905, T0 + 905 + HOT, summary="990 MHz")
          for d in (B0, B1, A2)),
        Episode(A1, "straggler_gpu", "communication", T0 + 1204, T0 + 1204 + SLOW, pending=120),
        Episode(B1, "input_pipeline_stall", "input", T0 + 1950, T0 + 2010),
        Episode(GI1, "dataloader_single_process", "input", T0 + 200, T0 + 320),
        Episode(GI2, "input_pipeline_stall", "input", T0, T0 + 2400, pending=0),
        Episode(M0, "pcie_link_degraded", "pcie", T0 + 100, T0 + 400, pending=30),
        Episode(M1, "clock_throttled", "compute", T0 + 500, T0 + 560),
    ]
    return Timeline(T0, T0 + 2400, job + others, episodes, failed={"b": [T0 + 1500]})


@pytest.fixture(scope="module", params=["prometheus", "victoriametrics"])
def prometheus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The timeline in a Prometheus, and in a VictoriaMetrics store (its rules replayed by
    vmalert): every report below must come out the same from both."""
    tmp_path = tmp_path_factory.mktemp("backfill")
    jobs = yaml.safe_load(JOBS.read_text())
    accounting = [g for g in jobs["groups"] if g["name"] == "gpuwatchd.jobs.accounting"]
    rules = tmp_path / "accounting.yaml"
    rules.write_text(yaml.safe_dump({"groups": accounting}))
    backfilled = {"prometheus": backfilled_prometheus,
                  "victoriametrics": backfilled_victoria_metrics}[request.param]
    with backfilled(tmp_path, timeline(), [rules]) as server:
        yield server


def invoke(prometheus: Any, job: str, since: float = T0, until: float = T0 + 2400,
           *extra: str) -> Any:
    args = ["report", job, "--prometheus", prometheus.base, "--since", f"{since}",
            "--until", f"{until}", *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def report(prometheus: Any, job: str, since: float = T0, until: float = T0 + 2400) -> dict:
    result = invoke(prometheus, job, since, until, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def seconds(hours: float) -> float:
    return round(hours * 3600, 6)


def test_every_figure_is_the_daemons_count_to_the_second(prometheus: Any) -> None:
    got = report(prometheus, "5120")
    assert got["accounting"] == "counters" and got["scrape_interval"] == SCRAPE
    causes = {c["cause"]: (seconds(c["gpu_hours"]), c["gpus"]) for c in got["causes"]}
    assert causes == {
        "input_pipeline_stall": (4 * INPUT, 4),  # the minute rules: 960 (-12 %)
        "clock_throttled": (2 * HOT, 2),  # the minute rules: 120 (-23 %)
        "dataloader_single_process": (SHORT, 1),
        "straggler_gpu": (SLOW, 1),  # between two minute ticks: 0 in the rules
    }
    # the nested dataloader episode counts once in its dimension and in the starved time
    assert {d: seconds(h) for d, h in got["dimensions"].items()} == {
        "input": 4 * INPUT, "compute": 2 * HOT, "communication": SLOW}
    assert seconds(got["starved_gpu_hours"]) == 4 * INPUT + 2 * HOT + SLOW
    assert got["overlap_gpu_hours"] == 0
    # 120 scrape intervals a GPU; node b's failed scrape leaves out two of its GPUs' each
    assert seconds(got["gpu_hours"]) == 4 * 120 * SCRAPE - 2 * 2 * SCRAPE
    assert [(g["node"], g["kind"]) for g in got["gaps"]] == [("b", "scrape failed")]


def test_one_accounting_the_worst_gpus_and_nodes_add_up(prometheus: Any) -> None:
    got = report(prometheus, "5120")
    starved = seconds(got["starved_gpu_hours"])
    for worst in (got["worst_gpus"], got["worst_nodes"]):
        assert round(sum(seconds(u["starved_gpu_hours"]) for u in worst), 6) == starved
    gpus = {u["name"]: (seconds(u["starved_gpu_hours"]), u["top_cause"])
            for u in got["worst_gpus"]}
    assert gpus == {
        "a GPU 0 (rank 0)": (INPUT, "input_pipeline_stall"),
        "a GPU 1 (rank 1)": (INPUT + SLOW, "input_pipeline_stall"),
        "b GPU 0 (rank 2)": (INPUT + HOT, "input_pipeline_stall"),
        "b GPU 1 (rank 3)": (INPUT + HOT, "input_pipeline_stall"),
    }
    nodes = {u["name"]: seconds(u["starved_gpu_hours"]) for u in got["worst_nodes"]}
    assert nodes == {"a": 2 * INPUT + SLOW, "b": 2 * (INPUT + HOT)}


def test_onsets_say_when_the_cause_fired_and_when_the_fault_began(prometheus: Any) -> None:
    onsets = {c["cause"]: c["onset"] for c in report(prometheus, "5120")["causes"]}
    stall, straggler = onsets["input_pipeline_stall"], onsets["straggler_gpu"]
    # fired: to the second (the counter's rise); held: the first pending sample
    assert (stall["at"], stall["holds_since"], stall["window"]) == (T0 + 365, T0 + 315, 60)
    assert (stall["node"], stall["gpu"], stall["summary"]) == (
        "a", "0", "waits 2.5 s per s of compute")
    assert (straggler["at"], straggler["holds_since"]) == (T0 + 1204, T0 + 1095)
    assert (straggler["node"], straggler["gpu"]) == ("a", "1")
    hot = onsets["clock_throttled"]
    assert (hot["at"], hot["holds_since"], hot["window"]) == (T0 + 905, T0 + 855, 0)
    text = invoke(prometheus, "5120").output
    assert "fault began" in text and "first onset" in text
    assert "2026-11-01 08:04:15 to 08:05:15 UTC  2026-11-01 08:06:05 UTC on a GPU 0" in text


def test_other_jobs_on_the_same_gpus_are_not_the_jobs(prometheus: Any) -> None:
    twin = report(prometheus, "5121")
    assert [(c["cause"], seconds(c["gpu_hours"])) for c in twin["causes"]] == [
        ("clock_throttled", HOT)]
    after = report(prometheus, "5122")  # b GPU 1 from T0+1900: the stall there is its own
    assert [(c["cause"], seconds(c["gpu_hours"])) for c in after["causes"]] == [
        ("input_pipeline_stall", 60)]


def test_verdict_and_formats(prometheus: Any) -> None:
    got = report(prometheus, "5120")
    assert got["verdict"] == ("15 % of GPU time lost to input: input_pipeline_stall on 4 of 4 "
                              "GPUs — Feed the loop faster")
    assert "gpu_instances" not in got and got["version"] == 2
    text = invoke(prometheus, "5120").output
    assert "GPUs:             4\n" in text and "scrape failed" in text
    markdown = invoke(prometheus, "5120", T0, T0 + 2400, "--markdown").output
    assert markdown.startswith("# Job 5120")
    assert "| input_pipeline_stall | input | 15 % |" in markdown
    pod = report(prometheus, "ml/train-0")
    assert (pod["gpus"], pod["causes"], pod["accounting"]) == (1, [], "counters")
    assert pod["verdict"] == "no starvation cause fired on the job's 1 GPUs"


def test_a_job_prometheus_does_not_know_is_an_error(prometheus: Any) -> None:
    result = invoke(prometheus, "ns/pod-1")
    assert result.exit_code == 1
    assert "no GPU owned by 'ns/pod-1'" in result.output and 'namespace="ns"' in result.output


@pytest.mark.parametrize("job", ["", " ", "/", "ml/", "/train-0"])
def test_an_empty_job_id_is_refused(prometheus: Any, job: str) -> None:
    result = invoke(prometheus, job)
    assert result.exit_code == 1, result.output
    assert "expected a Slurm job id, a torchrun run id, or a pod" in result.output
    assert "GPU-h" not in result.output


def test_a_window_that_cuts_the_job_says_so(prometheus: Any) -> None:
    whole = report(prometheus, "5120")
    assert (whole["cut_start"], whole["cut_end"]) == (False, False)
    cut = report(prometheus, "5120", T0 + 600, T0 + 1200)
    assert (cut["cut_start"], cut["cut_end"]) == (True, True)
    assert seconds(cut["gpu_hours"]) == 4 * 600  # the window's time, not a scrape more
    # the stall fired before the window: its onset is not in it
    stall = next(c for c in cut["causes"] if c["cause"] == "input_pipeline_stall")
    assert seconds(stall["gpu_hours"]) == 4 * (T0 + 365 + INPUT - (T0 + 600))
    assert (stall["onset"]["before"], stall["onset"]["at"]) == (True, T0 + 600)
    text = invoke(prometheus, "5120", T0 + 600, T0 + 1200).output
    assert "Run time:         at least 0:10:00: the window cuts the job (it held its GPUs " \
           "before --since and still at --until)" in text
    assert "before 2026-11-01 08:10:00 UTC on a GPU 0" in text
    started = report(prometheus, "5120", T0, T0 + 1200)
    assert (started["cut_start"], started["cut_end"]) == (False, True)


def test_mig_gpu_instances_are_the_jobs_gpus(prometheus: Any) -> None:
    got = report(prometheus, "900")
    assert (got["nodes"], got["gpus"], got["gpu_instances"]) == (["m"], 2, 1)
    assert seconds(got["gpu_hours"]) == 2 * 59 * SCRAPE  # from T0's scrape: 59 intervals
    # never the neighbour instance's stall, nor the MIG GPU's own link (no tenant)
    causes = {c["cause"]: (seconds(c["gpu_hours"]), c["onset"]["gpu"]) for c in got["causes"]}
    assert causes == {"dataloader_single_process": (120, "0/1"), "clock_throttled": (60, "1")}
    assert [u["name"] for u in got["worst_gpus"]] == [
        "m GPU 0/1 (3g.40gb, rank 0)", "m GPU 1 (rank 1)"]
    text = invoke(prometheus, "900").output
    assert "GPUs:             2 (1 of them MIG GPU instance)\n" in text


def test_a_url_without_a_scheme_gets_a_hint() -> None:
    result = CliRunner().invoke(main, ["report", "42", "--prometheus", "prometheus:9090"])
    assert result.exit_code == 1
    assert "expected a URL with its scheme, e.g. http://prometheus:9090" in result.output


def test_timeout_bounds_a_prometheus_that_does_not_answer() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result = CliRunner().invoke(main, ["report", "42", "--prometheus", url,
                                           "--timeout", "0.2"])
    assert result.exit_code == 1
    assert f"{url} did not answer within --timeout 0.2 s" in result.output
