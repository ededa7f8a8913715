"""Scrape latency and CPU of the daemon's HTTP front under concurrent scrapers and attacks.

    python bench/bench_scrape.py [--scrapers 50] [--requests 200] [--attacks] [--gzip]
    python bench/bench_scrape.py --url http://127.0.0.1:9766/metrics --pid PID

Starts `gpuwatchd run --simulate healthy-8gpu` (8 GPUs, ~220 KB a scrape) on loopback
unless given --url, then runs each mode with `--scrapers` threads doing `--requests`
scrapes each (bounded), and prints p50/p99/max latency, failures, and the daemon's CPU:
- new connection: connect, GET /metrics, read the body, close (Prometheus' habit with
  short-lived targets and what a load balancer does);
- keep-alive: one connection per scraper, reused.
--attacks also measures the daemon's RSS and whether /metrics and /healthz still answer
(a) with 1,024 idle connections open and (b) while a client streams a 400 MB body with
`Content-Length: -1` (issue 13, findings 1 and 2). Loopback only; run by hand, not a test.
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import psutil

TIMEOUT = 10.0  # a scrape slower than this counts as failed (Prometheus' default timeout)


class Target:
    def __init__(self, url: str, gzip: bool = False) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.request = (
            f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Accept: text/plain;version=0.0.4\r\n"
            + ("Accept-Encoding: gzip\r\n" if gzip else "")
            + "\r\n"
        ).encode()

    def connect(self, scraper: int = 0) -> socket.socket:
        """A connection from scraper `scraper`'s own address on loopback (127.0.1.N): the
        daemon's connect budget is per address, and these stand for many scrapers."""
        local = self.host.startswith("127.")
        source = (f"127.0.{1 + scraper // 250}.{1 + scraper % 250}", 0) if local else None
        sock = socket.create_connection((self.host, self.port), TIMEOUT, source)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def get(self, sock: socket.socket, path: str | None = None) -> int:
        """One request on `sock`; returns the status. Reads the whole body."""
        request = self.request
        if path is not None:
            request = request.replace(request.split(b" ")[1], path.encode(), 1)
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the response")
            head += chunk
        head, _, body = head.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in lines
            if line.lower().startswith(b"content-length:")
        )
        left = length - len(body)
        buffer = bytearray(65536)
        while left > 0:
            got = sock.recv_into(buffer, min(left, len(buffer)))
            if not got:
                raise ConnectionError("closed mid-body")
            left -= got
        return int(lines[0].split()[1])


def _scraper(
    target: Target,
    n: int,
    requests: int,
    keep_alive: bool,
    pace: float,
    out: list,
    failures: list,
) -> None:
    sock = None
    next_at = time.perf_counter()
    for _ in range(requests):
        next_at += pace
        start = time.perf_counter()
        try:
            if sock is None:
                sock = target.connect(n)
            status = target.get(sock)
            if status != 200:
                raise ConnectionError(f"status {status}")
            out.append(time.perf_counter() - start)
        except OSError as e:
            failures.append(type(e).__name__)
            sock = _close(sock)
            continue
        if not keep_alive:
            sock = _close(sock)
        time.sleep(max(0.0, next_at - time.perf_counter()))
    _close(sock)


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()


def run_mode(
    target: Target,
    process: psutil.Process,
    scrapers: int,
    requests: int,
    keep_alive: bool,
    pace: float = 0.0,
) -> dict:
    latencies: list[float] = []
    failures: list[str] = []
    threads = [
        threading.Thread(
            target=_scraper, args=(target, n, requests, keep_alive, pace, latencies, failures)
        )
        for n in range(scrapers)
    ]
    cpu_before, started = _cpu(process), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    cpu = _cpu(process) - cpu_before
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    return {
        "scrapes": len(latencies),
        "failed": len(failures),
        "p50 ms": q[49] * 1000,
        "p99 ms": q[98] * 1000,
        "max ms": max(latencies, default=float("nan")) * 1000,
        "scrapes/s": len(latencies) / wall,
        "daemon CPU %": 100 * cpu / wall,
        "CPU ms/scrape": 1000 * cpu / max(len(latencies), 1),
    }


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _rss_mib(process: psutil.Process) -> float:
    return process.memory_info().rss / 2**20


def _probe(target: Target, path: str) -> str:
    """One fresh-connection GET: 'NNN in X ms' or the failure."""
    start = time.perf_counter()
    try:
        with target.connect() as sock:
            sock.settimeout(5)
            status = target.get(sock, path)
    except OSError as e:
        return f"failed after {time.perf_counter() - start:.1f}s ({type(e).__name__})"
    return f"{status} in {(time.perf_counter() - start) * 1000:.1f} ms"


