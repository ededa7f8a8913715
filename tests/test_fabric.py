"""The NVLink fabric (issue 43, item 2): the fake NVML's fabric calls against nvml.h's
contract, the nvml source's read of them and its series (none where unsupported), and
what the exposition shows. The rule is checked by its scenarios (test_scenario_corpus)."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from gpuwatchd.config import Config, NvmlConfig
from gpuwatchd.sim import fake_nvml_fabric as fabric
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import make_pynvml
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.nvml.reads import SLOW_EVERY

P = "gpuwatchd_"
V = "nvmlDeviceGetGpuFabricInfoV"
V1 = "nvmlDeviceGetGpuFabricInfo"


def scenario(
    model: str = "h100-sxm5-80gb", count: int = 8, driver: str = "555.42.06", **values: Any
) -> Scenario:
    phase: dict[str, Any] = {"name": "p", "duration": "10m"}
    if values:
        phase["changes"] = [{"gpus": [gpu], "set": v} for gpu, v in values.items()]
    node = {"gpu_model": model, "gpu_count": count, "driver_version": driver}
    return Scenario.model_validate({"name": "t", "node": node, "phases": [phase]})


def binding(scn: Scenario) -> tuple[Any, SimClock]:
    clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
    nv = make_pynvml(Timeline(scn), clock)
    nv.nvmlInit()
    return nv, clock


def ask(nv: Any, call: str, info: Any, gpu: int = 0) -> Any:
    getattr(nv, call)(nv.nvmlDeviceGetHandleByIndex(gpu), ctypes.byref(info))
    return info


# -- the fake against nvml.h --------------------------------------------------------------


def test_pynvmls_structs_have_the_headers_layout():
    """nvml.h: nvmlGpuFabricInfo_t {clusterUuid[16], status, cliqueId, unsigned char
    state}; _v2_t adds version first and healthMask last, _v3_t healthSummary. pynvml
    declares state a c_uint: the same offsets and sizes, its upper bytes the header's
    padding."""
    nv = pynvml_copy()
    pairs = [(nv.c_nvmlGpuFabricInfo_t, fabric._V1), (nv.c_nvmlGpuFabricInfo_v2_t, fabric._V2),
             (nv.c_nvmlGpuFabricInfo_v3_t, fabric._V3)]  # fmt: skip
    for theirs, header in pairs:
        assert ctypes.sizeof(theirs) == ctypes.sizeof(header), theirs
        for name, _ in header._fields_:
            assert getattr(theirs, name).offset == getattr(header, name).offset, name
    assert (fabric._V1.state.offset, ctypes.sizeof(fabric._V1)) == (24, 28)
    # NVML_STRUCT_VERSION: sizeof | version << 24
    assert (nv.nvmlGpuFabricInfo_v2, nv.nvmlGpuFabricInfo_v3) == (fabric.V2, fabric.V3)
    assert (fabric.V2, fabric.V3) == (0x02000024, 0x03000028)
    assert nv.c_nvmlGpuFabricInfoV_t().version == fabric.V2  # what pynvml asks by default


def pynvml_copy() -> Any:
    from gpuwatchd.sim.fake_nvml import load_private_pynvml

    return load_private_pynvml()


def test_fake_answers_the_scenarios_registration_through_both_calls():
    nv, clock = binding(scenario(**{"1": {"fabric": {"state": "in_progress"}}}))
    done = ask(nv, V, nv.c_nvmlGpuFabricInfoV_t())
    assert (done.state, done.status, done.cliqueId, done.healthMask) == (3, 0, 0, 0)
    assert bytes(done.clusterUuid) == bytes(16)  # a single-node board's, as on real HGX
    pending = ask(nv, V1, nv.c_nvmlGpuFabricInfo_t(), gpu=1)
    assert pending.state == nv.NVML_GPU_FABRIC_STATE_IN_PROGRESS


def test_the_driver_writes_the_state_byte_only():
    """The header's state is one byte: pynvml's 4-byte read includes padding the driver
    does not write (the nvml source masks it)."""
    nv, _ = binding(scenario())
    info = nv.c_nvmlGpuFabricInfoV_t()
    ctypes.memset(ctypes.addressof(info) + fabric._V2.state.offset, 0xAB, 4)
    ask(nv, V, info)
    assert info.state == 0xABABAB03 and info.state & 0xFF == 3


@pytest.mark.parametrize(
    ("model", "count"),
    [
        ("a100-sxm4-80gb", 8),
        ("h100-pcie", 2),
        ("l40s", 2),
        ("rtx-4090", 1),
        ("h100-sxm5-80gb", 4),
    ],  # fmt: skip  # the last: a 4-GPU board, NVLinks direct
)
def test_not_supported_before_hopper_and_without_nvswitches(model, count):
    nv, _ = binding(scenario(model, count))
    for call, struct in ((V, nv.c_nvmlGpuFabricInfoV_t), (V1, nv.c_nvmlGpuFabricInfo_t)):
        with pytest.raises(nv.NVMLError_NotSupported):
            ask(nv, call, struct())


def test_the_version_is_checked_per_driver_branch():
    r550, _ = binding(scenario(driver="550.127.05"))
    for version in (fabric.V3, 2, fabric.V2 + 4):  # v3 is R580's; garbage; a wrong size
        info = r550.c_nvmlGpuFabricInfo_v3_t()
        info.version = version
        with pytest.raises(r550.NVMLError) as raised:
            ask(r550, V, info)
        assert raised.value.value == r550.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    r580, _ = binding(scenario(driver="580.95.05"))
    info = r580.c_nvmlGpuFabricInfo_v3_t()
    info.healthSummary = 7
    assert ask(r580, V, info).state == 3 and info.healthSummary == 0  # NOT_SUPPORTED
    assert ask(r580, V, r580.c_nvmlGpuFabricInfoV_t()).state == 3  # v2 still accepted


def test_older_drivers_lack_the_symbols():
    r535, _ = binding(scenario(driver="535.161.08"))
    with pytest.raises(r535.NVMLError_FunctionNotFound):
        ask(r535, V, r535.c_nvmlGpuFabricInfoV_t())
    assert ask(r535, V1, r535.c_nvmlGpuFabricInfo_t()).state == 3
    r520, _ = binding(scenario(driver="520.61.05"))
    with pytest.raises(r520.NVMLError_FunctionNotFound):
        ask(r520, V1, r520.c_nvmlGpuFabricInfo_t())


def test_a_null_or_by_value_argument_is_invalid():
    nv, _ = binding(scenario())
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    for argument in (None, nv.c_nvmlGpuFabricInfoV_t()):
        with pytest.raises(nv.NVMLError_InvalidArgument):
            nv.nvmlDeviceGetGpuFabricInfoV(handle, argument)


def test_a_status_name_the_binding_does_not_know_is_refused():
    with pytest.raises(ValueError, match=r"fabric\s+Value error, status: expected an nvmlReturn_t"):
        scenario(**{"0": {"fabric": {"status": "NVML_ERROR_NOPE"}}})


# -- the nvml source ----------------------------------------------------------------------


class Node:
    def __init__(self, scn: Scenario) -> None:
        self.nv, self.clock = binding(scn)
        self.fake = self.nv._gpuwatchd_fake
        context = Context(
            pynvml=self.nv, extras={"now": self.clock.now, "clock": self.clock.elapsed}
        )
        self.source = NvmlSource(NvmlConfig(), context)

    def poll(self) -> dict[str, dict[tuple[str, ...], float]]:
        """The fabric families of one poll: name -> (gpu, extra labels...) -> value."""
        got: dict[str, dict[tuple[str, ...], float]] = {}
        for s in self.source.collect():
            if "fabric" in s.name:
                got.setdefault(s.name.removeprefix(P), {})[(s.labels[0], *s.labels[2:])] = s.value
        self.clock.advance(1.0)
        return got

    def calls(self, name: str) -> int:
        return sum(n for (call, _), n in self.fake.gpu_calls.items() if call == name)


def test_state_per_gpu_and_a_failed_registrations_status():
    node = Node(scenario(**{
        "1": {"fabric": {"state": "in_progress"}},
        "2": {"fabric": {"state": "completed", "status": "NVML_ERROR_UNKNOWN"}},
        # nvml.h: the status is to be read only once completed
        "3": {"fabric": {"state": "not_started", "status": "NVML_ERROR_UNKNOWN"}},
    }))  # fmt: skip
    got = node.poll()
    state = got["gpu_fabric_state"]
    assert [state[(str(g),)] for g in range(8)] == [3, 2, 3, 1, 3, 3, 3, 3]
    assert got["gpu_fabric_status"] == {("2", "NVML_ERROR_UNKNOWN"): 999}
    for _ in range(SLOW_EVERY):  # a slow fact: read every SLOW_EVERY polls, kept between
        assert node.poll() == got
    assert node.calls(V) == 2 * 8 and node.calls(V1) == 0


def test_the_state_is_the_headers_byte_whatever_the_padding_holds():
    """A driver that copies its own struct, padding and all: pynvml's c_uint state holds
    that padding in its upper bytes; the source reads nvml.h's unsigned char."""
    node = Node(scenario(**{"0": {"fabric": {"state": "in_progress"}}}))
    fill = node.fake._fill_fabric

    def with_padding(info: Any, gpu: int) -> None:
        fill(info, gpu)
        ctypes.memset(ctypes.addressof(info) + type(info).state.offset + 1, 0xAB, 3)

    node.fake._fill_fabric = with_padding
    assert node.poll()["gpu_fabric_state"][("0",)] == 2


