"""The infiniband source: port state, rate against the best rate, traffic, waits, errors.

On real sysfs fixtures (node_exporter's mlx4_0 / i40iw0, gpud's H100 node with files
that lack the trailing newline, azhpc's Hyper-V port with an unknown physical state),
on trees the simulator writes (driven in virtual time), and on garbage (hypothesis).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from series import Clock, Key, by_key

from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sim.sysfs import SysfsWriter
from gpuwatchd.sim.writers.infiniband import InfinibandWriter, hca_type, rate_text
from gpuwatchd.sources import REGISTRY, SourceError
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.infiniband import (
    ERROR_COUNTERS,
    U32_MAX,
    IbRate,
    InfinibandConfig,
    InfinibandSource,
    counter_rate,
    parse_counter,
    parse_label,
    parse_link_layer,
    parse_rate,
    parse_state,
)

FIXTURES = Path(__file__).parent / "fixtures" / "infiniband"
NODE_EXPORTER = FIXTURES / "node_exporter"  # a sysfs root: class/infiniband/{mlx4_0,i40iw0}
GPUD = FIXTURES / "gpud"  # a sysfs root: class/infiniband/{mlx5_0,mlx5_1,mlx5_bond_0}
ENDURE = FIXTURES / "azhpc-diagnostics" / "endure"  # one port's rate, state, phys_state


def source(sysfs: Path, clock: Clock | None = None, **config: Any) -> InfinibandSource:
    ctx = Context(sysfs=sysfs, extras={"clock": clock or Clock()})
    return InfinibandSource(InfinibandConfig(**config), ctx)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def port_metrics(got: dict[Key, float], device: str, port: str = "1") -> dict[str, float]:
    return {name: v for (name, labels), v in got.items() if labels == (device, port)}


# --- parsers ----------------------------------------------------------------------------


def test_the_source_is_registered_with_a_5s_default_interval() -> None:
    assert REGISTRY["infiniband"] is InfinibandSource
    assert InfinibandConfig().interval == 5.0


def test_state_files_of_every_fixture() -> None:
    assert parse_state((NODE_EXPORTER / "class/infiniband/mlx4_0/ports/1/state").read_text()) == 4
    phys = GPUD / "class/infiniband/mlx5_0/ports/1/phys_state"
    assert not phys.read_text().endswith("\n")  # gpud's capture lost the newline
    assert parse_state(phys.read_text()) == 5
    assert parse_state((ENDURE / "phys_state").read_text()) == 0  # "0: <unknown>"
    assert parse_state((ENDURE / "state").read_text()) == 4
    assert parse_state("1: DOWN\n") == 1
    for bad in ("", "ACTIVE", ": 4", "4 ACTIVE", "99999: X", "4:\nACTIVE"):
        assert parse_state(bad) is None, bad


def test_rate_files_of_every_fixture() -> None:
    rates = {
        NODE_EXPORTER / "class/infiniband/mlx4_0/ports/1/rate": IbRate(40, 4, "QDR"),
        NODE_EXPORTER / "class/infiniband/i40iw0/ports/1/rate": IbRate(10, 4, ""),  # old SDR
        GPUD / "class/infiniband/mlx5_0/ports/1/rate": IbRate(400, 4, "NDR"),
        GPUD / "class/infiniband/mlx5_bond_0/ports/1/rate": IbRate(200, 2, "NDR"),
        ENDURE / "rate": IbRate(5, 1, "DDR"),
    }
    for path, expected in rates.items():
        assert parse_rate(path.read_text()) == expected, path
    assert parse_rate("2.5 Gb/sec (1X SDR)\n") == IbRate(2.5, 1, "SDR")
    assert parse_rate("56 Gb/sec (4X FDR)") == IbRate(56, 4, "FDR")
    assert parse_rate("400 Gb/sec (4X NDR)").bits_per_second == 400e9  # type: ignore[union-attr]
    for bad in ("", "fast", "400 Gb/s (4X NDR)", "400 Gb/sec (3X NDR)", "-1 Gb/sec"):
        assert parse_rate(bad) is None, bad


def test_counter_and_label_files() -> None:
    assert parse_counter("4294967295\n") == U32_MAX
    assert parse_counter("230442669431839") == 230442669431839  # gpud: no newline
    assert parse_counter("N/A (no PMA)\n") is None  # i40iw
    assert parse_counter("18446744073709551616") is None  # 2^64
    assert parse_counter("-1") is None
    assert parse_link_layer("InfiniBand\n") == "InfiniBand"
    assert parse_link_layer("Ethernet") == "Ethernet"
    assert parse_link_layer("Token Ring") is None
    assert parse_label("MT4129") == "MT4129"
    assert parse_label("\x00\x01") is None and parse_label("") is None


def test_counter_rate_handles_clears_and_saturation() -> None:
    assert counter_rate(100, 300, 2.0, True) == 100
    assert counter_rate(300, 100, 2.0, True) is None  # cleared
    assert counter_rate(5, U32_MAX, 1.0, True) is None  # saturated 32-bit counter
    assert counter_rate(5, U32_MAX, 1.0, False) == U32_MAX - 5  # a 64-bit counter passing by
    assert counter_rate(5, 6, 0.0, False) is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_parsers_never_raise(text: str) -> None:
    for parse in (parse_state, parse_rate, parse_counter, parse_link_layer, parse_label):
        parse(text)


# --- the fixture trees ------------------------------------------------------------------


def test_node_exporter_tree_mlx4_and_an_iwarp_device_without_pma() -> None:
    got = by_key(source(NODE_EXPORTER).collect())
    assert got[("ib_port_info", ("mlx4_0", "1", "InfiniBand", "MT4099", "2.31.5050"))] == 1
    assert got[("ib_port_info", ("i40iw0", "1", "InfiniBand", "I40IW", "0.2"))] == 1
    mlx4 = port_metrics(got, "mlx4_0")
    assert mlx4 == {
        "ib_port_state": 4,
        "ib_port_active": 1,
        "ib_port_physical_state": 5,
        "ib_port_physical_up": 1,
        "ib_port_rate_bits_per_second": 40e9,
        "ib_port_rate_max_bits_per_second": 40e9,  # the best seen so far
        "ib_port_rate_degraded": 0,
    }
    errors = {labels[2]: v for (name, labels), v in got.items() if name == "ib_port_errors_total"}
    # mlx4_0 port 1 has these error counters; i40iw0's all read "N/A (no PMA)"
    assert errors == {
        "link_error_recovery": 0,
        "link_downed": 0,
        "port_rcv_errors": 0,
        "port_xmit_discards": 5,
        "port_xmit_constraint_errors": 0,
        "port_rcv_constraint_errors": 0,
    }
    assert port_metrics(got, "i40iw0")["ib_port_rate_bits_per_second"] == 10e9
    assert port_metrics(got, "mlx4_0", "2")["ib_port_active"] == 1


def test_mlx4_rates_use_counters_ext_and_a_saturated_xmit_wait_gives_none(
    tmp_path: Path,
) -> None:
    root = copy_tree(NODE_EXPORTER, tmp_path / "sys")
    port = root / "class/infiniband/mlx4_0/ports/1"
    clock = Clock()
    src = source(root, clock)
    src.collect()
    ext = port / "counters_ext"
    (ext / "port_xmit_data_64").write_text(f"{3733440 + 2_500_000}\n")  # words
    (ext / "port_rcv_data_64").write_text(f"{4631917 + 500_000}\n")
    (port / "counters" / "port_xmit_data").write_text("0\n")  # 32-bit copy: not used
    clock.t = 2
    got = port_metrics(by_key(src.collect()), "mlx4_0")
    assert got["ib_port_transmit_bytes_per_second"] == 2_500_000 * 4 / 2
    assert got["ib_port_receive_bytes_per_second"] == 500_000 * 4 / 2
    # port_xmit_wait reads 4294967295: a saturated 32-bit PMA counter, no rate
    assert "ib_port_transmit_wait_ticks_per_second" not in got
    assert "ib_port_transmit_wait_ratio" not in got


def test_gpud_h100_tree_without_trailing_newlines(tmp_path: Path) -> None:
    root = copy_tree(GPUD, tmp_path / "sys")
    clock = Clock()
    src = source(root, clock)
    got = by_key(src.collect())
    assert got[("ib_port_info", ("mlx5_0", "1", "InfiniBand", "MT4129", "28.41.1000"))] == 1
    assert got[("ib_port_info", ("mlx5_bond_0", "1", "Ethernet", "MT41692", "32.38.3056"))] == 1
    mlx5_1 = port_metrics(got, "mlx5_1")
    assert mlx5_1["ib_port_rate_bits_per_second"] == 400e9
    assert got[("ib_port_errors_total", ("mlx5_1", "1", "link_downed"))] == 255  # 8 bits, full
    assert got[("ib_port_errors_total", ("mlx5_1", "1", "port_rcv_errors"))] == 14
    assert got[("ib_port_errors_total", ("mlx5_1", "1", "port_rcv_switch_relay_errors"))] == 2
    assert got[("ib_port_errors_total", ("mlx5_0", "1", "excessive_buffer_overrun_errors"))] == 15
    errors = [labels for (name, labels) in got if name == "ib_port_errors_total"]
    assert len(errors) == 3 * len(ERROR_COUNTERS)  # hw_counters/ are not read
    assert port_metrics(got, "mlx5_bond_0")["ib_port_rate_bits_per_second"] == 200e9

    # one second later: traffic and waits from the deltas
    counters = root / "class/infiniband/mlx5_0/ports/1/counters"
    data = int((counters / "port_xmit_data").read_text())
    wait = int((counters / "port_xmit_wait").read_text())
    (counters / "port_xmit_data").write_text(str(data + 10**10 // 4))  # 10 GB, no newline
    (counters / "port_xmit_wait").write_text(str(wait + 625_000_000))
    clock.t = 1
    mlx5_0 = port_metrics(by_key(src.collect()), "mlx5_0")
    assert mlx5_0["ib_port_transmit_bytes_per_second"] == 1e10
    assert mlx5_0["ib_port_receive_bytes_per_second"] == 0
    assert mlx5_0["ib_port_transmit_wait_ticks_per_second"] == 625_000_000
    # 625e6 ticks x 8 bytes / 50e9 bytes/s (400 Gb/s) = 10 % of the time waiting
    assert mlx5_0["ib_port_transmit_wait_ratio"] == pytest.approx(0.1)


def test_hyper_v_port_with_unknown_physical_state_and_no_counters(tmp_path: Path) -> None:
    port = tmp_path / "sys/class/infiniband/mlx5_ib0/ports/1"
    port.mkdir(parents=True)
    for name in ("rate", "state", "phys_state"):
        shutil.copy(ENDURE / name, port / name)
    clock = Clock()
    src = source(tmp_path / "sys", clock)
    src.collect()
    clock.t = 5
    got = by_key(src.collect())
    assert port_metrics(got, "mlx5_ib0") == {
        "ib_port_state": 4,
        "ib_port_active": 1,
        "ib_port_physical_state": 0,  # "0: <unknown>": no physical_up series
        "ib_port_rate_bits_per_second": 5e9,
        "ib_port_rate_max_bits_per_second": 5e9,
        "ib_port_rate_degraded": 0,
    }
    assert got[("ib_port_info", ("mlx5_ib0", "1", "", "", ""))] == 1
    # counters appear later (the driver finished loading): they are picked up
    counters = port / "counters"
    counters.mkdir()
    (counters / "port_rcv_data").write_text("100\n")
    clock.t = 10
    src.collect()
    (counters / "port_rcv_data").write_text("350\n")
    clock.t = 15
    assert port_metrics(by_key(src.collect()), "mlx5_ib0")[
        "ib_port_receive_bytes_per_second"
    ] == pytest.approx(250 * 4 / 5)


def test_no_rdma_devices_is_no_series_but_no_sysfs_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "sys" / "class").mkdir(parents=True)
    assert source(tmp_path / "sys").collect() == []
    with pytest.raises(SourceError, match=r"nowhere/class does not exist"):
        source(tmp_path / "nowhere").collect()


def test_include_exclude_and_port_removal(tmp_path: Path) -> None:
    root = copy_tree(GPUD, tmp_path / "sys")
    clock = Clock()
    only_bond = source(root, clock, include="bond")
    no_bond = source(root, clock, exclude="bond")
    assert {s.labels[0] for s in only_bond.collect()} == {"mlx5_bond_0"}
    assert {s.labels[0] for s in no_bond.collect()} == {"mlx5_0", "mlx5_1"}
    shutil.rmtree(root / "class/infiniband/mlx5_1")
    clock.t = 5
    assert {s.labels[0] for s in no_bond.collect()} == {"mlx5_0"}


def test_cleared_counters_skip_one_interval(tmp_path: Path) -> None:
    root = copy_tree(GPUD, tmp_path / "sys")
    counters = root / "class/infiniband/mlx5_0/ports/1/counters"
    clock = Clock()
    src = source(root, clock, include="^mlx5_0$")
    src.collect()
    for t, value in ((1, 1000), (2, 3000)):  # perfquery -R cleared it, then it rises
        (counters / "port_rcv_data").write_text(f"{value}\n")
        clock.t = t
        got = port_metrics(by_key(src.collect()), "mlx5_0")
        if t == 1:
            assert "ib_port_receive_bytes_per_second" not in got
        else:
            assert got["ib_port_receive_bytes_per_second"] == 8000


def test_a_garbled_file_drops_its_series_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_tree(GPUD, tmp_path / "sys")
    (root / "class/infiniband/mlx5_0/ports/1/rate").write_text("\x00\x00garbage")
    src = source(root, include="^mlx5_0$")
    with caplog.at_level(logging.WARNING):
        first = port_metrics(by_key(src.collect()), "mlx5_0")
        src.collect()
    assert "ib_port_rate_bits_per_second" not in first
    assert first["ib_port_state"] == 4
    logged = [r.getMessage() for r in caplog.records if "unexpected content" in r.getMessage()]
    assert len(logged) == 1 and logged[0].endswith("its series are left out")
    assert "mlx5_0/ports/1/rate" in logged[0]


GARBAGE = st.one_of(
    st.binary(max_size=60),
    st.sampled_from(
        [b"", b"4: ACTIVE", b"0: <unknown>", b"N/A (no PMA)\n", b"4294967295", b"400 Gb/sec (4X"]
    ),
)


@settings(max_examples=60, deadline=None)
@given(
    files=st.dictionaries(
        st.sampled_from(
            [
                "state",
                "phys_state",
                "rate",
                "link_layer",
                "counters/port_xmit_data",
                "counters/port_rcv_data",
                "counters/port_xmit_wait",
                "counters/link_downed",
                "counters/symbol_error",
            ]
        ),
        GARBAGE,
        max_size=9,
    ),
    cut=st.integers(min_value=0, max_value=40),
)
def test_collect_on_garbled_and_truncated_files_never_crashes(
    files: dict[str, bytes], cut: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = copy_tree(GPUD / "class/infiniband/mlx5_1", Path(tmp) / "class/infiniband/x")
        port = root / "ports/1"
        clock = Clock()
        src = source(Path(tmp), clock)
        src.collect()
        for name, content in files.items():
            (port / name).write_bytes(content)
        (port / "counters/port_rcv_errors").write_bytes(
            (port / "counters/port_rcv_errors").read_bytes()[: cut % 3]
        )
        for t in (1, 1, 2):
            clock.t = t
            for sample in src.collect():
                assert sample.value == sample.value  # no NaN
                if sample.name.endswith("_ratio"):
                    assert 0 <= sample.value <= 1


# --- the simulator's tree ---------------------------------------------------------------


def scenario(ports: list[dict[str, Any]], phases: list[dict[str, Any]]) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "ib",
            "node": {"gpu_count": 0, "host": {"ib_ports": ports}},
            "phases": phases,
        }
    )


EIGHT_PORTS = [{"device": f"mlx5_{i}", "port": 1, "rate_gbps": 400} for i in range(8)]


def sim(tmp_path: Path, timeline: Timeline, **config: Any) -> tuple[Any, InfinibandSource, Clock]:
    clock = Clock()
    writer = InfinibandWriter(tmp_path / "sys", timeline)
    return writer, source(tmp_path / "sys", clock, **config), clock


def run(writer: InfinibandWriter, src: InfinibandSource, clock: Clock, t: float) -> dict:
    clock.t = t
    writer.write(t)
    return by_key(src.collect())


def test_simulated_port_at_200_on_a_400_hca_is_below_its_best(tmp_path: Path) -> None:
    tl = Timeline(
        scenario(
            EIGHT_PORTS,
            [
                {
                    "name": "degraded",
                    "duration": "10m",
                    "host": {"ib_ports": {"mlx5_3/1": {"rate_gbps": 200}}},
                }
            ],
        )
    )
    writer, configured, clock = sim(tmp_path, tl, expected_rates={"mlx5_*/1": 400})
    unconfigured = source(tmp_path / "sys", clock)
    got = run(writer, configured, clock, 0)
    port = port_metrics(got, "mlx5_3")
    assert port["ib_port_rate_bits_per_second"] == 200e9
    assert port["ib_port_rate_max_bits_per_second"] == 400e9
    assert port["ib_port_rate_degraded"] == 1
    assert port_metrics(got, "mlx5_2")["ib_port_rate_degraded"] == 0
    rate = (tmp_path / "sys/class/infiniband/mlx5_3/ports/1/rate").read_text()
    assert rate == "200 Gb/sec (2X NDR)\n"  # two of four lanes
    # without expected_rates a port degraded from the start cannot be told
    assert port_metrics(by_key(unconfigured.collect()), "mlx5_3")["ib_port_rate_degraded"] == 0


def test_simulated_link_drops_to_a_lower_rate_then_goes_down(tmp_path: Path) -> None:
    tl = Timeline(
        scenario(
            [{"device": "mlx5_0", "port": 1, "rate_gbps": 400}],
            [
                {"name": "ok", "duration": "1m"},
                {
                    "name": "slow",
                    "duration": "1m",
                    "host": {"ib_ports": {"mlx5_0/1": {"rate_gbps": 100}}},
                },
                {
                    "name": "down",
                    "duration": "1m",
                    "host": {"ib_ports": {"mlx5_0/1": {"state": "DOWN"}}},
                },
            ],
        )
    )
    writer, src, clock = sim(tmp_path, tl)
    assert port_metrics(run(writer, src, clock, 0), "mlx5_0")["ib_port_rate_degraded"] == 0
    slow = port_metrics(run(writer, src, clock, 60), "mlx5_0")
    assert slow["ib_port_rate_bits_per_second"] == 100e9
    assert slow["ib_port_rate_max_bits_per_second"] == 400e9  # the highest seen while active
    assert slow["ib_port_rate_degraded"] == 1
    down = port_metrics(run(writer, src, clock, 120), "mlx5_0")
    assert down["ib_port_state"] == 1
    assert down["ib_port_active"] == 0
    assert down["ib_port_physical_state"] == 2  # Polling
    assert down["ib_port_physical_up"] == 0
    assert "ib_port_rate_degraded" not in down
    port_dir = Path(writer.port_dir("mlx5_0/1"))
    assert (port_dir / "state").read_text() == "1: DOWN\n"
    assert (port_dir / "phys_state").read_text() == "2: Polling\n"
    assert (port_dir / "rate").read_text() == "10 Gb/sec (4X SDR)\n"


def test_simulated_traffic_waits_and_errors(tmp_path: Path) -> None:
    tl = Timeline(
        scenario(
            [
                {"device": "mlx5_0", "port": 1, "rate_gbps": 400},
                {"device": "mlx5_1", "port": 1, "rate_gbps": 200, "link_layer": "Ethernet"},
            ],
            [
                {
                    "name": "congested",
                    "duration": "10m",
                    "host": {
                        "ib_ports": {
                            "mlx5_0/1": {
                                "rx_mb_s": 40_000,
                                "tx_mb_s": 30_000,
                                "xmit_wait_ratio": 0.4,
                                "link_downed_total": 300,
                                "local_link_integrity_errors_total": 20,
                            },
                            "mlx5_1/1": {"tx_mb_s": 12_500, "xmit_wait_ratio": 0.05},
                        }
                    },
                    "host_ramp": {"ib_ports.mlx5_0/1.symbol_error_total": [0, 600],
                                  "ib_ports.mlx5_1/1.port_xmit_discards_total": [0, 1200]},
                }
            ],
        )
    )
    writer, src, clock = sim(tmp_path, tl)
    run(writer, src, clock, 0)
    got = run(writer, src, clock, 5)
    port = port_metrics(got, "mlx5_0")
    assert port["ib_port_receive_bytes_per_second"] == pytest.approx(40e9)
    assert port["ib_port_transmit_bytes_per_second"] == pytest.approx(30e9)
    assert port["ib_port_transmit_wait_ratio"] == pytest.approx(0.4)
    assert port["ib_port_transmit_wait_ticks_per_second"] == pytest.approx(0.4 * 50e9 / 8)
    assert got[("ib_port_errors_total", ("mlx5_0", "1", "link_downed"))] == 255  # saturated
    assert got[("ib_port_errors_total", ("mlx5_0", "1", "symbol_error"))] == 5
    # issue 39's format: integrity errors (4-bit: stops at 15) and transmit discards
    assert got[("ib_port_errors_total", ("mlx5_0", "1", "local_link_integrity_errors"))] == 15
    assert got[("ib_port_errors_total", ("mlx5_1", "1", "port_xmit_discards"))] == 10
    assert port_metrics(got, "mlx5_1")["ib_port_transmit_wait_ratio"] == pytest.approx(0.05)
    assert got[("ib_port_info", ("mlx5_1", "1", "Ethernet", "MT4123", "28.39.1002"))] == 1


def test_writer_rewrites_only_what_changed(tmp_path: Path) -> None:
    tl = Timeline(scenario(EIGHT_PORTS, [{"name": "idle", "duration": "1m"}]))
    writer = InfinibandWriter(tmp_path / "sys", tl)
    first = writer.write(0)
    assert first == 8 * (4 + 12 + 5) + 4 * 8  # per port: 4 attributes, 12 error and 5 data
    # counters; per HCA 4 attributes
    assert writer.write(5) == 0  # idle: nothing moves
    assert not list((tmp_path / "sys").rglob(".*.tmp"))


def test_writer_rate_strings_read_back() -> None:
    for gbps, best in ((400, 400), (200, 400), (100, 400), (56, 56), (40, 56), (2.5, 10)):
        parsed = parse_rate(rate_text(gbps, best))
        assert parsed is not None and parsed.gbps == gbps, (gbps, best)
    assert rate_text(200, 200) == "200 Gb/sec (4X HDR)"
    assert rate_text(800, 800) == "800 Gb/sec (4X XDR)"
    assert rate_text(300, 400) == "200 Gb/sec (2X NDR)"  # not expressible: the rate below
    assert hca_type(400) == "MT4129" and hca_type(100) == "MT4119"


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="greater than 0"):
        InfinibandConfig(expected_rates={"mlx5_0/1": 0})
    with pytest.raises(ValidationError, match="regular expression"):
        InfinibandConfig(exclude="[")
    with pytest.raises(ValidationError):
        InfinibandConfig(xmit_wait_bytes_per_tick=0)
    with pytest.raises(ValidationError):
        InfinibandConfig(ports=["mlx5_0"])  # type: ignore[call-arg]


def test_simulated_node_without_ib_ports_has_sys_class_but_no_infiniband(tmp_path: Path) -> None:
    writer, src, clock = sim(tmp_path, Timeline(scenario([], [{"name": "p", "duration": "1m"}])))
    assert run(writer, src, clock, 0) == {}  # no RDMA device: no series, and no error
    assert (tmp_path / "sys/class").is_dir()
    assert not (tmp_path / "sys/class/infiniband").exists()


def test_ports_serve_the_gpus_nearest_them_on_pcie(tmp_path: Path) -> None:
    """`ib_port_gpu_distance`: each GPU gets the ports at its smallest PCIe distance,
    from the kernel's view the simulator writes (the HCA's `device` link, the bridges
    above it, its root complex and NUMA node): behind the GPU's switch (0), the GPU's
    root complex (1), its NUMA node (2); an HCA shown without a PCI function serves no
    GPU, and without any placed HCA there is no series (the rules read every port)."""

    def distances(topology: str, ports: list[dict[str, Any]], gpus: int) -> dict[Key, float]:
        root = tmp_path / topology / str(len(ports))
        tl = Timeline(
            Scenario.model_validate(
                {
                    "name": "affinity",
                    "node": {
                        "gpu_count": gpus,
                        "numa_nodes": 2,
                        "pcie_topology": topology,
                        "host": {"ib_ports": ports},
                    },
                    "phases": [{"name": "p", "duration": "1m"}],
                }
            )
        )
        SysfsWriter(root, tl).write(0)
        InfinibandWriter(root, tl).write(0)
        got = by_key(source(root).collect())
        return {k: v for k, v in got.items() if k[0] == "ib_port_gpu_distance"}

    # HGX: 4 switches of 2 GPUs; a NIC beside GPUs 0 and 5, a storage NIC on NUMA node 1
    hgx = distances(
        "switched",
        [
            {"device": "mlx5_0", "beside_gpu": 0},
            {"device": "mlx5_1", "beside_gpu": 5},
            {"device": "mlx5_2", "numa_node": 1, "link_layer": "Ethernet"},
            {"device": "rxe0"},  # soft-RoCE: no PCI function
        ],
        8,
    )
    served = {(k[1][0], k[1][1]): v for k, v in hgx.items()}
    by_gpu: dict[str, set[str]] = {}
    for bus, device in served:
        by_gpu.setdefault(bus, set()).add(device)
    assert len(by_gpu) == 8  # every GPU is served
    gpu_buses = sorted(by_gpu)
    # GPUs 0-1 share mlx5_0's switch, 4-5 mlx5_1's: distance 0
    assert by_gpu[gpu_buses[0]] == by_gpu[gpu_buses[1]] == {"mlx5_0"}
    assert by_gpu[gpu_buses[4]] == by_gpu[gpu_buses[5]] == {"mlx5_1"}
    assert served[(gpu_buses[0], "mlx5_0")] == 0
    # GPUs 2-3 (NUMA 0) reach only mlx5_0 on their node; 6-7 (NUMA 1) both on node 1
    assert by_gpu[gpu_buses[2]] == {"mlx5_0"} and served[(gpu_buses[2], "mlx5_0")] == 2
    assert by_gpu[gpu_buses[6]] == {"mlx5_1", "mlx5_2"}
    assert not any(device == "rxe0" for _, device in served)
    # direct: a NIC beside GPU 1 shares its root complex (1); GPU 0 on the other node: 3
    direct = distances("direct", [{"device": "mlx5_0", "beside_gpu": 1}], 2)
    assert sorted(direct.values()) == [1.0, 3.0]
    # no HCA with a place: no series
    assert distances("switched", [{"device": "mlx5_0"}], 2) == {}
