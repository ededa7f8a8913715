"""The cpu source: real /proc/stat, PSI and meminfo fixtures, simulator-written trees, garbage."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from series import by_key

from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sim.sysfs import SysfsWriter
from gpuwatchd.sim.writers.cpu import CpuWriter, core_split, psi_fixed
from gpuwatchd.sim.writers.cpufreq import CpufreqWriter
from gpuwatchd.sim.writers.interrupts import InterruptsWriter, nr_irqs
from gpuwatchd.sources import REGISTRY, SourceError
from gpuwatchd.sources import cpu as cpu_module
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.cpu import (
    CpuConfig,
    CpuSource,
    ParseError,
    Pressure,
    StatLines,
    StatReading,
    busy_ratio,
    core_ratios,
    cpu_ratios,
    parse_meminfo,
    parse_pressure,
    parse_stat,
    polled_meminfo,
    pressure_line,
)

FIXTURES = Path(__file__).parent / "fixtures" / "procfs"
NODE_EXPORTER = FIXTURES / "node_exporter"
DYNOLOG_STAT = FIXTURES / "dynolog" / "stat"


RECLAIM = Path(__file__).parent / "fixtures" / "reclaim"


def tree(root: Path, stat: Path = NODE_EXPORTER / "stat", pressure: bool = True) -> Path:
    """A procfs with the node_exporter fixtures' stat, meminfo and (optionally) PSI."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(stat, root / "stat")
    shutil.copy(NODE_EXPORTER / "meminfo", root / "meminfo")
    if pressure:
        shutil.copytree(NODE_EXPORTER / "pressure", root / "pressure")
    return root


def source_for(root: Path, **config: Any) -> CpuSource:
    """The source with per-core series (what most tests here look at; off by default)."""
    return CpuSource(CpuConfig(**{"per_core": True, **config}), Context(procfs=root))


def advance(text: str, per_cpu: dict[str, list[int]]) -> str:
    """Add ticks to cpu lines of a /proc/stat text (and the `cpu` line: their sum)."""
    total = [0] * 10
    for adds in per_cpu.values():
        total = [a + b for a, b in zip(total, adds + [0] * (10 - len(adds)), strict=True)]
    out = []
    for line in text.splitlines(keepends=True):
        fields = line.split()
        if fields and fields[0].startswith("cpu"):
            add = total if fields[0] == "cpu" else per_cpu.get(fields[0])
            if add is not None:
                padded = add + [0] * (len(fields) - 1 - len(add))
                values = [int(v) + a for v, a in zip(fields[1:], padded, strict=True)]
                sep = "  " if fields[0] == "cpu" else " "
                line = fields[0] + sep + " ".join(map(str, values)) + "\n"
        out.append(line)
    return "".join(out)


# --- parsers on the real fixtures -----------------------------------------------------------


def test_the_source_is_registered() -> None:
    assert REGISTRY["cpu"] is CpuSource


def test_parse_stat_on_the_fixtures() -> None:
    stat = parse_stat((NODE_EXPORTER / "stat").read_text())
    # user nice system idle iowait irq softirq steal (guest, guest_nice dropped)
    assert stat.total == (301854, 612, 111922, 8979004, 3552, 2, 3944, 0)
    assert sorted(stat.cpus) == list(range(8))
    assert stat.cpus[7] == (29098, 268, 10164, 1139282, 555, 0, 31, 0)
    big = parse_stat(DYNOLOG_STAT.read_text())
    assert len(big.cpus) == 32
    assert big.total[3] == 41381479016


def test_parse_stat_old_kernels_and_bad_lines() -> None:
    text = "cpu  10 0 5 100\ncpu0 10 0 5 100\ncpu1 1 2 x 4\ncpu2 1 2\ncpuX 1 2 3 4\nintr 5\n"
    stat = parse_stat(text)
    assert stat.total == (10, 0, 5, 100, 0, 0, 0, 0)
    assert list(stat.cpus) == [0]
    with pytest.raises(ParseError, match="no `cpu` line"):
        parse_stat("cpu0 1 2 3 4\n")
    with pytest.raises(ParseError):
        parse_stat("")


@pytest.mark.parametrize(
    "text",
    [
        (NODE_EXPORTER / "stat").read_text(),
        DYNOLOG_STAT.read_text(),
        "cpu  10 0 5 100\ncpu0 10 0 5 100\ncpu1 1 2 x 4\ncpu2 1 2\ncpuX 1 2 3 4\nintr 5\n",
        "cpu12 1 2 3 4\ncpu  1 1 1 1 1 1 1 1 1 1\ncpu1 5 6 7 8 9\ncpu12 9 9 9 9\ncpu1\n",
    ],
)
def test_stat_lines_are_parse_stats_lines(text: str) -> None:
    # what the processes source reads of a job's few CPUs (StatLines) is what parse_stat
    # reads of them: the last cpuN line of the right form, old kernels' padded, cpu12
    # not taken for cpu1
    lines, whole = StatLines(text), parse_stat(text)
    for cpu in [*range(40), 12, 1]:
        assert lines.line(cpu) == whole.cpus.get(cpu), cpu
    with pytest.raises(ParseError, match="no `cpu` line"):
        StatLines("cpu0 1 2 3 4\ncpu 1 2\n")


