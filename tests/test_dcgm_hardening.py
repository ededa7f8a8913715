"""Issue 13's DCGM findings (12-14), each against the fake modelled on DCGM's real bindings.

12: text and binary fields: rejected by the config, skipped if DCGM itself says a field is
    not a number, and one value that is not a number never fails the poll.
13: nothing accumulates in the bindings' registries (field groups of failed watches,
    handles of past connections), and more than 127 fields are split across field groups.
14: the `gpu` label is NVML's index (DCGM_FI_DEV_NVML_INDEX), not DCGM's GPU id.
Virtual time throughout; nothing sleeps.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from dcgm_sim import Metrics, P, Sim, scenario, sims, state_of

from gpuwatchd.config import ConfigError, DcgmConfig, load_config
from gpuwatchd.sim import dcgm as simdcgm
from gpuwatchd.sim.dcgm.hostengine import HostengineDown
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sources.dcgm import DcgmSource


@pytest.fixture
def make(tmp_path: Path):
    yield from sims(tmp_path)


def unchecked(sim: Sim, **config: Any) -> DcgmSource:
    """A source on `sim` whose config skipped validation, as for a field our table lacks
    (a newer DCGM's) or a host engine of another DCGM version than the bindings."""
    sim.source.close()
    sim.source = DcgmSource(DcgmConfig.model_construct(**config), sim.source.context)
    return sim.source


# -- 12: text and binary fields -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kind"), [(50, "text"), (54, "text"), (57, "text"), (1, "text"), (130, "binary")]
)
def test_the_config_rejects_text_and_binary_fields(tmp_path: Path, field: int, kind: str):
    path = tmp_path / "gpuwatchd.yaml"
    path.write_text(f"sources:\n  dcgm:\n    fields: [155, {field}, 1002]\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: sources.dcgm.fields: field {field} is a {kind} field")
    assert "numeric" in message


def test_fields_dcgm_says_are_not_numbers_are_skipped_once(make, caplog, monkeypatch):
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    caplog.set_level(logging.WARNING, "gpuwatchd.sources.dcgm")
    sim = make()
    source = unchecked(sim, fields=[155, 50, 130, 9999, 1002])
    for _ in range(3):
        m = Metrics(source.collect())
        assert m.state() == "connected"
        assert m.value("gpu_dcgm_power_watts", 1) == 300.0
        assert m.value("gpu_sm_active_ratio", 0) == 0.7
        sim.advance(5)
    assert not [n for n, labels, _ in m.samples if labels[2:3] in {("50",), ("130",)}]
    assert not unraisable  # the blob never reached the bindings' value parser
    skipped = [r.getMessage() for r in caplog.records if "not watching" in r.getMessage()]
    assert len(skipped) == 1
    for why in ("50 (name): a text field", "130 (supported_clocks): a binary field", "9999"):
        assert why in skipped[0]
    assert 50 not in sim.engine.field_groups()[f"gpuwatchd_{os.getpid()}"]


def test_a_value_that_is_not_a_number_never_fails_the_poll(make, caplog):
    caplog.set_level(logging.WARNING, "gpuwatchd.sources.dcgm")
    sim = make()
    sim.engine.set_value(155, "n/a", gpu=0)  # a host engine of another version than the bindings
    for _ in range(2):
        m = sim.collect()
        assert m.state() == "connected"
        assert m.value("gpu_dcgm_power_watts", 1) == 300.0 and m.value("gpu_sm_active_ratio", 0)
        assert ("0",) not in {labels[:1] for labels in m.by_name[P + "gpu_dcgm_power_watts"]}
        sim.advance(5)
    warned = [r.getMessage() for r in caplog.records if "'n/a'" in r.getMessage()]
    assert len(warned) == 1 and "field 155" in warned[0]


# -- 13: leaks and the 127-field limit ------------------------------------------------------------


def registries(source: DcgmSource) -> tuple[int, int]:
    """(field groups, handles) the source's copy of the bindings is holding on to."""
    pydcgm = source._bindings.pydcgm  # type: ignore[union-attr]
    return len(pydcgm.DcgmFieldGroup.groups), len(pydcgm.DcgmHandle.handles)


def test_refused_profiling_retries_leave_no_field_groups_behind(make):
    sim = make(profiling_retry=60.0)
    sim.engine.hold_profiling()  # every profiling watch fails (DCGM_ST_IN_USE)
    for _ in range(6):
        assert sim.collect().profiling(0) == "refused"
        sim.advance(60)
    assert registries(sim.source) == (1, 1)  # the device fields' group; one handle
    sim.engine.hold_profiling(False)
    assert sim.collect().profiling(0) == "active"
    assert registries(sim.source) == (2, 1)


