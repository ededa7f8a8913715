"""The probe on MIG (issue 26): a probed process on a MIG-enabled GPU reports under the
instance forms of the probe families (`gpu_instance_probe_*{gpu, uuid, gpu_instance,
profile}`) of the GPU instance NVML lists it on, never under the whole GPU's; a GPU
without MIG reads exactly as before. Through the real path: a simulated node (the fake
NVML answering MIG as the driver does), the probe source's own ingestion of datagrams
with the sender's pid, the nvml source's per-MIG-device lists where the parent's list
needs the MIG monitor capability, and `simulate --check` of the scenario."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.config import NvmlConfig, ProbeConfig
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sim.fake_nvml_mig import mig_uuid
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.probe import ProbeSource
from tests.series import Metrics

P = "gpuwatchd_"
HOST = "h"
GOOD = {"v": 1, "batches": 10, "wait_seconds": 9.0, "compute_seconds": 1.0}
PROBE_GPU_FAMILIES = (
    "probe_pid", "probe_rank", "probe_batches_total", "probe_wait_seconds_total",
    "probe_compute_seconds_total", "probe_loader_workers", "probe_loader_pin_memory",
    "probe_loader_prefetch_factor", "probe_loader_persistent_workers",
    "probe_loader_batch_size", "probe_cuda_reserved_bytes", "probe_cuda_allocated_bytes",
    "probe_cuda_inactive_split_bytes", "probe_cuda_largest_free_block_bytes",
    "probe_cuda_alloc_retries_total", "probe_cuda_ooms_total", "probe_cuda_init_seconds",
    "probe_cuda_init_timestamp_seconds",
)  # fmt: skip


def mig_scenario(monitor: bool = True, probe: dict[int, Any] | None = None) -> Scenario:
    """Two H100s: GPU 0 MIG-enabled, pid 100 on GI 1 (4g.40gb), pids 200 (more memory)
    and 201 on GI 2 (3g.40gb); GPU 1 a whole GPU with pid 300."""
    gi1 = {"gpu_instance": 1, "profile": "4g.40gb", "memory_used_mib": 3000,
           "processes": [{"pid": 100, "gpu_memory_mib": 3000}]}  # fmt: skip
    gi2 = {"gpu_instance": 2, "profile": "3g.40gb", "memory_used_mib": 2000,
           "processes": [{"pid": 200, "gpu_memory_mib": 1500},
                         {"pid": 201, "gpu_memory_mib": 500}]}  # fmt: skip
    return Scenario.model_validate({
        "name": "t",
        "node": {"gpu_count": 2, "hostname": HOST, "gpu_model": "h100-sxm5-80gb",
                 "mig_monitor": monitor},
        "phases": [{
            "name": "p",
            "duration": "10m",
            "changes": [
                {"gpus": [0], "set": {"mig": {"instances": [gi1, gi2]}}},
                {"gpus": [1], "set": {"processes": [{"pid": 300, "gpu_memory_mib": 500}]}},
            ],
            "host": {"probe": probe or {}},
        }],
    })  # fmt: skip


class Datagrams:
    """What the kernel hands the probe source: (sender pid, datagram)."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, bytes]] = []

    def send(self, pid: int, report: dict[str, Any]) -> None:
        self.queue.append((pid, json.dumps(report).encode()))

    def receive(self, limit: int) -> list[tuple[int, bytes]]:
        out, self.queue = self.queue[:limit], self.queue[limit:]
        return out

    def close(self) -> None:
        pass


