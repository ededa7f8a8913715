"""The probe socket against hostile local users: out-of-range reports, floods, and the
socket's path and directory (issue 13, findings 5-7); senders shared by tenant, the pids
tracked bounded (issue 41, item 3)."""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import stat
import struct
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cgroups import placed

from gpuwatchd.config import ProbeConfig
from gpuwatchd.sources import SourceError
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.owner.cgroup import tenant as cgroup_tenant
from gpuwatchd.sources.probe import DrainBudget, Inbox, ProbeSocket, ProbeSource
from gpuwatchd.sources.probe_tenants import PIDS_PER_TENANT, Roster
from tests.test_probe import GOOD, Datagrams, Metrics, Node, two_jobs

# -- finding 5: numbers a report may carry ----------------------------------------------

OUT_OF_RANGE: list[bytes | dict[str, Any]] = [
    {**GOOD, "batches": 10**400},  # float() overflows
    {**GOOD, "batches": 2**53},  # no longer exact as a float
    {**GOOD, "wait_seconds": math.inf},  # json.dumps writes Infinity
    {**GOOD, "compute_seconds": math.nan},
    b'{"v":1,"batches":1,"wait_seconds":1e400,"compute_seconds":1}',  # inf once parsed
    {**GOOD, "wait_seconds": 1e9},  # 31 years of waiting
    {**GOOD, "rank": 2**40},
    {**GOOD, "loader": {"num_workers": 10**30}},
    {**GOOD, "cuda": {"device": 0, "reserved_bytes": 2.0**61, "allocated_bytes": 1}},
    {**GOOD, "cuda": {"device": 0, "reserved_bytes": 1, "allocated_bytes": 1, "ooms": 2**64}},
    {**GOOD, "cuda": {"device": 0, "reserved_bytes": 1, "allocated_bytes": 1,
                      "init_timestamp": 1e300}},
    b"[" * 5000,  # nested deeper than the JSON decoder recurses
]  # fmt: skip


@pytest.fixture
def node() -> Iterator[Node]:
    made = Node(two_jobs(), Datagrams())
    yield made
    made.close()


def wire(node: Node) -> Datagrams:
    receiver = node.source._receiver
    assert isinstance(receiver, Datagrams)
    return receiver


@pytest.mark.parametrize("bad", [{"batches": 10**400}, {"wait_seconds": math.inf}])
def test_one_huge_report_does_not_take_the_probe_source_down(
    node: Node, bad: dict[str, Any]
) -> None:
    wire(node).send(200, GOOD)
    wire(node).send(100, {**GOOD, **bad})
    m = Metrics(node.source.collect())  # raised OverflowError / exported +Inf before
    assert all(math.isfinite(v) for values in m.by_name.values() for v in values.values())
    assert m.node("probe_reports_total", "malformed") == 1
    assert m.gpu("probe_pid", 0) is None and m.gpu("probe_pid", 2) == 200


def test_out_of_range_numbers_are_refused_per_report_and_the_source_stays_up(
    node: Node,
) -> None:
    for report in OUT_OF_RANGE:
        wire(node).send(100, report)
    wire(node).send(200, GOOD)
    samples = node.source.collect()  # must not raise: one report never fails a poll
    assert all(math.isfinite(s.value) for s in samples)
    m = Metrics(samples)
    assert m.node("probe_reports_total", "malformed") == len(OUT_OF_RANGE)
    assert m.node("probe_reports_total", "accepted") == 1
    assert m.gpu("probe_pid", 0) is None and m.gpu("probe_pid", 2) == 200


def test_the_largest_values_in_range_are_exported_exactly(node: Node) -> None:
    big = {**GOOD, "batches": 2**53 - 1, "wait_seconds": 999_999_999.0}
    cuda = {"device": 1, "reserved_bytes": 2**60 - 2**20, "allocated_bytes": 0}
    wire(node).send(100, {**big, "cuda": cuda})
    m = Metrics(node.source.collect())
    assert m.gpu("probe_batches_total", 0) == 2**53 - 1
    assert m.gpu("probe_wait_seconds_total", 0) == 999_999_999.0
    assert m.gpu("probe_cuda_reserved_bytes", 1) == 2**60 - 2**20


# -- finding 6: draining, fairness, counting --------------------------------------------


