"""MIG (issue 26): the fake libnvidia-ml's MIG answers under the real pynvml, the nvml
source's discovery and per-instance series through it, and the scenario format."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config import ConfigError, NvmlConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import DRIVER_COSTS, NvmlCosts, make_pynvml
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.nvml.mig import MIG_SPECS, OFF_EVERY, profile_of
from gpuwatchd.sources.nvml.reads import SLOW_EVERY

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
P = "gpuwatchd_"


def one_g(gi: int, used: float = 0, pids: tuple[int, ...] = ()) -> dict[str, Any]:
    processes = [{"pid": p, "gpu_memory_mib": used / max(1, len(pids))} for p in pids]
    return {"gpu_instance": gi, "profile": "1g.10gb", "memory_used_mib": used,
            "processes": processes}  # fmt: skip


def scenario(phases: list[dict[str, Any]], **node: Any) -> Scenario:
    node = {"gpu_count": 2, "pcie_topology": "direct", **node}
    return Scenario.model_validate({"name": "t", "node": node, "phases": phases})


def mig_on(instances: list[dict[str, Any]], duration: float = 60, gpus: Any = (0,)) -> dict:
    return {"name": "mig", "duration": duration, "gpus": list(gpus),
            "set": {"mig": {"instances": instances}}}  # fmt: skip


SEVEN = [one_g(7, 8000, (101,)), one_g(8, 3000, (102, 103)), *(one_g(g) for g in range(9, 14))]


class Node:
    """A fake node in virtual time and an NVML source reading it through the real pynvml."""

    def __init__(self, scn: Scenario, **options: Any) -> None:
        self.clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
        self.nv = make_pynvml(Timeline(scn), self.clock, **options)
        self.fake = self.nv._gpuwatchd_fake
        # the simulator's wait: for the reader, never for a real-time deadline
        extras = {
            "now": self.clock.now,
            "clock": self.clock.elapsed,
            "nvml_wait": self.fake.wait_for,
        }
        self.source = NvmlSource(NvmlConfig(), Context(pynvml=self.nv, extras=extras))

    def poll(self) -> list[Sample]:
        out = self.source.collect()
        self.clock.advance(1.0)
        return out

    def polls(self, n: int) -> list[Sample]:
        for _ in range(n - 1):
            self.poll()
        return self.poll()

    def handle(self, gpu: int) -> Any:
        self.nv.nvmlInit()
        return self.nv.nvmlDeviceGetHandleByIndex(gpu)


def series(samples: list[Sample], name: str, gpu: int = 0) -> dict[tuple[str, ...], float]:
    """`name`'s series of one GPU, by their labels after gpu and uuid."""
    wanted = P + name
    return {s.labels[2:]: s.value for s in samples if s.name == wanted and s.labels[0] == str(gpu)}


# -- the fake, parent --------------------------------------------------------------------


def test_a_gpu_with_mig_off_answers_as_the_h200_did():
    """Every MIG answer recorded on a real H200 with MIG off (mig.json), profiles too."""
    recorded = json.loads((ROOT / "docs/hardware/2026-12-04-h200-session8/mig.json").read_text())
    gpu = recorded["gpus"][0]
    node = Node(scenario([{"name": "p", "duration": 10}], gpu_model="h200-sxm-141gb"))
    nv, h = node.nv, node.handle(0)
    assert nv.nvmlDeviceGetMigMode(h) == gpu["mig_mode"]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == gpu["max_mig_devices"]
    assert nv.nvmlDeviceIsMigDeviceHandle(h).value == gpu["is_mig_handle"]
    calls = {
        "mig_handle_0": lambda: nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0),
        "gpu_instance_id": lambda: nv.nvmlDeviceGetGpuInstanceId(h),
        "compute_instance_id": lambda: nv.nvmlDeviceGetComputeInstanceId(h),
        "parent_of_handle": lambda: nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h),
        "attributes": lambda: nv.nvmlDeviceGetAttributes_v2(h),
    }
    for key, call in calls.items():
        with pytest.raises(nv.NVMLError) as raised:
            call()
        assert raised.value.value == getattr(nv, gpu[key]["error"]), key
    for entry in gpu["profiles"]:
        answer = entry["info_v2"]
        if "error" in answer:
            with pytest.raises(nv.NVMLError) as raised:
                nv.nvmlDeviceGetGpuInstanceProfileInfo(h, entry["profile"])
            assert raised.value.value == getattr(nv, answer["error"]), entry["profile"]
            continue
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, entry["profile"])
        for field in ("id", "sliceCount", "instanceCount", "multiprocessorCount",
                      "memorySizeMB", "copyEngineCount", "decoderCount", "jpegCount",
                      "ofaCount"):  # fmt: skip
            assert getattr(info, field) == answer[field], (entry["profile"], field)
        assert info.name == answer["name"]
        remaining = nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, answer["id"])
        assert remaining == entry["remaining"], entry["profile"]


