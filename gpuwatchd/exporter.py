"""Renders what the store and the pollers hold into cached expositions, and serves them.

The exporter never calls a source: `render()` runs once per evaluation cycle and swaps
in new bytes; a scrape only picks the cached bytes for its content type. A slow or hung
source therefore can never slow a scrape down.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE

from gpuwatchd import __version__
from gpuwatchd.exposition import OPENMETRICS_EOF, Renderer, Rows
from gpuwatchd.metrics import MetricSpec, gauge
from gpuwatchd.scheduler import Poller
from gpuwatchd.status_page import StatusPage
from gpuwatchd.store import SeriesKey, Store

log = logging.getLogger(__name__)

TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SELF_METRICS = (
    gauge("build_info", "gpuwatchd build; value is always 1", ("version",)),
    gauge("source_up", "1 if the source's last poll succeeded and none is overdue", ("source",)),
    gauge("source_duration_seconds", "How long the source's last poll took", ("source",)),
    gauge(
        "source_last_success_timestamp_seconds",
        "Unix time of the source's last successful poll",
        ("source",),
    ),
    MetricSpec(
        "gpuwatchd_source_errors_total",
        "Failed or overdue polls per source",
        ("source",),
        "counter",
    ),
)


@dataclass(frozen=True)
class Exposition:
    text: bytes
    openmetrics: bytes
    rendered_at: float


class Exporter:
    """Renders one part per source, reused until that source polls again or goes stale.

    Sources poll every 1-10 s and the exposition is rendered every evaluation cycle, so
    most parts are reused; the daemon's own metrics and the rules' derived families
    change every cycle and are rendered each time.
    """

    def __init__(
        self,
        store: Store,
        pollers: list[Poller],
        specs: Iterable[MetricSpec],
        now: Callable[[], float],
        derived: Iterable[Callable[[], dict[str, Rows]]] = (),
    ) -> None:
        self.store = store
        self.pollers = pollers
        self.now = now
        owned = {spec.name for poller in pollers for spec in poller.source.metrics}
        self.specs = [spec for spec in (*SELF_METRICS, *specs) if spec.name not in owned]
        self.derived = list(derived)  # more families (the rules engine's), by name
        self._renderers: dict[str, Renderer] = defaultdict(Renderer)
        self._parts: dict[str, tuple[object, bytes, bytes]] = {}
        self._current = Exposition(b"", b"", float("nan"))
        self._lock = threading.Lock()

    def _source_part(self, poller: Poller, now: float) -> tuple[bytes, bytes]:
        version = self.store.version(poller.name, now)
        part = self._parts.get(poller.name)
        if part is None or part[0] != version:
            stale = version[1]
            rows = _by_name([] if stale else self.store.source_latest(poller.name))
            text, openmetrics = self._renderers[poller.name].render(
                _families(poller.source.metrics, rows)
            )
            part = self._parts[poller.name] = (version, text, openmetrics)
        return part[1], part[2]

    def _own_rows(self, now: float) -> dict[str, Rows]:
        """The daemon's own families, derived families, and series of unpolled sources."""
        polled = {poller.name for poller in self.pollers}
        unpolled = [
            series
            for source in self.store.sources()
            if source not in polled and not self.store.is_stale(source, now)
            for series in self.store.source_latest(source)
        ]
        rows = _by_name(unpolled)
        rows[SELF_METRICS[0].name].append(((__version__,), 1.0))
        for poller in self.pollers:
            health, source = poller.health, (poller.name,)
            rows["gpuwatchd_source_up"].append((source, float(health.up)))
            rows["gpuwatchd_source_duration_seconds"].append((source, health.duration))
            rows["gpuwatchd_source_errors_total"].append((source, float(health.errors_total)))
            if health.last_success is not None:
                rows["gpuwatchd_source_last_success_timestamp_seconds"].append(
                    (source, health.last_success)
                )
        for provider in self.derived:
            for name, derived_rows in provider().items():
                rows[name].extend(derived_rows)
        return rows

    def render(self) -> Exposition:
        now = self.now()
        parts = [self._source_part(poller, now) for poller in self.pollers]
        parts.append(self._renderers[""].render(_families(self.specs, self._own_rows(now))))
        text = b"".join(p[0] for p in parts)
        openmetrics = b"".join(p[1] for p in parts) + OPENMETRICS_EOF
        exposition = Exposition(text, openmetrics, now)
        with self._lock:
            self._current = exposition
        return exposition

    @property
    def current(self) -> Exposition:
        with self._lock:
            return self._current


