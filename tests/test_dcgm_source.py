"""The DCGM source against the fake DCGM bindings, loaded the way real ones are.

Every test builds a simulated node's DCGM installation (`SimDcgm`: the fake bindings
under the node's root where DCGM installs them, and a host engine) and runs the real
source on it: bindings found and loaded through `find_bindings`/`load_bindings`,
connection through pydcgm.DcgmHandle. Time is virtual; nothing sleeps.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from dcgm_sim import Metrics, P, Sim, scenario, sims, state_of
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.config import ConfigError, SourcesConfig, load_config
from gpuwatchd.exporter import Exporter
from gpuwatchd.metrics import Sample
from gpuwatchd.scheduler import Poller
from gpuwatchd.sim import dcgm as simdcgm
from gpuwatchd.sim.dcgm import FAKE_BINDINGS
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sources.base import SourceError
from gpuwatchd.sources.dcgm import (
    BINDINGS_DIRS,
    COMPAT_DEFAULT_FIELDS,
    DEFAULT_FIELDS,
    FIELD_MAPS,
    DcgmConfig,
    DcgmUnavailable,
    compat_specs,
    find_bindings,
    load_bindings,
)
from gpuwatchd.store import Store

PROFILING_METRICS = {
    "gpu_gr_engine_active_ratio",
    "gpu_sm_active_ratio",
    "gpu_sm_occupancy_ratio",
    "gpu_tensor_active_ratio",
    "gpu_dram_active_ratio",
    "gpu_fp64_active_ratio",
    "gpu_fp32_active_ratio",
    "gpu_fp16_active_ratio",
    "gpu_dcgm_pcie_tx_bytes_per_second",
    "gpu_dcgm_pcie_rx_bytes_per_second",
    "gpu_nvlink_tx_bytes_per_second",
    "gpu_nvlink_rx_bytes_per_second",
}

# dcgm-exporter's etc/default-counters.csv (DCGM-Exporter 4.x): the enabled lines,
# field name -> type as declared there (DCGM_FI_DRIVER_VERSION is a label, and
# DCGM_FI_DEV_VGPU_LICENSE_STATUS only exists on vGPU hosts).
DCGM_EXPORTER_DEFAULTS = {
    "DCGM_FI_DEV_SM_CLOCK": "gauge",
    "DCGM_FI_DEV_MEM_CLOCK": "gauge",
    "DCGM_FI_DEV_MEMORY_TEMP": "gauge",
    "DCGM_FI_DEV_GPU_TEMP": "gauge",
    "DCGM_FI_DEV_POWER_USAGE": "gauge",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "counter",
    "DCGM_FI_DEV_GPU_UTIL": "gauge",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "gauge",
    "DCGM_FI_DEV_ENC_UTIL": "gauge",
    "DCGM_FI_DEV_DEC_UTIL": "gauge",
    "DCGM_FI_DEV_XID_ERRORS": "gauge",
    "DCGM_FI_DEV_FB_FREE": "gauge",
    "DCGM_FI_DEV_FB_USED": "gauge",
    "DCGM_FI_DEV_FB_RESERVED": "gauge",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "counter",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gauge",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "gauge",
    "DCGM_FI_PROF_DRAM_ACTIVE": "gauge",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "gauge",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "gauge",
}


@pytest.fixture
def make(tmp_path: Path):
    yield from sims(tmp_path)


# -- connected --------------------------------------------------------------------------------


def test_values_in_base_units_with_gpu_and_uuid_first(make):
    sim = make()
    m = sim.collect()
    assert m.state() == "connected"
    uuid0 = gpu_uuid("node7", 0)
    assert (P + "gpu_sm_active_ratio", ("0", uuid0), 0.7) in m.samples
    assert m.value("gpu_tensor_active_ratio", 1) == 0.4
    assert m.value("gpu_dram_active_ratio", 0) == 0.3
    assert m.value("gpu_gr_engine_active_ratio", 0) == 0.92
    assert m.value("gpu_nvlink_tx_bytes_per_second", 0) == 5e9
    assert m.value("gpu_nvlink_rx_bytes_per_second", 0) == 6e9
    assert m.value("gpu_dcgm_pcie_rx_bytes_per_second", 0) == 2e9
    assert m.value("gpu_dcgm_power_watts", 0) == 300.0
    assert m.value("gpu_dcgm_energy_joules_total", 0) == pytest.approx(300 * 10)  # J, not mJ
    assert m.value("gpu_dcgm_clock_violation_seconds_total", 0, "power") == 0.0
    assert m.value("gpu_dcgm_nvlink_errors_total", 0, "crc_flit") == 0.0
    assert m.value("gpu_dcgm_remapped_rows_total", 0, "uncorrectable") == 0.0
    assert m.value("gpu_dcgm_last_xid", 0) == 0.0
    assert m.profiling(0) == "active" and m.profiling(1) == "active"
    assert m.by_name[P + "dcgm_info"] == {("4.2.3",): 1.0}
    for name, labels, _ in m.samples:
        if name.startswith(P + "gpu_"):
            assert labels[:2] in {("0", uuid0), ("1", gpu_uuid("node7", 1))}, name
    declared = {spec.name for spec in sim.source.metrics}
    assert {name for name, _, _ in m.samples} <= declared


def test_dcgm_s_own_pcie_bytes_may_differ_from_nvml_s(make):
    """Issue 39's format: DCGM's PCIe bytes (1009/1010, headers included) as the scenario
    gives them, apart from NVML's payload rate (200/201 and the NVML fields)."""
    run = {"name": "run", "duration": 3600,
           "set": {"utilization_gpu": 100, "pcie_tx_mb_s": 2, "pcie_rx_mb_s": 2}}
    own = {**run, "set": {**run["set"], "dcgm_pcie_tx_mb_s": 11, "dcgm_pcie_rx_mb_s": 9}}
    m = make(scenario([own])).collect()
    assert m.value("gpu_dcgm_pcie_tx_bytes_per_second", 0) == 11e6
    assert m.value("gpu_dcgm_pcie_rx_bytes_per_second", 0) == 9e6
    m = make(scenario([run])).collect()  # not given: DCGM shows NVML's rate
    assert m.value("gpu_dcgm_pcie_tx_bytes_per_second", 0) == 2e6


