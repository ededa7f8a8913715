"""gpuwatchd_gpu_owner_info through the real code path: `gpuwatchd simulate` of built-in
scenarios whose processes run in Slurm steps and a Kubernetes pod (their /proc/PID/cgroup
and environ written by the simulator), read back from the final exposition; the pod's
names from a real gRPC server implementing the kubelet's pod-resources API."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.cli import main
from gpuwatchd.config import ConfigError, load_config
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sources.owner import LABELS
from gpuwatchd.sources.owner.podresources_v1 import api_pb2, api_pb2_grpc
from gpuwatchd.sources.owner.process import user_name

POD_NODE = "sim-k8s-4xh100pcie"  # torchrun-slow-rank-pod-h100's hostname
POD_UID = "6f1c3e2a-8b7d-4c55-9a10-2f4be1d07c93"
POD_CONTAINER = "containerd://3b9e1f0c2d4a5b6c7d8e9f00112233445566778899aabbccddeeff0011223344"


def exported(scenario: str, tmp_path: Path, until: int = 20, **processes: object) -> str:
    """The final exposition of `simulate SCENARIO`, with `sources.processes` settings."""
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(yaml.safe_dump({"sources": {"processes": processes}}))
    args = ["simulate", scenario, "--until", str(until), "--metrics", "--config", str(config)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


def series(output: str, name: str) -> list[dict[str, str]]:
    """The label sets of one family in an exposition (the lines of that family only)."""
    lines = [line for line in output.splitlines() if line.startswith(f"gpuwatchd_{name}")]
    families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    return [dict(s.labels) for f in families for s in f.samples]


def owners(output: str) -> dict[str, tuple[str, ...]]:
    """gpu -> (scheduler, job_id, step, rank, user, namespace, pod, container)."""
    found = series(output, "gpu_owner_info")
    assert all(set(labels) == {"gpu", "uuid", *LABELS} for labels in found)
    return {labels["gpu"]: tuple(labels[k] for k in LABELS) for labels in found}


def test_slurm_steps_on_two_nodes(tmp_path: Path) -> None:
    """cgroup/v2 plugin paths (job, step) with SLURM_* variables (rank, user)."""
    node1 = owners(exported("slurm-2node-job-healthy-half", tmp_path))
    node2 = owners(exported("slurm-2node-job-slow-gpu", tmp_path))
    job = ("slurm", "5120", "0")
    twin = ("slurm", "5121", "0")
    assert node1 == {
        "0": (*job, "0", "ada", "", "", ""),
        "1": (*job, "1", "ada", "", "", ""),
        "2": (*twin, "0", "lin", "", "", ""),
        "3": (*twin, "1", "lin", "", "", ""),
    }
    assert node2 == {
        "0": (*job, "2", "ada", "", "", ""),
        "1": (*job, "3", "ada", "", "", ""),
        "2": (*twin, "2", "lin", "", "", ""),
        "3": (*twin, "3", "lin", "", "", ""),
    }


def test_slurm_v1_batch_step(tmp_path: Path) -> None:
    """cgroup v1 (freezer at the step, cpu at slurmd's): a process driving two GPUs."""
    found = owners(exported("jupyter-kernels-slurm-ondemand-h100", tmp_path))
    assert found == dict.fromkeys("0123", ("slurm", "880412", "batch", "0", "ada", "", "", ""))


def test_pod_by_ids_then_by_the_kubelets_names(tmp_path: Path, kubelet: str) -> None:
    """Without the kubelet: the pod UID and container ID of the cgroup; with it: names."""
    ids = owners(exported("torchrun-slow-rank-pod-h100", tmp_path, pod_resources_socket=None))
    root = user_name(0)
    assert ids == {
        str(g): ("kubernetes", "bert-ft-7d9c", "", str(g), root, "", POD_UID, POD_CONTAINER)
        for g in range(4)
    }
    named = owners(exported("torchrun-slow-rank-pod-h100", tmp_path, pod_resources_socket=kubelet))
    names = ("ml", "bert-ft-worker-0", "pytorch")
    assert named == {
        str(g): ("kubernetes", "bert-ft-7d9c", "", str(g), root, *names) for g in range(4)
    }


def test_owner_off_exports_none_and_jobs_stay(tmp_path: Path) -> None:
    output = exported("slurm-2node-job-slow-gpu", tmp_path, owner=False)
    assert series(output, "gpu_owner_info") == []
    jobs = {s["gpu"] for s in series(output, "gpu_process_job")}
    assert jobs == {"0", "1", "2", "3"}


def test_no_process_no_owner(tmp_path: Path) -> None:
    assert series(exported("idle-8gpu", tmp_path, until=10), "gpu_owner_info") == []


def test_prolog_job_files_own_idle_gpus(tmp_path: Path) -> None:
    """dcgm-exporter's HPC convention: a file per GPU index, written by a prolog."""
    jobs = tmp_path / "dcgm-job-map"
    jobs.mkdir()
    (jobs / "0").write_text("991\n")
    (jobs / "3").write_text("992 1000\n")  # Princeton jobstats' "<job> <uid>"
    output = exported("idle-8gpu", tmp_path, until=10, job_mapping_dir=str(jobs))
    rest = ("", "", "", "", "", "")  # step, rank, user, namespace, pod, container
    assert owners(output) == {"0": ("slurm", "991", *rest), "3": ("slurm", "992", *rest)}


def test_owner_settings_are_checked(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    settings = {"pod_resources_timeout": "3s", "timeout": "3s"}
    config.write_text(yaml.safe_dump({"sources": {"processes": settings}}))
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    message = str(raised.value)
    assert str(config) in message and "sources.processes" in message
    assert "pod_resources_timeout (3s) must be shorter than timeout (3s)" in message
    config.write_text(yaml.safe_dump({"sources": {"processes": {"pod_resources_refresh": 0.5}}}))
    with pytest.raises(ConfigError, match="pod_resources_refresh"):
        load_config(config)
    defaults = load_config(None).sources.processes
    assert defaults.owner and defaults.owner_environ and defaults.job_mapping_dir is None


class _Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's side: the pod on the scenario's four GPUs, by UUID."""

    def List(self, request: object, context: grpc.ServicerContext) -> object:
        devices = [gpu_uuid(POD_NODE, g) for g in range(4)]
        container = api_pb2.ContainerResources(
            name="pytorch",
            devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=devices)],
        )
        pod = api_pb2.PodResources(name="bert-ft-worker-0", namespace="ml", containers=[container])
        return api_pb2.ListPodResourcesResponse(pod_resources=[pod])


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[str]:
    """A gRPC server implementing PodResourcesLister on a unix socket, as the kubelet does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Kubelet(), server)
    socket = str(tmp_path / "kubelet.sock")
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    yield socket
    server.stop(grace=None)
