"""The fake libnvidia-ml, driven through the REAL pynvml API (a private copy of it)."""

from __future__ import annotations

import ctypes
import re
import sys
import threading
import time
from typing import Any

import pynvml
import pytest

from gpuwatchd.sim import fake_nvml
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import (
    DRIVER_COSTS,
    FREE,
    NvmlCosts,
    gpu_uuid,
    make_pynvml,
    nvml_bus_id,
)
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario

MIB = 2**20
WAIT = 10.0  # bound on every real-time wait in these tests


def scenario(phases: list[dict[str, Any]], **node: Any) -> Scenario:
    node = {"gpu_count": 2, "pcie_topology": "direct", **node}
    return Scenario.model_validate({"name": "t", "node": node, "phases": phases})


def start(
    scn: Scenario | str, at: float = 0.0, **options: Any
) -> tuple[Any, Any, SimClock, Timeline]:
    """(initialised private pynvml, its fake, the virtual clock, the timeline) at `at` s."""
    timeline = Timeline(load_scenario(scn) if isinstance(scn, str) else scn)
    clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
    clock.advance(at)
    nv = make_pynvml(timeline, clock, **options)
    nv.nvmlInit()
    return nv, nv._gpuwatchd_fake, clock, timeline


def test_private_copy_leaves_the_installed_pynvml_alone():
    nv, fake, _, _ = start("healthy-8gpu")
    assert nv is not pynvml and nv.nvmlLib is fake
    assert pynvml.nvmlLib is None  # the real module never loaded anything
    assert nv.__name__ not in sys.modules
    assert nv.NVMLError is not pynvml.NVMLError
    assert issubclass(nv.NVMLError_GpuIsLost, nv.NVMLError)
    # each copy is independent: its own error classes and library
    other = make_pynvml(Timeline(load_scenario("idle-8gpu")), SimClock(virtual=True))
    assert other.NVMLError is not nv.NVMLError and other.nvmlLib is not fake