def test_parse_pressure_on_the_fixtures() -> None:
    cpu = parse_pressure((NODE_EXPORTER / "pressure" / "cpu").read_text())
    assert cpu == {
        "some": Pressure(0.0, 0.0, 0.0, 14036781),
        "full": Pressure(0.0, 0.0, 0.0, 0),
    }
    io = parse_pressure((NODE_EXPORTER / "pressure" / "io").read_text())
    assert io["some"] == Pressure(0.18, 0.34, 0.10, 159886802)
    assert io["full"].total == 159229614
    # irq: only a `full` line and no trailing newline
    irq_text = (NODE_EXPORTER / "pressure" / "irq").read_text()
    assert not irq_text.endswith("\n")
    assert parse_pressure(irq_text) == {"full": Pressure(0.0, 0.0, 0.0, 8494)}


def test_parse_pressure_skips_bad_lines() -> None:
    text = (
        "some avg10=nan avg60=0.00 avg300=0.00 total=1\n"
        "full avg10=1.00 avg60=0.50 avg300=0.25 total=77\n"
        "weird avg10=1.00 avg60=0.50 avg300=0.25 total=77\n"
    )
    assert parse_pressure(text) == {"full": Pressure(1.0, 0.5, 0.25, 77)}
    for bad in ("", "some\n", "some avg10=101 avg60=0 avg300=0 total=1", "some total=-1"):
        with pytest.raises(ParseError):
            parse_pressure(bad)


def test_parse_meminfo_on_the_fixture() -> None:
    meminfo = parse_meminfo((NODE_EXPORTER / "meminfo").read_text())
    assert meminfo["MemTotal"] == 3742148 * 1024
    assert meminfo["Active(anon)"] == 2020004 * 1024
    assert meminfo["HugePages_Total"] == 0  # a count, not kB
    assert meminfo["VmallocTotal"] == 34359738367 * 1024
    assert "MemAvailable" not in meminfo  # a kernel before 3.14
    with pytest.raises(ParseError, match="MemTotal"):
        parse_meminfo("MemFree: 10 kB\n")


def test_busy_ratio() -> None:
    before = (100, 0, 50, 1000, 10, 0, 0, 0)
    assert busy_ratio((130, 0, 60, 1050, 20, 0, 0, 0), before) == (0.4, 0.1, 0.0)
    # steal counts as busy
    busy, _, steal = busy_ratio((150, 0, 50, 1000, 10, 0, 0, 50), before)  # type: ignore[misc]
    assert (busy, steal) == (1.0, 0.5)
    # idle stepping back (NO_HZ) counts as zero, not negative
    assert busy_ratio((200, 0, 50, 990, 10, 0, 0, 0), before) == (1.0, 0.0, 0.0)
    assert busy_ratio(before, before) is None


# --- the source on fixture trees ---------------------------------------------------------------


def test_first_poll_gives_memory_pressure_and_core_count(tmp_path: Path) -> None:
    got = by_key(source_for(tree(tmp_path)).collect())
    assert got[("cpu_cores", ())] == 8
    assert got[("memory_total_bytes", ())] == 3742148 * 1024
    assert ("memory_available_bytes", ()) not in got  # the fixture predates MemAvailable
    assert got[("memory_swap_total_bytes", ())] == 4194300 * 1024
    assert got[("memory_swap_free_bytes", ())] == 3155360 * 1024
    assert got[("pressure_ratio", ("io", "some", "60s"))] == pytest.approx(0.0034)
    assert got[("pressure_ratio", ("io", "full", "300s"))] == pytest.approx(0.001)
    assert got[("pressure_stalled_seconds_total", ("io", "some"))] == 159.886802
    assert got[("pressure_stalled_seconds_total", ("irq", "full"))] == 0.008494
    assert ("pressure_ratio", ("irq", "some", "10s")) not in got
    assert not [k for k in got if k[0].startswith("cpu_busy")]  # rates need two polls


def test_second_poll_gives_busy_iowait_steal_and_saturation(tmp_path: Path) -> None:
    root = tree(tmp_path)
    source = source_for(root)
    source.collect()
    text = (root / "stat").read_text()
    # 100 ticks per CPU: cpu0 fully busy, cpu1 half busy + 10 iowait, cpu2 95 % user,
    # cpu3 50 user + 50 steal, the rest idle
    idle = [0, 0, 0, 100, 0, 0, 0, 0]
    adds = {f"cpu{c}": idle for c in range(8)}
    adds["cpu0"] = [90, 0, 10, 0, 0, 0, 0, 0]
    adds["cpu1"] = [40, 0, 10, 40, 10, 0, 0, 0]
    adds["cpu2"] = [95, 0, 0, 5, 0, 0, 0, 0]
    adds["cpu3"] = [50, 0, 0, 0, 0, 0, 0, 50]
    (root / "stat").write_text(advance(text, adds))
    got = by_key(source.collect())
    busy = {k[1][0]: v for k, v in got.items() if k[0] == "cpu_busy_ratio"}
    assert busy == {"0": 1.0, "1": 0.5, "2": 0.95, "3": 1.0, **{str(c): 0.0 for c in range(4, 8)}}
    assert got[("cpu_busy_ratio_max", ())] == 1.0
    assert got[("cpu_cores_saturated", ())] == 3  # over 0.9: cpu0, cpu2, cpu3
    assert got[("cpu_busy_ratio_avg", ())] == pytest.approx((100 + 50 + 95 + 100) / 800)
    assert got[("cpu_iowait_ratio", ())] == pytest.approx(10 / 800)
    assert got[("cpu_steal_ratio", ())] == pytest.approx(50 / 800)