def test_the_socket_is_drained_as_datagrams_arrive(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    daemon = ProbeSocket(path, 8192)
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.settimeout(10)  # blocks while the kernel's queue (10 datagrams) is full
        for i in range(200):  # nobody polls meanwhile
            sender.sendto(json.dumps({**GOOD, "batches": i}).encode(), str(path))
        sender.close()
        received = daemon.receive(1000)
        assert [json.loads(d)["batches"] for _, d in received] == list(range(200))
        assert daemon.dropped == 0
    finally:
        daemon.close()


def test_a_flooding_tenant_only_loses_its_own_share() -> None:
    inbox = Inbox(capacity=64)
    for i in range(10_000):
        inbox.put("user:1000", 4000 + i % 7, b"flood")
    inbox.put("user:1001", 5000, b"victim")
    inbox.put("pod:x", 6000, b"other")
    taken = inbox.take(1000)
    assert (5000, b"victim") in taken and (6000, b"other") in taken
    assert len(taken) == 64
    assert inbox.dropped == 10_000 + 2 - 64
    assert inbox.take(1000) == []


def test_take_serves_every_tenant_in_turn() -> None:
    inbox = Inbox(capacity=100)
    for i in range(50):
        inbox.put("user:1000", 1, b"a%d" % i)
    inbox.put("user:1001", 2, b"b")
    first = inbox.take(2)
    assert first == [(1, b"a0"), (2, b"b")]  # the victim is not behind the flood
    assert [d for _, d in inbox.take(100)] == [b"a%d" % i for i in range(1, 50)]


@pytest.mark.parametrize("uids", ["the victim's", "2,000 forged"])
def test_a_flooder_in_another_cgroup_does_not_starve_a_victim(uids: str) -> None:
    """Issue 41, item 3: the queue was shared by uid. Under the unit's PrivateUsers=yes
    every other user's uid reads 65534, so a flooder and its victim were one (here both
    are root); a process with CAP_SETUID names as many uids as it likes in SCM_CREDENTIALS
    (here 2,000) and had as many shares. Now the sender's cgroup says who it is."""
    directory = Path(tempfile.mkdtemp(prefix="gpuwatchd-probe-"))
    directory.chmod(0o755)
    path = directory / "probe.sock"
    daemon = ProbeSocket(path, 8192, capacity=64)
    go_read, go_write = os.pipe()
    child = os.fork()
    if child == 0:  # the flooder: 2,000 reports as fast as the kernel takes them
        os._exit(_flood(go_read, str(path), forged=uids != "the victim's"))
    try:
        with placed(child, f"/gpuwatchd-test-{uuid.uuid4().hex[:12]}") as where:
            os.write(go_write, b"go" if where else b"no")
            assert os.waitpid(child, 0)[1] == 0
            if where is None:
                pytest.skip("no cgroup can be made here (needs root and a writable hierarchy)")
        victim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        victim.settimeout(10)
        victim.sendto(b"victim", str(path))
        assert_eventually_queued(daemon, b"victim")
        assert daemon.dropped >= 2000 - 64
    finally:
        daemon.close()
        os.rmdir(directory)
        os.close(go_read)
        os.close(go_write)


def _flood(go: int, path: str, forged: bool) -> int:
    """The flooding child: once moved into its cgroup, 2,000 datagrams, with uids 1…2000
    named in SCM_CREDENTIALS (CAP_SETUID) where `forged`; its exit status."""
    try:
        if os.read(go, 2) != b"go":
            return 0
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.settimeout(10)
        for uid in range(1, 2001):
            creds = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS,
                      struct.pack("iII", os.getpid(), uid, 0))] if forged else []  # fmt: skip
            s.sendmsg([b"flood"], creds, 0, path)
        return 0
    except BaseException:
        return 1


