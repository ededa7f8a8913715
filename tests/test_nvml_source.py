"""The NVML source against the fake libnvidia-ml (under the real pynvml), and without one."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest
from series import Metrics as SampleIndex

from gpuwatchd.config import NvmlConfig
from gpuwatchd.scheduler import Poller
from gpuwatchd.sim import fake_nvml_device
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import gpu_uuid, make_pynvml
from gpuwatchd.sim.scenario import CLOCK_EVENT_REASONS, Scenario, Timeline, load_scenario
from gpuwatchd.sources import REGISTRY, load_builtin_sources
from gpuwatchd.sources.base import Context, SourceError
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.nvml import source as nvml_source
from gpuwatchd.sources.nvml.metrics import CLOCK_REASONS
from gpuwatchd.sources.nvml.plans import ReadPlan
from gpuwatchd.sources.nvml.reads import NVLINK_STATE, SLOW_EVERY
from gpuwatchd.sources.nvmlapi import (
    Direct,
    FieldValues,
    ProcessTable,
    cuda_version_string,
    sysfs_bus_id,
)
from gpuwatchd.store import Store

MIB = 2**20
WAIT = 10.0  # bound on every real-time wait in these tests
P = "gpuwatchd_"


def scenario(phases: list[dict[str, Any]], **node: Any) -> Scenario:
    node = {"gpu_count": 2, "pcie_topology": "direct", **node}
    return Scenario.model_validate({"name": "t", "node": node, "phases": phases})


class Sim:
    """A fake node at virtual time, and an NVML source reading it."""

    def __init__(
        self, scn: Scenario | str, at: float = 0.0, virtual_wait: bool = True, **options: Any
    ) -> None:
        self.timeline = Timeline(load_scenario(scn) if isinstance(scn, str) else scn)
        self.clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
        self.clock.advance(at)
        self.nv = make_pynvml(self.timeline, self.clock, **options)
        self.fake = self.nv._gpuwatchd_fake
        extras: dict[str, Any] = {"now": self.clock.now, "clock": self.clock.elapsed}
        # as the simulator: the poll waits for the reader to finish or to block on a hung
        # GPU, never on a real-time deadline a loaded machine can miss (a first poll of
        # 8 GPUs outlasted the patience once: a flaky "hung" GPU)
        if virtual_wait:
            extras["nvml_wait"] = self.fake.wait_for
        self.context = Context(pynvml=self.nv, extras=extras)
        self.source = NvmlSource(NvmlConfig(), self.context)

    def advance(self, seconds: float) -> None:
        """Move the clock, and let calls blocked on a hung GPU see it (as a step does)."""
        self.clock.advance(seconds)
        self.fake.settle()

    def collect(self) -> Metrics:
        return Metrics(self.source.collect())

    def polls(self, n: int, step: float = 1.0) -> Metrics:
        """`n` polls `step` seconds apart; the last one's samples."""
        for _ in range(n - 1):
            self.collect()
            self.clock.advance(step)
        return self.collect()

    def slow_read_after(self, seconds: float) -> Metrics:
        """SLOW_EVERY polls over `seconds` after a poll that read the SLOW fields (the
        first, or one of these): the last reads them again (a rate needs two readings)."""
        for _ in range(SLOW_EVERY - 1):
            self.clock.advance(seconds / SLOW_EVERY)
            self.collect()
        self.clock.advance(seconds / SLOW_EVERY)
        return self.collect()


class Metrics(SampleIndex):
    """Samples by name, then by labels (gpu, uuid, extra...)."""

    def gpu(self, name: str, gpu: int) -> dict[tuple[str, ...], float]:
        """Series of `name` for one GPU, keyed by their labels after gpu and uuid."""
        series = self.by_name[P + name].items()
        return {labels[2:]: v for labels, v in series if labels[0] == str(gpu)}

    def value(self, name: str, gpu: int, *extra: str) -> float:
        return self.gpu(name, gpu)[extra]

    def gpus_with(self, name: str) -> set[int]:
        return {int(labels[0]) for labels in self.by_name.get(P + name, {})}

    def series_of(self, gpu: int) -> set[str]:
        return {name for name, _ in self.samples_of(gpu)}

    def samples_of(self, gpu: int) -> list[tuple[str, tuple[str, ...]]]:
        return [(n, labels) for n, labels, _ in self.samples if labels[:1] == (str(gpu),)]


PER_GPU_FAMILIES = {
    "gpu_info", "gpu_lost", "gpu_utilization_ratio", "gpu_memory_utilization_ratio",
    "gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_power_watts", "gpu_power_limit_watts",
    "gpu_temperature_celsius", "gpu_sm_clock_hertz", "gpu_sm_clock_max_hertz",
    "gpu_memory_clock_hertz", "gpu_memory_clock_max_hertz", "gpu_performance_state",
    "gpu_clock_event_reason_active", "gpu_pcie_link_generation", "gpu_pcie_link_generation_max",
    "gpu_pcie_link_width", "gpu_pcie_link_width_max", "gpu_pcie_tx_bytes_per_second",
    "gpu_pcie_rx_bytes_per_second", "gpu_pcie_replay_errors_total", "gpu_ecc_errors_total",
    "gpu_persistence_mode", "gpu_ecc_mode", "gpu_nvlinks_active", "gpu_nvlinks_expected",
    "gpu_compute_processes", "gpu_process_memory_used_bytes", "gpu_nvml_hung_seconds",
    "gpu_power_default_limit_watts", "gpu_multiprocessors",
    "gpu_nvml_stale", "gpu_row_remap_pending", "gpu_row_remap_failed",
}


def test_registered_and_samples_match_the_declared_specs():
    assert load_builtin_sources()["nvml"] is NvmlSource and REGISTRY["nvml"] is NvmlSource
    specs = {spec.name: spec for spec in NvmlSource.metrics}
    assert len(specs) == len(NvmlSource.metrics)
    for spec in specs.values():
        assert spec.name.startswith(P)
        assert spec.name.endswith("_total") == (spec.type == "counter")
        if spec.name.startswith(P + "gpu_"):
            assert spec.labels[:2] == ("gpu", "uuid"), spec.name
    sim = Sim(xid_scenario(initial={"processes": [{"pid": 1, "gpu_memory_mib": 1}]}))
    sim.collect()
    got = sim.slow_read_after(12)
    for name, labels, value in got.samples:
        assert name in specs, name
        assert len(labels) == len(specs[name].labels), name
        assert isinstance(value, float), name
    assert {n.removeprefix(P) for n in got.by_name} >= PER_GPU_FAMILIES | {
        "gpu_xid_errors_total", "gpu_last_xid_timestamp_seconds", "cuda_driver_version",
        "nvml_devices"}


