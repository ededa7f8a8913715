"""Renders what the store and the pollers hold into the exposition web.py serves.

The exporter never calls a source, so a slow or hung source can never slow a scrape
down. The sources' families are rendered for a scrape (`scrape()`), as far as they
changed since the last render: Prometheus scrapes every 15-60 s, the sources poll every
1-10 s, and rendering every poll's values would be work nobody reads. So that a scrape
does not wait for a whole interval's news, the evaluation loop renders them once just
before the next scrape is expected (`render_ahead`), and the scrape serves that. The
rules' families are the loop's alone: it renders them on a transition (`refresh()`), so
a scrape never reads the engine while it evaluates.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass

from gpuwatchd import __version__
from gpuwatchd.exposition import OPENMETRICS_EOF, Renderer, Rows
from gpuwatchd.metrics import MetricSpec, gauge
from gpuwatchd.scheduler import Poller
from gpuwatchd.store import SeriesKey, Store

log = logging.getLogger(__name__)


def __getattr__(name: str) -> object:
    """The server moved to web.py; found there lazily, so `simulate` never loads the web front."""
    if name in ("MetricsServer", "TEXT_TYPE", "wants_openmetrics"):
        from gpuwatchd import web

        return getattr(web, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SELF_METRICS = (
    gauge("build_info", "gpuwatchd build; value is always 1", ("version",)),
    gauge(
        "source_up",
        "1 if the source's last poll succeeded and none is overdue",
        ("source",),
        budget=10,
    ),
    # the node's freshness in one series, each source's with detail_metrics (issue 46)
    gauge("last_success_timestamp_seconds", "Unix time of the last successful poll of any source"),
    gauge(
        "source_duration_seconds",
        "How long the source's last poll took",
        ("source",),
        export="detail",
        budget=10,
    ),
    gauge(
        "source_last_success_timestamp_seconds",
        "Unix time of the source's last successful poll",
        ("source",),
        export="detail",
        budget=10,
    ),
    MetricSpec(
        "gpuwatchd_source_errors_total",
        "Failed or overdue polls per source",
        ("source",),
        "counter",
        export="nonzero",
        budget=10,
    ),
)


@dataclass(frozen=True)
class Exposition:
    text: bytes
    openmetrics: bytes
    rendered_at: float


# Families computed elsewhere (the rules engine's): (version, rows). `rows()` is asked
# again only when `version()` differs from the last render's.
Derived = tuple[Callable[[], Hashable], Callable[[], dict[str, Rows]]]


class Exporter:
    """Renders the exposition in parts, each again only when what it shows has changed.

    A source's part is rendered when the source has polled (or gone stale); the
    daemon's own families when a poll's health changed; each derived part when its
    version changed (the rules' states on a transition, their seconds while a cause
    fires). A cycle in which nothing changed reuses the last bytes.
    """

    def __init__(
        self,
        store: Store,
        pollers: list[Poller],
        specs: Iterable[MetricSpec],
        now: Callable[[], float],
        derived: Iterable[Derived] = (),
        to_wall: Callable[[float], float] | None = None,
        detail: bool = False,
    ) -> None:
        self.store = store
        self.detail = detail  # show the `detail` families too (MetricSpec.export)
        self.pollers = pollers
        self.now = now
        self.to_wall = to_wall or (lambda t: t)  # `now`'s times as exported timestamps
        owned = {spec.name for poller in pollers for spec in poller.source.metrics}
        self.specs = [spec for spec in (*SELF_METRICS, *specs) if spec.name not in owned]
        self.derived = list(derived)
        self._renderers: dict[str, Renderer] = defaultdict(Renderer)
        self._parts: dict[str, tuple[object, bytes, bytes]] = {}
        self._views: dict[str, _View] = {}  # each source's series, as last rendered
        self._current = Exposition(b"", b"", float("nan"))
        self._joined: list[tuple[object, bytes, bytes]] = []  # what the current bytes joined
        self._derived_parts: list[tuple[object, bytes, bytes]] = []  # as the loop left them
        self.refreshed_at = float("nan")  # when the evaluation loop last refreshed
        self.render_error: str | None = None  # why the last render failed; None: it did not
        self._scraped: deque[float] = deque(maxlen=2)  # when the last two scrapes came
        self._ahead_of: float | None = None  # the scrape after which the loop rendered ahead
        self._cycle = 0.0  # the evaluation loop's interval (0: no loop renders ahead)
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()  # one render at a time: scrapes and callers

    def _part(
        self,
        name: str,
        version: object,
        specs: Iterable[MetricSpec],
        rows: Callable[[], dict[str, Rows]],
    ) -> tuple[object, bytes, bytes]:
        """The part `name`, rendered again only if its version changed."""
        part = self._parts.get(name)
        if part is None or part[0] != version:
            families = _families(specs, rows(), self.detail)
            text, openmetrics = self._renderers[name].render(families)
            part = self._parts[name] = (version, text, openmetrics)
        return part

    def _source_part(self, poller: Poller, now: float) -> tuple[object, bytes, bytes]:
        """A source's families, as they changed since the last render (Store.changes)."""
        name = poller.name
        version = self.store.version(name, now)
        part = self._parts.get(name)
        if part is not None and part[0] == version:
            return part
        view = self._views.setdefault(name, _View())
        changed = view.update(self.store, name, version)
        if part is not None and changed is not None and not changed:
            part = self._parts[name] = (version, part[1], part[2])  # polled, no news
            return part
        text, openmetrics = self._renderers[name].render(self._shown(poller, view, changed))
        part = self._parts[name] = (version, text, openmetrics)
        return part

    def _shown(
        self, poller: Poller, view: _View, changed: set[str] | None
    ) -> Iterator[tuple[MetricSpec, Rows | None]]:
        """A source's families as the exposition shows them (MetricSpec.export); None for
        a family shown in full that did not change (the renderer keeps its lines)."""
        for spec in poller.source.metrics:
            series = view.series.get(spec.name)
            if not series or not spec.shown(self.detail):
                continue
            if spec.export == "nonzero":  # what shows may differ from the last render's
                if rows := _nonzero(sorted(series.items())):
                    yield spec, rows
            elif changed is None or spec.name in changed:
                yield spec, sorted(series.items())
            else:
                yield spec, None

    def _own_part(self, now: float) -> tuple[object, bytes, bytes]:
        """The daemon's own families, and the series of sources no poller polls."""
        polled = {poller.name for poller in self.pollers}
        unpolled = [s for s in self.store.sources() if s not in polled]
        health = [poller.health for poller in self.pollers]
        version = (
            [(h.up, h.duration, h.errors_total, h.last_success) for h in health],
            [self.store.version(source, now) for source in unpolled],
        )

        def own() -> dict[str, Rows]:
            rows = _by_name(
                series
                for source in unpolled
                if not self.store.is_stale(source, now)
                for series in self.store.source_latest(source)
            )
            rows[SELF_METRICS[0].name].append(((__version__,), 1.0))
            successes = [p.health.last_success for p in self.pollers if p.health.last_success]
            if successes:
                rows["gpuwatchd_last_success_timestamp_seconds"].append(
                    ((), self.to_wall(max(successes)))
                )
            for poller in self.pollers:
                health, source = poller.health, (poller.name,)
                rows["gpuwatchd_source_up"].append((source, float(health.up)))
                rows["gpuwatchd_source_duration_seconds"].append((source, health.duration))
                rows["gpuwatchd_source_errors_total"].append((source, float(health.errors_total)))
                if health.last_success is not None:
                    rows["gpuwatchd_source_last_success_timestamp_seconds"].append(
                        (source, self.to_wall(health.last_success))
                    )
            return rows

        return self._part("", version, self.specs, own)

    def refresh(self) -> None:
        """The evaluation loop's share, every cycle: the rules' families, rendered again
        only when their version changed (a transition, a firing cause's seconds)."""
        now = self.now()
        with self._render_lock:
            parts = [
                self._part(f"derived {i}", version(), self.specs, rows)
                for i, (version, rows) in enumerate(self.derived)
            ]
        with self._lock:
            self._derived_parts = parts
            self.refreshed_at = now

    def latest(self) -> Exposition:
        """What a scrape serves: the sources' and the daemon's families rendered again as
        far as they changed since the last render, the rules' as the loop left them.
        A render that fails is remembered (`render_error`, /healthz) and raised."""
        with self._render_lock:
            try:
                exposition = self._latest()
            except Exception as e:
                self.render_error = f"{type(e).__name__}: {e}"
                raise
            self.render_error = None
            return exposition

    def _latest(self) -> Exposition:
        now = self.now()
        parts = [self._source_part(poller, now) for poller in self.pollers]
        parts.append(self._own_part(now))
        with self._lock:
            parts += self._derived_parts
            current = self._current
        joined = self._joined
        if len(parts) == len(joined) and all(a is b for a, b in zip(parts, joined, strict=True)):
            exposition = Exposition(current.text, current.openmetrics, now)  # nothing new
        else:
            self._joined = parts
            text = b"".join(p[1] for p in parts)
            openmetrics = b"".join(p[2] for p in parts) + OPENMETRICS_EOF
            exposition = Exposition(text, openmetrics, now)
        with self._lock:
            self._current = exposition
        return exposition

    def scrape(self) -> Exposition:
        """What a scraper is served: the exposition rendered within the last evaluation
        cycle if there is one (what the loop renders ahead of a scrape; as fresh as when
        the loop rendered every cycle), else `latest()`. Its time is noted for
        `render_ahead`."""
        now = self.now()
        with self._lock:
            current, cycle = self._current, self._cycle
        if not (cycle > 0 and now - cycle <= current.rendered_at <= now):
            current = self.latest()
        with self._lock:
            self._scraped.append(now)
        return current

    def render_ahead(self, now: float, cycle: float) -> None:
        """The evaluation loop's, each `cycle` seconds: render the sources' families once,
        in the last cycle before the next scrape is expected (the last one plus the gap
        between the last two), for that scrape to serve as it is: once per scrape
        interval, as rendering at each scrape, and a scrape does not wait for it. A
        scrape that comes earlier, or with no rhythm to expect, renders for itself."""
        with self._lock:
            self._cycle = cycle
            if len(self._scraped) < 2:
                return
            before, last = self._scraped
        if self._ahead_of != last and now >= last + (last - before) - cycle:
            self._ahead_of = last
            self.latest()

    def render(self) -> Exposition:
        """Everything, up to date now (`refresh()` then `latest()`)."""
        self.refresh()
        return self.latest()

    @property
    def current(self) -> Exposition:
        with self._lock:
            return self._current