class Node:
    """A simulated node in virtual time: the probe source, and the nvml source (its lists
    published for the others) where asked for."""

    def __init__(self, scenario: Scenario, wire: Any = None, nvml: bool = False) -> None:
        self.sim = SimNode(scenario, virtual=True)
        context = self.sim.context()
        if wire is not None:
            context.extras["probe_receiver"] = wire
        self.nvml = NvmlSource(NvmlConfig(), context) if nvml else None
        self.source = ProbeSource(ProbeConfig(), context)

    def poll(self, at: float) -> Metrics:
        self.sim.clock.advance(at - self.sim.clock.elapsed())
        self.sim.tick()
        if self.nvml is not None:  # due every second: it polls before the probe source
            self.nvml.collect()
        return Metrics(self.source.collect())

    def mig_uuid(self, gpu: int, gpu_instance: int) -> str:
        layout = self.sim.timeline.state(self.sim.clock.elapsed())[0][gpu]["mig"]
        device = next(d for d in layout.devices if d.gpu_instance == gpu_instance)
        return mig_uuid(HOST, gpu, device)

    def close(self) -> None:
        self.source.close()
        if self.nvml is not None:
            self.nvml.close()
        self.sim.close()


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(scenario: Scenario, wire: Any = None, nvml: bool = False) -> Node:
        made.append(Node(scenario, wire, nvml))
        return made[-1]

    yield make
    for node in made:
        node.close()


def rows(m: Metrics, family: str) -> dict[tuple[str, ...], float]:
    return m.by_name.get(P + family, {})


def instance(gi: int, profile: str) -> tuple[str, ...]:
    return ("0", gpu_uuid(HOST, 0), str(gi), profile)


def cuda(uuid: str, reserved: float) -> dict[str, Any]:
    return {"device": 0, "uuid": uuid, "reserved_bytes": reserved, "allocated_bytes": 1.0}


def assert_gpu_0_has_no_whole_gpu_probe_series(m: Metrics) -> None:
    for family in PROBE_GPU_FAMILIES:
        assert all(labels[0] != "0" for labels in rows(m, family)), family


