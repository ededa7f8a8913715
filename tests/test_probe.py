"""The probe: the client in the training process, the daemon's source, and the wire."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import wait_until

from gpuwatchd import probe
from gpuwatchd.config import ProbeConfig
from gpuwatchd.scheduler import LANES, Poller, ThreadedScheduler
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources import REGISTRY, SourceError
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.probe import REPORTS, ProbeSocket, ProbeSource, Report
from gpuwatchd.store import Store
from tests.series import Metrics as SampleIndex

P = "gpuwatchd_"


# -- the client -------------------------------------------------------------------------


def test_watch_times_waiting_and_computing() -> None:
    p = probe.Probe(socket_path="/nonexistent/probe.sock", interval=3600)

    def slow() -> Any:
        for i in range(4):
            time.sleep(0.02)  # the loader: 20 ms to produce each batch
            yield i

    seen = []
    for batch in p.watch(slow()):
        seen.append(batch)
        time.sleep(0.03)  # the step
    assert seen == [0, 1, 2, 3]
    assert p.batches == 4
    assert p.wait_seconds >= 4 * 0.02
    assert p.compute_seconds >= 3 * 0.03  # between batches: the last step is not counted


def test_waiting_marks_steps_explicitly() -> None:
    p = probe.Probe(socket_path="/nonexistent/probe.sock", interval=3600)
    for _ in range(3):
        with p.waiting():
            time.sleep(0.02)
        time.sleep(0.01)
    assert p.batches == 3
    assert p.wait_seconds >= 3 * 0.02
    assert p.compute_seconds >= 2 * 0.01


def test_loader_errors_reach_the_loop_untouched() -> None:
    def broken() -> Any:
        yield 1
        raise KeyError("bad sample")

    p = probe.Probe(socket_path="/nonexistent/probe.sock")
    with pytest.raises(KeyError, match="bad sample"):
        list(p.watch(broken()))


def test_no_daemon_drops_reports_and_carries_on(tmp_path: Path) -> None:
    p = probe.Probe(socket_path=str(tmp_path / "absent.sock"), interval=0)
    assert list(p.watch(range(100))) == list(range(100))
    assert p.sent == 0 and p.errors == 0 and p.dropped == 100


def test_full_socket_never_blocks(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    daemon.bind(str(path))  # bound, never read: its queue fills up
    try:
        p = probe.Probe(socket_path=str(path), interval=0)
        for _ in p.watch(range(5000)):
            pass
        # the last report that found the queue full may still be in the sending thread
        wait_until("every report sent or dropped", lambda: p.sent + p.dropped == 5000, 10)
        assert p.sent > 0 and p.dropped > 0 and p.errors == 0
    finally:
        daemon.close()


def test_a_report_that_finds_the_queue_full_waits_for_room(tmp_path: Path) -> None:
    """Another process fills the daemon's queue: the report is not dropped, the training
    loop does not wait, and the report is delivered once the daemon drains (issue 23)."""
    path = tmp_path / "probe.sock"
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    daemon.bind(str(path))
    flooder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    flooder.setblocking(False)
    try:
        with pytest.raises(BlockingIOError):
            while True:
                flooder.sendto(b"flood", str(path))
        p = probe.Probe(socket_path=str(path), interval=30)
        assert list(p.watch(range(1))) == [0]  # returned at once: the loop never waits
        assert p.sent == 0 and p.dropped == 0
        daemon.settimeout(10)
        reports = []
        while not reports:  # the daemon drains; the waiting report gets its turn
            data = daemon.recv(8192)
            if data != b"flood":
                reports.append(json.loads(data))
        assert reports[0]["batches"] == 1
        wait_until("the report counted as sent", lambda: p.sent == 1, 10)
        assert p.dropped == 0
    finally:
        flooder.close()
        daemon.close()


def test_a_restarted_daemon_gets_reports_again(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    p = probe.Probe(socket_path=str(path), interval=0)
    first = ProbeSocket(path, 8192)
    list(p.watch(range(3)))
    assert [pid for pid, _ in first.receive(10)] == [os.getpid()] * 3
    first.close()
    list(p.watch(range(2)))  # no daemon
    second = ProbeSocket(path, 8192)
    list(p.watch(range(2)))
    received = second.receive(10)
    second.close()
    assert len(received) == 2
    assert json.loads(received[-1][1])["batches"] == 7
    assert p.dropped == 2


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    daemon = ProbeSocket(path, 8192)
    monkeypatch.setenv("GPUWATCHD_PROBE", "0")
    p = probe.Probe(socket_path=str(path), interval=0)
    list(p.watch(range(10)))
    assert p.batches == 10 and p.sent == 0 and daemon.receive(10) == []
    daemon.close()


def test_socket_path_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCHD_PROBE_SOCKET", "/tmp/elsewhere.sock")
    assert probe.Probe().path == "/tmp/elsewhere.sock"
    monkeypatch.delenv("GPUWATCHD_PROBE_SOCKET")
    assert probe.Probe().path == probe.DEFAULT_SOCKET


def test_report_matches_the_daemons_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")

    class LoaderLike:
        num_workers = 4
        pin_memory = True
        prefetch_factor = 2
        persistent_workers = False
        batch_size = 32

        def __iter__(self) -> Any:
            return iter(range(3))

    p = probe.Probe(socket_path="/nonexistent/probe.sock", interval=3600)
    list(p.watch(LoaderLike()))
    report = Report.model_validate(json.loads(p.report_bytes()))
    assert (report.batches, report.rank, report.local_rank) == (3, 3, 1)
    assert report.loader is not None
    assert report.loader.model_dump() == {
        "num_workers": 4,
        "pin_memory": True,
        "prefetch_factor": 2,
        "persistent_workers": False,
        "batch_size": 32,
    }
    assert report.cuda is None  # no torch imported by this test, or no CUDA


def test_cuda_state_from_a_cuda_like_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA part reads torch.cuda's public API; a stand-in with its shapes."""

    class Props:
        uuid = "6f1d2c3b-8a4e-4f0a-9d7c-2b5e1a9c4d21"

    class Cuda:
        initialized = False

        def is_initialized(self) -> bool:
            return self.initialized

        def _lazy_init(self) -> None:
            time.sleep(0.01)
            self.initialized = True

        def current_device(self) -> int:
            return 1

        def get_device_properties(self, device: int) -> Props:
            return Props()

        def memory_stats(self, device: int) -> dict[str, int]:
            return {
                "reserved_bytes.all.current": 8 << 30,
                "allocated_bytes.all.current": 5 << 30,
                "inactive_split_bytes.all.current": 2 << 30,
                "num_alloc_retries": 7,
                "num_ooms": 0,
            }

        def memory_snapshot(self) -> list[dict[str, Any]]:
            return [
                {"device": 1, "blocks": [{"size": 1 << 30, "state": "inactive"}]},
                {"device": 1, "blocks": [{"size": 3 << 29, "state": "active_allocated"}]},
                {"device": 0, "blocks": [{"size": 4 << 30, "state": "inactive"}]},
            ]

    class Torch:
        cuda = Cuda()

    torch = Torch()
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    p = probe.Probe(socket_path="/nonexistent/probe.sock", interval=3600)
    assert Report.model_validate(json.loads(p.report_bytes())).cuda is None  # not yet
    torch.cuda._lazy_init()  # the program's first CUDA call, through the probe's wrapper
    report = Report.model_validate(json.loads(p.report_bytes()))
    cuda = report.cuda
    assert cuda is not None
    assert (cuda.device, cuda.uuid) == (1, Props.uuid)
    assert (cuda.reserved_bytes, cuda.allocated_bytes) == (8 << 30, 5 << 30)
    assert cuda.largest_free_block_bytes == 1 << 30  # device 1's inactive blocks only
    assert cuda.alloc_retries == 7
    assert cuda.init_seconds is not None and cuda.init_seconds >= 0.01
    assert cuda.init_timestamp is not None and abs(cuda.init_timestamp - time.time()) < 60