def test_reconnects_leave_no_handles_behind(make):
    sim = make()
    for _ in range(6):
        assert sim.collect().state() == "connected"
        sim.engine.restart()
        sim.down()  # connection_lost: the next poll reconnects
    assert sim.collect().state() == "connected"
    assert registries(sim.source) == (2, 1)
    sim.source.close()
    assert registries(sim.source) == (0, 0)


@pytest.mark.parametrize(
    ("failure", "state"),
    [("hostengine_stops", "hostengine_down"), ("bindings_mismatch", "error")],
)
def test_setup_failing_halfway_leaves_nothing_behind(make, failure, state):
    sim = make()
    real = sim.engine.watch
    calls = []

    def dies_at_the_second_watch(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 2:
            if failure == "bindings_mismatch":  # not a DCGMError: bindings of another DCGM
                raise TypeError("unexpected argument")
            sim.engine.stop()
            raise HostengineDown
        real(*args)

    sim.engine.watch = dies_at_the_second_watch  # type: ignore[method-assign]
    assert state_of(sim.down()) == state
    sim.engine.watch = real  # type: ignore[method-assign]
    sim.engine.start()
    sim.advance(3600)
    assert sim.collect().state() == "connected"
    assert registries(sim.source) == (2, 1)
    # the half-made field group of the dead connection, collected whenever the collector
    # runs, must not take the new connection's group (same id, new host engine) with it
    gc.collect()
    assert registries(sim.source) == (2, 1)


def test_more_than_127_fields_are_split_across_field_groups(make):
    numeric = [f for f, info in simdcgm.FIELDS.items() if info.type in "di" and not info.profiling]
    assert len(numeric) > 127
    sim = make(fields=numeric)
    m = sim.collect()
    assert m.state() == "connected"
    ours = {n: ids for n, ids in sim.engine.field_groups().items() if n.startswith("gpuwatchd_")}
    assert len(ours) == 2 and all(len(ids) <= 127 for ids in ours.values())
    assert set(numeric) <= {fid for ids in ours.values() for fid in ids}
    raw = {int(labels[2]) for labels in m.by_name[P + "gpu_dcgm_field_value"]}
    assert raw & set(ours[f"gpuwatchd_{os.getpid()}_2"])  # values of both groups arrive
    assert m.value("gpu_dcgm_power_watts", 0) == 300.0 and 200 in raw


# -- 14: the gpu label is NVML's index ------------------------------------------------------------


def renumbered(make: Any, **config: Any) -> Sim:
    """Four GPUs whose DCGM ids are not their NVML indices; power 100 + NVML index."""
    sim = make(scenario(gpu_count=4), **config)
    sim.engine.set_gpu_ids([2, 0, 3, 5])  # the DCGM id of NVML index 0, 1, 2, 3
    for index in range(4):
        sim.engine.set_value(155, 100.0 + index, gpu=index)
    return sim


def test_gpu_labels_are_nvml_indices_when_dcgm_ids_differ(make):
    sim = renumbered(make)
    m = sim.collect()
    for index in range(4):
        assert m.value("gpu_dcgm_power_watts", index) == 100.0 + index
        assert m.profiling(index) == "active"
    for name, labels, _ in m.samples:
        if name.startswith(P + "gpu_"):
            index = int(labels[0])
            assert labels[1] == gpu_uuid("node7", index), (name, labels)


def test_compat_labels_keep_dcgm_ids_as_dcgm_exporter_does(make):
    sim = renumbered(make, exporter_compat=True)
    samples = sim.source.collect()
    power = {labels[:2]: v for n, labels, v in samples if n == "DCGM_FI_DEV_POWER_USAGE"}
    assert power[("5", gpu_uuid("node7", 3))] == 103.0
    assert power[("0", gpu_uuid("node7", 1))] == 101.0


def test_the_gpu_label_follows_nvml_index_changes_while_connected(make, caplog):
    caplog.set_level(logging.INFO, "gpuwatchd.sources.dcgm")
    sim = renumbered(make)
    sim.collect()
    sim.engine.set_value(52, 7, gpu=3)  # NVML renumbered that GPU; DCGM kept its id (5)
    sim.advance(5)
    m = sim.collect()
    assert m.value("gpu_dcgm_power_watts", 7) == 103.0 and m.profiling(7) == "active"
    assert "3" not in {labels[0] for labels in m.by_name[P + "gpu_dcgm_power_watts"]}
    assert any("DCGM GPU 5 is NVML GPU 7 now" in r.getMessage() for r in caplog.records)
