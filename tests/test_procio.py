"""Per-job I/O attribution (gpuwatchd.sources.procio): real /proc/PID files, built trees, the
simulator's per-process I/O writer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatchd.config import ProcessesConfig
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.sim.writers.disks import DiskstatsWriter
from gpuwatchd.sim.writers.processes import ProcessesWriter, stat_line, worker_pid
from gpuwatchd.sim.writers.procio import ProcIoWriter, fdinfo_text, io_text
from gpuwatchd.sources.cpu import StatLines
from gpuwatchd.sources.processes import ProcessesSource
from gpuwatchd.sources.procio import (
    JobIo,
    cpu_shares,
    fdinfo_mount,
    is_file_target,
    parse_io,
    parse_mountinfo,
    read_bytes_of,
    stat_state,
)

FIXTURES = Path(__file__).parent / "fixtures"
GPU_PROCESS = "gpuwatchd_gpu_process_"
PROCIO = FIXTURES / "procio" / "procfs" / "26231"
STAT_26231 = FIXTURES / "procfs_pid" / "procfs" / "26231" / "stat"

# -- parsers on real files ---------------------------------------------------------------


def test_parse_io_on_the_real_file() -> None:
    values = parse_io((PROCIO / "io").read_bytes())
    assert values["read_bytes"] == 1024
    assert values["rchar"] == 750339 and values["syscr"] == 7405
    assert "cancelled_write_bytes" not in values  # printed signed (-1024): not a count
    assert read_bytes_of((PROCIO / "io").read_bytes()) == 1024
    assert read_bytes_of(b"read_bytes: 7\nwrite_bytes: 1\n") == 7


@pytest.mark.parametrize(
    "garbage", [b"", b"rchar: 1\n", b"read_bytes: x\n", b"read_bytes: -1\n", b"xread_bytes: 1\n"]
)
def test_read_bytes_of_garbage_is_an_error(garbage: bytes) -> None:
    with pytest.raises(ValueError):
        read_bytes_of(garbage)


@pytest.mark.parametrize("garbage", [b"", b"rchar: 1\n", b"read_bytes: x\n", b"\x00\xff"])
def test_parse_io_without_read_bytes_is_an_error(garbage: bytes) -> None:
    with pytest.raises(ValueError):
        parse_io(garbage)


def test_parse_mountinfo_on_the_real_file() -> None:
    mounts = parse_mountinfo((PROCIO / "mountinfo").read_bytes())
    assert mounts[21] == (8, 1)  # ext4 / on /dev/sda1
    assert mounts[194] == (0, 42)  # nfs4: an anonymous device, no disk
    assert mounts[1398] == (0, 44)
    assert mounts[1128] == (253, 0)  # xfs on LVM (dm-0)
    assert mounts[1] == (0, 5)  # rootfs; a double space in the line does not matter
    assert len(mounts) == 8


def test_fdinfo_mount_on_the_real_files() -> None:
    found = {n: fdinfo_mount((PROCIO / "fdinfo" / str(n)).read_bytes()) for n in (0, 1, 2, 3, 10)}
    assert found == {0: 13, 1: 13, 2: 9, 3: 9, 10: 9}
    assert fdinfo_mount(b"pos:\t0\nflags:\t02\n") is None  # before 3.15: no mnt_id
    assert fdinfo_mount(b"mnt_id:\tx\n") is None


def test_stat_state_on_the_real_file() -> None:
    # state, majflt, starttime, processor (fields 3, 12, 22, 39)
    assert stat_state(STAT_26231.read_bytes()) == ("R", 26, 82375, 0)
    line = stat_line(77, "pt_data_worker", "D", 7, 10, 2, 1, 500, 13, majflt=4321).encode()
    assert stat_state(line) == ("D", 4321, 500, 13)
    with pytest.raises(ValueError):
        stat_state(b"1 (x) S 1 2 3")


@pytest.mark.parametrize(
    ("target", "is_file"),
    [
        ("/data/imagenet/train/n01440764/x.JPEG", True),
        ("/mnt/nvme1n1/datasets/train/shard-00001.tar (deleted)", True),
        ("socket:[52311]", False),
        ("pipe:[41000]", False),
        ("anon_inode:[eventfd]", False),
        ("/dev/nvidia0", False),
        ("/dev/null", False),
        ("/memfd:cuda (deleted)", False),
        ("/proc/1234/stat", False),
        ("/", False),
    ],
)
def test_is_file_target(target: str, is_file: bool) -> None:
    assert is_file_target(target) is is_file


def test_cpu_shares_over_the_job_cpus() -> None:
    def stat(cpu2: str, cpu5: str) -> str:
        return f"cpu  0 0 0 0 0 0 0 0\ncpu2 {cpu2}\ncpu5 {cpu5}\n"

    before = StatLines(stat("100 0 0 100 0 0 0 0", "100 0 0 100 0 0 0 0"))
    # cpu2: 100 ticks, 10 iowait, 20 irq + 30 softirq; cpu5: 100 ticks, 30 iowait, none
    after = StatLines(stat("130 0 0 110 10 20 30 0", "160 0 0 110 30 0 0 0"))
    iowait, irq = cpu_shares(after, before, [2, 5])
    assert iowait == pytest.approx(40 / 200)
    assert irq == pytest.approx(0.5)
    assert cpu_shares(after, before, [7]) == (None, None)  # not a CPU of the node
    assert cpu_shares(after, None, [2]) == (None, None)  # first reading


# -- a built tree ----------------------------------------------------------------------------


def diskstats(nvme_busy_ms: int, sda_busy_ms: int) -> str:
    """nvme0n1 (259:0, partition 259:1) and sda (8:0, 8:1), 5.5+ lines."""

    def line(major: int, minor: int, name: str, busy: int, reads: int) -> str:
        fields = [reads, 0, reads * 8, reads, 0, 0, 0, 0, 0, busy, reads, 0, 0, 0, 0, 0, 0]
        return f"{major:4d} {minor:7d} {name} " + " ".join(map(str, fields)) + "\n"

    return (
        line(259, 0, "nvme0n1", nvme_busy_ms, nvme_busy_ms * 4)
        + line(259, 1, "nvme0n1p1", nvme_busy_ms, nvme_busy_ms * 4)
        + line(8, 0, "sda", sda_busy_ms, sda_busy_ms)
        + line(8, 1, "sda1", sda_busy_ms, sda_busy_ms)
    )


MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "23 22 259:1 / /data rw,relatime shared:2 - xfs /dev/nvme0n1p1 rw\n"
    "24 22 0:52 / /mnt/nfs rw,relatime shared:3 - nfs4 10.0.0.2:/ds rw,vers=4.1\n"
    "25 22 9:0 / /raid rw,relatime shared:4 - ext4 /dev/md0 rw\n"
)


def sysfs_tree(sys: Path) -> None:
    """Real-shape block devices: /sys/dev/block links into /sys/devices."""
    pci = sys / "devices" / "pci0000:00"
    disks = {
        "nvme0n1": (pci / "0000:00:1d.0" / "nvme" / "nvme0" / "nvme0n1", (259, 0), (259, 1)),
        "sda": (pci / "0000:00:17.0" / "ata1" / "host0" / "block" / "sda", (8, 0), (8, 1)),
        "sdb": (pci / "0000:00:17.0" / "ata2" / "host1" / "block" / "sdb", (8, 16), (8, 17)),
    }
    links = sys / "dev" / "block"
    links.mkdir(parents=True)
    for name, (path, (major, minor), (pmajor, pminor)) in disks.items():
        part = path / f"{name}{'p1' if name[-1].isdigit() else '1'}"
        part.mkdir(parents=True)
        (part / "partition").write_text("1\n")
        (links / f"{major}:{minor}").symlink_to(os.path.relpath(path, links))
        (links / f"{pmajor}:{pminor}").symlink_to(os.path.relpath(part, links))
    md = sys / "devices" / "virtual" / "block" / "md0"
    (md / "slaves").mkdir(parents=True)
    for slave in ("sda", "sdb"):
        target = disks[slave][0] / f"{slave}1"
        (md / "slaves" / f"{slave}1").symlink_to(os.path.relpath(target, md / "slaves"))
    (links / "9:0").symlink_to(os.path.relpath(md, links))


def process(
    proc: Path,
    pid: int,
    *,
    state: str = "S",
    cpu: int = 0,
    read_bytes: int = 0,
    files: tuple[tuple[str, int], ...] = (),
    start: int = 500,
) -> None:
    base = proc / str(pid)
    (base / "fd").mkdir(parents=True, exist_ok=True)
    (base / "fdinfo").mkdir(exist_ok=True)
    (base / "stat").write_text(stat_line(pid, "python", state, 1, 10, 1, 1, start, cpu))
    (base / "io").write_text(io_text(read_bytes, read_bytes + 4096, 12))
    (base / "mountinfo").write_text(MOUNTINFO)
    fds = [("socket:[1234]", 9), ("/dev/nvidia0", 27), *files]
    for n, (target, mount) in enumerate(fds):
        link = base / "fd" / str(n)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target)
        (base / "fdinfo" / str(n)).write_text(fdinfo_text(mount, 0, 1000 + n))


def cpu_stat(proc: Path, iowait: int, irq: int) -> None:
    """cpu0-3 at 100 ticks each; cpu2 with `iowait` and `irq` ticks of them."""
    lines = ["cpu  0 0 0 0 0 0 0 0\n"]
    for cpu in range(4):
        w, i = (iowait, irq) if cpu == 2 else (0, 0)
        lines.append(f"cpu{cpu} 0 0 0 {100 - w - i} {w} {i} 0 0 0 0\n")
    (proc / "stat").write_text("".join(lines))


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    sysfs_tree(sys)
    (proc / "diskstats").write_text(diskstats(0, 0))
    cpu_stat(proc, 0, 0)
    return proc, sys


def poll(io: JobIo, t: float, main: int, children: list[int], rescan: bool = False):  # noqa: ANN201
    io.begin(t)
    facts = io.read(main, children, rescan)
    io.end()
    return facts


def test_reads_are_attributed_to_the_disks_the_job_reads(tree: tuple[Path, Path]) -> None:
    """A backup saturating sda is not the job's: it reads /data on nvme0n1."""
    proc, sys = tree
    shard = (("/data/shards/000.tar", 23),)
    process(proc, 100, files=shard, cpu=2)
    process(proc, 101, files=shard, cpu=3)
    process(proc, 900, files=(("/backup/x", 22),))  # the backup: not the job's
    io = JobIo(os.fspath(proc), os.fspath(sys))
    first = poll(io, 0.0, 100, [101])
    assert first.read_bytes_per_second is None  # a baseline first
    assert first.disks == ("nvme0n1",)
    process(proc, 100, files=shard, cpu=2, read_bytes=50_000_000)
    process(proc, 101, files=shard, cpu=3, read_bytes=150_000_000)
    (proc / "diskstats").write_text(diskstats(nvme_busy_ms=1_000, sda_busy_ms=10_000))
    facts = poll(io, 10.0, 100, [101])
    assert facts.read_bytes_per_second == pytest.approx(20e6)
    assert facts.disks == ("nvme0n1",)
    assert facts.disk is not None
    assert facts.disk.utilization_ratio == pytest.approx(0.1)  # nvme0n1's, not sda's 100 %
    assert facts.cpus == frozenset({2, 3})


