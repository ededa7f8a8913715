"""MIG, round two (issue 42 items 2, 5, 6 and 7): what the driver does as a MIG layout
changes, played by the fake libnvidia-ml under the real pynvml, and the nvml source
following it: nvmlEventMigConfigChange, Xids without the MIG monitor capability, row
remapping on a MIG GPU with instances, and an instance's Xid counts ending with it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from dcgm_sim import sims
from test_mig import MIB, Node, mig_on, one_g, scenario, series

from gpuwatchd.sources.nvml.reads import SLOW_EVERY

NO_ID = 0xFFFFFFFF
FE_GPU = 1  # DCGM_FE_GPU
MIG_OFF = {"name": "off", "duration": 60, "gpus": [0], "set": {"mig": {"mode": "disabled"}}}


def events_of(node: Node, events: Any) -> list[tuple[int, int, int, int]]:
    """Every event waiting in the set: (GPU index, type, data, GPU instance id)."""
    nv, out = node.nv, []
    while True:
        try:
            data = nv.nvmlEventSetWait_v2(events, 0)
        except nv.NVMLError_Timeout:
            return out
        gpu = nv.nvmlDeviceGetIndex(data.device)
        out.append((gpu, data.eventType, data.eventData, data.gpuInstanceId))


# -- nvmlEventMigConfigChange (item 2) ------------------------------------------------------


def test_mig_config_changes_are_asked_for_alone_and_come_as_instances_change():
    """nvml.h: a registration the driver refuses (NOT_SUPPORTED) registers none of the
    types it asks for; the fake supports nvmlEventMigConfigChange only on a MIG-enabled
    GPU (DCGM asks for it only there), and raises it on the parent when a phase creates
    or destroys a MIG device."""
    phases = [
        {"name": "whole", "duration": 10},
        mig_on([one_g(7)], 10),
        mig_on([one_g(7)], 10),  # the same layout again (memory, processes): no change
        mig_on([one_g(7), one_g(8)], 10),
    ]
    node = Node(scenario(phases))
    nv, h = node.nv, node.handle(0)
    xid, change = nv.nvmlEventTypeXidCriticalError, nv.nvmlEventMigConfigChange
    events = nv.nvmlEventSetCreate()
    assert not nv.nvmlDeviceGetSupportedEventTypes(h) & change
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceRegisterEvents(h, xid | change, events)
    node.fake.inject_xid(0, 13)
    assert events_of(node, events) == []  # the Xids went with the refused type
    nv.nvmlDeviceRegisterEvents(h, xid, events)
    node.clock.advance(10)
    assert nv.nvmlDeviceGetSupportedEventTypes(h) & change
    nv.nvmlDeviceRegisterEvents(h, change, events)
    node.clock.advance(15)
    assert events_of(node, events) == []
    node.clock.advance(10)
    assert events_of(node, events) == [(0, change, 0, NO_ID)]
    nv.nvmlEventSetFree(events)


def test_a_reused_mig_handle_is_caught_in_the_poll_of_the_change():
    """GI 8 destroyed and GI 10 created at its index, its handle reused (nvml.h: "may be
    reused and their properties can change"): the source reads the layout again in the
    poll that drains the nvmlEventMigConfigChange, not at the next slow re-check."""
    before = [one_g(7, 1000, (101,)), one_g(8, 3000, (102,))]
    after = [one_g(7, 1000, (101,)), {**one_g(10, 5000, (110,)), "index": 1}]
    node = Node(scenario([mig_on(before, 33), mig_on(after, 60)]))
    node.fake.mig_handle_reuse = True
    first = node.polls(33)  # polls at 0..32 s; the next at 33 s, the change's
    assert {labels[0] for labels in series(first, "gpu_instance_info")} == {"7", "8"}
    assert 33 % SLOW_EVERY  # not a slow re-check's poll
    out = node.poll()
    used = series(out, "gpu_instance_memory_used_bytes")
    assert used == {("7", "0", "1g.10gb"): 1000 * MIB, ("10", "0", "1g.10gb"): 5000 * MIB}
    registered = node.fake.gpu_calls[("nvmlDeviceRegisterEvents", 0)]
    assert registered == 2  # the Xids, and the MIG changes in a call of their own
    assert node.fake.gpu_calls[("nvmlDeviceRegisterEvents", 1)] == 1  # no MIG there


# -- Xids without the MIG monitor capability (item 6) ---------------------------------------


@pytest.mark.parametrize("monitor", [True, False])
def test_an_instance_s_xid_needs_the_mig_monitor_capability(monitor, caplog):
    """nvml.h (nvmlEventSetWait_v2): in MIG mode the events of every instance only with
    the capability; without it only those affecting all instances (the whole GPU). The
    source says once that the capability is missing, and what that costs."""
    node = Node(scenario([mig_on([one_g(7), one_g(8)], 60)], mig_monitor=monitor))
    caplog.set_level(logging.WARNING, "gpuwatchd.sources.nvml")
    node.polls(3)
    warned = [r for r in caplog.records if "no MIG monitor capability" in r.getMessage()]
    assert len(warned) == (0 if monitor else 1)
    node.fake.inject_xid(0, 43, gpu_instance=8)
    node.fake.inject_xid(0, 79)  # the whole GPU's
    out = node.poll()
    instance = {("8", "1g.10gb", "43"): 1.0} if monitor else {}
    assert series(out, "gpu_instance_xid_errors_total") == instance
    whole = {("79",): 1.0, ("43",): 1.0} if monitor else {("79",): 1.0}
    assert series(out, "gpu_xid_errors_total") == whole


# -- row remapping on a MIG GPU (item 5) ------------------------------------------------------


def test_remapped_rows_are_not_supported_on_a_mig_gpu_with_instances():
    """nvml.h: "On MIG-enabled GPUs with active instances, querying the number of
    remapped rows is not supported": the call and its field values, until the last
    instance is gone."""
    node = Node(scenario([mig_on([one_g(7)], 10), mig_on([], 10), MIG_OFF]))
    nv, h = node.nv, node.handle(0)
    pending = nv.NVML_FI_DEV_REMAPPED_PENDING
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetRemappedRows(h)
    assert nv.nvmlDeviceGetFieldValues(h, [pending])[0].nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED
    assert nv.nvmlDeviceGetRemappedRows(node.handle(1)) == (0, 0, 0, 0)
    for _ in range(2):  # MIG on without instances, then MIG off
        node.clock.advance(10)
        assert nv.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
        assert nv.nvmlDeviceGetFieldValues(h, [pending])[0].nvmlReturn == nv.NVML_SUCCESS


@pytest.mark.parametrize("then", [MIG_OFF, mig_on([], 60)], ids=["mig-off", "no-instances"])
def test_row_remapping_is_read_again_once_mig_allows_it(then):
    """Refused while GPU 0 has instances, the row remapper's flags come back after MIG
    is turned off or its last instance destroyed: not lost for the daemon's life."""
    node = Node(scenario([mig_on([one_g(7), one_g(8)], 30), then]))
    during = node.polls(30)
    assert series(during, "gpu_row_remap_pending") == {}
    assert series(during, "gpu_row_remap_pending", gpu=1) == {(): 0.0}
    after = node.polls(SLOW_EVERY + 2)
    assert series(after, "gpu_row_remap_pending") == {(): 0.0}
    assert series(after, "gpu_row_remap_failed") == {(): 0.0}


# -- an instance's Xid counts (item 7) ----------------------------------------------------------


def test_an_instance_s_xid_count_ends_with_it_and_a_new_one_starts_from_none():
    """GI 8's Xid 43 is counted for it; GI 8 destroyed, its count goes (the GPU's stays);
    made again with the same id and profile (another tenant), it has none."""
    both, one = [one_g(7), one_g(8)], [one_g(7)]
    node = Node(scenario([mig_on(both, 20), mig_on(one, 20), mig_on(both, 20)]))
    node.poll()
    node.fake.inject_xid(0, 43, gpu_instance=8)
    counted = node.polls(5)
    assert series(counted, "gpu_instance_xid_errors_total") == {("8", "1g.10gb", "43"): 1.0}
    gone = node.polls(20)
    assert series(gone, "gpu_instance_xid_errors_total") == {}
    assert series(gone, "gpu_xid_errors_total") == {("43",): 1.0}
    again = node.polls(20)
    assert {labels[0] for labels in series(again, "gpu_instance_info")} == {"7", "8"}
    assert series(again, "gpu_instance_xid_errors_total") == {}


@pytest.fixture
def make(tmp_path):
    yield from sims(tmp_path)


def test_dcgm_has_no_remapped_rows_on_a_mig_gpu_with_instances(make):
    """DCGM reads row remapping through NVML: on GPU 0 (MIG, three instances) the fields
    answer DCGM's NOT_SUPPORTED blank, on GPU 1 (whole) their values."""
    sim = make("mig-instances-dcgm-xid-a100")
    sim.source.collect()
    session = sim.source._session
    bindings, handle = session.bindings, session.handle.handle
    pair = bindings.structs.c_dcgmGroupEntityPair_t
    entities = [pair(FE_GPU, 0), pair(FE_GPU, 1)]
    values = bindings.agent.dcgmEntitiesGetLatestValues(handle, entities, [393, 396], 1)
    got = {(v.entityId, v.fieldId): v.value.i64 for v in values}
    blank = bindings.value.DCGM_INT64_NOT_SUPPORTED
    assert got == {(0, 393): blank, (0, 396): blank, (1, 393): 0, (1, 396): 0}