def test_a_failing_cuda_query_never_reaches_the_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class Cuda:
        def is_initialized(self) -> bool:
            return True

        def current_device(self) -> int:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(__import__("sys").modules, "torch", type("T", (), {"cuda": Cuda()}))
    path = tmp_path / "probe.sock"
    daemon = ProbeSocket(path, 8192)
    p = probe.Probe(socket_path=str(path), interval=0)
    assert list(p.watch(range(3))) == [0, 1, 2]
    assert p.errors == 3 and daemon.receive(10) == []
    daemon.close()


# -- the socket -------------------------------------------------------------------------


def test_socket_names_the_sender_and_marks_oversized_datagrams(tmp_path: Path) -> None:
    path = tmp_path / "run" / "probe.sock"  # its directory is created
    daemon = ProbeSocket(path, 512)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.sendto(b"x" * 512, str(path))
    sender.sendto(b"y" * 4000, str(path))
    (pid1, small), (pid2, big) = daemon.receive(10)
    assert pid1 == pid2 == os.getpid()
    assert len(small) == 512 and len(big) > 512
    assert oct(path.stat().st_mode & 0o777) == "0o666"
    daemon.close()
    assert not path.exists()


def test_a_dead_daemons_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody is bound to it
    daemon = ProbeSocket(path, 512)
    daemon.close()