def test_disks_under_md_and_network_filesystems(tree: tuple[Path, Path]) -> None:
    proc, sys = tree
    process(proc, 100, files=(("/raid/a", 25), ("/mnt/nfs/b", 24), ("/data/c", 23)))
    process(proc, 200, files=(("/mnt/nfs/b", 24),))
    io = JobIo(os.fspath(proc), os.fspath(sys))
    assert poll(io, 0.0, 100, []).disks == ("nvme0n1", "sda", "sdb")  # md0 = sda1 + sdb1
    nfs = poll(io, 1.0, 200, [])
    assert nfs.disks == () and nfs.disk is None  # NFS: an anonymous device, no disk


def test_blocked_share_and_the_job_cpus_shares(tree: tuple[Path, Path]) -> None:
    proc, sys = tree
    process(proc, 100, state="D", cpu=2)
    for k, state in enumerate("DSS"):
        process(proc, 101 + k, state=state, cpu=k)
    io = JobIo(os.fspath(proc), os.fspath(sys))
    poll(io, 0.0, 100, [101, 102, 103])
    cpu_stat(proc, iowait=0, irq=0)
    text = (proc / "stat").read_text()
    # 100 more ticks on every CPU; on cpu2 30 iowait and 60 irq+softirq of them
    (proc / "stat").write_text(
        text.replace("cpu2 0 0 0 100 0 0 0", "cpu2 0 0 0 110 30 60 0")
        .replace("cpu0 0 0 0 100", "cpu0 0 0 0 200")
        .replace("cpu1 0 0 0 100", "cpu1 0 0 0 200")
        .replace("cpu3 0 0 0 100", "cpu3 0 0 0 200")
    )
    facts = poll(io, 5.0, 100, [101, 102, 103])
    assert facts.blocked_ratio == pytest.approx(0.5)  # 2 of 4 in D
    assert facts.cpus == frozenset({0, 1, 2})
    assert facts.interrupt_ratio == pytest.approx(0.6)  # cpu2's
    assert facts.iowait_ratio == pytest.approx(30 / 300)
    assert facts.disks == ()  # no files open