def test_uninitialised_before_init_and_after_shutdown():
    timeline = Timeline(load_scenario("healthy-8gpu"))
    nv = make_pynvml(timeline, SimClock(virtual=True))
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 8
    nv.nvmlShutdown()
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlSystemGetDriverVersion()
    assert nv.nvmlErrorString(nv.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"  # needs no init


def test_driver_not_loaded():
    timeline = Timeline(load_scenario("healthy-8gpu"))
    nv = make_pynvml(timeline, SimClock(virtual=True), driver_loaded=False)
    with pytest.raises(nv.NVMLError_DriverNotLoaded) as raised:
        nv.nvmlInit()
    assert str(raised.value) == "Driver Not Loaded"


def test_system_and_identity():
    nv, _, _, timeline = start("healthy-8gpu")
    assert nv.nvmlSystemGetDriverVersion() == "555.42.06"
    assert nv.nvmlSystemGetCudaDriverVersion() == 12050
    assert nv.nvmlSystemGetCudaDriverVersion_v2() == 12050
    uuids = set()
    for i in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(i)
        assert isinstance(handle, nv.c_nvmlDevice_t)
        assert nv.nvmlDeviceGetIndex(handle) == i
        uuid = nv.nvmlDeviceGetUUID(handle)
        assert isinstance(uuid, str)
        assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", uuid)
        assert uuid == gpu_uuid("sim-hgx-a100", i)
        uuids.add(uuid)
        assert nv.nvmlDeviceGetName(handle) == "NVIDIA A100-SXM4-80GB"
        pci = nv.nvmlDeviceGetPciInfo(handle)
        assert isinstance(pci, nv.nvmlPciInfo_t)
        bdf = timeline.topology.gpu(i).bdf  # e.g. 0000:34:00.0
        assert isinstance(pci.busId, str)
        assert pci.busId == "0000" + bdf.upper()  # NVML: 8-digit domain, upper case
        assert pci.busIdLegacy == bdf.upper()
        assert pci.bus == int(bdf.split(":")[1], 16)
        assert pci.pciDeviceId == 0x20B210DE
    assert len(uuids) == 8
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(8)


def test_nvml_bus_id():
    assert nvml_bus_id("0000:4e:00.0") == ("00000000:4E:00.0", 0, 0x4E, 0)


def test_values_and_units_match_the_scenario():
    nv, _, clock, timeline = start("pcie-gen3-under-load", at=400.0)
    values = timeline.state(400.0)[0]
    for i in (2, 3):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        v = values[i]
        memory = nv.nvmlDeviceGetMemoryInfo(h)
        assert isinstance(memory, nv.c_nvmlMemory_t)
        assert memory.total == 81920 * MIB and memory.used == 71680 * MIB
        assert memory.free == memory.total - memory.used
        memory_v2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
        assert isinstance(memory_v2, nv.c_nvmlMemory_v2_t) and memory_v2.used == 71680 * MIB
        utilization = nv.nvmlDeviceGetUtilizationRates(h)
        assert isinstance(utilization, nv.c_nvmlUtilization_t)
        assert (utilization.gpu, utilization.memory) == (v["utilization_gpu"], 42)
        assert nv.nvmlDeviceGetPowerUsage(h) == v["power_w"] * 1000  # mW
        assert nv.nvmlDeviceGetEnforcedPowerLimit(h) == 400_000
        assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 62
        assert nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU) == 62
        assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1410
        assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM) == 1593
        assert nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM) == 1410
        assert nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM) == 1593
        assert nv.nvmlDeviceGetPerformanceState(h) == 0
        assert nv.nvmlDeviceGetMaxPcieLinkGeneration(h) == 4
        assert nv.nvmlDeviceGetCurrPcieLinkWidth(h) == 16
        assert nv.nvmlDeviceGetMaxPcieLinkWidth(h) == 16
        # MB/s (10^6 B) in the scenario, KB/s (1024 B) from NVML
        rx_kb = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
        assert rx_kb == round(v["pcie_rx_mb_s"] * 1e6 / 1024)
        tx_kb = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
        assert tx_kb == round(1800e6 / 1024)
        assert nv.nvmlDeviceGetPersistenceMode(h) == nv.NVML_FEATURE_ENABLED
        assert nv.nvmlDeviceGetEccMode(h) == [1, 1]
        assert nv.nvmlDeviceGetPcieReplayCounter(h) == 0
        counter = nv.NVML_AGGREGATE_ECC
        assert nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, counter) == 0
        assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0
    h3 = nv.nvmlDeviceGetHandleByIndex(3)
    assert nv.nvmlDeviceGetCurrPcieLinkGeneration(h3) == 3
    assert nv.nvmlDeviceGetUtilizationRates(h3).gpu == 48
    assert nv.nvmlDeviceGetPowerUsage(h3) == 210_000
    assert nv.nvmlDeviceGetPcieThroughput(h3, nv.NVML_PCIE_UTIL_RX_BYTES) == round(7600e6 / 1024)
    assert nv.nvmlDeviceGetCurrPcieLinkGeneration(nv.nvmlDeviceGetHandleByIndex(2)) == 4
    # before the fault (virtual time moved back by a fresh clock): GPU 3 still at Gen4
    early, _, _, _ = start("pcie-gen3-under-load", at=100.0)
    assert early.nvmlDeviceGetCurrPcieLinkGeneration(early.nvmlDeviceGetHandleByIndex(3)) == 4


def test_ramps_follow_the_virtual_clock():
    scn = scenario([{"name": "p", "duration": "100s", "ramp": {
        "temperature_c": [40, 80], "pcie_replay_count": [0, 1000], "power_w": [100, 300]}}])
    nv, _, clock, _ = start(scn)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 40
    clock.advance(25)
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 50
    assert nv.nvmlDeviceGetPcieReplayCounter(h) == 250
    assert nv.nvmlDeviceGetPowerUsage(h) == 150_000
    clock.advance(500)  # a finished ramp keeps its end value
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 80


