"""The only shared state: the latest sample per series, a bounded history, staleness.

Each source replaces its whole set of series on every successful poll, so a series a
source stops reporting (a GPU lost, a function found unsupported) disappears at once
and its history is freed: memory follows the number of live series, not uptime.

History is kept in flat arrays of doubles rather than a deque of tuples (about 110
bytes a point), and only for the families a rule's window function reads
(`keep_history`; every family until it is called): the others keep their latest value
only. The histories one update of a source made share an `Axis`, one array of times and
one of values row by row (8 bytes a point and 8 a row), so that an update adds a row
with one call, not a point with a call for each history. A series is one source's (the
built-in sources' families are disjoint: tests/test_store.py): an axis is written by the
source whose update made it, and a series' changes are told in its source's log.
"""

from __future__ import annotations

import math
import threading
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice
from operator import itemgetter, ne

from gpuwatchd.metrics import Sample

SeriesKey = tuple[str, tuple[str, ...]]


class Axis:
    """The points of the histories one update of a source made: they take a point at the
    same updates from then on, so they share one array of times and one of values, a row
    (a value a history) per point, trimmed to a horizon and a point cap at once."""

    __slots__ = ("times", "values", "start", "width")

    def __init__(self, width: int = 0) -> None:
        self.times = array("d")
        self.values = array("d")
        self.start = 0  # rows before it are expired; compacted when half are
        self.width = width

    def append(self, t: float, row: Sequence[float], horizon: float, max_points: int) -> None:
        times = self.times
        times.append(t)
        self.values.extend(row)
        start, end = self.start, len(times)
        start = max(start, end - max_points)
        while start < end and times[start] < horizon:
            start += 1
        if start > end // 2:
            del times[:start], self.values[: start * self.width]
            start = 0
        self.start = start

    def keep(self, histories: list[History]) -> Axis:
        """A new axis with these histories' points alone, the histories moved to it."""
        kept = Axis(len(histories))
        kept.times = times = self.times[self.start :]
        kept.values = array("d", bytes(8 * len(times) * kept.width))
        first, width = self.start * self.width, self.width
        for column, history in enumerate(histories):
            kept.values[column :: kept.width] = self.values[first + history.column :: width]
            history.axis, history.column = kept, column
        return kept


class History:
    """(timestamp, value) points of one series, oldest first: a column of its axis."""

    __slots__ = ("axis", "column")

    def __init__(self, axis: Axis, column: int) -> None:
        self.axis = axis
        self.column = column

    def since(self, since: float) -> list[tuple[float, float]]:
        axis = self.axis
        first = bisect_left(axis.times, since, lo=axis.start)
        values = axis.values[first * axis.width + self.column :: axis.width]
        return list(zip(axis.times[first:], values, strict=True))

    def values_since(self, since: float) -> tuple[float, float, array[float]]:
        """(times of the first and of the last point newer than `since`, inf if none;
        the values from the first on)."""
        axis = self.axis
        times = axis.times
        first = bisect_left(times, since, lo=axis.start)
        values = axis.values[first * axis.width + self.column :: axis.width]
        if first == len(times):
            return math.inf, math.inf, values
        return times[first], times[-1], values

    def __len__(self) -> int:
        return len(self.axis.times) - self.axis.start


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
    # the axes of its histories, each with what picks its row out of an update's values
    axes: list[tuple[Axis, Callable[[tuple[float, ...]], Sequence[float]]]] = field(
        default_factory=list
    )


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
            for owned in self._sources.values():
                born = Axis()  # the source's series that take a history now
                for (name, _), series in owned.order:
                    if name not in windowed:
                        series.history = None
                    elif series.history is None:
                        series.history = History(born, born.width)
                        born.width += 1
                owned.axes = _axes(owned.order)

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
                self._replace(owned, samples, changed)
                owned.names, owned.labels = names, labels
                owned.axes = _axes(owned.order)
            else:  # the usual poll: the same series in the same order, new values
                if values != owned.values:
                    order = owned.order  # the places that changed, found in C
                    for i in compress(range(len(values)), map(ne, values, owned.values)):
                        key, series = order[i]
                        series.value = values[i]
                        changed.append(key)
            max_points = self._max_points
            for axis, row in owned.axes:
                axis.append(now, row(values), horizon, max_points)
            owned.values = values
            owned.updated_at = now
            owned.generation += 1
            owned.log.append((owned.generation, changed))

    def _replace(
        self, owned: SourceSeries, samples: list[Sample], changed: list[SeriesKey]
    ) -> None:
        """A source's series replaced; their histories take this update's point after."""
        fresh: set[SeriesKey] = set()
        order: list[tuple[SeriesKey, Series]] = []
        windowed, known = self._windowed, self._series
        born = Axis()  # the histories of the series new in this update
        for name, labels, value in samples:
            key = (name, labels)
            fresh.add(key)
            series = known.get(key)
            if series is None:
                history = None
                if windowed is None or name in windowed:
                    history = History(born, born.width)
                    born.width += 1
                series = known[key] = Series(value, history)
                changed.append(key)
            elif series.value != value:
                series.value = value
                changed.append(key)
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


def _axes(
    order: list[tuple[SeriesKey, Series]],
) -> list[tuple[Axis, Callable[[tuple[float, ...]], Sequence[float]]]]:
    """The axes of a source's histories, each with what picks its row (its columns'
    values, in order) out of an update's values, in `order`. An axis half of whose
    columns are no longer in `order` (series gone, or no longer windowed) is copied
    without them (until then theirs take any value: no one reads them); a series in
    `order` twice (a point for each) has an axis of its own."""
    places: dict[Axis, dict[History, list[int]]] = {}
    for i, (_, series) in enumerate(order):
        if series.history is not None:
            places.setdefault(series.history.axis, {}).setdefault(series.history, []).append(i)
    axes: list[tuple[Axis, Callable[[tuple[float, ...]], Sequence[float]]]] = []
    for axis, held in places.items():
        if any(len(at) > 1 for at in held.values()):
            for history, at in held.items():
                alone = axis.keep([history])
                axes += [(alone, _row([i])) for i in at]
            continue
        if len(held) * 2 <= axis.width:
            axis = axis.keep(sorted(held, key=lambda history: history.column))
        row = [next(iter(held.values()))[0]] * axis.width
        for history, at in held.items():
            row[history.column] = at[0]
        axes.append((axis, _row(row)))
    return axes


def _row(places: list[int]) -> Callable[[tuple[float, ...]], Sequence[float]]:
    if len(places) == 1:
        place = places[0]
        return lambda values: (values[place],)
    return itemgetter(*places)
