"""The processes source: parsers on real /proc fixtures and garbage, and the source on
simulator-written trees (fake NVML, ProcessesWriter, SysfsWriter) in virtual time."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from series import Metrics as SampleIndex
from series import by_key

from gpuwatchd.config import NvmlConfig, ProcessesConfig
from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import ERROR_GPU_IS_LOST, ERROR_NOT_SUPPORTED, make_pynvml
from gpuwatchd.sim.host import HostHardware
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.sim.sysfs import SysfsWriter
from gpuwatchd.sim.writers.processes import (
    ProcessesWriter,
    container_cgroup,
    maps_line,
    maps_text,
    thread_id,
    worker_pid,
)
from gpuwatchd.sources import REGISTRY, SourceError, nvmlapi
from gpuwatchd.sources import processes as processes_module
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.processes import ProcessesSource
from gpuwatchd.sources.processes.desktop import (
    DESKTOP_PROCESSES,
    desktop_name,
    installed_desktop,
)
from gpuwatchd.sources.processes.jobs import ADOPTERS, ALONE, group_jobs, is_launcher
from gpuwatchd.sources.processes.procfs import (
    CgroupLine,
    _Gone,
    cpu_cgroup,
    cpus_allowed,
    in_container,
    parse_cfs_quota,
    parse_cgroup,
    parse_children,
    parse_cpu_max,
    parse_cpulist,
    parse_cudart,
    parse_flat_keyed,
    parse_stat,
    parse_status,
    status_value,
    thread_times,
)

FIXTURES = Path(__file__).parent / "fixtures" / "procfs_pid"
P = "gpuwatchd_"
STAT_FIXTURES = ("node_exporter/1", "node_exporter/10", "node_exporter/11", "procfs/26231")
STATUS_FIXTURES = ("procfs/26231", "procfs/26235")


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


# -- parsers on the real fixtures -----------------------------------------------------------


def test_parse_stat_real_fixtures() -> None:
    systemd = parse_stat(fixture("node_exporter/1/stat"))
    assert (systemd.pid, systemd.comm, systemd.state, systemd.ppid) == (1, "systemd", "S", 0)
    assert (systemd.utime, systemd.stime, systemd.threads, systemd.starttime) == (36, 98, 1, 29)
    assert systemd.ticks == 134
    # this capture's pid field says 17, and it has no trailing newline
    khungtaskd = parse_stat(fixture("node_exporter/10/stat"))
    assert (khungtaskd.pid, khungtaskd.comm, khungtaskd.ppid) == (17, "khungtaskd", 2)
    assert (khungtaskd.utime, khungtaskd.stime, khungtaskd.starttime) == (14, 0, 24)
    rcu = parse_stat(fixture("node_exporter/11/stat"))  # idle kernel thread, priority -2
    assert (rcu.comm, rcu.state, rcu.utime, rcu.stime, rcu.starttime) == (
        "rcu_preempt", "I", 0, 346, 32)  # fmt: skip
    vim = parse_stat(fixture("procfs/26231/stat"))
    assert (vim.pid, vim.comm, vim.state, vim.ppid) == (26231, "vim", "R", 5392)
    assert (vim.utime, vim.stime, vim.threads, vim.starttime) == (1677, 44, 1, 82375)


def test_parse_stat_comm_with_spaces_and_parentheses() -> None:
    tail = " ".join(["R", "1"] + ["0"] * 9 + ["500", "25"] + ["0"] * 4 + ["7", "0", "4242"])
    stat = parse_stat(f"4242 (my (odd) name) {tail}\n".encode())
    assert (stat.pid, stat.comm, stat.state, stat.ppid) == (4242, "my (odd) name", "R", 1)
    assert (stat.utime, stat.stime, stat.threads, stat.starttime) == (500, 25, 7, 4242)
    stat = parse_stat(f"7 () ) ) {tail}".encode())  # a comm of ") ) "
    assert stat.comm == ") ) " and stat.ticks == 525


@pytest.mark.parametrize(
    "data",
    [b"", b"4242", b"4242 (python", b"(python) R 1", b"x (python) R 1 " + b"0 " * 30,
     b"4242 (python) R 1 2 3", b"4242 (python) RR " + b"1 " * 30,
     b"4242 (python) R -1 " + b"1 " * 30, b"4242 (python) R 1 " + b"x " * 30],
)  # fmt: skip
def test_parse_stat_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_stat(data)


def test_thread_times_agrees_with_parse_stat() -> None:
    for name in STAT_FIXTURES:
        stat = parse_stat(fixture(f"{name}/stat"))
        assert thread_times(fixture(f"{name}/stat")) == (stat.ticks, stat.starttime)
    for bad in (b"", b"1 (x) R 1 2", b"1 (x) R " + b"y " * 30, b"no parenthesis " * 5):
        with pytest.raises(ValueError):
            thread_times(bad)


def test_status_value_finds_one_key() -> None:
    data = fixture("procfs/26231/status")
    assert status_value(data, b"Cpus_allowed_list") == "0-7"
    assert status_value(data, b"Cpus_allowed") == "ff"
    assert status_value(data, b"Name") == "prometheus"  # after the leading empty line
    assert status_value(b"Name:\tx\nThreads:\t3", b"Threads") == "3"  # no final newline
    assert status_value(b"Name:\tx\n", b"Name") == "x"
    assert status_value(data, b"Nope") is None
    assert status_value(fixture("procfs/26235/status"), b"Threads") == "51"


def test_parse_status_real_fixtures() -> None:
    prometheus = parse_status(fixture("procfs/26231/status"))  # starts with an empty line
    assert prometheus["Name"] == "prometheus"
    assert (prometheus["PPid"], prometheus["Threads"]) == ("1", "1")
    assert prometheus["Uid"] == "1000\t1000\t1000\t0"
    assert cpus_allowed(prometheus) == frozenset(range(8))
    kube_proxy = parse_status(fixture("procfs/26235/status"))  # spaces, not tabs
    assert (kube_proxy["Name"], kube_proxy["Threads"], kube_proxy["PPid"]) == (
        "kube-proxy", "51", "1234")  # fmt: skip
    assert kube_proxy["VmRSS"] == "42652 kB"
    assert cpus_allowed(kube_proxy) == frozenset(range(8))
    assert cpus_allowed({}) is None
    assert cpus_allowed({"Cpus_allowed_list": "zero"}) is None


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-7\n") == frozenset(range(8))
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset()
    for bad in ("0-", "a", "3-1", "0-70000", "1,,2", "0 - 3"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_parse_cgroup_v2_v1_and_hybrid() -> None:
    v2 = parse_cgroup(b"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab12.scope\n")
    assert cpu_cgroup(v2) == (
        2,
        "",
        "/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab12.scope",
    )
    assert in_container(v2)
    v1 = parse_cgroup(
        b"12:pids:/docker/4f1c\n11:cpu,cpuacct:/docker/4f1c\n10:memory:/docker/4f1c\n"
        b"1:name=systemd:/docker/4f1c\n0::/system.slice/containerd.service\n"
    )
    assert v1[1] == CgroupLine(11, ("cpu", "cpuacct"), "/docker/4f1c")
    assert cpu_cgroup(v1) == (1, "cpu,cpuacct", "/docker/4f1c")
    assert in_container(v1)
    host = parse_cgroup(b"0::/system.slice/train.service\n")
    assert not in_container(host)
    assert cpu_cgroup(host) == (2, "", "/system.slice/train.service")
    assert cpu_cgroup(parse_cgroup(b"1:name=systemd:/user.slice\n")) is None
    for runtime in ("docker-ab.scope", "libpod-ab.scope", "crio-ab.scope", "lxc.payload.c1"):
        assert in_container(parse_cgroup(f"0::/machine.slice/{runtime}\n".encode()))
    # a path climbing with ".." is skipped (never joined under the cgroup root)
    lines = parse_cgroup(b"0::/../../etc\n3:cpu:/ok\n")
    assert [line.path for line in lines] == ["/ok"]
    for bad in (b"", b"garbage\n", b"x::/a\n", b"0::relative\n", b"0::/../x\n"):
        with pytest.raises(ValueError):
            parse_cgroup(bad)


def test_parse_cgroup_cpu_files() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("400000 100000\n") == 4.0
    assert parse_cpu_max("50000 100000") == 0.5
    for bad in ("", "max", "max 0", "-1 100000", "4 cpus", "400000 100000 7"):
        with pytest.raises(ValueError):
            parse_cpu_max(bad)
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("150000\n", "100000\n") == 1.5
    for quota, period in (("x", "100000"), ("100", "0"), ("100", "")):
        with pytest.raises(ValueError):
            parse_cfs_quota(quota, period)
    text = "usage_usec 51000000\nnr_periods 100\nnr_throttled 60\nthrottled_usec 3000000\nbad\n"
    assert parse_flat_keyed(text) == {
        "usage_usec": 51000000, "nr_periods": 100, "nr_throttled": 60, "throttled_usec": 3000000,
    }  # fmt: skip


def test_non_ascii_digits_are_garbage() -> None:
    # str.isdigit() accepts "²", which int() refuses (found by the fuzz test)
    assert parse_flat_keyed("nr_periods ²\nnr_throttled 3") == {"nr_throttled": 3}
    for bad in ("² 100000", "100 ²"):
        with pytest.raises(ValueError):
            parse_cpu_max(bad)
    with pytest.raises(ValueError):
        parse_cfs_quota("²", "100000")
    with pytest.raises(ValueError):
        parse_cgroup("²::/x\n".encode())


def test_parse_cudart_from_maps() -> None:
    line = maps_line(0x7F3A4E229000, 0x7F3A4E28C000, "r-xp", 0x29000, 1234,
                     "/usr/local/cuda/lib64/libcudart.so.12.1.105")  # fmt: skip
    assert line.index("/usr") == 73  # the kernel pads the path to column 73
    assert parse_cudart(line.encode()) == "12.1"
    torch = b"7f..-7f.. r-xp 00000000 103:02 99  /opt/venv/torch/lib/libcudart-d0da41ae.so.11.0\n"
    assert parse_cudart(torch) == "11.0"
    wheel = b"7f..-7f.. r-xp 00000000 103:02 9 /x/nvidia/cuda_runtime/lib/libcudart.so.12\n"
    assert parse_cudart(wheel) == "12"
    assert parse_cudart(torch + line.encode() + wheel) == "12.1"  # the highest
    assert parse_cudart(maps_text(None).encode()) is None
    assert parse_cudart(maps_text("12.4").encode()) == "12.4"
    assert parse_cudart(maps_text("12").encode()) == "12"
    assert parse_cudart(b"/usr/lib/libcudart_static.a\n/usr/lib/libcudart.so\n") is None


def test_parse_children() -> None:
    assert parse_children(b"4242001 4242002 ") == [4242001, 4242002]
    assert parse_children(b"") == []
    with pytest.raises(ValueError):
        parse_children(b"12 x ")


def test_desktop_names_match_truncated_comm() -> None:
    assert desktop_name("Xorg\n") == "Xorg"
    assert desktop_name("gnome-shell") == "gnome-shell"
    assert desktop_name("tracker-miner-f") == "tracker-miner-fs"  # tracker-miner-fs-3, cut
    assert desktop_name("gdm-wayland-ses") == "gdm-wayland-session"
    assert desktop_name("python") is None and desktop_name("") is None
    assert len(set(DESKTOP_PROCESSES)) == len(DESKTOP_PROCESSES)


def test_a_launcher_is_told_by_its_command() -> None:
    """Without the ranks' environment (the daemon without CAP_SYS_PTRACE), only a parent
    that is a launcher by its command makes its children one job."""
    assert is_launcher("torchrun", ["/usr/bin/python3", "/usr/local/bin/torchrun"])
    assert is_launcher("python3", ["python3", "-m", "torch.distributed.run", "train.py"])
    assert is_launcher("slurmstepd", ["slurmstepd: [4471902.0]"])
    assert not is_launcher("jupyter-lab", ["/usr/bin/python3", "/usr/bin/jupyter-lab"])
    assert not is_launcher("bash", ["bash", "run.sh"])
    assert not is_launcher("python3", ["python3", "-m", "ipykernel_launcher", "-f", "k.json"])
    kernels = {4101: 4000, 4102: 4000}
    never = {0}.__contains__
    assert group_jobs(kernels, never, launches=never) == {4101: 4101, 4102: 4102}
    assert group_jobs(kernels, never, launches={4000}.__contains__) == dict.fromkeys(
        kernels, 4000
    )


def test_group_jobs_by_common_parent() -> None:
    def never(pid: int) -> bool:  # no parent is an adopter by name
        return False

    torchrun = {6001: 6000, 6002: 6000, 6003: 6000}
    assert group_jobs(torchrun, never) == dict.fromkeys(torchrun, 6000)
    # a process without a GPU-using sibling is its own job, whatever its parent
    assert group_jobs({6001: 6000, 7001: 7000}, never) == {6001: 6001, 7001: 7001}
    # init (1) and "outside the namespace" (0) never make a job; nor does an adopter
    assert group_jobs({11: 1, 12: 1, 21: 0, 22: 0}, never) == {11: 11, 12: 12, 21: 21, 22: 22}
    assert group_jobs({31: 30, 32: 30}, {30}.__contains__) == {31: 31, 32: 32}
    assert group_jobs({}, never) == {}
    # a launcher that drives a GPU itself: its own job is its children's
    assert group_jobs({6000: 1, 6001: 6000, 6002: 6000}, never) == dict.fromkeys(
        (6000, 6001, 6002), 6000
    )


def test_group_jobs_by_launch() -> None:
    """Environment read: a launcher's signature groups by launch, its absence separates."""
    never = {0}.__contains__
    slurm = ("slurm", "42", "0", "", "")
    launch = (*slurm, "slurm:42.0")
    # sibling notebooks: read, no signature -> a job each, though they share a parent
    kernels = {4101: 4000, 4102: 4000}
    assert group_jobs(kernels, never, dict.fromkeys(kernels, ALONE)) == {4101: 4101, 4102: 4102}
    # ranks of one launch behind per-rank wrappers (different parents): one job, the
    # lowest pid; with a common launcher parent: that parent
    wrapped = {3200: 3100, 3201: 3101, 3202: 3102}
    assert group_jobs(wrapped, never, dict.fromkeys(wrapped, launch)) == dict.fromkeys(
        wrapped, 3200
    )
    torchrun = {6001: 6000, 6002: 6000}
    assert group_jobs(torchrun, never, dict.fromkeys(torchrun, launch)) == dict.fromkeys(
        torchrun, 6000
    )
    # same launch name under two owners (two pods' localhost:29500): two jobs
    pod = ("kubernetes", "", "", "uid-a", "containerd://a")
    other = ("kubernetes", "", "", "uid-b", "containerd://b")
    keys = {1: (*pod, "localhost:29500"), 2: (*pod, "localhost:29500"),
            3: (*other, "localhost:29500"), 4: (*other, "localhost:29500")}  # fmt: skip
    jobs = group_jobs(dict.fromkeys(keys, 0), never, keys)
    assert jobs == {1: 1, 2: 1, 3: 3, 4: 3}
    # a signature naming no launch: its siblings with a signature
    bare = (*slurm, "")
    keys = {11: bare, 12: bare, 21: bare}
    assert group_jobs({11: 10, 12: 10, 21: 20}, never, keys) == {11: 10, 12: 10, 21: 21}
    # environment unknown for some: those keep the parent rule
    mixed = {4101: 4000, 4102: 4000, 4103: 4000}
    keys2: dict[int, tuple[str, ...] | None] = {4101: ALONE, 4102: None, 4103: None}
    assert group_jobs(mixed, never, keys2) == {4101: 4101, 4102: 4000, 4103: 4000}


