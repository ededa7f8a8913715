"""The web front on loopback for tests: a real MetricsServer over a small real exporter."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bcrypt
import yaml
from servers import wait_until

from gpuwatchd.config import SourceConfig
from gpuwatchd.exporter import Exporter
from gpuwatchd.metrics import Sample, gauge
from gpuwatchd.scheduler import Poller
from gpuwatchd.sources.base import Context, Source
from gpuwatchd.store import Store
from gpuwatchd.web import Limits, MetricsServer

PASSWORD = "s3cret-password"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: fast tests


class FakeDcgm(Source):
    """A `dcgm` source whose profiling pause records its calls; `series` sets /metrics' size.

    Polled by hand (`serving` polls it once), so its interval is an hour: its series stay
    as polled for a test's life, as those of a source the daemon keeps polling do. (At
    1 s they went stale 3 s after the poll: on a loaded machine, polling and rendering
    60,000 series took longer, and /metrics answered ~900 bytes instead of ~4 MB.)"""

    name = "dcgm"
    metrics = (gauge("gpu_test_value", "A test series", ("gpu", "uuid", "i")),)

    def __init__(self, series: int = 10) -> None:
        super().__init__(SourceConfig(interval=3600, timeout=1), Context())
        self.series = series
        self.pauses: list[float] = []

    def collect(self) -> list[Sample]:
        return [
            Sample("gpuwatchd_gpu_test_value", ("0", "GPU-a", str(i)), 1.0)
            for i in range(self.series)
        ]

    def pause_profiling(self, seconds: float) -> dict[str, Any]:
        self.pauses.append(seconds)
        return {"paused": seconds > 0, "seconds": seconds, "applied": True}


@contextmanager
def serving(
    web_config: dict[str, Any] | None = None,
    limits: Limits | None = None,
    series: int = 10,
    where: Path | None = None,
) -> Iterator[tuple[MetricsServer, FakeDcgm]]:
    """A started server; `web_config` is written to `where`/web.yml (exporter-toolkit format)."""
    source, store = FakeDcgm(series), Store()
    poller = Poller(source, store, time.time)
    poller.poll()
    exporter = Exporter(store, [poller], source.metrics, time.time)
    exporter.render()
    config_file = None
    if web_config is not None:
        assert where is not None
        config_file = where / "web.yml"
        config_file.write_text(yaml.safe_dump(web_config))
    server = MetricsServer(
        exporter, "127.0.0.1", 0, web_config_file=config_file, limits=limits or Limits()
    )
    server.start()
    # its loop's thread sets up the connections' bookkeeping the tests read (a connect
    # succeeds before: the socket listens from the constructor)
    wait_until("the server's loop to run", lambda: hasattr(server, "_connections"), 10)
    try:
        yield server, source
    finally:
        server.stop()


def read_responses(sock: socket.socket, timeout: float = 5.0) -> list[bytes]:
    """Every response's status line until the server closes (or `timeout` passes)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    statuses = []
    while b"\r\n\r\n" in data:  # each response: its head, then Content-Length bytes
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        statuses.append(lines[0])
        lengths = [
            line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length:")
        ]
        data = data[int(lengths[0]) if lengths else len(data) :]
    return statuses


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed `sock` (EOF or reset), without blocking."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
