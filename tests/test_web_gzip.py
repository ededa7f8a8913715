"""A gzipped exposition is compressed once per body and format, off the event loop
(issue 41 item 6: each scrape compressed it again, in the loop)."""

from __future__ import annotations

import gzip
import http.client
import threading
import zlib

import pytest
from webfront import serving

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture
def compressions(monkeypatch) -> list[str]:
    """The thread of each zlib compression begun (zlib itself, spied on, still runs)."""
    threads: list[str] = []
    for name in ("compress", "compressobj"):
        real = getattr(zlib, name)

        def spy(*args, real=real, **kwargs):
            threads.append(threading.current_thread().name)
            return real(*args, **kwargs)

        monkeypatch.setattr(zlib, name, spy)
    return threads


def scrape(server, accept: str = "", encoding: str = "gzip", method: str = "GET") -> bytes:
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    try:
        conn.request(method, "/metrics", headers={"Accept": accept, "Accept-Encoding": encoding})
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200
        if response.getheader("Content-Encoding") == "gzip":
            assert method == "HEAD" or int(response.getheader("Content-Length")) == len(body)
            return gzip.decompress(body) if body else b""
        return body
    finally:
        conn.close()


def test_one_compression_per_exposition_and_format_off_the_loop(compressions):
    with serving(series=3000) as (server, source):
        plain = scrape(server, encoding="identity")
        assert compressions == []
        assert [scrape(server) for _ in range(4)] == [plain] * 4
        assert scrape(server, method="HEAD") == b""
        assert len(compressions) == 1  # four scrapes and a HEAD of one body: once
        openmetrics = scrape(server, OPENMETRICS)
        assert scrape(server, OPENMETRICS) == openmetrics != plain
        assert openmetrics.endswith(b"# EOF\n")
        assert len(compressions) == 2  # the other format: once more
        source.series = 3001
        server.exporter.pollers[0].poll()  # a new exposition: compressed anew
        fresh = scrape(server)
        assert fresh != plain and b'i="3000"' in fresh
        assert len(compressions) == 3
        assert "http" not in compressions  # never the event loop's thread
