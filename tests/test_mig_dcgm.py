"""MIG phase 2 (issue 26): DCGM per GPU instance and Xids per instance.

The fake DCGM's GPU-instance entities and hierarchy under the fake bindings, the DCGM
source reading them into the instance forms (and dcgm-exporter's MIG labels) as the MIG
layout changes at run time, and NVML's Xid events naming the instance they hit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from dcgm_sim import Sim, sims
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.config import NvmlConfig
from gpuwatchd.exporter import Exporter
from gpuwatchd.metrics import Sample
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm import library_without
from gpuwatchd.sim.fake_nvml import make_pynvml
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.dcgm.fields import INSTANCE_SPECS
from gpuwatchd.sources.dcgm.mig import MIG_EVERY
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.store import Store

P = "gpuwatchd_"
SCENARIO = (
    "mig-instances-dcgm-xid-a100"  # GPU 0: GI 2 3g.40gb 95 %, GI 3 2g.20gb 10 %, GI 9 1g 60 %
)
FE_GPU, FE_GPU_I, FE_GPU_CI = 1, 4, 5
NO_ID = 0xFFFFFFFF


@pytest.fixture
def make(tmp_path: Path):
    yield from sims(tmp_path)


def instances(samples: list[Sample], name: str, gpu: int = 0) -> dict[tuple[str, ...], float]:
    """`name`'s instance-form series of one GPU, by (gpu_instance, profile, ...)."""
    return {
        s.labels[2:]: s.value for s in samples if s.name == P + name and s.labels[0] == str(gpu)
    }


def poll_until(sim: Sim, t: float, every: float = 5.0) -> list[Sample]:
    """Poll every `every` seconds of the node's clock up to `t`; the last poll's samples."""
    samples = sim.source.collect()
    while sim.clock.elapsed() + every <= t:
        sim.advance(every)
        samples = sim.source.collect()
    return samples


# -- the fake DCGM ------------------------------------------------------------------------------


def connected(sim: Sim) -> tuple[Any, Any]:
    sim.source.collect()
    session = sim.source._session
    assert session is not None
    return session.bindings, session.handle.handle


def test_the_hierarchy_has_dcgm_s_shape_ids_and_order(make):
    sim = make("mig-3g-4g-h100")  # both GPUs: GI 1 4g.40gb, GI 2 3g.40gb; GPU 1's 3g: 3 CIs
    bindings, handle = connected(sim)
    hierarchy = bindings.agent.dcgmGetGpuInstanceHierarchy(handle)
    assert type(hierarchy).__name__ == "c_dcgmMigHierarchy_v2"
    rows = [hierarchy.entityList[k] for k in range(hierarchy.count)]
    shape = [
        (r.entity.entityGroupId, r.entity.entityId, r.parent.entityGroupId, r.parent.entityId,
         r.info.nvmlInstanceId, r.info.nvmlComputeInstanceId, r.info.nvmlProfileSlices)
        for r in rows
    ]  # fmt: skip
    # DCGM numbers entities gpuId * 7 + k, walking the profiles in index order (3g before
    # 4g), each GPU instance followed by its compute instances
    assert shape == [
        (FE_GPU_I, 0, FE_GPU, 0, 2, NO_ID, 3),
        (FE_GPU_CI, 0, FE_GPU_I, 0, 2, 0, 3),
        (FE_GPU_I, 1, FE_GPU, 0, 1, NO_ID, 4),
        (FE_GPU_CI, 1, FE_GPU_I, 1, 1, 0, 4),
        (FE_GPU_I, 7, FE_GPU, 1, 2, NO_ID, 3),
        (FE_GPU_CI, 7, FE_GPU_I, 7, 2, 0, 1),
        (FE_GPU_CI, 8, FE_GPU_I, 7, 2, 1, 1),
        (FE_GPU_CI, 9, FE_GPU_I, 7, 2, 2, 1),
        (FE_GPU_I, 8, FE_GPU, 1, 1, NO_ID, 4),
        (FE_GPU_CI, 10, FE_GPU_I, 8, 1, 0, 4),
    ]
    assert {r.info.gpuUuid.decode() if isinstance(r.info.gpuUuid, bytes) else r.info.gpuUuid
            for r in rows[:4]} == {sim.engine.uuids[0]}  # fmt: skip


