"""GPU owners no tenant can forge, and owners under the unit's PrivateUsers=yes (issue 41,
items 4 and 5): the environment is a process's own (SLURM_JOB_ID, SLURM_JOB_USER), so it
names a job only where the cgroup or a prolog's job file confirms it and never the user;
in a user namespace that maps only root and the daemon's user (what PrivateUsers=yes
makes), every other uid reads 65534, which is unknown, never `nobody`.

Through real /proc trees (tests/test_owner.py's fixtures), a real user namespace over
the real /proc, a simulated node's processes source, and `gpuwatchd report` on a real
Prometheus holding what that source exported."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from backfill import Device, Timeline, backfilled_prometheus
from backfill import Owner as Held
from cgroups import placed
from click.testing import CliRunner
from servers import wait_until

from gpuwatchd.cli import main
from gpuwatchd.config import ProcessesConfig
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources.owner import (
    LABELS,
    Attribution,
    GpuProcesses,
    InstanceProcesses,
    Owner,
    ProcessReader,
    owners_by_instance,
)
from gpuwatchd.sources.owner.process import unmapped_uid
from gpuwatchd.sources.processes import ProcessesSource
from tests.test_owner import STATUS_1000, add_process, cgroup, env, owner_of, users

SLURM_V2 = cgroup("slurm-v2-step")  # job 1392969, step 0: no uid in the path
SESSION = "0::/user.slice/user-7319.slice/session-4.scope\n"  # bob's login session
NOBODY = STATUS_1000.replace(b"Uid:\t1000\t1000\t1000\t0", b"Uid:\t65534\t65534\t65534\t65534")
assert NOBODY != STATUS_1000


# -- item 5: the environment is the process's own ---------------------------------------


def test_slurm_job_user_in_ones_own_step_is_not_the_user(tmp_path: Path) -> None:
    forged = env(SLURM_JOB_ID="1392969", SLURM_STEP_ID="0", SLURM_JOB_USER="bob")
    add_process(tmp_path, 100, SLURM_V2, forged, STATUS_1000)  # alice's step
    assert owner_of(tmp_path, 100) == Owner("slurm", "1392969", "0", user="alice")


@pytest.mark.parametrize(
    "variables",
    [
        {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_USER": "bob"},
        {"TORCHELASTIC_RUN_ID": "4242", "RANK": "0", "WORLD_SIZE": "1"},  # no job file
    ],
)
def test_a_job_named_outside_any_job_is_not_that_job(
    tmp_path: Path, variables: dict[str, str]
) -> None:
    """Outside Slurm, `SLURM_JOB_ID=4242` (or a torchrun run id that could be a Slurm
    job's) put alice's GPU in bob's job 4242, and `gpuwatchd report 4242` counted it."""
    add_process(tmp_path, 100, "0::/user.slice/user-1000.slice/session-2.scope\n",
                env(**variables), STATUS_1000)  # fmt: skip
    owner = owner_of(tmp_path, 100)
    assert owner is not None and (owner.scheduler, owner.job_id, owner.step) == ("process", "", "")
    assert owner.user == "alice"


def test_a_job_file_confirms_the_environment_and_names_the_user(tmp_path: Path) -> None:
    """A prolog's file `0` says "4242 7319" (jobstats' `<job> <uid>`): the variables of
    job 4242 count, and the job's user is uid 7319 even where the kernel's is unknown."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("4242 7319\n")
    launch = env(SLURM_JOB_ID="4242", SLURM_STEP_ID="1", SLURM_PROCID="3", SLURM_JOB_USER="eve")
    add_process(tmp_path / "proc", 100, "0::/init.scope\n", launch, NOBODY)
    attribution = Attribution(tmp_path / "proc", job_dir=jobs, users=users)
    attribution.processes.unmapped = 65534  # as under PrivateUsers=yes
    owner = attribution.owners([GpuProcesses(0, "GPU-0", {100: 1.0})])["GPU-0"]
    assert owner == Owner("slurm", "4242", "1", rank="3", user="bob")
    (jobs / "0").write_text("5555\n")  # another job's file: the variables are ignored whole
    owner = attribution.owners([GpuProcesses(0, "GPU-0", {100: 1.0})])["GPU-0"]
    assert owner == Owner("slurm", "5555")


def test_job_files_anyone_may_write_are_not_read(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("4242\n")
    jobs.chmod(0o1777)  # sticky and world-writable, as /tmp
    add_process(tmp_path / "proc", 100, SESSION, env(SLURM_JOB_ID="4242"), STATUS_1000)
    owner = owner_of(tmp_path / "proc", 100, job_dir=jobs)
    assert owner is not None and owner.job_id == "" and owner.scheduler == "process"


def test_the_same_per_mig_instance(tmp_path: Path) -> None:
    forged = env(SLURM_JOB_ID="4242", SLURM_JOB_USER="bob", TORCHELASTIC_RUN_ID="4242")
    add_process(tmp_path, 100, SESSION.replace("7319", "1000"), forged, STATUS_1000)
    add_process(tmp_path, 200, SLURM_V2, forged, STATUS_1000)
    reader = ProcessReader(tmp_path)
    instances = [InstanceProcesses(0, "GPU-0", gi, (f"MIG-{gi}",), {pid: 1.0})
                 for gi, pid in ((1, 100), (2, 200))]  # fmt: skip
    owners = owners_by_instance(instances, reader.read, users=users)
    assert owners[("GPU-0", 1)] == Owner("process", user="alice")
    assert owners[("GPU-0", 2)] == Owner("slurm", "1392969", "0", user="alice")


# -- item 4: PrivateUsers=yes -----------------------------------------------------------


def test_an_unmapped_uid_is_unknown_and_the_login_slice_names_it(tmp_path: Path) -> None:
    add_process(tmp_path, 100, SESSION, status=NOBODY)
    add_process(tmp_path, 200, "0::/system.slice/train.service\n", status=NOBODY)
    attribution = Attribution(tmp_path, users=users)
    attribution.processes.unmapped = 65534
    gpus = [GpuProcesses(0, "GPU-0", {100: 1.0}), GpuProcesses(1, "GPU-1", {200: 1.0})]
    owners = attribution.owners(gpus)
    assert owners["GPU-0"] == Owner("process", user="bob")  # was "nobody"
    assert owners["GPU-1"] == Owner("process", user="")  # unknown, not "nobody"


def test_the_unmapped_uid_is_the_overflow_uid_only_where_not_mapped(tmp_path: Path) -> None:
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "overflowuid").write_text("65534\n")
    (tmp_path / "self").mkdir()
    for uid_map, unmapped in (
        ("         0          0 4294967295\n", None),  # the host's namespace
        ("         0          0          1\n       990        990          1\n", 65534),
        ("         0     100000      65536\n", None),  # a container's: 65534 is its nobody
    ):
        (tmp_path / "self" / "uid_map").write_text(uid_map)
        assert unmapped_uid(str(tmp_path)) == unmapped


CLONE_NEWUSER = 0x10000000


def in_private_users(read: Callable[[], Any]) -> Any:
    """read() in a child in a user namespace of its own that maps root and uid 990 (as
    systemd's PrivateUsers=yes maps root and the service's user), as that root."""
    results, ready, go = os.pipe(), os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
            os.write(ready[1], b"!")
            os.read(go[0], 1)  # the parent has written the maps
            os.write(results[1], json.dumps(read()).encode())
            code = 0
        finally:
            os._exit(code)
    for fd in (results[1], ready[1], go[0]):
        os.close(fd)
    try:
        if os.read(ready[0], 1) == b"!":
            Path(f"/proc/{pid}/uid_map").write_text("0 0 1\n990 990 1\n")
            Path(f"/proc/{pid}/setgroups").write_text("deny")
            Path(f"/proc/{pid}/gid_map").write_text("0 0 1\n")
        os.write(go[1], b"!")
        with os.fdopen(results[0], "rb") as pipe:
            data = pipe.read()
    finally:
        _, status = os.waitpid(pid, 0)
        for fd in (ready[0], go[1]):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, "the child in the user namespace failed"
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to map uids and make cgroups")
def test_owners_in_a_real_user_namespace_as_the_unit_makes_it() -> None:
    """A real process of uid 4321 in its login session's cgroup, read through the real
    /proc from a user namespace mapping only root and the daemon's uid: the kernel says
    65534 (the old owner: `nobody`); the owner is uid 4321, from the session's slice."""
    session = f"/user.slice/user-4321.slice/session-{uuid.uuid4().int % 10**6}.scope"
    tenant = subprocess.Popen(["sleep", "30"], user=4321, group=4321)
    try:
        wait_until("the tenant's exec", lambda: Path(f"/proc/{tenant.pid}/comm").read_text()
                   == "sleep\n", 10)  # fmt: skip
        with placed(tenant.pid, session) as where:
            if where is None:
                pytest.skip("no cgroup can be made here (a writable hierarchy, no user.slice)")
            gpu = GpuProcesses(0, "GPU-0", {tenant.pid: 1.0})

            def read() -> list[Any]:
                status = Path(f"/proc/{tenant.pid}/status").read_text()
                owner = Attribution(Path("/proc"), users=str).owners([gpu])["GPU-0"]
                assert owner is not None
                return [status.split("Uid:")[1].split()[0], *owner.values()]

            kernel_uid, *labels = in_private_users(read)
    finally:
        tenant.kill()
        tenant.wait()
    assert kernel_uid == "65534"  # what the daemon's namespace shows
    assert dict(zip(LABELS, labels, strict=True))["user"] == "4321"


# -- `gpuwatchd report 4242` through the owner series -----------------------------------

FORGERY = Scenario.model_validate({
    "name": "forged-owners",
    "node": {"gpu_count": 3, "hostname": "n1", "host": {
        "users": {2001: "ada", 2002: "eve"},
        "processes": [
            # ada's job 4242 on GPU 0
            {"pid": 4300, "uid": 2001, "owner": {"slurm": {"job": 4242}},
             "environment": {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}},
            # eve outside Slurm, naming ada's job and ada (and a torchrun run id as the job)
            {"pid": 4400, "uid": 2002, "cgroup": "/user.slice/user-2002.slice/session-9.scope",
             "environment": {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
                             "SLURM_JOB_USER": "ada", "TORCHELASTIC_RUN_ID": "4242"}},
            # eve in her own job 5000, naming ada
            {"pid": 4500, "uid": 2002, "owner": {"slurm": {"job": 5000}},
             "environment": {"SLURM_JOB_ID": "5000", "SLURM_JOB_USER": "ada"}},
        ]}},
    "phases": [{"name": "p", "duration": "10m", "changes": [
        {"gpus": [gpu], "set": {"processes": [{"pid": pid, "gpu_memory_mib": 9000}]}}
        for gpu, pid in ((0, 4300), (1, 4400), (2, 4500))]}],
})  # fmt: skip


def exported_owners() -> dict[str, dict[str, str]]:
    """gpu -> the labels of gpuwatchd_gpu_owner_info, from a processes source polling the
    simulated node (the simulator's processes, cgroups, environments and user database)."""
    sim = SimNode(FORGERY, virtual=True)
    source = ProcessesSource(ProcessesConfig(), sim.context())
    try:
        for t in (5.0, 10.0):
            sim.clock.advance(t - sim.clock.elapsed())
            sim.tick()
            samples = source.collect()
    finally:
        source.close()
        sim.close()
    owners = [s for s in samples if s.name == "gpuwatchd_gpu_owner_info"]
    return {s.labels[0]: dict(zip(LABELS, s.labels[2:], strict=True)) for s in owners}


def test_report_4242_no_longer_counts_a_forgers_gpus(tmp_path: Path) -> None:
    owners = exported_owners()
    assert {g: (o["scheduler"], o["job_id"], o["user"]) for g, o in owners.items()} == {
        "0": ("slurm", "4242", "ada"),
        "1": ("process", "", "eve"),  # was ("slurm", "4242", "ada")
        "2": ("slurm", "5000", "eve"),  # was ("slurm", "5000", "ada")
    }
    start = 1_800_000_000.0
    held = [Held(Device("n1", int(g)), start, start + 600, job_id=o["job_id"], rank=o["rank"],
                 user=o["user"]) for g, o in owners.items()]  # fmt: skip
    with backfilled_prometheus(tmp_path, Timeline(start, start + 600, held, [])) as prometheus:
        args = ["report", "4242", "--prometheus", prometheus.base, "--since", f"{start}",
                "--until", f"{start + 600}", "--json"]  # fmt: skip
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["gpus"], report["user"]) == (1, "ada")  # GPU 0 alone