def test_a_live_daemons_socket_is_not_stolen(tmp_path: Path) -> None:
    path = tmp_path / "probe.sock"
    daemon = ProbeSocket(path, 512)
    with pytest.raises(SourceError, match="another process"):
        ProbeSocket(path, 512)
    daemon.close()


# -- the source on a simulated node -----------------------------------------------------


class Metrics(SampleIndex):
    def gpu(self, name: str, gpu: int) -> float | None:
        for labels, value in self.by_name.get(P + name, {}).items():
            if labels[0] == str(gpu):
                return value
        return None

    def node(self, name: str, *labels: str) -> float | None:
        return self.by_name.get(P + name, {}).get(labels)


class Datagrams:
    """A receiver handing over what a test queued, as the socket would."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, bytes]] = []

    def send(self, pid: int, report: dict[str, Any] | bytes) -> None:
        data = report if isinstance(report, bytes) else json.dumps(report).encode()
        self.queue.append((pid, data))

    def receive(self, limit: int) -> list[tuple[int, bytes]]:
        out, self.queue = self.queue[:limit], self.queue[limit:]
        return out

    def close(self) -> None:
        pass


def two_jobs(
    probe_values: dict[int, dict[str, Any]] | None = None, *later: dict[str, Any]
) -> Scenario:
    """pid 100 on GPUs 0-1 (more memory on 1), pid 200 on GPU 2, pid 300 beside 200;
    for 10 minutes, or 40 s and then the phases `later`."""
    return Scenario.model_validate(
        {
            "name": "t",
            "node": {"gpu_count": 4, "hostname": "h"},
            "phases": [
                {
                    "name": "p",
                    "duration": "40s" if later else "10m",
                    "changes": [
                        {"gpus": [0], "set": {"processes": [{"pid": 100, "gpu_memory_mib": 10}]}},
                        {"gpus": [1], "set": {"processes": [{"pid": 100, "gpu_memory_mib": 90}]}},
                        {
                            "gpus": [2],
                            "set": {
                                "processes": [
                                    {"pid": 200, "gpu_memory_mib": 500},
                                    {"pid": 300, "gpu_memory_mib": 50},
                                ]
                            },
                        },
                    ],
                    "host": {"probe": probe_values or {}},
                },
                *later,
            ],
        }
    )


class Node:
    def __init__(self, scenario: Scenario, receiver: Any = None, **config: Any) -> None:
        self.sim = SimNode(scenario, virtual=True)
        context = self.sim.context()
        if receiver is not None:
            context.extras["probe_receiver"] = receiver
        self.source = ProbeSource(ProbeConfig(**config), context)

    def poll(self, at: float) -> Metrics:
        self.sim.clock.advance(at - self.sim.clock.elapsed())
        self.sim.tick()
        return Metrics(self.source.collect())

    def close(self) -> None:
        self.source.close()
        self.sim.close()


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(scenario: Scenario, receiver: Any = None, **config: Any) -> Node:
        made.append(Node(scenario, receiver, **config))
        return made[-1]

    yield make
    for node in made:
        node.close()


GOOD = {"v": 1, "batches": 10, "wait_seconds": 9.0, "compute_seconds": 1.0}


def test_registered() -> None:
    assert REGISTRY["probe"] is ProbeSource


def test_reports_land_on_the_senders_gpus(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    cuda = {"device": 0, "uuid": gpu_uuid("h", 1)[4:], "reserved_bytes": 8e9}
    cuda |= {"allocated_bytes": 2e9, "largest_free_block_bytes": 1e8, "alloc_retries": 3}
    wire.send(100, {**GOOD, "rank": 0, "loader": {"num_workers": 0, "pin_memory": False}})
    wire.send(100, {**GOOD, "batches": 11, "cuda": cuda})  # the newer one counts
    wire.send(200, {**GOOD, "batches": 5, "future_field": {"x": 1}})  # unknown keys ignored
    m = node.poll(1)
    for gpu in (0, 1):
        assert m.gpu("probe_pid", gpu) == 100
        assert m.gpu("probe_batches_total", gpu) == 11
        assert m.gpu("probe_wait_seconds_total", gpu) == 9.0
        assert m.gpu("probe_loader_workers", gpu) is None  # the latest report had no loader
    assert m.gpu("probe_cuda_reserved_bytes", 1) == 8e9  # the GPU whose uuid torch gave
    assert m.gpu("probe_cuda_reserved_bytes", 0) is None
    assert m.gpu("probe_cuda_alloc_retries_total", 1) == 3
    assert m.gpu("probe_pid", 2) == 200
    assert m.gpu("probe_pid", 3) is None
    assert m.node("probe_reports_total", "accepted") == 3
    assert m.node("probe_processes") == 2
    assert m.node("probe_unplaced_processes") == 0


def test_without_a_uuid_cuda_goes_to_the_gpu_with_most_memory(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    wire.send(100, {**GOOD, "cuda": {"device": 0, "reserved_bytes": 1, "allocated_bytes": 1}})
    m = node.poll(1)
    assert m.gpu("probe_cuda_reserved_bytes", 1) == 1
    assert m.gpu("probe_cuda_reserved_bytes", 0) is None


def test_the_process_with_most_memory_owns_a_shared_gpu(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    wire.send(300, {**GOOD, "batches": 1})
    assert node.poll(1).gpu("probe_pid", 2) == 300  # the only probed one
    wire.send(200, {**GOOD, "batches": 2})
    assert node.poll(2).gpu("probe_pid", 2) == 200


def test_bad_reports_are_counted_and_dropped(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire, max_report_bytes=256)
    wire.send(100, b"{not json")
    wire.send(100, {**GOOD, "batches": -1})
    wire.send(100, {**GOOD, "wait_seconds": "lots"})
    wire.send(100, {"v": 1})
    wire.send(100, b"[1, 2]")
    wire.send(100, b"\xff\xfe")
    wire.send(100, {**GOOD, "pad": "x" * 300})
    wire.send(0, GOOD)  # no credentials
    m = node.poll(1)
    assert m.node("probe_reports_total", "malformed") == 7
    assert m.node("probe_reports_total", "too_large") == 1
    assert m.node("probe_reports_total", "accepted") == 0
    assert m.gpu("probe_pid", 0) is None
    wire.send(100, GOOD)  # a good one after bad ones is taken
    assert node.poll(2).gpu("probe_batches_total", 0) == 10


def test_bad_reports_are_logged_once_a_minute(nodes: Any, caplog: Any) -> None:
    """Issue 41: one line a poll was still 86,400 a day; the next line counts the rest."""
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    for t in (1, 2, 3, 62):
        wire.send(100, b"{not json")
        node.poll(t)
    why = "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    assert [r.getMessage() for r in caplog.records if r.name == "gpuwatchd.sources.probe"] == [
        f"probe: dropped 1 report(s) (malformed 1); the first, pid 100 (malformed): {why}",
        f"probe: dropped 3 report(s) (malformed 3); the first, pid 100 (malformed): {why}",
    ]


def test_bad_reports_from_many_forked_pids_make_one_line_per_poll(nodes: Any, caplog: Any) -> None:
    """Issue 23, item 8: each forked process sending a bad report made a warning of its
    own (1,068 a second); now one line per poll says how many, by kind."""
    wire = Datagrams()
    node = nodes(two_jobs(), wire, max_report_bytes=256)
    for pid in range(5000, 5500):
        wire.send(pid, b"{not json")
    for pid in range(6000, 6010):
        wire.send(pid, {**GOOD, "pad": "x" * 300})
    m = node.poll(1)
    assert m.node("probe_reports_total", "malformed") == 500
    warnings = [r.getMessage() for r in caplog.records if r.name == "gpuwatchd.sources.probe"]
    assert len(warnings) == 1
    assert warnings[0].startswith("probe: dropped 510 report(s) (malformed 500, too_large 10)")


def test_rate_limit_per_pid(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire, max_reports_per_second=2)
    for i in range(10):
        wire.send(100, {**GOOD, "batches": i})
    wire.send(200, GOOD)  # another pid has its own budget
    m = node.poll(1)
    assert m.node("probe_reports_total", "accepted") == 5  # a burst of twice the rate, + pid 200
    assert m.node("probe_reports_total", "rate_limited") == 6
    assert m.gpu("probe_batches_total", 0) == 3
    for i in range(10, 20):
        wire.send(100, {**GOOD, "batches": i})
    m = node.poll(3)  # 2 s later: 4 more tokens
    assert m.gpu("probe_batches_total", 0) == 13


def test_silent_and_dead_pids_expire(nodes: Any) -> None:
    wire = Datagrams()
    exits = {"name": "exit", "duration": "1m", "host": {"processes": {200: {"running": False}}}}
    node = nodes(two_jobs(None, exits), wire, expire_after=30)
    wire.send(100, GOOD)
    wire.send(200, GOOD)
    assert node.poll(1).node("probe_processes") == 2
    wire.send(200, GOOD)
    m = node.poll(31)  # 100 silent for 30 s: still current
    assert m.node("probe_processes") == 2
    wire.send(200, GOOD)
    m = node.poll(32)
    assert m.node("probe_processes") == 1 and m.gpu("probe_pid", 0) is None
    m = node.poll(41)  # pid 200 exited at 40 s
    assert m.node("probe_processes") == 0 and m.gpu("probe_pid", 2) is None


def test_a_pid_on_no_gpu_is_counted_not_placed(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    (node.sim.root / "proc" / "777").mkdir()
    stat = (node.sim.root / "proc" / "100" / "stat").read_bytes().replace(b"100 (", b"777 (", 1)
    (node.sim.root / "proc" / "777" / "stat").write_bytes(stat)
    wire.send(777, GOOD)
    m = node.poll(1)
    assert m.node("probe_processes") == 1 and m.node("probe_unplaced_processes") == 1
    assert not any(labels for labels in m.by_name.get(P + "probe_pid", {}))


def test_a_report_does_not_land_on_the_next_process_with_its_pid(nodes: Any) -> None:
    """Issue 23, item 8: a report is the process's that sent it (pid + start time); once
    the pid is another process's, the old report is gone, not put on the new one's GPU."""
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    wire.send(200, GOOD)
    assert node.poll(1).gpu("probe_pid", 2) == 200
    node.sim.clock.advance(1)
    node.sim.tick()
    path = node.sim.root / "proc" / "200" / "stat"
    head, _, tail = path.read_bytes().rpartition(b")")
    fields = tail.split(b" ")
    fields[20] = str(int(fields[20]) + 500).encode()  # pid 200 exited, a new one started
    path.write_bytes(head + b")" + b" ".join(fields))
    m = Metrics(node.source.collect())
    assert m.gpu("probe_pid", 2) is None and m.node("probe_processes") == 0
    wire.send(200, GOOD)  # the new process's own report is its own
    assert node.poll(3).gpu("probe_pid", 2) == 200


def test_no_reports_no_nvml(nodes: Any) -> None:
    node = nodes(two_jobs(), Datagrams())
    m = node.poll(1)
    assert m.node("probe_processes") == 0
    assert node.source._placer.nv is None  # nothing to attribute: NVML not even started


def test_a_quiet_poll_hands_back_the_last_samples(nodes: Any) -> None:
    wire = Datagrams()
    node = nodes(two_jobs(), wire)
    first = node.source.collect()
    assert node.source.collect() is first  # nothing came, nobody to expire: not rebuilt
    wire.send(100, b"{not json")
    bad = node.source.collect()
    assert bad is not first and Metrics(bad).node("probe_reports_total", "malformed") == 1
    assert node.source.collect() is bad
    wire.send(100, GOOD)
    placed = node.source.collect()
    assert Metrics(placed).gpu("probe_pid", 0) == 100
    assert node.source.collect() is not placed  # a known pid: placed and expired each poll


class WatchedSocket(ProbeSocket):
    """The daemon's socket, counting the polls that read it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 8192)
        self.reads = 0

    def receive(self, limit: int) -> list[tuple[int, bytes]]:
        self.reads += 1
        return super().receive(limit)


