"""MIG phase 2, processes and owners (issue 26): each GPU instance of a MIG-enabled GPU
has its own main process and owner, through the real code path -- a simulated node (fake
NVML, /proc and cgroups written by the simulator), the nvml source publishing each MIG
device's processes, the processes source reading them, a real gRPC kubelet and job
files -- and a whole GPU next to it is read as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from servers import serving_pod_resources

from gpuwatchd.config import NvmlConfig, ProcessesConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import gpu_uuid, make_pynvml
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.sim.sysfs import SysfsWriter
from gpuwatchd.sim.writers.processes import ProcessesWriter
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.owner import LABELS
from gpuwatchd.sources.owner.jobfiles import read_job_files, read_job_map
from gpuwatchd.sources.owner.podresources import device_key
from gpuwatchd.sources.owner.podresources_v1 import api_pb2, api_pb2_grpc
from gpuwatchd.sources.processes import ProcessesSource
from gpuwatchd.sources.processes.metrics import INSTANCE_FORMS, MAIN_FAMILIES

P = "gpuwatchd_"
SCENARIOS = Path(__file__).resolve().parents[1] / "gpuwatchd" / "sim" / "scenarios"
SCENARIO = "mig-owners-pod-slurm-a100"
HOST = "sim-a100-mig-owners"
POD_UID = "0b6f5c1e-3a2d-4e8f-9c71-5d2a8e4f1b90"
MIG_GI1 = "MIG-e1c495ce-d1f4-dcd0-e69d-1fad66d518b6"  # GPU 0's 3g.40gb (the pod's)
MIG_GI5 = "MIG-8b3c333d-829d-648a-023b-815f3c31e467"  # GPU 0's 2g.20gb (job 7001's)
MIG_GI13 = "MIG-f0cb271f-99d4-c3ab-ac68-0a5bef6c19a1"  # GPU 0's idle 1g.10gb


class Node:
    """A simulated node in virtual time with the nvml and processes sources of one
    pipeline (the nvml source publishes its lists, the processes source reads them)."""

    def __init__(self, scn: Scenario | str, root: Path, nvml: bool = True, **config: Any) -> None:
        self.timeline = Timeline(load_scenario(scn) if isinstance(scn, str) else scn)
        self.clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
        self.nv = make_pynvml(self.timeline, self.clock)
        proc, sys = root / "proc", root / "sys"
        self.sysfs = SysfsWriter(sys, self.timeline)
        self.writer = ProcessesWriter(proc, sys, self.timeline)
        host = self.timeline.scenario.node.host
        extras = {
            "clock": self.clock.elapsed,
            "now": self.clock.now,
            "user_name": host.user_name,
            "nvml_wait": self.nv._gpuwatchd_fake.wait_for,  # the simulator's: no deadline
        }
        context = Context(procfs=proc, sysfs=sys, pynvml=self.nv, extras=extras)
        self.nvml = NvmlSource(NvmlConfig(), context) if nvml else None
        self.source = ProcessesSource(ProcessesConfig(**config), context)

    def poll(self, t: float) -> list[Sample]:
        self.clock.advance(t - self.clock.elapsed())
        self.sysfs.write(t)
        self.writer.write(t)
        if self.nvml is not None:  # due every second: it polls before the processes source
            self.nvml.collect()
        return self.source.collect()

    def polls(self, *times: float) -> list[Sample]:
        out: list[Sample] = []
        for t in times:
            out = self.poll(t)
        return out

    def close(self) -> None:
        self.source.close()
        if self.nvml is not None:
            self.nvml.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(scn: Scenario | str = SCENARIO, nvml: bool = True, **config: Any) -> Node:
        made.append(Node(scn, tmp_path / f"n{len(made)}", nvml, **config))
        return made[-1]

    yield make
    for n in made:
        n.close()


def per_instance(samples: list[Sample], name: str, gpu: int = 0) -> dict[str, Any]:
    """GI id -> value (info families: their labels after profile) of one instance form."""
    out: dict[str, Any] = {}
    for s in samples:
        if s.name == P + name and s.labels[0] == str(gpu):
            out[s.labels[2]] = s.labels[4:] if name.endswith("_info") else s.value
    return out


def profiles(samples: list[Sample], gpu: int = 0) -> dict[str, str]:
    return {s.labels[2]: s.labels[3] for s in samples
            if s.name == P + "gpu_instance_process_pid" and s.labels[0] == str(gpu)}  # fmt: skip


def names_on(samples: list[Sample], gpu: int) -> set[str]:
    return {s.name.removeprefix(P) for s in samples if s.labels[:1] == (str(gpu),)}


def owner(values: tuple[str, ...]) -> dict[str, str]:
    return dict(zip(LABELS, values, strict=True))


# -- main processes ----------------------------------------------------------------------


def test_each_gpu_instance_has_its_own_main_process(node) -> None:
    out = node().polls(60.0, 65.0)
    assert per_instance(out, "gpu_instance_process_pid") == {"1": 8101, "5": 8201}
    assert profiles(out) == {"1": "3g.40gb", "5": "2g.20gb"}  # the idle GI 13 has none
    # the helper beside job 7001's rank on GI 5, none beside the pod's process on GI 1
    assert per_instance(out, "gpu_instance_other_processes") == {"1": 0, "5": 1}
    assert per_instance(out, "gpu_instance_process_info") == {
        "1": ("python", ""),
        "5": ("python", ""),
    }
    # rates from the second poll on, the same units as the whole-GPU families
    cpu = per_instance(out, "gpu_instance_process_cpu_cores")
    assert set(cpu) == {"1", "5"} and all(v >= 0 for v in cpu.values())
    assert set(per_instance(out, "gpu_instance_process_threads")) == {"1", "5"}
    # jobs: a pid of each instance's own launch (rank 8201 alone in its step's env)
    jobs = per_instance(out, "gpu_instance_process_job")
    assert jobs["1"] != jobs["5"]


def test_a_mig_enabled_gpu_has_no_whole_gpu_main_process(node) -> None:
    out = node().polls(60.0, 65.0)
    mig_gpu = names_on(out, 0)
    whole = {spec.name.removeprefix(P) for spec in MAIN_FAMILIES} - {"gpu_other_processes"}
    assert mig_gpu & whole == set()
    # the whole GPU's counts stay: its aggregate list holds every instance's processes,
    # and the others are those besides every instance's main process
    counts = {s.labels[2:]: s.value for s in out
              if s.name == P + "gpu_processes" and s.labels[0] == "0"}  # fmt: skip
    assert counts[("compute",)] == 3
    others = [s.value for s in out if s.name == P + "gpu_other_processes" and s.labels[0] == "0"]
    assert others == [1.0]


def test_a_whole_gpu_beside_it_is_read_as_without_mig(node, tmp_path: Path) -> None:
    """GPU 1 has no MIG: its series are the whole-GPU families, exactly those of a node
    whose GPU 0 is not partitioned at all (same scenario less the MIG layout)."""
    scn = load_scenario(SCENARIO)
    raw = yaml.safe_load((SCENARIOS / f"{SCENARIO}.yaml").read_text())
    for change in raw["phases"][0]["changes"]:
        change["set"].pop("mig", None)
    plain = Scenario.model_validate(raw)
    out = node(scn).polls(60.0, 65.0)
    reference = node(plain).polls(60.0, 65.0)
    gpu1 = sorted((s for s in out if s.labels[:1] == ("1",)), key=repr)
    assert gpu1 == sorted((s for s in reference if s.labels[:1] == ("1",)), key=repr)
    assert "gpu_process_pid" in names_on(out, 1)
    assert not any("gpu_instance_" in name for name in names_on(out, 1))


def test_compute_instances_of_one_gpu_instance_share_its_main_process(node) -> None:
    """mig-3g-4g-h100's GPU 1: a 3g.40gb split into three 1c.3g.40gb compute instances
    with a notebook each on two of them: one GPU instance, one main process."""
    out = node("mig-3g-4g-h100").polls(60.0, 65.0)
    assert per_instance(out, "gpu_instance_process_pid", gpu=1) == {"1": 7201, "2": 7301}
    assert profiles(out, gpu=1) == {"1": "4g.40gb", "2": "3g.40gb"}
    assert per_instance(out, "gpu_instance_other_processes", gpu=1) == {"1": 0, "2": 1}


@pytest.mark.parametrize("scn", [SCENARIO, "mig-3g-4g-h100", "mig-7x1g-a100-mixed-tenants"])
def test_asked_of_nvml_by_the_source_itself_the_instances_are_the_same(node, scn) -> None:
    """Without the nvml source's lists (disabled, or late) the parent's aggregate list is
    split by the GI/CI ids of its v3 records: the same samples."""
    shared, alone = (
        node(scn, pod_resources_socket=None),
        node(scn, False, pod_resources_socket=None),
    )
    for t in (60.0, 65.0, 70.0):
        assert sorted(shared.poll(t), key=repr) == sorted(alone.poll(t), key=repr)
    assert per_instance(alone.poll(75.0), "gpu_instance_process_pid")


def test_without_the_mig_monitor_capability_instances_are_still_read(node) -> None:
    """The parent's aggregate lists are refused (NO_PERMISSION); each MIG device's own
    list is not."""
    scn = load_scenario(SCENARIO).model_copy(deep=True)
    scn.node.mig_monitor = False
    out = node(scn).polls(60.0, 65.0)
    assert per_instance(out, "gpu_instance_process_pid") == {"1": 8101, "5": 8201}
    assert not [s for s in out if s.name == P + "gpu_processes" and s.labels[0] == "0"]
    assert "gpu_process_pid" not in names_on(out, 0)


def test_main_processes_follow_mig_being_enabled_and_disabled(node) -> None:
    """mig-mode-change-a100: GPU 0 whole (8100), MIG 2x3g (8300, 8301), whole again."""
    n = node("mig-mode-change-a100")
    before = n.polls(60.0, 65.0)
    assert {s.value for s in before if s.name == P + "gpu_process_pid" and s.labels[0] == "0"} == {
        8100.0
    }
    during = n.polls(*(400.0 + 5 * i for i in range(3)))
    assert per_instance(during, "gpu_instance_process_pid") == {"1": 8300, "2": 8301}
    assert "gpu_process_pid" not in names_on(during, 0)
    after = n.polls(*(1000.0 + 5 * i for i in range(3)))
    assert per_instance(after, "gpu_instance_process_pid") == {}
    assert {s.value for s in after if s.name == P + "gpu_process_pid" and s.labels[0] == "0"} == {
        8500.0
    }


# -- owners ------------------------------------------------------------------------------


def test_each_gpu_instance_is_owned_by_its_own_tenant(node) -> None:
    out = node(pod_resources_socket=None).polls(60.0, 65.0)
    owners = {gi: owner(v) for gi, v in per_instance(out, "gpu_instance_owner_info").items()}
    assert set(owners) == {"1", "5"}
    assert owners["1"]["scheduler"] == "kubernetes" and owners["1"]["pod"] == POD_UID
    assert owners["1"]["job_id"] == "" and owners["1"]["user"] != "ada"
    assert owners["5"] == owner(("slurm", "7001", "0", "0", "ada", "", "", ""))
    # nobody owns the partitioned GPU as a whole; GPU 1's owner is its job's
    whole = {s.labels[0]: owner(s.labels[2:]) for s in out if s.name == P + "gpu_owner_info"}
    assert whole == {"1": owner(("slurm", "7002", "0", "0", "lin", "", "", ""))}


def test_the_kubelet_names_the_pod_of_a_mig_device_only(node, kubelet) -> None:
    """Mixed strategy: the pod holds GI 1's MIG device as nvidia.com/mig-3g.40gb; its
    names go to GI 1 only, never to job 7001's GI 5 on the same GPU."""
    lister, socket = kubelet
    lister.devices = {"nvidia.com/mig-3g.40gb": [MIG_GI1]}
    out = node(pod_resources_socket=socket).polls(60.0, 65.0)
    owners = {gi: owner(v) for gi, v in per_instance(out, "gpu_instance_owner_info").items()}
    assert (owners["1"]["namespace"], owners["1"]["pod"], owners["1"]["container"]) == (
        "serving", "llm-0", "server",
    )  # fmt: skip
    assert owners["5"] == owner(("slurm", "7001", "0", "0", "ada", "", "", ""))