def test_fds_are_walked_only_when_new_or_at_a_scan(tree: tuple[Path, Path]) -> None:
    proc, sys = tree
    process(proc, 100, files=(("/data/a", 23),))
    io = JobIo(os.fspath(proc), os.fspath(sys))
    assert poll(io, 0.0, 100, []).disks == ("nvme0n1",)
    process(proc, 100, files=(("/data/a", 23), ("/x", 22)))
    assert poll(io, 1.0, 100, []).disks == ("nvme0n1",)
    assert poll(io, 2.0, 100, [], rescan=True).disks == ("nvme0n1", "sda")


def test_a_reused_pid_and_a_gone_process(tree: tuple[Path, Path]) -> None:
    proc, sys = tree
    process(proc, 100, read_bytes=10_000_000)
    io = JobIo(os.fspath(proc), os.fspath(sys))
    poll(io, 0.0, 100, [555])  # 555 does not exist: left out
    process(proc, 100, read_bytes=1_000, start=9_000)  # a new process with the same pid
    assert poll(io, 1.0, 100, []).read_bytes_per_second is None
    process(proc, 100, read_bytes=3_000, start=9_000)
    assert poll(io, 2.0, 100, []).read_bytes_per_second == pytest.approx(2_000)


def test_unreadable_io_leaves_the_rate_out(tree: tuple[Path, Path]) -> None:
    proc, sys = tree
    process(proc, 100)
    (proc / "100" / "io").unlink()
    (proc / "100" / "io").mkdir()  # not a regular file: refused without blocking
    complaints: list[str] = []
    io = JobIo(os.fspath(proc), os.fspath(sys), lambda kind, msg: complaints.append(kind))
    poll(io, 0.0, 100, [])
    facts = poll(io, 1.0, 100, [])
    assert facts.read_bytes_per_second is None and facts.blocked_ratio == 0.0
    assert complaints == ["io", "io"]