def test_a_gpu_instance_answers_as_dcgm_does_per_field(make):
    sim = make(SCENARIO)
    bindings, handle = connected(sim)
    structs = bindings.structs
    pair = structs.c_dcgmGroupEntityPair_t
    # entities in DCGM's order, profile by profile: 0 the 1g, 1 the 2g, 2 the 3g; 5: none
    entities = [pair(FE_GPU_I, e) for e in (0, 1, 2, 5)]
    values = bindings.agent.dcgmEntitiesGetLatestValues(
        handle, entities, [50, 1001, 1005, 155, 1009], structs.DCGM_FV_FLAG_LIVE_DATA
    )
    got = {(v.entityId, v.fieldId): v for v in values}
    assert [got[(e, 50)].value.str for e in (0, 1, 2)] == ["1g.10gb", "2g.20gb", "3g.40gb"]
    assert [got[(e, 1001)].value.dbl for e in (0, 1, 2)] == pytest.approx([0.60, 0.10, 0.95])
    assert got[(0, 1005)].status == structs.DCGM_ST_OK  # a GPU_I-level field
    assert got[(0, 155)].value.dbl == 300.0  # a device field: its GPU's value
    assert got[(0, 1009)].status == structs.DCGM_ST_NO_DATA  # GPU-level profiling: none
    assert {got[(5, f)].status for f in (50, 1001, 155)} == {structs.DCGM_ST_INSTANCE_NOT_FOUND}
    # the whole MIG GPU: each instance weighted by its share of the 7 compute slices
    whole = bindings.agent.dcgmEntitiesGetLatestValues(handle, [pair(FE_GPU, 0)], [1001], 1)
    assert whole[0].value.dbl == pytest.approx((3 * 0.95 + 2 * 0.10 + 0.60) / 7)
    # DCGM's field metadata: the profiling ratios are below the GPU's level, PCIe is not
    levels = {f: bindings.fields.DcgmFieldGetById(f).entityLevel for f in (1001, 1005, 1009, 155)}
    assert levels == {1001: FE_GPU_CI, 1005: FE_GPU_I, 1009: FE_GPU, 155: FE_GPU}


# -- the DCGM source ----------------------------------------------------------------------------


def test_the_source_exports_each_gpu_instance_s_activity_as_the_instance_form(make):
    sim = make(SCENARIO)
    samples = sim.source.collect()
    gr = instances(samples, "gpu_instance_gr_engine_active_ratio")
    assert gr == pytest.approx({("2", "3g.40gb"): 0.95, ("3", "2g.20gb"): 0.10,
                                ("9", "1g.10gb"): 0.60})  # fmt: skip
    sm = instances(samples, "gpu_instance_sm_active_ratio")
    assert sm[("2", "3g.40gb")] == pytest.approx(0.9 * 0.95)
    # the GPU's own families stay, with DCGM's whole-GPU value; PCIe is the GPU's only
    whole = instances(samples, "gpu_gr_engine_active_ratio")
    assert whole[()] == pytest.approx((3 * 0.95 + 2 * 0.10 + 0.60) / 7)
    assert not instances(samples, "gpu_instance_dcgm_pcie_rx_bytes_per_second")
    assert instances(samples, "gpu_dcgm_pcie_rx_bytes_per_second")[()] == 1.2e9
    assert not instances(samples, "gpu_instance_gr_engine_active_ratio", gpu=1)  # no MIG
    # the instance forms are the source's families, read by the rules as the GPU's
    specs = {s.name: s for s in sim.source.metrics}
    spec = specs[P + "gpu_instance_gr_engine_active_ratio"]
    assert spec.instance_of == P + "gpu_gr_engine_active_ratio"
    assert spec.labels == ("gpu", "uuid", "gpu_instance", "profile")
    assert all(s.name in specs for s in INSTANCE_SPECS.values())
    # the engine's activity is the instance's utilization (the same value, shown once)
    assert instances(samples, "gpu_instance_utilization_ratio") == gr
    text = exposition(sim, samples)
    assert P + "gpu_instance_gr_engine_active_ratio" not in text  # detail: shown as ...
    uuid = sim.engine.uuids[0]
    labels = text[P + "gpu_instance_utilization_ratio"]
    assert {"gpu": "0", "uuid": uuid, "gpu_instance": "9", "profile": "1g.10gb"} in labels
    assert P + "gpu_instance_sm_active_ratio" in text