def test_a_model_without_mig_answers_not_supported():
    node = Node(scenario([{"name": "p", "duration": 10}], gpu_model="l40s"))
    nv, h = node.nv, node.handle(0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)


def test_a_mig_enabled_parent_has_no_utilization_and_aggregates_memory_and_processes():
    node = Node(scenario([mig_on(SEVEN)]))
    nv, h0, h1 = node.nv, node.handle(0), node.handle(1)
    assert nv.nvmlDeviceGetMigMode(h0) == [1, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h0) == 7
    for call in (nv.nvmlDeviceGetUtilizationRates, nv.nvmlDeviceGetNumGpuCores):
        with pytest.raises(nv.NVMLError_NotSupported):
            call(h0)
    assert nv.nvmlDeviceGetUtilizationRates(h1).gpu == 0  # GPU 1: no MIG
    assert nv.nvmlDeviceGetMemoryInfo(h0).used == 11000 * MIB
    listed = {(p.pid, p.gpuInstanceId, p.computeInstanceId)
              for p in nv.nvmlDeviceGetComputeRunningProcesses(h0)}  # fmt: skip
    assert listed == {(101, 7, 0), (102, 8, 0), (103, 8, 0)}
    (other,) = nv.nvmlDeviceGetComputeRunningProcesses(h1) or [None]
    assert other is None
    assert nv.nvmlDeviceGetPowerUsage(h0) > 0  # power, clocks, PCIe stay the parent's
    assert nv.nvmlDeviceGetClockInfo(h0, nv.NVML_CLOCK_SM) > 0
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h0, 19) == 0  # all 7 slices used


def test_without_the_mig_monitor_capability_the_parent_aggregates_are_refused():
    node = Node(scenario([mig_on(SEVEN)], mig_monitor=False))
    nv, h0, h1 = node.nv, node.handle(0), node.handle(1)
    for call in (nv.nvmlDeviceGetMemoryInfo, nv.nvmlDeviceGetComputeRunningProcesses):
        with pytest.raises(nv.NVMLError_NoPermission):
            call(h0)
    assert nv.nvmlDeviceGetMemoryInfo(h1).total > 0  # no MIG there: no capability needed
    m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)  # the instances answer
    assert nv.nvmlDeviceGetMemoryInfo(m).used == 8000 * MIB


# -- the fake, MIG device handles -------------------------------------------------------


