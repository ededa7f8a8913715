"""Issue 25's DCGM findings, each through the real source on the fake modelled on DCGM's
real bindings (virtual time throughout; nothing sleeps).

1. Profiling fields past 1012 (DCGM's profiling range is 1001-1096 and 1532/1533): a
   refused profiling watch must never take the device fields' watch with it.
2. The fallback read (a libdcgm without dcgmEntitiesGetLatestValues) survives a value it
   cannot decode: the walk goes on, nothing raises inside libdcgm's callback.
3. dcgm-exporter's `Hostname` is $NODE_NAME when set; the DaemonSet sets it.
4. Xid `err_msg` texts: NVIDIA's published meanings, as dcgm-exporter exports them.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from dcgm_sim import P, Sim, scenario, sims

from gpuwatchd.metrics import Sample
from gpuwatchd.sim import dcgm as simdcgm
from gpuwatchd.sources.dcgm import fields as dcgm_fields

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def make(tmp_path: Path):
    yield from sims(tmp_path)


def series(samples: list[Sample]) -> dict[tuple[str, tuple[str, ...]], float]:
    """Every series but the source's own state (profiling state and DCGM state)."""
    return {
        (s.name, s.labels): s.value
        for s in samples
        if not s.name.startswith((P + "dcgm_", P + "gpu_dcgm_profiling_state"))
    }


# -- 1: the whole profiling range ---------------------------------------------------------------

TENSOR_PIPES = [1013, 1014]  # DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE, _HMMA_ACTIVE


@pytest.mark.parametrize(
    ("model", "refusal", "state"),
    [
        ("a100-sxm4-80gb", "DCGM_ST_IN_USE", "refused"),  # another profiler holds the counters
        ("rtx-4090", "DCGM_ST_PROFILING_NOT_SUPPORTED", "unsupported"),  # GeForce: never
    ],
)
def test_profiling_fields_past_1012_never_take_the_device_fields_down(
    make, model: str, refusal: str, state: str
):
    scn = scenario(gpu_model=model)
    fields = [*dcgm_fields.DEFAULT_FIELDS, *TENSOR_PIPES]
    runs = []
    for configured in (list(dcgm_fields.DEFAULT_FIELDS), fields):
        sim: Sim = make(scn, fields=configured)
        sim.engine.hold_profiling(refusal == "DCGM_ST_IN_USE")
        m = sim.collect()
        assert m.state() == "connected"
        assert [m.profiling(gpu) for gpu in (0, 1)] == [state, state]
        assert m.value("gpu_dcgm_power_watts", 0) == m.value("gpu_dcgm_power_watts", 1) == 300.0
        runs.append(series(m.samples))
    assert runs[1] == runs[0]  # every device series, and nothing of the refused fields
    device = sim.engine.field_groups()[f"gpuwatchd_{os.getpid()}"]
    assert not set(device) & {*range(1001, 1015)}
    if refusal == "DCGM_ST_IN_USE":  # once the counters are free, the tensor pipes too
        sim.engine.hold_profiling(False)
        sim.advance(sim.config.profiling_retry)
        m = sim.collect()
        assert m.profiling(0) == "active"
        assert m.value("gpu_dcgm_field_value", 0, "1014") == 0.4
        assert m.value("gpu_dcgm_field_value", 0, "1013") == 0.0


def test_the_bindings_name_the_profiling_fields():
    """DCGM_FI_PROF_* of the bindings' dcgm_fields (a newer DCGM's, past 1096, included)."""
    newer = types.SimpleNamespace(
        DCGM_FI_PROF_GR_ENGINE_ACTIVE=1001,
        DCGM_FI_PROF_SOMETHING_NEW=1100,
        DCGM_FI_DEV_POWER_USAGE=155,
        DCGM_FI_PROF_FIRST_ID_NAME="not an id",
    )
    ids = dcgm_fields.profiling_ids(newer)
    assert {1001, 1013, 1014, 1096, 1532, 1533, 1100} <= ids and 155 not in ids
    plan = dcgm_fields.FieldPlan.of([155, 1002, 1014, 1100]).classified(ids)
    assert plan.profiling == [1002, 1014, 1100]
    assert plan.device_groups() == [[52, 155]]