def test_per_core_off_keeps_the_node_summary(tmp_path: Path) -> None:
    root = tree(tmp_path)
    source = source_for(root, per_core=False, saturated_threshold=0.5)
    source.collect()
    text = advance((root / "stat").read_text(), {"cpu5": [60, 0, 0, 40, 0, 0, 0, 0]})
    (root / "stat").write_text(text)
    got = by_key(source.collect())
    assert not [k for k in got if k[0] == "cpu_busy_ratio"]
    assert got[("cpu_busy_ratio_max", ())] == 0.6
    assert got[("cpu_cores_saturated", ())] == 1


def test_cpu_hot_plug(tmp_path: Path) -> None:
    root = tree(tmp_path)
    source = source_for(root)
    source.collect()
    text = (root / "stat").read_text()
    offline = "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith("cpu7 ")
    )
    (root / "stat").write_text(advance(offline, {"cpu0": [100, 0, 0, 0, 0, 0, 0, 0]}))
    got = by_key(source.collect())
    assert got[("cpu_cores", ())] == 7
    assert ("cpu_busy_ratio", ("7",)) not in got
    assert got[("cpu_busy_ratio", ("0",))] == 1.0
    (root / "stat").write_text(advance(text, {"cpu7": [10, 0, 0, 90, 0, 0, 0, 0]}))
    got = by_key(source.collect())
    assert ("cpu_busy_ratio", ("7",)) not in got  # back online: baseline first
    (root / "stat").write_text(
        advance(advance(text, {"cpu7": [10, 0, 0, 90, 0, 0, 0, 0]}), {"cpu7": [5, 0, 0, 5]})
    )
    assert by_key(source.collect())[("cpu_busy_ratio", ("7",))] == 0.5


def test_no_psi_means_no_pressure_series_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = source_for(tree(tmp_path, pressure=False))
    with caplog.at_level(logging.INFO, logger="gpuwatchd.sources.cpu"):
        for _ in range(3):
            got = by_key(source.collect())
            assert not [k for k in got if k[0].startswith("pressure")]
    assert len([r for r in caplog.records if "no PSI" in r.getMessage()]) == 1


def test_psi_not_supported_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = cpu_module.read_text

    def read(path: str) -> str:
        if "/pressure/" in path:  # booted with psi=0: the files exist, reading fails
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_read(path)

    monkeypatch.setattr(cpu_module, "read_text", read)
    got = by_key(source_for(tree(tmp_path)).collect())
    assert got[("cpu_cores", ())] == 8
    assert not [k for k in got if k[0].startswith("pressure")]


def test_pressure_can_be_switched_off(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / "pressure" / "io").write_text("garbage\n")
    got = by_key(source_for(root, pressure=False).collect())
    assert not [k for k in got if k[0].startswith("pressure")]


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("stat", "intr 5\nctxt 6\n", r"/stat: not a /proc/stat file: no `cpu` line"),
        ("meminfo", "\x00\x01garbage", r"/meminfo: not a /proc/meminfo file: no MemTotal"),
        ("pressure/io", "some avg10=x\n", r"pressure/io: not a PSI file"),
    ],
)
def test_garbage_files_are_source_errors_naming_the_file(
    tmp_path: Path, file: str, content: str, message: str
) -> None:
    root = tree(tmp_path)
    (root / file).write_text(content)
    with pytest.raises(SourceError, match=message):
        source_for(root).collect()


def test_missing_files_are_source_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"nowhere/stat does not exist: is procfs mounted"):
        source_for(tmp_path / "nowhere").collect()
    root = tree(tmp_path / "proc")
    (root / "meminfo").unlink()
    with pytest.raises(SourceError, match=r"meminfo does not exist"):
        source_for(root).collect()


