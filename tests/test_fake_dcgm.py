"""The fake DCGM bindings and the simulated host engine, through the bindings' own API.

Every test loads the fake bindings directory the way the DCGM source loads real ones
(`load_bindings`), then uses pydcgm / dcgm_agent / dcgm_structs as DCGM's docs and
test suite do: the same classes, calls, return shapes, exceptions and blank values.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.sim import dcgm as simdcgm
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm import FAKE_BINDINGS, SimDcgm, SimHostengine
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sim.scenario import Scenario, Timeline
from gpuwatchd.sources.dcgm import Bindings, load_bindings

WALL0 = 1_700_000_000.0
PROFILING = list(range(1001, 1015))


def scenario(phases: list[dict[str, Any]] | None = None, **node: Any) -> Scenario:
    node = {"gpu_count": 2, "pcie_topology": "direct", **node}
    phases = phases or [
        {
            "name": "run",
            "duration": 600,
            "set": {
                "utilization_gpu": 90,
                "power_w": 300,
                "sm_active": 0.7,
                "tensor_active": 0.4,
                "dram_active": 0.3,
                "pcie_tx_mb_s": 100,
                "pcie_rx_mb_s": 2000,
                "nvlink_tx_mb_s": 5000,
                "nvlink_rx_mb_s": 6000,
                "memory_used_mib": 1024,
            },
        }
    ]
    return Scenario.model_validate({"name": "t", "node": node, "phases": phases})


class Node:
    """A simulated host engine at virtual time, and a private copy of the fake bindings."""

    def __init__(self, scn: Scenario | None = None, at: float = 0.0) -> None:
        self.timeline = Timeline(scn or scenario())
        self.clock = SimClock(virtual=True, start_wall=WALL0)
        self.clock.advance(at)
        self.engine = SimHostengine(self.timeline, self.clock)
        self.b: Bindings = load_bindings(FAKE_BINDINGS)
        self.pydcgm: Any = self.b.pydcgm
        self.structs: Any = self.b.structs
        self.agent: Any = self.b.agent
        self.fields: Any = self.b.fields

    def connect(self, **kwargs: Any) -> Any:
        return self.pydcgm.DcgmHandle(ipAddress=self.engine.address, **kwargs)

    def error(self, name: str) -> type[Exception]:
        return getattr(self.structs, name)

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def watch(n: Node, handle: Any, ids: list[int], name: str = "fg", gpus=(0, 1)) -> tuple[Any, Any]:
    system = handle.GetSystem()
    group = system.GetGroupWithGpuIds(name, list(gpus))
    field_group = n.pydcgm.DcgmFieldGroup(handle, name, ids)
    group.samples.WatchFields(field_group, 1_000_000, 3600.0, 0)
    return group, field_group


def latest(group: Any, field_group: Any) -> dict[int, dict[int, Any]]:
    """gpu -> field -> DcgmFieldValue (the last one)."""
    values = group.samples.GetLatest_v2(field_group).values
    return {gpu: {fid: s[-1] for fid, s in fields.items()} for gpu, fields in values[1].items()}


# -- loading -------------------------------------------------------------------------------


def test_loading_leaves_sys_path_and_modules_as_they_were():
    path_before, modules_before = list(sys.path), dict(sys.modules)
    impostor = types.ModuleType("dcgm_structs")
    sys.modules["dcgm_structs"] = impostor
    try:
        b = load_bindings(FAKE_BINDINGS)
        assert sys.modules["dcgm_structs"] is impostor  # displaced, then put back
        assert b.structs is not impostor and b.structs.DCGM_ST_OK == 0
    finally:
        del sys.modules["dcgm_structs"]
    assert sys.path == path_before
    assert {n for n in sys.modules if n not in modules_before} <= {
        n for n in sys.modules if n.startswith(("gpuwatchd", "ctypes", "_ctypes"))
    }
    for name in ("pydcgm", "dcgm_agent", "dcgm_fields", "dcgmvalue", "_sim", "DcgmHandle"):
        assert name not in sys.modules


def test_each_load_is_a_private_copy():
    a, b = load_bindings(FAKE_BINDINGS), load_bindings(FAKE_BINDINGS)
    assert a.structs is not b.structs and a.pydcgm is not b.pydcgm
    # the modules reach each other through their own globals, not sys.modules
    assert a.pydcgm.DcgmHandle.__init__.__globals__["dcgm_structs"] is a.structs
    assert set(a.modules) >= {
        "pydcgm",
        "dcgm_structs",
        "dcgm_agent",
        "dcgm_fields",
        "dcgmvalue",
        "dcgm_field_helpers",
        "DcgmHandle",
        "DcgmGroup",
        "DcgmSystem",
        "DcgmFieldGroup",
        "_sim",
    }


def test_a_directory_without_pydcgm_is_not_bindings(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        load_bindings(tmp_path)


# -- errors and blanks ----------------------------------------------------------------------


def test_error_classes_and_codes_are_dcgms(node: Node):
    s = node.structs
    assert s.DCGM_ST_CONNECTION_NOT_VALID == -21 and s.DCGM_ST_PROFILING_NOT_SUPPORTED == -36
    e = s.DCGMError(s.DCGM_ST_CONNECTION_NOT_VALID)
    assert type(e) is s.DCGMError_ConnectionNotValid
    assert isinstance(e, s.DCGMError) and e.value == -21
    assert s.dcgmExceptionClass(s.DCGM_ST_IN_USE) is s.DCGMError_InUse
    assert s.dcgmExceptionClass(s.DCGM_ST_3RD_PARTY_LIBRARY_ERROR).__name__ == (
        "DCGMError_3rdPartyLibraryError"
    )
    assert s.DCGMError_ProfilingNotSupported().value == -36
    assert "not valid" in str(e)
    e.SetAdditionalInfo("during connect")
    assert str(e).endswith("'during connect'")


def test_blank_sentinels_are_dcgms(node: Node):
    v = node.b.modules["dcgmvalue"]
    assert v.DCGM_INT64_BLANK == 0x7FFFFFFFFFFFFFF0 and v.DCGM_FP64_BLANK == 2.0**47
    assert v.DCGM_INT64_NOT_SUPPORTED == v.DCGM_INT64_BLANK + 2
    assert v.DCGM_FP64_NOT_PERMISSIONED == v.DCGM_FP64_BLANK + 3
    assert v.DCGM_INT32_NOT_FOUND == 0x7FFFFFF1
    assert v.DCGM_STR_NOT_SUPPORTED == "<<<NOT_SUPPORTED>>>"
    for blank in (v.DCGM_INT64_BLANK, v.DCGM_INT64_NOT_FOUND, v.DCGM_FP64_NOT_SUPPORTED):
        assert v.DcgmValue(blank).IsBlank()
    assert not v.DcgmValue(0).IsBlank() and not v.DcgmValue(0.5).IsBlank()
    d = v.DcgmValue(0)
    d.SetFromInt32(v.DCGM_INT32_NOT_SUPPORTED)
    assert d.value == v.DCGM_INT64_NOT_SUPPORTED


def test_field_values_with_blanks_or_bad_status_are_blank(node: Node):
    handle = node.connect()
    node.engine.set_value(1002, simdcgm.FP64_BLANK + simdcgm.NOT_SUPPORTED, gpu=0)
    node.engine.set_value(155, simdcgm.FP64_BLANK + simdcgm.NOT_PERMISSIONED, gpu=1)
    node.engine.set_value(202, simdcgm.INT64_BLANK + simdcgm.NOT_FOUND)
    group, fg = watch(node, handle, [155, 202, 1002])
    values = latest(group, fg)
    assert values[0][1002].isBlank and not values[1][1002].isBlank
    assert values[1][155].isBlank and not values[0][155].isBlank
    assert values[0][202].isBlank and values[1][202].isBlank
    # a field nobody watches: status NOT_WATCHED, so blank with no value
    unwatched = node.pydcgm.DcgmFieldGroup(handle, "other", [150])
    other = latest(group, unwatched)
    assert other[0][150].isBlank and other[0][150].value is None


# -- connecting -----------------------------------------------------------------------------


def test_connect_to_nothing_or_a_stopped_hostengine_fails_like_dcgm(node: Node):
    with pytest.raises(node.error("DCGMError_ConnectionNotValid")):
        node.pydcgm.DcgmHandle(ipAddress="localhost")
    with pytest.raises(node.error("DCGMError_ConnectionNotValid")):
        node.pydcgm.DcgmHandle(unixSocketPath="/run/nvidia-dcgm.sock")
    node.engine.stop()
    with pytest.raises(node.error("DCGMError_ConnectionNotValid")):
        node.connect(timeoutMs=1500)
    assert node.engine.connect_timeouts_ms == [1500]
    node.engine.start()
    assert node.connect().handle.value


def test_missing_libdcgm_is_library_not_found():
    with simdcgm.library_missing():
        b = load_bindings(FAKE_BINDINGS)
        with pytest.raises(b.structs.DCGMError_LibraryNotFound):
            b.pydcgm.DcgmHandle(ipAddress="localhost")


def test_embedded_mode_attaches_to_the_chosen_hostengine(node: Node):
    with pytest.raises(node.error("DCGMError_InitError")):
        node.pydcgm.DcgmHandle()
    simdcgm.use_for_embedded(node.engine)
    try:
        handle = node.pydcgm.DcgmHandle()
        assert handle.isEmbedded
        assert handle.GetSystem().discovery.GetAllSupportedGpuIds() == [0, 1]
    finally:
        simdcgm.use_for_embedded(None)


# -- discovery, groups, field groups --------------------------------------------------------


def test_discovery_matches_the_nvml_fake(node: Node):
    system = node.connect().GetSystem()
    assert system.discovery.GetAllGpuIds() == [0, 1]
    attrs = system.discovery.GetGpuAttributes(1)
    assert type(attrs).__name__ == "c_dcgmDeviceAttributes_v3"
    assert attrs.identifiers.uuid == gpu_uuid("sim-node", 1)
    assert attrs.identifiers.deviceName == "NVIDIA A100-SXM4-80GB"
    bus_id = attrs.identifiers.pciBusId
    assert bus_id.startswith("00000000:") and bus_id.endswith(".0")
    assert attrs.identifiers.driverVersion == "555.42.06"
    meta = system.fields.GetFieldById(1002)
    assert (meta.tag, meta.fieldType) == ("sm_active", "d")
    assert system.fields.GetFieldByTag("power_usage").fieldId == 155
    assert system.fields.GetFieldById(9999) is None
    version = node.agent.dcgmVersionInfo().rawBuildInfoString
    assert version.startswith("version:4.")


def test_more_than_32_gpus_is_beyond_dcgm():
    n = Node(scenario(gpu_count=40))
    try:
        assert len(n.connect().GetSystem().discovery.GetAllSupportedGpuIds()) == 32
    finally:
        n.close()


def test_groups_and_field_groups(node: Node):
    handle = node.connect()
    system = handle.GetSystem()
    group = system.GetGroupWithGpuIds("mine", [1])
    assert group.GetGpuIds() == [1]
    assert system.GetDefaultGroup().GetGpuIds() == [0, 1]
    with pytest.raises(node.error("DCGMError_DuplicateKey")):
        group.AddGpu(1)
    fg = node.pydcgm.DcgmFieldGroup(handle, "mine", [155, 1002])
    with pytest.raises(node.error("DCGMError_DuplicateKey")):
        node.pydcgm.DcgmFieldGroup(handle, "mine", [150])
    found = system.GetFieldGroupIdByName("mine")
    assert found.value == fg.fieldGroupId.value
    assert node.pydcgm.DcgmFieldGroup(handle, fieldGroupId=found).fieldIds == [155, 1002]
    # pydcgm destroys only field groups its process created: not another client's
    other = load_bindings(FAKE_BINDINGS).pydcgm
    theirs = other.DcgmFieldGroup(other.DcgmHandle(ipAddress=node.engine.address), "theirs", [150])
    node.pydcgm.DcgmFieldGroup(handle, fieldGroupId=theirs.fieldGroupId).Delete()
    assert system.GetFieldGroupIdByName("theirs") is not None
    assert system.GetFieldGroupIdByName("DCGM_INTERNAL_30SEC") is not None
    assert system.GetFieldGroupIdByName("nope") is None
    with pytest.raises(node.error("DCGMError_Badparam")):  # as nv-hostengine answers
        node.pydcgm.DcgmFieldGroup(handle, "bad", [9999])
    fg.Delete()
    assert system.GetFieldGroupIdByName("mine") is None


def test_a_clients_groups_go_when_it_disconnects(node: Node):
    a, b = node.connect(), node.connect()
    watch(node, a, [155], "a")
    watch(node, b, [150], "b")
    assert set(node.engine.groups()) == {"a", "b"}
    a.Shutdown()
    assert set(node.engine.groups()) == {"b"}
    assert (0, 155) not in node.engine.watched_fields()
    assert (0, 150) in node.engine.watched_fields()


# -- values -----------------------------------------------------------------------------------


def test_values_follow_the_scenario_in_dcgms_units():
    n = Node(at=100.0)
    try:
        handle = n.connect()
        ids = [155, 156, 203, 252, 253, 251, 1001, 1002, 1004, 1005, 1009, 1010, 1011, 1012]
        group, fg = watch(n, handle, ids)
        v = {fid: value.value for fid, value in latest(group, fg)[0].items()}
        assert v[155] == 300.0 and isinstance(v[155], float)  # W, double
        assert v[156] == 30_000_000 and isinstance(v[156], int)  # mJ since t=0: 300 W x 100 s
        assert v[203] == 90  # percent, int64
        assert v[252] == 1024 and v[251] + v[252] + v[253] == 81920  # MiB
        assert (v[1002], v[1004], v[1005]) == (0.7, 0.4, 0.3)
        assert v[1001] == pytest.approx(0.9)  # not in the scenario: from utilization_gpu
        assert (v[1009], v[1010]) == (100_000_000, 2_000_000_000)  # bytes per second
        assert (v[1011], v[1012]) == (5_000_000_000, 6_000_000_000)
        ts = latest(group, fg)[0][155].ts
        assert ts == round((WALL0 + 100.0) * 1e6)  # µs since the epoch
    finally:
        n.close()


def test_samples_are_taken_on_the_watch_interval():
    scn = scenario(
        [
            {
                "name": "ramp",
                "duration": 100,
                "set": {"utilization_gpu": 0},
                "ramp": {"power_w": [100, 300]},
            }
        ]
    )
    n = Node(scn)
    try:
        handle = n.connect()
        system = handle.GetSystem()
        group = system.GetGroupWithGpuIds("g", [0])
        fg = n.pydcgm.DcgmFieldGroup(handle, "g", [155, 156])
        group.samples.WatchFields(fg, 10_000_000, 60.0, 0)  # every 10 s
        n.clock.advance(57)
        v = latest(group, fg)[0]
        assert v[155].value == pytest.approx(200.0)  # the sample at 50 s
        assert v[156].value == 100 * 50 * 1000 + 0.5 * 2 * 50**2 * 1000  # exact integral
        n.clock.advance(43)
        assert latest(group, fg)[0][156].value == pytest.approx(20_000_000)  # 100 s at 200 W
    finally:
        n.close()


def test_violation_time_counts_throttled_nanoseconds():
    scn = scenario(
        [
            {"name": "capped", "duration": 30, "set": {"clock_event_reasons": ["sw_power_cap"]}},
            {
                "name": "hot",
                "duration": 20,
                "set": {"clock_event_reasons": ["hw_thermal_slowdown"]},
            },
        ]
    )
    n = Node(scn, at=50)
    try:
        group, fg = watch(n, n.connect(), [240, 241, 244])
        v = {fid: value.value for fid, value in latest(group, fg)[0].items()}
        assert v == {240: 30 * 10**9, 241: 20 * 10**9, 244: 0}
    finally:
        n.close()


def test_xids_from_the_timeline_and_injected():
    scn = scenario(
        [
            {"name": "ok", "duration": 10},
            {"name": "bad", "duration": 10, "gpus": [1], "set": {"xid": [79]}},
        ]
    )
    n = Node(scn, at=15)
    try:
        group, fg = watch(n, n.connect(), [230])
        assert {gpu: v[230].value for gpu, v in latest(group, fg).items()} == {0: 0, 1: 79}
        n.engine.inject_xid(0, 48)
        assert latest(group, fg)[0][230].value == 48
    finally:
        n.close()


def test_lost_gpu_answers_blank_with_gpu_is_lost():
    scn = scenario([{"name": "lost", "duration": 10, "gpus": [1], "set": {"lost": True}}])
    n = Node(scn, at=1)
    try:
        handle = n.connect()
        group, fg = watch(n, handle, [155])
        values = latest(group, fg)
        assert not values[0][155].isBlank and values[1][155].isBlank
        raw = n.agent.dcgmEntityGetLatestValues(handle.handle, 1, 1, [155])
        assert raw[0].status == n.structs.DCGM_ST_GPU_IS_LOST
    finally:
        n.close()


def test_entities_get_latest_values_reads_live(node: Node):
    handle = node.connect()
    pair = node.structs.c_dcgmGroupEntityPair_t(1, 0)
    values = node.agent.dcgmEntitiesGetLatestValues(handle.handle, [pair], [155, 203], 1)
    assert [(v.entityId, v.fieldId, v.status) for v in values] == [(0, 155, 0), (0, 203, 0)]
    assert values[0].value.dbl == 300.0 and values[1].value.i64 == 90
    not_live = node.agent.dcgmEntitiesGetLatestValues(handle.handle, [pair], [155], 0)
    assert not_live[0].status == node.structs.DCGM_ST_NOT_WATCHED


def test_entities_get_latest_values_fills_dcgm_field_value_v2_as_libdcgm_does(node: Node):
    handle = node.connect()
    node.engine.set_value(202, "n/a", gpu=1)  # a text where a number was expected
    node.engine.set_value(1002, simdcgm.FP64_BLANK + simdcgm.NOT_SUPPORTED, gpu=0)
    group, fg = watch(node, handle, [155, 202, 1002, 156])
    pairs = [node.structs.c_dcgmGroupEntityPair_t(1, gpu) for gpu in (1, 0)]
    ids = [155, 202, 1002, 156, 150]  # 150: nobody watches it
    values = node.agent.dcgmEntitiesGetLatestValues(handle.handle, pairs, ids, 0)
    assert type(values).__name__ == "c_dcgmFieldValue_v2_Array_10"
    assert {v.version for v in values} == {node.structs.dcgmFieldValue_version2}
    # entity by entity, field by field, as the host engine's one request answers
    assert [(v.entityGroupId, v.entityId, v.fieldId) for v in values] == [
        (1, gpu, fid) for gpu in (1, 0) for fid in ids
    ]
    by = {(v.entityId, v.fieldId): v for v in values}
    assert by[(1, 202)].fieldType == ord("s") and by[(1, 202)].value.str == "n/a"
    assert by[(0, 1002)].value.dbl == simdcgm.FP64_BLANK + simdcgm.NOT_SUPPORTED
    assert by[(0, 150)].status == node.structs.DCGM_ST_NOT_WATCHED
    # the values and times the callback API delivers for the same watch
    for gpu, fields in latest(group, fg).items():
        for fid, value in fields.items():
            raw = by[(gpu, fid)]
            assert (raw.ts, raw.status) == (value.ts, 0)
            if not value.isBlank:
                member = {"d": "dbl", "i": "i64", "s": "str"}[chr(raw.fieldType)]
                assert value.value == getattr(raw.value, member)
    with pytest.raises(node.error("DCGMError_Badparam")):  # as libdcgm checks its arguments
        node.agent.dcgmEntitiesGetLatestValues(handle.handle, [], [155], 0)
    with pytest.raises(node.error("DCGMError_Badparam")):
        node.agent.dcgmEntitiesGetLatestValues(handle.handle, pairs, [], 0)


def test_an_older_libdcgm_lacks_symbols():
    with simdcgm.library_without("dcgmEntitiesGetLatestValues"):
        n = Node()
        try:
            handle = n.connect()
            pair = n.structs.c_dcgmGroupEntityPair_t(1, 0)
            with pytest.raises(n.error("DCGMError_FunctionNotFound")):
                n.agent.dcgmEntitiesGetLatestValues(handle.handle, [pair], [155], 1)
            group, fg = watch(n, handle, [155])
            assert latest(group, fg)[0][155].value == 300.0
        finally:
            n.close()


def test_device_fields_a_model_lacks_are_not_supported_blanks():
    n = Node(scenario(gpu_model="rtx-4090"))
    try:
        group, fg = watch(n, n.connect(), [140, 393, 409, 155])
        v = latest(group, fg)[0]
        for fid in (140, 393, 409):
            assert v[fid].isBlank and v[fid].value == simdcgm.INT64_BLANK + simdcgm.NOT_SUPPORTED
        assert not v[155].isBlank
    finally:
        n.close()


# -- profiling --------------------------------------------------------------------------------


def supported(n: Node, handle: Any, gpu: int) -> set[int]:
    groups = n.agent.dcgmProfGetSupportedMetricGroups(handle.handle, gpu)
    assert type(groups).__name__ == "c_dcgmProfGetMetricGroups_v3"
    return {
        groups.metricGroups[i].fieldIds[j]
        for i in range(groups.numMetricGroups)
        for j in range(groups.metricGroups[i].numFieldIds)
    }


def test_datacenter_gpus_support_the_profiling_metric_groups(node: Node):
    handle = node.connect()
    assert supported(node, handle, 0) == set(PROFILING)
    group = handle.GetSystem().GetGroupWithGpuIds("g", [0, 1])
    assert group.profiling.GetSupportedMetricGroups().numMetricGroups == 9
    n = Node(scenario(gpu_model="l40s"))  # no NVLink: no NVLink profiling fields
    try:
        assert supported(n, n.connect(), 0) == set(PROFILING) - {1011, 1012}
    finally:
        n.close()


def test_geforce_refuses_profiling_like_the_real_thing():
    n = Node(scenario(gpu_model="rtx-4090"))
    try:
        handle = n.connect()
        with pytest.raises(n.error("DCGMError_ProfilingNotSupported")):
            n.agent.dcgmProfGetSupportedMetricGroups(handle.handle, 0)
        group = handle.GetSystem().GetGroupWithGpuIds("g", [0, 1])
        fg = n.pydcgm.DcgmFieldGroup(handle, "mixed", [155, 1002])
        with pytest.raises(n.error("DCGMError_ProfilingNotSupported")):
            group.samples.WatchFields(fg, 1_000_000, 60.0, 0)
        # the whole field group's watch is dropped, device fields included
        assert latest(group, fg)[0][155].isBlank
        n.engine.unsupported_profiling = "empty"
        assert supported(n, handle, 0) == set()
    finally:
        n.close()


def test_pause_blanks_profiling_until_resume(node: Node):
    handle = node.connect()
    group, fg = watch(node, handle, [155, 1002])
    system = handle.GetSystem()
    system.profiling.Pause()
    assert node.engine.profiling_paused
    values = latest(group, fg)[0]
    assert values[1002].isBlank and values[1002].value == simdcgm.FP64_BLANK
    assert not values[155].isBlank
    system.profiling.Resume()
    assert latest(group, fg)[0][1002].value == 0.7


def test_hopper_profiles_through_gpm_and_cannot_pause():
    n = Node(scenario(gpu_model="h100-sxm5-80gb"))
    try:
        with pytest.raises(n.error("DCGMError_NotSupported")):
            n.connect().GetSystem().profiling.Pause()
    finally:
        n.close()


def test_another_profiler_holding_the_counters(node: Node):
    handle = node.connect()
    group, fg = watch(node, handle, [1002], "before")
    node.engine.hold_profiling()
    assert latest(group, fg)[0][1002].isBlank
    with pytest.raises(node.error("DCGMError_InUse")):
        watch(node, handle, [1004], "during")
    node.engine.hold_profiling(False)
    assert latest(group, fg)[0][1002].value == 0.7


@pytest.mark.parametrize("refusal", ["DCGMError_InUse", "DCGMError_ProfilingNotSupported"])
def test_a_profiling_refusal_undoes_every_watch_of_its_field_group(refusal: str):
    """As DCGM's WatchFieldGroup: any field DCGM_FIELD_ID_IS_PROF_FIELD covers (1013 and
    1014 as much as 1001-1012) goes to the profiling module, and when it refuses, the
    group's watches are all undone: the device field's, and one set up before."""
    geforce = refusal == "DCGMError_ProfilingNotSupported"
    n = Node(scenario(gpu_model="rtx-4090" if geforce else "a100-sxm4-80gb"))
    try:
        handle = n.connect()
        assert n.b.fields.DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE == 1014
        assert not geforce or not n.engine.supported_profiling_fields(0)
        group = handle.GetSystem().GetGroupWithGpuIds("g", [0, 1])
        fg = n.pydcgm.DcgmFieldGroup(handle, "mixed", [155, 1013, 1014])
        if not geforce:
            group.samples.WatchFields(fg, 1_000_000, 60.0, 0)  # watched, then refused
            assert (0, 155) in n.engine.watched_fields()
            assert latest(group, fg)[0][1014].value == 0.4  # HMMA: the tensor work
            n.engine.hold_profiling()
        with pytest.raises(n.error(refusal)):
            group.samples.WatchFields(fg, 1_000_000, 60.0, 0)
        assert not n.engine.watched_fields()
        assert latest(group, fg)[0][155].isBlank
        # a field group of device fields only is no business of the profiling module's
        device = n.pydcgm.DcgmFieldGroup(handle, "device", [155])
        group.samples.WatchFields(device, 1_000_000, 60.0, 0)
        assert latest(group, device)[0][155].value == 300.0
    finally:
        n.close()


# -- host engine restarts -----------------------------------------------------------------------


def restart_scenario() -> Scenario:
    return scenario(
        [
            {"name": "up", "duration": 60},
            {"name": "down", "duration": 30, "host": {"dcgm_hostengine_up": False}},
            {"name": "back", "duration": 60, "host": {"dcgm_hostengine_up": True}},
        ]
    )


def test_a_restarting_hostengine_invalidates_connections_and_forgets_everything():
    n = Node(restart_scenario())
    try:
        handle = n.connect()
        group, fg = watch(n, handle, [155, 1002])
        system = handle.GetSystem()
        system.profiling.Pause()
        n.clock.advance(70)
        with pytest.raises(n.error("DCGMError_ConnectionNotValid")):
            latest(group, fg)
        with pytest.raises(n.error("DCGMError_ConnectionNotValid")):
            n.connect()
        n.clock.advance(30)  # a new nv-hostengine process
        with pytest.raises(n.error("DCGMError_ConnectionNotValid")):
            system.discovery.GetAllGpuIds()  # the old connection stays dead
        fresh = n.connect()
        assert fresh.GetSystem().GetFieldGroupIdByName("fg") is None
        assert n.engine.groups() == {} and not n.engine.profiling_paused
        handle.Shutdown()  # disconnecting a dead connection is fine
    finally:
        n.close()


def test_restart_hook_and_looping_timelines():
    n = Node()
    try:
        handle = n.connect()
        n.engine.restart()
        with pytest.raises(n.error("DCGMError_ConnectionNotValid")):
            handle.GetSystem().discovery.GetAllGpuIds()
        assert n.connect().GetSystem().discovery.GetAllGpuIds() == [0, 1]
    finally:
        n.close()
    timeline = Timeline(restart_scenario(), loop=True)
    engine = SimHostengine(timeline, SimClock(virtual=True), register_it=False)
    assert [engine._generation(t) for t in (10, 70, 100, 160, 250, 310)] == [0, 0, 1, 1, 2, 2]
    assert [engine.up(t) for t in (10, 70, 100, 220)] == [True, False, True, False]


# -- the simulated node's installation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "where"),
    [
        ("4", "usr/share/datacenter-gpu-manager-4/bindings/python3"),
        ("3", "usr/local/dcgm/bindings/python3"),
        ("none", None),
    ],
)
def test_sim_node_installs_the_bindings_where_dcgm_does(tmp_path: Path, version: str, where):
    timeline = Timeline(scenario(dcgm=version))
    sim = SimDcgm(timeline, SimClock(virtual=True), tmp_path)
    try:
        extras = sim.context_extras()
        assert extras["rootfs"] == tmp_path
        if where is None:
            assert sim.hostengine is None and not (tmp_path / "usr").exists()
            assert simdcgm.lookup(extras["dcgm_hostengine"]) is None
        else:
            assert (tmp_path / where / "pydcgm.py").is_file()
            assert simdcgm.lookup(extras["dcgm_hostengine"]) is sim.hostengine
            expected = "3.3.9" if version == "3" else "4.2.3"
            assert sim.hostengine is not None and sim.hostengine.version == expected
    finally:
        sim.close()
    assert simdcgm.lookup(extras["dcgm_hostengine"]) is None


# -- what hid issue 13's findings: the real bindings' behaviour, modelled ------------------------


def test_shutdown_leaves_the_handle_in_the_bindings_registry(node: Node):
    """DCGM 4.5+'s DcgmHandle tracks every handle it connects and Shutdown never untracks it."""
    handles = node.pydcgm.DcgmHandle.handles
    first, second = node.connect(), node.connect()
    first.Shutdown()
    second.Shutdown()
    assert handles == [first, second] and first.handle is None and second.handle is None