def test_healthy_node_every_family_with_its_units():
    sim = Sim("healthy-8gpu", at=599.0)
    sim.collect()
    got = sim.slow_read_after(1)
    values = sim.timeline.state(600.0)[0]
    assert got.by_name[P + "nvml_devices"] == {(): 8.0}
    assert got.by_name[P + "cuda_driver_version"] == {(): pytest.approx(12.5)}
    for i in range(8):
        v = values[i]
        uuid = gpu_uuid("sim-hgx-a100", i)
        assert got.series_of(i) == {P + f for f in PER_GPU_FAMILIES}
        assert {labels[1] for _, labels in got.samples_of(i)} == {uuid}
        bdf = sim.timeline.topology.gpu(i).bdf
        assert got.gpu("gpu_info", i) == {
            ("NVIDIA A100-SXM4-80GB", bdf, "555.42.06", "12.5"): 1.0}
        assert got.value("gpu_lost", i) == 0
        assert got.value("gpu_utilization_ratio", i) == pytest.approx(v["utilization_gpu"] / 100)
        assert got.value("gpu_memory_utilization_ratio", i) == pytest.approx(0.42)
        assert got.value("gpu_memory_used_bytes", i) == v["memory_used_mib"] * MIB
        assert got.value("gpu_memory_total_bytes", i) == 81920 * MIB
        assert got.value("gpu_power_watts", i) == pytest.approx(v["power_w"])
        assert got.value("gpu_power_limit_watts", i) == 400
        assert got.value("gpu_temperature_celsius", i) == round(v["temperature_c"])
        assert got.value("gpu_sm_clock_hertz", i) == 1410e6
        assert got.value("gpu_sm_clock_max_hertz", i) == 1410e6
        assert got.value("gpu_memory_clock_hertz", i) == 1593e6
        assert got.value("gpu_memory_clock_max_hertz", i) == 1593e6
        assert got.value("gpu_performance_state", i) == 0
        reasons = got.gpu("gpu_clock_event_reason_active", i)
        assert {r for (r,) in reasons} == set(CLOCK_REASONS)
        assert all(value == 0 for value in reasons.values())
        assert got.value("gpu_pcie_link_generation", i) == 4
        assert got.value("gpu_pcie_link_generation_max", i) == 4
        assert got.value("gpu_pcie_link_width", i) == 16
        assert got.value("gpu_pcie_link_width_max", i) == 16
        # the byte counters' increase between the last two polls (0.1 s apart: 32-bit
        # counters, so 950 MB between reads of an RX at 9.5 GB/s stays exact)
        assert got.value("gpu_pcie_tx_bytes_per_second", i) == pytest.approx(1800e6, rel=1e-5)
        assert got.value("gpu_pcie_rx_bytes_per_second", i) == pytest.approx(9500e6, rel=1e-5)
        assert got.value("gpu_pcie_replay_errors_total", i) == 0
        assert got.gpu("gpu_ecc_errors_total", i) == {("corrected",): 0, ("uncorrected",): 0}
        assert got.value("gpu_persistence_mode", i) == 1
        assert got.value("gpu_ecc_mode", i) == 1
        assert got.value("gpu_row_remap_pending", i) == 0
        assert got.value("gpu_row_remap_failed", i) == 0
        assert got.value("gpu_nvlinks_active", i) == got.value("gpu_nvlinks_expected", i) == 12
        assert got.gpu("gpu_nvlink_down", i) == {}  # only while a link is down
        assert got.value("gpu_compute_processes", i) == 1
        assert got.gpu("gpu_process_memory_used_bytes", i) == {("4242",): 71680 * MIB}


def test_idle_node():
    got = Sim("idle-8gpu", at=60.0).collect()
    for i in range(8):
        assert got.value("gpu_utilization_ratio", i) == 0
        assert got.value("gpu_performance_state", i) == 8
        assert got.value("gpu_pcie_link_generation", i) == 1
        assert got.value("gpu_pcie_link_generation_max", i) == 4
        assert got.value("gpu_power_watts", i) == 61
        assert got.value("gpu_sm_clock_hertz", i) == 210e6
        assert got.value("gpu_clock_event_reason_active", i, "gpu_idle") == 1
        assert got.value("gpu_clock_event_reason_active", i, "sw_power_cap") == 0
        assert got.value("gpu_compute_processes", i) == 0
        assert got.gpu("gpu_process_memory_used_bytes", i) == {}


def test_pcie_gen3_under_load_at_400s():
    sim = Sim("pcie-gen3-under-load", at=399.0)
    sim.collect()
    got = sim.slow_read_after(1)
    assert got.value("gpu_pcie_link_generation", 3) == 3
    assert got.value("gpu_pcie_link_generation_max", 3) == 4
    assert got.value("gpu_utilization_ratio", 3) == pytest.approx(0.48)
    assert got.value("gpu_power_watts", 3) == 210
    assert got.value("gpu_pcie_rx_bytes_per_second", 3) == pytest.approx(7600e6, rel=1e-5)
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert got.value("gpu_pcie_link_generation", i) == 4
        assert got.value("gpu_utilization_ratio", i) == pytest.approx(0.95)
    before = Sim("pcie-gen3-under-load", at=100.0)  # before the retrain
    assert before.collect().value("gpu_pcie_link_generation", 3) == 4


def test_clock_event_reasons_and_counters_follow_the_scenario():
    scn = scenario([
        {"name": "ok", "duration": 10},
        {"name": "bad", "duration": 100, "set": {
            "clock_event_reasons": ["sw_power_cap", "hw_slowdown"], "nvlink_down": [2],
            "persistence_mode": False, "row_remap_pending": True,
            "processes": [{"pid": 7, "gpu_memory_mib": 100}, {"pid": 8, "gpu_memory_mib": 50}]},
         "ramp": {"pcie_replay_count": [0, 1000], "ecc_corrected_total": [0, 100]}},
    ])
    sim = Sim(scn, at=60.0)
    got = sim.collect()
    reasons = got.gpu("gpu_clock_event_reason_active", 1)
    assert {r for (r,), v in reasons.items() if v} == {"sw_power_cap", "hw_slowdown"}
    assert got.value("gpu_pcie_replay_errors_total", 1) == 500
    assert got.value("gpu_ecc_errors_total", 1, "corrected") == 50
    # link 2 down from before the first poll, on a board without NVSwitches: not expected
    assert nvlinks(got, 1) == (11, 11, set())
    assert got.value("gpu_persistence_mode", 1) == 0
    assert got.value("gpu_row_remap_pending", 1) == 1 and got.value("gpu_row_remap_failed", 1) == 0
    assert got.value("gpu_compute_processes", 1) == 2
    assert got.gpu("gpu_process_memory_used_bytes", 1) == {("7",): 100 * MIB, ("8",): 50 * MIB}


@pytest.mark.parametrize("model, absent, present", [
    ("rtx-4090", {"gpu_nvlinks_active", "gpu_ecc_mode", "gpu_ecc_errors_total",
                  "gpu_row_remap_pending"}, {"gpu_pcie_replay_errors_total"}),
    ("l40s", {"gpu_nvlinks_active"}, {"gpu_ecc_mode", "gpu_ecc_errors_total",
                                     "gpu_row_remap_pending"}),
])
def test_unsupported_functions_drop_series_and_are_not_asked_again(model, absent, present):
    sim = Sim(scenario([{"name": "p", "duration": 100}], gpu_model=model))
    for _ in range(5):
        got = sim.collect()
        sim.clock.advance(1)
        for gpu in (0, 1):
            families = {n.removeprefix(P) for n in got.series_of(gpu)}
            assert not families & absent
            assert present <= families
            assert "gpu_power_watts" in families
    nv = sim.nv
    for gpu in (0, 1):
        assert sim.fake.gpu_calls[("nvmlDeviceGetFieldValues", gpu)] == 1 + 5  # +link count
        assert sim.fake.field_calls[(nv.NVML_FI_DEV_POWER_INSTANT, gpu)] == 5
        assert sim.fake.field_calls[(nv.NVML_FI_DEV_NVLINK_LINK_COUNT, gpu)] == 1
        assert sim.fake.field_calls[(nv.NVML_FI_DEV_NVLINK_GET_STATE, gpu)] == 0
        if "gpu_ecc_mode" in absent:  # asked once, then left out of the batch
            assert sim.fake.field_calls[(nv.NVML_FI_DEV_ECC_CURRENT, gpu)] == 1
            assert sim.fake.field_calls[(nv.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, gpu)] == 1
        assert sim.fake.gpu_calls[("nvmlDeviceGetPowerUsage", gpu)] == 0
        assert sim.fake.gpu_calls[("nvmlDeviceGetNvLinkState", gpu)] == 0


