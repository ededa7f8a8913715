"""The probe socket against hostile local users: out-of-range reports, floods, and the
socket's path and directory (issue 13, findings 5-7)."""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config import ProbeConfig
from gpuwatchd.sources import SourceError
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.probe import DrainBudget, Inbox, ProbeSocket, ProbeSource
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


def test_a_flooding_uid_only_loses_its_own_share() -> None:
    inbox = Inbox(capacity=64)
    for i in range(10_000):
        inbox.put(1000, 4000 + i % 7, b"flood")
    inbox.put(1001, 5000, b"victim")
    inbox.put(1002, 6000, b"other")
    taken = inbox.take(1000)
    assert (5000, b"victim") in taken and (6000, b"other") in taken
    assert len(taken) == 64
    assert inbox.dropped == 10_000 + 2 - 64
    assert inbox.take(1000) == []


def test_take_serves_every_uid_in_turn() -> None:
    inbox = Inbox(capacity=100)
    for i in range(50):
        inbox.put(1000, 1, b"a%d" % i)
    inbox.put(1001, 2, b"b")
    first = inbox.take(2)
    assert first == [(1, b"a0"), (2, b"b")]  # the victim is not behind the flood
    assert [d for _, d in inbox.take(100)] == [b"a%d" % i for i in range(1, 50)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another uid")
def test_a_flooder_of_another_uid_does_not_starve_a_victim() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gpuwatchd-probe-"))
    directory.chmod(0o755)  # reachable by the flooder's uid
    path = directory / "probe.sock"
    daemon = ProbeSocket(path, 8192, capacity=64)
    try:
        child = os.fork()
        if child == 0:  # the flooder: nobody, 2000 reports as fast as the kernel takes them
            code = 1
            try:
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.settimeout(10)
                for _ in range(2000):
                    s.sendto(b"flood", str(path))
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0
        victim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        victim.settimeout(10)
        victim.sendto(b"victim", str(path))
        assert_eventually_queued(daemon, b"victim")
        assert daemon.dropped >= 2000 - 64
    finally:
        daemon.close()
        os.rmdir(directory)


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


def test_a_uid_past_its_share_is_dropped_first_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    budget = DrainBudget(cpu_share=1.0, per_uid=5, window=3600)  # CPU never spent
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
