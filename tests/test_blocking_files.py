"""Kernel files that would block a poll (a FIFO where a procfs file should be), and a poll
that hangs anyway: the source goes down, never stays stuck, and comes back by itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from series import Clock

from gpuwatchd.config import InterruptsConfig, SourceConfig
from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.scheduler import Poller, ThreadedScheduler
from gpuwatchd.sources import base, infiniband, pcie
from gpuwatchd.sources.base import Context, Source
from gpuwatchd.sources.interrupts import InterruptsSource
from gpuwatchd.store import Store

INTERRUPTS = Path(__file__).parent / "fixtures" / "procfs" / "procfs" / "interrupts"


def eventually(condition: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Bounded polling: `condition` must hold within `within` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within:g}s: {what}"
        time.sleep(0.01)


def release(fifo: Path) -> None:
    """Let a reader stuck opening `fifo` go (opening the write end releases it)."""
    with contextlib.suppress(OSError):  # ENXIO: nobody is stuck on it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def fifo_tree(tmp_path: Path) -> Iterator[Path]:
    """A procfs tree whose `interrupts` is a FIFO (a file nobody ever writes)."""
    fifo = tmp_path / "interrupts"
    os.mkfifo(fifo)
    yield tmp_path
    release(fifo)


def finishes(call: Callable[[], object], within: float = 5.0) -> object:
    """`call`'s result, or a test failure if it is still blocked after `within` seconds."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"still blocked after {within:g}s"
    return result[0]


def test_the_read_helpers_refuse_a_fifo_at_once(fifo_tree: Path) -> None:
    fifo = str(fifo_tree / "interrupts")

    def refused(read: Callable[[str], object]) -> str:
        try:
            read(fifo)
        except OSError as e:
            return str(e.strerror)
        return "read it"

    assert "not a regular file" in str(finishes(lambda: refused(base.read_text)))
    assert finishes(lambda: pcie._read(fifo)) is None
    assert finishes(lambda: infiniband._read(fifo)) is None


def test_read_each_refuses_a_fifo_even_with_data_waiting_in_it(fifo_tree: Path) -> None:
    # the pcie source's files read in one loop: each refused as open_kernel_file refuses
    fifo, regular = fifo_tree / "interrupts", fifo_tree / "speed"
    regular.write_text("16.0 GT/s PCIe\n")
    held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer, and bytes to read
    try:
        os.write(held, b"8.0 GT/s PCIe\n")
        paths = [str(fifo), str(regular), str(fifo_tree / "gone"), "nul\0byte"]
        assert finishes(lambda: base.read_each(paths)) == [None, b"16.0 GT/s PCIe\n", None, None]
    finally:
        os.close(held)


def test_kernel_pseudo_files_still_read(tmp_path: Path) -> None:
    assert base.read_text("/proc/self/stat").split()[0] == str(os.getpid())
    assert base.read_text(str(INTERRUPTS)) == INTERRUPTS.read_text()
    big = tmp_path / "big"
    big.write_bytes(b"x" * 200_000)  # more than one read's worth
    assert len(base.read_text(str(big))) == 200_000


def test_a_fifo_at_a_procfs_path_puts_the_source_down_until_the_file_is_back(
    fifo_tree: Path,
) -> None:
    source = InterruptsSource(
        InterruptsConfig(interval=0.1, timeout=1.0), Context(procfs=fifo_tree)
    )
    store = Store()
    poller = Poller(source, store, time.monotonic)
    scheduler = ThreadedScheduler([poller])
    scheduler.start()
    try:
        eventually(lambda: poller.health.errors_total > 0, "the poll failed")
        assert not poller.health.up
        assert "not a regular file" in (poller.health.last_error or "")
        fifo = fifo_tree / "interrupts"
        fifo.unlink()
        shutil.copy(INTERRUPTS, fifo)  # the file is back
        eventually(lambda: poller.health.up, "the source came back by itself")
    finally:
        release(fifo_tree / "interrupts")
        scheduler.stop()


# -- a poll that hangs anyway (a driver call, a hung mount) --------------------------------

VALUE = gauge("test_value", "which poll produced the sample")


class Sticky(Source):
    """Its first poll hangs until `gate` opens; later polls return at once."""

    name = "sticky"
    metrics = (VALUE,)

    def __init__(self) -> None:
        super().__init__(SourceConfig(interval=0.1, timeout=0.2), Context())
        self.gate = threading.Event()
        self.calls = 0

    def collect(self) -> list[Sample]:
        self.calls += 1
        if self.calls == 1:
            self.gate.wait()
            return [Sample(VALUE.name, (), 1.0)]  # late: given up on, must be dropped
        return [Sample(VALUE.name, (), 2.0)]


def source_threads(name: str) -> int:
    return sum(t.name == f"source-{name}" for t in threading.enumerate())


def test_a_poll_stuck_past_abandon_after_is_replaced_once() -> None:
    source, store, clock = Sticky(), Store(), Clock()
    poller = Poller(source, store, clock)
    scheduler = ThreadedScheduler([poller], abandon_after=30)
    scheduler.start()
    try:
        eventually(lambda: source.calls == 1, "the first poll started")
        clock.t = 29
        scheduler.check_hung(clock())
        assert not poller.health.up and source_threads("sticky") == 1  # down, still waited on
        clock.t = 31
        scheduler.check_hung(clock())  # given up on: a fresh thread polls
        eventually(lambda: poller.health.up, "the fresh thread's poll succeeded")
        assert store.source_latest("sticky") == [((VALUE.name, ()), 2.0)]
        assert poller.abandoned == 1
        source.gate.set()  # the stuck call returns at last: too late to count
        eventually(lambda: poller.abandoned == 0, "the abandoned thread ended")
        assert store.source_latest("sticky") == [((VALUE.name, ()), 2.0)]
        eventually(lambda: source_threads("sticky") == 1, "it stopped polling")
    finally:
        source.gate.set()
        scheduler.stop()


def test_at_most_one_stuck_thread_is_left_behind() -> None:
    class Stuck(Sticky):
        def collect(self) -> list[Sample]:
            self.calls += 1
            self.gate.wait()  # every call hangs (a GPU whose every call blocks)
            return []

    source, clock = Stuck(), Clock()
    poller = Poller(source, Store(), clock)
    scheduler = ThreadedScheduler([poller], abandon_after=30)
    scheduler.start()
    try:
        eventually(lambda: source.calls == 1, "the first poll started")
        clock.t = 31
        scheduler.check_hung(clock())
        eventually(lambda: source.calls == 2, "one replacement")
        for t in (62, 93, 1000):  # stuck for many more abandon_after periods
            clock.t = t
            scheduler.check_hung(clock())
        assert source_threads("sticky") == 2 and poller.abandoned == 1
        assert not poller.health.up
    finally:
        source.gate.set()
        scheduler.stop()