def test_a_mig_device_handle_answers_for_its_instance_and_nothing_of_the_parent():
    shared = [{"gpu_instance": 2, "compute_instance": ci, "profile": "3g.40gb",
               "compute_slices": 1, "memory_used_mib": 1000 * (ci + 1),
               "processes": [{"pid": 300 + ci, "gpu_memory_mib": 1000 * (ci + 1)}]}
              for ci in range(3)]  # fmt: skip
    layout = [{"gpu_instance": 1, "profile": "4g.40gb", "memory_used_mib": 20000}, *shared]
    node = Node(scenario([mig_on(layout)], gpu_model="h100-sxm5-80gb"))
    nv, h = node.nv, node.handle(0)
    handles = [nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(4)]
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 4)
    ids = [(nv.nvmlDeviceGetGpuInstanceId(m), nv.nvmlDeviceGetComputeInstanceId(m))
           for m in handles]  # fmt: skip
    assert ids == [(1, 0), (2, 0), (2, 1), (2, 2)]
    m = handles[2]
    assert nv.nvmlDeviceIsMigDeviceHandle(m).value == 1
    assert nv.nvmlDeviceGetName(m) == "NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"
    assert nv.nvmlDeviceGetUUID(m).startswith("MIG-")
    assert nv.nvmlDeviceGetIndex(m) == 2
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)) == 0
    memory = nv.nvmlDeviceGetMemoryInfo(m)  # the GPU instance's, shared by its 3 CIs
    assert (memory.total, memory.used) == (40448 * MIB, 6000 * MIB)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId)
            for p in nv.nvmlDeviceGetComputeRunningProcesses(m)] == [(301, 2, 1)]  # fmt: skip
    attributes = nv.nvmlDeviceGetAttributes_v2(m)
    assert (attributes.gpuInstanceSliceCount, attributes.computeInstanceSliceCount,
            attributes.multiprocessorCount) == (3, 1, 20)  # fmt: skip
    parent_only = (
        lambda: nv.nvmlDeviceGetUtilizationRates(m),
        lambda: nv.nvmlDeviceGetTemperature(m, nv.NVML_TEMPERATURE_GPU),
        lambda: nv.nvmlDeviceGetPowerUsage(m),
        lambda: nv.nvmlDeviceGetClockInfo(m, nv.NVML_CLOCK_SM),
        lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(m),
        lambda: nv.nvmlDeviceGetFieldValues(m, [nv.NVML_FI_DEV_POWER_INSTANT]),
        lambda: nv.nvmlDeviceGetMigMode(m),
    )
    for call in parent_only:
        with pytest.raises(nv.NVMLError_NotSupported):
            call()
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(m, 0)
    assert nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 2).contents is not None
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)) == (
        nv.nvmlDeviceGetUUID(m)  # the same instance: the same device
    )


def test_a_destroyed_instance_s_handle_no_longer_answers():
    phases = [
        mig_on(SEVEN, 10),
        mig_on(SEVEN[:3], 10),
        {"name": "off", "duration": 10, "gpus": [0], "set": {"mig": {"mode": "disabled"}}},
    ]
    node = Node(scenario(phases))
    nv, h = node.nv, node.handle(0)
    kept, gone = (nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in (1, 5))
    node.clock.advance(12)
    assert nv.nvmlDeviceGetGpuInstanceId(kept) == 8
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMemoryInfo(gone)
    node.clock.advance(10)
    assert nv.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMemoryInfo(kept)
    assert nv.nvmlDeviceGetUtilizationRates(h).gpu == 0  # the whole GPU's again


def test_mig_calls_cost_what_the_driver_spends_per_function():
    assert DRIVER_COSTS.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == pytest.approx(33e-6)
    costs = NvmlCosts(calls={"nvmlDeviceGetMemoryInfo": 0.02, "nvmlDeviceGetMigMode": 0.02})
    node = Node(scenario([mig_on(SEVEN)]), costs=costs)
    nv, h = node.nv, node.handle(0)
    m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    for call, args in ((nv.nvmlDeviceGetMemoryInfo, (m,)), (nv.nvmlDeviceGetMigMode, (h,))):
        before = time.thread_time()
        call(*args)
        assert time.thread_time() - before >= 0.02
    assert node.fake.gpu_calls[("nvmlDeviceGetMemoryInfo", 0)] == 1  # counted on its GPU