@settings(max_examples=200, deadline=None)
@given(
    parents=st.dictionaries(st.integers(2, 60), st.integers(0, 12), max_size=20),
    adopters=st.sets(st.integers(2, 12), max_size=3),
)
def test_group_jobs_properties(parents: dict[int, int], adopters: set[int]) -> None:
    jobs = group_jobs(parents, adopters.__contains__)
    assert jobs.keys() == parents.keys()
    for pid, job in jobs.items():
        assert job in (pid, parents[pid])  # itself or its parent
        if job != pid:
            assert job > 1 and job not in adopters
            siblings = [p for p, pp in parents.items() if pp == job]
            assert len(siblings) >= 2 and all(jobs[p] == job for p in siblings)
    for a in parents:
        for b in parents:
            if a != b and jobs[a] == jobs[b]:
                # one job: siblings, the job being their parent, or a launcher that is
                # a GPU main process itself and its children
                job = jobs[a]
                assert parents[a] == parents[b] == job or job in (a, b)
                assert {parents[a], parents[b]} & {job}


# -- fuzz: truncated and garbled files --------------------------------------------------


def _mangle(data: bytes, cut: int, at: int, junk: bytes) -> bytes:
    cut = min(cut, len(data))
    at = min(at, cut)
    return data[:at] + junk + data[at:cut]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(STAT_FIXTURES),
    cut=st.integers(0, 400),
    at=st.integers(0, 400),
    junk=st.binary(max_size=12),
)
def test_fuzz_stat(name: str, cut: int, at: int, junk: bytes) -> None:
    data = _mangle(fixture(f"{name}/stat"), cut, at, junk)
    with contextlib.suppress(ValueError):
        ticks, start = thread_times(data)
        assert ticks >= 0 and start >= 0
    try:
        stat = parse_stat(data)
    except ValueError:
        return
    assert stat.pid >= 0 and stat.ticks >= 0 and stat.threads >= 0 and len(stat.state) == 1


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(STATUS_FIXTURES),
    cut=st.integers(0, 1200),
    at=st.integers(0, 1200),
    junk=st.binary(max_size=16),
)
def test_fuzz_status(name: str, cut: int, at: int, junk: bytes) -> None:
    data = _mangle(fixture(f"{name}/status"), cut, at, junk)
    status = parse_status(data)
    cpus = cpus_allowed(status)
    assert cpus is None or all(0 <= c < 1 << 16 for c in cpus)
    value = status_value(data, b"Cpus_allowed_list")
    assert value is None or "\n" not in value


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200) | st.text(max_size=80).map(str.encode))
def test_fuzz_byte_parsers(data: bytes) -> None:
    for parse in (parse_stat, parse_cgroup, parse_children):
        with contextlib.suppress(ValueError):
            parse(data)
    assert parse_cudart(data) is None or parse_cudart(data)[0].isdigit()  # type: ignore[index]
    text = data.decode("utf-8", "replace")
    for parse_text in (parse_cpulist, parse_cpu_max):
        with contextlib.suppress(ValueError):
            parse_text(text)
    with contextlib.suppress(ValueError):
        parse_cfs_quota(text, text[::-1])
    assert all(v >= 0 for v in parse_flat_keyed(text).values())
    assert desktop_name(text) in (None, *DESKTOP_PROCESSES)


@settings(max_examples=100, deadline=None)
@given(cpus=st.lists(st.integers(0, 511), max_size=40))
def test_cpulist_roundtrip(cpus: list[int]) -> None:
    from gpuwatchd.sim.sysfs import cpulist

    assert parse_cpulist(cpulist(sorted(set(cpus)))) == frozenset(cpus)


# -- the source on simulated nodes ------------------------------------------------------


def scenario(
    gpu_processes: list[dict[str, Any]] | dict[int, list[dict[str, Any]]],
    host: dict[int, dict[str, Any]] | None = None,
    facts: list[dict[str, Any]] | None = None,
    phases: list[dict[str, Any]] | None = None,
    **node: Any,
) -> Scenario:
    """One 10-minute phase; `gpu_processes` on every GPU, or per GPU index."""
    node = {"gpu_count": 8, "host": {"processes": facts or []}, **node}
    if isinstance(gpu_processes, dict):
        changes = [{"gpus": [i], "set": {"processes": procs}} for i, procs in gpu_processes.items()]
        first = {"name": "p", "duration": "10m", "changes": changes}
    else:
        first = {"name": "p", "duration": "10m", "set": {"processes": gpu_processes}}
    first["host"] = {"processes": host or {}}
    return Scenario.model_validate({"name": "t", "node": node, "phases": [first, *(phases or [])]})