def test_a_field_group_holds_at_most_127_fields(node: Node):
    handle = node.connect()
    numeric = sorted(f for f, info in simdcgm.FIELDS.items() if info.type in "di")
    assert len(numeric) >= 128
    with pytest.raises(node.error("DCGMError_Badparam")):  # DCGM_MAX_FIELD_IDS_PER_FIELD_GROUP
        node.pydcgm.DcgmFieldGroup(handle, "too many", numeric[:128])
    assert len(node.pydcgm.DcgmFieldGroup(handle, "most", numeric[:127]).fieldIds) == 127
    with pytest.raises(node.error("DCGMError_Badparam")):
        node.pydcgm.DcgmFieldGroup(handle, "none", [])


def test_text_fields_read_as_str_and_blobs_fail_inside_the_bindings(node: Node, monkeypatch):
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    group, fg = watch(node, node.connect(), [50, 54, 57, 155])
    v = latest(group, fg)[1]
    assert (v[50].value, v[54].value) == ("NVIDIA A100-SXM4-80GB", gpu_uuid("sim-node", 1))
    assert isinstance(v[57].value, str) and v[57].value.startswith("00000000:")
    assert not unraisable
    # a binary field: DcgmFieldValue raises in the enumeration callback, which ctypes
    # reports and swallows; libdcgm, called back once per value, reads the garbage result
    # as "stop": every value after the blob is lost, the other GPU's included
    group, fg = watch(node, node.connect(), [155, 130, 150], "blob")
    values = latest(group, fg)
    assert len(unraisable) == 1 and "Blobs not handled" in str(unraisable[0].exc_value)
    assert set(values) == {0} and set(values[0]) == {155}