def test_static_values_are_read_once_and_slow_ones_every_few_polls():
    sim = Sim("healthy-8gpu")
    for _ in range(SLOW_EVERY + 1):
        got = sim.collect()
        assert got.value("gpu_pcie_link_generation", 0) == 4  # kept between the reads
        assert got.value("gpu_pcie_link_generation_max", 0) == 4
    assert sim.fake.gpu_calls[("nvmlDeviceGetMaxPcieLinkGeneration", 0)] == 1
    assert sim.fake.gpu_calls[("nvmlDeviceGetUUID", 0)] == 1
    assert sim.fake.gpu_calls[("nvmlDeviceGetHandleByIndex_v2", 0)] == 1
    assert sim.fake.gpu_calls[("nvmlDeviceGetCurrPcieLinkGeneration", 0)] == 2
    assert sim.fake.gpu_calls[("nvmlDeviceGetPersistenceMode", 0)] == 2


def test_a_slow_fact_that_changes_is_seen_within_its_cadence():
    sim = Sim(scenario([
        {"name": "on", "duration": 5},
        {"name": "off", "duration": 100, "set": {"persistence_mode": False}},
    ]))
    seen = []
    for _ in range(2 * SLOW_EVERY):
        seen.append(sim.collect().value("gpu_persistence_mode", 0))
        sim.clock.advance(1)
    assert seen == [1.0] * SLOW_EVERY + [0.0] * SLOW_EVERY


def test_calls_per_gpu_per_poll():
    """The cost of a poll, in NVML calls: the field-values batch (power, PCIe counters,
    replays, ECC, every NVLink's state), one call per other value, the process list."""
    sim = Sim("healthy-8gpu", at=60.0)

    def calls() -> int:
        return sum(n for (_, gpu), n in sim.fake.gpu_calls.items() if gpu == 0)

    sim.collect()
    before = calls()
    sim.collect()
    # 1 field values + 5 reads (utilization, memory, SM clock, P-state, clock event
    # reasons) + 1 for the compute processes (into a buffer kept big enough: pynvml's
    # wrapper would ask for the count first)
    assert calls() - before == 7
    for _ in range(SLOW_EVERY - 1):
        sim.collect()
    # every SLOW_EVERY polls: temperature, memory clock, link generation and width,
    # persistence mode, power limit, graphics processes
    assert calls() - before == 7 * SLOW_EVERY + 7
    assert sim.fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # never: it blocks 20 ms
    batch = {fid for (fid, gpu), _ in sim.fake.field_calls.items() if gpu == 0}
    nv = sim.nv
    assert batch == {
        nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
        nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
        nv.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, nv.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
        nv.NVML_FI_DEV_ECC_CURRENT, nv.NVML_FI_DEV_NVLINK_GET_STATE,
        nv.NVML_FI_DEV_NVLINK_LINK_COUNT, nv.NVML_FI_DEV_REMAPPED_PENDING,
        nv.NVML_FI_DEV_REMAPPED_FAILURE}
    # the slow fields ride in the batch every SLOW_EVERY polls only
    assert sim.fake.field_calls[(nv.NVML_FI_DEV_REMAPPED_PENDING, 0)] == 2
    assert sim.fake.field_calls[(nv.NVML_FI_DEV_NVLINK_GET_STATE, 0)] == 12 * (SLOW_EVERY + 1)


def test_pcie_rates_from_the_byte_counters():
    """Each poll's rate is the counters' increase since the last poll, over the driver's
    own timestamps."""
    scn = scenario([
        {"name": "a", "duration": 10, "set": {"pcie_tx_mb_s": 100, "pcie_rx_mb_s": 2000}},
        {"name": "b", "duration": 10, "set": {"pcie_tx_mb_s": 300, "pcie_rx_mb_s": 50}},
    ])
    sim = Sim(scn, at=5.0)
    first = sim.collect()
    assert first.gpu("gpu_pcie_tx_bytes_per_second", 0) == {}  # a rate needs two readings
    got = sim.polls(3)  # t=7
    assert got.value("gpu_pcie_tx_bytes_per_second", 0) == pytest.approx(100e6, rel=1e-6)
    assert got.value("gpu_pcie_rx_bytes_per_second", 1) == pytest.approx(2000e6, rel=1e-6)
    sim.clock.advance(2.5)
    sim.collect()
    sim.clock.advance(1)  # t=10.5: half a second of each phase since t=9.5
    got = sim.collect()
    assert got.value("gpu_pcie_tx_bytes_per_second", 0) == pytest.approx(200e6, rel=1e-6)
    sim.clock.advance(1)
    got = sim.collect()
    assert got.value("gpu_pcie_rx_bytes_per_second", 0) == pytest.approx(50e6, rel=1e-6)


def test_pcie_rates_survive_the_32_bit_counters_wrapping():
    """A real H200 answers the byte counters as 32-bit ints that wrap every 2**32 bytes
    (every ~1.3 s at 3.2 GB/s): the increase is taken modulo 2**32, exact while fewer
    than 2**32 bytes pass between two polls; more alias (the driver's own limit)."""
    scn = scenario([{"name": "p", "duration": 100, "set": {"pcie_tx_mb_s": 3200}}])
    sim = Sim(scn, at=10.0)
    sim.collect()
    for _ in range(20):  # 14 wraps
        sim.clock.advance(1)
        got = sim.collect()
        assert got.value("gpu_pcie_tx_bytes_per_second", 0) == pytest.approx(3.2e9, rel=1e-6)
    sim.clock.advance(2)  # 6.4 GB between two reads: 6.4e9 - 2**32 seen
    got = sim.collect()
    assert got.value("gpu_pcie_tx_bytes_per_second", 0) == pytest.approx(
        (6.4e9 - 2**32) / 2, rel=1e-6)


def test_a_64_bit_pcie_counter_that_falls_was_reset(monkeypatch):
    """A driver answering the counters in 64 bits (no wrap in practice): a value below the
    last one means a reload, so that reading gives no rate."""
    monkeypatch.setattr(fake_nvml_device, "UINT_FIELDS", ())
    sim = Sim(scenario([{"name": "p", "duration": 100, "set": {"pcie_tx_mb_s": 10}}]), at=50)
    sim.polls(2)
    sim.fake._pcie[(0, "tx")] = (0.0, sim.clock.elapsed())  # the driver reloaded: from 0
    got = sim.polls(2)
    assert got.gpu("gpu_pcie_tx_bytes_per_second", 0) == {}
    assert got.value("gpu_pcie_tx_bytes_per_second", 1) == pytest.approx(10e6, rel=1e-6)
    got = sim.polls(2)
    assert got.value("gpu_pcie_tx_bytes_per_second", 0) == pytest.approx(10e6, rel=1e-6)


def test_without_the_byte_counters_pcie_rates_are_left_out():
    """A driver before R555: no PCIe counters, and no 20 ms nvmlDeviceGetPcieThroughput."""
    sim = Sim("healthy-8gpu", at=60.0)
    nv = sim.nv
    for fid in (nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES):
        sim.fake.fail_field(fid, nv.NVML_ERROR_NOT_SUPPORTED)
    got = sim.polls(3)
    assert got.gpus_with("gpu_pcie_tx_bytes_per_second") == set()
    assert got.gpus_with("gpu_power_watts") == set(range(8))
    assert sim.fake.field_calls[(nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0)] == 1  # not again
    assert sim.fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_power_falls_back_to_the_classic_call_without_the_field():
    sim = Sim("idle-8gpu")
    sim.fake.fail_field(sim.nv.NVML_FI_DEV_POWER_INSTANT, sim.nv.NVML_ERROR_NOT_SUPPORTED)
    for _ in range(3):  # found out in the first poll's batch, read by the call that poll
        assert sim.collect().value("gpu_power_watts", 0) == 61
    assert sim.fake.gpu_calls[("nvmlDeviceGetPowerUsage", 0)] == 3
    assert sim.fake.field_calls[(sim.nv.NVML_FI_DEV_POWER_INSTANT, 0)] == 1