class Metrics(SampleIndex):
    """Samples by name, then by labels."""

    def gpu(self, name: str, gpu: int, *extra: str) -> float | None:
        for labels, value in self.by_name.get(P + name, {}).items():
            if labels[0] == str(gpu) and labels[2:] == extra:
                return value
        return None

    def labels(self, name: str, gpu: int) -> list[tuple[str, ...]]:
        return [labels[2:] for labels in self.by_name.get(P + name, {}) if labels[0] == str(gpu)]

    def node(self, name: str, *labels: str) -> float | None:
        return self.by_name.get(P + name, {}).get(labels)

    def names_of(self, gpu: int) -> set[str]:
        return {n for n, labels, _ in self.samples if labels[:1] == (str(gpu),)}


class Node:
    """A simulated node in virtual time and a processes source reading it."""

    def __init__(self, scn: Scenario | str, root: Path, **config: Any) -> None:
        self.timeline = Timeline(load_scenario(scn) if isinstance(scn, str) else scn)
        self.clock = SimClock(virtual=True, start_wall=1_700_000_000.0)
        self.nv = make_pynvml(self.timeline, self.clock)
        self.fake = self.nv._gpuwatchd_fake
        self.proc, self.sys = root / "proc", root / "sys"
        self.sysfs = SysfsWriter(self.sys, self.timeline)
        self.writer = ProcessesWriter(self.proc, self.sys, self.timeline)
        self.context = Context(
            procfs=self.proc,
            sysfs=self.sys,
            pynvml=self.nv,
            extras={"clock": self.clock.elapsed, "now": self.clock.now},
        )
        self.source = ProcessesSource(ProcessesConfig(**config), self.context)

    def at(self, t: float) -> None:
        """Move the clock to t and write the trees."""
        self.clock.advance(t - self.clock.elapsed())
        self.sysfs.write(t)
        self.writer.write(t)

    def poll(self, t: float) -> Metrics:
        self.at(t)
        return Metrics(self.source.collect())


@pytest.fixture
def node_factory(tmp_path: Path):
    made: list[Node] = []

    def make(scn: Scenario | str, **config: Any) -> Node:
        node = Node(scn, tmp_path / f"n{len(made)}", **config)
        made.append(node)
        return node

    yield make
    for node in made:
        node.source.close()


def test_registered_with_bounded_labels() -> None:
    assert REGISTRY["processes"] is ProcessesSource
    specs = {spec.name: spec for spec in ProcessesSource.metrics}
    assert len(specs) == len(ProcessesSource.metrics)
    for spec in specs.values():
        assert spec.name.startswith(P)
        assert "pid" not in spec.labels and "cmdline" not in spec.labels
        if spec.name.startswith(P + "gpu_"):
            assert spec.labels[:2] == ("gpu", "uuid")
    assert specs[P + "gpu_process_info"].labels == ("gpu", "uuid", "name", "cudart")
    assert specs[P + "gpu_process_throttled_seconds_total"].type == "counter"
    assert ProcessesConfig().interval == 5.0
    with pytest.raises(ValueError):
        ProcessesConfig.model_validate({"scan_evrey": 3})


@pytest.mark.parametrize("scn", ["desktop-on-training-box", "ddp-independent-jobs"])
def test_the_nvml_sources_lists_are_used_instead_of_asking_nvml_again(node_factory, scn) -> None:
    """With the nvml source polling in the same context, this source asks NVML nothing:
    the same samples as when it lists the processes itself."""
    alone = node_factory(scn)
    shared = node_factory(scn)
    nvml = NvmlSource(NvmlConfig(), shared.context)
    for t in (60.0, 65.0, 70.0):
        shared.at(t)
        nvml.collect()  # the nvml thread polls first (it is due every second)
        assert by_key(shared.source.collect()) == by_key(alone.poll(t).samples)
    # NVML saw exactly what it sees when the nvml source runs alone
    nvml_only = node_factory(scn)
    other = NvmlSource(NvmlConfig(), nvml_only.context)
    for t in (60.0, 65.0, 70.0):
        nvml_only.at(t)
        other.collect()
    assert shared.fake.calls == nvml_only.fake.calls
    other.close()
    nvml.close()


def test_dataloader_single_process_scenario(node_factory) -> None:
    node = node_factory("dataloader-single-process")
    first = node.poll(60.0)  # a burst phase: main thread 100 %, 24 threads, quota 4
    assert first.gpu("gpu_process_cpu_cores", 0) is None  # rates need two polls
    assert first.gpu("gpu_process_threads", 0) == 24
    m = node.poll(65.0)
    for gpu in range(8):
        assert m.gpu("gpu_processes", gpu, "compute") == 1
        assert m.gpu("gpu_processes", gpu, "graphics") == 0
        assert m.gpu("gpu_other_processes", gpu) == 0
        assert m.gpu("gpu_desktop_processes", gpu) == 0
        assert m.gpu("gpu_process_pid", gpu) == 4242
        assert m.labels("gpu_process_info", gpu) == [("python", "12.1")]
        assert m.gpu("gpu_process_cpu_cores", gpu) == pytest.approx(2.8, abs=0.02)
        assert m.gpu("gpu_process_busiest_thread_cpu_ratio", gpu) == pytest.approx(1.0, abs=0.01)
        assert m.gpu("gpu_process_threads", gpu) == 24
        assert m.gpu("gpu_process_workers", gpu) == 0
        assert m.gpu("gpu_process_workers_cpu_cores", gpu) == 0
        assert m.gpu("gpu_process_cpu_quota_cpus", gpu) == 4
        assert m.gpu("gpu_process_throttled_ratio", gpu) == pytest.approx(0.6, abs=0.01)
        assert m.gpu("gpu_process_in_container", gpu) == 1
        assert m.gpu("gpu_process_cudart_version", gpu) == pytest.approx(12.1)
        assert m.gpu("gpu_process_cpus_allowed", gpu) == 128
        assert m.gpu("gpu_process_numa_aligned", gpu) == 0  # may run on both sockets
    # throttled_usec: 6 throttled periods/s x 50 ms, since the writer's first write (60 s)
    assert m.gpu("gpu_process_throttled_seconds_total", 0) == pytest.approx(5 * 6 * 0.05)
    assert m.node("desktop_processes") == 0 and m.node("desktop_cpu_cores") == 0
    assert node.source.polls == 2


def test_workers_and_their_cpu(node_factory) -> None:
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 30000}],
        host={4242: {"main_thread_cpu_percent": 35, "threads": 3, "other_threads_cpu_percent": 30,
                     "workers": 8, "worker_cpu_percent": 50}},
        phases=[{"name": "more workers", "duration": "10m",
                 "host": {"processes": {4242: {"workers": 12, "worker_cpu_percent": 80}}}}],
    )  # fmt: skip
    node = node_factory(scn)
    node.poll(100.0)
    m = node.poll(105.0)
    assert m.gpu("gpu_process_workers", 3) == 8
    assert m.gpu("gpu_process_workers_cpu_cores", 3) == pytest.approx(4.0, abs=0.02)
    assert m.gpu("gpu_process_cpu_cores", 3) == pytest.approx(0.65, abs=0.02)  # no children
    assert m.gpu("gpu_process_busiest_thread_cpu_ratio", 3) == pytest.approx(0.35, abs=0.01)
    assert m.gpu("gpu_process_cpu_quota_cpus", 3) is None  # no limit: absent
    assert m.gpu("gpu_process_throttled_ratio", 3) == 0
    assert m.gpu("gpu_process_in_container", 3) == 0
    assert m.labels("gpu_process_info", 3) == [("python", "")]  # no cudart mapped
    # 0: maps read, no runtime mapped (absent only where the maps are unreadable)
    assert m.gpu("gpu_process_cudart_version", 3) == 0
    # four more workers fork at 600 s (the simulator's counters move at the rate of its
    # previous write, so they start at 603); the poll after sees all their CPU time
    node.poll(598.0)
    node.at(603.0)
    m = node.poll(608.0)
    assert m.gpu("gpu_process_workers", 3) == 12
    expected = (8 * (5 * 0.5 + 5 * 0.8) + 4 * 5 * 0.8) / 10
    assert m.gpu("gpu_process_workers_cpu_cores", 3) == pytest.approx(expected, abs=0.01)
    stat = (node.proc / str(worker_pid(4242, 0)) / "stat").read_bytes()
    assert parse_stat(stat).comm == "pt_data_worker" and parse_stat(stat).ppid == 4242


def test_numa_alignment_per_gpu(node_factory) -> None:
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 1000}],
        facts=[{"pid": 4242, "cpus_allowed": "0-31"}],
    )
    m = node_factory(scn).poll(10.0)
    assert m.gpu("gpu_process_cpus_allowed", 0) == 32
    assert [m.gpu("gpu_process_numa_aligned", g) for g in range(8)] == [1] * 4 + [0] * 4


def test_main_process_and_other_tenants(node_factory) -> None:
    scn = scenario(
        {
            0: [{"pid": 300, "gpu_memory_mib": 500}, {"pid": 200, "gpu_memory_mib": 9000},
                {"pid": 100, "gpu_memory_mib": 500}],
            1: [{"pid": 100, "gpu_memory_mib": 500}, {"pid": 300, "gpu_memory_mib": 500}],
            2: [{"pid": 1789, "name": "Xorg", "gpu_memory_mib": 90000, "kind": "graphics"}],
            3: [{"pid": 1789, "name": "Xorg", "gpu_memory_mib": 400, "kind": "graphics"},
                {"pid": 700, "name": "glxgears", "gpu_memory_mib": 50, "kind": "graphics"}],
        },
        facts=[{"pid": 1789, "name": "Xorg", "uid": 0}],  # root's (issue 41: its signature)
    )  # fmt: skip
    m = node_factory(scn).poll(10.0)
    assert m.gpu("gpu_process_pid", 0) == 200  # the most memory
    assert m.gpu("gpu_other_processes", 0) == 2
    assert m.gpu("gpu_process_pid", 1) == 100  # a tie: the lowest pid
    assert m.gpu("gpu_other_processes", 1) == 1
    assert m.gpu("gpu_process_pid", 2) is None  # a desktop process is never the main one
    assert m.gpu("gpu_desktop_processes", 2) == 1 and m.gpu("gpu_other_processes", 2) == 0
    assert m.gpu("gpu_processes", 2, "graphics") == 1 and m.gpu("gpu_processes", 2, "compute") == 0
    assert m.gpu("gpu_process_pid", 3) == 700  # a non-desktop graphics process can be
    assert m.gpu("gpu_desktop_processes", 3) == 1 and m.gpu("gpu_other_processes", 3) == 0
    assert m.names_of(4) == {P + "gpu_processes", P + "gpu_desktop_processes",
                             P + "gpu_other_processes"}  # fmt: skip
    assert m.gpu("gpu_processes", 4, "compute") == 0