def test_the_default_fields_are_the_issues(make):
    assert set(DEFAULT_FIELDS) == {
        *range(1001, 1013),
        155,
        156,
        202,
        230,
        *range(240, 246),
        409,
        419,
        429,
        439,
        393,
        394,
    }
    sim = make()
    sim.collect()
    watched = sim.engine.field_groups()
    pid = os.getpid()
    assert sorted(watched[f"gpuwatchd_{pid}_prof0"]) == list(range(1001, 1013))
    device = set(DEFAULT_FIELDS) - set(range(1001, 1013))
    assert set(watched[f"gpuwatchd_{pid}"]) == {52, *device}  # and the NVML index, for labels


def test_configured_fields_and_unknown_ones_raw(make):
    sim = make(fields=[1002, 190, 155])
    m = sim.collect()
    assert m.names() >= {"gpu_sm_active_ratio", "gpu_dcgm_power_watts"}
    assert "gpu_tensor_active_ratio" not in m.names()
    assert m.value("gpu_dcgm_field_value", 0, "190") == 8.0  # pstate, as DCGM reports it


def test_collecting_does_not_change_sys_path_or_modules(make):
    path, modules = list(sys.path), set(sys.modules)
    sim = make()
    sim.collect()
    assert sys.path == path
    assert not {"pydcgm", "dcgm_structs", "dcgm_agent", "_sim"} & set(sys.modules)
    assert not {m for m in set(sys.modules) - modules if not m.startswith("gpuwatchd")}


def test_groups_are_named_with_the_pid_beside_another_client(make):
    sim = make()
    # a dcgm-exporter on the same host engine, and a stale group of ours from before
    b = load_bindings(FAKE_BINDINGS)
    exporter = b.pydcgm.DcgmHandle(ipAddress=sim.engine.address)
    b.pydcgm.DcgmFieldGroup(exporter, "dcgm-exporter-fields", [155, 1001])
    stale = f"gpuwatchd_{os.getpid()}"
    b.pydcgm.DcgmFieldGroup(exporter, stale, [150])
    m = sim.collect()
    assert m.state() == "connected"
    groups = sim.engine.field_groups()
    assert groups["dcgm-exporter-fields"] == [155, 1001]
    assert 155 in groups[stale]  # ours replaced the stale one of the same name
    exporter.Shutdown()


