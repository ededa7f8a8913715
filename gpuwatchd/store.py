"""The only shared state: the latest sample per series, a bounded history, staleness.

Each source replaces its whole set of series on every successful poll, so a series a
source stops reporting (a GPU lost, a function found unsupported) disappears at once
and its history is freed: memory follows the number of live series, not uptime.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from gpuwatchd.metrics import Sample

SeriesKey = tuple[str, tuple[str, ...]]


@dataclass
class Series:
    value: float
    timestamp: float
    history: deque[tuple[float, float]] = field(repr=False)


@dataclass
class SourceSeries:
    keys: set[SeriesKey] = field(default_factory=set)
    updated_at: float | None = None
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
                    series = Series(value, now, deque(maxlen=self._max_points))
                    self._series[key] = series
                series.value, series.timestamp = value, now
                history = series.history
                history.append((now, value))
                while history[0][0] < horizon:
                    history.popleft()
            for gone in owned.keys - fresh:
                self._series.pop(gone, None)
            owned.keys = fresh
            owned.updated_at = now

    def is_stale(self, source: str, now: float) -> bool:
        owned = self._sources.get(source)
        if owned is None or owned.updated_at is None:
            return True
        return now - owned.updated_at > owned.stale_after

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
            return [point for point in series.history if point[0] >= since]

    def series_count(self) -> int:
        with self._lock:
            return len(self._series)