# -- 2: the fallback read survives a value it cannot decode ----------------------------------------


def test_the_fallback_read_goes_on_past_a_blob(make, monkeypatch, caplog):
    """A host engine of another version answers a blob for GPU 0's power: the values after
    it in libdcgm's walk (GPU 0's others, GPU 1's) arrive, as through the bulk read."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    caplog.set_level(logging.WARNING, "gpuwatchd.sources.dcgm")
    runs = []
    for without in ((), ("dcgmEntitiesGetLatestValues",)):
        with simdcgm.library_without(*without):
            sim = make()
            sim.engine.set_value(155, b"\x01\x02\x03", gpu=0)
            polls = []
            for _ in range(3):
                m = sim.collect()
                assert m.state() == "connected"
                assert m.value("gpu_dcgm_power_watts", 1) == 300.0
                assert m.value("gpu_sm_active_ratio", 0) == 0.7
                powered = {labels[0] for labels in m.by_name[P + "gpu_dcgm_power_watts"]}
                assert powered == {"1"}  # GPU 0's power is the blob: left out
                polls.append(series(m.samples))
                sim.advance(5)
            runs.append(polls)
    assert sim.engine.calls["dcgmGetLatestValues_v2"] > 0  # the fallback was read
    assert runs[1] == runs[0]
    assert not unraisable  # nothing raised inside libdcgm's callback
    warned = [r.getMessage() for r in caplog.records if "not a number" in r.getMessage()]
    assert len(warned) == 2 and all("field 155" in w for w in warned)  # once per source


# -- 3: Hostname is $NODE_NAME when the DaemonSet sets it ----------------------------------------


def hostnames(sim: Sim) -> set[str]:
    return {
        s.labels[7]  # after gpu, UUID, pci_bus_id, device, modelName, GPU_I_PROFILE, GPU_I_ID
        for s in sim.source.collect()
        if s.name == "DCGM_FI_DEV_POWER_USAGE"
    }


def test_hostname_is_node_name_when_set(make):
    assert hostnames(make(exporter_compat=True)) == {"node7"}
    assert hostnames(make(exporter_compat=True, environ={"NODE_NAME": ""})) == {"node7"}
    named = make(exporter_compat=True, environ={"NODE_NAME": "gpu-node-12"})
    assert hostnames(named) == {"gpu-node-12"}


def test_the_daemonset_sets_node_name_from_the_downward_api():
    daemonset = yaml.safe_load((ROOT / "deploy/kubernetes/daemonset.yaml").read_text())
    (container,) = [
        c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "gpuwatchd"
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


# -- 4: Xid err_msg as dcgm-exporter exports it ---------------------------------------------------

# err_msg of DCGM_FI_DEV_XID_ERRORS in dcgm-exporter 4.x (internal/pkg/collector/
# xid_errors.go, after its "XID errors v580" update), for a sample of codes
DCGM_EXPORTER_ERR_MSG = {
    0: "No Error",
    8: "GPU stopped processing",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    43: "GPU stopped processing",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
    137: "NVLink Privilege Error",
    140: "Unrecovered ECC Error",
    149: "NVLINK: NETIR Error",
    154: "GPU Recovery Action Changed",
    172: "Uncorrectable SRAM Error",
}


def test_xid_messages_match_dcgm_exporters(make):
    sim = make(exporter_compat=True)
    seen = {}
    for code in [*DCGM_EXPORTER_ERR_MSG, 173]:
        if code:
            sim.engine.inject_xid(1, code)
        sim.advance(5)
        (xid,) = [
            s.labels
            for s in sim.source.collect()
            if s.name == "DCGM_FI_DEV_XID_ERRORS" and s.labels[0] == "1"
        ]
        seen[int(xid[-2])] = xid[-1]
    assert seen == {**DCGM_EXPORTER_ERR_MSG, 173: "Unknown Error"}