def attack_idle(target: Target, process: psutil.Process, count: int = 1024) -> dict:
    """Open `count` connections that never send a byte; can others still scrape?"""
    rss_before = _rss_mib(process)
    socks = []
    refused = 0
    for _ in range(count):
        try:
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((target.host, target.port))  # no wait for the handshake
            socks.append(sock)
        except OSError:
            refused += 1
    time.sleep(1)  # let the daemon accept them (measurement, not synchronisation)
    cpu_before, started = _cpu(process), time.perf_counter()
    result = {
        "RSS before MiB": rss_before,
        "daemon fds": process.num_fds(),
        "/metrics": _probe(target, "/metrics"),
        "/healthz": _probe(target, "/healthz"),
    }
    time.sleep(2)
    result["RSS held MiB"] = _rss_mib(process)
    result["daemon CPU % while held"] = (
        100 * (_cpu(process) - cpu_before) / (time.perf_counter() - started)
    )
    for sock in socks:
        sock.close()
    return result


def attack_stream(target: Target, process: psutil.Process, total: int = 400 * 2**20) -> dict:
    """POST /api/dcgm/pause with Content-Length: -1 and stream `total` bytes of body."""
    rss_before, peak = _rss_mib(process), 0.0
    sent, refused_after = 0, None
    sock = target.connect()
    sock.settimeout(5)
    head = (
        f"POST /api/dcgm/pause?seconds=1 HTTP/1.1\r\nHost: {target.host}\r\n"
        "Content-Length: -1\r\n\r\n"
    ).encode()
    chunk = b"x" * 2**20
    probes: dict[str, str] = {}
    try:
        sock.sendall(head)
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
            if sent % (50 * 2**20) == 0:
                peak = max(peak, _rss_mib(process))
            if sent == 200 * 2**20:  # halfway: does the daemon still serve?
                probes = {p: _probe(target, p) for p in ("/metrics", "/healthz")}
    except OSError as e:
        refused_after = f"{sent / 2**20:.0f} MiB sent, then {type(e).__name__}"
    finally:
        peak = max(peak, _rss_mib(process))
        sock.close()
    return {
        "RSS before MiB": rss_before,
        "RSS peak MiB": peak,
        "connection": refused_after or f"all {sent / 2**20:.0f} MiB accepted",
        **probes,
    }


@contextmanager
def spawned_daemon(scenario: str) -> Iterator[tuple[str, int]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--simulate",
            scenario,
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        line = next(line for line in proc.stderr if "gpuwatchd: serving" in line)
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep it draining
        yield line.rsplit(" on ", 1)[1].strip(), proc.pid
    finally:
        proc.terminate()
        proc.wait(15)


def _table(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}\n")
    columns = list(next(iter(rows.values())))
    print("| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an already running daemon's /metrics URL (with --pid)")
    parser.add_argument("--pid", type=int, help="its process id, for CPU and RSS")
    parser.add_argument("--scenario", default="healthy-8gpu")
    parser.add_argument("--scrapers", type=int, default=50)
    parser.add_argument("--requests", type=int, default=200, help="scrapes per scraper")
    parser.add_argument(
        "--pace", type=float, default=0.0, help="seconds between a scraper's scrapes (0: flat out)"
    )
    parser.add_argument("--attacks", action="store_true")
    parser.add_argument("--gzip", action="store_true", help="ask for gzip, as Prometheus does")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))

    def run(url: str, pid: int) -> None:
        target, process = Target(url, args.gzip), psutil.Process(pid)
        with target.connect() as sock:  # warm up: the first render is there
            target.get(sock)
        scrape = args.scrapers, args.requests
        modes: dict[str, Callable[[], dict]] = {
            "new connection": lambda: run_mode(target, process, *scrape, False, args.pace),
            "keep-alive": lambda: run_mode(target, process, *scrape, True, args.pace),
        }
        paced = f", one every {args.pace:g}s each" if args.pace else ", flat out"
        _table(
            f"{args.scrapers} concurrent scrapers x {args.requests} scrapes{paced} of {url}",
            {name: mode() for name, mode in modes.items()},
        )
        if args.attacks:
            _table("1,024 idle connections", {"idle": attack_idle(target, process)})
            _table("400 MB body, Content-Length: -1", {"stream": attack_stream(target, process)})

    if args.url:
        if args.pid is None:
            parser.error("--url needs --pid")
        run(args.url, args.pid)
    else:
        with spawned_daemon(args.scenario) as (url, pid):
            run(url, pid)


if __name__ == "__main__":
    main()