def test_samples_match_the_declared_specs(tmp_path: Path) -> None:
    root = tree(tmp_path)
    meminfo = "MemTotal: 100 kB\nMemAvailable: 50 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n"
    (root / "meminfo").write_text(meminfo)
    shutil.copy(RECLAIM / "vmstat", root / "vmstat")  # swap-ins and kswapd: reclaim.py
    (root / "47").mkdir()
    shutil.copy(RECLAIM / "kswapd0.stat", root / "47" / "stat")
    freq = tmp_path / "sys/devices/system/cpu/cpu0/cpufreq"  # cpufreq.py: busy cores' clock
    freq.mkdir(parents=True)
    (freq / "cpuinfo_max_freq").write_text("3800000\n")
    (freq / "scaling_cur_freq").write_text("1900000\n")
    now = [10.0]
    context = Context(procfs=root, sysfs=tmp_path / "sys", extras={"clock": lambda: now[0]})
    source = CpuSource(CpuConfig(per_core=True), context)
    source.collect()
    now[0] += 1
    (root / "stat").write_text(advance((root / "stat").read_text(), {"cpu0": [1, 0, 0, 1]}))
    samples = source.collect()
    specs = {spec.name: spec for spec in CpuSource.metrics}
    assert {s.name for s in samples} == set(specs)
    assert specs["gpuwatchd_pressure_stalled_seconds_total"].type == "counter"
    for s in samples:
        assert len(s.labels) == len(specs[s.name].labels), s
    assert by_key(samples)[("memory_available_bytes", ())] == 50 * 1024
    assert by_key(samples)[("cpu_busy_frequency_ratio", ())] == 0.5


def test_by_default_per_numa_node_not_per_core(tmp_path: Path) -> None:
    """The default exports each NUMA node's mean busy ratio and its busiest interrupt
    core (sysfs node*/cpulist), no per-core series; node 0 for all without NUMA."""
    values = {"cpu_busy_percent": 10, "core_busy_percent": {1: 100, 6: 50},
              "core_softirq_percent": {5: 30}}  # fmt: skip
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    timeline = Timeline(scenario(values, numa_nodes=2))
    SysfsWriter(sys, timeline).write(0.0)
    assert (sys / "devices/system/node/node1/cpulist").read_text() == "4-7\n"
    writer = CpuWriter(proc, timeline)
    source = CpuSource(CpuConfig(), Context(procfs=proc, sysfs=sys))
    flat = CpuSource(CpuConfig(), Context(procfs=proc, sysfs=tmp_path / "no-numa"))
    for t in (0.0, 10.0):
        writer.write(t)
        got, got_flat = by_key(source.collect()), by_key(flat.collect())
    assert not [k for k in got if k[0] in ("cpu_busy_ratio", "cpu_interrupt_ratio")]
    assert got[("cpu_numa_busy_ratio", ("0",))] == pytest.approx((1.0 + 3 * 0.1) / 4, abs=0.003)
    # core 5's softirq counts as busy (interrupt handlers run there): 0.1 0.3 0.5 0.1
    assert got[("cpu_numa_busy_ratio", ("1",))] == pytest.approx(1.0 / 4, abs=0.03)
    assert got[("cpu_numa_interrupt_ratio_max", ("1",))] >= 0.3  # core 5's softirq
    assert got[("cpu_numa_interrupt_ratio_max", ("0",))] < 0.05
    assert set(k[1] for k in got_flat if k[0] == "cpu_numa_busy_ratio") == {("0",)}


def test_config_defaults_and_validation() -> None:
    config = CpuConfig()
    assert (config.interval, config.per_core, config.saturated_threshold) == (5.0, False, 0.9)
    with pytest.raises(ValidationError):
        CpuConfig.model_validate({"saturated_threshold": 1.5})
    with pytest.raises(ValidationError, match="extra"):
        CpuConfig.model_validate({"per_cpu": False})


# --- the simulator's files ------------------------------------------------------------------


def scenario(values: dict[str, Any], **node: Any) -> Scenario:
    data: dict[str, Any] = {
        "name": "cpu-test",
        "node": {"gpu_count": 1, "cpus": 8, **node},
        "phases": [
            {"name": "first", "duration": 100, "host": values},
            {"name": "second", "duration": 1000, "host": {"psi_io_some": 0}},
        ],
    }
    return Scenario.model_validate(data)


def test_simulated_stat_reads_back_as_the_scenario_said(tmp_path: Path) -> None:
    values = {
        "cpu_busy_percent": 10,
        "core_busy_percent": {0: 100, 3: 50},
        "iowait_percent": 5,
        "steal_percent": 0,
        "mem_available_mib": 1000,
    }
    writer = CpuWriter(tmp_path, Timeline(scenario(values, host={"memory_total_mib": 4096})))
    source = source_for(tmp_path)
    writer.write(0.0)
    source.collect()
    writer.write(10.0)
    got = by_key(source.collect())
    busy = {k[1][0]: v for k, v in got.items() if k[0] == "cpu_busy_ratio"}
    assert busy["0"] == pytest.approx(1.0, abs=0.002)
    assert busy["3"] == pytest.approx(0.5, abs=0.002)
    assert busy["5"] == pytest.approx(0.1, abs=0.002)
    assert got[("cpu_cores_saturated", ())] == 1
    assert got[("cpu_iowait_ratio", ())] == pytest.approx(0.05 * 7 / 8, abs=0.002)  # cpu0: 100 %
    assert got[("cpu_steal_ratio", ())] == 0
    assert got[("memory_available_bytes", ())] == 1000 * 2**20
    assert got[("memory_total_bytes", ())] == 4096 * 2**20