@pytest.mark.parametrize(
    ("resource", "device_id"),
    [
        ("nvidia.com/gpu", MIG_GI13),  # single strategy: MIG devices as nvidia.com/gpu
        ("nvidia.com/mig-1g.10gb", MIG_GI13 + "::2"),  # a time-sliced replica (EKS)
        ("nvidia.com/mig-1g.10gb", "nvidia0/gi13/vgpu0"),  # GKE
    ],
)
def test_an_idle_instance_is_owned_by_its_allocation(node, kubelet, resource, device_id) -> None:
    lister, socket = kubelet
    lister.devices = {resource: [device_id]}
    out = node(pod_resources_socket=socket).polls(60.0, 65.0)
    owners = per_instance(out, "gpu_instance_owner_info")
    assert owners["13"] == ("kubernetes", "", "", "", "", "serving", "llm-0", "server")
    assert "gpu_instance_process_pid" not in {
        s.name.removeprefix(P) for s in out if s.labels[2:3] == ("13",)
    }
    assert owner(owners["5"])["scheduler"] == "slurm"  # untouched


def test_a_whole_gpu_allocation_or_job_file_names_no_instance(node, kubelet, tmp_path) -> None:
    """A GPU UUID allocation or a GPU's own job file cannot say which instance: an idle
    instance stays unowned and the tenants keep their own owners."""
    lister, socket = kubelet
    lister.devices = {"nvidia.com/gpu": [gpu_uuid(HOST, 0)]}
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("999\n")
    out = node(pod_resources_socket=socket, job_mapping_dir=str(jobs)).polls(60.0, 65.0)
    owners = {gi: owner(v) for gi, v in per_instance(out, "gpu_instance_owner_info").items()}
    assert set(owners) == {"1", "5"}
    assert owners["1"]["namespace"] == "" and owners["5"]["job_id"] == "7001"


