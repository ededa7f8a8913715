"""`gpuwatchd doctor`: simulated nodes (virtual time) and this real node (no GPU here).

Replaying a scenario up to the diagnosis takes seconds, so each one is replayed once per
module: `diagnose_simulated` is memoized while these tests run, and the CLI (which looks
it up at call time) gets the same report for its text and its --json.
"""

import dataclasses
import json
import re
import socket
from importlib import resources
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gpuwatchd import doctor as doctor_module
from gpuwatchd.cli import main
from gpuwatchd.config import Config
from gpuwatchd.doctor import (
    DIMENSIONS,
    HOST_CHECKS,
    DaemonProbe,
    diagnose_simulated,
    expected_moment,
    format_report,
    gpu_list,
)
from gpuwatchd.sim.scenario import Scenario, load_scenario

DOCS = Path(__file__).parent.parent / "docs" / "doctor.md"


@pytest.fixture(scope="module", autouse=True)
def replay_once():
    """Memoize `diagnose_simulated` per (scenario, config, at) for this module."""
    reports: dict = {}
    real = doctor_module.diagnose_simulated

    def memoized(scenario, config, at):
        key = (scenario.model_dump_json(), config.model_dump_json(), at)
        if key not in reports:
            reports[key] = real(scenario, config, at)
        return reports[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(doctor_module, "diagnose_simulated", memoized)
        yield


def doctor(*args: str):
    return CliRunner().invoke(main, ["doctor", *args])


def lines_by_first_word(output: str) -> dict[str, str]:
    return {line.split()[0]: line for line in output.splitlines() if line.strip()}


def host_rows(output: str) -> dict[str, list[str]]:
    """The host check table: check name -> [dimension, status, evidence]."""
    names = {spec.name for spec in HOST_CHECKS}
    rows = {}
    for line in output.splitlines():
        for name in names:
            if line.startswith(name + " "):
                rows[name] = re.split(r"\s{2,}", line[len(name) :].strip(), maxsplit=2)
    return rows


@pytest.fixture(scope="module")
def no_nvml(tmp_path_factory) -> Path:
    """A configuration without the NVML source: doctor sees no GPU, as on a CPU node."""
    path = tmp_path_factory.mktemp("config") / "no-nvml.yaml"
    path.write_text("sources:\n  nvml:\n    enabled: false\n")
    return path


# -- when doctor diagnoses a scenario by default -------------------------------------------


def scenario(*expect: dict, minutes: int = 30) -> Scenario:
    return Scenario.model_validate(
        {"name": "t", "phases": [{"name": "p", "duration": f"{minutes}m"}], "expect": list(expect)}
    )


def test_expected_moment_is_the_latest_by_inside_the_fault():
    assert expected_moment(load_scenario("pcie-gen3-under-load")) == 360  # by 6m, ends 25m
    assert expected_moment(load_scenario("nccl-stall")) == 480  # by 8m, ends 10m
    assert expected_moment(load_scenario("dataloader-single-process")) == 240  # two: 3m, 4m
    assert expected_moment(load_scenario("idle-8gpu")) == 1800  # never: the end
    assert expected_moment(scenario({"cause": "x", "onset": "2m"})) == 1800  # no by: the end
    # `by` left out with `ends`: the last second of the fault, not its repair
    assert expected_moment(scenario({"cause": "x", "onset": "2m", "ends": "5m"})) == 299
    # faults that never overlap: the moment inside the most of them, the latest on a tie
    disjoint = scenario(
        {"cause": "a", "onset": "1m", "by": "2m", "ends": "4m"},
        {"cause": "b", "onset": "1m", "by": "3m", "ends": "4m"},
        {"cause": "c", "onset": "10m", "by": "12m", "ends": "15m"},
    )
    assert expected_moment(disjoint) == 180


@pytest.fixture(scope="module")
def pcie():
    return doctor("--simulate", "pcie-gen3-under-load")


def test_pcie_gen3_under_load_by_default_finds_the_degraded_link_on_gpu_3_only(pcie):
    out = pcie.output
    assert pcie.exit_code == 1, out
    assert "simulated node 'pcie-gen3-under-load' at 360s, when its expected causes hold" in out
    assert "  GPU 3: pcie_link_degraded (pcie, " in out
    assert "pin the slot" in out.lower()  # the remedy
    lines = lines_by_first_word(out)
    assert lines["pcie"].split()[1] == "problem"
    for dim in DIMENSIONS[1:]:
        assert lines[dim].split()[1] == "ok", lines[dim]
    assert {row[1] for row in host_rows(out).values()} == {"ok"}
    assert "result: a cause holds: pcie_link_degraded on GPU 3 (exit 1)" in out
    assert re.search(r"\n  where GPU 3 is: PCI \S+:\S+, pid 4242\n", out), out  # where to look


def test_findings_shared_by_gpus_print_once_with_their_list(pcie):
    findings = pcie.output.split("per-GPU findings:\n")[1].split("\n\n")[0].splitlines()
    assert findings[0].startswith("  GPU 3: pcie_link_degraded")
    assert findings[1] == "  GPUs 0-2, 4-7: no cause holds"
    # the rules that read the probe wait for it on all eight GPUs (none reports): one
    # line that says so, not a fault
    (unknown,) = [line for line in findings if "probe" in line]
    assert unknown == (
        "  GPUs 0-7: need the in-process probe (docs/probe.md), not reporting here: "
        "input_pipeline_stall, pin_memory_disabled, memory_fragmentation, slow_cuda_start"
    )
    assert not [line for line in findings if "cannot judge" in line]
    assert findings[3].startswith("  where GPU 3 is: PCI ") and len(findings) == 4


def test_gpu_lists():
    assert gpu_list(["3"]) == "GPU 3"
    assert gpu_list([str(g) for g in range(8)]) == "GPUs 0-7"
    assert gpu_list(["0", "1", "2", "4", "6", "7"]) == "GPUs 0-2, 4, 6-7"


def test_nccl_stall_by_default_finds_the_stall_on_every_gpu():
    result = doctor("--simulate", "nccl-stall")
    assert result.exit_code == 1, result.output
    assert "at 480s, when its expected causes hold" in result.output
    assert "result: a cause holds: nccl_stall on GPUs 0-3 (exit 1)" in result.output


def test_scenario_without_an_expected_cause_is_diagnosed_at_its_end_and_finds_nothing():
    result = doctor("--simulate", "desktop-idle-workstation")
    out = result.output
    assert result.exit_code == 0, out
    assert "simulated node 'desktop-idle-workstation' at 480s, its end (no cause expected)" in out
    assert "GPU 0: no cause holds" in out
    assert "problem" not in out and "not checked" not in out
    assert "result: no cause holds (exit 0)" in out


def test_pcie_gen3_under_load_before_onset_finds_nothing():
    result = doctor("--simulate", "pcie-gen3-under-load", "--at", "120")
    assert result.exit_code == 0, result.output


def test_doctor_ignores_for():
    # at 30 s GPU 1 has had persistence mode off for 30 s: `for` (1m) has not passed,
    # the alerting state is pending, and doctor still sees it
    report = diagnose_simulated(load_scenario("persistence-mode-off"), Config(), 30)
    holding = [(f.gpu, f.cause) for f in report.findings if f.status == "holds"]
    assert holding == [("1", "persistence_mode_off")]


def test_json_has_the_same_content(pcie):
    text = pcie.output
    result = doctor("--simulate", "pcie-gen3-under-load", "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["exit_code"] == 1
    assert f"result: {report['result']} (exit 1)" in text
    assert report["no_gpu"] is None and report["not_checked"] == []
    assert report["gpus"] == [str(g) for g in range(8)]
    dims = {d["dimension"]: d for d in report["dimensions"]}
    assert list(dims) == list(DIMENSIONS)
    assert dims["pcie"]["status"] == "problem"
    assert [(c["gpu"], c["cause"]) for c in dims["pcie"]["causes"]] == [("3", "pcie_link_degraded")]
    for c in dims["pcie"]["causes"]:
        assert c["summary"] in text
        assert c["remedy"] in text
    for d in dims.values():
        assert d["status"] in text
        for evidence in d["evidence"]:
            assert evidence in text
    rows = host_rows(text)
    assert [c["check"] for c in report["host_checks"]] == [spec.name for spec in HOST_CHECKS]
    for c in report["host_checks"]:
        assert rows[c["check"]] == [c["dimension"], c["status"], c["evidence"]]
    holding = [(f["gpu"], f["cause"]) for f in report["findings"] if f["status"] == "holds"]
    assert holding == [("3", "pcie_link_degraded")]
    # grouped: one entry per finding shared by GPUs, as the text prints them
    groups = {(g["cause"], g["status"]): g["gpus"] for g in report["finding_groups"]}
    assert groups["pcie_link_degraded", "holds"] == ["3"]
    assert groups["pcie_link_degraded", "does_not_hold"] == ["0", "1", "2", "4", "5", "6", "7"]
    assert len(report["finding_groups"]) < len(report["findings"])
    assert sum(len(g["gpus"]) for g in report["finding_groups"]) == len(report["findings"])


def test_a_tenants_escape_sequences_reach_the_terminal_as_text():
    """An Xid hit by a process its owner named `nvidia ESC ]0;pwned BEL smi` (an OSC
    sequence sets a terminal's title): the kernel log's line quotes the name, and doctor
    prints it as text."""
    text = resources.files("gpuwatchd.sim.scenarios") / "xid119-gsp-timeout-2xh100.yaml"
    scenario = Scenario.model_validate(
        yaml.safe_load(text.read_text().replace("name=nvidia-smi", "name=nvidia\\e]0;pwned\\asmi"))
    )
    output = format_report(diagnose_simulated(scenario, Config(), None))
    assert "Xid 119 in nvidia\\x1b]0;pwned\\x07smi (pid 2024380)" in output
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", output)


def test_bad_scenario_exits_2():
    result = doctor("--simulate", "no-such-scenario")
    assert result.exit_code == 2


def test_at_past_the_end_or_without_a_scenario_exits_2():
    """No diagnosis of a moment the scenario never reaches (it used to run silently to its
    end), and none of a moment on a real node."""
    result = doctor("--simulate", "healthy-8gpu", "--at", "99999")
    assert result.exit_code == 2
    assert "--at 99999: after the end of scenario 'healthy-8gpu' (1800 s)" in result.output
    result = doctor("--at", "5")
    assert result.exit_code == 2 and "only with --simulate" in result.output


# -- no GPU, and the host checks -------------------------------------------------------------


def test_simulated_node_without_nvml_could_not_check_and_says_so(no_nvml):
    result = doctor("--config", str(no_nvml), "--simulate", "healthy-8gpu", "--at", "60")
    out = result.output
    assert result.exit_code == 3, out
    assert out.startswith("no NVIDIA GPU or driver found: the NVML source is disabled")
    lines = lines_by_first_word(out)
    for dim in DIMENSIONS:
        assert lines[dim].split()[1:3] == ["not", "checked"], lines[dim]
    rows = host_rows(out)
    assert list(rows) == [spec.name for spec in HOST_CHECKS]
    assert {row[1] for row in rows.values()} == {"ok"}
    assert "per-GPU findings" not in out
    assert out.rstrip().endswith(
        "result: could not check the GPUs; no cause holds on what was checked (exit 3)"
    )
    report = json.loads(
        doctor(
            "--config", str(no_nvml), "--simulate", "healthy-8gpu", "--at", "60", "--json"
        ).output
    )
    assert report["exit_code"] == 3 and report["not_checked"] == list(DIMENSIONS)
    assert {c["status"] for c in report["host_checks"]} == {"ok"}


@pytest.mark.parametrize(
    ("scenario_name", "check", "evidence"),
    [
        ("interrupt-storm", "irq storm", "1 IRQ line(s) over 10000/s, busiest IRQ line 45000/s"),
        ("cpu-steal-vm", "cpu steal", "30% of CPU time stolen by the hypervisor"),
    ],
    ids=["interrupt-storm", "cpu-steal-vm"],
)
def test_host_fault_without_a_gpu_gives_its_host_verdict(no_nvml, scenario_name, check, evidence):
    result = doctor("--config", str(no_nvml), "--simulate", scenario_name)
    out = result.output
    assert result.exit_code == 1, out
    rows = host_rows(out)
    assert rows[check][1] == "problem" and evidence in rows[check][2], rows[check]
    assert [name for name, row in rows.items() if row[1] == "problem"] == [check]
    remedy = next(spec.remedy for spec in HOST_CHECKS if spec.name == check)
    assert f"  {check}: {remedy}" in out
    assert f"a cause holds: {check} on the host; could not check the GPUs (exit 1)" in out


@pytest.mark.parametrize(
    ("scenario_name", "check", "evidence", "verdict"),
    [
        (
            "host-cpu-bound",
            "saturated core",
            "cpu 0-7 at or over 95% busy",
            "host_cpu_bound on GPU 0",
        ),
        (
            "storage-io-bound",
            "saturated disk",
            "nvme0n1 99% busy, 25 ms await",
            "storage_io_bound on GPUs 0-1, saturated disk on the host",
        ),
    ],
    ids=["host-cpu-bound", "storage-io-bound"],
)
def test_host_fault_on_a_gpu_node_gives_the_rule_and_the_host_verdict(
    scenario_name, check, evidence, verdict
):
    result = doctor("--simulate", scenario_name)
    out = result.output
    assert result.exit_code == 1, out
    rows = host_rows(out)
    # a saturated core is a notice: only the GPU rule says the job starves on it
    status = "notice" if check == "saturated core" else "problem"
    assert rows[check][1] == status and evidence in rows[check][2], rows[check]
    assert [name for name, row in rows.items() if row[1] in ("problem", "notice")] == [check]
    assert f"result: a cause holds: {verdict} (exit 1)" in out


def test_docs_state_every_host_check_and_its_threshold():
    docs = DOCS.read_text()
    for spec in HOST_CHECKS:
        assert f"| {spec.name} | {spec.dimension} | {spec.criterion} | {spec.why} |" in docs


@pytest.fixture(scope="module")
def real_node():
    """This machine has no NVIDIA GPU or driver (the test skips where it has one)."""
    result = doctor("--window", "0.2")
    if "no NVIDIA GPU or driver found" not in result.output:
        pytest.skip("this machine has an NVIDIA GPU")
    return result


def test_real_node_without_gpu_says_so_and_reports_host_checks(real_node):
    out = real_node.output
    # 3: could not check the GPUs; 1 if a host check finds a problem on this (shared,
    # busy) machine
    assert real_node.exit_code in (1, 3), out
    assert out.startswith("no NVIDIA GPU or driver found: ")
    assert "sources down:" in out and "  nvml: " in out
    lines = lines_by_first_word(out)
    for dim in DIMENSIONS:
        assert "not checked" in lines[dim], lines[dim]
    rows = host_rows(out)
    for name in ("saturated core", "iowait", "cpu steal", "irq storm"):
        assert rows[name][1] in ("ok", "problem", "notice"), rows[name]
    assert "could not check the GPUs" in out.splitlines()[-1]


def test_real_node_json(real_node):
    result = doctor("--window", "0.2", "--json")
    report = json.loads(result.output)
    assert result.exit_code == report["exit_code"] in (1, 3)
    assert report["gpus"] == [] and report["no_gpu"]
    assert report["not_checked"] == list(DIMENSIONS)
    assert "nvml" in report["sources_down"]
    assert {d["status"] for d in report["dimensions"]} == {"not checked"}
    assert {c["check"] for c in report["host_checks"]} == {spec.name for spec in HOST_CHECKS}


def test_a_rule_that_cannot_judge_the_node_says_why(tmp_path):
    """Issue 39 (3): on an R535 driver NVML has no PCIe byte counters and nccl_stall reads
    DCGM's instead; without DCGM as well, doctor says the rule cannot judge these GPUs and
    why, rather than a bare 'not evaluable'."""
    text = (
        Path(__file__).parent.parent
        / "gpuwatchd"
        / "sim"
        / "scenarios"
        / "nccl-hang-r535-dcgm-8xh100.yaml"
    ).read_text()
    scenario = tmp_path / "r535-no-dcgm.yaml"
    scenario.write_text(text.replace('dcgm: "3"', "dcgm: none"))
    result = doctor("--simulate", str(scenario), "--at", "500")
    findings = result.output.split("per-GPU findings:\n")[1].split("\n\n")[0].splitlines()
    (line,) = [line for line in findings if "cannot judge" in line]
    assert line.startswith("  GPUs 0-7: cannot judge ") and "nccl_stall" in line, line
    assert line.endswith(": source dcgm down or disabled"), line


def test_beside_a_running_daemon_doctor_leaves_it_the_probe(tmp_path):
    """Issue 40 (5): the probe socket is the node's running daemon's. Doctor reported the
    probe source down ("another process receives on it", and to move the socket); it now
    leaves the socket alone and says the daemon judges the probe's rules, and where."""
    path = tmp_path / "run" / "probe.sock"
    path.parent.mkdir(mode=0o755)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(f"listen: 0.0.0.0:9766\nsources:\n  probe:\n    socket: {path}\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as daemon:  # the daemon's end
        daemon.bind(str(path))
        out = doctor("--config", str(config), "--window", "0.2").output
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            probe.sendto(b"{}", str(path))
        assert daemon.recv(16) == b"{}"  # the daemon still receives the reports
    assert "  probe: " not in out, out
    assert (
        f"probe: a running gpuwatchd receives the probe's reports on {path}, so it judges "
        "the rules that read them, not doctor: http://localhost:9766/"
    ) in out


def test_beside_a_running_daemon_the_probe_rules_are_its_own(pcie):
    """Where GPUs are found, the rules that read the probe are the daemon's to judge: not
    a probe that is 'not reporting here'."""
    report = doctor_module.diagnose_simulated(load_scenario("pcie-gen3-under-load"), Config(), None)
    daemon = DaemonProbe("/run/gpuwatchd/probe.sock", "http://localhost:9766/")
    beside = dataclasses.replace(report, daemon_probe=daemon)
    assert (
        "  GPUs 0-7: judged by the running gpuwatchd (http://localhost:9766/): "
        "input_pipeline_stall, pin_memory_disabled, memory_fragmentation, slow_cuda_start"
    ) in format_report(beside).splitlines()
    assert beside.to_dict()["daemon_probe"] == dataclasses.asdict(daemon)