def test_simulated_swap_fills_with_what_is_swapped_out(tmp_path: Path) -> None:
    """SwapTotal and SwapFree (issue 39's format): a node that swaps has 32 GiB unless it
    says otherwise; what is swapped out and not read back is in use; a node that never
    swaps has none; swap_free_mib sets it outright."""
    swapping = {"swap_out_mb_s": 100, "swap_in_mb_s": 40}
    for host, values, total, free in (
        ({}, swapping, 32768 << 20, (32768 << 20) - 60e6 * 10),
        ({"swap_total_mib": 1024}, {**swapping, "swap_free_mib": 100}, 1 << 30, 100 << 20),
        ({}, {}, 0, 0),
    ):
        root = tmp_path / str(total + free)
        writer = CpuWriter(root, Timeline(scenario(values, host=host)))
        source = source_for(root)
        writer.write(0.0)
        writer.write(10.0)
        got = by_key(source.collect())
        assert got[("memory_swap_total_bytes", ())] == total
        assert got[("memory_swap_free_bytes", ())] == pytest.approx(free, abs=4096)


def test_simulated_iowait_per_core(tmp_path: Path) -> None:
    """iowait lands on the cores whose tasks wait (a DataLoader's workers pinned to 2 of
    8 cores): the node's ratio is their share, and procs_blocked counts those cores."""
    values = {"cpu_busy_percent": 10, "core_iowait_percent": {1: 60, 2: 80}}
    writer = CpuWriter(tmp_path, Timeline(scenario(values)))
    source = source_for(tmp_path)
    writer.write(0.0)
    source.collect()
    writer.write(10.0)
    got = by_key(source.collect())
    assert got[("cpu_iowait_ratio", ())] == pytest.approx((0.6 + 0.8) / 8, abs=0.002)
    assert got[("cpu_busy_ratio", ("1",))] == pytest.approx(0.1, abs=0.002)
    cpu2 = next(line for line in (tmp_path / "stat").read_text().splitlines()
                if line.startswith("cpu2 "))  # fmt: skip
    assert int(cpu2.split()[5]) == 800  # iowait ticks: 80 a second for 10 s
    assert "procs_blocked 1\n" in (tmp_path / "stat").read_text()  # 1.4 cores' worth


def test_busy_cores_clock_from_cpufreq(tmp_path: Path) -> None:
    """The clock of the busy cores only (an idle core's clock drops by design); none on a
    node without cpufreq (a VM)."""
    values = {"cpu_busy_percent": 5, "core_busy_percent": {0: 100, 1: 100, 2: 30},
              "cpu_mhz": 1200, "core_mhz": {1: 3500}}  # fmt: skip

    def collect(name: str, max_mhz: float | None) -> dict:
        proc, sys = tmp_path / name / "proc", tmp_path / name / "sys"
        timeline = Timeline(scenario(values, host={"cpu_max_mhz": max_mhz}))
        writers = (CpuWriter(proc, timeline), CpufreqWriter(sys, timeline))
        source = CpuSource(CpuConfig(), Context(procfs=proc, sysfs=sys))
        for t in (0.0, 10.0):
            for writer in writers:
                writer.write(t)
            got = by_key(source.collect())
        return got

    got = collect("node", 3500)
    assert got[("cpu_busy_frequency_ratio", ())] == pytest.approx((1200 / 3500 + 1) / 2)
    link = tmp_path / "node/sys/devices/system/cpu/cpu0/cpufreq"
    assert os.readlink(link) == "../cpufreq/policy0"
    assert (link / "cpuinfo_max_freq").read_text() == "3500000\n"
    got = collect("vm", None)
    assert ("cpu_busy_frequency_ratio", ()) not in got
    assert ("cpu_busy_ratio_max", ()) in got


def test_simulated_cores_keep_their_history_when_their_load_diverges(tmp_path: Path) -> None:
    data: dict[str, Any] = {
        "name": "diverge",
        "node": {"gpu_count": 0, "cpus": 4},
        "phases": [
            {"name": "even", "duration": 100, "host": {"cpu_busy_percent": 10}},
            {"name": "hot", "duration": 100, "host": {"core_busy_percent": {0: 100, 2: 60}}},
            {"name": "cool", "duration": 100, "host": {"core_busy_percent": {0: 10, 2: 10}}},
        ],
    }
    writer = CpuWriter(tmp_path, Timeline(Scenario.model_validate(data)))
    for t in (0.0, 100.0, 110.0, 200.0, 210.0):
        writer.write(t)
    stat = parse_stat((tmp_path / "stat").read_text())

    def busy(times: tuple[int, ...]) -> int:
        return sum(times) - times[3] - times[4]

    # 100 s at 10 %, 100 s hot, 10 s at 10 % again (ticks: percent per second)
    assert [busy(stat.cpus[c]) for c in range(4)] == pytest.approx(
        [1000 + 10000 + 100, 2100, 1000 + 6000 + 100, 2100], abs=4
    )
    assert sum(stat.cpus[0]) == pytest.approx(21000, abs=4)
    assert stat.total == tuple(sum(stat.cpus[c][i] for c in range(4)) for i in range(8))


