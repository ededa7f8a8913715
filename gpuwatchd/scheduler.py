"""Polling: each source on its own interval, in its own thread, judged against a timeout.

A blocked C call (NVML when a GPU falls off the bus) cannot be cancelled from Python,
so a hung poll is not interrupted: the poller reports it down once the timeout passes,
never starts a second call beside it, and the store lets its series go stale. Nothing
else waits on it: other sources have their own threads and scrapes read cached bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
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
        self.interval = source.config.interval
        self.timeout = source.config.timeout
        self.health = Health()
        self._store = store
        self._now = now
        self._in_flight_since: float | None = None
        self._hang_reported = False
        store.register_source(
            self.name, stale_after=max(3 * self.interval, self.interval + self.timeout)
        )

    def poll(self) -> None:
        started = self._now()
        self._in_flight_since = started
        cpu0 = time.perf_counter()
        try:
            samples: list[Sample] = self.source.collect()
        except Exception as e:  # a broken source must never take the daemon down
            why = getattr(e, "samples", None)  # a SourceError that says why, as series
            if isinstance(why, list):
                self._store.update(self.name, started, why)
            self._failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        else:
            self._store.update(self.name, started, samples)
            if not self.health.up and self.health.last_error is not None:
                log.info("source %s: recovered", self.name)
            self.health.up, self.health.last_error = True, None
            self.health.last_success = started
        finally:
            self.health.duration = time.perf_counter() - cpu0
            self._in_flight_since = None
            self._hang_reported = False

    def check_hung(self, now: float) -> None:
        """Mark the source down (once) if its current poll has outlived the timeout."""
        since = self._in_flight_since
        if since is not None and now - since > self.timeout and not self._hang_reported:
            self._hang_reported = True
            self._failed(f"poll has not returned after {self.timeout:g}s")
            self.health.duration = now - since

    def _failed(self, reason: str) -> None:
        self.health.errors_total += 1
        if reason != self.health.last_error:
            log.warning("source %s: down: %s", self.name, reason)
        self.health.up, self.health.last_error = False, reason


class ThreadedScheduler:
    """Real time: one daemon thread per source."""

    def __init__(self, pollers: list[Poller]) -> None:
        self.pollers = pollers
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for poller in self.pollers:
            thread = threading.Thread(
                target=self._loop, args=(poller,), name=f"source-{poller.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _loop(self, poller: Poller) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            poller.poll()
            next_at += poller.interval
            now = time.monotonic()
            if next_at < now:  # fell behind (slow or hung poll): skip, don't burst
                next_at = now + poller.interval
            self._stop.wait(next_at - now)

    def stop(self, join_timeout: float = 1.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(join_timeout)  # a thread stuck in a C call is a daemon; let it be


class SteppedScheduler:
    """Virtual time: polls every source that is due, in order, on the caller's thread."""

    def __init__(self, pollers: list[Poller]) -> None:
        self.pollers = pollers
        self._next_due = {p.name: float("-inf") for p in pollers}

    def run_due(self, now: float) -> None:
        for poller in self.pollers:
            if self._next_due[poller.name] <= now:
                poller.poll()
                self._next_due[poller.name] = now + poller.interval