def test_idle_gpu_and_clock_event_reasons():
    nv, _, _, _ = start("idle-8gpu", at=60.0)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetPerformanceState(h) == 8
    assert nv.nvmlDeviceGetCurrPcieLinkGeneration(h) == 1
    assert nv.nvmlDeviceGetMaxPcieLinkGeneration(h) == 4
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == nv.nvmlClocksEventReasonGpuIdle
    assert nv.nvmlDeviceGetCurrentClocksThrottleReasons(h) == nv.nvmlClocksThrottleReasonGpuIdle
    assert nv.nvmlDeviceGetMemoryInfo(h).used == 4 * MIB

    reasons = ["sw_power_cap", "hw_slowdown", "hw_thermal_slowdown"]
    nv, _, _, _ = start(scenario([{"name": "p", "duration": 10,
                                   "set": {"clock_event_reasons": reasons}}]))
    mask = nv.nvmlDeviceGetCurrentClocksEventReasons(nv.nvmlDeviceGetHandleByIndex(1))
    assert mask == (nv.nvmlClocksEventReasonSwPowerCap | nv.nvmlClocksEventReasonHwSlowdown
                    | nv.nvmlClocksEventReasonHwThermalSlowdown)


def test_function_not_found_for_symbols_the_library_lacks():
    missing = {"nvmlDeviceGetCurrentClocksEventReasons"}
    nv, fake, _, _ = start("healthy-8gpu", missing_functions=missing)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert nv.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0  # the older symbol is there
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetBAR1MemoryInfo(h)  # never faked
    assert "nvmlDeviceGetCurrentClocksEventReasons" not in fake.symbols()
    assert "nvmlDeviceGetHandleByIndex_v2" in fake.symbols()