def _by_name(series: Iterable[tuple[SeriesKey, float]]) -> dict[str, Rows]:
    rows: dict[str, Rows] = defaultdict(list)
    for (name, labels), value in series:
        rows[name].append((labels, value))
    return rows


def _families(
    specs: Iterable[MetricSpec], rows: dict[str, Rows]
) -> Iterator[tuple[MetricSpec, Rows]]:
    """Every family with samples, in spec order, samples sorted by label values."""
    for spec in specs:
        samples = rows.get(spec.name)
        if samples:
            samples.sort()
            yield spec, samples


def wants_openmetrics(accept: str | None) -> bool:
    return any(
        part.split(";")[0].strip() == "application/openmetrics-text"
        for part in (accept or "").split(",")
    )


class _Handler(BaseHTTPRequestHandler):
    exporter: Exporter  # set on the subclass made per server
    status_page: Callable[[], bytes]  # the page at `/`, likewise
    protocol_version = "HTTP/1.1"
    # headers and body go out as two writes: without this, Nagle's algorithm holds the
    # body back until the client's delayed ACK (40 ms per keep-alive scrape)
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            current = self.exporter.current
            if wants_openmetrics(self.headers.get("Accept")):
                self._send(HTTPStatus.OK, OPENMETRICS_TYPE, current.openmetrics)
            else:
                self._send(HTTPStatus.OK, TEXT_TYPE, current.text)
        elif path == "/healthz":
            self._healthz()
        elif path == "/":
            self._status_page()
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(min(length, 65536))  # a body is not used; keep the connection sane
        path, _, query = self.path.partition("?")
        if path == "/api/dcgm/pause":
            self._dcgm_pause(parse_qs(query))
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

    def _dcgm_pause(self, params: dict[str, list[str]]) -> None:
        """POST /api/dcgm/pause?seconds=N: pause DCGM profiling for N s (0: resume now)."""
        source = next((p.source for p in self.exporter.pollers if p.name == "dcgm"), None)
        pause = getattr(source, "pause_profiling", None)
        if pause is None:
            body = b"the dcgm source is not enabled\n"
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", body)
            return
        try:
            seconds = float(params["seconds"][0])
        except (KeyError, IndexError, ValueError):
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            body = b"expected ?seconds=N, N >= 0 (0 resumes profiling now)\n"
            self._send(HTTPStatus.BAD_REQUEST, "text/plain; charset=utf-8", body)
            return
        result = pause(seconds)
        self._send(HTTPStatus.OK, "application/json", (json.dumps(result) + "\n").encode())

    def _healthz(self) -> None:
        """Healthy while the render loop is alive; sources being down is not unhealthy."""
        current = self.exporter.current
        age = self.exporter.now() - current.rendered_at
        lines = [
            f"source {p.name}: {'up' if p.health.up else 'down'}" for p in self.exporter.pollers
        ]
        if age <= 30:
            self._send(
                HTTPStatus.OK,
                "text/plain; charset=utf-8",
                ("ok\n" + "\n".join(lines) + "\n").encode(),
            )
        else:
            body = f"exposition not rendered for {age:.0f}s\n".encode()
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain; charset=utf-8", body)

    def _status_page(self) -> None:
        try:
            body = self.status_page()
        except Exception:  # a bug in the page answers 500 instead of dropping the connection
            log.exception("status page failed")
            body = b"status page failed; see the daemon's log\n"
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", body)
            return
        self._send(HTTPStatus.OK, "text/html; charset=utf-8", body)

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """The HTTP endpoint, on its own threads; `address` is the bound (host, port).

    `status_page` renders `/`; without one the page shows the sources and GPUs but no
    causes (there is no rule engine to ask).
    """

    def __init__(
        self,
        exporter: Exporter,
        host: str,
        port: int,
        status_page: Callable[[], bytes] | None = None,
    ) -> None:
        if status_page is None:
            status_page = StatusPage(exporter.store, exporter.pollers, exporter.now)
        attributes = {"exporter": exporter, "status_page": staticmethod(status_page)}
        handler = type("Handler", (_Handler,), attributes)
        server_cls = _Server6 if ":" in host else _Server
        self._server = server_cls((host, port), handler)
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