SESSION = "/user.slice/user-1000.slice/session-2.scope"  # a console login's


def test_a_name_alone_does_not_make_a_desktop_process(node_factory) -> None:
    """Issue 23 (8d): `Xorg` is a comm any process can take (prctl PR_SET_NAME). A
    desktop process needs evidence beyond it: a graphics context on an NVML list, or a
    cmdline naming a display server where the system installs programs."""
    python = ["/usr/bin/python3", "train.py"]
    scn = scenario(
        {
            0: [{"pid": 4242, "name": "Xorg", "gpu_memory_mib": 9000}],  # compute only
            1: [{"pid": 1789, "name": "Xorg", "gpu_memory_mib": 400, "kind": "graphics"},
                {"pid": 4343, "name": "python", "gpu_memory_mib": 9000}],
        },
        host={pid: {"main_thread_cpu_percent": cpu, "other_threads_cpu_percent": 0}
              for pid, cpu in ((4242, 100), (5150, 100), (5151, 10), (1789, 10))},
        facts=[
            {"pid": 4242, "name": "Xorg", "cmdline": python},
            {"pid": 1789, "name": "Xorg", "cmdline": ["/usr/lib/xorg/Xorg", "vt2"],
             "cgroup": SESSION, "tty": "tty2"},  # on vt2: its signature (issue 41)
            {"pid": 5150, "name": "gnome-shell", "cmdline": ["gnome-shell"]},  # setproctitle
            {"pid": 5151, "name": "tracker-miner-fs-3",  # /usr/bin/tracker-miner-fs-3
             "cgroup": "/user.slice/user-1000.slice/user@1000.service/tracker.service"},
        ],
    )  # fmt: skip
    node = node_factory(scn)
    node.poll(10.0)
    assert (node.proc / "4242" / "cmdline").read_bytes() == b"/usr/bin/python3\0train.py\0"
    m = node.poll(15.0)
    assert m.gpu("gpu_process_pid", 0) == 4242  # the training process is the main one
    assert m.gpu("gpu_desktop_processes", 0) == 0 and m.gpu("gpu_other_processes", 0) == 0
    assert m.gpu("gpu_process_pid", 1) == 4343  # a real Xorg (graphics) still is desktop
    assert m.gpu("gpu_desktop_processes", 1) == 1
    # node-wide: the real Xorg and tracker-miner-fs-3 (found by the scan), not the
    # renamed python at a full core nor the process only calling itself gnome-shell
    assert m.node("desktop_processes") == 2
    assert m.node("desktop_process_cpu_cores", "Xorg") == pytest.approx(0.1, abs=0.02)
    assert m.node("desktop_process_cpu_cores", "gnome-shell") is None
    assert m.node("desktop_cpu_cores") == pytest.approx(0.2, abs=0.03)


def test_installed_desktop_reads_argv0_as_proc_shows_it() -> None:
    assert installed_desktop(b"/usr/lib/xorg/Xorg\0vt2\0-displayfd\0003\0")
    assert installed_desktop(b"/usr/libexec/tracker-miner-fs-3\0")
    assert installed_desktop(b"/nix/store/abc-xorg-server-21/bin/Xorg\0")
    assert not installed_desktop(b"Xorg\0")  # not a path: anything can say this
    assert not installed_desktop(b"/home/u/bin/Xorg\0")  # not where programs are installed
    assert not installed_desktop(b"/usr/bin/../../home/u/Xorg\0")
    assert not installed_desktop(b"/usr/bin/python3\0Xorg\0")
    assert not installed_desktop(b"")


def torchrun_env(rank: int, ranks: int) -> dict[str, str]:
    """The variables torchrun sets in a rank (a launcher's signature)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


def ddp(parent: dict[str, Any] | None, ranks: int = 4, gpus: int = 6, **extra: Any) -> Scenario:
    """`ranks` processes 6001… on GPUs 0…, children of `parent` (pid 6000) with
    torchrun's variables, and an unrelated single-GPU job (pid 9001) on the last GPU."""
    facts = [{"pid": 6000 + 1 + r, "ppid": 6000, "environment": torchrun_env(r, ranks)}
             for r in range(ranks)]  # fmt: skip
    if parent is not None:
        facts.insert(0, {"pid": 6000, **parent})
    per_gpu = {r: [{"pid": 6000 + 1 + r, "gpu_memory_mib": 70000}] for r in range(ranks)}
    per_gpu[gpus - 1] = [{"pid": 9001, "gpu_memory_mib": 1000}]
    return scenario(per_gpu, facts=facts, gpu_count=gpus, **extra)


def test_job_of_ddp_ranks_is_their_launcher(node_factory) -> None:
    node = node_factory(ddp({"name": "torchrun"}))
    m = node.poll(10.0)
    assert [m.gpu("gpu_process_pid", g) for g in range(4)] == [6001, 6002, 6003, 6004]
    assert [m.gpu("gpu_process_job", g) for g in range(4)] == [6000] * 4
    assert m.gpu("gpu_process_job", 4) is None  # no process: no job
    assert m.gpu("gpu_process_job", 5) == 9001  # alone: its own job
    # a launcher's variables: a rank of a launch; a readable environment without: not
    assert [m.gpu("gpu_process_launched", g) for g in range(4)] == [1] * 4
    assert m.gpu("gpu_process_launched", 5) == 0
    # the launcher has no GPU: it is read only for its name
    assert m.gpu("gpu_process_workers", 0) == 0
    assert (node.proc / "6000" / "task" / "6000" / "children").read_text() == (
        "6001 6002 6003 6004 "
    )


def test_process_on_several_gpus_and_its_sibling_are_one_job(node_factory) -> None:
    per_gpu = {0: [{"pid": 6001, "gpu_memory_mib": 100}], 1: [{"pid": 6001, "gpu_memory_mib": 100}],
               2: [{"pid": 6002, "gpu_memory_mib": 100}], 3: [{"pid": 7001, "gpu_memory_mib": 100}],
               4: [{"pid": 7001, "gpu_memory_mib": 100}]}  # fmt: skip
    mpi = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2"} for r in range(2)]
    facts = [{"pid": 6000, "name": "mpirun"}, {"pid": 6001, "ppid": 6000, "environment": mpi[0]},
             {"pid": 6002, "ppid": 6000, "environment": mpi[1]}, {"pid": 7001}]  # fmt: skip
    m = node_factory(scenario(per_gpu, facts=facts, gpu_count=5)).poll(10.0)
    assert [m.gpu("gpu_process_job", g) for g in range(5)] == [6000, 6000, 6000, 7001, 7001]


def test_jobs_are_not_made_by_adopters_or_a_lone_child(node_factory) -> None:
    # environment unknown: ranks adopted by a user manager (systemd --user, a subreaper)
    # are no job
    m = node_factory(ddp({"name": "systemd"}), owner_environ=False).poll(10.0)
    assert [m.gpu("gpu_process_job", g) for g in range(4)] == [6001, 6002, 6003, 6004]
    assert m.gpu("gpu_process_launched", 0) is None  # not read: not known
    # their launcher's variables still make them one job, named by the lowest rank's pid
    m = node_factory(ddp({"name": "systemd"})).poll(10.0)
    assert [m.gpu("gpu_process_job", g) for g in range(4)] == [6001] * 4
    assert "systemd" in ADOPTERS and "init" in ADOPTERS
    # one rank only: a child with no GPU-using sibling is its own job
    m = node_factory(ddp({"name": "torchrun"}, ranks=1)).poll(10.0)
    assert m.gpu("gpu_process_job", 0) == 6001
    assert m.gpu("gpu_process_launched", 0) == 1  # ... but still a rank of a launch
    # independent jobs from shells of one tmux server: different parents, different jobs
    facts = [{"pid": 3000, "name": "tmux"}]
    facts += [{"pid": 3001 + g, "name": "bash", "ppid": 3000} for g in range(3)]
    facts += [{"pid": 3101 + g, "ppid": 3001 + g} for g in range(3)]
    per_gpu = {g: [{"pid": 3101 + g, "gpu_memory_mib": 100}] for g in range(3)}
    m = node_factory(scenario(per_gpu, facts=facts, gpu_count=3)).poll(10.0)
    assert [m.gpu("gpu_process_job", g) for g in range(3)] == [3101, 3102, 3103]


def test_an_unreadable_environment_falls_back_to_the_parent(node_factory) -> None:
    """Another user's ranks, seen by an unprivileged daemon: /proc/PID/environ refuses
    reading (EACCES, even to the simulated daemon's root), so their launch is unknown
    and their common parent makes them one job; a readable script keeps its own."""
    facts = [{"pid": 6000, "name": "torchrun", "uid": 2001}, {"pid": 7001}]
    facts += [{"pid": 6001 + r, "ppid": 6000, "uid": 2001, "environment": torchrun_env(r, 2),
               "environ_readable": False} for r in range(2)]  # fmt: skip
    per_gpu = {g: [{"pid": pid, "gpu_memory_mib": 100}] for g, pid in enumerate((6001, 6002, 7001))}
    node = node_factory(scenario(per_gpu, facts=facts, gpu_count=4))
    m = node.poll(10.0)
    with pytest.raises(PermissionError):
        (node.proc / "6001" / "environ").read_bytes()
    assert [m.gpu("gpu_process_launched", g) for g in range(3)] == [None, None, 0]
    assert [m.gpu("gpu_process_job", g) for g in range(3)] == [6000, 6000, 7001]