def test_model_unsupported_functions_answer_not_supported():
    nv, fake, _, _ = start(scenario([{"name": "p", "duration": 10}], gpu_model="rtx-4090"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetEccMode(h)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetNvLinkState(h, 0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEccErrors(h, 0, 1)
    assert nv.nvmlDeviceGetName(h) == "NVIDIA GeForce RTX 4090"
    fields = nv.nvmlDeviceGetFieldValues(h, [
        nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER, nv.NVML_FI_DEV_ECC_SBE_AGG_TOTAL])
    assert [f.nvmlReturn for f in fields] == [nv.NVML_SUCCESS, nv.NVML_ERROR_NOT_SUPPORTED]
    assert fake.gpu_calls[("nvmlDeviceGetEccMode", 0)] == 1


def test_lost_gpu_answers_gpu_is_lost_and_others_are_fine():
    scn = scenario([
        {"name": "ok", "duration": 10},
        {"name": "lost", "duration": 10, "changes": [{"gpus": [1], "set": {"lost": True}}]},
    ])
    nv, _, clock, _ = start(scn)
    h1 = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetPowerUsage(h1) > 0
    clock.advance(15)
    for call in (nv.nvmlDeviceGetPowerUsage, nv.nvmlDeviceGetUUID, nv.nvmlDeviceGetMemoryInfo):
        with pytest.raises(nv.NVMLError_GpuIsLost):
            call(h1)
    with pytest.raises(nv.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetHandleByIndex(1)  # as nvidia-smi shows: no handle for a lost GPU
    h0 = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetPowerUsage(h0) > 0
    assert nv.nvmlDeviceGetCount() == 2


def test_nvlink_states():
    down = {"gpus": [0], "set": {"nvlink_down": [1, 3]}}
    scn = scenario([{"name": "p", "duration": 10, "changes": [down]}])
    nv, _, _, _ = start(scn)
    h0, h1 = (nv.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    assert [nv.nvmlDeviceGetNvLinkState(h0, link) for link in range(12)] == [
        1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert all(nv.nvmlDeviceGetNvLinkState(h1, link) == 1 for link in range(12))
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetNvLinkState(h0, 12)  # an A100 has 12 links


def test_processes_use_the_two_call_protocol():
    nv, fake, _, _ = start("healthy-8gpu", at=60.0)
    procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 71680 * MIB)]
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2  # size, then fill

    idle, idle_fake, _, _ = start("idle-8gpu")
    assert idle.nvmlDeviceGetComputeRunningProcesses(idle.nvmlDeviceGetHandleByIndex(0)) == []
    assert idle_fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1


def test_graphics_processes_are_listed_apart_from_compute():
    scn = scenario([{"name": "p", "duration": 100, "set": {"processes": [
        {"pid": 1789, "name": "Xorg", "gpu_memory_mib": 212, "kind": "graphics"},
        {"pid": 4242, "name": "python", "gpu_memory_mib": 20000},
        {"pid": 2210, "name": "gnome-shell", "gpu_memory_mib": 85, "kind": "graphics"},
    ]}}])
    nv, fake, _, _ = start(scn, at=10.0)
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    compute = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    graphics = nv.nvmlDeviceGetGraphicsRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory) for p in compute] == [(4242, 20000 * MIB)]
    assert [(p.pid, p.usedGpuMemory) for p in graphics] == [(1789, 212 * MIB), (2210, 85 * MIB)]
    assert fake.calls["nvmlDeviceGetGraphicsRunningProcesses_v3"] == 2  # size, then fill
    assert [p.pid for p in nv.nvmlDeviceGetGraphicsRunningProcesses_v2(handle)] == [1789, 2210]
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses_v2(handle)] == [4242]
    assert all(p.gpuInstanceId == 0xFFFFFFFF for p in graphics)

    idle, idle_fake, _, _ = start("healthy-8gpu", at=60.0)  # compute only: no graphics
    assert idle.nvmlDeviceGetGraphicsRunningProcesses(idle.nvmlDeviceGetHandleByIndex(0)) == []
    assert idle_fake.calls["nvmlDeviceGetGraphicsRunningProcesses_v3"] == 1


def test_field_values():
    scn = scenario([{"name": "p", "duration": 100, "set": {
        "pcie_replay_count": 17, "ecc_corrected_total": 5, "ecc_uncorrected_total": 2}}])
    nv, fake, clock, _ = start(scn, at=30.0)
    h = nv.nvmlDeviceGetHandleByIndex(1)
    ids = [nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER, nv.NVML_FI_DEV_ECC_SBE_AGG_TOTAL,
           nv.NVML_FI_DEV_ECC_DBE_AGG_TOTAL, nv.NVML_FI_DEV_NVLINK_LINK_COUNT, 250]
    fields = nv.nvmlDeviceGetFieldValues(h, ids)
    assert [f.fieldId for f in fields] == ids
    assert [f.nvmlReturn for f in fields] == [0, 0, 0, 0, nv.NVML_ERROR_NOT_SUPPORTED]
    # as a real H200 answers (docs/hardware/2026-12-04-h200): the replay counter in 32 bits
    uint, ull = nv.NVML_VALUE_TYPE_UNSIGNED_INT, nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert [f.valueType for f in fields[:4]] == [uint, ull, ull, ull]
    assert [fields[0].value.uiVal] + [f.value.ullVal for f in fields[1:4]] == [17, 5, 2, 12]
    assert fields[0].timestamp == int((1_700_000_000.0 + 30.0) * 1e6)  # microseconds

    fake.fail_field(nv.NVML_FI_DEV_ECC_DBE_AGG_TOTAL, nv.NVML_ERROR_UNKNOWN, gpu=1)
    fields = nv.nvmlDeviceGetFieldValues(h, ids[:3])
    assert [f.nvmlReturn for f in fields] == [0, 0, nv.NVML_ERROR_UNKNOWN]


def test_field_values_of_the_nvml_sources_batch():
    scn = scenario([{"name": "p", "duration": 100, "set": {
        "power_w": 250.5, "nvlink_down": [2]}}])
    nv, fake, _, _ = start(scn, at=10.0)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    ids = [nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_FI_DEV_ECC_CURRENT,
           (nv.NVML_FI_DEV_NVLINK_GET_STATE, 1), (nv.NVML_FI_DEV_NVLINK_GET_STATE, 2),
           (nv.NVML_FI_DEV_NVLINK_GET_STATE, 12)]
    fields = nv.nvmlDeviceGetFieldValues(h, ids)
    assert [f.nvmlReturn for f in fields] == [0, 0, 0, 0, nv.NVML_ERROR_INVALID_ARGUMENT]
    assert [f.value.ullVal for f in fields[:4]] == [250500, 1, 1, 0]  # mW; link 2 down
    assert fake.field_calls[(nv.NVML_FI_DEV_NVLINK_GET_STATE, 0)] == 3
    # a GeForce: no ECC, no NVLink (per field: the batch itself succeeds)
    nv, _, _, _ = start(scenario([{"name": "p", "duration": 1}], gpu_model="rtx-4090"))
    fields = nv.nvmlDeviceGetFieldValues(nv.nvmlDeviceGetHandleByIndex(0), ids[:3])
    assert [f.nvmlReturn for f in fields] == [0, nv.NVML_ERROR_NOT_SUPPORTED,
                                              nv.NVML_ERROR_NOT_SUPPORTED]


def test_pcie_byte_counters_integrate_the_scenarios_rates_exactly():
    scn = scenario([
        {"name": "a", "duration": 10, "set": {"pcie_tx_mb_s": 100}},
        {"name": "b", "duration": 10, "ramp": {"pcie_tx_mb_s": [0, 1000]}},
    ])
    nv, _, clock, _ = start(scn)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    tx, rx = nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES

    def counters() -> list[int]:
        fields = nv.nvmlDeviceGetFieldValues(h, [tx, rx])
        assert {f.valueType for f in fields} == {nv.NVML_VALUE_TYPE_UNSIGNED_INT}
        return [f.value.uiVal for f in fields]

    assert counters() == [0, 0]
    clock.advance(14)  # 10 s at 100 MB/s, then 4 s of a ramp from 0 to 400 MB/s
    assert counters() == [int(100e6 * 10 + 200e6 * 4), 0]
    clock.advance(16)  # the ramp's last 6 s (400 -> 1000 MB/s), then 10 s at its end
    # 32 bits, as on a real H200: 16 GB counted reads as 16e9 mod 2**32
    assert counters() == [int(1e9 + 8e8 + 700e6 * 6 + 1000e6 * 10) % 2**32, 0]


def test_timeline_integral_over_loops():
    scn = scenario([
        {"name": "a", "duration": 10, "set": {"pcie_rx_mb_s": 1}},
        {"name": "b", "duration": 10, "set": {"pcie_rx_mb_s": 3}},
    ])
    looping = Timeline(scn, loop=True)
    assert looping.integral("pcie_rx_mb_s", 5, 45) == [pytest.approx(5 + 30 + 10 + 30 + 5)] * 2
    assert Timeline(scn).integral("pcie_rx_mb_s", 15, 30) == [pytest.approx(45)] * 2


def test_what_other_tools_ask_is_answered_as_the_product_would():
    nv, _, _, _ = start("healthy-8gpu", at=60.0)  # A100 SXM: no NVENC, no fans, MIG off
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetEncoderUtilization(h)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetFanSpeed(h)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetConfComputeMemSizeInfo(h)
    assert nv.nvmlDeviceGetDecoderUtilization(h) == [0, 167_000]
    assert nv.nvmlDeviceGetMigMode(h) == [0, 0]
    assert nv.nvmlDeviceIsMigDeviceHandle(h).value == 0
    (sample,) = nv.nvmlDeviceGetProcessUtilization(h, 0)
    assert (sample.pid, sample.smUtil, sample.memUtil) == (4242, 95, 42)
    details = nv.nvmlDeviceGetRunningProcessDetailList(
        h, nv.nvmlProcessDetailList_v1, nv.NVML_PROCESS_MODE_COMPUTE)
    assert [(d.pid, d.usedGpuMemory) for d in details] == [(4242, 71680 * MIB)]
    assert nv.nvmlDeviceGetRunningProcessDetailList(
        h, nv.nvmlProcessDetailList_v1, nv.NVML_PROCESS_MODE_GRAPHICS) == []
    geforce, _, _, _ = start(scenario([{"name": "p", "duration": 1}], gpu_model="rtx-4090"))
    g = geforce.nvmlDeviceGetHandleByIndex(0)
    assert geforce.nvmlDeviceGetFanSpeed(g) == 30
    assert geforce.nvmlDeviceGetEncoderUtilization(g) == [0, 167_000]
    with pytest.raises(geforce.NVMLError_NotSupported):
        geforce.nvmlDeviceGetMigMode(g)
    with pytest.raises(geforce.NVMLError_NotFound):  # no compute process: no samples
        geforce.nvmlDeviceGetProcessUtilization(g, 0)


def test_injected_failures_and_call_counts():
    nv, fake, _, _ = start("healthy-8gpu")
    h0, h1 = (nv.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    fake.fail("nvmlDeviceGetPowerUsage", nv.NVML_ERROR_UNKNOWN, gpu=1, times=1)
    assert nv.nvmlDeviceGetPowerUsage(h0) > 0
    with pytest.raises(nv.NVMLError_Unknown):
        nv.nvmlDeviceGetPowerUsage(h1)
    assert nv.nvmlDeviceGetPowerUsage(h1) > 0  # only once
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 3
    assert fake.gpu_calls[("nvmlDeviceGetPowerUsage", 1)] == 2
    fake.fail("nvmlSystemGetDriverVersion", nv.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(nv.NVMLError_NoPermission):
        nv.nvmlSystemGetDriverVersion()
    fake.clear_failures()
    assert nv.nvmlSystemGetDriverVersion() == "555.42.06"


def in_this_thread(monkeypatch: pytest.MonkeyPatch, name: str, replacement: Any) -> None:
    """time.`name` replaced for calls from this thread only: `time` is the process's
    module, and other threads (tests/ahead.py's real-time runs) sleep meanwhile."""
    real, me = getattr(time, name), threading.get_ident()
    monkeypatch.setattr(
        time, name, lambda *a: replacement(*a) if threading.get_ident() == me else real(*a)
    )


def test_calls_cost_what_the_settings_say(monkeypatch):
    spent: list[float] = []
    slept: list[float] = []
    monkeypatch.setattr(fake_nvml, "_spend", lambda seconds, since: spent.append(seconds))
    in_this_thread(monkeypatch, "sleep", slept.append)
    in_this_thread(monkeypatch, "thread_time", lambda: 0.0)  # the fake takes no time
    costs = NvmlCosts(per_call=30e-6, per_field=2e-6, pcie_sample=0.02)
    nv, fake, _, _ = start("healthy-8gpu", costs=costs)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    spent.clear()
    nv.nvmlDeviceGetUtilizationRates(h)
    assert spent == [30e-6]
    nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER] * 5)
    assert spent[1:] == [pytest.approx(30e-6 + 10e-6)]  # the call and its 5 fields
    nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
    assert slept == [0.02]  # the driver's sampling window, blocking
    assert fake.calls_total == sum(fake.calls.values())
    assert fake.overshoot == 0
    listed = NvmlCosts(
        per_call=30e-6,
        per_field=2e-6,
        calls={"nvmlDeviceGetMaxClockInfo": 1.4e-3},
        fields={"NVML_FI_DEV_PCIE_REPLAY_COUNTER": 177e-6},
    )
    nv, fake, _, _ = start("healthy-8gpu", costs=listed)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    spent.clear()
    nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)  # a function of its own cost
    nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER, nv.NVML_FI_DEV_ECC_CURRENT])
    assert spent == [pytest.approx(1.4e-3), pytest.approx(30e-6 + 177e-6 + 2e-6)]
    ticks = iter([0.0, 100e-6])  # a call whose own work takes 100 µs of CPU
    in_this_thread(monkeypatch, "thread_time", lambda: next(ticks))
    spent.clear()
    nv.nvmlDeviceGetUtilizationRates(h)
    assert spent == [] and fake.overshoot == pytest.approx(70e-6)  # beyond the 30 µs
    assert fake.python == pytest.approx(100e-6)  # the fake's own work, all of it