def test_simulated_steal_counts_as_busy(tmp_path: Path) -> None:
    writer = CpuWriter(tmp_path, Timeline(scenario({"cpu_busy_percent": 30, "steal_percent": 20})))
    source = source_for(tmp_path)
    writer.write(0.0)
    source.collect()
    writer.write(10.0)
    got = by_key(source.collect())
    assert got[("cpu_busy_ratio", ("1",))] == pytest.approx(0.5, abs=0.002)
    assert got[("cpu_steal_ratio", ())] == pytest.approx(0.2, abs=0.002)


def test_simulated_psi_averages_lag_and_total_integrates(tmp_path: Path) -> None:
    writer = CpuWriter(tmp_path, Timeline(scenario({"psi_io_some": 30, "psi_cpu_some": 12.345})))
    source = source_for(tmp_path)
    writer.write(0.0)
    got = by_key(source.collect())
    assert got[("pressure_ratio", ("io", "some", "10s"))] == 0.30
    assert got[("pressure_ratio", ("io", "some", "300s"))] == 0.30  # settled at the start
    assert got[("pressure_ratio", ("cpu", "some", "10s"))] == 0.1234  # truncated, as the kernel
    assert got[("pressure_ratio", ("cpu", "full", "10s"))] == 0.0
    assert got[("pressure_ratio", ("memory", "full", "60s"))] == 0.0
    writer.write(100.0)
    assert by_key(source.collect())[("pressure_stalled_seconds_total", ("io", "some"))] == 30.0
    writer.write(160.0)  # the second phase: io pressure gone
    got = by_key(source.collect())
    assert got[("pressure_ratio", ("io", "some", "10s"))] == 0.0
    assert got[("pressure_ratio", ("io", "some", "60s"))] == pytest.approx(0.30 / 2.718, abs=0.001)
    assert 0.2 < got[("pressure_ratio", ("io", "some", "300s"))] < 0.3
    assert got[("pressure_stalled_seconds_total", ("io", "some"))] == 30.0


def test_simulated_files_have_the_kernels_formats(tmp_path: Path) -> None:
    timeline = Timeline(scenario({"cpu_busy_percent": 40}))
    interrupts = InterruptsWriter(tmp_path, timeline)
    writer = CpuWriter(tmp_path, timeline, interrupts=interrupts)
    for t in (0.0, 3.0):
        interrupts.write(t)
        writer.write(t)
    stat = (tmp_path / "stat").read_text().splitlines()
    real = (NODE_EXPORTER / "stat").read_text().splitlines()
    assert re.fullmatch(r"cpu  \d+( \d+){9}", stat[0]) and re.fullmatch(
        r"cpu  \d+( \d+){9}", real[0]
    )
    assert [line.split()[0] for line in stat] == (
        ["cpu"] + [f"cpu{c}" for c in range(8)] + [line.split()[0] for line in real[9:]]
    )
    intr = stat[9].split()
    assert intr[0] == "intr" and len(intr) == 2 + nr_irqs(8)
    assert int(intr[1]) >= sum(map(int, intr[2:])) > 0
    for line in stat[1:9]:
        assert re.fullmatch(r"cpu\d+( \d+){10}", line)
    # PSI: the kernel's "%s avg10=%lu.%02lu avg60=%lu.%02lu avg300=%lu.%02lu total=%llu\n"
    psi = re.compile(r"(some|full) avg10=\d+\.\d\d avg60=\d+\.\d\d avg300=\d+\.\d\d total=\d+")
    for resource in ("cpu", "io", "memory"):
        for text in (
            (tmp_path / "pressure" / resource).read_text(),
            (NODE_EXPORTER / "pressure" / resource).read_text(),
        ):
            assert text.endswith("\n")
            assert [psi.fullmatch(line) is not None for line in text.splitlines()] == [True, True]
    # meminfo: "%-16s%8lu kB" (and the unitless HugePages_* counts)
    row = re.compile(r"[A-Za-z0-9_()]+: *\d+( kB)?")
    for text in ((tmp_path / "meminfo").read_text(), (NODE_EXPORTER / "meminfo").read_text()):
        for line in text.splitlines():
            assert row.fullmatch(line), line
            assert len(line.split(":")[0]) + 1 + len(line.split(":")[1].split(" kB")[0]) >= 24
    real_rows = [
        line.split(":")[0] for line in (NODE_EXPORTER / "meminfo").read_text().splitlines()
    ]
    ours = [line.split(":")[0] for line in (tmp_path / "meminfo").read_text().splitlines()]
    assert ours[:3] == ["MemTotal", "MemFree", "MemAvailable"]
    assert set(real_rows) - set(ours) == set()


def test_writes_only_changed_files(tmp_path: Path) -> None:
    writer = CpuWriter(tmp_path, Timeline(scenario({})))
    # stat, 3 PSI files, meminfo, vmstat, one kswapd per NUMA node (2)
    assert writer.write(0.0) == 8
    assert writer.write(0.0) == 0
    # stat and vmstat (page faults always rise): no pressure, memory and kswapd unchanged
    assert writer.write(5.0) == 2
    assert not list(tmp_path.rglob(".*.tmp"))