def test_an_instance_s_own_activity_apart_from_its_utilization(make):
    """Issue 39's format: an instance's SMs, tensor pipes and DRAM as the scenario gives
    them (a hung kernel: engine 100 %, the rest idle), not derived from its utilization;
    the whole GPU's are the instances' weighted by their compute slices."""
    sim = make("mig-instance-hang-busy-neighbour-a100")
    samples = poll_until(sim, 240.0)  # GI 1 hung since 180 s
    got = {name: instances(samples, f"gpu_instance_{name}_ratio")
           for name in ("utilization", "sm_active", "tensor_active", "dram_active")}  # fmt: skip
    assert got["utilization"] == pytest.approx({("1", "3g.40gb"): 1.0, ("2", "3g.40gb"): 0.95})
    assert got["sm_active"] == pytest.approx({("1", "3g.40gb"): 0.03, ("2", "3g.40gb"): 0.45})
    assert got["tensor_active"][("1", "3g.40gb")] == 0.0
    assert got["dram_active"] == pytest.approx({("1", "3g.40gb"): 0.002, ("2", "3g.40gb"): 0.6})
    whole = instances(samples, "gpu_dram_active_ratio")[()]
    assert whole == pytest.approx((3 * 0.002 + 3 * 0.6) / 7)


def test_dcgm_3_bindings_without_entity_level_read_the_instances(make):
    """DCGM 3.x's bindings (to 3.3.9) have no entityLevel in c_dcgm_field_meta_t: the
    level comes from DCGM's field table, and the source (non-MIG GPUs too) stays up."""
    scn = load_scenario(SCENARIO)
    sim = make(scn.model_copy(update={"node": scn.node.model_copy(update={"dcgm": "3"})}))
    bindings, _ = connected(sim)
    meta = bindings.fields.DcgmFieldGetById(1001)
    assert "entityLevel" not in dict(meta._fields_) and meta.fieldId == 1001
    samples = sim.source.collect()
    gr = instances(samples, "gpu_instance_gr_engine_active_ratio")
    assert set(gr) == {("2", "3g.40gb"), ("3", "2g.20gb"), ("9", "1g.10gb")}
    assert not instances(samples, "gpu_instance_dcgm_pcie_rx_bytes_per_second")  # GPU level
    assert instances(samples, "gpu_gr_engine_active_ratio", gpu=1)[()] > 0.85


def exposition(sim: Sim, samples: list[Sample]) -> dict[str, list[dict[str, str]]]:
    store = Store()
    store.register_source("dcgm", float("inf"))
    store.update("dcgm", 0.0, samples)
    text = Exporter(store, [], sim.source.metrics, lambda: 0.0).render().text.decode()
    return {
        f.name: [dict(s.labels) for s in f.samples] for f in text_string_to_metric_families(text)
    }


