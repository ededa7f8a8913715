"""The store's live series as the rules read them, kept current one change at a time.

Each cycle, for each source that polled since the last (or went stale, or came back),
only the series whose value changed are looked at (`Store.changes`), and the (family,
key) pairs whose rows changed are reported with the sources that polled: what the engine
needs to tell which rules could come out otherwise (`evaluator.Reads`). Keys are what the
evaluator looks rows up by: (gpu, uuid) for GPU families, the bus id for PCIe families,
None for host families.
"""

from __future__ import annotations

from typing import Any

from gpuwatchd.rules.evaluator import Row, Snapshot
from gpuwatchd.rules.language import GPU, PCIE
from gpuwatchd.store import SeriesKey, Store

Changed = set[tuple[str, Any]]


class LiveIndex:
    """A Snapshot of the families in `scopes` (name -> scope), updated in place."""

    def __init__(self, store: Store, scopes: dict[str, str]) -> None:
        self.store = store
        self.scopes = scopes
        self.snapshot = Snapshot(0.0)
        self._versions: dict[str, tuple[int, bool]] = {}  # source -> store.version
        # (family, key) -> {labels: value}: the rows, kept to update one series at a time
        self._cells: dict[tuple[str, Any], dict[tuple[str, ...], float]] = {}
        self._owned: dict[str, set[tuple[str, Any]]] = {}  # source -> its (family, key)s

    def update(self, now: float) -> tuple[Changed, set[str]]:
        """Bring the snapshot to `now`: (changed (family, key) pairs, sources that polled)."""
        self.snapshot.now = now
        changed: Changed = set()
        polled: set[str] = set()
        for source in self.store.sources():
            version = self.store.version(source, now)
            before = self._versions.get(source)
            if version == before:
                continue
            self._versions[source] = version
            if before is None or version[0] != before[0]:
                polled.add(source)
            series = None
            if before is not None and before[1] == version[1] and not version[1]:
                series = self.store.changes(source, before[0])  # what changed since
            if series is None:  # everything again: first seen, stale, back, or too far behind
                self._forget(source, changed)
                series = [] if version[1] else list(self.store.source_latest(source))
            self._apply(source, series, changed)
        return changed, polled

    def _forget(self, source: str, changed: Changed) -> None:
        for pair in self._owned.pop(source, set()):
            if self._cells.pop(pair, None):
                changed.add(pair)
                self._publish(pair, {})

    def _apply(
        self, source: str, series: list[tuple[SeriesKey, float | None]], changed: Changed
    ) -> None:
        scopes, cells = self.scopes, self._cells
        touched: set[tuple[str, Any]] = set()
        for (name, labels), value in series:
            scope = scopes.get(name)
            if scope is None:
                continue
            key = labels[:2] if scope == GPU else labels[0] if scope == PCIE else None
            pair = (name, key)
            rows = cells.get(pair)
            if value is None:
                if rows is not None and rows.pop(labels, None) is not None:
                    touched.add(pair)
            else:
                if rows is None:
                    rows = cells[pair] = {}
                    self._owned.setdefault(source, set()).add(pair)
                if rows.get(labels) != value or labels not in rows:
                    rows[labels] = value
                    touched.add(pair)
        for pair in touched:
            changed.add(pair)
            self._publish(pair, cells.get(pair, {}))

    def _publish(self, pair: tuple[str, Any], cells: dict[tuple[str, ...], float]) -> None:
        """Put the rows of one (family, key) where the evaluator looks them up."""
        name, key = pair
        snap = self.snapshot
        rows: list[Row] = list(cells.items())
        scope = self.scopes[name]
        if scope in (GPU, PCIE):
            table: dict[str, dict[Any, list[Row]]] = snap.per_gpu if scope == GPU else snap.per_bus
            family = table.setdefault(name, {})
            if rows:
                family[key] = rows
            else:
                family.pop(key, None)
                if not family:
                    del table[name]
        elif rows:
            snap.host[name] = rows
        else:
            snap.host.pop(name, None)
