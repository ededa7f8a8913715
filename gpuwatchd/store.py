"""The only shared state: the latest sample per series, a bounded history, staleness.

Each source replaces its whole set of series on every successful poll, so a series a
source stops reporting (a GPU lost, a function found unsupported) disappears at once
and its history is freed: memory follows the number of live series, not uptime.

History is kept in flat arrays of doubles (16 bytes a point) rather than a deque of
tuples (about 110 bytes a point): ten minutes of history for a big 8-GPU host is some
380 000 points, 40 MB as tuples, 6 MB as arrays.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from gpuwatchd.metrics import Sample

SeriesKey = tuple[str, tuple[str, ...]]


class History:
    """(timestamp, value) points, oldest first, trimmed to a horizon and a point cap."""

    __slots__ = ("_times", "_values", "_start")

    def __init__(self) -> None:
        self._times = array("d")
        self._values = array("d")
        self._start = 0  # points before it are expired; compacted when half are

    def append(self, t: float, value: float, horizon: float, max_points: int) -> None:
        self._times.append(t)
        self._values.append(value)
        times, start = self._times, self._start
        end = len(times)
        start = max(start, end - max_points)
        while start < end and times[start] < horizon:
            start += 1
        if start > end // 2:
            del self._times[:start], self._values[:start]
            start = 0
        self._start = start

    def since(self, since: float) -> list[tuple[float, float]]:
        first = bisect_left(self._times, since, lo=self._start)
        return list(zip(self._times[first:], self._values[first:], strict=True))

    def __len__(self) -> int:
        return len(self._times) - self._start


@dataclass
class Series:
    value: float
    timestamp: float
    history: History = field(repr=False, default_factory=History)


@dataclass
class SourceSeries:
    keys: set[SeriesKey] = field(default_factory=set)
    updated_at: float | None = None
    generation: int = 0  # bumped by every update, so readers can tell new data from old
    stale_after: float = float("inf")


class Store:
    def __init__(self, history_seconds: float = 600.0, max_points: int = 3600) -> None:
        self._history_seconds = history_seconds
        self._max_points = max_points
        self._series: dict[SeriesKey, Series] = {}
        self._sources: dict[str, SourceSeries] = {}
        self._lock = threading.Lock()

    def register_source(self, source: str, stale_after: float) -> None:
        with self._lock:
            self._sources.setdefault(source, SourceSeries()).stale_after = stale_after

    def update(self, source: str, now: float, samples: Iterable[Sample]) -> None:
        """Replace `source`'s series with `samples`, taken at `now`."""
        with self._lock:
            owned = self._sources.setdefault(source, SourceSeries())
            fresh: set[SeriesKey] = set()
            horizon = now - self._history_seconds
            for name, labels, value in samples:
                key = (name, labels)
                fresh.add(key)
                series = self._series.get(key)
                if series is None:
                    series = Series(value, now)
                    self._series[key] = series
                series.value, series.timestamp = value, now
                series.history.append(now, value, horizon, self._max_points)
            for gone in owned.keys - fresh:
                self._series.pop(gone, None)
            owned.keys = fresh
            owned.updated_at = now
            owned.generation += 1

    def is_stale(self, source: str, now: float) -> bool:
        owned = self._sources.get(source)
        if owned is None or owned.updated_at is None:
            return True
        return now - owned.updated_at > owned.stale_after

    def version(self, source: str, now: float) -> tuple[int, bool]:
        """Changes whenever a source's visible series may have: (updates so far, stale)."""
        owned = self._sources.get(source)
        return (0 if owned is None else owned.generation, self.is_stale(source, now))

    def sources(self) -> list[str]:
        with self._lock:
            return list(self._sources)

    def source_latest(self, source: str) -> list[tuple[SeriesKey, float]]:
        """The live series of one source (stale or not), with their latest values."""
        with self._lock:
            owned = self._sources.get(source)
            if owned is None:
                return []
            return [(key, self._series[key].value) for key in owned.keys]

    def latest(self, now: float) -> Iterator[tuple[SeriesKey, float]]:
        """Every live series of every source that is not stale, as of `now`."""
        with self._lock:
            rows = [
                ((key, self._series[key].value))
                for source, owned in self._sources.items()
                if not self.is_stale(source, now)
                for key in owned.keys
            ]
        return iter(rows)

    def get(self, name: str, labels: tuple[str, ...]) -> float | None:
        with self._lock:
            series = self._series.get((name, labels))
            return None if series is None else series.value

    def window(self, name: str, labels: tuple[str, ...], since: float) -> list[tuple[float, float]]:
        """(timestamp, value) points of one series newer than `since`, oldest first."""
        with self._lock:
            series = self._series.get((name, labels))
            if series is None:
                return []
            return series.history.since(since)

    def series_count(self) -> int:
        with self._lock:
            return len(self._series)