def test_the_source_follows_instances_created_and_destroyed_at_run_time(make):
    sim = make("mig-mode-change-a100", at=0.0)
    gr = "gpu_instance_gr_engine_active_ratio"
    assert not instances(poll_until(sim, 5 * 60), gr)  # MIG pending, then off
    # 6m: two 3g.40gb created; found within MIG_EVERY polls (no hierarchy read per poll)
    found = instances(poll_until(sim, 6 * 60 + 5 * MIG_EVERY), gr)
    assert found == pytest.approx({("1", "3g.40gb"): 0.90, ("2", "3g.40gb"): 0.50})
    # 11m: destroyed, seven 1g.10gb created (DCGM reuses entity ids for other instances):
    # the first poll after reads the new layout, never an old GI's label on a new one's
    found = instances(poll_until(sim, 11 * 60 + 5), gr)
    assert set(found) == {(str(gi), "1g.10gb") for gi in range(7, 14)}
    # 16m: MIG disabled: the instances' reads fail, the next poll finds none
    at_16m = poll_until(sim, 16 * 60 + 10)
    assert not instances(at_16m, gr)
    assert instances(at_16m, "gpu_gr_engine_active_ratio")[()] == pytest.approx(0.92)
    hierarchy_reads = sim.engine.calls["dcgmGetGpuInstanceHierarchy"]
    without = (6 * 60) // 5  # polls before any instance: one read in MIG_EVERY
    with_instances = (10 * 60 + 10) // 5 + 1  # from 6m to 16m10s: one read a poll
    assert hierarchy_reads <= without // MIG_EVERY + with_instances + 4


def layouts(*phases: list[dict[str, Any]] | None, every: float = 30) -> Any:
    """A two-A100 node whose GPU 0 has each MIG layout (None: MIG disabled) for `every` s."""
    steps = [
        {"name": f"p{k}", "duration": every, "gpus": [0],
         "set": {"mig": {"mode": "disabled"} if gis is None else {"instances": gis}}}
        for k, gis in enumerate(phases)
    ]  # fmt: skip
    node = {"gpu_model": "a100-sxm4-80gb", "gpu_count": 2, "pcie_topology": "switched"}
    initial = {"utilization_gpu": 90, "power_w": 300, "memory_used_mib": 1024}
    return Scenario.model_validate(
        {"name": "t", "node": {**node, "initial": initial}, "phases": steps}
    )


def test_a_gpu_instance_re_created_with_another_profile_is_relabelled(make):
    """GI 1 destroyed and created again as a 1g.20gb: the same GI id, the same DCGM entity
    and slice count; only the profile id tells (issue 42 item 4)."""
    before = [{"gpu_instance": 1, "profile": "1g.10gb", "utilization_gpu": 50}]
    after = [{"gpu_instance": 1, "profile": "1g.20gb", "utilization_gpu": 50}]
    sim = make(layouts(before, after), at=0.0)
    gr = "gpu_instance_gr_engine_active_ratio"
    assert set(instances(poll_until(sim, 25), gr)) == {("1", "1g.10gb")}
    assert set(instances(poll_until(sim, 35), gr)) == {("1", "1g.20gb")}


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("three", "off"),  # MIG disabled
        ("three", "one"),  # two instances destroyed
        ("off", "three"),  # MIG enabled with instances
    ],
)
def test_compat_rows_follow_a_layout_change_at_once(make, first: str, then: str):
    """The first poll after a layout change has no row of an instance that is gone, and
    (once DCGM shows the instances) no whole-GPU row of a GPU that has instances."""
    gis = [{"gpu_instance": g, "profile": "2g.20gb"} for g in (3, 4, 5)]
    shapes = {"three": gis, "one": gis[:1], "off": None}
    sim = make(layouts(shapes[first], shapes[then]), at=0.0, exporter_compat=True,
               interval=5.0)  # fmt: skip
    poll_until(sim, 25)
    expected = {
        "three": {("2g.20gb", "3"), ("2g.20gb", "4"), ("2g.20gb", "5")},
        "one": {("2g.20gb", "3")},
        "off": {("", "")},
    }[then]
    rows: set[tuple[str, str]] = set()
    while sim.clock.elapsed() < 30 + 5 * MIG_EVERY:
        sim.advance(5)
        rows = {
            (s.labels[5], s.labels[6])  # GPU_I_PROFILE, GPU_I_ID
            for s in sim.source.collect()
            if s.name.startswith("DCGM_FI_") and s.labels[0] == "0"
        }
        # MIG enabled shows within MIG_EVERY polls (one hierarchy read in MIG_EVERY)
        waiting = {("", "")} if then == "three" else expected
        assert rows in (expected, waiting), (sim.clock.elapsed(), rows)
    assert rows == expected