def assert_eventually_queued(daemon: ProbeSocket, data: bytes) -> None:
    """The reader thread queues what the kernel handed it; a send has returned, so it is
    in the kernel's queue or already taken: receive until it shows (bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(d == data for _, d in daemon.receive(1000)):
            return
        time.sleep(0.01)
    pytest.fail(f"{data!r} never arrived")


def test_refusals_by_the_socket_are_counted_per_reason(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    receiver = ProbeSocket(path, 8192, capacity=4)
    source = ProbeSource(
        ProbeConfig(socket=path), Context(procfs=tmp_path, extras={"probe_receiver": receiver})
    )
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.settimeout(10)
        for _ in range(10):
            sender.sendto(b"{}", str(path))
        assert_dropped(receiver, 6)
        m = Metrics(source.collect())
        assert m.node("probe_reports_total", "queue_full") == 6
        assert m.node("probe_reports_total", "malformed") == 4
    finally:
        source.close()


def assert_dropped(receiver: ProbeSocket, count: int) -> None:
    deadline = time.monotonic() + 10
    while receiver.dropped < count:
        assert time.monotonic() < deadline, f"dropped {receiver.dropped}, not {count}"
        time.sleep(0.01)


# -- issue 23, item 3: the drain's CPU under a flood ------------------------------------


def test_a_flood_spends_the_drains_cpu_budget_then_the_kernel_holds_it(tmp_path: Path) -> None:
    """Once its window's CPU is spent, the thread reads nothing until the next poll (or
    the window's end): a flood costs the daemon a bounded share of its CPUQuota."""
    path = tmp_path / "probe.sock"
    spent = itertools.count(0, 10**6).__next__  # every look at the CPU: another 10^6 s
    budget = DrainBudget(window=3600, cpu_clock=spent)
    daemon = ProbeSocket(path, 8192, budget=budget)
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.sendto(b"first", str(path))
        assert budget.resting.wait(10)  # one burst, then the budget is spent
        sender.setblocking(False)
        taken = 0
        for _ in range(100):  # the flood: the kernel queues what it may, then refuses
            try:
                sender.sendto(b"flood", str(path))
                taken += 1
            except BlockingIOError:
                pass
        qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
        assert taken == qlen + 1  # the kernel refuses once more than qlen wait
        assert len(daemon._inbox) == 1  # nothing read while it rests (read 100 before)
        received = daemon.receive(1000)  # the poll: reads what the kernel held (bounded)
        assert [d for _, d in received] == [b"first"] + [b"flood"] * taken
    finally:
        daemon.close()


def test_a_tenant_past_its_share_is_dropped_first_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    budget = DrainBudget(cpu_share=1.0, per_tenant=5, window=3600)  # CPU never spent
    daemon = ProbeSocket(path, 8192, budget=budget)
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.settimeout(10)  # blocks while the kernel's queue is full
        for i in range(20):
            sender.sendto(b"%d" % i, str(path))
        assert [d for _, d in daemon.receive(1000)] == [b"0", b"1", b"2", b"3", b"4"]
        assert daemon.dropped == 15  # the queue_full count the source exports
        for i in range(3):  # a poll renews every uid's share
            sender.sendto(b"again %d" % i, str(path))
        assert len(daemon.receive(1000)) == 3 and daemon.dropped == 15
    finally:
        daemon.close()


# -- finding 7: the socket's directory and path -----------------------------------------


def test_chmod_never_follows_a_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("key")
    secret.chmod(0o600)
    path = tmp_path / "run" / "probe.sock"
    bind = socket.socket.bind

    def racing_bind(self: socket.socket, address: Any) -> None:
        bind(self, address)  # then someone swaps the new socket for a symlink
        os.unlink(address)
        os.symlink(secret, address)

    monkeypatch.setattr(socket.socket, "bind", racing_bind)
    with pytest.raises(SourceError, match="not the socket"):
        ProbeSocket(path, 512)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may replace the socket in it
    with pytest.raises(SourceError, match=r"writable by other users"):
        ProbeSocket(shared / "probe.sock", 512)
    assert not (shared / "probe.sock").exists()