def test_free_costs_nothing_and_run_simulate_costs_what_a_driver_does(monkeypatch):
    spent: list[float] = []
    monkeypatch.setattr(fake_nvml, "_spend", lambda seconds, since: spent.append(seconds))
    in_this_thread(monkeypatch, "sleep", spent.append)
    nv, fake, _, _ = start("healthy-8gpu")  # the default: FREE
    assert fake.costs == FREE
    h = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER])
    nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
    assert spent == []
    assert DRIVER_COSTS.pcie_sample == 0.021 and DRIVER_COSTS.per_call > 0

    from gpuwatchd.sim.node import SimNode

    real, virtual = (SimNode(load_scenario("idle-8gpu"), virtual=v) for v in (False, True))
    try:
        assert real.pynvml._gpuwatchd_fake.costs == DRIVER_COSTS
        assert virtual.pynvml._gpuwatchd_fake.costs == FREE
    finally:
        real.close()
        virtual.close()


def test_spend_burns_this_threads_cpu():
    before = time.thread_time()
    fake_nvml._spend(0.002, before)
    assert time.thread_time() - before >= 0.002


def test_call_counts_are_written_for_a_benchmark(tmp_path, monkeypatch):
    path = tmp_path / "calls"
    monkeypatch.setenv(fake_nvml.STATS_ENV, str(path))
    nv, fake, _, _ = start("healthy-8gpu")
    nv.nvmlDeviceGetCount()
    at, calls, overshoot, python = path.read_text().split()
    assert float(at) > 0 and 1 <= int(calls) <= fake.calls_total and float(overshoot) >= 0
    assert float(python) >= float(overshoot)