def telling_when_it_rests(poller: Poller) -> threading.Semaphore:
    """Released each time the poller has settled into resting (its lane waits on the
    socket's next datagram): after `rest` returns, not when the socket is first told."""
    resting = threading.Semaphore(0)
    rest = poller.rest

    def rest_and_tell(wake: Any) -> bool:
        idle = rest(wake)
        if idle:
            resting.release()
        return idle

    poller.rest = rest_and_tell  # type: ignore[method-assign]
    return resting


def test_an_idle_probe_lane_sleeps_until_a_datagram_comes(tmp_path: Path) -> None:
    sock = WatchedSocket(tmp_path / "probe.sock")
    config = ProbeConfig(socket=sock.path, interval=0.1)
    source = ProbeSource(config, Context(extras={"probe_receiver": sock}))
    t = [0.0]
    store = Store()
    poller = Poller(source, store, lambda: t[0])
    resting = telling_when_it_rests(poller)
    scheduler = ThreadedScheduler([poller], lanes=LANES)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    scheduler.start()
    try:
        assert resting.acquire(timeout=10)  # polled once, then waits on the socket
        assert sock.reads == 1
        t[0] = 5.0  # past 3 intervals, and no refresh yet (a long evaluation interval):
        assert not store.is_stale("probe", t[0])  # a resting source's series hold
        t[0] = 30.0
        scheduler.check_hung(t[0])  # the evaluation loop keeps them current, as polls would
        assert poller.health.up and poller.health.last_success == 30.0
        assert not store.is_stale("probe", t[0])
        t[0] = 200.0  # its lane should have polled it long since (a thread gone wrong):
        scheduler.check_hung(t[0])  # no more refreshes, and its series go stale
        assert poller.health.last_success == 30.0 and store.is_stale("probe", t[0])
        sender.sendto(b"{not json", str(sock.path))
        assert resting.acquire(timeout=10)  # woken, polled once, resting again
        assert sock.reads == 2
        latest = dict(store.source_latest("probe"))
        assert latest[(REPORTS.name, ("malformed",))] == 1
    finally:
        sender.close()
        scheduler.stop()
        source.close()