# -- the nvml source --------------------------------------------------------------------


def test_the_source_reads_each_mig_device_and_leaves_the_parent_utilization_out():
    node = Node(scenario([mig_on(SEVEN)]))
    out = node.polls(2)
    assert series(out, "gpu_mig_mode") == {(): 1.0}
    assert series(out, "gpu_utilization_ratio") == {}  # NOT_SUPPORTED on MIG: absent
    assert series(out, "gpu_utilization_ratio", gpu=1) == {(): 0.0}
    assert series(out, "gpu_mig_mode", gpu=1) == {}  # MIG-capable, off: only while on
    used = series(out, "gpu_instance_memory_used_bytes")
    assert used[("7", "0", "1g.10gb")] == 8000 * MIB and used[("13", "0", "1g.10gb")] == 0
    assert len(used) == 7
    processes = series(out, "gpu_instance_compute_processes")
    assert processes[("8", "0", "1g.10gb")] == 2 and processes[("9", "0", "1g.10gb")] == 0
    total = series(out, "gpu_instance_memory_total_bytes")
    assert set(total.values()) == {9728 * MIB}
    info = series(out, "gpu_instance_info")
    uuids = {labels[3] for labels in info}
    assert len(uuids) == 7 and all(u.startswith("MIG-") for u in uuids)
    assert series(out, "gpu_compute_processes") == {(): 3.0}  # the parent's aggregate
    assert series(out, "gpu_instance_multiprocessors")[("7", "0", "1g.10gb")] == 14
    names = {spec.name for spec in node.source.metrics}
    assert {spec.name for spec in MIG_SPECS} <= names


def test_mig_is_read_cheaply_between_changes():
    node = Node(scenario([mig_on(SEVEN, 200)]))
    node.polls(2)
    calls = node.fake.gpu_calls
    at_start = {name: calls[(name, 0)] for name in (
        "nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetUUID")}  # fmt: skip
    node.polls(10 * SLOW_EVERY)
    assert calls[("nvmlDeviceGetMigMode", 0)] - at_start["nvmlDeviceGetMigMode"] == 10
    counted = calls[("nvmlDeviceGetMaxMigDeviceCount", 0)]
    assert counted == at_start["nvmlDeviceGetMaxMigDeviceCount"]
    # no rediscovery; each device's UUID once a slow cycle (a handle reused, issue 42)
    assert calls[("nvmlDeviceGetUUID", 0)] - at_start["nvmlDeviceGetUUID"] == 7 * 10
    # a full GPU (7 of 7): no probe for a new device either
    assert (
        calls[("nvmlDeviceGetMigDeviceHandleByIndex", 0)]
        == (at_start["nvmlDeviceGetMigDeviceHandleByIndex"])
    )
    assert calls[("nvmlDeviceGetMemoryInfo", 0)] >= 7 * 10 * SLOW_EVERY  # per device, per poll
    assert calls[("nvmlDeviceGetUtilizationRates", 0)] == 0  # never asked on MIG
    # MIG off (GPU 1): the mode once per OFF_EVERY polls
    assert calls[("nvmlDeviceGetMigMode", 1)] == 1 + (10 * SLOW_EVERY + 1) // OFF_EVERY


def test_mig_device_indexes_with_holes_are_skipped_not_rediscovered():
    """Index 2 NOT_FOUND, 3 a device (the driver's numbering after a compute instance
    went): discovery skips the hole, and the probe for new devices does not take index 3
    for a new one every SLOW_EVERY polls (issue 42 item 7)."""
    holes = [{**one_g(7), "index": 0}, {**one_g(8), "index": 1}, {**one_g(9), "index": 3}]
    node = Node(scenario([mig_on(holes, 60), mig_on([*holes, {**one_g(10), "index": 2}], 60)]))
    nv, h = node.nv, node.handle(0)
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 3)) == 3
    calls = node.fake.gpu_calls
    before = calls[("nvmlDeviceGetMaxMigDeviceCount", 0)]
    out = node.polls(5 * SLOW_EVERY)
    assert set(series(out, "gpu_instance_memory_total_bytes")) == {
        (str(gi), "0", "1g.10gb") for gi in (7, 8, 9)
    }
    assert calls[("nvmlDeviceGetMaxMigDeviceCount", 0)] - before == 1  # one discovery
    assert calls[("nvmlDeviceGetName", 0)] <= 3 + 1  # three devices identified once
    node.polls(60 - 5 * SLOW_EVERY + SLOW_EVERY + 1)  # a new instance in the hole: found
    assert len(series(node.poll(), "gpu_instance_info")) == 4


