"""Polling: each source on its own interval, in its lane's thread, judged against a timeout.

A blocked C call (NVML when a GPU falls off the bus) cannot be cancelled from Python,
so a hung poll is not interrupted: the poller reports it down once the timeout passes
and the store lets its series go stale. Nothing else waits on it: the sources that can
block have threads of their own (`LANES`), the evaluation loop another, and scrapes
read cached bytes. A poll still stuck after `abandon_after` is given up on: a fresh
thread polls the source's lane (so it recovers by itself once its input answers again)
and the stuck call's result, if it ever comes, is dropped. One stuck thread per source
at most is left behind: while it has not returned, the source is not given up on again.

A source that waits on its input (the probe's socket) may rest between polls while it
has nothing to read and nothing that changes with time (`Poller.rest`): its lane's
thread sleeps until the input comes, and the evaluation loop keeps its series current
meanwhile (`Poller.refresh`), as polls that find nothing new would.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuwatchd.metrics import Sample
from gpuwatchd.sources.base import Source
from gpuwatchd.store import Store

log = logging.getLogger(__name__)


@dataclass
class Health:
    up: bool = False
    duration: float = 0.0
    last_success: float | None = None
    errors_total: int = 0
    last_error: str | None = None


class Poller:
    """Runs one source once at a time; keeps its health; logs changes, not repeats."""

    def __init__(self, source: Source, store: Store, now: Callable[[], float]) -> None:
        self.source = source
        self.name = source.name
        self.health = Health()
        self._store = store
        self._now = now
        self._in_flight_since: float | None = None
        self._hang_reported = False
        self._lock = threading.Lock()
        self._current = 0  # the poll whose result counts; abandoning one moves past it
        self.abandoned = 0  # polls given up on whose calls have not returned yet
        # a source that can rest on its input has `idle(wake) -> bool`: True if the series
        # of its last poll stay as they are until input comes (it then calls `wake`, once)
        self._idle: Callable[[Callable[[], None]], bool] | None = getattr(source, "idle", None)
        self._resting: list[Sample] | None = None
        self._last: list[Sample] = []
        self._polled_at = 0.0  # when its last successful poll read
        self.retime(source.config.interval, source.config.timeout)

    def retime(self, interval: float, timeout: float) -> None:
        """Poll every `interval`, judge hung after `timeout` (at start, and on a reload)."""
        self.interval, self.timeout = interval, timeout
        self._judge_stale(resting=self._resting is not None)

    def _judge_stale(self, resting: bool) -> None:
        """Series go stale a few intervals after the last poll; while the source rests, once
        its lane should have polled it again (within REST_AT_MOST) however seldom the
        evaluation loop refreshes it."""
        interval, timeout = self.interval, self.timeout
        after = (
            REST_AT_MOST + interval + timeout if resting else max(3 * interval, interval + timeout)
        )
        self._store.register_source(self.name, stale_after=after)

    def poll(self) -> bool:
        """Poll once; False if the poll was given up on while it ran (result dropped)."""
        with self._lock:
            self._current += 1
            mine = self._current
            if self._resting is not None:
                self._resting = None
                self._judge_stale(resting=False)
        started = self._now()
        self._in_flight_since = started
        cpu0 = time.perf_counter()
        samples: list[Sample] = []
        error: Exception | None = None
        try:
            samples = self.source.collect()
        except Exception as e:  # a broken source must never take the daemon down
            error = e
        with self._lock:
            if mine != self._current:  # abandoned while stuck: too late to count
                self.abandoned -= 1
                return False
        # stamped when read, not when asked: a slow poll must not expire its own samples
        read_at = self._now()
        if error is not None:
            why = getattr(error, "samples", None)  # a SourceError that says why, as series
            if isinstance(why, list):
                self._store.update(self.name, read_at, why)
            kind = type(error).__name__
            self._failed(f"{kind}: {error}" if str(error) else kind)
        else:
            self._store.update(self.name, read_at, samples)
            if self._idle is not None:
                self._last, self._polled_at = samples, read_at
            if not self.health.up and self.health.last_error is not None:
                log.info("source %s: recovered", self.name)
            self.health.up, self.health.last_error = True, None
            self.health.last_success = read_at
        self.health.duration = time.perf_counter() - cpu0
        self._in_flight_since = None
        self._hang_reported = False
        return True

    def rest(self, wake: Callable[[], None]) -> bool:
        """After a successful poll: True if the source has nothing to read until its input
        comes (it then calls `wake`), so that its lane may sleep until then instead of
        polling; while it rests, `refresh` keeps its series current."""
        with self._lock:  # a refresh sees it resting once its input may wake it
            try:
                idle = self._idle is not None and self.health.up and self._idle(wake)
            except Exception:  # cannot tell: polled as any source is
                log.exception("source %s: cannot rest", self.name)
                idle = False
            if not idle:
                return False
            self._resting = self._last
            self._judge_stale(resting=True)
        return True

    def refresh(self) -> None:
        """A resting source's series, stored as current now, about as often as it would
        be polled: a poll would find the same (no input came) and nothing to expire."""
        if self._resting is None:  # not resting (read again under the lock)
            return
        with self._lock:
            now, last = self._now(), self.health.last_success
            if self._resting is None or last is None or now - last < self.interval / 2:
                return
            if now - self._polled_at > REST_AT_MOST + self.interval:
                return  # its lane should have polled it by now: let it go stale
            self._store.update(self.name, now, self._resting)
            self.health.last_success = now

    def check_hung(self, now: float) -> None:
        """Mark the source down (once) if its current poll has outlived the timeout, or
        if it has not been polled for so long that its series are stale (its thread is
        held up by another source of its lane)."""
        since = self._in_flight_since
        if since is not None and now - since > self.timeout and not self._hang_reported:
            self._hang_reported = True
            self._failed(f"poll has not returned after {self.timeout:g}s")
            self.health.duration = now - since
        elif since is None and self.health.up and self._store.is_stale(self.name, now):
            self._failed("not polled: its thread is held up by a poll of another source")

    def judge(self, now: float, abandon_after: float) -> bool:
        """Each evaluation cycle: keep a resting source's series current, mark a hung or
        held-up source down; True if its poll in flight is given up on (`abandon_if_stuck`)."""
        self.refresh()
        self.check_hung(now)
        return self._in_flight_since is not None and self.abandon_if_stuck(now, abandon_after)

    def abandon_if_stuck(self, now: float, after: float) -> bool:
        """Give up on a poll in flight for longer than `after` (and the timeout), unless
        one given up on earlier has still not returned; True if it was given up on."""
        since = self._in_flight_since
        with self._lock:
            if since is None or now - since <= max(after, self.timeout) or self.abandoned:
                return False
            self._current += 1
            self.abandoned += 1
        self._in_flight_since = None
        stuck = now - since
        log.warning(
            "source %s: poll stuck for %.0fs; polling from a fresh thread", self.name, stuck
        )
        return True

    def _failed(self, reason: str) -> None:
        if reason != self.health.last_error:
            log.warning("source %s: down: %s", self.name, reason)
        self.health.up, self.health.last_error = False, reason
        self.health.errors_total += 1  # last: a reader who sees the count sees why


ABANDON_AFTER = 60.0  # seconds a poll may hang before a fresh thread takes over


# Threads of the daemon's sources, by source: a source that calls a library that can
# block (NVML on a GPU gone bad inside the driver, DCGM on a hung nv-hostengine) or that
# waits on its input (the probe's socket) has one of its own, so that nothing else waits
# with it; the processes source shares NVML's (it reads NVML's process lists, polled just
# before it); every other source reads kernel files and they share one.
LANES = {"nvml": "nvml", "processes": "nvml", "dcgm": "dcgm", "probe": "probe"}
HOST_LANE = "host"
# a resting source is polled at least this often all the same (were its input's
# thread ever to die, what came would be read by then)
REST_AT_MOST = 60.0


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the kernel too (/proc/PID/task/TID/comm, top -H,
    py-spy), cut to its 15 bytes; quietly nothing where that cannot be done."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class ThreadedScheduler:
    """Real time: a daemon thread per lane of sources, each source polled on its own
    interval (and a fresh thread for a lane whose poll is stuck). `lanes` maps a source
    to its lane, the others to HOST_LANE; without it every source has a lane of its own.
    A lane of one source that rests (`Poller.rest`) sleeps until its input comes, and is
    then polled on its interval again: at most once an interval, however much comes.
    """

    def __init__(
        self,
        pollers: list[Poller],
        abandon_after: float = ABANDON_AFTER,
        lanes: Mapping[str, str] | None = None,
    ) -> None:
        self.pollers = pollers
        self.abandon_after = abandon_after
        self._stop = threading.Event()
        # each live lane thread, and the event that wakes it from a rest (stop() sets it)
        self._threads: dict[threading.Thread, threading.Event] = {}
        self._lanes: dict[str, list[Poller]] = {}
        self._lane_of: dict[str, str] = {}
        for poller in pollers:
            lane = poller.name if lanes is None else lanes.get(poller.name, HOST_LANE)
            self._lanes.setdefault(lane, []).append(poller)
            self._lane_of[poller.name] = lane

    def start(self) -> None:
        for lane in self._lanes:
            self._spawn(lane)

    def _spawn(self, lane: str) -> None:
        wake = threading.Event()  # a resting source's input came, or stop()
        thread = threading.Thread(
            target=self._loop,
            args=(self._lanes[lane], wake),
            name=f"source-{lane}",
            daemon=True,
        )
        thread.start()
        alive = {t: w for t, w in self._threads.items() if t.is_alive()}
        self._threads = {**alive, thread: wake}  # a new dict: stop() may be iterating

    def _loop(self, pollers: list[Poller], wake: threading.Event) -> None:
        name_os_thread(threading.current_thread().name)
        start = time.monotonic()
        next_at = [start] * len(pollers)
        while not self._stop.is_set():
            polled = False
            for i, poller in enumerate(pollers):
                if next_at[i] > time.monotonic():
                    continue
                if not poller.poll():
                    return  # given up on while stuck: a fresh thread polls its lane now
                polled = True
                next_at[i] += poller.interval
                now = time.monotonic()
                if next_at[i] < now:  # fell behind (slow or hung poll): skip, don't burst
                    next_at[i] = now + poller.interval
            wake.clear()
            if self._stop.is_set():
                break
            if polled and len(pollers) == 1 and pollers[0].rest(wake.set):
                wake.wait(REST_AT_MOST)  # then polled when due: an interval after the last
            self._stop.wait(max(0.0, min(next_at) - time.monotonic()))

    def check_hung(self, now: float) -> None:
        """Judge every poll in flight; a stuck one past `abandon_after` gets a fresh thread.
        (Each evaluation cycle: keeps resting sources current first.)"""
        for poller in self.pollers:
            if poller.judge(now, self.abandon_after):
                self._spawn(self._lane_of[poller.name])

    def stop(self, join_timeout: float = 1.0) -> None:
        self._stop.set()
        for wake in self._threads.values():
            wake.set()
        for thread in self._threads:
            thread.join(join_timeout)  # a thread stuck in a C call is a daemon; let it be


class SteppedScheduler:
    """Virtual time: polls every source that is due, in order, on the caller's thread."""

    def __init__(self, pollers: list[Poller]) -> None:
        self.pollers = pollers
        self._next_due = {p.name: float("-inf") for p in pollers}

    def due(self, now: float) -> set[str]:
        """The sources `run_due(now)` will poll."""
        return {name for name, at in self._next_due.items() if at <= now}

    def run_due(self, now: float) -> None:
        for poller in self.pollers:
            if self._next_due[poller.name] <= now:
                poller.poll()
                self._next_due[poller.name] = now + poller.interval
