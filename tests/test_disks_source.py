"""The disks source: /proc/diskstats parsed and turned into iostat -x rates.

On the real node_exporter fixture (14-, 18- and 20-field lines), on trees the
simulator writes (driven in virtual time), on counter wrap, reset and hot-plug, and on
garbage (hypothesis).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from series import Clock, Key, by_key

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sim.writers.disks import (
    DiskstatsWriter,
    device_numbers,
    disk_rates,
    partition_name,
)
from gpuwatchd.sources import REGISTRY, SourceError
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.disks import (
    U32,
    DisksConfig,
    DisksSource,
    DiskStat,
    DiskstatsError,
    counter_delta,
    iostat,
    is_partition_name,
    parse_diskstats,
    whole_disks,
)

FIXTURE = Path(__file__).parent / "fixtures" / "diskstats" / "node_exporter"
FIXTURE_TEXT = (FIXTURE / "diskstats").read_text()


def devices(samples: list[Sample]) -> set[str]:
    return {s.labels[0] for s in samples}


def source(procfs: Path, sysfs: Path, clock: Clock, **config: Any) -> DisksSource:
    ctx = Context(procfs=procfs, sysfs=sysfs, extras={"clock": clock})
    return DisksSource(DisksConfig(**config), ctx)


def line(name: str, stat: DiskStat, major: int = 259, minor: int = 0, fields: int = 17) -> str:
    return f"{major:4d} {minor:7d} {name} " + " ".join(str(v) for v in stat[:fields]) + "\n"


def stat(**values: int) -> DiskStat:
    base = dict.fromkeys(DiskStat._fields, 0)
    base.update(values)
    return DiskStat(**base)


# --- parsing the real fixture -----------------------------------------------------------


def test_the_source_is_registered_with_a_5s_default_interval() -> None:
    assert REGISTRY["disks"] is DisksSource
    assert DisksConfig().interval == 5.0


def test_fixture_lines_of_every_kernel_generation_parse() -> None:
    stats = parse_diskstats(FIXTURE_TEXT)
    assert len(stats) == len(FIXTURE_TEXT.splitlines()) == 51
    # 14 fields (before 4.18): no discard or flush counters
    assert stats["sda"] == DiskStat(
        25354637, 34367663, 1003346126, 18492372, 28444756, 11134226, 505697032, 63877960,
        0, 9653880, 82621804,
    )  # fmt: skip
    # 18 fields (4.18+): discards
    assert stats["sdb"][11:15] == (68851, 0, 1925173784, 11130)
    assert stats["sdb"].fl_ios == 0
    # 20 fields (5.5+): discards and flushes
    assert stats["sdc"][11:] == (18851, 0, 125173784, 11130, 1555, 1944)
    assert stats["nvme0n1"].io_ticks == 222766
    assert stats["nvme0n1"].time_in_queue == 1032546


def test_partitions_by_name() -> None:
    for name in ("sda1", "sdb2", "vda1", "xvda3", "hdc1", "sdaa12", "nvme0n1p1", "mmcblk0p2"):
        assert is_partition_name(name), name
    for name in ("sda", "vda", "nvme0n1", "mmcblk0", "md0", "md127", "dm-0", "sr0", "nbd0"):
        assert not is_partition_name(name), name


def test_without_sysfs_whole_devices_come_from_name_rules_and_the_default_exclude(
    tmp_path: Path,
) -> None:
    clock = Clock()
    src = source(FIXTURE, tmp_path / "no-sys", clock)
    assert src.collect() == []  # first sample: no rates yet
    clock.t = 10
    got = devices(src.collect())
    # ram*, loop*, dm-*, sr0, fd0 and every partition are left out
    assert got == {"sda", "sdb", "sdc", "vda", "mmcblk0", "nvme0n1"}


def test_with_sysfs_whole_devices_are_the_block_directory(tmp_path: Path) -> None:
    # the node_exporter sysfs fixture has only /sys/block/sda
    clock = Clock()
    src = source(FIXTURE, FIXTURE / "sys", clock)
    src.collect()
    clock.t = 1
    assert devices(src.collect()) == {"sda"}


def test_include_and_exclude(tmp_path: Path) -> None:
    clock = Clock()
    only_nvme = source(FIXTURE, tmp_path, clock, include="^nvme")
    everything = source(FIXTURE, tmp_path, clock, exclude="")
    capped = source(FIXTURE, tmp_path, clock, exclude="", max_devices=3)
    for src in (only_nvme, everything, capped):
        src.collect()
    clock.t = 5
    assert devices(only_nvme.collect()) == {"nvme0n1"}
    got = devices(everything.collect())
    assert {"ram0", "loop7", "dm-5", "sr0", "fd0", "sda"} <= got
    assert not got & {"sda1", "nvme0n1p2", "mmcblk0p1"}
    assert devices(capped.collect()) == {"dm-0", "dm-1", "dm-2"}  # first 3 by name


def test_config_rejects_a_bad_regex_and_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="regular expression"):
        DisksConfig(include="(")
    with pytest.raises(ValidationError):
        DisksConfig(devices=["sda"])  # type: ignore[call-arg]
    assert issubclass(DisksConfig, SourceConfig)


# --- iostat arithmetic ------------------------------------------------------------------


def test_rates_are_iostat_x_from_a_real_line() -> None:
    prev = parse_diskstats(FIXTURE_TEXT)["sdc"]
    cur = prev._replace(
        rd_ios=prev.rd_ios + 100,
        rd_sectors=prev.rd_sectors + 2048,
        rd_ticks=prev.rd_ticks + 250,
        wr_ios=prev.wr_ios + 50,
        wr_sectors=prev.wr_sectors + 800,
        wr_ticks=prev.wr_ticks + 500,
        io_ticks=prev.io_ticks + 1800,
        time_in_queue=prev.time_in_queue + 1500,
        dc_ios=prev.dc_ios + 10,
        dc_ticks=prev.dc_ticks + 40,
    )
    r = iostat(prev, cur, 2.0)
    assert r is not None
    assert r.reads_per_second == 50
    assert r.writes_per_second == 25
    assert r.read_bytes_per_second == 2048 * 512 / 2
    assert r.write_bytes_per_second == 800 * 512 / 2
    assert r.read_await_seconds == pytest.approx(0.0025)
    assert r.write_await_seconds == pytest.approx(0.010)
    assert r.await_seconds == pytest.approx((250 + 500 + 40) / 160 / 1000)
    assert r.queue_size == pytest.approx(0.75)
    assert r.utilization_ratio == pytest.approx(0.9)


def test_no_io_gives_zero_awaits_and_util_is_capped() -> None:
    prev = stat(io_ticks=1000)
    r = iostat(prev, prev._replace(io_ticks=3500), 2.0)
    assert r is not None
    assert (r.read_await_seconds, r.write_await_seconds, r.await_seconds) == (0, 0, 0)
    assert r.utilization_ratio == 1.0
    assert iostat(prev, prev, 0.0) is None


def test_counter_delta_wraps_only_plausibly() -> None:
    assert counter_delta(10, 15, 64) == 5
    assert counter_delta(U32 - 100, 50, 32) == 150  # a 32-bit wrap
    assert counter_delta(U32 - 100, 50, 64) is None  # a 64-bit counter went down: reset
    assert counter_delta(1000, 10, 32) is None  # too far back to be a wrap: reset
    assert counter_delta(U32 + 5, 3, 32) is None  # not a 32-bit value before


def test_millisecond_fields_wrap_at_32_bits_on_a_64_bit_kernel() -> None:
    prev = stat(rd_ios=5 * U32, rd_ticks=U32 - 300, io_ticks=U32 - 400, time_in_queue=U32 - 1)
    cur = prev._replace(rd_ios=prev.rd_ios + 100, rd_ticks=200, io_ticks=500, time_in_queue=999)
    r = iostat(prev, cur, 1.0, ulong_bits=64)
    assert r is not None
    assert r.read_await_seconds == pytest.approx(0.005)
    assert r.utilization_ratio == pytest.approx(0.9)
    assert r.queue_size == pytest.approx(1.0)


def test_ulong_fields_wrap_on_a_32_bit_kernel_and_reset_on_a_64_bit_one() -> None:
    prev = stat(rd_ios=U32 - 10, rd_sectors=U32 - 1000)
    cur = prev._replace(rd_ios=30, rd_sectors=3000)
    r = iostat(prev, cur, 1.0, ulong_bits=32)
    assert r is not None and r.reads_per_second == 40 and r.read_bytes_per_second == 4000 * 512
    assert iostat(prev, cur, 1.0, ulong_bits=64) is None


def write(path: Path, *lines: str) -> None:
    path.write_text("".join(lines))


def test_source_learns_the_kernel_is_64_bit_and_then_treats_a_decrease_as_a_reset(
    tmp_path: Path,
) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    clock = Clock()
    src = source(proc, tmp_path / "sys", clock)
    high = U32 - 10
    write(proc / "diskstats", line("sda", stat(rd_ios=high)), line("sdb", stat()))
    src.collect()
    clock.t = 1
    write(proc / "diskstats", line("sda", stat(rd_ios=5)), line("sdb", stat()))
    got = by_key(src.collect())
    assert got[("disk_reads_per_second", ("sda",))] == 15  # maybe a 32-bit kernel: a wrap
    clock.t = 2
    write(proc / "diskstats", line("sda", stat(rd_ios=10)), line("sdb", stat(wr_sectors=U32 + 1)))
    src.collect()  # sdb's sector count proves unsigned long is 64 bits
    clock.t = 3
    write(proc / "diskstats", line("sda", stat(rd_ios=high)), line("sdb", stat(wr_sectors=U32 + 1)))
    src.collect()
    clock.t = 4
    write(proc / "diskstats", line("sda", stat(rd_ios=7)), line("sdb", stat(wr_sectors=U32 + 1)))
    assert devices(src.collect()) == {"sdb"}  # sda went down: a reset, no rates


def test_a_reset_skips_one_interval_then_rates_resume(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    clock = Clock()
    src = source(proc, tmp_path / "sys", clock)
    for t, reads in ((0, 10_000), (5, 10_500), (10, 20), (15, 520)):
        clock.t = t
        write(proc / "diskstats", line("nvme0n1", stat(rd_ios=reads)))
        got = by_key(src.collect())
        rate = got.get(("disk_reads_per_second", ("nvme0n1",)))
        assert rate == {0: None, 5: 100, 10: None, 15: 100}[t], t


def test_hot_plug_new_device_waits_one_poll_gone_device_loses_its_series(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    clock = Clock()
    src = source(proc, tmp_path / "sys", clock)
    a, b = stat(wr_ios=100), stat(wr_ios=7)
    write(proc / "diskstats", line("nvme0n1", a))
    src.collect()
    clock.t = 1
    write(proc / "diskstats", line("nvme0n1", a), line("nvme1n1", b, minor=2))
    assert devices(src.collect()) == {"nvme0n1"}
    clock.t = 2
    write(proc / "diskstats", line("nvme0n1", a), line("nvme1n1", b._replace(wr_ios=17), minor=2))
    got = by_key(src.collect())
    assert got[("disk_writes_per_second", ("nvme1n1",))] == 10
    clock.t = 3
    write(proc / "diskstats", line("nvme1n1", b._replace(wr_ios=27), minor=2))
    assert devices(src.collect()) == {"nvme1n1"}
    clock.t = 4  # nvme0n1 comes back, counters restarted: a new device, no rates yet
    write(proc / "diskstats", line("nvme0n1", stat(wr_ios=3)), line("nvme1n1", b, minor=2))
    assert devices(src.collect()) == set()  # nvme1n1 went down: reset


def test_a_poll_at_the_same_instant_repeats_the_last_rates(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    clock = Clock()
    src = source(proc, tmp_path / "sys", clock)
    write(proc / "diskstats", line("sda", stat(rd_ios=0), major=8))
    src.collect()
    clock.t = 2
    write(proc / "diskstats", line("sda", stat(rd_ios=20), major=8))
    first = by_key(src.collect())
    write(proc / "diskstats", line("sda", stat(rd_ios=40), major=8))
    assert by_key(src.collect()) == first
    clock.t = 4  # the next interval runs from the last poll that moved the clock
    assert by_key(src.collect())[("disk_reads_per_second", ("sda",))] == 10


# --- errors -----------------------------------------------------------------------------


def test_missing_file_is_a_source_error_naming_it(tmp_path: Path) -> None:
    src = source(tmp_path / "nowhere", tmp_path, Clock())
    with pytest.raises(SourceError, match=r"nowhere/diskstats does not exist"):
        src.collect()


def test_garbage_file_is_a_source_error_and_a_bad_line_is_skipped_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    src = source(proc, tmp_path / "sys", Clock())
    (proc / "diskstats").write_text("this is not\na diskstats file\n")
    with pytest.raises(SourceError, match=r"proc/diskstats: no valid diskstats line"):
        src.collect()
    (proc / "diskstats").write_text("")
    assert src.collect() == []  # an empty file: no devices (some containers), not an error
    (proc / "diskstats").write_text(FIXTURE_TEXT + "   8 0 sdz 1 2 three\n")
    with caplog.at_level(logging.WARNING):
        src.collect()
        src.collect()
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1 and "sdz" in warnings[0].getMessage()


def test_parser_rejects_bad_numbers_and_names() -> None:
    good = "   8       0 sda 1 2 3 4 5 6 7 8 9 10 11\n"
    assert set(parse_diskstats(good)) == {"sda"}
    bad = [
        "   8       0 sda 1 2 3 4 5 6 7 8 9 10\n",  # 10 counters
        "   8       0 sda 1 2 3 -4 5 6 7 8 9 10 11\n",
        "   8       0 sda 1 2 3 4 5 6 7 8 9 10 18446744073709551616\n",  # 2^64
        "   8       x sda 1 2 3 4 5 6 7 8 9 10 11\n",
        "   8       0 s\u00e9a 1 2 3 4 5 6 7 8 9 10 11\n",
        "   8       0 sda 1 2 3 4 5 6 7 8 9 10 \u0663\n",  # a non-ASCII digit
    ]
    for text in bad:
        malformed: list[str] = []
        assert parse_diskstats(good + text, malformed) == parse_diskstats(good)
        assert malformed == [text.rstrip("\n")]
        with pytest.raises(DiskstatsError):
            parse_diskstats(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=400))
def test_parser_never_raises_anything_but_its_error_on_any_text(text: str) -> None:
    try:
        stats = parse_diskstats(text)
    except DiskstatsError:
        return
    for name, value in stats.items():
        assert name and all(0 <= v < 2**64 for v in value)


@settings(max_examples=200, deadline=None)
@given(
    cut=st.integers(min_value=0, max_value=len(FIXTURE_TEXT)),
    flips=st.lists(
        st.tuples(st.integers(0, len(FIXTURE_TEXT) - 1), st.sampled_from("0 9x-\n\t\x00\ufffd")),
        max_size=8,
    ),
)
def test_truncated_and_garbled_fixture(cut: int, flips: list[tuple[int, str]]) -> None:
    chars = list(FIXTURE_TEXT)
    for pos, ch in flips:
        chars[pos] = ch
    text = "".join(chars)[:cut]
    try:
        stats = parse_diskstats(text)
    except DiskstatsError:
        assert text.strip()
        return
    whole = parse_diskstats(FIXTURE_TEXT)
    if not flips:  # a truncated file gives a subset of the devices (a cut line may be lost)
        assert set(stats) <= set(whole)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.binary(max_size=300), second=st.binary(max_size=300))
def test_collect_on_garbage_never_crashes(garbage: bytes, second: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc = Path(tmp)
        clock = Clock()
        src = source(proc, proc / "sys", clock)
        for t, content in ((0, garbage), (1, FIXTURE_TEXT.encode() + second), (2, garbage)):
            clock.t = t
            (proc / "diskstats").write_bytes(content)
            try:
                samples = src.collect()
            except SourceError as e:
                assert "diskstats" in str(e)
                continue
            for s in samples:
                assert s.value >= 0 or s.value != s.value  # never negative


# --- the simulator's tree ---------------------------------------------------------------


def scenario(disks: list[str], phases: list[dict[str, Any]]) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "disks",
            "node": {"gpu_count": 0, "host": {"disks": [{"name": d} for d in disks]}},
            "phases": phases,
        }
    )


BUSY = {
    "read_iops": 2000,
    "write_iops": 400,
    "read_mb_s": 1500,
    "write_mb_s": 200,
    "util_percent": 99,
    "await_ms": 25,
}


def sim(tmp_path: Path, timeline: Any, **writer: Any) -> tuple[DiskstatsWriter, DisksSource, Clock]:
    clock = Clock()
    w = DiskstatsWriter(tmp_path / "proc", timeline, sysfs=tmp_path / "sys", **writer)
    src = source(tmp_path / "proc", tmp_path / "sys", clock)
    return w, src, clock


def run(w: DiskstatsWriter, src: DisksSource, clock: Clock, t: float) -> dict[Key, float]:
    clock.t = t
    w.write(t)
    return by_key(src.collect())


def test_simulated_busy_disk_reads_back_as_the_scenario_says(tmp_path: Path) -> None:
    tl = Timeline(
        scenario(
            ["nvme0n1", "nvme1n1", "sda"],
            [
                {"name": "idle", "duration": "1m"},
                {"name": "busy", "duration": "5m", "host": {"disks": {"nvme1n1": BUSY}}},
            ],
        )
    )
    w, src, clock = sim(tmp_path, tl)
    assert run(w, src, clock, 0) == {}
    idle = run(w, src, clock, 30)
    assert idle[("disk_utilization_ratio", ("nvme1n1",))] == 0
    run(w, src, clock, 60)
    got = run(w, src, clock, 65)
    # partitions (nvme1n1p1) and loop0 are in the file but not reported
    assert devices([Sample(k[0], k[1], v) for k, v in got.items()]) == {
        "nvme0n1",
        "nvme1n1",
        "sda",
    }
    busy = {name: got[(name, ("nvme1n1",))] for name, _ in got if _ == ("nvme1n1",)}
    assert busy["disk_utilization_ratio"] == pytest.approx(0.99)
    assert busy["disk_read_await_seconds"] == pytest.approx(0.025, rel=1e-3)
    assert busy["disk_write_await_seconds"] == pytest.approx(0.025, rel=1e-3)
    assert busy["disk_await_seconds"] == pytest.approx(0.025, rel=1e-3)
    assert busy["disk_reads_per_second"] == pytest.approx(2000)
    assert busy["disk_writes_per_second"] == pytest.approx(400)
    assert busy["disk_read_bytes_per_second"] == pytest.approx(1.5e9, rel=1e-6)
    assert busy["disk_write_bytes_per_second"] == pytest.approx(2e8, rel=1e-6)
    assert busy["disk_queue_size"] == pytest.approx(2400 * 0.025, rel=1e-3)
    assert got[("disk_utilization_ratio", ("nvme0n1",))] == 0


def test_writer_lays_out_kernel_numbers_partitions_and_sysfs(tmp_path: Path) -> None:
    tl = Timeline(scenario(["nvme0n1", "nvme1n1", "sda", "sdb", "vda"], [BUSY_PHASE]))
    w = DiskstatsWriter(tmp_path / "proc", tl, sysfs=tmp_path / "sys")
    assert w.write(0) > 0
    assert w.write(0) == 0  # nothing changed: nothing written
    text = (tmp_path / "proc" / "diskstats").read_text()
    heads = [ln.split()[:3] for ln in text.splitlines()]
    assert heads == [
        ["259", "0", "nvme0n1"],
        ["259", "1", "nvme0n1p1"],
        ["259", "2", "nvme1n1"],
        ["259", "3", "nvme1n1p1"],
        ["8", "0", "sda"],
        ["8", "1", "sda1"],
        ["8", "16", "sdb"],
        ["8", "17", "sdb1"],
        ["252", "0", "vda"],
        ["252", "1", "vda1"],
        ["7", "0", "loop0"],
    ]
    assert all(len(ln.split()) == 20 for ln in text.splitlines())
    assert text.splitlines()[0].startswith(" 259       0 nvme0n1 ")  # "%4d %7d %s"
    assert sorted(p.name for p in (tmp_path / "sys" / "block").iterdir()) == [
        "nvme0n1",
        "nvme1n1",
        "sda",
        "sdb",
        "vda",
    ]
    assert (tmp_path / "sys/block/sdb/dev").read_text() == "8:16\n"
    assert (tmp_path / "sys/block/nvme1n1/nvme1n1p1/partition").read_text() == "1\n"
    assert not list((tmp_path / "proc").glob(".*.tmp"))
    assert w.write(5) == 1  # counters moved: only diskstats is rewritten


BUSY_PHASE = {"name": "busy", "duration": "10m", "host": {"disks": {"nvme0n1": BUSY}}}


def test_device_numbers_follow_the_kernel() -> None:
    names = [f"sd{c}" for c in "abcdefghijklmnopq"] + ["sdaa", "mmcblk1", "nvme0n1", "xyz"]
    numbers = device_numbers(names)
    assert numbers["sda"] == (8, 0) and numbers["sdb"] == (8, 16) and numbers["sdp"] == (8, 240)
    assert numbers["sdq"] == (65, 0)  # the 17th sd disk: the next sd major
    assert numbers["sdaa"] == (65, 160)  # index 26
    assert numbers["mmcblk1"] == (179, 8) and numbers["mmcblk1p1"] == (179, 9)
    assert numbers["nvme0n1"] == (259, 0) and numbers["xyz1"] == (259, 3)
    assert partition_name("nvme0n1") == "nvme0n1p1" and partition_name("sda") == "sda1"
    assert disk_rates({}) == (0.0,) * 7


def test_simulated_counters_cross_the_32_bit_wrap(tmp_path: Path) -> None:
    tl = Timeline(scenario(["nvme0n1"], [BUSY_PHASE]))
    # every counter starts 1000 below 2^32: the ms fields wrap within a second, and with
    # a 32-bit unsigned long the I/O and sector counts too
    for bits in (64, 32):
        root = tmp_path / str(bits)
        w, src, clock = sim(root, tl, ulong_bits=bits, offset=U32 - 1000)
        run(w, src, clock, 0)
        run(w, src, clock, 1)
        got = run(w, src, clock, 6)
        before = [int(v) for v in (root / "proc/diskstats").read_text().split()[3:20]]
        assert before[9] < 1000 * 6  # io_ticks wrapped
        assert got[("disk_utilization_ratio", ("nvme0n1",))] == pytest.approx(0.99)
        assert got[("disk_read_await_seconds", ("nvme0n1",))] == pytest.approx(0.025, rel=1e-3)
        assert got[("disk_queue_size", ("nvme0n1",))] == pytest.approx(60, rel=1e-3)
        assert got[("disk_reads_per_second", ("nvme0n1",))] == pytest.approx(2000)


class HotPlug:
    """A timeline whose disk `name` is absent (`present: false`) in [gone, back)."""

    def __init__(self, timeline: Timeline, name: str, gone: float, back: float) -> None:
        self.scenario = timeline.scenario
        self._timeline = timeline
        self._name, self._gone, self._back = name, gone, back

    def host_state(self, t: float) -> dict[str, Any]:
        host = dict(self._timeline.host_state(t))
        if self._gone <= t < self._back:
            disks = {k: dict(v) for k, v in (host.get("disks") or {}).items()}
            disks.setdefault(self._name, {})["present"] = False
            host["disks"] = disks
        return host


def test_simulated_hot_plug(tmp_path: Path) -> None:
    tl = HotPlug(Timeline(scenario(["nvme0n1", "nvme1n1"], [BUSY_PHASE])), "nvme0n1", 10, 20)
    w, src, clock = sim(tmp_path, tl)
    run(w, src, clock, 0)
    assert ("disk_reads_per_second", ("nvme0n1",)) in run(w, src, clock, 5)
    gone = run(w, src, clock, 10)
    assert {labels for _, labels in gone} == {("nvme1n1",)}
    assert "nvme0n1 " not in (tmp_path / "proc/diskstats").read_text()
    assert not (tmp_path / "sys/block/nvme0n1").exists()
    back = run(w, src, clock, 20)
    assert {labels for _, labels in back} == {("nvme1n1",)}  # back: first sample only
    assert (tmp_path / "sys/block/nvme0n1/dev").read_text() == "259:0\n"
    fields = (tmp_path / "proc/diskstats").read_text().split("\n")[0].split()
    assert fields[2] == "nvme0n1" and fields[3] == "0"  # its counters restarted
    again = run(w, src, clock, 25)
    assert again[("disk_reads_per_second", ("nvme0n1",))] == pytest.approx(2000)


def test_writer_and_source_without_sysfs_directory(tmp_path: Path) -> None:
    # a writer without sysfs: the source falls back to name rules
    tl = Timeline(scenario(["nvme0n1", "sda"], [BUSY_PHASE]))
    w = DiskstatsWriter(tmp_path / "proc", tl)
    clock = Clock()
    src = source(tmp_path / "proc", tmp_path / "absent", clock)
    w.write(0)
    src.collect()
    clock.t = 5
    w.write(5)
    assert devices(src.collect()) == {"nvme0n1", "sda"}


def test_a_plain_source_config_gets_the_defaults(tmp_path: Path) -> None:
    clock = Clock()
    ctx = Context(procfs=FIXTURE, sysfs=tmp_path, extras={"clock": clock})
    src = DisksSource(SourceConfig(interval=7), ctx)
    src.collect()
    clock.t = 7
    assert "loop0" not in devices(src.collect())  # the default exclude applies


# --- which disks a device number is on (per-job attribution) ---------------------------------


def test_whole_disks_of_partitions_stacked_devices_and_anonymous_ones(tmp_path: Path) -> None:
    """/sys/dev/block/MAJ:MIN as the kernel lays it out: links into /sys/devices."""
    sys = tmp_path / "sys"
    links = sys / "dev" / "block"
    links.mkdir(parents=True)
    sda = sys / "devices" / "pci0000:00" / "0000:00:17.0" / "ata1" / "host0" / "block" / "sda"
    nvme = sys / "devices" / "pci0000:00" / "0000:00:1d.0" / "nvme" / "nvme0" / "nvme0n1"
    for disk, part in ((sda, "sda2"), (nvme, "nvme0n1p1")):
        (disk / part).mkdir(parents=True)
        (disk / part / "partition").write_text("1\n")
    (links / "8:0").symlink_to(os.path.relpath(sda, links))
    (links / "8:2").symlink_to(os.path.relpath(sda / "sda2", links))
    (links / "259:1").symlink_to(os.path.relpath(nvme / "nvme0n1p1", links))
    # LVM on a partition of each disk: dm-0's slaves
    dm = sys / "devices" / "virtual" / "block" / "dm-0"
    (dm / "slaves").mkdir(parents=True)
    (dm / "slaves" / "sda2").symlink_to(os.path.relpath(sda / "sda2", dm / "slaves"))
    (dm / "slaves" / "nvme0n1p1").symlink_to(os.path.relpath(nvme / "nvme0n1p1", dm / "slaves"))
    (links / "253:0").symlink_to(os.path.relpath(dm, links))
    root = os.fspath(sys)
    assert whole_disks(root, 8, 0) == ("sda",)
    assert whole_disks(root, 8, 2) == ("sda",)
    assert whole_disks(root, 259, 1) == ("nvme0n1",)
    assert whole_disks(root, 253, 0) == ("nvme0n1", "sda")
    assert whole_disks(root, 0, 52) == ()  # NFS, tmpfs: no block device
    assert whole_disks(os.fspath(tmp_path / "nowhere"), 8, 0) == ()


def test_simulated_dev_block_links_lead_to_the_disks(tmp_path: Path) -> None:
    tl = Timeline(scenario(["nvme0n1", "sdb"], [{"name": "p", "duration": 60}]))
    DiskstatsWriter(tmp_path / "proc", tl, sysfs=tmp_path / "sys").write(0.0)
    root = os.fspath(tmp_path / "sys")
    assert whole_disks(root, 259, 0) == ("nvme0n1",)
    assert whole_disks(root, 259, 1) == ("nvme0n1",)  # nvme0n1p1
    assert whole_disks(root, 8, 17) == ("sdb",)  # sdb1
