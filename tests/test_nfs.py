"""NFS mounts tied to GPU jobs (issue 39 item 4): mountstats parsed as the kernel prints it,
the simulator's mountstats, and what the processes source makes of them in each privilege
mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.config import ConfigError, ProcessesConfig
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario, load_scenario
from gpuwatchd.sources.mountstats import (
    OpStats,
    nfs_by_device,
    parse_mounts,
    parse_mountstats,
)
from gpuwatchd.sources.nfsio import reads_between
from gpuwatchd.sources.processes import ProcessesSource

PROCIO = Path(__file__).parent / "fixtures" / "procio" / "procfs" / "26231"
NFS = "gpuwatchd_gpu_process_nfs_"


def test_parse_mountstats_on_the_real_file() -> None:
    mounts = parse_mountstats((PROCIO / "mountstats").read_bytes())
    assert [(m.device, m.mountpoint, m.fstype) for m in mounts] == [
        ("rootfs", "/", "rootfs"),
        ("sysfs", "/sys", "sysfs"),
        ("proc", "/proc", "proc"),
        ("/dev/sda1", "/", "ext4"),
        ("192.168.1.1:/srv/test", "/mnt/nfs/test", "nfs4"),
    ]
    assert [m.ops is None for m in mounts] == [True, True, True, True, False]
    ops = mounts[4].ops
    assert ops is not None and set(ops) == {"NULL", "READ", "WRITE", "ACCESS"}
    # prometheus/procfs's reading of the same line (mountstats_test.go)
    assert ops["READ"] == OpStats(1298, 1298, 0, 207680, 1210292152, 6, 79386, 79407)
    assert ops["ACCESS"].queue_ms == 18446743919241604546  # wrapped upstream, still a count


@pytest.mark.parametrize(
    "garbage",
    [
        b"device x mounted BAD / with fstype ext4\n",
        b"device a:/b mounted on /m with fstype nfs4 statvers=1.1\n\tper-op statistics\n"
        b"\t        READ: 1 2 3\n",
        b"device a:/b mounted on /m with fstype nfs4 statvers=1.1\n\tper-op statistics\n"
        b"\t        READ: 1 2 3 4 5 6 7 x\n",
    ],
)
def test_malformed_mountstats_is_an_error(garbage: bytes) -> None:
    with pytest.raises(ValueError):
        parse_mountstats(garbage)


def test_mounts_pair_by_order_else_by_a_unique_mount_point() -> None:
    info = (
        b"24 1 259:1 / / rw - ext4 /dev/nvme0n1p1 rw\n"
        b"100 24 0:52 / /mnt/data rw - nfs4 10.0.0.5:/datasets rw,vers=4.1\n"
        b"101 24 0:53 / /mnt/home rw - nfs 10.0.0.6:/home rw,vers=3\n"
    )
    read = "\t        READ: 10 10 0 2120 10486000 1 480 490 0\n"
    stats = (
        b"device /dev/nvme0n1p1 mounted on / with fstype ext4\n"
        + b"device 10.0.0.5:/datasets mounted on /mnt/data with fstype nfs4 statvers=1.1\n"
        + f"\tage:\t12\n\tper-op statistics\n{read}\n".encode()
        + b"device 10.0.0.6:/home mounted on /mnt/home with fstype nfs statvers=1.1\n"
        + b"\tper-op statistics\n\t        READ: 0 0 0 0 0 0 0 0 0\n\n"
    )
    rows = parse_mounts(info)
    by_device = nfs_by_device(rows, parse_mountstats(stats))
    assert sorted(by_device) == [(0, 52), (0, 53)]
    assert by_device[(0, 52)][0].source == "10.0.0.5:/datasets"
    assert by_device[(0, 52)][1]["READ"].rtt_ms == 480
    # a mount came between the two reads: the order no longer pairs, mount points still do
    raced = parse_mounts(info + b"102 24 0:54 / /mnt/new rw - nfs4 10.0.0.9:/new rw\n")
    assert sorted(nfs_by_device(raced, parse_mountstats(stats))) == [(0, 52), (0, 53)]


def test_reads_between_two_polls() -> None:
    before = OpStats(100, 100, 0, 0, 100 << 20, 0, 200, 210)
    now = OpStats(200, 200, 0, 0, 200 << 20, 500, 5000, 5510)
    reads = reads_between(before, now, 5.0)
    assert reads is not None
    assert reads.rtt_seconds == pytest.approx(0.048)  # 4800 ms over 100 READs
    assert reads.execute_seconds == pytest.approx(0.053)
    assert reads.in_flight == pytest.approx(1.06)  # 5.3 s of READ time in 5 s
    assert reads.bytes_per_second == pytest.approx((100 << 20) / 5)
    assert reads_between(now, before, 5.0) is None  # remounted: counters start again
    assert reads_between(now, now, 5.0).rtt_seconds is None  # type: ignore[union-attr]


SCENARIO = {
    "name": "nfs-unit",
    "node": {
        "gpu_count": 2,
        "host": {
            "disks": [{"name": "nvme0n1"}],
            "nfs_mounts": [
                {"name": "data", "server": "10.0.0.5", "export": "/datasets",
                 "mountpoint": "/mnt/data"},
                {"name": "home", "server": "10.0.0.6", "version": "3"},
                {"name": "podvol", "server": "filer01", "daemon_sees": False},
            ],
            "processes": [{"pid": 42, "uid": 1201}, {"pid": 43, "uid": 1202}],
        },
        "initial_host": {
            "processes": {
                42: {"workers": 4, "worker_read_mb_s": 5, "reads_from": "data",
                     "io_blocked_workers": 3},
                43: {"workers": 2, "worker_read_mb_s": 1, "reads_from": "podvol"},
            },
            "nfs": {"data": {"read_rtt_ms": 48, "read_ops_per_second": 40},
                    "home": {"read_mb_s": 300, "read_rtt_ms": 90},
                    "podvol": {"read_rtt_ms": 4, "read_queue_ms": 36}},
        },
    },
    "phases": [
        {"name": "p", "duration": "1m",
         "changes": [{"gpus": [0], "set": {"processes": [{"pid": 42}]}},
                     {"gpus": [1], "set": {"processes": [{"pid": 43}]}}]},
    ],
}  # fmt: skip


def _nfs_samples(ptrace: bool) -> tuple[dict[tuple[str, str], float], dict[str, tuple[str, ...]]]:
    node = SimNode(Scenario.model_validate(SCENARIO), virtual=True, ptrace=ptrace)
    source = ProcessesSource(ProcessesConfig(), node.context())
    try:
        for t in (10.0, 15.0):
            node.clock.advance(t - node.clock.elapsed())
            node.tick()
            samples = [s for s in source.collect() if s.name.startswith(NFS)]
        own = parse_mountstats((node.root / "proc" / "self" / "mountstats").read_bytes())
        assert "filer01:/podvol" not in {m.device for m in own}  # the pod's only
        rows = parse_mounts((node.root / "proc" / "42" / "mountinfo").read_bytes())
        if ptrace:  # the job's own file pairs with its mountinfo, in order
            job = parse_mountstats((node.root / "proc" / "42" / "mountstats").read_bytes())
            assert len(nfs_by_device(rows, job)) == 3
    finally:
        source.close()
        node.close()
    values = {(s.name.removeprefix(NFS), s.labels[0]): s.value for s in samples}
    mounts = {s.labels[0]: s.labels[2:] for s in samples if s.name.endswith("nfs_mount")}
    return values, mounts


def test_a_job_is_tied_to_the_nfs_mount_of_its_open_files() -> None:
    values, mounts = _nfs_samples(ptrace=True)
    assert mounts["0"] == ("10.0.0.5:/datasets", "/mnt/data", "open files")
    assert values[("read_rtt_seconds", "0")] == pytest.approx(0.048)
    assert values[("read_execute_seconds", "0")] == pytest.approx(0.04805)
    assert values[("reads_in_flight", "0")] == pytest.approx(40 * 0.04805)
    assert values[("read_bytes_per_second", "0")] == pytest.approx(20e6 + 40 * 136)
    # a pod's volume the daemon's namespace lacks: read from the job's own mountstats
    assert mounts["1"] == ("filer01:/podvol", "/mnt/podvol", "open files")
    # (whole READs and ms in the counters, as the kernel's: a few percent at 2 READs/s)
    assert values[("read_execute_seconds", "1")] == pytest.approx(0.04005, rel=0.1)
    assert values[("read_rtt_seconds", "1")] == pytest.approx(0.004, rel=0.1)


def test_unprivileged_the_busiest_nfs_mount_of_the_jobs_namespace() -> None:
    values, mounts = _nfs_samples(ptrace=False)
    # fd/ refused: of the namespace's mounts, /home keeps the most READs in flight
    assert mounts["0"] == ("10.0.0.6:/home", "/mnt/home", "mount namespace")
    assert values[("read_rtt_seconds", "0")] == pytest.approx(0.09, rel=1e-3)
    assert values[("reads_in_flight", "0")] == pytest.approx(300e6 / 1048576 * 0.09005, rel=1e-3)
    # the job's mountstats (0400) refused: the pod's volume has no statistics, /home is
    # the busiest the daemon sees in the job's namespace
    assert mounts["1"][2] == "mount namespace" and mounts["1"][0] != "filer01:/podvol"


def test_nfs_values_must_name_a_mount(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: x\nnode: {host: {disks: [{name: nvme0n1}]}, initial_host: {nfs: {data: {}}}}\n"
        "phases: [{name: p, duration: 1s}]\n"
    )
    with pytest.raises(ConfigError, match=r"node.initial_host.nfs.data: no such NFS mount"):
        load_scenario(path)