def test_a_reused_mig_handle_is_caught_on_the_slow_cadence():
    """nvml.h: a destroyed instance's handle "may be reused and their properties can
    change". GI 8 destroyed, GI 10 created at its index: the kept handle answers SUCCESS
    for GI 10 (another tenant), whose series must not carry GI 8's labels or MIG UUID
    past a slow cycle (issue 42 item 2)."""
    before = [one_g(7, 1000, (101,)), one_g(8, 3000, (102,))]
    after = [one_g(7, 1000, (101,)), {**one_g(10, 5000, (110,)), "index": 1}]
    node = Node(scenario([mig_on(before, 30), mig_on(after, 60)]))
    node.fake.mig_handle_reuse = True
    nv, h = node.nv, node.handle(0)
    kept = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    first = node.polls(29)
    uuids = {labels[0]: labels[3] for labels in series(first, "gpu_instance_info")}
    assert set(uuids) == {"7", "8"}
    assert nv.nvmlDeviceGetGpuInstanceId(kept) == 8
    node.polls(SLOW_EVERY + 1)  # 30 s: GI 10 now answers through GI 8's old handle
    assert nv.nvmlDeviceGetGpuInstanceId(kept) == 10
    out = node.poll()
    used = series(out, "gpu_instance_memory_used_bytes")
    assert used == {("7", "0", "1g.10gb"): 1000 * MIB, ("10", "0", "1g.10gb"): 5000 * MIB}
    info = {labels[0]: labels[3] for labels in series(out, "gpu_instance_info")}
    assert set(info) == {"7", "10"} and info["10"] != uuids["8"]


def test_a_model_without_mig_is_asked_once():
    node = Node(scenario([{"name": "p", "duration": 100}], gpu_model="l40s"))
    out = node.polls(3 * OFF_EVERY)
    assert node.fake.gpu_calls[("nvmlDeviceGetMigMode", 0)] == 1
    assert series(out, "gpu_mig_mode") == {}


def test_the_source_follows_mig_being_enabled_reshaped_and_disabled(caplog):
    phases = [
        {"name": "whole", "duration": 30, "set": {"utilization_gpu": 80}},
        mig_on(
            [{"gpu_instance": 1, "profile": "3g.40gb"}, {"gpu_instance": 2, "profile": "3g.40gb"}],
            30,
        ),  # fmt: skip
        mig_on(SEVEN[:5], 30),
        mig_on(SEVEN, 30),
        {"name": "off", "duration": 30, "gpus": [0], "set": {"mig": {"mode": "disabled"}}},
    ]
    node = Node(scenario(phases))
    caplog.set_level(logging.INFO, "gpuwatchd.sources.nvml")
    seen: list[tuple[float, float | None, int]] = []  # (t, utilization, MIG devices)
    for _ in range(150):
        t = node.clock.elapsed()
        out = node.poll()
        utilization = series(out, "gpu_utilization_ratio").get(())
        seen.append((t, utilization, len(series(out, "gpu_instance_info"))))

    def at(t: float) -> tuple[float | None, int]:
        return next((u, n) for when, u, n in seen if when == t)

    assert at(29) == (0.8, 0)
    assert at(32) == (None, 2)  # enabled: found within two polls, utilization gone
    assert at(59) == (None, 2)
    assert at(61)[1] == 5  # created instances: found by the next probe
    assert at(91) == (None, 7)
    assert at(122) == (0.8, 0)  # disabled: the handles stop answering, read whole again
    assert "MIG enabled" in caplog.text and "MIG disabled" in caplog.text