def test_job_files_name_the_job_of_each_instance(node, tmp_path: Path) -> None:
    """dcgm-exporter's HPC convention for MIG: `<GPU index>.<GPU instance id>`."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0.13").write_text("7003\n")  # the idle 1g.10gb, allocated to job 7003
    (jobs / "0.5").write_text("7001\n")
    out = node(pod_resources_socket=None, job_mapping_dir=str(jobs)).polls(60.0, 65.0)
    owners = {gi: owner(v) for gi, v in per_instance(out, "gpu_instance_owner_info").items()}
    assert owners["13"] == owner(("slurm", "7003", "", "", "", "", "", ""))
    assert owners["5"]["job_id"] == "7001"
    assert owners["1"]["scheduler"] == "kubernetes" and owners["1"]["job_id"] == ""


def test_owner_off_exports_no_instance_owner(node) -> None:
    out = node(owner=False).polls(60.0, 65.0)
    assert per_instance(out, "gpu_instance_owner_info") == {}
    assert per_instance(out, "gpu_instance_process_pid") == {"1": 8101, "5": 8201}


# -- formats and specs -------------------------------------------------------------------


def test_device_ids_of_mig_devices() -> None:
    """What the device plugins announce for MIG (NVIDIA's since R470, before R470, with
    time-slicing, GKE's) and what a GPU instance is looked up by."""
    assert device_key(MIG_GI1) == MIG_GI1
    assert device_key(MIG_GI1 + "::7") == MIG_GI1
    old = "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/3/0"
    assert device_key(old) == "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/gi3"
    assert device_key("nvidia1/gi4") == device_key("nvidia1/gi4/vgpu2") == "1/gi4"
    assert device_key("nvidia1") == "1"  # a whole GPU, as before


def test_job_map_keys_instances_apart(tmp_path: Path) -> None:
    (tmp_path / "2").write_text("10\n")
    (tmp_path / "2.0").write_text("11\n")
    (tmp_path / "2.10").write_text("12\n13\n")
    assert read_job_map(tmp_path) == {(2, -1): ["10"], (2, 0): ["11"], (2, 10): ["12", "13"]}
    assert read_job_files(tmp_path) == {2: ["10", "11", "12", "13"]}  # as before


def test_instance_forms_split_the_main_process_families() -> None:
    registered = {spec.name: spec for spec in ProcessesSource.metrics}
    for spec in MAIN_FAMILIES:
        form = INSTANCE_FORMS[spec.name]
        assert registered[form.name] is form and form.instance_of == spec.name
        assert form.labels == ("gpu", "uuid", "gpu_instance", "profile", *spec.labels[2:])
        assert form.type == spec.type and form.export == spec.export and form.budget == 0
    assert P + "gpu_instance_owner_info" in registered


# -- the kubelet -------------------------------------------------------------------------


class Lister(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's side: one pod, its container holding `devices` (resource -> ids)."""

    def __init__(self) -> None:
        self.devices: dict[str, list[str]] = {}

    def List(self, request: object, context: grpc.ServicerContext) -> object:
        held = [api_pb2.ContainerDevices(resource_name=name, device_ids=ids)
                for name, ids in self.devices.items()]  # fmt: skip
        container = api_pb2.ContainerResources(name="server", devices=held)
        pod = api_pb2.PodResources(name="llm-0", namespace="serving", containers=[container])
        return api_pb2.ListPodResourcesResponse(pod_resources=[pod])


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[Lister, str]]:
    lister = Lister()
    socket = str(tmp_path / "kubelet.sock")
    with serving_pod_resources(lister, socket):
        yield lister, socket