# -- not installed ----------------------------------------------------------------------------


def test_no_dcgm_installed(make, caplog):
    sim = make(scenario(dcgm="none"))
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    error = sim.down()
    assert issubclass(DcgmUnavailable, SourceError) and state_of(error) == "not_installed"
    assert "datacenter-gpu-manager-4/bindings/python3" in str(error)
    assert "usr/local/dcgm/bindings/python3" in str(error)
    for _ in range(5):
        sim.advance(3600)
        assert state_of(sim.down()) == "not_installed"
    assert len([r for r in caplog.records if "not installed" in r.message]) == 1


def test_bindings_but_no_libdcgm(make):
    sim = make()
    with simdcgm.library_missing():
        error = sim.down()
    assert state_of(error) == "not_installed" and "libdcgm" in str(error)


def test_configured_bindings_path_wins(make, tmp_path: Path):
    sim = make(scenario(dcgm="none"), bindings_path=FAKE_BINDINGS)
    sim.source._hostengine = "localhost"  # no simulated host engine: nothing listens
    assert state_of(sim.down()) == "hostengine_down"
    assert find_bindings(tmp_path / "nope")[0] is None
    found, looked = find_bindings(None, tmp_path / "node0")
    assert found is None and looked == [tmp_path / "node0" / d for d in BINDINGS_DIRS]


def test_dcgm_3_layout_is_found(make):
    sim = make(scenario(dcgm="3"))
    m = sim.collect()
    assert m.state() == "connected" and m.by_name[P + "dcgm_info"] == {("3.3.9",): 1.0}
    assert sim.source._bindings is not None
    assert sim.source._bindings.directory.parts[-4:] == ("local", "dcgm", "bindings", "python3")


# -- host engine down, lost, back ---------------------------------------------------------------


def test_hostengine_down_backs_off_without_touching_dcgm(make, caplog):
    sim = make(interval=5.0, reconnect_backoff_max=60.0)
    sim.engine.stop()
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    attempts = []
    for _ in range(40):  # a poll every 5 s for 200 s
        before = sim.engine.calls["dcgmConnect"]
        error = sim.down()
        assert state_of(error) == "hostengine_down"
        if sim.engine.calls["dcgmConnect"] > before:
            attempts.append(sim.clock.elapsed())
        sim.advance(5)
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[:4] == [5, 10, 20, 40] and set(gaps[4:]) == {60}
    assert len([r for r in caplog.records if "hostengine down" in r.message]) == 1
    assert sim.engine.connect_timeouts_ms[0] == 2000  # connect_timeout
    sim.engine.start()
    sim.advance(60)
    assert sim.collect().state() == "connected"
    assert any("connected" in r.message for r in caplog.records)


def test_connection_lost_mid_run_then_reconnect_on_a_restarted_hostengine(make, caplog):
    scn = scenario(
        [
            {"name": "up", "duration": 60, "set": {"sm_active": 0.7}},
            {"name": "down", "duration": 40, "host": {"dcgm_hostengine_up": False}},
            {"name": "back", "duration": 600, "host": {"dcgm_hostengine_up": True}},
        ]
    )
    sim = make(scn, at=0.0)
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    states = []
    for _ in range(40):  # 200 s, a poll every 5 s
        try:
            m = sim.collect()
            states.append(m.state())
            losses = m.by_name[P + "dcgm_connection_losses_total"][()]
        except DcgmUnavailable as e:
            states.append(state_of(e))
        sim.advance(5)
    compressed = [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]
    assert compressed == ["connected", "connection_lost", "hostengine_down", "connected"]
    assert losses == 1
    # the new host engine has our groups and watches again, and values flow
    assert f"gpuwatchd_{os.getpid()}_prof0" in sim.engine.groups()
    assert sim.collect().value("gpu_sm_active_ratio", 0) == 0.7
    messages = [r.message for r in caplog.records]
    assert sum("connection lost" in msg for msg in messages) == 1
    assert sum("hostengine down" in msg for msg in messages) == 1


def test_a_quick_restart_reconnects_on_the_next_poll(make):
    sim = make()
    assert sim.collect().state() == "connected"
    sim.engine.restart()
    assert state_of(sim.down()) == "connection_lost"
    m = sim.collect()
    assert m.state() == "connected" and m.value("gpu_sm_active_ratio", 1) == 0.7