def test_a_pending_mode_change_shows():
    phases = [{"name": "p", "duration": 200, "gpus": [0],
               "set": {"mig": {"mode": "disabled", "pending": "enabled"}}}]  # fmt: skip
    out = Node(scenario(phases)).polls(3)
    assert series(out, "gpu_mig_mode_change_pending") == {(): 1.0}
    assert series(out, "gpu_mig_mode") == {}


@pytest.mark.parametrize(
    ("name", "attributes", "profile"),
    [
        ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", None, "1g.10gb"),
        ("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", None, "3g.40gb"),
        ("NVIDIA A100-SXM4-80GB MIG 1g.10gb+me", None, "1g.10gb+me"),
        ("MIG-GPU", type("A", (), {"memorySizeMB": 19968, "gpuInstanceSliceCount": 2}), "2g.20gb"),
        ("", None, ""),
    ],
)
def test_the_profile_label_comes_from_the_mig_device_s_name(name, attributes, profile):
    assert profile_of(name, attributes) == profile


# -- the scenario format ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("instances", "node", "problem"),
    [
        ([{"gpu_instance": 1, "profile": "5g.50gb"}], {}, "not a profile of NVIDIA A100"),
        ([one_g(g) for g in range(1, 9)], {}, "no free placement"),
        (
            [{"gpu_instance": 1, "profile": "4g.40gb"}, {"gpu_instance": 2, "profile": "4g.40gb"}],
            {},
            "no free placement",
        ),
        ([one_g(7), one_g(7)], {}, "given twice"),
        ([{"gpu_instance": 1, "profile": "1g.10gb", "compute_slices": 2}], {}, "more than"),
        ([one_g(7, 9000)], {}, ""),  # fits: 9728 MiB
        ([one_g(7, 9800)], {}, "memory_used_mib over"),
        ([one_g(7)], {"gpu_model": "l40s"}, "does not support MIG"),
    ],
)
def test_mig_layouts_are_checked_against_the_model(instances, node, problem):
    phases = [mig_on(instances)]
    if not problem:
        scenario(phases, **node)
        return
    with pytest.raises(ValueError, match=problem):
        scenario(phases, **node)


def test_mig_owns_the_gpu_s_processes():
    with pytest.raises(ValueError, match="per instance"):
        scenario([{"name": "p", "duration": 1, "set": {
            "processes": [{"pid": 1}], "mig": {"instances": [one_g(7)]}}}])  # fmt: skip
    with pytest.raises(ValueError, match="only with mode: enabled"):
        scenario([{"name": "p", "duration": 1, "set": {
            "mig": {"mode": "disabled", "instances": [one_g(7)]}}}])  # fmt: skip
    values, _ = Timeline(scenario([mig_on(SEVEN)])).state(1)
    assert [p["pid"] for p in values[0]["processes"]] == [101, 102, 103]  # /proc gets them
    assert values[0]["memory_used_mib"] == 11000


def test_the_builtin_mig_scenarios_load(tmp_path):
    for name in ("mig-7x1g-a100-mixed-tenants", "mig-3g-4g-h100", "mig-mode-change-a100",
                 "mig-twin-shared-a100-no-mig"):  # fmt: skip
        assert load_scenario(name).expect
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nphases: [{name: p, duration: 1, set: {mig: {instances: "
                   "[{gpu_instance: 1, profile: 9g.1gb}]}}}]\n")  # fmt: skip
    with pytest.raises(ConfigError, match=r"phases\.0\.changes\.0\.set\.mig: instances\.0"):
        load_scenario(bad)