class _View:
    """One source's series by family, kept as the store's changes come."""

    def __init__(self) -> None:
        self.series: dict[str, dict[tuple[str, ...], float]] = {}
        self.version: tuple[int, bool] | None = None

    def update(self, store: Store, source: str, version: tuple[int, bool]) -> set[str] | None:
        """Catch up with `version`: the families that changed; None: all of them."""
        before, self.version = self.version, version
        changes = None
        if before is not None and before[1] == version[1] and not version[1]:
            changes = store.changes(source, before[0])
        if changes is None:  # everything again: first seen, stale, back, or too far behind
            self.series = {}
            changes = [] if version[1] else list(store.source_latest(source))
            self._apply(changes)
            return None
        return self._apply(changes)

    def _apply(self, changes: Iterable[tuple[SeriesKey, float | None]]) -> set[str]:
        touched = set()
        for (name, labels), value in changes:
            family = self.series.setdefault(name, {})
            if value is None:
                family.pop(labels, None)
            else:
                family[labels] = value
            touched.add(name)
        return touched


def _by_name(series: Iterable[tuple[SeriesKey, float]]) -> dict[str, Rows]:
    rows: dict[str, Rows] = defaultdict(list)
    for (name, labels), value in series:
        rows[name].append((labels, value))
    return rows


def _nonzero(rows: Rows) -> Rows:
    return [row for row in rows if row[1] != 0.0]


def _families(
    specs: Iterable[MetricSpec], rows: dict[str, Rows], detail: bool
) -> Iterator[tuple[MetricSpec, Rows]]:
    """Every family with samples that the exposition shows (MetricSpec.export), in spec
    order, samples sorted by label values."""
    for spec in specs:
        samples = rows.get(spec.name)
        if not samples or not spec.shown(detail):
            continue
        samples.sort()
        if spec.export == "nonzero":
            samples = _nonzero(samples)
        if samples:
            yield spec, samples