def test_the_hostengine_restart_scenario(make):
    sim = make("dcgm-hostengine-restart", at=0.0)
    seen = []
    for _ in range(int(22 * 60 / 5)):
        try:
            seen.append(sim.collect().state())
        except DcgmUnavailable as e:
            seen.append(state_of(e))
        sim.advance(5)
    assert seen[0] == "connected" and seen[-1] == "connected"
    assert {"connection_lost", "hostengine_down"} <= set(seen)
    assert seen.count("connection_lost") == 1


def test_unavailable_carries_the_state_through_the_poller(make):
    sim = make()
    sim.engine.stop()
    store = Store()
    poller = Poller(sim.source, store, sim.clock.now)
    poller.poll()
    assert poller.health.up is False and "hostengine_down" in (poller.health.last_error or "")
    stored = store.get(P + "dcgm_state", ("hostengine_down",))
    if stored is None:
        pytest.skip("the scheduler does not store a SourceError's samples yet (see docs/dcgm.md)")
    assert stored == 1.0 and store.get(P + "dcgm_state", ("connected",)) == 0.0


# -- profiling ----------------------------------------------------------------------------------


def test_consumer_gpus_have_no_profiling_but_device_fields(make, caplog):
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    sim = make("consumer-gpu-no-profiling")
    m = sim.collect()
    assert m.state() == "connected"
    assert not PROFILING_METRICS & m.names()
    assert m.value("gpu_dcgm_power_watts", 3) == 410.0
    assert all(m.profiling(gpu) == "unsupported" for gpu in range(4))
    assert "gpu_dcgm_remapped_rows_total" not in m.names()  # GeForce: not supported, absent
    sim.advance(5)
    sim.collect()
    unsupported = [r for r in caplog.records if "profiling unsupported" in r.message]
    assert len(unsupported) == 1 and "GPUs [0-3]" in unsupported[0].message
    assert "DCGM_ST_PROFILING_NOT_SUPPORTED" in unsupported[0].message
    assert not [g for g in sim.engine.groups() if "_prof" in g]


def test_no_metric_groups_counts_as_unsupported(make):
    sim = make(scenario(gpu_model="rtx-4090"))
    sim.engine.unsupported_profiling = "empty"
    m = sim.collect()
    assert m.profiling(0) == "unsupported" and "gpu_dcgm_power_watts" in m.names()


def test_l40s_watches_the_profiling_fields_it_has(make):
    m = make(scenario(gpu_model="l40s")).collect()
    assert m.profiling(0) == "active"
    assert "gpu_sm_active_ratio" in m.names()
    assert "gpu_nvlink_tx_bytes_per_second" not in m.names()


def test_refused_profiling_is_retried(make):
    sim = make(profiling_retry=60.0)
    sim.engine.hold_profiling()
    m = sim.collect()
    assert m.state() == "connected" and m.profiling(0) == "refused"
    assert "gpu_dcgm_power_watts" in m.names() and not PROFILING_METRICS & m.names()
    sim.engine.hold_profiling(False)
    sim.advance(30)
    assert sim.collect().profiling(0) == "refused"
    sim.advance(30)
    m = sim.collect()
    assert m.profiling(0) == "active" and m.value("gpu_sm_active_ratio", 0) == 0.7


def test_blank_values_are_absent_never_numbers(make):
    sim = make()
    engine = sim.engine
    engine.set_value(1002, simdcgm.FP64_BLANK, gpu=0)
    engine.set_value(1004, simdcgm.FP64_BLANK + simdcgm.NOT_FOUND, gpu=0)
    engine.set_value(155, simdcgm.FP64_BLANK + simdcgm.NOT_SUPPORTED, gpu=0)
    engine.set_value(156, simdcgm.INT64_BLANK + simdcgm.NOT_PERMISSIONED, gpu=0)
    engine.set_value(1011, simdcgm.INT64_BLANK, gpu=0)
    m = sim.collect()
    gpu0 = {name for name, labels, _ in m.samples if labels[:1] == ("0",)}
    for name in (
        "gpu_sm_active_ratio",
        "gpu_tensor_active_ratio",
        "gpu_dcgm_power_watts",
        "gpu_dcgm_energy_joules_total",
        "gpu_nvlink_tx_bytes_per_second",
    ):
        assert P + name not in gpu0
        assert m.value(name, 1) >= 0  # the other GPU still has it
    assert P + "gpu_dram_active_ratio" in gpu0
    assert all(v < 1e12 for _, _, v in m.samples)