# -- the simulator's writer, read back --------------------------------------------------------

SCENARIO = {
    "name": "procio",
    "node": {
        "gpu_count": 2,
        "cpus": 16,
        "host": {
            "disks": [{"name": "nvme0n1"}, {"name": "nvme1n1"}],
            "processes": [{"pid": 42, "cpus_allowed": "4-7"}, {"pid": 43}],
        },
    },
    "phases": [
        {
            "name": "p",
            "duration": "10m",
            "host": {
                "disks": {"nvme1n1": {"read_iops": 1000, "util_percent": 90, "await_ms": 5}},
                "processes": {
                    42: {"workers": 3, "read_mb_s": 2, "worker_read_mb_s": 10,
                         "reads_from": "nvme1n1"},
                    43: {"read_mb_s": 5, "reads_from": "lustre"},
                },
            },
            "changes": [
                {"gpus": [0], "set": {"processes": [{"pid": 42}]}},
                {"gpus": [1], "set": {"processes": [{"pid": 43}]}},
            ],
        }
    ],
}  # fmt: skip


def test_the_simulated_job_reads_back(tmp_path: Path) -> None:
    timeline = Timeline(Scenario.model_validate(SCENARIO))
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    processes = ProcessesWriter(proc, sys, timeline)
    writers = [DiskstatsWriter(proc, timeline, sysfs=sys), processes]
    writers.append(ProcIoWriter(proc, timeline, processes))  # type: ignore[arg-type]
    io = JobIo(os.fspath(proc), os.fspath(sys))
    children = [worker_pid(42, k) for k in range(3)]
    for t in (10.0, 20.0):
        for writer in writers:
            writer.write(t)
        io.begin(t)
        job = io.read(42, children, False)
        other = io.read(43, [], False)
        io.end()
    assert job.read_bytes_per_second == pytest.approx(32e6)  # 2 + 3 x 10 MB/s
    assert job.disks == ("nvme1n1",)
    assert job.disk is not None and job.disk.utilization_ratio == pytest.approx(0.9)
    assert job.cpus == frozenset({4, 5, 6})  # main on its first allowed CPU, workers after
    assert other.read_bytes_per_second == pytest.approx(5e6)
    assert other.disks == ()  # an NFS mount: no disk of the node
    text = (proc / "42" / "io").read_text()
    assert [line.split(":")[0] for line in text.splitlines()] == [
        "rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes", "cancelled_write_bytes",
    ]  # fmt: skip
    assert parse_mountinfo((proc / "42" / "mountinfo").read_bytes())[24] == (259, 1)