@pytest.mark.parametrize(("model", "count"), [("a100-sxm4-80gb", 8), ("h100-pcie", 2)])
def test_no_series_where_unsupported_and_asked_once(model, count):
    node = Node(scenario(model, count))
    for _ in range(SLOW_EVERY + 1):
        assert node.poll() == {}
    assert node.calls(V) == count and node.calls(V1) == 0  # NOT_SUPPORTED: never again


def test_a_success_with_state_not_supported_is_not_supported():
    node = Node(scenario(**{"0": {"fabric": {"state": "not_supported"}}}))
    for _ in range(SLOW_EVERY + 1):
        assert ("0",) not in node.poll()["gpu_fabric_state"]
    assert node.fake.gpu_calls[(V, 0)] == 1 and node.fake.gpu_calls[(V, 1)] == 2


def test_before_r550_the_first_call_is_read():
    node = Node(scenario(driver="535.161.08", **{"4": {"fabric": {"state": "in_progress"}}}))
    assert node.poll()["gpu_fabric_state"][("4",)] == 2
    assert node.calls(V1) == 8 and node.calls(V) == 0  # the binding raised FunctionNotFound


def test_a_binding_newer_than_the_driver_falls_back_to_the_first_call():
    """A future nvidia-ml-py whose default V struct is v3 (R580's nvml.h) on an R550 node:
    ARGUMENT_VERSION_MISMATCH, then the unversioned call."""
    node = Node(scenario(driver="550.127.05", **{"4": {"fabric": {"state": "in_progress"}}}))
    node.nv.c_nvmlGpuFabricInfoV_t = node.nv.c_nvmlGpuFabricInfo_v3_t
    assert node.poll()["gpu_fabric_state"][("4",)] == 2
    assert node.calls(V) == 8 and node.calls(V1) == 8
    node.poll()
    assert node.calls(V) == 8  # not asked again


# -- what the exposition shows ------------------------------------------------------------


def exposition(name: str, until: float) -> list[str]:
    simulation = Simulation(load_scenario(name), Config())
    try:
        body = simulation.run(until=until).exposition.decode()
    finally:
        simulation.close()
    return [line for line in body.splitlines() if "fabric" in line and not line.startswith("#")]


def test_the_exposition_shows_the_state_and_only_what_is_wrong():
    """One state series per GPU; the status only where a registration failed; the
    fabric manager while it runs."""
    lines = exposition("fabric-registration-error-one-gpu-8xh200", until=15.0)
    assert sum(line.startswith(P + "gpu_fabric_state{") for line in lines) == 8
    (status,) = [line for line in lines if line.startswith(P + "gpu_fabric_status{")]
    assert 'gpu="5"' in status and 'status="NVML_ERROR_UNKNOWN"' in status
    assert P + "fabric_manager_processes 1.0" in lines
    down = exposition("fabric-manager-down-after-driver-upgrade-8xh100", until=15.0)
    assert not any(line.startswith(P + "fabric_manager_processes") for line in down)
    assert sum(line.endswith(" 2.0") for line in down) == 8  # in progress, every GPU