def test_a_sticky_shared_directory_is_refused(tmp_path: Path) -> None:
    """Like /tmp: others cannot remove the daemon's socket there, but any user can bind
    the path first (while the daemon is down) and receive every tenant's reports."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(SourceError, match=r"\(mode 1777\) is writable by other users"):
        ProbeSocket(shared / "probe.sock", 512)
    assert not (shared / "probe.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_a_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(SourceError, match=r"owned by uid 65534"):
        ProbeSocket(theirs / "probe.sock", 512)


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SourceError, match="symbolic link"):
        ProbeSocket(tmp_path / "link" / "probe.sock", 512)


def test_the_directory_is_created_0755_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)  # systemd's UMask=0077
    try:
        daemon = ProbeSocket(tmp_path / "run" / "probe.sock", 512)
    finally:
        os.umask(old)
    try:
        st = os.lstat(tmp_path / "run")
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(os.lstat(tmp_path / "run" / "probe.sock").st_mode) == 0o666
    finally:
        daemon.close()


def test_something_else_at_the_socket_path_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    path.write_text("not a socket")
    with pytest.raises(SourceError, match="not a socket"):
        ProbeSocket(path, 512)
    assert path.read_text() == "not a socket"


# -- issue 41, item 3: tenants and the pids tracked -------------------------------------

FLOODER = "/user.slice/user-2000.slice/user@2000.service/app.slice/flood-{}.scope"


def cheap_reporters(proc: Path, pids: range, cgroup: str) -> None:
    """Live processes in `proc` (their stat and cgroup, as the kernel writes them)."""
    stat = "{} (python3) S 1 {} {} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 5000 0 0\n"
    for pid in pids:
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "stat").write_text(stat.format(pid, pid, pid))
        (proc / str(pid) / "cgroup").write_text(f"0::{cgroup.format(pid)}\n")


def test_thousands_of_cheap_reporters_are_bounded_per_tenant(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """2,287 reporters of one login user, each in a cgroup of its own making: 64 are
    tracked (a poll read every one's stat: 32-114 ms), the rest counted as pid_limit, one
    log line; the victim's report still lands on its GPU."""
    flood = range(30_000, 32_287)
    cheap_reporters(node.sim.root / "proc", flood, FLOODER)
    for t in (1, 2, 3):  # a third of them each poll (the test's wire is no fair queue)
        for pid in flood[t - 1 :: 3]:
            wire(node).send(pid, GOOD)
        wire(node).send(200, {**GOOD, "batches": t})
        m = node.poll(t)
    assert m.node("probe_processes") == PIDS_PER_TENANT + 1
    assert m.node("probe_unplaced_processes") == PIDS_PER_TENANT
    assert m.node("probe_reports_total", "pid_limit") == len(flood) - PIDS_PER_TENANT
    assert m.gpu("probe_pid", 2) == 200 and m.gpu("probe_batches_total", 2) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuwatchd.sources.probe"]
    assert len(lines) == 2, lines  # one for the drops, one for the pids on no GPU
    assert lines[1].startswith(
        "probe: pid 30000, 30003, 30006, 30009, 30012, 30015, 30018, 30021, 30024, 30027 "
        "reports but NVML lists it on no GPU (64 pid(s) in all now)"
    )


def test_the_roster_keeps_room_for_every_tenant() -> None:
    """At the cap, a newcomer takes the place of the stalest pid of the tenant tracking
    the most; one tenant never holds more than its share, nor evicts itself."""
    roster: Roster[Any] = Roster(most=8, per_tenant=5)

    def add(pid: int, tenant: str) -> bool:
        if not roster.room(tenant):
            return False
        roster.add(pid, SimpleNamespace(tenant=tenant, seen=float(pid)))
        return True

    assert [add(pid, "a") for pid in range(1, 7)] == [True] * 5 + [False]
    assert [add(pid, "b") for pid in range(11, 14)] == [True] * 3  # 8 tracked
    assert add(21, "c")  # a's stalest, pid 1, makes room
    assert sorted(roster.pids) == [2, 3, 4, 5, 11, 12, 13, 21]
    assert add(22, "c") and 2 not in roster.pids  # a: 3, b: 3, c: 2
    assert not add(23, "c")  # c would hold as many as the most: its own newcomer waits
    roster.remove(13)
    assert add(23, "c")


@pytest.mark.parametrize(
    "cgroup, tenant",
    [
        # what a tenant makes below its own cgroup is still its own
        (FLOODER.format(1), "user:2000"),
        (f"/user.slice/user-2000.slice/user@2000.service/user.slice/libpod-{'f' * 64}.scope",
         "user:2000"),  # rootless podman: the user's own container
        ("/user.slice/user-2000.slice/session-4.scope", "user:2000"),
        ("/system.slice/slurmstepd.scope/job_77/step_0/user/task_0/x/y", "slurm:77"),
        (f"/kubepods.slice/kubepods-pod{'a' * 32}.slice/cri-containerd-{'b' * 64}.scope/z",
         "pod:" + "a" * 32),
        (f"/docker/{'c' * 64}/docker/{'d' * 64}", f"cgroup:docker/{'c' * 64}"),  # the outer
        ("/system.slice/train.service/sub/deeper", "cgroup:system.slice/train.service"),
        ("/", None),
    ],
)  # fmt: skip
def test_a_tenant_is_cut_where_its_own_subtree_begins(cgroup: str, tenant: str | None) -> None:
    assert cgroup_tenant(f"0::{cgroup}\n") == tenant