def test_ranks_reparented_when_their_launcher_exits(node_factory) -> None:
    gone = [{"name": "crashed", "duration": "10m",
             "host": {"processes": {6000: {"running": False}}}}]  # fmt: skip
    node = node_factory(ddp({"name": "torchrun"}, ranks=2, phases=gone))
    unknown = node_factory(ddp({"name": "torchrun"}, ranks=2, phases=gone), owner_environ=False)
    assert node.poll(590.0).gpu("gpu_process_job", 0) == 6000
    assert unknown.poll(590.0).gpu("gpu_process_job", 0) == 6000
    m = node.poll(605.0)
    assert not (node.proc / "6000").exists()
    assert parse_stat((node.proc / "6001" / "stat").read_bytes()).ppid == 1
    assert parse_status((node.proc / "6001" / "status").read_bytes())["PPid"] == "1"
    # still one launch (their variables): named by the lowest rank's pid
    assert [m.gpu("gpu_process_job", g) for g in range(2)] == [6001, 6001]
    # environment unknown: siblings of init are no job
    m = unknown.poll(605.0)
    assert [m.gpu("gpu_process_job", g) for g in range(2)] == [6001, 6002]


def test_straggler_ddp_scenario_tree(node_factory) -> None:
    node = node_factory("straggler-ddp")
    m = node.poll(10.0)
    assert [m.gpu("gpu_process_pid", g) for g in range(8)] == list(range(6001, 6009))
    assert [m.gpu("gpu_process_job", g) for g in range(8)] == [6000] * 8
    assert (node.proc / "6000" / "comm").read_text() == "torchrun\n"
    m = node_factory("ddp-independent-jobs").poll(10.0)
    assert [m.gpu("gpu_process_job", g) for g in range(8)] == list(range(3101, 3109))


def test_process_tree_is_validated() -> None:
    HostHardware.model_validate({"processes": [{"pid": 5, "ppid": 0}, {"pid": 6, "ppid": 5}]})
    bad = (
        ([{"pid": 5, "ppid": 7}], "processes.0.ppid: 7 is not a process"),
        ([{"pid": 5, "ppid": 6}, {"pid": 6, "ppid": 5}], "its own ancestor"),
        ([{"pid": 5, "ppid": 5}], "its own ancestor"),
        ([{"pid": 5}, {"pid": 5}], "pid 5 is listed twice"),
        ([{"pid": 5, "ppid": -1}], "greater than or equal to 0"),
    )
    for processes, message in bad:
        with pytest.raises(ValueError, match=message):
            HostHardware.model_validate({"processes": processes})


def test_desktop_on_training_box_scenario(node_factory) -> None:
    node = node_factory("desktop-on-training-box")
    node.poll(60.0)
    m = node.poll(65.0)
    assert m.gpu("gpu_processes", 0, "graphics") == 2 and m.gpu("gpu_processes", 0, "compute") == 1
    assert m.gpu("gpu_desktop_processes", 0) == 2
    assert m.gpu("gpu_other_processes", 0) == 0
    assert m.gpu("gpu_process_pid", 0) == 4242
    assert m.labels("gpu_process_info", 0) == [("python", "12")]
    assert m.gpu("gpu_process_workers", 0) == 4
    assert m.gpu("gpu_process_workers_cpu_cores", 0) == pytest.approx(2.8, abs=0.03)
    assert m.gpu("gpu_process_numa_aligned", 0) == 1  # one NUMA node
    # gdm3, Xorg, gnome-shell (on the GPU) and tracker-miner-fs-3 (found by the scan)
    assert m.node("desktop_processes") == 4
    by_name = {"gdm3": 0.005, "Xorg": 0.55, "gnome-shell": 0.95, "tracker-miner-fs": 1.25}
    for name, ratio in by_name.items():
        assert m.node("desktop_process_cpu_cores", name) == pytest.approx(ratio, abs=0.02), name
    assert m.node("desktop_cpu_cores") == pytest.approx(sum(by_name.values()), abs=0.05)
    # gdm3 stopped at 600 s: the desktop is gone from the GPU and from the node
    node.poll(605.0)
    m = node.poll(610.0)
    assert m.gpu("gpu_processes", 0, "graphics") == 0 and m.gpu("gpu_desktop_processes", 0) == 0
    assert m.node("desktop_processes") == 0 and m.node("desktop_cpu_cores") == 0
    assert m.by_name.get(P + "desktop_process_cpu_cores") is None


def test_desktop_scan_runs_every_n_polls(node_factory) -> None:
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 1000}],
        facts=[{"pid": 2650, "name": "tracker-miner-fs-3", "tty": "tty1"}],  # from the console
        host={2650: {"running": False}},
        phases=[{"name": "indexing", "duration": "10m",
                 "host": {"processes": {2650: {"running": True, "main_thread_cpu_percent": 90,
                                               "threads": 1}}}}],
    )  # fmt: skip
    node = node_factory(scn, scan_every=3)
    polls = [node.poll(t) for t in (590.0, 595.0, 600.0, 605.0, 610.0, 615.0)]
    assert node.source.scans == 2  # polls 1 and 4
    # started at 600 s (poll 3), seen by the scan of poll 4, rated from poll 5
    assert [p.node("desktop_processes") for p in polls] == [0, 0, 0, 1, 1, 1]
    assert [p.node("desktop_cpu_cores") for p in polls[:3]] == [0, 0, 0]
    assert polls[3].node("desktop_cpu_cores") is None  # found, not yet rated
    assert polls[4].node("desktop_cpu_cores") == pytest.approx(0.9, abs=0.01)
    # without desktop, only desktop processes on a GPU are counted (the scan still runs:
    # it finds the fabric manager)
    quiet = node_factory(scn, desktop=False)
    assert [quiet.poll(t).node("desktop_processes") for t in (600.0, 605.0)] == [0, 0]
    assert quiet.source.scans == 1


def test_the_fabric_manager_is_found_by_the_scan_and_followed(node_factory) -> None:
    """nv-fabricmanager (comm cut to 15 bytes) found by the scan, desktop or not; its exit
    seen on the next poll, a new one at the next scan; another name is not it."""
    manager = {"pid": 2301, "name": "nv-fabricmanager", "uid": 0,
               "cgroup": "/system.slice/nvidia-fabricmanager.service"}  # fmt: skip
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 1000}],
        facts=[manager, {"pid": 2302, "name": "nv-fabricmanag", "uid": 1000}],
        phases=[
            {"name": "stop", "duration": "1m", "host": {"processes": {2301: {"running": False}}}},
            {"name": "again", "duration": "5m", "host": {"processes": {2301: {"running": True}}}},
        ],
    )
    node = node_factory(scn, scan_every=3, desktop=False)
    counts = [node.poll(t).node("fabric_manager_processes") for t in range(590, 660, 5)]
    # 600 s: stopped, seen at once; 660 s: started again, seen by the scan of poll 13 (650 s)
    assert counts == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert node.poll(660.0).node("fabric_manager_processes") == 0  # poll 15: no scan
    assert node.poll(665.0).node("fabric_manager_processes") == 1  # poll 16's scan


def test_process_vanishing_between_listing_and_read(node_factory) -> None:
    scn = scenario({0: [{"pid": 4242, "gpu_memory_mib": 100}],
                    1: [{"pid": 5151, "gpu_memory_mib": 100}]})  # fmt: skip
    node = node_factory(scn)
    node.poll(10.0)
    node.at(15.0)
    shutil.rmtree(node.proc / "4242")  # exited after NVML listed it
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_processes", 0, "compute") == 1  # NVML still lists it
    assert m.labels("gpu_process_info", 0) == [] and m.gpu("gpu_process_pid", 0) is None
    assert m.gpu("gpu_process_cpu_cores", 1) is not None  # the other GPU is unaffected
    # it exits half-way: stat read, then status gone
    node.writer = ProcessesWriter(node.proc, node.sys, node.timeline)  # writes everything anew
    node.at(20.0)
    (node.proc / "4242" / "status").unlink()
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_pid", 0) is None and m.gpu("gpu_process_threads", 0) is None
    assert m.gpu("gpu_process_pid", 1) == 5151


def test_process_lookup_error_mid_read(node_factory, monkeypatch) -> None:
    node = node_factory(scenario({0: [{"pid": 4242, "gpu_memory_mib": 100}]}))
    node.poll(10.0)
    real_read = processes_module._read

    def read(path: str, limit: int = 1 << 20) -> bytes:
        if path.endswith("/4242/cgroup"):
            raise ProcessLookupError(3, "No such process")
        return real_read(path, limit)

    monkeypatch.setattr(processes_module, "_read", read)
    node.at(15.0)
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_pid", 0) is None and m.gpu("gpu_processes", 0, "compute") == 1


def test_garbled_files_drop_only_what_they_feed(node_factory, caplog) -> None:
    scn = scenario(
        {0: [{"pid": 4242, "gpu_memory_mib": 100}], 1: [{"pid": 5151, "gpu_memory_mib": 100}],
         2: [{"pid": 6161, "gpu_memory_mib": 100}]},
        facts=[{"pid": 5151, "cudart": "12.4", "container": True},
               {"pid": 6161, "cpus_allowed": "0-7"}],
        host={5151: {"cpu_quota_cpus": 2}},
    )  # fmt: skip
    node = node_factory(scn)
    node.poll(10.0)
    node.at(15.0)
    (node.proc / "4242" / "stat").write_bytes(b"4242 (python) R garbage\n")
    (node.proc / "5151" / "cgroup").write_bytes(b"\x00\xff nonsense\n")
    (node.proc / "6161" / "status").write_bytes(b"Name:\tpython\nCpus_allowed_list:\t0-x\n")
    with caplog.at_level(logging.DEBUG, logger="gpuwatchd.sources.processes"):
        m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_pid", 0) is None  # no stat: nothing about that process
    assert m.gpu("gpu_process_pid", 1) == 5151  # no cgroup: no container, quota, throttling
    assert m.gpu("gpu_process_in_container", 1) is None
    assert m.gpu("gpu_process_cpu_quota_cpus", 1) is None
    assert m.gpu("gpu_process_cudart_version", 1) == pytest.approx(12.4)
    assert m.gpu("gpu_process_cpu_cores", 1) is not None
    assert m.gpu("gpu_process_cpus_allowed", 2) is None  # no valid affinity
    assert m.gpu("gpu_process_numa_aligned", 2) is None
    assert m.gpu("gpu_process_in_container", 2) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert {w.getMessage().split(":")[1].strip().split("/")[-1] for w in warnings} >= {
        "stat", "cgroup", "status"}  # fmt: skip
    # the next poll logs the same problems at DEBUG only
    caplog.clear()
    (node.proc / "4242" / "stat").write_bytes(b"4242 (python) R garbage\n")
    with caplog.at_level(logging.DEBUG, logger="gpuwatchd.sources.processes"):
        node.source.collect()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@settings(max_examples=40, deadline=None)
