"""The only shared state: the latest sample per series, a bounded history, staleness.

Each source replaces its whole set of series on every successful poll, so a series a
source stops reporting (a GPU lost, a function found unsupported) disappears at once
and its history is freed: memory follows the number of live series, not uptime.

History is kept in flat arrays of doubles (16 bytes a point) rather than a deque of
tuples (about 110 bytes a point), and only for the families a rule's window function
reads (`keep_history`; every family until it is called): the others keep their latest
value only.
"""

from __future__ import annotations

import math
import threading
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

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

    def values_since(self, since: float) -> tuple[float, float, array[float]]:
        """(times of the first and of the last point newer than `since`, inf if none;
        the values from the first on)."""
        first = bisect_left(self._times, since, lo=self._start)
        if first == len(self._times):
            return math.inf, math.inf, self._values[first:]
        return self._times[first], self._times[-1], self._values[first:]

    def __len__(self) -> int:
        return len(self._times) - self._start


class Series:
    __slots__ = ("value", "history")

    def __init__(self, value: float, history: History | None) -> None:
        self.value = value
        self.history = history  # None: no window reads this family


@dataclass
class SourceSeries:
    keys: set[SeriesKey]
    updated_at: float | None = None
    generation: int = 0  # bumped by every update, so readers can tell new data from old
    stale_after: float = float("inf")
    # the last updates' changes: (generation, the series whose value changed, came or went);
    # enough of them to span a 30 s scrape interval of a source polled every second
    log: deque[tuple[int, list[SeriesKey]]] = field(default_factory=lambda: deque(maxlen=32))
    order: list[tuple[SeriesKey, Series]] = field(default_factory=list)  # the last update's
    # the last update's names, labels and values, each a tuple in its order: the usual
    # poll (the same series again) is told by two tuple comparisons made in C
    names: tuple[str, ...] = ()
    labels: tuple[tuple[str, ...], ...] = ()
    values: tuple[float, ...] = ()
    histories: list[tuple[int, History]] = field(default_factory=list)  # (place, its history)


class Store:
    def __init__(self, history_seconds: float = 600.0, max_points: int = 3600) -> None:
        self._history_seconds = history_seconds
        self._max_points = max_points
        self._series: dict[SeriesKey, Series] = {}
        self._sources: dict[str, SourceSeries] = {}
        self._windowed: frozenset[str] | None = None  # families with history; None: all
        self._lock = threading.Lock()

    def keep_history(self, names: Iterable[str]) -> None:
        """Keep history only for these families (what window functions read); the
        history of every other series is dropped."""
        with self._lock:
            self._windowed = windowed = frozenset(names)
            for (name, _), series in self._series.items():
                if name not in windowed:
                    series.history = None
                elif series.history is None:
                    series.history = History()
            for owned in self._sources.values():
                owned.histories = _histories(owned.order)

    def register_source(self, source: str, stale_after: float) -> None:
        with self._lock:
            self._sources.setdefault(source, SourceSeries(set())).stale_after = stale_after

    def update(self, source: str, now: float, samples: Iterable[Sample]) -> None:
        """Replace `source`'s series with `samples`, taken at `now`."""
        samples = samples if isinstance(samples, list) else list(samples)
        names, labels, values = zip(*samples, strict=True) if samples else ((), (), ())
        with self._lock:
            owned = self._sources.setdefault(source, SourceSeries(set()))
            changed: list[SeriesKey] = []
            horizon = now - self._history_seconds
            if names != owned.names or labels != owned.labels:
                self._replace(owned, samples, now, changed)
                owned.names, owned.labels = names, labels
                owned.histories = _histories(owned.order)
            else:  # the usual poll: the same series in the same order, new values
                if values != owned.values:
                    order, before = owned.order, owned.values
                    for i in [i for i, value in enumerate(values) if value != before[i]]:
                        key, series = order[i]
                        series.value = values[i]
                        changed.append(key)
                max_points = self._max_points
                for i, history in owned.histories:
                    history.append(now, values[i], horizon, max_points)
            owned.values = values
            owned.updated_at = now
            owned.generation += 1
            owned.log.append((owned.generation, changed))

    def _replace(
        self, owned: SourceSeries, samples: list[Sample], now: float, changed: list[SeriesKey]
    ) -> None:
        fresh: set[SeriesKey] = set()
        order: list[tuple[SeriesKey, Series]] = []
        horizon = now - self._history_seconds
        max_points, windowed, known = self._max_points, self._windowed, self._series
        for name, labels, value in samples:
            key = (name, labels)
            fresh.add(key)
            series = known.get(key)
            if series is None:
                keep = windowed is None or name in windowed
                series = known[key] = Series(value, History() if keep else None)
                changed.append(key)
            elif series.value != value:
                series.value = value
                changed.append(key)
            if series.history is not None:
                series.history.append(now, value, horizon, max_points)
            order.append((key, series))
        for gone in owned.keys - fresh:
            known.pop(gone, None)
            changed.append(gone)
        owned.keys, owned.order = fresh, order

    def is_stale(self, source: str, now: float) -> bool:
        owned = self._sources.get(source)
        if owned is None or owned.updated_at is None:
            return True
        return now - owned.updated_at > owned.stale_after

    def version(self, source: str, now: float) -> tuple[int, bool]:
        """Changes whenever a source's visible series may have: (updates so far, stale)."""
        owned = self._sources.get(source)
        return (0 if owned is None else owned.generation, self.is_stale(source, now))

    def changes(self, source: str, since: int) -> list[tuple[SeriesKey, float | None]] | None:
        """The series of `source` whose value changed, came or went (None) in its updates
        after generation `since`, with their values now; None if those are no longer
        known (more updates since than are remembered): read it all again."""
        with self._lock:
            owned = self._sources.get(source)
            if owned is None or not owned.log or owned.log[0][0] > since + 1:
                return None
            log = owned.log
            start = len(log)  # the first update after `since`: usually the last one
            while start and log[start - 1][0] > since:
                start -= 1
            keys = {key for _, changed in islice(log, start, None) for key in changed}
            known = self._series
            return [(key, known[key].value if key in known else None) for key in keys]

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
            if series is None or series.history is None:
                return []
            return series.history.since(since)

    def window_values(
        self, name: str, labels: tuple[str, ...], since: float
    ) -> tuple[float, float, Sequence[float]]:
        """window()'s values alone, and the times of its first and last points (inf:
        none)."""
        with self._lock:
            series = self._series.get((name, labels))
            if series is None or series.history is None:
                return math.inf, math.inf, ()
            return series.history.values_since(since)

    def series_count(self) -> int:
        with self._lock:
            return len(self._series)


def _histories(order: list[tuple[SeriesKey, Series]]) -> list[tuple[int, History]]:
    """The places in a source's order of the series that keep a history."""
    return [(i, s.history) for i, (_, s) in enumerate(order) if s.history is not None]
