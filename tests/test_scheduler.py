"""The threads the sources poll in: one per lane (NVML's, DCGM's, the probe's, the rest)."""

from __future__ import annotations

import threading

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.scheduler import HOST_LANE, LANES, Poller, SteppedScheduler, ThreadedScheduler
from gpuwatchd.sources.base import Context, Source
from gpuwatchd.store import Store

WAIT = 10.0  # bound on every real-time wait


def counting(name: str, interval: float) -> type[Source]:
    class Counting(Source):
        metrics = ()

        def __init__(self) -> None:
            super().__init__(SourceConfig(interval=interval, timeout=5), Context())
            self.polled = threading.Semaphore(0)
            self.threads: set[str] = set()

        def collect(self) -> list[Sample]:
            self.threads.add(threading.current_thread().name)
            self.polled.release()
            return []

    Counting.name = name
    return Counting


def test_sources_share_their_lanes_thread_each_on_its_own_interval():
    store = Store()
    sources = {
        name: counting(name, interval)()
        for name, interval in (
            ("nvml", 0.1), ("processes", 0.2), ("cpu", 0.1), ("disks", 0.2), ("dcgm", 0.1)
        )
    }
    scheduler = ThreadedScheduler(
        [Poller(s, store, lambda: 0.0) for s in sources.values()], lanes=LANES
    )
    scheduler.start()
    try:
        for source in sources.values():
            for _ in range(3):  # each polled again and again, in its lane's thread
                assert source.polled.acquire(timeout=WAIT)
    finally:
        scheduler.stop()
    lanes = {name: source.threads for name, source in sources.items()}
    assert lanes == {
        "nvml": {"source-nvml"}, "processes": {"source-nvml"},
        "cpu": {f"source-{HOST_LANE}"}, "disks": {f"source-{HOST_LANE}"},
        "dcgm": {"source-dcgm"},
    }  # fmt: skip


def test_without_lanes_every_source_has_a_thread_of_its_own():
    store = Store()
    sources = [counting(name, 0.1)() for name in ("a", "b")]
    scheduler = ThreadedScheduler([Poller(s, store, lambda: 0.0) for s in sources])
    scheduler.start()
    try:
        for source in sources:
            assert source.polled.acquire(timeout=WAIT)
    finally:
        scheduler.stop()
    assert [s.threads for s in sources] == [{"source-a"}, {"source-b"}]


def test_stepped_scheduler_says_who_is_due():
    store = Store()
    fast, slow = counting("fast", 1)(), counting("slow", 5)()
    scheduler = SteppedScheduler([Poller(s, store, lambda: 0.0) for s in (fast, slow)])
    assert scheduler.due(0) == {"fast", "slow"}
    scheduler.run_due(0)
    assert scheduler.due(1) == {"fast"} and scheduler.due(5) == {"fast", "slow"}


def test_a_source_held_up_behind_a_stuck_one_is_reported_down():
    store = Store()
    source = counting("processes", 5)()
    poller = Poller(source, store, lambda: 0.0)
    poller.poll()
    poller.check_hung(10.0)
    assert poller.health.up  # polled 10 s ago: not stale yet (15 s)
    poller.check_hung(16.0)  # its lane's thread never came back to it
    assert not poller.health.up
    assert "its thread is held up by a poll of another source" in str(poller.health.last_error)