@given(
    garbage=st.dictionaries(
        st.sampled_from(["stat", "status", "cgroup", "maps", "comm", "task/4242/stat",
                         "task/4242/children", "CG/cpu.max", "CG/cpu.stat"]),
        st.binary(max_size=120),
        min_size=1,
    )
)  # fmt: skip
def test_collect_on_random_garbage_never_raises(
    tmp_path_factory: pytest.TempPathFactory, garbage: dict[str, bytes]
) -> None:
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 100}],
        host={4242: {"workers": 2, "cpu_quota_cpus": 3, "throttled_ratio": 0.5}},
        gpu_count=2,
    )
    node = Node(scn, tmp_path_factory.mktemp("n"))
    node.poll(10.0)
    node.at(15.0)
    cgroup = node.sys / "fs" / "cgroup" / "system.slice" / "train.service"
    for name, content in garbage.items():
        path = cgroup / name[3:] if name.startswith("CG/") else node.proc / "4242" / name
        path.write_bytes(content)
    samples = node.source.collect()
    assert all(isinstance(s.value, float) and s.value >= 0 for s in samples)
    node.source.close()


def test_a_thread_unreadable_once_is_not_taken_for_a_new_one(node_factory) -> None:
    scn = scenario([{"pid": 4242, "gpu_memory_mib": 100}], gpu_count=1,
                   host={4242: {"threads": 2, "main_thread_cpu_percent": 10,
                                "other_threads_cpu_percent": 60}})  # fmt: skip
    node = node_factory(scn)
    node.poll(1000.0)
    node.at(1005.0)
    hot = node.proc / "4242" / "task" / str(thread_id(4242, 1)) / "stat"
    hot.write_bytes(b"torn")
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_busiest_thread_cpu_ratio", 0) == pytest.approx(0.1, abs=0.01)
    m = node.poll(1010.0)  # readable again: a new base, not 1010 s of CPU at once
    assert m.gpu("gpu_process_busiest_thread_cpu_ratio", 0) == pytest.approx(0.1, abs=0.01)
    m = node.poll(1015.0)
    assert m.gpu("gpu_process_busiest_thread_cpu_ratio", 0) == pytest.approx(0.6, abs=0.01)


def test_on_this_machines_real_proc(tmp_path: Path) -> None:
    """The real kernel's formats: this test process, listed by the fake NVML, read from
    /proc and /sys (values vary; what is checked is that each fact is found)."""
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        pytest.skip("no Linux procfs")
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = os.getpid()
        timeline = Timeline(scenario([{"pid": me, "gpu_memory_mib": 100}], gpu_count=1))
        clock = SimClock(virtual=True)
        nv = make_pynvml(timeline, clock)
        context = Context(pynvml=nv, extras={"clock": clock.elapsed})  # /proc and /sys
        source = ProcessesSource(ProcessesConfig(), context)
        source.collect()
        clock.advance(1.0)
        m = Metrics(source.collect())
        source.close()
    finally:
        child.kill()
        child.wait()
    assert m.gpu("gpu_process_pid", 0) == me
    comm = Path(f"/proc/{me}/comm").read_text().strip()
    assert [labels[0] for labels in m.labels("gpu_process_info", 0)] == [comm]
    assert m.gpu("gpu_process_threads", 0) >= 1
    assert m.gpu("gpu_process_workers", 0) >= 1  # the sleeping child
    assert m.gpu("gpu_process_cpus_allowed", 0) >= 1
    assert m.gpu("gpu_process_cpu_cores", 0) >= 0
    assert m.gpu("gpu_process_busiest_thread_cpu_ratio", 0) >= 0
    assert m.gpu("gpu_process_in_container", 0) in (0, 1)
    assert m.node("desktop_processes") is not None


def _real_jobs(environ: dict[str, str], **settings: Any) -> tuple[list[float | None], int]:
    """gpu_process_job of two real children of this process (GPUs 0 and 1, started with
    `environ`) and of this process (GPU 2), read through this machine's /proc."""
    import subprocess
    import sys

    me = os.getpid()
    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=environ)
        for _ in range(2)
    ]
    try:
        per_gpu = {
            g: [{"pid": child.pid, "gpu_memory_mib": 100}] for g, child in enumerate(children)
        }
        per_gpu[2] = [{"pid": me, "gpu_memory_mib": 100}]
        timeline = Timeline(scenario(per_gpu, gpu_count=3))
        clock = SimClock(virtual=True)
        source = ProcessesSource(
            ProcessesConfig(**settings),
            Context(pynvml=make_pynvml(timeline, clock), extras={"clock": clock.elapsed}),
        )
        m = Metrics(source.collect())
        source.close()
    finally:
        for child in children:
            child.kill()
            child.wait()
    return [m.gpu("gpu_process_job", g) for g in range(3)], me


def test_job_on_this_machines_real_proc() -> None:
    """Two real children of this process on GPUs 0 and 1: one job (this process) when
    their environment carries a launcher's variables; two jobs when it is read and has
    none (sibling notebooks), or cannot be read, this process (pytest) being no launcher
    by its command. This process on GPU 2 is a job of its own (with its children, where
    they are its ranks)."""
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        pytest.skip("no Linux procfs")
    plain = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": "/nonexistent"}
    ranks = {**plain, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29500"}  # fmt: skip
    jobs, me = _real_jobs(ranks)
    assert jobs == [me, me, me]
    jobs, me = _real_jobs(plain)
    assert jobs[2] == me and jobs[0] != jobs[1] and me not in jobs[:2]
    # unknown, and the parent is no launcher by its command: a job each (issue 39 item 5)
    jobs, me = _real_jobs(plain, owner_environ=False)
    assert jobs[2] == me and jobs[0] != jobs[1] and me not in jobs[:2]


def test_pid_reuse_is_a_new_process(node_factory) -> None:
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 100}],
        host={4242: {"main_thread_cpu_percent": 90}},
        phases=[
            {"name": "exited", "duration": "10s",
             "host": {"processes": {4242: {"running": False}}}},
            {"name": "again", "duration": "10m",
             "host": {"processes": {4242: {"running": True, "main_thread_cpu_percent": 10}}}},
        ],
    )  # fmt: skip
    node = node_factory(scn)
    node.poll(590.0)
    assert node.poll(595.0).gpu("gpu_process_cpu_cores", 0) == pytest.approx(1.0, abs=0.02)
    node.at(605.0)  # gone from /proc (NVML still lists it)
    assert not (node.proc / "4242").exists()
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_pid", 0) is None
    # back with a new start time and counters from zero: no rate until the second look
    m = node.poll(612.0)
    assert m.gpu("gpu_process_pid", 0) == 4242 and m.gpu("gpu_process_cpu_cores", 0) is None
    m = node.poll(617.0)
    assert m.gpu("gpu_process_cpu_cores", 0) == pytest.approx(0.2, abs=0.02)