def xid_scenario() -> Scenario:
    return scenario([
        {"name": "ok", "duration": 10},
        {"name": "xid", "duration": 10, "changes": [{"gpus": [1], "set": {"xid": [79, 48]}}]},
    ])


def test_xid_events_are_delivered_once():
    nv, fake, clock, _ = start(xid_scenario())
    event_set = nv.nvmlEventSetCreate()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    for h in handles:
        supported = nv.nvmlDeviceGetSupportedEventTypes(h)
        assert supported & nv.nvmlEventTypeXidCriticalError
        nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(event_set, 0)
    clock.advance(12)
    seen = []
    for _ in range(2):
        data = nv.nvmlEventSetWait_v2(event_set, 0)
        assert isinstance(data, nv.c_nvmlEventData_t)
        assert data.eventType == nv.nvmlEventTypeXidCriticalError
        assert ctypes.addressof(data.device.contents) == ctypes.addressof(handles[1].contents)
        seen.append(data.eventData)
    assert seen == [79, 48]
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait(event_set, 0)  # delivered once
    clock.advance(5)
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(event_set, 0)
    fake.inject_xid(0, 13)
    data = nv.nvmlEventSetWait_v2(event_set, 0)
    assert (data.eventData, ctypes.addressof(data.device.contents)) == (
        13, ctypes.addressof(handles[0].contents))
    nv.nvmlEventSetFree(event_set)


