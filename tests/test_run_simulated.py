"""`gpuwatchd run --simulate healthy-8gpu`: the whole path from a (simulated) GPU to a scrape.

The daemon runs as a real subprocess through the console entry point; the test scrapes
it over HTTP and checks every metric family for all 8 GPUs against the scenario.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from importlib import resources

import pytest
from daemon_process import DETAIL, SCENARIO_PACKAGE, running_daemon
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.sim.node import _TMPFS
from gpuwatchd.sim.scenario import Timeline, load_scenario
from gpuwatchd.sources import BUILTIN

MIB = 2**20
GPU_FAMILIES = {
    # family: expected value on every GPU of healthy-8gpu (None: only presence is checked)
    "gpuwatchd_gpu_info": 1,
    "gpuwatchd_gpu_utilization_ratio": 0.95,
    "gpuwatchd_gpu_memory_utilization_ratio": 0.42,
    "gpuwatchd_gpu_memory_used_bytes": 71680 * MIB,
    "gpuwatchd_gpu_memory_total_bytes": 81920 * MIB,
    "gpuwatchd_gpu_power_watts": 335,
    "gpuwatchd_gpu_power_limit_watts": 400,
    "gpuwatchd_gpu_temperature_celsius": None,
    "gpuwatchd_gpu_sm_clock_hertz": 1410e6,
    "gpuwatchd_gpu_sm_clock_max_hertz": 1410e6,
    "gpuwatchd_gpu_memory_clock_hertz": 1593e6,
    "gpuwatchd_gpu_memory_clock_max_hertz": 1593e6,
    "gpuwatchd_gpu_performance_state": 0,
    "gpuwatchd_gpu_pcie_link_generation": 4,
    "gpuwatchd_gpu_pcie_link_generation_max": 4,
    "gpuwatchd_gpu_pcie_link_width": 16,
    "gpuwatchd_gpu_pcie_link_width_max": 16,
    "gpuwatchd_gpu_pcie_tx_bytes_per_second": 1800e6,
    # 9.5 GB/s passes 2**32 bytes twice a second: the 32-bit counter aliases (as a real
    # H200's does), so the value depends on the poll's exact spacing
    "gpuwatchd_gpu_pcie_rx_bytes_per_second": None,
    "gpuwatchd_gpu_persistence_mode": 1,
    "gpuwatchd_gpu_ecc_mode": 1,
    "gpuwatchd_gpu_compute_processes": 1,
}
# shown only while not 0 (docs/metrics.md): nothing of them on this healthy node
ZERO_FAMILIES = (
    "gpuwatchd_gpu_lost",
    "gpuwatchd_gpu_pcie_replay_errors",
    "gpuwatchd_gpu_clock_event_reason_active",  # training at full clocks: none holds
    "gpuwatchd_gpu_ecc_errors",
    "gpuwatchd_pcie_link_degraded",
)


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    with running_daemon("healthy-8gpu", *DETAIL) as url:  # every family, detail too
        yield url


def complete_scrape(url: str) -> dict[str, list]:
    """Scrape until every family is there for all 8 GPUs (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        got = scrape(url)
        if all(len({s.labels["gpu"] for s in got.get(f, [])}) == 8 for f in GPU_FAMILIES) and (
            {"gpuwatchd_pcie_link_generation", "gpuwatchd_gpu_sm_active_ratio"} <= set(got)
        ):
            return got
        assert time.monotonic() < deadline, f"incomplete after 30s: {sorted(got)}"
        time.sleep(0.2)


def test_every_gpu_family_has_the_scenarios_values(daemon):
    got = complete_scrape(daemon)
    for family, expected in GPU_FAMILIES.items():
        samples = got[family]
        assert sorted(int(s.labels["gpu"]) for s in samples) == list(range(8)), family
        assert all(s.labels["uuid"].startswith("GPU-") for s in samples), family
        if expected is not None:
            for s in samples:
                assert s.value == pytest.approx(expected, rel=1e-6), (family, s)
    temps = [s.value for s in got["gpuwatchd_gpu_temperature_celsius"]]
    assert all(58 <= t <= 66 for t in temps)
    assert not set(ZERO_FAMILIES) & set(got)


def test_info_labels_and_per_label_families(daemon):
    got = complete_scrape(daemon)
    info = got["gpuwatchd_gpu_info"][0].labels
    assert info["model"] == "NVIDIA A100-SXM4-80GB"
    assert info["driver_version"] == "555.42.06"
    assert info["cuda_driver_version"] == "12.5"
    uuids = {s.labels["uuid"] for s in got["gpuwatchd_gpu_info"]}
    assert len(uuids) == 8
    nvlinks = got["gpuwatchd_gpu_nvlinks_active"]
    assert len(nvlinks) == 8 and all(s.value == 12 for s in nvlinks)
    memory = got["gpuwatchd_gpu_process_memory_used_bytes"]
    assert {s.labels["pid"] for s in memory} == {"4242"}
    assert all(s.value == 71680 * MIB for s in memory)


def test_pcie_tree_and_self_metrics(daemon):
    got = complete_scrape(daemon)
    timeline = Timeline(load_scenario("healthy-8gpu"))
    gpu_bdfs = {timeline.topology.gpu(i).bdf for i in range(8)}
    gens = got["gpuwatchd_pcie_link_generation"]
    assert {s.labels["gpu_bus_id"] for s in gens} == gpu_bdfs
    # each GPU: itself + downstream port + switch upstream port + root port
    for bdf in gpu_bdfs:
        mine = [s for s in gens if s.labels["gpu_bus_id"] == bdf]
        assert len(mine) == 4 and all(s.value == 4 for s in mine)
    up = {s.labels["source"]: s.value for s in got["gpuwatchd_source_up"]}
    assert up == dict.fromkeys(BUILTIN, 1)
    assert got["gpuwatchd_build_info"][0].value == 1


def test_healthz_and_openmetrics(daemon):
    base = daemon.removesuffix("/metrics")
    with urllib.request.urlopen(base + "/healthz", timeout=5) as response:
        assert response.status == 200
    request = urllib.request.Request(daemon, headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.read().endswith(b"# EOF\n")


def test_at_starts_the_simulated_node_at_its_fault():
    """`run --simulate pcie-gen3-under-load --at 400`: GPU 3's link is at Gen3 from the
    first scrape (it drops at 300 s), not after five minutes of waiting."""
    with running_daemon("pcie-gen3-under-load", "--at", "400", *DETAIL) as url:
        deadline = time.monotonic() + 30
        while True:
            got = scrape(url).get("gpuwatchd_gpu_pcie_link_generation", [])
            gens = {s.labels["gpu"]: s.value for s in got}
            if len(gens) == 8:
                break
            assert time.monotonic() < deadline, gens
            time.sleep(0.2)
    assert gens["3"] == 3 and gens["0"] == 4


def test_a_failed_start_leaves_no_simulated_node_behind(tmp_path):
    """A port in use (or a bad web config) stops the start after the simulated node's
    tree was made: the tree is removed, not left in /dev/shm."""
    name = f"leak-check-{os.getpid()}"
    text = (resources.files(SCENARIO_PACKAGE) / "idle-8gpu.yaml").read_text()
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(text.replace("name: idle-8gpu", f"name: {name}", 1))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "run", "--simulate", str(scenario),
             "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode != 0 and "cannot listen" in result.stderr, result.stderr
    root = _TMPFS or tempfile.gettempdir()
    assert [p for p in os.listdir(root) if name in p] == []
