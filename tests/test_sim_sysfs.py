"""The simulator's sysfs writer, read back by the real pcie source."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config import ConfigError, PcieConfig
from gpuwatchd.sim.scenario import (
    PciFunction,
    Scenario,
    Timeline,
    load_scenario,
)
from gpuwatchd.sim.sysfs import (
    AER_CORRECTABLE,
    AER_UNCORRECTABLE,
    SysfsWriter,
    aer_text,
    cpulist,
    cpumask,
    link_states,
    numa_cpus,
    port_kinds,
)
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.pcie import PcieSource

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"
NVME_FIXTURE = FIXTURES / "node_exporter/bus/pci/devices/0000:01:00.0"

Key = tuple[str, tuple[str, ...]]


def scenario(phases: list[dict[str, Any]] | None = None, **node: Any) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "test",
            "node": {"gpu_count": 8, "pcie_topology": "switched", **node},
            "phases": phases or [{"name": "p", "duration": "10m"}],
        }
    )


def read_back(root: Path, timeline: Timeline, t: float) -> tuple[SysfsWriter, dict[Key, float]]:
    writer = SysfsWriter(root, timeline)
    writer.write(t)
    samples = PcieSource(PcieConfig(), Context(sysfs=root)).collect()
    got = {(s.name.removeprefix("gpuwatchd_"), s.labels): s.value for s in samples}
    assert len(got) == len(samples)
    return writer, got


def degraded(got: dict[Key, float]) -> set[tuple[str, str]]:
    """(gpu bus id, device) of every degraded link reading."""
    return {
        (labels[0], labels[1])
        for (name, labels), v in got.items()
        if name == "pcie_link_degraded" and v == 1
    }


def bdf(timeline: Timeline, name: str) -> str:
    return timeline.topology.functions[name].bdf


# --- built-in scenarios -------------------------------------------------------------------


def test_healthy_8gpu_tree(tmp_path: Path) -> None:
    timeline = Timeline(load_scenario("healthy-8gpu"))
    writer, got = read_back(tmp_path, timeline, 600)
    topo = timeline.topology
    gpus = {topo.gpu(i).bdf for i in range(8)}
    # every GPU with its 3 bridges (downstream port, upstream port, root port)
    paths: dict[str, set[str]] = {}
    for name, labels in got:
        if name == "pcie_link_generation":
            paths.setdefault(labels[0], set()).add(labels[1])
    assert set(paths) == gpus
    for i in range(8):
        expected = {fn.bdf for fn in topo.path_to_root(topo.gpu_names[i])}
        assert paths[topo.gpu(i).bdf] == expected and len(expected) == 4
    assert not degraded(got)
    assert sum(1 for (n, _) in got if n == "pcie_link_degraded") == 32
    assert {v for (n, _), v in got.items() if n.startswith("pcie_link_generation")} == {4}
    assert {v for (n, _), v in got.items() if n.startswith("pcie_link_width")} == {16}
    assert {v for (n, _), v in got.items() if n.startswith("pcie_link_speed")} == {16e9}
    numa = {labels[0]: v for (n, labels), v in got.items() if n == "pcie_gpu_numa_node"}
    assert numa == {topo.gpu(i).bdf: (0 if i < 4 else 1) for i in range(8)}
    aer = [v for (n, _), v in got.items() if n == "pcie_aer_errors_total"]
    assert len(aer) == 8 * 4 * 3 and set(aer) == {0}
    # the kernel's shape: relative links into nested function directories
    link = tmp_path / "bus/pci/devices" / topo.gpu(3).bdf
    assert os.readlink(link) == (
        "../../../devices/pci0000:30/0000:30:01.1/0000:31:00.0/0000:32:08.0/0000:34:00.0"
    )
    assert link.resolve() == writer.device_dir("gpu3").resolve()
    assert (link / "vendor").read_text() == "0x10de\n"
    assert (link / "class").read_text() == "0x030200\n"
    assert (link / "local_cpulist").read_text() == "0-63\n"
    rp = tmp_path / "bus/pci/devices/0000:30:01.1"
    assert (rp / "class").read_text() == "0x060400\n"
    assert (rp / "vendor").read_text() == "0x8086\n"
    assert (tmp_path / "bus/pci/devices/0000:31:00.0/vendor").read_text() == "0x10b5\n"


def test_idle_8gpu_reports_gpu_and_its_port_below_max(tmp_path: Path) -> None:
    timeline = Timeline(load_scenario("idle-8gpu"))
    _, got = read_back(tmp_path, timeline, 60)
    topo = timeline.topology
    expected = set()
    for i in range(8):
        gpu = topo.gpu(i)
        expected |= {(gpu.bdf, gpu.bdf), (gpu.bdf, bdf(timeline, gpu.parent or ""))}
        assert got[("pcie_link_generation", (gpu.bdf, gpu.bdf, "gpu"))] == 1
        assert got[("pcie_link_speed_transfers_per_second", (gpu.bdf, gpu.bdf, "gpu"))] == 2.5e9
        assert got[("pcie_link_generation_max", (gpu.bdf, gpu.bdf, "gpu"))] == 4
    assert degraded(got) == expected


def test_pcie_gen3_under_load_degrades_only_gpu3_and_its_port(tmp_path: Path) -> None:
    timeline = Timeline(load_scenario("pcie-gen3-under-load"))
    writer, got = read_back(tmp_path, timeline, 100)
    assert not degraded(got)
    writer.write(400)
    got = {
        (s.name.removeprefix("gpuwatchd_"), s.labels): s.value
        for s in PcieSource(PcieConfig(), Context(sysfs=tmp_path)).collect()
    }
    gpu3 = bdf(timeline, "gpu3")
    assert degraded(got) == {(gpu3, gpu3), (gpu3, bdf(timeline, "sw1-dp1"))}
    assert got[("pcie_link_generation", (gpu3, gpu3, "gpu"))] == 3
    assert got[("pcie_link_generation", (gpu3, bdf(timeline, "sw1-dp1"), "bridge"))] == 3
    assert got[("pcie_link_generation_max", (gpu3, gpu3, "gpu"))] == 4


def test_degraded_switch_uplink_shows_on_the_path_of_both_gpus(tmp_path: Path) -> None:
    timeline = Timeline(
        scenario(
            [
                {"name": "ok", "duration": "1m"},
                {"name": "uplink-gen3", "duration": "5m", "bridges": {"sw1-up": {"gen": 3}}},
            ]
        )
    )
    _, got = read_back(tmp_path, timeline, 120)
    rp1, up1 = bdf(timeline, "rp1"), bdf(timeline, "sw1-up")
    expected = set()
    for gpu in ("gpu2", "gpu3"):
        g = bdf(timeline, gpu)
        expected |= {(g, rp1), (g, up1)}
        assert got[("pcie_link_degraded", (g, g, "gpu"))] == 0  # the GPUs' own links are fine
        assert got[("pcie_link_generation", (g, rp1, "bridge"))] == 3
        assert got[("pcie_link_generation", (g, up1, "bridge"))] == 3
    assert degraded(got) == expected


def test_both_ends_of_a_link_set_the_same_link(tmp_path: Path) -> None:
    def tree(bridges: dict[str, Any], sub: str) -> dict[str, str]:
        timeline = Timeline(scenario([{"name": "p", "duration": "1m", "bridges": bridges}]))
        writer = SysfsWriter(tmp_path / sub, timeline)
        writer.write(30)
        return {
            name: (writer.device_dir(name) / "current_link_speed").read_text()
            + (writer.device_dir(name) / "current_link_width").read_text()
            for name in timeline.topology.functions
        }

    # the rp1 <-> sw1-up link from either end
    assert tree({"rp1": {"gen": 3}}, "a") == tree({"sw1-up": {"gen": 3}}, "b")
    # GPU 3's link from its port
    by_port = tree({"sw1-dp1": {"width": 8}}, "c")
    assert by_port["gpu3"] == by_port["sw1-dp1"] == "16.0 GT/s PCIe\n8\n"
    assert by_port["gpu2"] == by_port["sw1-up"] == "16.0 GT/s PCIe\n16\n"


def test_direct_topology_root_port_shares_the_gpu_link(tmp_path: Path) -> None:
    timeline = Timeline(
        scenario(
            [{"name": "p", "duration": "1m", "changes": [{"gpus": [1], "set": {"pcie_width": 8}}]}],
            pcie_topology="direct",
            gpu_count=4,
        )
    )
    _, got = read_back(tmp_path, timeline, 10)
    g1, rp1 = bdf(timeline, "gpu1"), bdf(timeline, "rp1")
    assert timeline.topology.functions["gpu1"].parent == "rp1"
    assert degraded(got) == {(g1, g1), (g1, rp1)}
    assert got[("pcie_link_width", (g1, rp1, "bridge"))] == 8
    assert sum(1 for (n, _) in got if n == "pcie_link_degraded") == 8


def test_lost_gpu_has_no_link(tmp_path: Path) -> None:
    timeline = Timeline(
        scenario(
            [{"name": "p", "duration": "1m", "changes": [{"gpus": [0], "set": {"lost": True}}]}],
        )
    )
    writer, got = read_back(tmp_path, timeline, 10)
    g0, dp = bdf(timeline, "gpu0"), bdf(timeline, "sw0-dp0")
    assert (writer.device_dir("gpu0") / "current_link_speed").read_text() == "Unknown\n"
    assert (writer.device_dir("gpu0") / "current_link_width").read_text() == "0\n"
    assert (writer.device_dir("sw0-dp0") / "current_link_speed").read_text() == "2.5 GT/s PCIe\n"
    assert ("pcie_link_degraded", (g0, g0, "gpu")) not in got  # unknown: no series
    assert ("pcie_link_width", (g0, g0, "gpu")) not in got
    assert got[("pcie_link_degraded", (g0, dp, "bridge"))] == 1


def test_gpu_aer_counts_reach_the_source(tmp_path: Path) -> None:
    # GpuValues has no AER fields yet; the writer takes them when the state carries them
    timeline = Timeline(scenario(gpu_count=2))
    real_state = timeline.state

    def state(t: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
        gpus, bridges = real_state(t)
        return [dict(gpus[0], aer_correctable_total=5.0, aer_fatal_total=1), gpus[1]], bridges

    timeline.state = state  # type: ignore[method-assign]
    writer, got = read_back(tmp_path, timeline, 10)
    g0 = bdf(timeline, "gpu0")
    text = (writer.device_dir("gpu0") / "aer_dev_correctable").read_text()
    assert "BadTLP 5\n" in text and text.endswith("TOTAL_ERR_COR 5\n")
    assert got[("pcie_aer_errors_total", (g0, g0, "correctable"))] == 5
    assert got[("pcie_aer_errors_total", (g0, g0, "nonfatal"))] == 0
    assert got[("pcie_aer_errors_total", (g0, g0, "fatal"))] == 1
    assert got[("pcie_aer_errors_total", (g0, bdf(timeline, "sw0-dp0"), "correctable"))] == 0


def test_gen5_model_and_kernel_speed_strings(tmp_path: Path) -> None:
    timeline = Timeline(scenario(gpu_model="h100-sxm5-80gb", gpu_count=2))
    writer, got = read_back(tmp_path, timeline, 0)
    assert (writer.device_dir("gpu0") / "max_link_speed").read_text() == "32.0 GT/s PCIe\n"
    assert (writer.device_dir("sw0-up") / "vendor").read_text() == "0x1000\n"
    assert {v for (n, _), v in got.items() if n == "pcie_link_generation"} == {5}


def test_vga_class_model(tmp_path: Path) -> None:
    timeline = Timeline(scenario(gpu_model="rtx-4090", gpu_count=1, pcie_topology="direct"))
    writer, got = read_back(tmp_path, timeline, 0)
    assert (writer.device_dir("gpu0") / "class").read_text() == "0x030000\n"
    assert ("pcie_gpu_numa_node", (bdf(timeline, "gpu0"),)) in got


# --- writing: only what changed, atomically -----------------------------------------------


def test_only_changed_files_are_rewritten(tmp_path: Path) -> None:
    timeline = Timeline(load_scenario("pcie-gen3-under-load"))
    writer = SysfsWriter(tmp_path, timeline)
    first = writer.write(0)
    assert first == writer.writes > 8 * 4 * 10
    files = sorted(p for p in (tmp_path / "devices").rglob("*") if p.is_file())
    inodes = {p: p.stat().st_ino for p in files}
    assert writer.write(0) == 0
    assert writer.write(299) == 0
    assert writer.write(400) == 2  # current_link_speed of GPU 3 and of its port
    changed = {p for p in files if p.stat().st_ino != inodes[p]}
    assert changed == {
        writer.device_dir("gpu3") / "current_link_speed",
        writer.device_dir("sw1-dp1") / "current_link_speed",
    }
    assert writer.write(401) == 0
    assert not list(tmp_path.rglob(".*.tmp"))


def test_writer_takes_over_an_existing_tree(tmp_path: Path) -> None:
    timeline = Timeline(load_scenario("healthy-8gpu"))
    SysfsWriter(tmp_path, timeline).write(0)
    again = SysfsWriter(tmp_path, timeline)  # a restarted simulator on the same root
    again.write(0)
    _, got = read_back(tmp_path, timeline, 0)
    assert not degraded(got)


def test_a_concurrent_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    timeline = Timeline(load_scenario("pcie-gen3-under-load"))
    writer = SysfsWriter(tmp_path, timeline)
    writer.write(0)
    path = writer.device_dir("gpu3") / "current_link_speed"
    seen: set[str] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            with open(path) as f:
                seen.add(f.read())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(300):
            writer.write(400 if i % 2 else 0)
    finally:
        stop.set()
        thread.join()
    assert seen <= {"16.0 GT/s PCIe\n", "8.0 GT/s PCIe\n"}


# --- formats against the real fixtures -------------------------------------------------------


def test_aer_text_matches_the_kernel_files() -> None:
    assert (
        aer_text(AER_CORRECTABLE, "ERR_COR", {})
        == (NVME_FIXTURE / "aer_dev_correctable").read_text()
    )
    assert (
        aer_text(AER_UNCORRECTABLE, "ERR_NONFATAL", {})
        == (NVME_FIXTURE / "aer_dev_nonfatal").read_text()
    )
    assert (
        aer_text(AER_UNCORRECTABLE, "ERR_FATAL", {}) == (NVME_FIXTURE / "aer_dev_fatal").read_text()
    )
    text = aer_text(AER_CORRECTABLE, "ERR_COR", {"BadTLP": 3})
    assert "BadTLP 3\n" in text and text.endswith("TOTAL_ERR_COR 3\n")


@pytest.mark.parametrize(
    ("fixture", "nr_cpus"),
    [
        (NVME_FIXTURE, 16),
        (FIXTURES / "node_exporter/bus/pci/devices/0000:45:00.0", 256),
        (FIXTURES / "procfs/bus/pci/devices/0000:a2:00.0", 128),
    ],
)
def test_cpu_formats_match_the_kernel_files(fixture: Path, nr_cpus: int) -> None:
    listed = (fixture / "local_cpulist").read_text().strip()
    cpus = [
        c
        for part in listed.split(",")
        for a, _, b in [part.partition("-")]
        for c in range(int(a), int(b or a) + 1)
    ]
    assert cpulist(cpus) == listed
    assert cpumask(cpus, nr_cpus) + "\n" == (fixture / "local_cpus").read_text()


def test_numa_cpus() -> None:
    assert numa_cpus(0, 128, 2) == list(range(64))
    assert numa_cpus(1, 128, 2) == list(range(64, 128))
    assert numa_cpus(2, 10, 3) == list(range(6, 10))
    assert numa_cpus(-1, 4, 1) == [0, 1, 2, 3]
    assert cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_port_kinds_and_link_states() -> None:
    timeline = Timeline(scenario(gpu_count=2))
    kinds = port_kinds(timeline.topology)
    assert kinds == {
        "rp0": "root",
        "sw0-up": "upstream",
        "sw0-dp0": "downstream",
        "gpu0": "endpoint",
        "sw0-dp1": "downstream",
        "gpu1": "endpoint",
    }
    gpus, bridges = timeline.state(0)
    gpus = [dict(gpus[0], pcie_gen=5), dict(gpus[1], pcie_gen=2.6)]  # above max; ramped
    states = link_states(timeline.topology, gpus, {**bridges, "rp0": {"gen": 4, "width": 4}})
    assert states["gpu0"] == states["sw0-dp0"] == (4, 16)  # capped at both ends' max
    assert states["gpu1"] == states["sw0-dp1"] == (3, 16)
    assert states["rp0"] == states["sw0-up"] == (4, 4)


# --- scale ------------------------------------------------------------------------------------


def test_64_gpus_read_back(tmp_path: Path) -> None:
    timeline = Timeline(
        scenario(
            [{"name": "p", "duration": "1m", "changes": [{"gpus": [40], "set": {"pcie_gen": 2}}]}],
            gpu_count=64,
            numa_nodes=8,
            cpus=256,
        )
    )
    _, got = read_back(tmp_path, timeline, 10)
    g40 = bdf(timeline, "gpu40")
    assert g40.startswith("0002:")
    assert len([n for (n, _) in got if n == "pcie_gpu_numa_node"]) == 64
    assert sum(1 for (n, _) in got if n == "pcie_link_degraded") == 64 * 4
    assert degraded(got) == {(g40, g40), (g40, bdf(timeline, "sw20-dp0"))}


def test_invalid_simulated_addresses_are_refused(tmp_path: Path) -> None:
    timeline = Timeline(scenario(gpu_count=1))
    fn = timeline.topology.functions["gpu0"]
    timeline.topology.functions["gpu0"] = PciFunction(
        fn.name, "0000:113:00.0", fn.parent, fn.domain_root, fn.max_gen, fn.max_width, 0
    )
    with pytest.raises(ValueError, match=r"gpu0 has address 0000:113:00.0"):
        SysfsWriter(tmp_path, timeline)


# --- each function's own capability (node.pcie_max) -------------------------------------------


def caps(writer: SysfsWriter, name: str) -> tuple[str, str]:
    d = writer.device_dir(name)
    return (d / "max_link_speed").read_text(), (d / "max_link_width").read_text()


def test_pcie_max_gives_groups_and_functions_their_own_maximum(tmp_path: Path) -> None:
    timeline = Timeline(
        scenario(
            gpu_count=4,
            gpu_model="h100-sxm5-80gb",
            pcie_max={
                "root_ports": {"gen": 4},
                "switch_ports": {"width": 16},
                "sw1-dp1": {"width": 8},
                "gpus": {"width": 16},
                "gpu0": {"gen": 4, "width": 8},
            },
        )
    )
    writer, got = read_back(tmp_path, timeline, 30)
    assert caps(writer, "rp0") == caps(writer, "rp1") == ("16.0 GT/s PCIe\n", "16\n")
    assert caps(writer, "sw0-up") == ("32.0 GT/s PCIe\n", "16\n")
    assert caps(writer, "sw1-dp1") == ("32.0 GT/s PCIe\n", "8\n")  # the name beats the group
    assert caps(writer, "gpu0") == ("16.0 GT/s PCIe\n", "8\n")
    assert caps(writer, "gpu1") == ("32.0 GT/s PCIe\n", "16\n")
    # every link trained to the lower of its ends: at its best, nothing degraded
    assert not degraded(got)
    g0, g3 = bdf(timeline, "gpu0"), bdf(timeline, "gpu3")
    assert got[("pcie_link_generation", (g0, g0, "gpu"))] == 4
    assert got[("pcie_link_width", (g0, bdf(timeline, "sw0-dp0"), "bridge"))] == 8
    assert got[("pcie_link_width", (g3, g3, "gpu"))] == 8
    assert got[("pcie_link_generation", (g3, bdf(timeline, "rp1"), "bridge"))] == 4
    assert got[("pcie_link_generation", (g3, g3, "gpu"))] == 5


@pytest.mark.parametrize(
    ("name", "own_max", "port_max"),
    [
        ("pcie-x8-card-in-x16-slot", (4, 8), (4, 16)),
        ("pcie-gen4-gpu-gen5-host", (4, 16), (5, 16)),
        ("pcie-gen5-gpu-gen4-host", (5, 16), (4, 16)),
    ],
)
def test_benign_twins_read_one_end_below_the_other_yet_nothing_is_degraded(
    tmp_path: Path, name: str, own_max: tuple[int, int], port_max: tuple[int, int]
) -> None:
    timeline = Timeline(load_scenario(name))
    _, got = read_back(tmp_path, timeline, 120)
    for i in range(timeline.scenario.node.gpu_count):
        gpu = timeline.topology.gpu(i)
        g, port = gpu.bdf, (gpu.bdf, bdf(timeline, gpu.parent or ""), "bridge")
        assert (
            got[("pcie_link_generation_max", (g, g, "gpu"))],
            got[("pcie_link_width_max", (g, g, "gpu"))],
        ) == own_max
        assert (
            got[("pcie_link_generation_max", port)],
            got[("pcie_link_width_max", port)],
        ) == port_max
    assert not degraded(got)  # each link at min(both ends), under load


@pytest.mark.parametrize(
    ("pcie_max", "error"),
    [
        ("{rp9: {gen: 4}}", r"bad\.yaml: node: pcie_max\.rp9: no such PCI function or group"),
        ("{gpu0: {width: 6}}", r"bad\.yaml: node\.pcie_max\.gpu0\.width: Input should be 1, 2"),
        ("{root_ports: {speed: 4}}", r"bad\.yaml: node\.pcie_max\.root_ports\.speed"),
    ],
)
def test_pcie_max_errors_name_the_file_and_field(tmp_path: Path, pcie_max: str, error: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        f"name: t\nnode: {{gpu_count: 2, pcie_max: {pcie_max}}}\n"
        "phases: [{name: p, duration: 60}]\n"
    )
    with pytest.raises(ConfigError, match=error):
        load_scenario(path)