@pytest.fixture(scope="module")
def fuzzed_node() -> Any:
    """One node for every fuzzed poll: building a simulated node per example cost most of
    the fuzz's time; what one poll leaves behind is part of what the next must survive."""
    node = Node(two_jobs(), Datagrams(), max_report_bytes=512)
    node.at = 0  # type: ignore[attr-defined]
    yield node
    node.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 400), st.binary(max_size=600)), max_size=20))
def test_fuzz_datagrams_never_break_a_poll(fuzzed_node: Any, datagrams: Any) -> None:
    node = fuzzed_node
    before = node.poll(node.at).by_name.get(P + "probe_reports_total", {})
    node.source._receiver.queue = list(datagrams)  # type: ignore[union-attr]
    node.at += 1
    m = node.poll(node.at)
    counted = sum(m.by_name[P + "probe_reports_total"].values()) - sum(before.values())
    assert counted == len(datagrams)


# -- the simulator's probes -------------------------------------------------------------


def test_simulated_probe_integrates_rates(nodes: Any) -> None:
    values = {
        100: {"step_seconds": 0.25, "wait_fraction": 0.9, "num_workers": 0, "pin_memory": False},
        200: {"cuda_device": 2, "reserved_mib": 1024, "allocated_mib": 512,
              "alloc_retries_per_minute": 6, "cuda_init_seconds": 4.5},
    }  # fmt: skip
    node = nodes(two_jobs(values))
    node.poll(0)
    m = node.poll(60)
    assert m.gpu("probe_batches_total", 0) == 240
    assert m.gpu("probe_wait_seconds_total", 0) == pytest.approx(54)
    assert m.gpu("probe_compute_seconds_total", 0) == pytest.approx(6)
    assert m.gpu("probe_loader_workers", 1) == 0 and m.gpu("probe_loader_pin_memory", 1) == 0
    assert m.gpu("probe_cuda_reserved_bytes", 2) == 1 << 30
    assert m.gpu("probe_cuda_alloc_retries_total", 2) == 6
    assert m.gpu("probe_cuda_init_seconds", 2) == 4.5
    assert m.gpu("probe_loader_workers", 2) is None


def test_a_simulated_node_lets_the_probe_rest_only_where_no_probe_ever_reports() -> None:
    """`run --simulate` as on a real node: without a probing process the lane sleeps."""
    from gpuwatchd.sim.probe import SimProbeReceiver
    from gpuwatchd.sim.scenario import Timeline, load_scenario

    def notify(name: str) -> bool:
        receiver = SimProbeReceiver(Timeline(load_scenario(name)), time.time, lambda: 0.0)
        return receiver.notify(lambda: None)

    assert notify("healthy-8gpu")
    assert not notify("dataloader-workers0-probe-4090")