def test_core_split_and_psi_fixed() -> None:
    columns = core_split(busy=80, iowait=30, steal=10)  # more than 100 %: iowait gives way
    assert sum(columns) == pytest.approx(100)
    assert (columns[3], columns[4], columns[7]) == (0.0, pytest.approx(10.0), 10.0)
    assert psi_fixed(0.184) == "0.18"
    assert psi_fixed(99.999) == "99.99"
    assert psi_fixed(150) == "100.00"


# --- garbage --------------------------------------------------------------------------------

_BASES = st.sampled_from(
    [
        (NODE_EXPORTER / "stat").read_text(),
        DYNOLOG_STAT.read_text(),
        (NODE_EXPORTER / "meminfo").read_text(),
        *((NODE_EXPORTER / "pressure" / r).read_text() for r in ("cpu", "io", "memory", "irq")),
    ]
)


@st.composite
def mangled(draw: st.DrawFn) -> str:
    text = draw(_BASES)
    text = text[: draw(st.integers(0, len(text)))]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        junk = draw(st.text(max_size=20) | st.sampled_from(["\n", "=", "nan", "9" * 30]))
        text = text[:at] + junk + text[at:]
    return text


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(), mangled()))
def test_parsers_never_raise_anything_but_parse_error(text: str) -> None:
    for parse in (parse_stat, parse_pressure, parse_meminfo):
        with contextlib.suppress(ParseError):
            parse(text)


def stat_line_by_line(text: str) -> StatReading:
    """parse_stat as it was before session 17: the matched lines assigned one by one."""
    total, cpus = None, {}
    for label, columns in cpu_module._STAT_LINE.findall(text):
        times = cpu_module._padded(tuple(map(int, columns.split()[:8])))
        if label:
            cpus[int(label)] = times
        else:
            total = times
    if total is None:
        raise ParseError("no `cpu` line")
    return StatReading(total, cpus)


_ODD_LINES = st.sampled_from(["\n", "\r\n", "\r", "\x0c", "\x1e", "\u2028", " ", ":"])


@st.composite
def meminfo_texts(draw: st.DrawFn) -> str:
    """meminfo-like lines (the polled names among others, kB or not, garbled) joined by
    every line break splitlines() knows."""
    names = st.sampled_from(["MemTotal", "MemAvailable", "SwapTotal", "SwapFree", "MemFree",
                             " MemTotal", "SwapFree ", "Mem Total", "XMemTotal"])  # fmt: skip
    values = st.sampled_from(["1", "17 kB", "9" * 25, "x", "", "3 kB x", "4 MB"])
    rows = draw(st.lists(st.tuples(names, _ODD_LINES, values), max_size=8))
    breaks = draw(st.lists(_ODD_LINES, min_size=len(rows), max_size=len(rows)))
    return "".join(f"{n}:{pad}{v}{end}" for (n, pad, v), end in zip(rows, breaks, strict=True))


@st.composite
def psi_lines(draw: st.DrawFn) -> str:
    """PSI lines as the kernel prints them and near it: other spacing, order, widths."""
    avg = st.sampled_from(["0.00", "0.18", "99.99", "100.00", "100.01", "150.00", "1000.00",
                           "1.5", "1e1", "nan", "inf", "-0.00", "007.00", "x"])  # fmt: skip
    total = st.sampled_from(["0", "159886802", "9" * 20, "9" * 21, "-1", "1.0", ""])
    fields = [f"avg10={draw(avg)}", f"avg60={draw(avg)}", f"avg300={draw(avg)}",
              f"total={draw(total)}"]  # fmt: skip
    if draw(st.booleans()):
        fields = draw(st.permutations(fields))
    kind = draw(st.sampled_from(["some", "full", "none", " some"]))
    sep = draw(st.sampled_from([" ", "  ", "\t"]))
    return kind + " " + sep.join(fields) + draw(st.sampled_from(["", " ", "\t"]))


@settings(max_examples=500, deadline=None)
@given(line=psi_lines())
def test_a_kernel_psi_line_matched_whole_is_what_taking_it_apart_gives(line: str) -> None:
    assert pressure_line(line) == cpu_module.any_pressure_line(line)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(meminfo_texts(), mangled()))
def test_polled_meminfo_is_parse_meminfo_of_the_polled_names(text: str) -> None:
    # the poll's regex finds the lines parse_meminfo's splitlines() would, odd breaks too
    try:
        whole = parse_meminfo(text)
    except ParseError:
        with pytest.raises(ParseError, match="no MemTotal"):
            polled_meminfo(text)
        return
    expected = {k: whole[k] for k in cpu_module.MEMINFO_POLLED if k in whole}
    assert polled_meminfo(text) == expected


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(mangled(), st.sampled_from([
    "cpu12 1 2 3 4\ncpu  1 1 1 1 1 1 1 1 1 1\ncpu1 5 6 7 8 9\ncpu12 9 9 9 9\ncpu 2 2 2 2\n",
    "cpu0 1 2 3 4 5 6 7 8\ncpu 1 2 3 4 5 6 7 8\ncpu0 8 7 6 5 4 3 2 1\ncpu3 1 1 1 1 1 1 1 1\n",
])))  # fmt: skip
def test_parse_stat_is_the_line_by_line_parse(text: str) -> None:
    # which `cpu` line is the node's and which `cpuN` value stays, duplicates included
    try:
        expected = stat_line_by_line(text)
    except ParseError:
        with pytest.raises(ParseError, match="no `cpu` line"):
            parse_stat(text)
        return
    got = parse_stat(text)
    assert (got.total, list(got.cpus.items())) == (expected.total, list(expected.cpus.items()))