def test_the_processes_source_exports_each_jobs_io() -> None:
    """Two jobs with files on one saturated disk: only the one that reads it reads."""
    node = SimNode(load_scenario("storage-two-jobs-one-disk"), virtual=True)
    source = ProcessesSource(ProcessesConfig(), node.context())
    try:
        for t in (300.0, 305.0):  # in the full-resolution epoch
            node.clock.advance(t - node.clock.elapsed())
            node.tick()
            samples = [s for s in source.collect() if s.name.startswith(GPU_PROCESS)]
            got = {(s.name.removeprefix("gpuwatchd_"), s.labels[0]): s.value for s in samples}
            busiest = {
                s.labels[0]: s.labels[2] for s in samples if s.name.endswith("disk_busiest")
            }
    finally:
        source.close()
        node.close()
    assert got[("gpu_process_read_bytes_per_second", "0")] == pytest.approx(2.4e9)  # 8 x 300 MB/s
    assert got[("gpu_process_read_bytes_per_second", "2")] == 0  # from page cache
    for gpu in ("0", "2"):
        assert got[("gpu_process_disks", gpu)] == 1  # nvme1n1, for both
        assert got[("gpu_process_disk_utilization_ratio", gpu)] == pytest.approx(1.0)
        assert got[("gpu_process_disk_await_seconds", gpu)] == pytest.approx(0.03)
        assert busiest[gpu] == "nvme1n1"  # named for the page (issue 39 item 4)
        assert got[("gpu_process_io_blocked_ratio", gpu)] == 0
    assert got[("gpu_process_cpu_iowait_ratio", "0")] == pytest.approx(0.05, abs=0.002)


def test_files_open_only_for_writing_are_not_where_the_input_is(tree: tuple[Path, Path]) -> None:
    proc, sys = tree
    process(proc, 100, files=(("/data/a", 23), ("/var/log/train.log", 22)))
    (proc / "100" / "fdinfo" / "3").write_text(fdinfo_text(22, 4096, 7, flags="0102001"))
    io = JobIo(os.fspath(proc), os.fspath(sys))
    assert poll(io, 0.0, 100, []).disks == ("nvme0n1",)  # not sda, where the log is
    (proc / "100" / "fdinfo" / "3").write_text(fdinfo_text(22, 4096, 7, flags="0100002"))
    assert poll(io, 1.0, 100, [], rescan=True).disks == ("nvme0n1", "sda")  # O_RDWR: read too