def test_without_the_hierarchy_call_the_source_reads_the_gpus_as_before(make, caplog):
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    with library_without("dcgmGetGpuInstanceHierarchy"):
        sim = make(SCENARIO)
        samples = sim.source.collect()
    assert not instances(samples, "gpu_instance_gr_engine_active_ratio")
    assert instances(samples, "gpu_gr_engine_active_ratio")[()] > 0.4
    assert any("no MIG GPU instances read" in r.getMessage() for r in caplog.records)


def test_exporter_compat_labels_instances_as_dcgm_exporter_does(make):
    sim = make(SCENARIO, exporter_compat=True)
    samples = sim.source.collect()
    text = exposition(sim, samples)
    gr = [s for s in text["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] if s["gpu"] == "0"]
    assert {(s["GPU_I_ID"], s["GPU_I_PROFILE"]) for s in gr} == {
        ("2", "3g.40gb"), ("3", "2g.20gb"), ("9", "1g.10gb")
    }  # fmt: skip
    assert {s["UUID"] for s in gr} == {sim.engine.uuids[0]}
    # dcgm-exporter's default ("flex") mode: a MIG GPU's device fields once per instance,
    # with the GPU's value (DCGM's answer on a GPU instance), and no whole-GPU row
    power = {
        (s.labels[0], s.labels[5], s.labels[6]): s.value
        for s in samples
        if s.name == "DCGM_FI_DEV_POWER_USAGE"
    }
    assert power == {("0", "3g.40gb", "2"): 300.0, ("0", "2g.20gb", "3"): 300.0,
                     ("0", "1g.10gb", "9"): 300.0, ("1", "", ""): 300.0}  # fmt: skip
    assert not [s for s in samples if s.name == "DCGM_FI_PROF_PCIE_RX_BYTES" and s.labels[0] == "0"]
    gpu1 = [s for s in text["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] if s["gpu"] == "1"]
    assert [(s["GPU_I_ID"], s["GPU_I_PROFILE"]) for s in gpu1] == [("", "")]


def test_compat_framebuffer_and_xid_rows_carry_each_instance_s_own_value(make):
    """DCGM_FI_DEV_FB_* and DCGM_FI_DEV_XID_ERRORS are compute-instance-level fields:
    DCGM answers them per GPU instance (its MIG device's memory; the Xids filed on it),
    and dcgm-exporter exports those, not the GPU's (issue 42 item 3)."""
    sim = make(SCENARIO, exporter_compat=True, at=0.0)

    def rows(samples: list[Sample], name: str) -> dict[tuple[str, ...], float]:
        return {(*s.labels[5:7], *s.labels[9:10]): s.value for s in samples
                if s.name == name and s.labels[0] == "0"}  # fmt: skip

    samples = poll_until(sim, 60)
    assert rows(samples, "DCGM_FI_DEV_FB_USED") == {
        ("3g.40gb", "2"): 36000, ("2g.20gb", "3"): 6000, ("1g.10gb", "9"): 7000
    }  # fmt: skip
    assert rows(samples, "DCGM_FI_DEV_FB_FREE")[("1g.10gb", "9")] == 9728 - 7000
    assert rows(samples, "DCGM_FI_DEV_FB_RESERVED")[("2g.20gb", "3")] == 0
    assert rows(samples, "DCGM_FI_DEV_POWER_USAGE")[("2g.20gb", "3")] == 300  # the GPU's
    whole = {s.labels[5:7]: s.value for s in samples
             if s.name == "DCGM_FI_DEV_FB_USED" and s.labels[0] == "1"}  # fmt: skip
    assert whole == {("", ""): 60000}
    samples = poll_until(sim, 3 * 60 + 10)  # 3m: Xid 43 on GI 9 (the driver names it)
    xids = {(s.labels[5], s.labels[6], s.labels[9]) for s in samples
            if s.name == "DCGM_FI_DEV_XID_ERRORS" and s.labels[0] == "0"}  # fmt: skip
    assert xids == {("3g.40gb", "2", "0"), ("2g.20gb", "3", "0"), ("1g.10gb", "9", "43")}
    assert sim.engine.calls["dcgmGetGpuInstanceHierarchy"] > 0


def test_paused_profiling_blanks_the_instances_too(make):
    sim = make(SCENARIO)
    sim.source.collect()
    sim.source.pause_profiling(60)
    sim.advance(5)
    assert not instances(sim.source.collect(), "gpu_instance_gr_engine_active_ratio")
    sim.advance(60)
    assert instances(sim.source.collect(), "gpu_instance_gr_engine_active_ratio")


# -- Xid per instance (NVML) ----------------------------------------------------------------


class NvmlNode:
    """A fake node in virtual time and an NVML source reading it through the real pynvml."""

    def __init__(self, name: str) -> None:
        self.clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
        self.nv = make_pynvml(Timeline(load_scenario(name)), self.clock)
        self.fake = self.nv._gpuwatchd_fake
        # the simulator's wait: for the reader, never for a real-time deadline
        extras = {
            "now": self.clock.now,
            "clock": self.clock.elapsed,
            "nvml_wait": self.fake.wait_for,
        }
        self.source = NvmlSource(NvmlConfig(), Context(pynvml=self.nv, extras=extras))

    def until(self, t: float) -> list[Sample]:
        samples = self.source.collect()
        while self.clock.elapsed() + 5 <= t:
            self.clock.advance(5)
            samples = self.source.collect()
        return samples


def test_an_xid_on_a_mig_instance_counts_for_the_gpu_and_the_instance():
    node = NvmlNode(SCENARIO)  # 3m: Xid 43 on GPU 0's GI 9 (1g.10gb)
    before = node.until(2 * 60)
    assert not instances(before, "gpu_instance_xid_errors_total")
    after = node.until(3 * 60 + 10)
    assert instances(after, "gpu_xid_errors_total") == {("43",): 1.0}
    assert instances(after, "gpu_instance_xid_errors_total") == {("9", "1g.10gb", "43"): 1.0}
    # a whole-GPU Xid on the MIG GPU (0xFFFFFFFF ids) and one on GPU 1: the GPUs' only
    node.fake.inject_xid(0, 79)
    node.fake.inject_xid(1, 13)
    node.clock.advance(5)
    later = node.source.collect()
    assert instances(later, "gpu_xid_errors_total") == {("43",): 1.0, ("79",): 1.0}
    assert instances(later, "gpu_instance_xid_errors_total") == {("9", "1g.10gb", "43"): 1.0}
    assert instances(later, "gpu_xid_errors_total", gpu=1) == {("13",): 1.0}
    assert not instances(later, "gpu_instance_xid_errors_total", gpu=1)
    # an injected one naming an instance (GI 3, CI 0)
    node.fake.inject_xid(0, 31, gpu_instance=3)
    node.clock.advance(5)
    xids = instances(node.source.collect(), "gpu_instance_xid_errors_total")
    assert xids[("3", "2g.20gb", "31")] == 1.0


def test_the_fake_driver_names_the_instance_in_the_event_data():
    node = NvmlNode(SCENARIO)
    nv = node.nv
    nv.nvmlInit()
    events = nv.nvmlEventSetCreate()
    for gpu in (0, 1):
        handle = nv.nvmlDeviceGetHandleByIndex(gpu)
        nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
    node.clock.advance(3 * 60 + 1)
    data = nv.nvmlEventSetWait_v2(events, 0)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (43, 9, 0)
    node.fake.inject_xid(1, 13)
    data = nv.nvmlEventSetWait_v2(events, 0)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (13, NO_ID, NO_ID)
    nv.nvmlEventSetFree(events)