def test_cgroup_v1_and_hierarchical_limits(node_factory) -> None:
    scn = scenario({0: [{"pid": 4242, "gpu_memory_mib": 100}],
                    1: [{"pid": 5151, "gpu_memory_mib": 100}]},
                   facts=[{"pid": 5151, "cgroup": "/kubepods/pod1/c1"}],
                   host={5151: {"cpu_quota_cpus": 8, "throttled_ratio": 0.1}})  # fmt: skip
    node = node_factory(scn)
    cg = node.sys / "fs" / "cgroup"

    def v1(periods: int, throttled: int) -> None:
        (node.proc / "4242" / "cgroup").write_text(
            "11:cpu,cpuacct:/docker/4f1c\n1:name=systemd:/docker/4f1c\n0::/\n"
        )
        d = cg / "cpu,cpuacct" / "docker" / "4f1c"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text("150000\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
        (d / "cpu.stat").write_text(
            f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_time {throttled * 10**8}\n"
        )
        parent = cg / "cpu,cpuacct" / "docker"
        (parent / "cpu.cfs_quota_us").write_text("-1\n")
        (parent / "cpu.cfs_period_us").write_text("100000\n")
        # the pod above container c1 allows only 2 CPUs, less than c1's own 8
        pod = cg / "kubepods" / "pod1"
        (pod / "cpu.max").write_text("200000 100000\n")
        (pod / "cpu.stat").write_text(f"nr_periods {periods}\nnr_throttled {periods // 2}\n"
                                      f"throttled_usec {periods * 1000}\n")  # fmt: skip

    node.at(10.0)
    v1(100, 10)
    node.source.collect()
    node.at(15.0)
    v1(150, 40)
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_cpu_quota_cpus", 0) == 1.5
    assert m.gpu("gpu_process_throttled_ratio", 0) == pytest.approx(0.6)
    assert m.gpu("gpu_process_throttled_seconds_total", 0) == pytest.approx(4.0)
    assert m.gpu("gpu_process_in_container", 0) == 1
    assert m.gpu("gpu_process_cpu_quota_cpus", 1) == 2  # the tightest limit on the path
    assert m.gpu("gpu_process_throttled_ratio", 1) == pytest.approx(0.5)  # the pod's
    assert m.gpu("gpu_process_throttled_seconds_total", 1) == pytest.approx(0.15)
    assert m.gpu("gpu_process_in_container", 1) == 1


def test_missing_cgroup_tree_leaves_limits_out(node_factory, caplog) -> None:
    node = node_factory(scenario([{"pid": 4242, "gpu_memory_mib": 100}], gpu_count=1))
    node.at(10.0)
    shutil.rmtree(node.sys / "fs")
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.sources.processes"):
        m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_pid", 0) == 4242
    assert m.gpu("gpu_process_throttled_ratio", 0) is None
    assert "no such cgroup" in caplog.text


def test_workers_without_children_files(node_factory) -> None:
    scn = scenario([{"pid": 4242, "gpu_memory_mib": 100}],
                   host={4242: {"workers": 3, "worker_cpu_percent": 40}}, gpu_count=2)  # fmt: skip
    node = node_factory(scn, scan_every=100)

    def strip() -> None:
        for children in node.proc.glob("*/task/*/children"):
            children.unlink()

    node.at(10.0)
    strip()
    m = Metrics(node.source.collect())  # finds out, scans ppids at once
    assert m.gpu("gpu_process_workers", 0) == 3
    node.at(15.0)
    strip()
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_workers", 1) == 3
    assert m.gpu("gpu_process_workers_cpu_cores", 1) == pytest.approx(1.2, abs=0.02)
    assert node.source.scans == 2  # the first poll's, and the one that found out


def test_children_of_other_threads_are_found_at_scans(node_factory) -> None:
    scn = scenario([{"pid": 4242, "gpu_memory_mib": 100}], host={4242: {"threads": 4}},
                   gpu_count=1)  # fmt: skip
    node = node_factory(scn, scan_every=2)
    node.at(10.0)
    worker = node.proc / "777"
    shutil.copytree(node.proc / "4242", worker)  # a child forked by thread 2
    tail = (worker / "stat").read_text().split(") ", 1)[1].split()
    tail[1] = "4242"  # ppid
    (worker / "stat").write_text("777 (pt_data_worker) " + " ".join(tail) + "\n")
    (node.proc / "4242" / "task" / str(thread_id(4242, 2)) / "children").write_text("777 ")
    assert Metrics(node.source.collect()).gpu("gpu_process_workers", 0) == 1  # scan poll
    assert node.poll(15.0).gpu("gpu_process_workers", 0) == 1  # remembered between scans


def test_thread_cap(node_factory) -> None:
    scn = scenario([{"pid": 4242, "gpu_memory_mib": 100}],
                   host={4242: {"threads": 50, "main_thread_cpu_percent": 20,
                                "other_threads_cpu_percent": 490}}, gpu_count=1)  # fmt: skip
    node = node_factory(scn, max_threads=5)
    node.poll(10.0)
    m = node.poll(15.0)
    assert m.gpu("gpu_process_threads", 0) == 50
    assert m.gpu("gpu_process_busiest_thread_cpu_ratio", 0) == pytest.approx(0.2, abs=0.01)


def test_unreadable_maps_leaves_cudart_out(node_factory, monkeypatch, caplog) -> None:
    node = node_factory(scenario([{"pid": 4242, "gpu_memory_mib": 100}],
                                 facts=[{"pid": 4242, "cudart": "12.1"}], gpu_count=1))  # fmt: skip
    real_read = processes_module._read

    def read(path: str, limit: int = 1 << 20) -> bytes:
        if path.endswith("/maps"):
            raise PermissionError(13, "Permission denied")
        return real_read(path, limit)

    monkeypatch.setattr(processes_module, "_read", read)
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.sources.processes"):
        m = node.poll(10.0)
    assert m.labels("gpu_process_info", 0) == [("python", "")]
    assert m.gpu("gpu_process_threads", 0) == 8
    assert "CAP_SYS_PTRACE" in caplog.text
    monkeypatch.setattr(processes_module, "_read", real_read)
    assert node.poll(15.0).labels("gpu_process_info", 0) == [("python", "")]  # not before a scan
    node.source.settings = ProcessesConfig(scan_every=1)
    assert node.poll(20.0).labels("gpu_process_info", 0) == [("python", "12.1")]


def test_nvml_unavailable_is_a_source_error(tmp_path: Path, monkeypatch) -> None:
    timeline = Timeline(load_scenario("healthy-8gpu"))
    nv = make_pynvml(timeline, SimClock(virtual=True), driver_loaded=False)
    source = ProcessesSource(ProcessesConfig(), Context(procfs=tmp_path, pynvml=nv))
    for _ in range(2):  # retried on every poll
        with pytest.raises(SourceError) as raised:
            source.collect()
        assert str(raised.value) == (
            "NVML unavailable: NVIDIA driver not loaded (NVML_ERROR_DRIVER_NOT_LOADED); "
            "is this a GPU node?"
        )
    source.close()

    def no_module(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(nvmlapi.importlib, "import_module", no_module)
    with pytest.raises(SourceError, match="module pynvml\\) is not installed"):
        ProcessesSource(ProcessesConfig(), Context(procfs=tmp_path)).collect()


def test_procfs_missing_is_a_source_error(node_factory) -> None:
    node = node_factory(scenario([], gpu_count=1))
    with pytest.raises(SourceError, match="does not exist: is procfs mounted"):
        node.source.collect()  # nothing written yet


def test_lost_gpu_and_unsupported_graphics_list(node_factory) -> None:
    node = node_factory(scenario([{"pid": 4242, "gpu_memory_mib": 100}], gpu_count=3))
    node.fake.fail("nvmlDeviceGetGraphicsRunningProcesses_v3", ERROR_NOT_SUPPORTED, gpu=1)
    node.fake.fail("nvmlDeviceGetComputeRunningProcesses_v3", ERROR_GPU_IS_LOST, gpu=2)
    m = node.poll(10.0)
    assert m.gpu("gpu_processes", 0, "graphics") == 0
    assert m.gpu("gpu_processes", 1, "graphics") is None  # not supported: left out
    assert m.gpu("gpu_processes", 1, "compute") == 1 and m.gpu("gpu_process_pid", 1) == 4242
    assert m.names_of(2) == set()  # lost: the nvml source says so
    node.fake.clear_failures()
    m = node.poll(15.0)
    assert m.gpu("gpu_processes", 1, "graphics") is None  # not asked again
    assert node.fake.gpu_calls[("nvmlDeviceGetGraphicsRunningProcesses_v3", 1)] == 1
    assert m.gpu("gpu_process_pid", 2) == 4242


def test_older_driver_without_v3_lists(tmp_path: Path) -> None:
    timeline = Timeline(scenario([{"pid": 4242, "gpu_memory_mib": 100}], gpu_count=1))
    clock = SimClock(virtual=True)
    missing = [f"nvmlDeviceGet{api}RunningProcesses_v3" for api in ("Compute", "Graphics")]
    nv = make_pynvml(timeline, clock, missing_functions=missing)
    ProcessesWriter(tmp_path / "proc", tmp_path / "sys", timeline).write(0.0)
    source = ProcessesSource(
        ProcessesConfig(), Context(procfs=tmp_path / "proc", sysfs=tmp_path / "sys", pynvml=nv)
    )
    m = Metrics(source.collect())
    assert m.gpu("gpu_processes", 0, "compute") == 1 and m.gpu("gpu_process_pid", 0) == 4242
    assert nv._gpuwatchd_fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2
    source.close()


def test_bounded_series_with_many_processes(node_factory) -> None:
    """8 GPUs x 8 processes: the same series per GPU as with one."""
    per_gpu = {
        g: [{"pid": 1000 + 10 * g + k, "gpu_memory_mib": 100 + k} for k in range(8)]
        for g in range(8)
    }
    node = node_factory(scenario(per_gpu))
    node.poll(10.0)
    m = node.poll(15.0)
    one = node_factory(scenario([{"pid": 4242, "gpu_memory_mib": 100}]))
    one.poll(10.0)
    single = one.poll(15.0)
    for gpu in range(8):
        assert m.names_of(gpu) == single.names_of(gpu)
        assert m.gpu("gpu_process_pid", gpu) == 1000 + 10 * gpu + 7
        assert m.gpu("gpu_other_processes", gpu) == 7
    assert len(m.samples) == len(single.samples)


# -- the writer ---------------------------------------------------------------------------


def test_writer_formats_and_only_changed_writes(tmp_path: Path) -> None:
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 100}],
        facts=[{"pid": 4242, "container": True, "cpus_allowed": "0-15,64-79", "uid": 1001}],
        host={4242: {"threads": 3, "workers": 2, "cpu_quota_cpus": 4, "throttled_ratio": 0.6}},
    )
    timeline = Timeline(scn)
    writer = ProcessesWriter(tmp_path / "proc", tmp_path / "sys", timeline)
    first = writer.write(0.0)
    assert first > 0 and writer.write(0.0) == 0  # nothing changed
    assert writer.write(10.0) < first  # only the counters
    pid = tmp_path / "proc" / "4242"
    stat = (pid / "stat").read_text()
    assert stat.endswith("\n") and len(stat.split(") ")[1].split()) + 2 == 52
    status = parse_status((pid / "status").read_bytes())
    assert status["Cpus_allowed_list"] == "0-15,64-79" and status["Threads"] == "3"
    assert status["Cpus_allowed"] == "00000000,0000ffff,00000000,0000ffff"
    assert status["Uid"] == "1001\t1001\t1001\t1001"
    assert (pid / "comm").read_text() == "python\n"
    cgroup = (pid / "cgroup").read_text()
    assert cgroup.startswith("0::/system.slice/docker-") and cgroup.endswith(".scope\n")
    fact = timeline.scenario.node.host.processes[0]
    assert cgroup == f"0::{container_cgroup(fact)}\n"
    tids = sorted(int(t) for t in os.listdir(pid / "task"))
    assert tids == [4242, thread_id(4242, 1), thread_id(4242, 2)]
    assert (pid / "task" / "4242" / "children").read_text() == "4242001 4242002 "
    cg = tmp_path / "sys" / "fs" / "cgroup" / container_cgroup(fact).lstrip("/")
    assert (cg / "cpu.max").read_text() == "400000 100000\n"
    values = parse_flat_keyed((cg / "cpu.stat").read_text())
    assert (values["nr_periods"], values["nr_throttled"], values["throttled_usec"]) == (
        100, 60, 3_000_000)  # fmt: skip
    # fewer threads and workers: their directories go
    fewer = scenario([{"pid": 4242, "gpu_memory_mib": 100}], facts=[{"pid": 4242}],
                     host={4242: {"threads": 2, "workers": 1}})  # fmt: skip
    writer.timeline = Timeline(fewer)
    writer.write(15.0)
    assert sorted(int(t) for t in os.listdir(pid / "task")) == [4242, thread_id(4242, 1)]
    assert (pid / "task" / "4242" / "children").read_text() == "4242001 "
    assert not (tmp_path / "proc" / "4242002").exists()
    assert parse_stat((pid / "stat").read_bytes()).threads == 2
    # stopping the process removes it and its workers
    stopped = scenario([], facts=[{"pid": 4242}], host={4242: {"running": False, "workers": 2}})
    writer.timeline = Timeline(stopped)
    writer.write(20.0)
    assert not pid.exists() and not (tmp_path / "proc" / "4242001").exists()