def test_reports_land_on_their_gpu_instances(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(mig_scenario(), wire)
    node.poll(1)
    gi1, gi2 = node.mig_uuid(0, 1), node.mig_uuid(0, 2)
    loader = {"num_workers": 2, "pin_memory": True}
    wire.send(100, {**GOOD, "rank": 0, "loader": loader, "cuda": cuda(gi1[4:], 5e9)})  # bare
    wire.send(200, {**GOOD, "batches": 20, "cuda": cuda(gi2, 6e9)})  # as NVML spells it
    wire.send(201, {**GOOD, "batches": 30})  # less memory on GI 2 than pid 200
    wire.send(300, {**GOOD, "batches": 40, "cuda": cuda(gpu_uuid(HOST, 1)[4:], 7e9)})
    m = node.poll(2)
    assert rows(m, "gpu_instance_probe_pid") == {
        instance(1, "4g.40gb"): 100,
        instance(2, "3g.40gb"): 200,
    }
    assert rows(m, "gpu_instance_probe_batches_total") == {
        instance(1, "4g.40gb"): 10,
        instance(2, "3g.40gb"): 20,
    }
    assert rows(m, "gpu_instance_probe_rank") == {instance(1, "4g.40gb"): 0}
    assert rows(m, "gpu_instance_probe_loader_workers") == {instance(1, "4g.40gb"): 2}
    assert rows(m, "gpu_instance_probe_loader_pin_memory") == {instance(1, "4g.40gb"): 1}
    # the allocator's state on the instance whose MIG device torch names
    assert rows(m, "gpu_instance_probe_cuda_reserved_bytes") == {
        instance(1, "4g.40gb"): 5e9,
        instance(2, "3g.40gb"): 6e9,
    }
    assert_gpu_0_has_no_whole_gpu_probe_series(m)
    # the whole GPU beside it, as before
    whole = ("1", gpu_uuid(HOST, 1))
    assert rows(m, "probe_pid") == {whole: 300}
    assert rows(m, "probe_cuda_reserved_bytes") == {whole: 7e9}
    assert all(labels[0] == "0" for labels in rows(m, "gpu_instance_probe_pid"))
    assert m.by_name[P + "probe_processes"][()] == 4
    assert m.by_name[P + "probe_unplaced_processes"][()] == 0


def test_the_allocator_state_goes_to_the_instance_torch_names(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(mig_scenario(), wire)
    node.poll(1)
    # another instance's MIG device: not this one's allocator
    wire.send(100, {**GOOD, "cuda": cuda(node.mig_uuid(0, 2), 5e9)})
    # the parent GPU's uuid (a CUDA that names the GPU): the instance the process is on
    wire.send(200, {**GOOD, "cuda": cuda(gpu_uuid(HOST, 0)[4:], 6e9)})
    m = node.poll(2)
    assert rows(m, "gpu_instance_probe_cuda_reserved_bytes") == {instance(2, "3g.40gb"): 6e9}
    # no uuid: the instance the process holds most memory on
    wire.send(100, {**GOOD, "cuda": {"device": 0, "reserved_bytes": 1, "allocated_bytes": 1}})
    m = node.poll(3)
    assert rows(m, "gpu_instance_probe_cuda_reserved_bytes")[instance(1, "4g.40gb")] == 1


def test_without_the_mig_monitor_capability_the_mig_devices_lists_place_them(
    nodes: Any,
) -> None:
    """The parent's list answers NO_PERMISSION; each MIG device's own list, which the nvml
    source reads every poll, places the reports, with no NVML call of the probe's."""
    wire = Datagrams()
    node = nodes(mig_scenario(monitor=False), wire, nvml=True)
    node.poll(1)
    wire.send(100, {**GOOD, "cuda": cuda(node.mig_uuid(0, 1)[4:], 5e9)})
    wire.send(200, {**GOOD, "batches": 20})
    wire.send(300, {**GOOD, "batches": 40})
    m = node.poll(2)
    assert rows(m, "gpu_instance_probe_pid") == {
        instance(1, "4g.40gb"): 100,
        instance(2, "3g.40gb"): 200,
    }
    assert rows(m, "gpu_instance_probe_cuda_reserved_bytes") == {instance(1, "4g.40gb"): 5e9}
    assert_gpu_0_has_no_whole_gpu_probe_series(m)
    assert rows(m, "probe_pid") == {("1", gpu_uuid(HOST, 1)): 300}
    assert m.by_name[P + "probe_unplaced_processes"][()] == 0


def test_without_the_capability_nor_the_nvml_source_they_stay_unplaced(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(mig_scenario(monitor=False), wire)
    for pid in (100, 200, 300):
        wire.send(pid, GOOD)
    m = node.poll(1)
    assert not rows(m, "gpu_instance_probe_pid")
    assert_gpu_0_has_no_whole_gpu_probe_series(m)  # never the whole GPU's
    assert rows(m, "probe_pid") == {("1", gpu_uuid(HOST, 1)): 300}
    assert m.by_name[P + "probe_unplaced_processes"][()] == 2


def test_mig_devices_are_discovered_once_and_only_for_a_probed_instance(
    nodes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = Datagrams()
    node = nodes(mig_scenario(), wire)
    nv = node.sim.pynvml
    calls: list[Any] = []
    count = nv.nvmlDeviceGetMaxMigDeviceCount
    monkeypatch.setattr(nv, "nvmlDeviceGetMaxMigDeviceCount", lambda h: calls.append(h) or count(h))
    wire.send(300, GOOD)  # only the whole GPU's process reports
    node.poll(1)
    assert calls == []
    for t in range(2, 6):
        wire.send(100, {**GOOD, "batches": t})
        wire.send(300, GOOD)
        assert node.poll(t).by_name[P + "gpu_instance_probe_batches_total"] == {
            instance(1, "4g.40gb"): t
        }
    assert len(calls) == 1  # then known: GI ids from the parent's list, profiles cached


def test_the_simulated_probe_names_the_mig_device(nodes: Any) -> None:
    """The simulator's probe reports as torch does on a MIG device: its MIG UUID."""
    probe = {"cuda_device": 0, "reserved_mib": 100, "num_workers": 4}
    whole = {**probe, "cuda_device": 1}  # the node's GPU 1
    node = nodes(mig_scenario(probe={100: probe, 200: probe, 300: whole}))
    m = node.poll(5)
    mib = float(1 << 20)
    assert rows(m, "gpu_instance_probe_cuda_reserved_bytes") == {
        instance(1, "4g.40gb"): 100 * mib,
        instance(2, "3g.40gb"): 100 * mib,
    }
    assert rows(m, "probe_cuda_reserved_bytes") == {("1", gpu_uuid(HOST, 1)): 100 * mib}
    assert_gpu_0_has_no_whole_gpu_probe_series(m)


def test_gpus_without_mig_read_exactly_as_before(nodes: Any) -> None:
    """The samples of a node without MIG, in order, as the probe source gave them before
    MIG (recorded from it): nothing added, nothing moved."""
    wire = Datagrams()
    scenario = Scenario.model_validate({
        "name": "t",
        "node": {"gpu_count": 3, "hostname": HOST},
        "phases": [{"name": "p", "duration": "10m", "changes": [
            {"gpus": [0], "set": {"processes": [{"pid": 100, "gpu_memory_mib": 10}]}},
            {"gpus": [1], "set": {"processes": [{"pid": 100, "gpu_memory_mib": 90}]}},
            {"gpus": [2], "set": {"processes": [{"pid": 200, "gpu_memory_mib": 500},
                                                {"pid": 300, "gpu_memory_mib": 50}]}},
        ]}],
    })  # fmt: skip
    node = nodes(scenario, wire)
    u0, u1, u2 = (gpu_uuid(HOST, i) for i in range(3))
    full = {"device": 0, "uuid": u1[4:], "reserved_bytes": 8e9, "allocated_bytes": 2e9,
            "largest_free_block_bytes": 1e8, "alloc_retries": 3, "init_seconds": 0.5,
            "init_timestamp": 1.7e9}  # fmt: skip
    loader = {"num_workers": 0, "pin_memory": False, "batch_size": 8}
    wire.send(100, {**GOOD, "rank": 0, "loader": loader, "cuda": full})
    wire.send(200, {**GOOD, "batches": 5, "cuda": {"device": 0, "reserved_bytes": 1,
                                                   "allocated_bytes": 1}})  # fmt: skip
    wire.send(300, {**GOOD, "batches": 7, "rank": 3})
    node.sim.tick()
    got = [tuple(s) for s in node.source.collect()]
    head = ("pid", 100.0), ("rank", 0.0), ("batches_total", 10.0), ("wait_seconds_total", 9.0)
    head += ("compute_seconds_total", 1.0), ("loader_workers", 0.0)
    head += ("loader_pin_memory", 0.0), ("loader_batch_size", 8.0)
    allocator = (("cuda_reserved_bytes", 8e9), ("cuda_allocated_bytes", 2e9),
                 ("cuda_inactive_split_bytes", 0.0), ("cuda_largest_free_block_bytes", 1e8),
                 ("cuda_alloc_retries_total", 3.0), ("cuda_ooms_total", 0.0),
                 ("cuda_init_seconds", 0.5), ("cuda_init_timestamp_seconds", 1.7e9))  # fmt: skip
    gpu2 = (("pid", 200.0), ("batches_total", 5.0), ("wait_seconds_total", 9.0),
            ("compute_seconds_total", 1.0), ("cuda_reserved_bytes", 1.0),
            ("cuda_allocated_bytes", 1.0), ("cuda_inactive_split_bytes", 0.0),
            ("cuda_alloc_retries_total", 0.0), ("cuda_ooms_total", 0.0))  # fmt: skip
    expected = [(P + "probe_" + n, ("0", u0), v) for n, v in head]
    expected += [(P + "probe_" + n, ("1", u1), v) for n, v in head + allocator]
    expected += [(P + "probe_" + n, ("2", u2), v) for n, v in gpu2]
    results = ("accepted", "malformed", "too_large", "rate_limited", "queue_full", "pid_limit")
    expected += [(P + "probe_reports_total", (r,), float(r == "accepted") * 3) for r in results]
    expected += [(P + "probe_processes", (), 3.0), (P + "probe_unplaced_processes", (), 0.0)]
    assert got == expected


def test_the_scenario_fires_on_the_stalled_instance_only() -> None:
    result = CliRunner().invoke(main, ["simulate", "mig-probe-input-stall-h100", "--check"])
    assert result.exit_code == 0, result.output
    assert "0 mismatch(es) in 12 expectation(s)" in result.output
    assert "gpu 0/2  input_pipeline_stall firing" in result.output
    assert "gpu 0/1  input_pipeline_stall" not in result.output