def test_pause_profiling_then_resume_automatically(make):
    sim = make(max_profiling_pause=600.0)
    sim.collect()
    result = sim.source.pause_profiling(30)
    assert result == {"paused": True, "seconds": 30.0, "applied": True, "state": "connected"}
    assert sim.engine.profiling_paused
    m = sim.collect()
    assert not PROFILING_METRICS & m.names() and "gpu_dcgm_power_watts" in m.names()
    assert m.profiling(0) == "paused"
    assert m.by_name[P + "dcgm_profiling_pause_remaining_seconds"][()] == 30.0
    sim.advance(29)
    sim.collect()
    assert sim.engine.profiling_paused
    sim.advance(1)
    m = sim.collect()
    assert not sim.engine.profiling_paused and m.profiling(0) == "active"
    assert m.value("gpu_sm_active_ratio", 0) == 0.7
    assert m.by_name[P + "dcgm_profiling_pause_remaining_seconds"][()] == 0.0
    assert sim.source.pause_profiling(10**6)["seconds"] == 600.0  # bounded
    sim.source.resume_profiling()
    assert not sim.engine.profiling_paused


def test_a_pause_requested_while_down_applies_on_connect_and_survives_restarts(make):
    sim = make()
    sim.engine.stop()
    sim.down()
    assert sim.source.pause_profiling(120)["applied"] is False
    sim.engine.start()
    sim.advance(10)
    assert sim.collect().profiling(0) == "paused" and sim.engine.profiling_paused
    sim.engine.restart()  # the new host engine is not paused
    sim.down()
    assert sim.collect().profiling(1) == "paused" and sim.engine.profiling_paused
    sim.source.close()  # closing gives the counters back
    assert not sim.engine.profiling_paused


def test_pause_is_a_no_op_on_gpm_gpus(make, caplog):
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    sim = make(scenario(gpu_model="h100-sxm5-80gb"))
    sim.collect()
    sim.source.pause_profiling(60)
    m = sim.collect()
    assert m.profiling(0) == "active" and "gpu_sm_active_ratio" in m.names()
    assert any("GPM" in r.message for r in caplog.records)


# -- dcgm-exporter compatibility ------------------------------------------------------------------


