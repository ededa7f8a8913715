"""GPU owners (gpuwatchd/sources/owner): real /proc/PID/cgroup captures of every layout
(tests/fixtures/README.md, `owner/`), /proc trees built from them, dcgm-exporter's job
files, a real gRPC server speaking the kubelet's pod-resources API on a unix socket, and a
real unreadable environment (a root process read by an unprivileged reader)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from servers import serving_pod_resources, wait_until

from gpuwatchd.sources.owner import (
    LABELS,
    Attribution,
    GpuProcesses,
    Owner,
    Placement,
    PodContainer,
    PodResources,
    ProcessFacts,
    owners_by_gpu,
    parse_cgroup,
    read_job_files,
)
from gpuwatchd.sources.owner.cgroup import place
from gpuwatchd.sources.owner.podresources import device_key
from gpuwatchd.sources.owner.podresources_v1 import api_pb2, api_pb2_grpc
from gpuwatchd.sources.owner.process import Launch, ProcessReader, parse_environ, parse_uid

FIXTURES = Path(__file__).parent / "fixtures"
CGROUPS = FIXTURES / "owner" / "cgroup"
ENVIRON = (FIXTURES / "owner" / "environ" / "procfs-26231").read_bytes()  # no launcher's variable
STAT = (FIXTURES / "procfs_pid" / "procfs" / "26231" / "stat").read_bytes()
STATUS_1000 = (FIXTURES / "procfs_pid" / "procfs" / "26231" / "status").read_bytes()  # Uid 1000
STATUS_0 = (FIXTURES / "procfs_pid" / "procfs" / "26235" / "status").read_bytes()  # Uid 0
USERS = {0: "root", 1000: "alice", 7319: "bob"}.get


def users(uid: int) -> str:
    return USERS(uid) or str(uid)


def cgroup(name: str) -> str:
    return (CGROUPS / name).read_text()


# -- the cgroup, layout by layout ----------------------------------------------------------

CRIO_V2_POD = "042efd86-1f3b-4f2f-8736-f31c58e95bbc"
CRIO_V2_ID = "f33f47b0db740bb647cb3e7ac62d96c74966dbb99cbfaf4563bfd42d387e8b44"

LAYOUTS = {
    # Slurm, cgroup v1: the job is in one hierarchy only (freezer); one line of another site
    "slurm-v1-freezer-only": Placement("slurm", job_id="748468", step="0", uid=7319),
    "slurm-v1-interactive": Placement("slurm", job_id="280678", step="interactive", uid=2101171),
    # Slurm's cgroup/v2 plugin
    "slurm-v2-step": Placement("slurm", job_id="1392969", step="0"),
    "slurmd-v2-multiple-slurmd": Placement(),  # slurmd itself, in the scope but in no job
    # Kubernetes, cgroupfs driver
    "k8s-v1-cgroupfs-docker": Placement(
        "kubernetes",
        pod_uid="74ba62da-1a3d-11e7-bb11-080027cb0e22",
        container="cb1eadb7abe3a6545e9856411207073277838e1bdc003337c2f8685faeedc32c",
    ),
    "k8s-v1-cgroupfs-containerd": Placement(
        "kubernetes",
        pod_uid="a36d0c1d-0b26-4451-8d80-9c195e004afa",
        container="5dd96d5394ca930a854a390ea46f7515a8bc930123eb3251ba20f2708a38fc61",
    ),
    "k8s-v1-cgroupfs-burstable": Placement(
        "kubernetes",
        pod_uid="fd52ef25-a87d-11e9-9423-0800271a638e",
        container="8c046cb0b72cd4c99f51b5591cd5b095967f58ee003710a45280c28ee1a9c7fa",
    ),
    # Kubernetes, systemd driver: containerd, CRI-O, docker; v1 and v2
    "k8s-v1-systemd-containerd-bottlerocket": Placement(
        "kubernetes",
        pod_uid="dd1bf9d1-241d-47f5-8e25-12de83135812",
        container="containerd://f45298cd514d1930c4fe3afc4412e59547f7e3148fddd22ca33cefce046eb830",
    ),
    "k8s-v1-systemd-containerd-colon": Placement(
        "kubernetes",
        pod_uid="2105e389-7471-476e-a50f-6074cef29bbd",
        container="containerd://d3d8ccf5cca91931c6285c1d7472c413dd5a7700fddc0aa9f89a9ac7008b003e",
    ),
    "k8s-v1-systemd-crio-besteffort": Placement(
        "kubernetes",
        pod_uid="8ca306fa-3c03-47fa-97dd-19979c345572",
        container="cri-o://d6d725b909f37c3e232aadfbafa950a58bfe7baa579ba8c47a12be88bb921607",
    ),
    "k8s-v1-systemd-crio-burstable-static-pod": Placement(
        "kubernetes",
        pod_uid="487a0dc6dccaeefbcfedba7a7ce1ca18",  # a static pod's UID: 32 hex digits
        container="cri-o://7a1fd6fe8cdfbd44dc78c4cc85dad7031eaab4365801684cad0aabdeaf863f9e",
    ),
    "k8s-v1-systemd-docker": Placement(
        "kubernetes",
        pod_uid="045b1e35-7f13-11e7-ac42-0050568ffca0",
        container="docker://b5b6f2da8008be266864f896f93789762b2ce50792114a5c5f2cc3315af0bc70",
    ),
    "k8s-v1-systemd-guaranteed": Placement(
        "kubernetes",
        pod_uid="97f1ae73-7ad9-11ec-b4a7-9a35488b4fab",
        container="3291bfddf3f3f8d87cb0cd1245fe9c45b2e1e5a9b6fe3de1bddf041aedaecbab",
    ),
    "k8s-v2-systemd-containerd": Placement(
        "kubernetes",
        pod_uid="9493223b-520e-4a97-a45f-359dcf967006",
        container="containerd://25d057a4c6c9555f2a0eb106e8896968c28f1c44aca4754174851aca7f89ad26",
    ),
    "k8s-v2-systemd-crio": Placement(
        "kubernetes", pod_uid=CRIO_V2_POD, container=f"cri-o://{CRIO_V2_ID}"
    ),
    # read from inside a cgroup namespace: the path climbs out of the reader's own cgroup
    "k8s-v2-cgroupns-docker": Placement(
        "kubernetes",
        pod_uid="fd698699-eabf-4c23-92ef-cf0bbdb78261",
        container="docker://2cc65c162ca1388b6b8d5ccfb701d22fc96675ccf8b2f1590c490c2c4039547f",
    ),
    # plain containers
    "docker-v1-cgroupfs": Placement(
        "container",
        container="docker://9d5b23edb1ba181e8910389a99906598d69ac9a0ead109ee55730cc416d95f7f",
    ),
    "docker-v1-systemd": Placement(
        "container",
        container="docker://9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d",
    ),
    "docker-v2-systemd": Placement(
        "container",
        container="docker://2b45249a1a21d3806efd98e2eb93c7dc319c645a27e7cd85362227becc68ca44",
    ),
    "docker-v2-cgroupns": Placement(
        "container",
        container="docker://1f1d6e2d4940ddac13abd421a2617992bf89f0e0f9a902ed58278c5f843e9ae7",
    ),
    "docker-in-docker-v1": Placement(  # the inner container
        "container",
        container="docker://ec08435e04266c5ba381fccbb829f626d11d8ddf5f8f547263c7a2d79ab4787a",
    ),
    "podman-v2-rootless": Placement(  # in its user's slice: that user's (issue 41)
        "container",
        uid=1000,
        container="podman://f13b567f07e025055fa9fa2793f44695036e3d412d82d16ee03d72e8b4eb8387",
    ),
    # bare processes: the login user of systemd's user-U.slice (issue 41)
    "bare-v1-session": Placement(uid=0),
    "bare-hybrid": Placement(uid=0),
    "bare-v2-init": Placement(),
    "bare-v2-user-app": Placement(uid=1000),
}


def test_every_fixture_has_a_layout() -> None:
    assert sorted(p.name for p in CGROUPS.iterdir()) == sorted(LAYOUTS)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cgroup_layouts(name: str) -> None:
    assert parse_cgroup(cgroup(name)) == LAYOUTS[name]


ID = "d3d8ccf5cca91931c6285c1d7472c413dd5a7700fddc0aa9f89a9ac7008b003e"
POD = "2105e389_7471_476e_a50f_6074cef29bbd"  # as systemd slice names write it
POD_UID = POD.replace("_", "-")


@pytest.mark.parametrize(
    "path, expected",
    [
        # Slurm's cgroup_v2 documentation (tests/fixtures/README.md): the step tree of
        # job 3385 under a node-prefixed scope (--enable-multiple-slurmd), slurmstepd's
        # own directory, the infinity process's waiting area, the batch step's task_special
        (
            "/system.slice/gamba1_slurmstepd.scope/job_3385/step_extern/user/task_0",
            Placement("slurm", job_id="3385", step="extern"),
        ),
        ("/system.slice/slurmstepd.scope/job_3385/step_0/slurm", Placement("slurm", "3385", "0")),
        ("/system.slice/slurmstepd.scope/system", Placement()),
        (
            "/system.slice/slurmstepd.scope/job_17/step_batch/user/task_special",
            Placement("slurm", job_id="17", step="batch"),
        ),
        # monitors beside containers are no containers: CRI-O's conmon (in the pod),
        # podman's conmon
        (
            f"/kubepods.slice/kubepods-pod{POD}.slice/crio-conmon-{ID}.scope",
            Placement("kubernetes", pod_uid=POD_UID),
        ),
        (f"/machine.slice/libpod-conmon-{ID}.scope", Placement()),
        # CRI-O and podman on the cgroupfs driver, podman's --cgroups=split, crun's
        # `container` subgroup, kind's kubelet-prefixed slices
        (
            f"/kubepods/besteffort/pod{POD_UID}/crio-{ID}",
            Placement("kubernetes", pod_uid=POD_UID, container=f"cri-o://{ID}"),
        ),
        (f"/libpod_parent/libpod-{ID}", Placement("container", container=f"podman://{ID}")),
        (
            f"/machine.slice/libpod-payload-{ID}.scope",
            Placement("container", container=f"podman://{ID}"),
        ),
        (
            f"/kubepods.slice/kubepods-pod{POD}.slice/crio-{ID}.scope/container",
            Placement("kubernetes", pod_uid=POD_UID, container=f"cri-o://{ID}"),
        ),
        (
            f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
            f"kubelet-kubepods-besteffort-pod{POD}.slice/cri-containerd-{ID}.scope",
            Placement("kubernetes", pod_uid=POD_UID, container=f"containerd://{ID}"),
        ),
        # not Slurm: `job_` must be a whole component under Slurm's own directories
        ("/user.slice/myjob_17/step_0", Placement()),
        ("/custom/job_17/step_0", Placement()),
        # not a pod: pod<UID> outside kubepods; not docker: a bare ID outside /docker
        (f"/machine/pod{POD_UID}/{ID}", Placement()),
    ],
)
def test_cgroup_paths_from_documentation(path: str, expected: Placement) -> None:
    """Layouts no capture in the fixtures shows, assembled from the documented directory
    names (Slurm's cgroup_v2 page; CRI-O's, podman's and crun's cgroup names)."""
    assert place(path) == expected


DELEGATED = "/user.slice/user-1000.slice/user@1000.service/app.slice"  # the tenant's own


@pytest.mark.parametrize(
    "path, expected",
    [
        # issue 23: a tenant names cgroups in its delegated subtree after a victim's job;
        # it stays its login user's (issue 41), whatever it names below
        (f"{DELEGATED}/uid_7319/job_748468/step_0", Placement(uid=1000)),
        (f"{DELEGATED}/slurm/uid_7319/job_748468/step_0", Placement(uid=1000)),
        (f"{DELEGATED}/system.slice/slurmstepd.scope/job_748468/step_0", Placement(uid=1000)),
        (f"{DELEGATED}/kubepods.slice/kubepods-pod{POD}.slice/payload", Placement(uid=1000)),
        (f"{DELEGATED}/user.slice/user-0.slice/session-1.scope", Placement(uid=1000)),
        # or nests them inside its own job or pod: the scheduler's (outer) one counts
        (
            "/system.slice/slurmstepd.scope/job_5/step_0/user/task_0/uid_7319/job_748468/step_0",
            Placement("slurm", job_id="5", step="0"),
        ),
        (
            f"/kubepods/besteffort/pod{POD_UID}/{ID}/kubepods/pod{CRIO_V2_POD}/{ID}",
            Placement("kubernetes", pod_uid=POD_UID, container=ID),
        ),
    ],
)
def test_scheduler_paths_count_only_from_the_root(path: str, expected: Placement) -> None:
    assert place(path) == expected


def test_a_delegated_cgroup_named_after_a_job_is_not_charged_to_it(tmp_path: Path) -> None:
    """Through the attribution: alice (uid 1000) in `…/uid_7319/job_748468/step_0`."""
    add_process(tmp_path, 100, f"0::{DELEGATED}/uid_7319/job_748468/step_0\n")
    assert owner_of(tmp_path, 100) == Owner("process", user="alice")


def test_garbage_cgroup_is_a_bare_process() -> None:
    for text in ("", "random garbage\n", "/job_hello/\n", "0::\n", "1:cpu\n"):
        assert parse_cgroup(text) == Placement()


# -- the environment --------------------------------------------------------------------


def env(**variables: str) -> bytes:
    """A real environ (procfs' fixture: NUL after each entry) with launcher variables."""
    return ENVIRON + b"".join(f"{k}={v}".encode() + b"\0" for k, v in variables.items())


def test_environ_real_format_without_launcher() -> None:
    assert parse_environ(ENVIRON) == Launch()
    assert parse_environ(b"") == Launch()


def test_environ_launcher_variables() -> None:
    slurm = env(SLURM_JOB_ID="748468", SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_JOB_USER="bob")
    assert parse_environ(slurm) == Launch("748468", "0", rank="5")  # the user is not read
    # torchrun under srun: RANK is the worker's rank, SLURM_PROCID the launcher's
    assert parse_environ(env(SLURM_PROCID="1", RANK="9")).rank == "9"
    assert parse_environ(env(PMI_RANK="2", OMPI_COMM_WORLD_RANK="3")).rank == "3"
    assert parse_environ(env(TORCHELASTIC_RUN_ID="ddp-77")).run_id == "ddp-77"
    assert parse_environ(env(TORCHELASTIC_RUN_ID="none")).run_id == ""  # torchrun's default
    # Slurm's named steps by their IDs (slurm.h)
    assert parse_environ(env(SLURM_STEP_ID="4294967291")).slurm_step == "batch"
    assert parse_environ(env(SLURM_STEP_ID="4294967292")).slurm_step == "extern"


def test_environ_values_that_are_no_label_values_are_dropped() -> None:
    garbage = env(SLURM_JOB_ID="1 2", RANK="-1", SLURM_JOB_USER="x" * 65, PMI_RANK="4")
    assert parse_environ(garbage) == Launch(rank="4", launched=True)
    assert parse_environ(b"RANK=7") == Launch(rank="7", launched=True)  # no NUL at the end
    assert parse_environ(b"\xff\xfe=1\0RANK\0=3\0") == Launch()


def test_environ_launcher_signature_and_communicator() -> None:
    """A rank carries its launcher's variables; what names its launch, most specific first."""
    torchrun = dict(RANK="3", LOCAL_RANK="3", WORLD_SIZE="8", TORCHELASTIC_RUN_ID="r7")
    launch = parse_environ(env(**torchrun, MASTER_ADDR="node1", MASTER_PORT="29500"))
    assert launch.launched and launch.communicator == "node1:29500"
    assert parse_environ(env(**torchrun)).communicator == "torchrun:r7"
    mpi = parse_environ(env(OMPI_COMM_WORLD_RANK="1", PMIX_NAMESPACE="prterun-n1-811@1"))
    assert mpi.launched and mpi.communicator == "pmix:prterun-n1-811@1"
    srun = env(SLURM_JOB_ID="42", SLURM_STEP_ID="0", SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="4")
    assert parse_environ(srun).communicator == "slurm:42.0"
    assert parse_environ(env(PMI_RANK="0")) == Launch(rank="0", launched=True)  # names none
    # no signature: a batch script's or `srun jupyter`'s processes (SLURM_PROCID 0, one
    # task), a notebook kernel, a rank variable that is no number
    for plain in (
        env(SLURM_JOB_ID="42", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1"),
        env(JPY_PARENT_PID="4100", MASTER_ADDR="node1", MASTER_PORT="29500"),
        env(RANK="x"),
    ):
        launch = parse_environ(plain)
        assert not launch.launched and launch.communicator == ""


def test_status_uid() -> None:
    assert parse_uid(STATUS_1000) == 1000  # a status that starts with an empty line
    assert parse_uid(STATUS_0) == 0
    assert parse_uid(b"Name:\tx\n") is None


# -- /proc trees --------------------------------------------------------------------------


def add_process(
    proc: Path,
    pid: int,
    cgroup_text: str,
    environ: bytes = ENVIRON,
    status: bytes = STATUS_1000,
    start: int = 82375,
) -> None:
    """/proc/PID with real stat and status files, the cgroup and the environ given."""
    base = proc / str(pid)
    base.mkdir(parents=True, exist_ok=True)
    fields = STAT.split(b" ")
    fields[21] = str(start).encode()  # starttime
    (base / "stat").write_bytes(b" ".join(fields))
    (base / "status").write_bytes(status)
    (base / "cgroup").write_text(cgroup_text)
    (base / "environ").write_bytes(environ)


def one_gpu(*pids: int, memory: Callable[[int], float] = lambda pid: 1.0) -> GpuProcesses:
    return GpuProcesses(0, "GPU-0", {pid: memory(pid) for pid in pids})


def owner_of(proc: Path, pid: int, **kwargs: object) -> Owner | None:
    attribution = Attribution(proc, users=users, **kwargs)  # type: ignore[arg-type]
    return attribution.owners([one_gpu(pid)])["GPU-0"]


def test_slurm_v1_with_environment(tmp_path: Path) -> None:
    launch = env(SLURM_JOB_ID="748468", SLURM_STEP_ID="0", SLURM_PROCID="12")
    add_process(tmp_path, 100, cgroup("slurm-v1-freezer-only"), launch)
    assert owner_of(tmp_path, 100) == Owner("slurm", "748468", "0", rank="12", user="bob")
    # SLURM_JOB_USER is the process's own to set: the cgroup's uid names the user (issue 41)
    add_process(tmp_path, 101, cgroup("slurm-v1-freezer-only"), launch + b"SLURM_JOB_USER=carol\0")
    assert owner_of(tmp_path, 101) == Owner("slurm", "748468", "0", rank="12", user="bob")


def test_slurm_v2_environment_unread(tmp_path: Path) -> None:
    launch = env(SLURM_JOB_ID="1392969", SLURM_PROCID="3")
    add_process(tmp_path, 100, cgroup("slurm-v2-step"), launch, STATUS_1000)
    expected = Owner("slurm", "1392969", "0", user="alice")  # no uid in v2 paths: the process's
    assert owner_of(tmp_path, 100, read_environ=False) == expected


def test_environment_of_another_job_is_ignored(tmp_path: Path) -> None:
    """A process adopted into job 748468 (pam_slurm_adopt) that inherited job 1's variables."""
    launch = env(SLURM_JOB_ID="1", SLURM_PROCID="4", SLURM_JOB_USER="mallory")
    add_process(tmp_path, 100, cgroup("slurm-v1-freezer-only"), launch)
    assert owner_of(tmp_path, 100) == Owner("slurm", "748468", "0", user="bob")


def test_slurm_without_cgroup_tracking(tmp_path: Path) -> None:
    """proctrack/linuxproc: the process stays in the session's cgroup. Its variables name
    a job only where the prolog's job file confirms it (issue 41: any process sets them)."""
    launch = env(SLURM_JOB_ID="55", SLURM_STEP_ID="4294967291", SLURM_PROCID="0")
    add_process(tmp_path / "proc", 100, cgroup("bare-v1-session"), launch, STATUS_0)
    assert owner_of(tmp_path / "proc", 100) == Owner("process", rank="0", user="root")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "0").write_text("55\n")
    assert owner_of(tmp_path / "proc", 100, job_dir=tmp_path / "jobs") == Owner(
        "slurm", "55", "batch", rank="0", user="root"
    )


def test_torchrun_outside_slurm(tmp_path: Path) -> None:
    launch = env(TORCHELASTIC_RUN_ID="resnet-42", RANK="3", LOCAL_RANK="3", WORLD_SIZE="8")
    add_process(tmp_path, 100, cgroup("bare-v2-user-app"), launch)
    assert owner_of(tmp_path, 100) == Owner("process", "resnet-42", rank="3", user="alice")
    add_process(tmp_path, 101, cgroup("k8s-v2-systemd-crio"), launch, STATUS_0)
    assert owner_of(tmp_path, 101) == Owner(
        "kubernetes",
        "resnet-42",
        rank="3",
        user="root",
        pod=CRIO_V2_POD,
        container=f"cri-o://{CRIO_V2_ID}",
    )


@pytest.mark.parametrize(
    "name, scheduler",
    [
        ("k8s-v1-systemd-containerd-colon", "kubernetes"),
        ("k8s-v2-systemd-containerd", "kubernetes"),
        ("k8s-v1-cgroupfs-docker", "kubernetes"),
        ("docker-v2-systemd", "container"),
        ("podman-v2-rootless", "container"),
        ("bare-v2-init", "process"),
    ],
)
def test_containers_and_bare_processes(tmp_path: Path, name: str, scheduler: str) -> None:
    add_process(tmp_path, 100, cgroup(name), status=STATUS_0)
    expected = LAYOUTS[name]
    assert owner_of(tmp_path, 100) == Owner(
        scheduler, user="root", pod=expected.pod_uid, container=expected.container
    )


def test_uid_without_a_name_is_its_number(tmp_path: Path) -> None:
    add_process(tmp_path, 100, cgroup("slurm-v1-interactive"))
    assert owner_of(tmp_path, 100) == Owner("slurm", "280678", "interactive", user="2101171")


def test_main_process_is_the_one_with_most_memory(tmp_path: Path) -> None:
    add_process(tmp_path, 100, cgroup("slurm-v2-step"))  # a small helper
    add_process(tmp_path, 200, cgroup("docker-v2-systemd"))  # the trainer
    memory = {100: 1e8, 200: 4e10, 300: 8e10}  # 300: listed by NVML, exited since
    gpu = GpuProcesses(0, "GPU-0", memory)
    owner = Attribution(tmp_path, users=users).owners([gpu])["GPU-0"]
    assert owner is not None and owner.scheduler == "container"
    tie = GpuProcesses(1, "GPU-1", {200: 1.0, 100: 1.0})  # the lowest pid on a tie
    owner = Attribution(tmp_path, users=users).owners([tie])["GPU-1"]
    assert owner is not None and owner.scheduler == "slurm"


def test_environment_read_once_per_process(tmp_path: Path) -> None:
    add_process(tmp_path, 100, cgroup("bare-v2-init"), env(RANK="1"))
    attribution = Attribution(tmp_path, users=users)
    assert attribution.owners([one_gpu(100)])["GPU-0"] == Owner(rank="1", user="alice")
    (tmp_path / "100" / "environ").write_bytes(env(RANK="2"))
    assert attribution.owners([one_gpu(100)])["GPU-0"] == Owner(rank="1", user="alice")
    # the pid reused by a new process (another start time): read again
    add_process(tmp_path, 100, cgroup("bare-v2-init"), env(RANK="2"), start=99999)
    assert attribution.owners([one_gpu(100)])["GPU-0"] == Owner(rank="2", user="alice")
    # a process moved to another cgroup is seen at once
    (tmp_path / "100" / "cgroup").write_text(cgroup("slurm-v2-step"))
    owner = attribution.owners([one_gpu(100)])["GPU-0"]
    assert owner is not None and owner.job_id == "1392969"
    attribution.owners([one_gpu()])
    assert attribution.processes._known == {}  # forgotten once off the GPUs


def test_gpus_without_a_readable_process(tmp_path: Path) -> None:
    gpus = [GpuProcesses(i, f"GPU-{i}", {}) for i in range(3)]
    gpus.append(GpuProcesses(3, "GPU-3", {4242: 1.0}))  # gone
    pods = {"GPU-1": PodContainer("ml", "trainer-0", "main")}
    owners = owners_by_gpu(gpus, ProcessReader(tmp_path).read, jobs={0: "77", 3: "78"}, pods=pods)
    assert owners == {
        "GPU-0": Owner("slurm", "77"),  # allocated to a job, idle
        "GPU-1": Owner("kubernetes", namespace="ml", pod="trainer-0", container="main"),
        "GPU-2": None,  # nobody's
        "GPU-3": Owner("slurm", "78"),
    }


def test_owner_values_follow_labels() -> None:
    owner = Owner("slurm", "1", "0", "3", "bob", "ns", "pod", "ctr")
    assert dict(zip(LABELS, owner.values(), strict=True)) == {
        "scheduler": "slurm",
        "job_id": "1",
        "step": "0",
        "rank": "3",
        "user": "bob",
        "namespace": "ns",
        "pod": "pod",
        "container": "ctr",
    }


# -- a real unreadable environment ---------------------------------------------------------

NOBODY = 65534


def as_nobody(read: Callable[[], list[str]]) -> list[str]:
    """read() in a child process that runs as `nobody` (uid and gid 65534, no groups)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, json.dumps(read()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another user")
def test_unreadable_environment_is_normal() -> None:
    """A root process with a Slurm job's variables: root reads them, `nobody` cannot (no
    CAP_SYS_PTRACE, another uid) and still gets the owner from cgroup and status."""
    own = parse_cgroup(Path("/proc/self/cgroup").read_text())
    if own.job_id:
        pytest.skip("inside a Slurm job: its cgroup names another job than the variables")
    variables = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    variables.update(SLURM_JOB_ID="4242", SLURM_PROCID="7")
    helper = subprocess.Popen(["sleep", "30"], env=variables)
    environ = Path(f"/proc/{helper.pid}/environ")
    try:
        wait_until("the helper's exec", lambda: b"SLURM_JOB_ID=4242" in environ.read_bytes(), 10)
        gpu = GpuProcesses(0, "GPU-0", {helper.pid: 1.0})

        def read() -> list[str]:
            owner = Attribution(Path("/proc"), users=str).owners([gpu])["GPU-0"]
            assert owner is not None
            return list(owner.values())

        as_root = dict(zip(LABELS, read(), strict=True))
        as_nobody_ = dict(zip(LABELS, as_nobody(read), strict=True))
    finally:
        helper.kill()
        helper.wait()
    # the job is the variables' only: unconfirmed, not the owner's (issue 41)
    assert (as_root["job_id"], as_root["rank"], as_root["user"]) == ("", "7", "0")
    assert (as_nobody_["job_id"], as_nobody_["rank"], as_nobody_["user"]) == ("", "", "0")
    assert as_nobody_["scheduler"] == own.scheduler


# -- per-GPU job files (dcgm-exporter's --hpc-job-mapping-dir) ------------------------------


def test_job_files_dcgm_exporter_format(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    shutil.copytree(FIXTURES / "owner" / "hpc-job-mapping", jobs)
    (jobs / "iamdir").mkdir()  # skipped, as dcgm-exporter does: directories
    (jobs / "iamdir" / "9").write_text("nested\n")
    (jobs / "README").write_text("not a GPU\n")  # and names that are no GPU
    (jobs / "5").write_text("45916256 262563\n")  # Princeton jobstats: "<job> <uid>"
    (jobs / "6").write_text("\n  \n")
    assert read_job_files(jobs) == {
        0: ["job1-0"],
        1: ["job1-1", "job2-1"],
        3: ["job3.0-0"],  # MIG instance 3.0 (no trailing newline)
        5: ["45916256"],
    }
    assert read_job_files(tmp_path / "missing") == {}


def test_job_file_names_the_job_of_a_bare_process(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    shutil.copytree(FIXTURES / "owner" / "hpc-job-mapping", jobs)
    add_process(tmp_path / "proc", 100, cgroup("bare-v1-session"))
    gpus = [GpuProcesses(1, "GPU-1", {100: 1.0}), GpuProcesses(0, "GPU-0", {})]
    owners = Attribution(tmp_path / "proc", job_dir=jobs, users=users).owners(gpus)
    assert owners == {
        "GPU-1": Owner("slurm", "job1-1", user="alice"),  # the first job listed
        "GPU-0": Owner("slurm", "job1-0"),
    }


# -- the kubelet's pod-resources API over a real gRPC server -------------------------------

UUIDS = [f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in range(6)]


def allocation(
    namespace: str, pod: str, *containers: tuple[str, str, list[str]]
) -> api_pb2.PodResources:
    return api_pb2.PodResources(
        name=pod,
        namespace=namespace,
        containers=[
            api_pb2.ContainerResources(
                name=name,
                devices=[api_pb2.ContainerDevices(resource_name=resource, device_ids=ids)],
            )
            for name, resource, ids in containers
        ],
    )


NODE = api_pb2.ListPodResourcesResponse(
    pod_resources=[
        allocation("ml", "trainer-0", ("main", "nvidia.com/gpu", [UUIDS[0], UUIDS[1]])),
        allocation("ml", "notebook", ("lab", "nvidia.com/gpu", [f"{UUIDS[2]}::3"])),  # time-sliced
        allocation("infer", "server", ("triton", "nvidia.com/gpu", ["3"])),  # by index
        allocation("gke", "job", ("worker", "nvidia.com/gpu", ["nvidia4"])),  # GKE's plugin
        allocation("mig", "small", ("w", "nvidia.com/mig-1g.10gb", ["MIG-0000"])),  # no whole GPU
        allocation("net", "sriov", ("c", "intel.com/sriov", [UUIDS[5]])),  # not a GPU resource
    ]
)


class Lister(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's side: answers NODE, after `delay` seconds, or UNAVAILABLE."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.fail = False
        self.calls = 0

    def List(self, request: object, context: grpc.ServicerContext) -> object:
        self.calls += 1
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
        time.sleep(self.delay)
        return NODE


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[Lister, str]]:
    """A gRPC server implementing PodResourcesLister on a unix socket, as the kubelet does."""
    lister = Lister()
    socket = str(tmp_path / "kubelet.sock")
    with serving_pod_resources(lister, socket):
        yield lister, socket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_device_keys() -> None:
    assert device_key(UUIDS[0]) == UUIDS[0]
    assert device_key(f"{UUIDS[0]}::12") == UUIDS[0]
    assert device_key("nvidia7") == "7"
    assert device_key("3") == "3"


def test_pod_names_from_the_kubelet(tmp_path: Path, kubelet: tuple[Lister, str]) -> None:
    lister, socket = kubelet
    add_process(tmp_path, 100, cgroup("k8s-v2-systemd-crio"), env(RANK="0"), STATUS_0)
    client = PodResources(socket, timeout=5.0)
    attribution = Attribution(tmp_path, pod_resources=client, users=users)
    gpus = [GpuProcesses(i, uuid, {}) for i, uuid in enumerate(UUIDS)]
    gpus[0] = GpuProcesses(0, UUIDS[0], {100: 1e9})
    owners = attribution.owners(gpus)
    attribution.close()
    kubernetes = "kubernetes"
    assert owners == {
        UUIDS[0]: Owner(
            kubernetes, rank="0", user="root", namespace="ml", pod="trainer-0", container="main"
        ),
        UUIDS[1]: Owner(kubernetes, namespace="ml", pod="trainer-0", container="main"),
        UUIDS[2]: Owner(kubernetes, namespace="ml", pod="notebook", container="lab"),
        UUIDS[3]: Owner(kubernetes, namespace="infer", pod="server", container="triton"),
        UUIDS[4]: Owner(kubernetes, namespace="gke", pod="job", container="worker"),
        UUIDS[5]: None,
    }
    assert lister.calls == 1


def test_kubelet_answer_is_kept_for_refresh(kubelet: tuple[Lister, str]) -> None:
    lister, socket = kubelet
    clock = Clock()
    client = PodResources(socket, timeout=5.0, refresh=10.0, clock=clock)
    assert client.devices()[UUIDS[0]] == PodContainer("ml", "trainer-0", "main")
    clock.now += 9.9
    client.devices()
    assert lister.calls == 1
    clock.now += 0.1
    client.devices()
    assert lister.calls == 2
    client.close()


def test_kubelet_failing_falls_back_to_ids_and_retries_later(
    tmp_path: Path, kubelet: tuple[Lister, str], caplog: pytest.LogCaptureFixture
) -> None:
    lister, socket = kubelet
    lister.fail = True
    clock = Clock()
    client = PodResources(socket, timeout=5.0, refresh=10.0, retry=60.0, clock=clock)
    add_process(tmp_path, 100, cgroup("k8s-v2-systemd-crio"), status=STATUS_0)
    attribution = Attribution(tmp_path, pod_resources=client, users=users)
    gpu = [GpuProcesses(0, UUIDS[0], {100: 1.0})]
    ids = Owner("kubernetes", user="root", pod=CRIO_V2_POD, container=f"cri-o://{CRIO_V2_ID}")
    with caplog.at_level(logging.WARNING):
        assert attribution.owners(gpu)[UUIDS[0]] == ids
        clock.now += 30
        assert attribution.owners(gpu)[UUIDS[0]] == ids
    assert lister.calls == 1  # not asked again before `retry`
    assert [r.getMessage() for r in caplog.records if "UNAVAILABLE" in r.getMessage()]
    lister.fail = False
    clock.now += 30
    owner = attribution.owners(gpu)[UUIDS[0]]
    assert owner is not None and (owner.pod, owner.container) == ("trainer-0", "main")
    attribution.close()


def test_slow_kubelet_costs_one_timeout(kubelet: tuple[Lister, str]) -> None:
    lister, socket = kubelet
    lister.delay = 1.0
    client = PodResources(socket, timeout=0.2)
    started = time.monotonic()
    assert client.devices() == {}
    assert client.devices() == {}  # backing off: not asked again
    assert time.monotonic() - started < 1.5
    assert lister.calls == 1
    client.close()


def test_no_kubelet_socket_is_no_kubernetes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = PodResources(str(tmp_path / "absent.sock"))
    with caplog.at_level(logging.INFO):
        assert client.devices() == {}
    assert caplog.records == []
    client.close()


def test_the_gpus_of_one_process_and_job_share_one_owner(tmp_path: Path) -> None:
    add_process(tmp_path, 100, cgroup("bare-v2-init"), env(RANK="1"))
    add_process(tmp_path, 200, cgroup("bare-v2-init"), env(RANK="2"))
    gpus = [GpuProcesses(i, f"GPU-{i}", {100 if i < 3 else 200: 1.0}) for i in range(4)]
    memo: dict[int, ProcessFacts | None] = {}  # as the processes source reads: once a pid

    def facts(pid: int) -> ProcessFacts | None:
        return memo[pid] if pid in memo else memo.setdefault(pid, ProcessReader(tmp_path).read(pid))

    owners = owners_by_gpu(gpus, facts, jobs={2: "77"}, users=users)
    assert owners["GPU-0"] is owners["GPU-1"]  # made once, with its labels' tuple
    assert owners["GPU-0"] == Owner(rank="1", user="alice")
    assert owners["GPU-2"] == Owner("slurm", "77", rank="1", user="alice")  # its own job
    assert owners["GPU-3"] == Owner(rank="2", user="alice")
    assert owners["GPU-3"].values() == ("process", "", "", "2", "alice", "", "", "")