@settings(max_examples=100, deadline=None)
@given(files=st.dictionaries(st.sampled_from(["stat", "meminfo", "pressure/io"]), mangled()))
def test_collect_on_garbage_never_raises_but_source_error(
    tmp_path_factory: pytest.TempPathFactory, files: dict[str, str]
) -> None:
    root = tree(tmp_path_factory.mktemp("proc"))
    source = source_for(root)
    for attempt in range(2):
        if attempt:
            for name, content in files.items():
                (root / name).write_text(content)
        try:
            samples = source.collect()
        except SourceError:
            continue
        for s in samples:
            assert 0 <= s.value < float("inf")
            if s.name.endswith("_ratio") or s.name.endswith("_ratio_max"):
                assert s.value <= 1


# --- interrupt time per core ------------------------------------------------------------------


cpu_lines = st.dictionaries(
    st.integers(0, 7), st.tuples(*[st.integers(0, 50)] * 8), min_size=0, max_size=8
)


@settings(max_examples=60, deadline=None)
@given(before=cpu_lines, now=cpu_lines, same_cores=st.booleans())
def test_core_ratios_equal_cpu_ratios_core_by_core(
    before: dict[int, tuple[int, ...]], now: dict[int, tuple[int, ...]], same_cores: bool
) -> None:
    """All cores at once, column by column, give what cpu_ratios gives each core: columns
    that went backwards, cores that did not move, cores plugged in or out."""
    if same_cores:
        now = {cpu: now.get(cpu, times) for cpu, times in before.items()}
    total = (0,) * 8
    got = core_ratios(StatReading(total, now), StatReading(total, before))
    expected: tuple[list[int], list[float], list[float]] = ([], [], [])
    for cpu, times in now.items():
        ratios = cpu_ratios(times, before[cpu]) if cpu in before else None
        if ratios is not None:
            expected[0].append(cpu)
            expected[1].append(ratios[0])
            expected[2].append(ratios[3])
    assert got == expected


def test_interrupt_ratio_is_irq_plus_softirq_of_the_interval() -> None:
    before = (100, 0, 50, 800, 10, 5, 35, 0)
    after = (150, 0, 60, 820, 10, 25, 135, 0)  # 200 ticks: 20 irq + 100 softirq
    ratios = cpu_ratios(after, before)
    assert ratios is not None and ratios[3] == pytest.approx(0.6)
    assert cpu_ratios(before, before) is None


def test_core_split_takes_interrupt_time_from_the_task_first() -> None:
    columns = core_split(busy=90, iowait=5, steal=0, irq=10, softirq=50)
    assert columns[5] == pytest.approx(10 + 40 * 0.01)  # its own + the busy split's share
    assert columns[6] == pytest.approx(50 + 40 * 0.02)
    assert sum(columns) == pytest.approx(100)
    assert columns[4] == 0  # no room left for iowait


def test_a_storm_costs_the_cpu_it_lands_on(tmp_path: Path) -> None:
    """The simulator charges each interrupt to its CPU; the source reads it back per core."""
    hardware = {"nics": [{"name": "mlx5_0", "queues": 4, "bus_id": "0000:0c:00.0"}]}
    values = {
        "cpu_busy_percent": 20,
        "interrupts": {"mlx5_comp1": {"rate": 40_000, "cpus": [3]}},
        "core_softirq_percent": {5: 7},
    }
    timeline = Timeline(scenario(values, host=hardware))
    interrupts = InterruptsWriter(tmp_path, timeline)
    writer = CpuWriter(tmp_path, timeline, interrupts=interrupts)
    source = source_for(tmp_path)
    for t in (0.0, 10.0):
        interrupts.write(t)
        writer.write(t)
        got = by_key(source.collect())
    # 40 000/s x (1.5 + 12) µs = 54 %, plus the busy split's 3 % of the 20 % left
    assert got[("cpu_interrupt_ratio", ("3",))] == pytest.approx(0.54 + 0.2 * 0.03, abs=0.002)
    assert got[("cpu_interrupt_ratio", ("5",))] == pytest.approx(0.07 + 0.2 * 0.03, abs=0.002)
    assert got[("cpu_interrupt_ratio", ("0",))] == pytest.approx(0.2 * 0.03, abs=0.002)
    assert got[("cpu_interrupt_ratio_max", ())] == got[("cpu_interrupt_ratio", ("3",))]
    assert got[("cpu_busy_ratio", ("3",))] == pytest.approx(0.74, abs=0.002)