def exposition(sim: Sim, samples: list[Sample]) -> dict[str, Any]:
    store = Store()
    store.register_source("dcgm", float("inf"))
    store.update("dcgm", 0.0, samples)
    text = Exporter(store, [], sim.source.metrics, lambda: 0.0).render().text.decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_compat_names_labels_and_units_match_dcgm_exporter_defaults(make):
    sim = make("healthy-8gpu", exporter_compat=True)
    samples = sim.source.collect()
    families = exposition(sim, samples)
    compat = {name: f for name, f in families.items() if name.startswith("DCGM_FI_")}
    assert set(DCGM_EXPORTER_DEFAULTS) <= set(compat)
    for name in compat:
        assert compat[name].type == "gauge"  # see compat_specs: names kept, no _total
    gpu3 = {f.name: s for f in compat.values() for s in f.samples if s.labels["gpu"] == "3"}
    labels = gpu3["DCGM_FI_DEV_GPU_UTIL"].labels
    assert labels == {
        "gpu": "3",
        "UUID": gpu_uuid("sim-hgx-a100", 3),
        "pci_bus_id": labels["pci_bus_id"],
        "device": "nvidia3",
        "modelName": "NVIDIA A100-SXM4-80GB",
        # dcgm-exporter's MIG labels, empty on a whole GPU: to Prometheus no label at all
        "GPU_I_PROFILE": "",
        "GPU_I_ID": "",
        "Hostname": "sim-hgx-a100",
        "DCGM_FI_DRIVER_VERSION": "555.42.06",
    }
    assert labels["pci_bus_id"].startswith("00000000:") and labels["pci_bus_id"].endswith(":00.0")
    # DCGM's raw units, as dcgm-exporter passes them on
    assert gpu3["DCGM_FI_DEV_GPU_UTIL"].value == 95  # percent
    assert gpu3["DCGM_FI_DEV_POWER_USAGE"].value == 335.0  # W
    assert gpu3["DCGM_FI_DEV_FB_USED"].value == 71680  # MiB
    assert gpu3["DCGM_FI_DEV_SM_CLOCK"].value == 1410  # MHz
    assert gpu3["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].value == 335 * 10 * 1000  # mJ
    assert gpu3["DCGM_FI_PROF_PCIE_RX_BYTES"].value == 9.5e9  # bytes per second
    assert gpu3["DCGM_FI_PROF_SM_ACTIVE"].value == 0.8  # a configured field with a name
    xid = gpu3["DCGM_FI_DEV_XID_ERRORS"]
    assert xid.value == 0 and (xid.labels["err_code"], xid.labels["err_msg"]) == ("0", "No Error")
    # and gpuwatchd's own names are there too
    assert families[P + "gpu_sm_active_ratio"].samples


def test_compat_hostname_label_and_xid_messages(make):
    scn = scenario([{"name": "x", "duration": 60, "gpus": [1], "set": {"xid": [79]}}])
    sim = make(scn, exporter_compat=True, compat_hostname_label="hostname")
    families = exposition(sim, sim.source.collect())
    xid = {s.labels["gpu"]: s for s in families["DCGM_FI_DEV_XID_ERRORS"].samples}
    assert xid["1"].value == 79 and xid["1"].labels["err_msg"] == "GPU has fallen off the bus"
    assert xid["1"].labels["hostname"] == "node7" and "Hostname" not in xid["1"].labels
    sim.engine.inject_xid(0, 999)
    families = exposition(sim, sim.source.collect())
    xid = {s.labels["gpu"]: s for s in families["DCGM_FI_DEV_XID_ERRORS"].samples}
    assert (xid["0"].labels["err_code"], xid["0"].labels["err_msg"]) == ("999", "Unknown Error")


def test_compat_watches_dcgm_exporters_defaults_only_when_asked(make):
    plain = make()
    plain.collect()
    compat = make(exporter_compat=True)
    compat.collect()
    pid = os.getpid()
    assert 203 not in plain.engine.field_groups()[f"gpuwatchd_{pid}"]
    assert set(COMPAT_DEFAULT_FIELDS) - set(range(1001, 1013)) <= set(
        compat.engine.field_groups()[f"gpuwatchd_{pid}"]
    )
    assert not [n for n, _, _ in plain.source.collect() if n.startswith("DCGM_FI_")]
    assert {spec.name for spec in compat_specs()} == {m.compat for m in FIELD_MAPS.values()}
    assert "gpu_dcgm_utilization_ratio" not in Metrics(compat.source.collect()).names()


# -- configuration ------------------------------------------------------------------------------


def test_config_validation():
    assert DcgmConfig().hostengine == "localhost"
    assert DcgmConfig(fields=[155, 155, 1002]).fields == [155, 1002]
    for bad in (
        {"fields": [0]},
        {"fields": ["x"]},
        {"hostengine": ""},
        {"hostengine": "unix://relative.sock"},
        {"connect_timeout": 5, "timeout": 5},
        {"colour": "blue"},
    ):
        with pytest.raises(ValueError):
            DcgmConfig(**bad)
    assert DcgmConfig(hostengine="unix:///run/dcgm.sock").hostengine == "unix:///run/dcgm.sock"


def test_embedded_mode(make):
    sim = make(hostengine="embedded")
    sim.source._hostengine = "embedded"  # the simulated node names its host engine
    assert state_of(sim.down()) == "error"
    simdcgm.use_for_embedded(sim.engine)
    try:
        sim.advance(3600)
        assert sim.collect().state() == "connected"
    finally:
        simdcgm.use_for_embedded(None)


# -- reading: one dcgmEntitiesGetLatestValues call per watch ----------------------------------


def polls(sim: Sim, count: int = 3) -> list[list[Sample]]:
    out = []
    for _ in range(count):
        out.append(sim.source.collect())
        sim.advance(5)
    return out


def test_each_watch_is_read_in_one_call_without_callbacks(make):
    sim = make("healthy-8gpu", exporter_compat=True)
    sim.collect()  # connects; reads the NVML indices with one live call
    calls = sim.engine.calls
    before = calls["dcgmEntitiesGetLatestValues"]
    polls(sim, 4)
    assert calls["dcgmEntitiesGetLatestValues"] - before == 4 * 2  # device, profiling
    assert calls["dcgmGetLatestValues_v2"] == 0


@pytest.mark.parametrize("compat", [False, True])
def test_a_libdcgm_without_the_bulk_call_reads_through_callbacks_alike(make, caplog, compat):
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    scn = scenario([{"name": "x", "duration": 600, "gpus": [1], "set": {"xid": [79]}}])
    runs = []
    for without in ((), ("dcgmEntitiesGetLatestValues",)):
        with simdcgm.library_without(*without):
            sim = make(scn, exporter_compat=compat)
            sim.engine.set_value(1002, simdcgm.FP64_BLANK, gpu=0)
            sim.engine.set_value(155, "n/a", gpu=1)
            runs.append(polls(sim, 3))
            sim.engine.restart()  # a new session keeps what the library lacks
            sim.down()
            runs.append(polls(sim, 2))
    assert runs[:2] == runs[2:]
    older = sim
    assert older.engine.calls["dcgmGetLatestValues_v2"] == 5 * 2 + 1  # + the one refused
    assert older.engine.calls["dcgmEntitiesGetLatestValues"] == 0
    fallback = [r.getMessage() for r in caplog.records if "instead" in r.getMessage()]
    assert len(fallback) == 1 and "DCGM_ST_FUNCTION_NOT_FOUND" in fallback[0]


def test_a_nan_is_a_value_through_either_read(make):
    # pydcgm's DCGM_FP64_IS_BLANK is `value >= DCGM_FP64_BLANK`: a NaN is a value, not blank
    for without in ((), ("dcgmEntitiesGetLatestValues",)):
        with simdcgm.library_without(*without):
            sim = make()
            sim.engine.set_value(1002, math.nan, gpu=1)
            m = sim.collect()
            assert math.isnan(m.value("gpu_sm_active_ratio", 1))
            assert m.value("gpu_sm_active_ratio", 0) == 0.7


def test_text_blanks_are_absent_without_a_warning(make, caplog):
    caplog.set_level(logging.WARNING, "gpuwatchd.sources.dcgm")
    sim = make()
    sim.engine.set_value(155, "<<<NOT_SUPPORTED>>>", gpu=0)  # a text field's blank sentinel
    m = sim.collect()
    assert {labels[0] for labels in m.by_name[P + "gpu_dcgm_power_watts"]} == {"1"}
    assert not caplog.records


def lost_at_20s() -> Any:
    """Two GPUs; GPU 1 falls off the bus 20 s in (DCGM: its values' status GPU_IS_LOST)."""
    run = scenario().model_dump(mode="json", exclude_defaults=True)["phases"][0]
    lost = {"name": "lost", "duration": 600, "changes": [{"gpus": [1], "set": {"lost": True}}]}
    return scenario([{**run, "duration": 20}, {**lost, "set": run["set"]}])


@pytest.mark.parametrize("compat", [False, True])
def test_odd_values_read_in_bulk_as_one_by_one(make, compat):
    # the bulk read (numbers in columns, samples made in one pass) against the fallback's
    # value-by-value decoding: blanks of either type, NaN, infinities, ints past 2**53,
    # an Xid (dcgm-exporter's labels), and GPU 1 lost 20 s in
    odd = {
        (0, 1002): math.nan,
        (0, 1003): math.inf,  # at or above DCGM_FP64_BLANK: blank
        (0, 1004): -math.inf,
        (0, 155): simdcgm.FP64_BLANK - 1,
        (0, 156): simdcgm.INT64_BLANK - 1,
        (0, 202): 2**53 + 1,
        (0, 1009): simdcgm.INT64_BLANK + 3,
        (0, 240): -7,
        (1, 1005): simdcgm.FP64_BLANK,
        (1, 230): 43,
    }
    runs = []
    for without in ((), ("dcgmEntitiesGetLatestValues",)):
        with simdcgm.library_without(*without):
            sim = make(lost_at_20s(), exporter_compat=compat)
            for (gpu, field), value in odd.items():
                sim.engine.set_value(field, value, gpu=gpu)
            runs.append(polls(sim, 6))
    assert repr(runs[0]) == repr(runs[1])  # a NaN is not equal to itself
    first, last = Metrics(runs[0][0]), Metrics(runs[0][-1])
    assert math.isnan(first.value("gpu_sm_active_ratio", 0))
    assert first.value("gpu_dcgm_energy_joules_total", 0) == (simdcgm.INT64_BLANK - 1) * 0.001
    assert first.value("gpu_dcgm_pcie_replay_errors_total", 0) == float(2**53 + 1)
    assert 0 not in {int(labels[0]) for labels in first.by_name[P + "gpu_sm_occupancy_ratio"]}
    assert {labels[0] for labels in last.by_name[P + "gpu_dcgm_power_watts"]} == {"0"}


def test_a_watch_read_as_before_keeps_what_its_values_become(make):
    sim = make(lost_at_20s())
    sim.collect()
    device = sim.source._session.watches[0]
    made = device.made
    sim.advance(5)
    sim.engine.set_value(155, simdcgm.FP64_BLANK, gpu=0)
    m = sim.collect()
    assert device.made is made  # a blank is a value: the records read as before
    assert {labels[0] for labels in m.by_name[P + "gpu_dcgm_power_watts"]} == {"1"}
    sim.engine.clear_values()
    sim.advance(10)
    m = sim.collect()  # GPU 1's values now answer DCGM_ST_GPU_IS_LOST
    assert device.made is not made
    assert {labels[0] for labels in m.by_name[P + "gpu_dcgm_power_watts"]} == {"0"}


def test_our_group_removed_by_another_client_means_setting_up_again(make):
    sim = make(interval=5.0)
    assert sim.collect().state() == "connected"
    other = load_bindings(FAKE_BINDINGS)
    handle = other.pydcgm.DcgmHandle(ipAddress=sim.engine.address)
    for group_id in other.agent.dcgmGroupGetAllIds(handle.handle):
        if other.agent.dcgmGroupGetInfo(handle.handle, group_id).groupName.endswith("_prof0"):
            other.agent.dcgmGroupDestroy(handle.handle, group_id)  # and so our watch
    error = sim.down()  # every value NOT_WATCHED: our watch is gone
    assert state_of(error) == "error" and "DCGM_ST_NOT_WATCHED" in str(error)
    sim.advance(5)
    m = sim.collect()
    assert m.state() == "connected" and m.value("gpu_sm_active_ratio", 0) == 0.7
    handle.Shutdown()


def test_two_runs_give_the_same_samples(make):
    runs = []
    for _ in range(2):
        sim = make("healthy-8gpu", exporter_compat=True)
        polls = []
        for _ in range(3):
            polls.append(sim.source.collect())
            sim.advance(5)
        runs.append(polls)
    assert runs[0] == runs[1]


# -- wiring (active once `dcgm` is in SourcesConfig, sources/__init__ and SimNode) ---------------

wired = pytest.mark.skipif(
    "dcgm" not in SourcesConfig.model_fields, reason="sources.dcgm is not wired into config.py yet"
)


@wired
def test_config_file_and_simulation_end_to_end(tmp_path: Path):
    from gpuwatchd.simulate import Simulation

    cfg = tmp_path / "gpuwatchd.yaml"
    cfg.write_text("sources:\n  dcgm:\n    exporter_compat: true\n    fields: [1002, 155]\n")
    config = load_config(cfg)
    simulation = Simulation(load_scenario("dcgm-hostengine-restart"), config)
    try:
        result = simulation.run(until=300)
        text = result.exposition.decode()
        assert 'gpuwatchd_source_up{source="dcgm"} 1.0' in text
        assert "gpuwatchd_gpu_sm_active_ratio{" in text and "DCGM_FI_PROF_SM_ACTIVE{" in text
        simulation.run(until=11 * 60)
        text = simulation.pipeline.exporter.render().text.decode()
        assert 'gpuwatchd_source_up{source="dcgm"} 0.0' in text
    finally:
        simulation.close()
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  dcgm:\n    hostengin: localhost\n")
    with pytest.raises(ConfigError, match="sources.dcgm.hostengin: unknown key"):
        load_config(bad)