def test_dcgm_gpu_ids_need_not_be_nvml_indices():
    n = Node(scenario(gpu_count=4))
    try:
        # DCGM re-detected the GPUs and kept their ids by UUID; NVML renumbered them
        n.engine.set_gpu_ids([2, 0, 3, 5])  # the DCGM id of NVML index 0, 1, 2, 3
        n.engine.set_value(155, 111.0, gpu=3)  # NVML index 3
        handle = n.connect()
        discovery = handle.GetSystem().discovery
        assert discovery.GetAllSupportedGpuIds() == [0, 2, 3, 5]
        assert discovery.GetGpuAttributes(5).identifiers.uuid == gpu_uuid("sim-node", 3)
        group, fg = watch(n, handle, [52, 155], gpus=(0, 5))
        v = latest(group, fg)
        assert (v[0][52].value, v[5][52].value) == (1, 3)  # DCGM_FI_DEV_NVML_INDEX
        assert v[5][155].value == 111.0 and v[0][155].value == 300.0
        with pytest.raises(n.error("DCGMError_Badparam")):
            handle.GetSystem().GetGroupWithGpuIds("no such gpu", [1])
    finally:
        n.close()


def test_the_hostengines_work_is_counted_apart_for_a_benchmark(tmp_path: Path, monkeypatch):
    """nv-hostengine is a process of its own: a benchmark leaves its work out of the
    client's CPU. Embedded, the host engine is the client's own and is not counted."""
    path = tmp_path / "dcgm"
    monkeypatch.setenv(simdcgm.library.STATS_ENV, str(path))
    n = Node()
    try:
        simdcgm.use_for_embedded(n.engine)
        embedded = n.pydcgm.DcgmHandle()
        pair = n.structs.c_dcgmGroupEntityPair_t(1, 0)
        n.agent.dcgmEntitiesGetLatestValues(embedded.handle, [pair], [155, 203], 1)
        assert float(path.read_text().split()[2]) == 0.0
        handle = n.connect()
        n.agent.dcgmEntitiesGetLatestValues(handle.handle, [pair], [155, 203], 1)
        _, calls, cpu = path.read_text().split()
        assert int(calls) >= 3 and cpu == f"{n.engine.cpu_seconds:.6f}" and float(cpu) > 0
    finally:
        simdcgm.use_for_embedded(None)
        n.close()