def test_process_lists_are_shared_with_the_processes_source():
    scn = scenario([{"name": "p", "duration": 100, "set": {"processes": [
        {"pid": 7, "gpu_memory_mib": 100}, {"pid": 9, "gpu_memory_mib": 5, "kind": "graphics"}]}}])
    sim = Sim(scn, at=3.0)
    table = sim.context.extras["nvml_processes"]
    assert isinstance(table, ProcessTable)
    assert table.fresh(sim.clock.elapsed(), 5.0) is None  # nothing read yet
    sim.collect()
    listed = table.fresh(sim.clock.elapsed() + 5.0, 5.0)
    assert listed is not None and [g.index for g in listed] == [0, 1]
    assert listed[1].labels == ("1", gpu_uuid("sim-node", 1))
    assert listed[1].bus_id == sim.timeline.topology.gpu(1).bdf
    assert listed[1].lists == {"compute": {7: 100 * MIB}, "graphics": {9: 5 * MIB}}
    assert table.fresh(sim.clock.elapsed() + 5.1, 5.0) is None  # too old


def test_function_not_found_falls_back_to_the_older_function():
    sim = Sim("idle-8gpu", missing_functions={
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperature"})
    for _ in range(3):
        got = sim.collect()
        assert got.value("gpu_clock_event_reason_active", 0, "gpu_idle") == 1
        assert got.value("gpu_temperature_celsius", 0) == 31
    assert sim.fake.gpu_calls[("nvmlDeviceGetCurrentClocksThrottleReasons", 0)] == 3
    assert sim.fake.gpu_calls[("nvmlDeviceGetTemperatureV", 0)] == 1  # a slow fact


def test_function_missing_with_no_fallback_drops_the_series():
    sim = Sim("idle-8gpu", missing_functions={"nvmlDeviceGetPerformanceState"})
    counted = []
    real = sim.nv.nvmlDeviceGetPerformanceState
    sim.nv.nvmlDeviceGetPerformanceState = lambda h: (counted.append(1), real(h))[1]
    for _ in range(3):
        got = sim.collect()
        assert got.gpu("gpu_performance_state", 0) == {}
        assert got.value("gpu_power_watts", 0) == 61
    assert len(counted) == 8  # once per GPU, then remembered


def test_other_errors_drop_the_series_for_one_poll_only():
    sim = Sim("healthy-8gpu", at=60.0)
    nv = sim.nv
    sim.fake.fail("nvmlDeviceGetTemperature", nv.NVML_ERROR_UNKNOWN, gpu=2, times=1)
    sim.fake.fail_field(nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER, nv.NVML_ERROR_UNKNOWN, gpu=2)
    got = sim.collect()  # a slow fact failing is asked again at the next poll
    assert got.gpus_with("gpu_temperature_celsius") == {0, 1, 3, 4, 5, 6, 7}
    assert got.gpus_with("gpu_pcie_replay_errors_total") == {0, 1, 3, 4, 5, 6, 7}
    assert got.gpu("gpu_ecc_errors_total", 2) == {("corrected",): 0, ("uncorrected",): 0}
    assert got.gpus_with("gpu_pcie_tx_bytes_per_second") == set()  # no rate at a first read
    sim.fake.clear_failures()
    got = sim.collect()
    assert got.gpus_with("gpu_temperature_celsius") == set(range(8))
    # a SLOW field failing is asked again at its next read, SLOW_EVERY polls on; the
    # other SLOW fields of that read are kept meanwhile
    assert got.gpus_with("gpu_pcie_replay_errors_total") == {0, 1, 3, 4, 5, 6, 7}
    got = sim.slow_read_after(SLOW_EVERY - 1)
    assert got.gpus_with("gpu_pcie_replay_errors_total") == set(range(8))
    assert got.gpus_with("gpu_pcie_tx_bytes_per_second") == set(range(8))


def test_a_failed_field_values_call_keeps_no_stale_slow_samples():
    sim = Sim("healthy-8gpu", at=60.0)
    nv = sim.nv
    sim.collect()
    sim.slow_read_after(SLOW_EVERY)  # rates on every GPU
    sim.fake.fail("nvmlDeviceGetFieldValues", nv.NVML_ERROR_UNKNOWN, gpu=2, times=1)
    sim.clock.advance(1)
    got = sim.collect()  # GPU 2's batch failed: its fields are absent for this poll
    assert got.gpus_with("gpu_pcie_tx_bytes_per_second") == {0, 1, 3, 4, 5, 6, 7}
    sim.clock.advance(1)
    got = sim.collect()  # and read again at once, all of them
    assert got.gpus_with("gpu_pcie_replay_errors_total") == set(range(8))
    assert sim.fake.field_calls[(nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 2)] == 3


def lost_scenario() -> Scenario:
    return scenario([
        {"name": "ok", "duration": 10},
        {"name": "lost", "duration": 10, "changes": [{"gpus": [1], "set": {"lost": True}}]},
    ], gpu_count=3)


def test_lost_gpu_reports_only_its_identity_and_gpu_lost():
    sim = Sim(lost_scenario())
    assert sim.collect().value("gpu_lost", 1) == 0
    sim.slow_read_after(5)  # the PCIe rates of the others
    sim.clock.advance(10)
    for _ in range(2):
        got = sim.collect()
        uuid = gpu_uuid("sim-node", 1)
        assert got.series_of(1) == {P + f for f in (
            "gpu_info", "gpu_multiprocessors", "gpu_lost", "gpu_nvml_hung_seconds",
            "gpu_nvml_stale")}
        assert {labels[1] for _, labels in got.samples_of(1)} == {uuid}
        assert got.value("gpu_lost", 1) == 1
        for other in (0, 2):
            assert got.value("gpu_lost", other) == 0
            no_processes = PER_GPU_FAMILIES - {"gpu_process_memory_used_bytes"}
            assert got.series_of(other) == {P + f for f in no_processes}


def test_the_xid_raised_as_a_gpu_falls_off_is_exported_while_it_is_lost():
    """Xid 79 and GPU_IS_LOST at once: the poll that first finds the GPU lost still
    counts the Xid, and every poll while it is lost exports it (xid_error's input)."""
    sim = Sim(scenario([
        {"name": "ok", "duration": 10},
        {"name": "off", "duration": 30,
         "changes": [{"gpus": [1], "set": {"xid": [79], "lost": True}}]},
    ], gpu_count=3))
    sim.collect()
    sim.clock.advance(11)
    for _ in range(3):
        got = sim.collect()
        assert got.value("gpu_lost", 1) == 1
        assert got.gpu("gpu_xid_errors_total", 1) == {("79",): 1}
        assert got.value("gpu_last_xid_timestamp_seconds", 1) == 1_700_000_011.0
        assert got.gpus_with("gpu_xid_errors_total") == {1}
        assert got.gpus_with("gpu_utilization_ratio") == {0, 2}
        sim.clock.advance(5)


def test_gpu_lost_before_it_was_ever_seen():
    sim = Sim(lost_scenario(), at=15.0)
    got = sim.collect()
    assert got.by_name[P + "gpu_lost"][("1", "")] == 1  # no handle, so no UUID either
    assert got.samples_of(1) == [(P + "gpu_lost", ("1", ""))]
    assert got.value("gpu_power_watts", 0) > 0


def test_no_driver_on_this_machine_real_pynvml():
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has libnvidia-ml")
    source = NvmlSource(NvmlConfig(), Context())  # the installed nvidia-ml-py
    for _ in range(2):  # retried on every poll, same message
        with pytest.raises(SourceError) as raised:
            source.collect()
        assert str(raised.value) == (
            "NVML unavailable: libnvidia-ml.so.1 not found (NVML_ERROR_LIBRARY_NOT_FOUND); "
            "is the NVIDIA driver installed on this node?")
    source.close()


def test_driver_not_loaded_then_loaded():
    sim = Sim("healthy-8gpu", driver_loaded=False)
    with pytest.raises(SourceError) as raised:
        sim.collect()
    assert str(raised.value) == (
        "NVML unavailable: NVIDIA driver not loaded (NVML_ERROR_DRIVER_NOT_LOADED); "
        "is this a GPU node?")
    assert "\n" not in str(raised.value)
    sim.fake.driver_loaded = True  # modprobe nvidia
    got = sim.collect()
    assert got.by_name[P + "nvml_devices"] == {(): 8.0}
    assert sim.fake.calls["nvmlInitWithFlags"] == 2


def test_other_init_failures_are_one_line():
    sim = Sim("healthy-8gpu")
    sim.fake.fail("nvmlInitWithFlags", sim.nv.NVML_ERROR_NO_PERMISSION, times=1)
    with pytest.raises(SourceError, match=r"permission denied \(NVML_ERROR_NO_PERMISSION\)"):
        sim.collect()
    sim.fake.fail("nvmlDeviceGetCount_v2", sim.nv.NVML_ERROR_UNKNOWN, times=1)
    with pytest.raises(SourceError, match=r"nvmlDeviceGetCount failed: Unknown Error"):
        sim.collect()
    assert sim.fake._refcount == 0  # the failed start shut NVML down again
    assert sim.collect().by_name[P + "nvml_devices"] == {(): 8.0}


def test_a_hung_gpu_holds_up_only_itself():
    """Item 10 of issue 15: a call that blocks on GPU 1 leaves GPUs 0 and 2 read as
    before; GPU 1 shows its identity and how long its call has blocked, not stale
    readings, and no second call is made on it while the first is in flight."""
    sim = Sim(scenario([{"name": "p", "duration": 100}], gpu_count=3))
    poller = Poller(sim.source, Store(), now=sim.clock.now)
    poller.poll()
    sim.fake.hang(1)
    sim.advance(1)
    assert poller.poll() and poller.health.up  # the poll did not wait on GPU 1
    calls_on_1 = sum(n for (_, gpu), n in sim.fake.gpu_calls.items() if gpu == 1)
    for _ in range(3):
        sim.advance(5)
        got = sim.collect()
        assert got.gpus_with("gpu_utilization_ratio") == {0, 2}
        assert got.value("gpu_nvml_stale", 0) == got.value("gpu_nvml_stale", 2) == 0
        assert got.value("gpu_nvml_hung_seconds", 0) == 0
        assert got.series_of(1) == {P + "gpu_info", P + "gpu_nvml_hung_seconds"}
    assert got.value("gpu_nvml_hung_seconds", 1) == 15  # blocked since t=1, now t=16
    assert sum(n for (_, gpu), n in sim.fake.gpu_calls.items() if gpu == 1) == calls_on_1
    readers = [t for t in threading.enumerate() if t.name.startswith("nvml-reader")]
    assert sum(t in sim.fake._blocked_threads for t in readers) == 1  # one thread stuck
    sim.fake.release()  # the driver answers again
    sim.advance(1)
    got = sim.collect()
    assert got.gpus_with("gpu_utilization_ratio") == {0, 1, 2}
    assert got.value("gpu_nvml_hung_seconds", 1) == 0 and got.value("gpu_nvml_stale", 1) == 0
    sim.source.close()


def test_gpus_not_reached_behind_a_hung_one_keep_their_last_values_marked_stale():
    sim = Sim(scenario([{"name": "p", "duration": 100, "set": {"utilization_gpu": 40}}],
                       gpu_count=3))
    first = sim.collect()
    sim.fake.hang(0)  # the first GPU the reader reads
    sim.advance(1)
    got = sim.collect()
    assert got.gpus_with("gpu_utilization_ratio") == {1, 2}
    for gpu in (1, 2):  # not read this poll: the last values, said to be so
        assert got.value("gpu_nvml_stale", gpu) == 1
        assert got.gpu("gpu_utilization_ratio", gpu) == first.gpu("gpu_utilization_ratio", gpu)
    assert got.value("gpu_nvml_hung_seconds", 0) == 0  # it blocked just now
    sim.advance(1)
    got = sim.collect()  # a new reader, which leaves GPU 0 alone
    assert got.value("gpu_nvml_stale", 1) == got.value("gpu_nvml_stale", 2) == 0
    assert got.value("gpu_nvml_hung_seconds", 0) == 1
    sim.fake.release()
    sim.source.close()


def test_the_poll_waits_for_a_blocked_call_half_its_timeout_in_real_time():
    sim = Sim(scenario([{"name": "p", "duration": 100}]), virtual_wait=False)
    # 1 s of real time for the reader to read GPU 0 (a few ms) even on a loaded machine
    sim.source = NvmlSource(NvmlConfig(timeout=2.0), sim.context)
    sim.collect()
    sim.fake.hang(1)
    try:
        got = sim.collect()  # about 1 s: the reader blocks on GPU 1, the poll goes on
        assert got.gpus_with("gpu_utilization_ratio") == {0}
        assert got.series_of(1) == {P + "gpu_info", P + "gpu_nvml_hung_seconds"}
        assert sim.fake.blocked.is_set()
    finally:
        sim.fake.release()
    sim.source.close()


def test_a_slow_poll_stamps_its_samples_when_read_so_they_are_fresh():
    """A poll of many GPUs can outlast the timeout: its samples are as old as their
    reading, not as the poll's start, and are not stale when it ends."""
    sim = Sim("healthy-8gpu", at=60.0)
    store = Store()
    poller = Poller(sim.source, store, now=sim.clock.now)
    collect = sim.source.collect

    def slow() -> list[Any]:
        samples = collect()
        sim.clock.advance(2 * poller.timeout + 3 * poller.interval)  # longer than stale_after
        return samples

    sim.source.collect = slow  # type: ignore[method-assign]
    poller.poll()
    now = sim.clock.now()
    assert poller.health.up and poller.health.last_success == now
    assert not store.is_stale("nvml", now)
    assert store.get(P + "gpu_lost", ("0", gpu_uuid("sim-hgx-a100", 0))) == 0


def test_scenario_hang_recovers_when_the_phase_ends():
    scn = scenario([
        {"name": "ok", "duration": 10},
        {"name": "hung", "duration": 10, "changes": [{"gpus": [0], "set": {"hung": True}}]},
        {"name": "back", "duration": 10, "changes": [{"gpus": [0], "set": {"hung": False}}]},
    ])
    sim = Sim(scn)
    poller = Poller(sim.source, Store(), now=sim.clock.now)
    poller.poll()
    sim.advance(12)
    assert poller.poll() and poller.health.up
    blocked = set(sim.fake._blocked_threads)
    assert len(blocked) == 1
    sim.advance(10)  # the phase ends: the blocked call returns, its thread ends
    assert not any(t.is_alive() for t in blocked)
    got = sim.collect()
    assert got.gpus_with("gpu_utilization_ratio") == {0, 1}
    assert got.value("gpu_nvml_hung_seconds", 0) == 0
    sim.source.close()


def xid_scenario(**node: Any) -> Scenario:
    return scenario([
        {"name": "ok", "duration": 10},
        {"name": "xid", "duration": 10, "changes": [{"gpus": [1], "set": {"xid": [79]}}]},
        {"name": "more", "duration": 10, "changes": [{"gpus": [1], "set": {"xid": [79, 48]}}]},
    ], **node)


def test_xid_counter_increments():
    sim = Sim(xid_scenario())
    got = sim.collect()
    assert got.gpu("gpu_xid_errors_total", 1) == {}
    assert got.gpu("gpu_last_xid_timestamp_seconds", 1) == {}
    sim.clock.advance(12)
    got = sim.collect()
    assert got.gpu("gpu_xid_errors_total", 1) == {("79",): 1}
    assert got.value("gpu_last_xid_timestamp_seconds", 1) == 1_700_000_012.0
    assert got.gpu("gpu_xid_errors_total", 0) == {}
    sim.clock.advance(1)
    assert sim.collect().gpu("gpu_xid_errors_total", 1) == {("79",): 1}  # counted once
    sim.clock.advance(10)
    got = sim.collect()
    assert got.gpu("gpu_xid_errors_total", 1) == {("79",): 2, ("48",): 1}
    assert got.value("gpu_last_xid_timestamp_seconds", 1) == 1_700_000_023.0
    sim.fake.inject_xid(0, 13)
    assert sim.collect().gpu("gpu_xid_errors_total", 0) == {("13",): 1}


def test_event_registration_is_retried():
    sim = Sim(xid_scenario())
    sim.fake.fail("nvmlDeviceRegisterEvents", sim.nv.NVML_ERROR_UNKNOWN, gpu=1, times=1)
    sim.collect()
    sim.fake.inject_xid(1, 31)  # not registered yet: the driver drops it
    assert sim.collect().gpu("gpu_xid_errors_total", 1) == {}  # registered during this poll
    sim.fake.inject_xid(1, 31)
    assert sim.collect().gpu("gpu_xid_errors_total", 1) == {("31",): 1}
    assert sim.fake.gpu_calls[("nvmlDeviceRegisterEvents", 1)] == 2
    assert sim.fake.gpu_calls[("nvmlDeviceRegisterEvents", 0)] == 1


def test_nvml_shut_down_under_the_source_starts_again():
    sim = Sim("healthy-8gpu")
    sim.collect()
    sim.fake.fail("nvmlDeviceGetUtilizationRates", sim.nv.NVML_ERROR_UNINITIALIZED, times=1)
    with pytest.raises(SourceError, match="NVML was shut down"):
        sim.collect()
    assert sim.collect().gpus_with("gpu_utilization_ratio") == set(range(8))
    assert sim.fake.calls["nvmlInitWithFlags"] == 2


def test_close_frees_the_event_set_and_shuts_down():
    sim = Sim("healthy-8gpu")
    sim.source.close()  # nothing to do before the first poll
    assert sim.fake.calls["nvmlShutdown"] == 0
    sim.collect()
    sim.source.close()
    assert sim.fake.calls["nvmlEventSetFree"] == 1
    assert sim.fake.calls["nvmlShutdown"] == 1
    assert sim.fake._refcount == 0
    assert sim.collect().by_name[P + "nvml_devices"] == {(): 8.0}  # starts again


def test_helpers():
    assert cuda_version_string(12040) == "12.4"
    assert cuda_version_string(11080) == "11.8"
    assert cuda_version_string(13000) == "13.0"
    assert sysfs_bus_id("00000000:4E:00.0") == "0000:4e:00.0"
    assert sysfs_bus_id("00000001:0A:00.0") == "0001:0a:00.0"
    assert set(CLOCK_EVENT_REASONS) <= set(CLOCK_REASONS)


def test_process_lists_grow_their_buffer_and_agree_with_pynvml():
    processes = [{"pid": 100 + i, "gpu_memory_mib": i} for i in range(40)]
    sim = Sim(scenario([{"name": "p", "duration": 100, "set": {"processes": processes}}]))
    got = sim.collect()  # 40 processes: more than the first buffer holds
    assert got.value("gpu_compute_processes", 1) == 40
    handle = sim.nv.nvmlDeviceGetHandleByIndex(1)
    listed = Direct(sim.nv).lister("nvmlDeviceGetComputeRunningProcesses_v3")(handle)
    assert listed == {p.pid: float(p.usedGpuMemory) for p in
                      sim.nv.nvmlDeviceGetComputeRunningProcesses_v3(handle)}
    assert len(listed) == 40


def test_field_values_are_read_as_pynvml_reads_them():
    import pynvml

    array = (pynvml.c_nvmlFieldValue_t * 7)()
    members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
    numbers = (2.5, 4_000_000_000, 2**63 + 5, 2**64 - 1, -(2**62), -7, 65535)
    for i, (member, number) in enumerate(zip(members, numbers, strict=True)):
        array[i].fieldId, array[i].timestamp = 100 + i, 1_700_000_000_000_000 + i
        array[i].valueType, array[i].nvmlReturn = i, i % 2
        setattr(array[i].value, member, number)
    got = FieldValues(pynvml).read(array)
    # an unsigned integer comes with the modulus it wraps at (its width, the driver's choice)
    moduli = (None, 2**32, 2**64, 2**64, None, None, 2**16)
    assert got == [
        (i % 2, 1_700_000_000_000_000 + i, n, m)
        for i, (n, m) in enumerate(zip(numbers, moduli, strict=True))
    ]


def test_field_values_follow_the_value_types_the_driver_answers_each_time():
    """The array is decoded for the value types it holds: a field answered in another
    type at the next call (or one this binding does not know: no number) reads right."""
    import pynvml

    array = (pynvml.c_nvmlFieldValue_t * 3)()
    for record in array:
        record.valueType, record.value.ullVal = 3, 2**40 + 7  # unsigned long long
    values = FieldValues(pynvml)
    assert [v[2:] for v in values.read(array)] == [(2**40 + 7, 2**64)] * 3
    array[1].valueType, array[1].value.uiVal = 1, 5  # unsigned int: the low 4 bytes
    array[2].valueType, array[2].value.dVal = 0, 1.5
    assert [v[2:] for v in values.read(array)] == [(2**40 + 7, 2**64), (5, 2**32), (1.5, None)]
    array[0].valueType = 99
    assert values.read(array)[0][2:] == (None, None)


# --- which NVLinks should be up -------------------------------------------------------


def nvlinks(got: Metrics, gpu: int) -> tuple[float, float, set[int]]:
    """(active links, expected links, the expected links that are down) of a GPU."""
    counts = [got.gpu(f"gpu_nvlinks_{kind}", gpu).get((), 0.0) for kind in ("active", "expected")]
    down = {int(k[0]) for k in got.gpu("gpu_nvlink_down", gpu)}
    return counts[0], counts[1], down


def test_a_pcie_card_without_a_bridge_has_links_none_of_which_is_expected():
    sim = Sim(scenario([{"name": "p", "duration": 100}], gpu_model="a100-pcie-80gb"))
    got = sim.polls(3)
    for gpu in (0, 1):
        assert nvlinks(got, gpu) == (0, 0, set())
    # no active link: nothing to ask what it reaches
    assert sim.fake.calls["nvmlDeviceGetNvLinkRemoteDeviceType"] == 0


def test_bridged_h100_pcie_expects_only_the_links_its_bridges_connect():
    sim = Sim(scenario([{"name": "p", "duration": 100}], gpu_model="h100-pcie",
                       nvlink="bridge", gpu_count=3))
    got = sim.polls(2)
    assert nvlinks(got, 0) == nvlinks(got, 1) == (12, 12, set())  # 12 of 18 links bridged
    assert nvlinks(got, 2) == (0, 0, set())  # the odd one out has no partner, no bridge


def test_a_link_seen_active_stays_expected_when_it_goes_down():
    sim = Sim(scenario([
        {"name": "up", "duration": 5},
        {"name": "down", "duration": 100, "gpus": [1], "set": {"nvlink_down": [2, 3]}},
    ], gpu_model="h100-pcie", nvlink="bridge"))
    sim.polls(3)
    sim.clock.advance(5)
    assert nvlinks(sim.collect(), 1) == (10, 12, {2, 3})
    # the remote type is a static fact: asked once per GPU, at its first active link
    for _ in range(5):
        sim.collect()
    assert sim.fake.gpu_calls[("nvmlDeviceGetNvLinkRemoteDeviceType", 0)] == 1
    assert sim.fake.gpu_calls[("nvmlDeviceGetNvLinkRemoteDeviceType", 1)] == 1


def test_on_an_nvswitch_board_links_down_before_the_start_are_expected():
    sim = Sim(scenario(
        [{"name": "p", "duration": 100, "changes": [
            {"gpus": [3], "set": {"nvlink_down": [7]}},
            {"gpus": [5], "set": {"nvlink_down": list(range(12))}},
        ]}],
        gpu_count=8, pcie_topology="switched", nvlink="nvswitch",
    ))
    got = sim.polls(2)
    assert nvlinks(got, 3) == (11, 12, {7})
    assert nvlinks(got, 5) == (0, 12, set(range(12)))  # wired as every other GPU's
    assert nvlinks(got, 0) == (12, 12, set())


def test_links_down_from_the_start_are_expected_once_a_later_gpu_finds_the_switches():
    """GPU 0 is read before any GPU has shown an active link: its links are not expected
    at the first poll; once GPU 1 has found the NVSwitches they are, with the same link
    states as before (the samples kept from the last poll are not reused then)."""
    sim = Sim(scenario(
        [{"name": "p", "duration": 100, "gpus": [0], "set": {"nvlink_down": list(range(12))}}],
        gpu_count=2, nvlink="nvswitch",
    ))
    assert nvlinks(sim.collect(), 0) == (0, 0, set())
    sim.clock.advance(1)
    for _ in range(2):
        got = sim.collect()
        assert nvlinks(got, 0) == (0, 12, set(range(12)))
        assert nvlinks(got, 1) == (12, 12, set())


def test_a_link_seen_up_at_a_poll_that_found_the_gpu_lost_is_expected_once_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A link is expected once seen active. GPU 0's link 0 comes up at a poll whose
    question of what it reaches finds the GPU lost (GPU_IS_LOST), and the GPU answers
    again at the next poll, the link down again: it is expected, and down. The states
    are those of the poll before the lost one, whose samples must not be reused: the
    link was seen active since."""
    sim = Sim(scenario([
        {"name": "down", "duration": 3, "gpus": [0], "set": {"nvlink_down": list(range(12))}},
        {"name": "link 0 up", "duration": 3, "gpus": [0],
         "set": {"nvlink_down": list(range(1, 12))}},
        {"name": "down again", "duration": 100, "gpus": [0],
         "set": {"nvlink_down": list(range(12))}},
    ], nvlink="direct"))  # fmt: skip
    assert nvlinks(sim.collect(), 0) == (0, 0, set())
    nv = sim.nv

    def lost(handle: Any, link: int) -> int:
        raise nv.NVMLError(nv.NVML_ERROR_GPU_IS_LOST)

    with monkeypatch.context() as patch:
        patch.setattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", lost)
        sim.clock.advance(3)
        assert sim.collect().value("gpu_lost", 0) == 1
    sim.clock.advance(3)
    got = sim.collect()
    assert got.value("gpu_lost", 0) == 0
    assert nvlinks(got, 0) == (0, 1, {0})


def test_link_and_clock_reason_samples_follow_each_change():
    """What a poll reads again unchanged gives the samples of the last one; each change
    of a link or of the clock event reasons shows at the poll that reads it."""
    sim = Sim(scenario([
        {"name": "ok", "duration": 3},
        {"name": "bad", "duration": 3, "gpus": [1],
         "set": {"nvlink_down": [2], "clock_event_reasons": ["hw_slowdown"]}},
        {"name": "ok again", "duration": 100,  # a phase's values hold until set again
         "set": {"nvlink_down": [], "clock_event_reasons": ["gpu_idle"]}},
    ], nvlink="direct"))

    def seen() -> tuple[tuple[float, float, set[int]], set[str]]:
        got = sim.collect()
        reasons = got.gpu("gpu_clock_event_reason_active", 1)
        return nvlinks(got, 1), {r for (r,), v in reasons.items() if v}

    up = ((12, 12, set()), {"gpu_idle"})  # the scenario's default
    assert [seen() for _ in range(2)] == [up, up]
    sim.clock.advance(3)
    down = ((11, 12, {2}), {"hw_slowdown"})
    assert [seen() for _ in range(2)] == [down, down]
    sim.clock.advance(3)
    assert seen() == up


def test_on_a_gpu_to_gpu_board_a_link_never_seen_active_is_not_expected():
    """Without NVSwitches the wiring is not known (bridges may leave links unconnected):
    a link down before the daemon started is a known blind spot."""
    sim = Sim(scenario([{"name": "p", "duration": 100, "gpus": [1],
                         "set": {"nvlink_down": [4]}}], nvlink="direct"))
    got = sim.polls(2)
    assert nvlinks(got, 1) == (11, 11, set())  # link 4 neither active nor expected


def test_remote_device_type_follows_the_board():
    sim = Sim(scenario([{"name": "p", "duration": 100, "gpus": [0],
                         "set": {"nvlink_down": [1]}}], gpu_count=8, nvlink="nvswitch"))
    nv = sim.nv
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, 0) == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH
    assert nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, 1) == nv.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, 12)
    bridged = Sim(scenario([{"name": "p", "duration": 100}], gpu_model="a100-pcie-80gb",
                           nvlink="bridge"))
    bridged.nv.nvmlInit()
    handle = bridged.nv.nvmlDeviceGetHandleByIndex(1)
    remote = bridged.nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, 11)
    assert remote == nv.NVML_NVLINK_DEVICE_TYPE_GPU
    l40s = Sim(scenario([{"name": "p", "duration": 100}], gpu_model="l40s"))
    l40s.nv.nvmlInit()
    with pytest.raises(l40s.nv.NVMLError_NotSupported):
        l40s.nv.nvmlDeviceGetNvLinkRemoteDeviceType(l40s.nv.nvmlDeviceGetHandleByIndex(0), 0)


def test_links_name_the_gpu_they_reach_while_down():
    """nvmlDeviceGetNvLinkRemotePciInfo, asked once per link while it is up: a 4-GPU
    direct board's links reach GPUs in blocks (A100: 4 to each other GPU), a bridge
    its partner, an NVSwitch board's links switches; a link down reports its GPU."""
    down = [{"name": "up", "duration": 10},
            {"name": "down", "duration": 100, "gpus": [1], "set": {"nvlink_down": [4, 5]}}]
    sim = Sim(scenario(down, gpu_count=4, nvlink="direct"))
    assert P + "gpu_nvlink_down_peer_gpu" not in sim.collect().by_name
    sim.clock.advance(20)
    got = sim.collect()
    assert got.gpus_with("gpu_nvlink_down_peer_gpu") == {1}
    assert got.value("gpu_nvlink_down_peer_gpu", 1) == 2  # links 4-7: the second other GPU
    nv = sim.nv
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    reached = {nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId for link in (0, 4, 8)}
    bus_ids = {nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByIndex(g)).busId for g in (1, 2, 3)}
    assert reached == bus_ids
    with pytest.raises(nv.NVMLError_NotSupported):  # no far end known over a link down
        nv.nvmlDeviceGetNvLinkRemotePciInfo(nv.nvmlDeviceGetHandleByIndex(1), 4)
    switched = Sim(scenario(down, gpu_count=8, nvlink="nvswitch", gpu_model="h100-sxm5-80gb"))
    switched.collect()
    switched.clock.advance(20)
    assert P + "gpu_nvlink_down_peer_gpu" not in switched.collect().by_name
    remote = switched.nv.nvmlDeviceGetNvLinkRemotePciInfo(
        switched.nv.nvmlDeviceGetHandleByIndex(0), 5)
    assert remote.pciDeviceId == (0x22A3 << 16) | 0x10DE  # a Hopper NVSwitch


def test_nvml_reports_the_link_as_trained_and_the_maximum_of_both_ends():
    sim = Sim(scenario([{"name": "p", "duration": 100}], gpu_model="h100-pcie",
                       pcie_max={"root_ports": {"gen": 4}, "gpu1": {"width": 8}}))
    got = sim.collect()
    assert got.value("gpu_pcie_link_generation", 0) == 4  # a Gen5 card in a Gen4 host
    assert got.value("gpu_pcie_link_generation_max", 0) == 4
    assert got.value("gpu_pcie_link_width", 1) == 8
    assert got.value("gpu_pcie_link_width_max", 1) == 8
    assert got.value("gpu_pcie_link_width_max", 0) == 16


@pytest.mark.parametrize("expected", ["all", (4, 5)])
def test_configured_nvlinks_are_expected_though_never_seen(expected):
    scn = scenario([{"name": "p", "duration": 100, "gpus": [1], "set": {"nvlink_down": [4]}}],
                   nvlink="direct")
    sim = Sim(scn)
    sim.source = NvmlSource(NvmlConfig(expected_nvlinks=expected), sim.context)
    assert nvlinks(sim.polls(2), 1) == (11, 12, {4})  # 4: never seen, but configured


def test_expected_nvlinks_config_errors_name_the_field():
    with pytest.raises(ValueError, match="expected_nvlinks"):
        NvmlConfig(expected_nvlinks="some")


def test_pcie_byte_counters_every_poll_the_replay_counter_every_slow_polls():
    """The PCIe counters cost a GSP round trip each (150-180 µs of CPU on an H200, the
    other fields ~1 µs). The byte counters are 32 bits and wrap: asked every poll. The
    replay counter is asked every SLOW_EVERY polls, its sample exported every poll."""
    sim = Sim("healthy-8gpu", at=100.0)
    nv = sim.nv
    for poll in range(2 * SLOW_EVERY):
        got = sim.collect()
        assert got.gpus_with("gpu_pcie_replay_errors_total") == set(range(8)), poll
        sim.clock.advance(1)
    assert sim.fake.field_calls[(nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 0)] == 2
    for field in ("PCIE_COUNT_TX_BYTES", "PCIE_COUNT_RX_BYTES", "POWER_INSTANT"):
        assert sim.fake.field_calls[(getattr(nv, "NVML_FI_DEV_" + field), 0)] == 2 * SLOW_EVERY
    assert got.gpus_with("gpu_pcie_tx_bytes_per_second") == set(range(8))


def test_sm_count_from_the_cores_and_the_compute_capability():
    """nvmlDeviceGetNumGpuCores / the capability's cores per SM: a real H200 answered
    16896 cores at 9.0, 132 SMs (docs/hardware/2026-12-04-h200); an A100 (8.0) has 64
    cores per SM. A driver without the call: no series."""
    got = Sim("healthy-at-power-cap-h200", at=10.0).collect()
    assert got.value("gpu_multiprocessors", 0) == 132
    assert Sim("healthy-8gpu", at=10.0).collect().value("gpu_multiprocessors", 7) == 108
    old = Sim("healthy-8gpu", at=10.0, missing_functions=["nvmlDeviceGetNumGpuCores"])
    assert old.collect().gpus_with("gpu_multiprocessors") == set()


# -- the plans a poll follows (plans.py): the same samples and calls as reading each
# field and each read by the tables, made again as what they were made from changes


def unplanned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Polls without plans: every field by the loop, every read by `_read_one`."""
    monkeypatch.setattr(nvml_source, "field_plan", lambda entries, success: None)

    def steps(self: ReadPlan, phase: int) -> list[Any]:
        return [(r, None, (), False, None) for r in self.reads if r.key not in self.disabled]

    monkeypatch.setattr(ReadPlan, "_steps", steps)


def scrambled(sim: Sim) -> None:
    """Each GPU's batch with its NVLink states split by a field (as a field asked again
    after a MIG change can leave it): not one run."""
    for gpu in sim.source._gpus:
        batch = list(gpu.batch)
        links = [i for i, e in enumerate(batch) if e.field is NVLINK_STATE]
        if len(links) > 1:
            batch.insert(links[1], batch.pop(0))
            sim.source._ask(gpu, batch)


@pytest.mark.parametrize(("name", "at", "polls", "scramble"), [
    ("nvlink-down", 170.0, 2 * SLOW_EVERY + 3, False),
    ("nvlink-down", 170.0, 2 * SLOW_EVERY + 3, True),
    ("nvlink-loss-8xh100-nvswitch", 170.0, SLOW_EVERY + 3, False),
    ("fabric-registration-at-boot-8xh100", 0.0, 3 * SLOW_EVERY, False),
    ("gpu-fallen-off-bus", 290.0, SLOW_EVERY + 5, False),
    ("mig-mode-change-a100", 350.0, 2 * SLOW_EVERY + 3, False),  # MIG enabled at 360 s
    ("mig-mode-change-a100", 650.0, 2 * SLOW_EVERY + 3, False),  # 2 x 3g -> 7 x 1g at 660 s
    ("nccl-hang-r535-dcgm-8xh100", 0.0, SLOW_EVERY + 3, False),
])
def test_planned_polls_give_what_reading_each_field_and_read_gives(
    monkeypatch: pytest.MonkeyPatch, name: str, at: float, polls: int, scramble: bool
) -> None:
    planned = Sim(name, at=at)
    with monkeypatch.context() as patched:
        unplanned(patched)
        sim = Sim(name, at=at)
        expected = []
        for i in range(polls):
            expected.append(sim.source.collect())
            if scramble and i == 1:
                scrambled(sim)
            sim.advance(1)
        calls = dict(sim.fake.gpu_calls)
    for i in range(polls):
        assert planned.source.collect() == expected[i], f"poll {i}"
        if scramble and i == 1:
            scrambled(planned)
        planned.advance(1)
    assert dict(planned.fake.gpu_calls) == calls


def test_a_read_that_falls_back_later_is_planned_with_its_fallback():
    sim = Sim("idle-8gpu")
    sim.polls(2)  # the plans made, fabric's NOT_SUPPORTED found
    nv, calls = sim.nv, sim.fake.gpu_calls
    sim.fake.fail("nvmlDeviceGetCurrentClocksEventReasons", nv.NVML_ERROR_FUNCTION_NOT_FOUND, gpu=0)
    for _ in range(3):
        assert sim.collect().value("gpu_clock_event_reason_active", 0, "gpu_idle") == 1
    assert calls[("nvmlDeviceGetCurrentClocksEventReasons", 0)] == 2 + 1  # then its fallback
    assert calls[("nvmlDeviceGetCurrentClocksThrottleReasons", 0)] == 3
    assert calls[("nvmlDeviceGetCurrentClocksEventReasons", 1)] == 5


def test_a_read_found_unsupported_later_leaves_the_plan():
    sim = Sim("idle-8gpu")
    sim.polls(2)
    sim.fake.fail("nvmlDeviceGetPerformanceState", sim.nv.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    for _ in range(3):
        got = sim.collect()
        assert got.gpu("gpu_performance_state", 0) == {}
        assert got.value("gpu_performance_state", 1) == 8
    assert sim.fake.gpu_calls[("nvmlDeviceGetPerformanceState", 0)] == 3  # 2 + 1, not again
    assert sim.fake.gpu_calls[("nvmlDeviceGetPerformanceState", 1)] == 5


def test_a_fallback_read_added_later_joins_the_plan():
    sim = Sim("idle-8gpu")
    assert sim.polls(2).value("gpu_power_watts", 0) == 61
    sim.fake.fail_field(sim.nv.NVML_FI_DEV_POWER_INSTANT, sim.nv.NVML_ERROR_NOT_SUPPORTED)
    for _ in range(3):  # the field found unsupported, its call read in the same poll
        assert sim.collect().value("gpu_power_watts", 0) == 61
    assert sim.fake.gpu_calls[("nvmlDeviceGetPowerUsage", 0)] == 3


def test_a_field_plan_needs_the_nvlink_states_in_one_run():
    sim = Sim("nvlink-down", at=170.0)
    sim.collect()
    gpu = sim.source._gpus[0]
    fast, batch = gpu.plans
    assert batch is not None and fast is not None
    assert batch.scopes == tuple(range(12)) and batch.links == slice(9, 21)
    # power; the two PCIe rates; the replay counter (SLOW); the ECC fields; row remapping
    assert [(slow, start, end, rate is not None) for slow, start, end, *_, rate in batch.runs] == [
        (False, 0, 1, False), (False, 1, 2, True), (False, 2, 3, True), (True, 3, 4, False),
        (False, 4, 7, False), (True, 7, 9, False),
    ]
    scrambled(sim)
    assert gpu.plans[1] is None