def test_xid_events_only_for_registered_gpus():
    nv, _, clock, _ = start(xid_scenario())
    event_set = nv.nvmlEventSetCreate()
    h0 = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceRegisterEvents(h0, nv.nvmlEventTypeXidCriticalError, event_set)
    clock.advance(12)
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(event_set, 0)  # the Xid was on GPU 1


def test_hung_gpu_blocks_until_released():
    nv, fake, _, _ = start("healthy-8gpu")
    h = nv.nvmlDeviceGetHandleByIndex(1)
    fake.hang(1)
    result: list[int] = []
    worker = threading.Thread(
        target=lambda: result.append(nv.nvmlDeviceGetPowerUsage(h)), daemon=True)
    worker.start()
    assert fake.blocked.wait(WAIT)
    assert worker.is_alive() and not result
    assert nv.nvmlDeviceGetPowerUsage(nv.nvmlDeviceGetHandleByIndex(0)) > 0  # others answer
    fake.release()
    worker.join(WAIT)
    assert not worker.is_alive() and result and result[0] > 0


def test_scenario_hang_ends_with_the_phase():
    scn = scenario([
        {"name": "ok", "duration": 10},
        {"name": "hung", "duration": 10, "changes": [{"gpus": [0], "set": {"hung": True}}]},
        {"name": "back", "duration": 10, "changes": [{"gpus": [0], "set": {"hung": False}}]},
    ])
    nv, fake, clock, _ = start(scn)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    clock.advance(12)
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (nv.nvmlDeviceGetPerformanceState(h), done.set()), daemon=True)
    worker.start()
    assert fake.blocked.wait(WAIT)
    assert not done.is_set()
    clock.advance(10)  # the hung phase is over
    fake.settle()  # virtual time: the blocked call looks at the clock again
    assert done.wait(WAIT)
    worker.join(WAIT)