def test_writer_parents_and_children(tmp_path: Path) -> None:
    scn = scenario(
        [{"pid": 6001, "gpu_memory_mib": 100}],
        facts=[{"pid": 6000, "name": "torchrun"}, {"pid": 6001, "ppid": 6000},
               {"pid": 6002, "ppid": 6000}, {"pid": 4242, "ppid": 0}],
        host={6000: {"workers": 1}},
    )  # fmt: skip
    ProcessesWriter(tmp_path / "proc", tmp_path / "sys", Timeline(scn)).write(0.0)
    proc = tmp_path / "proc"
    assert (proc / "6000" / "task" / "6000" / "children").read_text() == "6000001 6001 6002 "
    for pid, ppid in ((6000, 1), (6001, 6000), (6002, 6000), (4242, 0), (6000001, 6000)):
        assert parse_stat((proc / str(pid) / "stat").read_bytes()).ppid == ppid, pid
        assert parse_status((proc / str(pid) / "status").read_bytes())["PPid"] == str(ppid)
    rank_thread = proc / "6001" / "task" / str(thread_id(6001, 1)) / "stat"
    assert parse_stat(rank_thread.read_bytes()).ppid == 6000
    assert (proc / "6001" / "task" / "6001" / "children").read_text() == ""


def test_writer_limits(tmp_path: Path) -> None:
    scn = scenario([{"pid": 4242, "gpu_memory_mib": 100}], host={4242: {"threads": 501}})
    with pytest.raises(ValueError, match="at most 500 threads"):
        ProcessesWriter(tmp_path / "p", tmp_path / "s", Timeline(scn)).write(0.0)


def test_process_age_from_starttime_and_uptime(node_factory) -> None:
    """gpu_process_age_seconds: /proc/PID/stat starttime against /proc/uptime, so a new
    process on the GPU (a restarted run) starts again from 0."""
    node = node_factory("compile-warmup-young-process-h100")
    node.poll(60.0)  # pid 5400 appears (the writer's first write)
    assert node.poll(65.0).gpu("gpu_process_age_seconds", 0) == pytest.approx(5.0)
    m = node.poll(250.0)  # at 240 s pid 5500 replaced it; first written now
    assert m.gpu("gpu_process_pid", 0) == 5500
    assert m.gpu("gpu_process_age_seconds", 0) == pytest.approx(0.0)
    assert node.poll(300.0).gpu("gpu_process_age_seconds", 0) == pytest.approx(50.0)
    (node.proc / "uptime").write_text("garbage\n")  # unreadable uptime: no age, no error
    assert node.source.collect() and Metrics(node.source.collect()).gpu(
        "gpu_process_age_seconds", 0) is None  # fmt: skip


def test_writer_owner_layouts_read_back_by_the_owner_parser(node_factory) -> None:
    """Each owner layout the simulator writes (/proc/PID/cgroup, environ) is what the real
    parsers read: Slurm v1 and v2, pods under both drivers and both runtimes; and a
    v1 process's CPU limit is found in the v1 cpu hierarchy."""
    from gpuwatchd.sources.owner.cgroup import Placement
    from gpuwatchd.sources.owner.cgroup import parse_cgroup as placement
    from gpuwatchd.sources.owner.process import parse_environ

    uid = "6f1c3e2a-8b7d-4c55-9a10-2f4be1d07c93"
    cid = "ab" * 32
    owners = {
        101: ({"slurm": {"job": 77, "step": "batch", "cgroup": "v1", "task": 2}},
              Placement("slurm", job_id="77", step="batch", uid=1000)),
        102: ({"slurm": {"job": 78, "step": "3"}}, Placement("slurm", job_id="78", step="3")),
        103: ({"pod": {"uid": uid, "container_id": cid}},
              Placement("kubernetes", pod_uid=uid, container=f"containerd://{cid}")),
        104: ({"pod": {"uid": uid, "container_id": cid, "driver": "cgroupfs", "qos": "besteffort",
                       "runtime": "cri-o"}},
              Placement("kubernetes", pod_uid=uid, container=cid)),
        105: ({"pod": {"uid": uid, "container_id": cid, "qos": "guaranteed", "runtime": "cri-o"}},
              Placement("kubernetes", pod_uid=uid, container=f"cri-o://{cid}")),
    }  # fmt: skip
    facts = [{"pid": pid, "owner": owner, "environment": {"RANK": str(pid)}}
             for pid, (owner, _) in owners.items()]  # fmt: skip
    per_gpu = {g: [{"pid": pid, "gpu_memory_mib": 100}] for g, pid in enumerate(owners)}
    host = {101: {"cpu_quota_cpus": 2}}
    node = node_factory(scenario(per_gpu, host=host, facts=facts, gpu_count=len(owners)))
    m = node.poll(10.0)
    for pid, (_, expected) in owners.items():
        assert placement((node.proc / str(pid) / "cgroup").read_text()) == expected, pid
        environ = (node.proc / str(pid) / "environ").read_bytes()
        assert environ.endswith(b"\0") and b"PATH=/usr/local/sbin:" in environ
        assert parse_environ(environ).rank == str(pid)
    v1 = (node.proc / "101" / "cgroup").read_text().splitlines()
    assert v1[0] == "12:freezer:/slurm/uid_1000/job_77/step_batch"
    assert "4:cpu,cpuacct:/system.slice/slurmd.service" in v1
    assert m.gpu("gpu_process_cpu_quota_cpus", 0) == 2.0
    cpu = node.sys / "fs" / "cgroup" / "cpu,cpuacct" / "system.slice" / "slurmd.service"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "200000\n"
    # ranks of different owners are never one job, though one launch would name them alike
    assert len({m.gpu("gpu_process_job", g) for g in range(len(owners))}) == len(owners)
    with pytest.raises(ValueError, match="exactly one of slurm or pod"):
        HostHardware.model_validate({"processes": [{"pid": 5, "owner": {}}]})
    with pytest.raises(ValueError, match="environment"):
        HostHardware.model_validate({"processes": [{"pid": 5, "environment": {"A=B": "1"}}]})


def test_a_process_renaming_itself_keeps_one_info_series(node_factory) -> None:
    """Issue 23, item 8: a name read per poll made a new gpu_process_info{name} series
    each time the process renamed itself; the name is read once per pid + start time."""
    node = node_factory(scenario([{"pid": 4242, "gpu_memory_mib": 30000}]))
    assert node.poll(100.0).labels("gpu_process_info", 3) == [("python", "")]
    for i, t in enumerate((105.0, 110.0, 115.0)):
        node.at(t)
        stat = node.proc / "4242" / "stat"
        stat.write_bytes(stat.read_bytes().replace(b"(python)", b"(renamed-%d)" % i))
        m = Metrics(node.source.collect())
        assert m.labels("gpu_process_info", 3) == [("python", "")]
        assert m.gpu("gpu_process_pid", 3) == 4242


def test_a_main_process_on_several_gpus_gives_each_this_polls_facts(node_factory) -> None:
    # its samples are worked out once a poll for all its GPUs: never a poll's for the next
    per_gpu = {g: [{"pid": 4242, "gpu_memory_mib": 100}] for g in range(3)}
    scn = scenario(
        per_gpu, gpu_count=3, host={4242: {"threads": 4}},
        phases=[{"name": "more", "duration": "10m", "host": {"processes": {4242: {"threads": 9}}}}],
    )  # fmt: skip
    node = node_factory(scn)
    assert node.poll(590.0).gpu("gpu_process_cpu_cores", 0) is None  # the first look
    for t, threads in ((595.0, 4.0), (605.0, 9.0)):  # the phase changes at 600
        m = node.poll(t)
        assert [m.gpu("gpu_process_threads", g) for g in range(3)] == [threads] * 3, t
        assert len({m.gpu("gpu_process_cpu_cores", g) for g in range(3)} - {None}) == 1
        assert [m.labels("gpu_process_info", g) for g in range(3)] == [[("python", "")]] * 3


def test_a_process_gone_in_its_last_read_has_no_owner(node_factory, monkeypatch) -> None:
    """A main process that exits between its cgroup read and its maps read (a scan poll,
    its CUDA runtime not yet known) is gone for the owners too: the stat and cgroup bytes
    the facts read are not handed on to make its owner."""
    node = node_factory(scenario([{"pid": 4242, "gpu_memory_mib": 30000}]), scan_every=1)
    real = processes_module._proc_read
    exits = False

    def proc_read(path: str, *args: Any, **kwargs: Any) -> bytes:
        if path.endswith("/4242/maps"):
            if exits:
                shutil.rmtree(node.proc / "4242")
                raise _Gone(path)
            raise PermissionError(13, "no ptrace", path)  # the runtime stays unknown
        return real(path, *args, **kwargs)

    monkeypatch.setattr(processes_module, "_proc_read", proc_read)
    for t in (100.0, 105.0):
        assert node.poll(t).labels("gpu_owner_info", 0)
    node.at(110.0)
    exits = True
    m = Metrics(node.source.collect())
    assert m.gpu("gpu_process_pid", 0) is None
    assert not m.labels("gpu_owner_info", 0)


def test_a_poll_reads_each_of_a_jobs_stat_and_cgroup_once(node_factory, monkeypatch) -> None:
    """The main process's stat and cgroup, and its workers' stat, are read once a poll
    for the facts, the job's I/O and the owner alike (the cgroup every poll: a process
    can be moved)."""
    scn = scenario(
        [{"pid": 4242, "gpu_memory_mib": 30000}],
        host={4242: {"workers": 2, "worker_cpu_percent": 50}},
    )
    node = node_factory(scn)
    node.poll(100.0)
    opened: Counter[str] = Counter()
    real_open = os.open

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        opened[os.fspath(path)] += 1
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    for t in (105.0, 110.0):
        m = node.poll(t)
        main, worker = node.proc / "4242", node.proc / str(worker_pid(4242, 0))
        assert opened.pop(f"{main}/stat") == opened.pop(f"{main}/cgroup") == 1
        assert opened.pop(f"{worker}/stat") == 1
        assert m.gpu("gpu_process_workers", 3) == 2
        assert m.gpu("gpu_process_workers_cpu_cores", 3) == pytest.approx(1.0, abs=0.02)
        assert m.labels("gpu_owner_info", 3)
        opened.clear()