def test_settle_waits_for_blocked_calls_to_look_at_the_new_time():
    """Virtual time: a blocked call returns only at a settle() after the hang ends, and
    settle() returns once it has (or blocked again): replays are deterministic."""
    scn = scenario([
        {"name": "ok", "duration": 1},
        {"name": "hung", "duration": 10, "changes": [{"gpus": [0], "set": {"hung": True}}]},
        {"name": "back", "duration": 10, "changes": [{"gpus": [0], "set": {"hung": False}}]},
    ])
    nv, fake, clock, _ = start(scn)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    clock.advance(1)
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (nv.nvmlDeviceGetPerformanceState(h), done.set()), daemon=True)
    worker.start()
    assert not fake.wait_for(done, worker, WAIT)  # returns as soon as it blocks
    clock.advance(5)
    fake.settle()
    assert worker in fake._blocked_threads and not done.is_set()  # still hung at 5 s
    clock.advance(6)
    fake.settle()  # at 12 s the call returns; settle waits for the thread to end
    assert not worker.is_alive() and done.is_set()
    assert fake.hang_timeouts == 0


def test_hang_is_capped():
    nv, fake, _, _ = start("healthy-8gpu", hang_cap=0.05)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    fake.hang(0)
    assert nv.nvmlDeviceGetPowerUsage(h) > 0  # answers after hang_cap (real time)
    assert fake.hang_timeouts == 1


def test_no_library_fails_in_pynvmls_own_loader():
    """`node.nvml: no_library`: libnvidia-ml.so.1 cannot be opened, as on a node without
    the driver; pynvml's loader answers NVML_ERROR_LIBRARY_NOT_FOUND, every time."""
    timeline = Timeline(load_scenario("healthy-8gpu"))
    nv = make_pynvml(timeline, SimClock(virtual=True), library=False)
    for _ in range(2):
        with pytest.raises(nv.NVMLError_LibraryNotFound):
            nv.nvmlInit()
    assert nv._gpuwatchd_fake.calls_total == 0
