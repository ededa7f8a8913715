"""Can an authenticated Prometheus still scrape while someone without a password attacks?

    python bench/bench_attack.py [--attack busy-http|busy-tls|bcrypt|connect-flood[-data] ...]
        [--seconds 30]

Starts `gpuwatchd run --simulate healthy-8gpu` on loopback with a web config made here
(trustme certificates, a cost-10 bcrypt password for `prometheus`), runs one attack from
issue 23, and meanwhile scrapes /metrics as Prometheus does (keep-alive, a new connection
after a failure, 10 s timeout, one scrape a second). Prints, per attack, the scrapes that
succeeded, their p50/p99 latency, the daemon's RSS before the attack and at its peak,
and the peak of its connections' kernel send queues (`ss`):
- busy-http: plain HTTP, no auth; 256 connections pipeline `GET /metrics` x40 and never
  read (reconnecting when dropped);
- busy-tls: TLS + basic auth; 256 TLS connections pipeline anonymous `GET /healthz` and
  `GET /metrics` (401) without end and never read;
- bcrypt: TLS + basic auth; 16 connections from 127.0.0.2 send wrong passwords for
  `prometheus` as fast as answered, and the victim's right password is not cached yet (a
  fresh daemon);
- connect-flood: plain HTTP; 4 processes connect from 127.0.0.2 and reset as fast as
  they can (issue 41), while the victim, from 127.0.0.1, opens a new connection for each
  request as a kubelet does: a `/healthz` probe with its 1 s timeout and a scrape, once
  a second each; connect-flood-data: the same, each connection sending a request line
  before its reset (so it reaches accept() whatever TCP_DEFER_ACCEPT holds back).
Loopback only; run by hand, not a test. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import multiprocessing
import re
import resource
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import bcrypt
import psutil
import trustme

TIMEOUT = 10.0  # Prometheus' default scrape timeout
ATTACKER = ("127.0.0.2", 0)  # the password guesser's address: another host than Prometheus
PASSWORD = "scrape-password"


def _auth(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@contextmanager
def daemon(where: Path, tls: bool, auth: bool) -> Iterator[tuple[str, int, ssl.SSLContext | None]]:
    """A `run --simulate` daemon; yields its host:port, pid and a client SSL context."""
    lines, client = [], None
    if tls:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        cert.cert_chain_pems[0].write_to_path(str(where / "server.pem"))
        cert.private_key_pem.write_to_path(str(where / "server.key"))
        lines += ["tls_server_config:", "  cert_file: server.pem", "  key_file: server.key"]
        client = ssl.create_default_context()
        ca.configure_trust(client)
    if auth:
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
        lines += ["basic_auth_users:", f"  prometheus: '{hashed}'"]
    (where / "web.yml").write_text("\n".join(lines) + "\n" if lines else "{}\n")
    command = [sys.executable, "-m", "gpuwatchd", "run", "--simulate", "healthy-8gpu"]
    command += ["--listen", "127.0.0.1:0", "--log-level", "error"]
    command += ["--web.config.file", str(where / "web.yml")]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        line = next(line for line in proc.stderr if "gpuwatchd: serving" in line)
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield urlsplit(line.rsplit(" on ", 1)[1].strip()).netloc, proc.pid, client
    finally:
        proc.terminate()
        proc.wait(15)


class Attacker:
    """`count` connections that send `payload` whenever they can and never read."""

    def __init__(self, address, context, payload: bytes, count: int, repeat: bool) -> None:
        self.address, self.context, self.payload = address, context, payload
        self.count, self.repeat = count, repeat
        self.stop = threading.Event()
        self.reconnects = 0

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.address, timeout=2)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname="127.0.0.1")
            sock.settimeout(0.05)
            sock.sendall(self.payload)
            return sock
        except OSError:
            return None

    def run(self) -> None:
        socks: list[socket.socket | None] = [None] * self.count
        while not self.stop.is_set():
            for i, sock in enumerate(socks):
                if self.stop.is_set():
                    break
                if sock is None:
                    socks[i] = self._open()
                    self.reconnects += 1
                    continue
                try:  # still open? a send fails once the daemon dropped it
                    sock.send(self.payload if self.repeat else b"\r\n")
                except (TimeoutError, ssl.SSLWantWriteError):
                    pass  # its buffers are full: still held
                except OSError:
                    sock.close()
                    socks[i] = None
            self.stop.wait(0.05)
        for sock in socks:
            if sock is not None:
                sock.close()


class Guesser:
    """`count` threads sending wrong passwords for `prometheus`, one after another."""

    def __init__(self, address, context, count: int = 16) -> None:
        self.address, self.context, self.count = address, context, count
        self.stop = threading.Event()
        self.answers: dict[int, int] = {}

    def _one(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                guess = _auth("prometheus", f"guess{n}")
                status = _get(self.address, self.context, guess, ATTACKER)
            except OSError:
                status = 0
            self.answers[status] = self.answers.get(status, 0) + 1

    def run(self) -> None:
        threads = [threading.Thread(target=self._one, daemon=True) for _ in range(self.count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _connection(address, context, source=None) -> http.client.HTTPConnection:
    host, port = address
    if context is None:
        return http.client.HTTPConnection(host, port, timeout=TIMEOUT, source_address=source)
    return http.client.HTTPSConnection(
        host, port, context=context, timeout=TIMEOUT, source_address=source
    )


def _get(address, context, headers: dict[str, str], source=None) -> int:
    connection = _connection(address, context, source)
    try:
        connection.request("GET", "/metrics", headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def scrape_like_prometheus(address, context, auth: bool, seconds: float) -> dict:
    """One scrape a second for `seconds`, keep-alive, a new connection after a failure."""
    headers = _auth("prometheus", PASSWORD) if auth else {}
    latencies: list[float] = []
    failures: dict[str, int] = {}
    connection = None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            connection = connection or _connection(address, context)
            connection.request("GET", "/metrics", headers=headers)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")
            latencies.append(time.monotonic() - started)
        except (OSError, RuntimeError, http.client.HTTPException) as e:
            reason = str(e) if isinstance(e, RuntimeError) else type(e).__name__
            failures[reason] = failures.get(reason, 0) + 1
            if connection is not None:
                connection.close()
            connection = None
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    attempts = len(latencies) + sum(failures.values())
    ordered = sorted(latencies)
    return {
        "succeeded": f"{len(latencies)} of {attempts}",
        "p50 ms": 1000 * statistics.median(ordered) if ordered else float("nan"),
        "p99 ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered
        else float("nan"),
        "failures": ", ".join(f"{k}: {v}" for k, v in failures.items()) or "-",
    }


def _flood(address: tuple[str, int], payload: bytes, stop, counted) -> None:
    """Connect from ATTACKER, send `payload` and reset, until `stop` is set; adds its
    connects to `counted`."""
    linger, connects = struct.pack("ii", 1, 0), 0
    while not stop.is_set():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)  # no TIME_WAIT
            sock.settimeout(5)
            try:
                sock.bind(ATTACKER)
                sock.connect(address)
                sock.sendall(payload)
                connects += 1
            except OSError:
                pass
    with counted.get_lock():
        counted.value += connects


class Flooder:
    """`processes` processes running `_flood` until `stop` is set; `rate`: connects/s."""

    def __init__(self, address, payload: bytes, processes: int = 4) -> None:
        self.address, self.payload, self.processes = address, payload, processes
        self.stop = threading.Event()
        self.rate = 0.0

    def run(self) -> None:
        stop, counted = multiprocessing.Event(), multiprocessing.Value("q", 0)
        workers = [
            multiprocessing.Process(target=_flood, args=(self.address, self.payload, stop, counted))
            for _ in range(self.processes)
        ]
        started = time.monotonic()
        for worker in workers:
            worker.start()
        self.stop.wait()
        stop.set()
        for worker in workers:
            worker.join()
        self.rate = counted.value / (time.monotonic() - started)


def fresh_connections(address, seconds: float) -> dict:
    """A kubelet's probe (new connection, GET /healthz, 1 s timeout) and a scrape on a
    new connection (10 s timeout), once a second each, for `seconds`."""
    probes: list[float] = []
    answers = {"probes": [0, 0], "scrapes": [0, 0]}  # succeeded, tried
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        for kind, path, timeout in (("probes", "/healthz", 1.0), ("scrapes", "/metrics", TIMEOUT)):
            answers[kind][1] += 1
            began = time.monotonic()
            connection = http.client.HTTPConnection(*address, timeout=timeout)
            try:
                connection.request("GET", path)
                response = connection.getresponse()
                response.read()
                if response.status == 200 and time.monotonic() - began <= timeout:
                    answers[kind][0] += 1
                    if kind == "probes":
                        probes.append(time.monotonic() - began)
            except (OSError, http.client.HTTPException):
                pass
            finally:
                connection.close()
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    ordered = sorted(probes)
    return {
        "probes within 1 s": "{} of {}".format(*answers["probes"]),
        "new-connection scrapes": "{} of {}".format(*answers["scrapes"]),
        "probe p50 ms": 1000 * statistics.median(ordered) if ordered else float("nan"),
        "probe p99 ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered
        else float("nan"),
    }


def _send_queues(port: int) -> int:
    """Bytes in the kernel's send queues of the daemon's connections (`ss`'s skmem `w`):
    kernel memory, which its cgroup is charged for as it is for RSS."""
    command = ["ss", "-Htmn", "state", "established", f"( sport = :{port} )"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(int(queued) for queued in re.findall(r"skmem:\(.*?\bw(\d+)", out))


def _during(
    attack: Callable[[], None],
    stop: threading.Event,
    victim: Callable[[], dict],
    pid: int,
    port: int,
) -> dict:
    process, peak, queued = psutil.Process(pid), [0.0], [0]
    idle = process.memory_info().rss / 2**20  # after start-up and a first render

    def watch() -> None:  # from the attack's first connection: its fill is the peak
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss / 2**20)
            queued[0] = max(queued[0], _send_queues(port))
            stop.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    time.sleep(2)  # let the attack fill the daemon (a measurement, not a test)
    try:
        result = victim()
    finally:
        stop.set()
        attacker.join(30)
        watcher.join(5)
    return {
        **result,
        "daemon RSS MiB before": idle,
        "daemon peak RSS MiB": peak[0],
        "peak kernel send queues MiB": queued[0] / 2**20,
    }


def run_attack(name: str, seconds: float) -> dict:
    tls = auth = name not in ("busy-http", "connect-flood", "connect-flood-data")
    with tempfile.TemporaryDirectory() as tmp, daemon(Path(tmp), tls, auth) as (netloc, pid, ctx):
        host, port = netloc.rsplit(":", 1)
        address = (host, int(port))
        if name.startswith("connect-flood"):
            payload = b"GET /metrics HTTP/1.1\r\n" if name.endswith("data") else b""
            flooder, process = Flooder(address, payload), psutil.Process(pid)
            cpu = sum(process.cpu_times()[:2])
            victim = lambda: fresh_connections(address, seconds)  # noqa: E731
            result = _during(flooder.run, flooder.stop, victim, pid, address[1])
            cpu = (sum(process.cpu_times()[:2]) - cpu) / (seconds + 2)
            return {**result, "flood connects/s": flooder.rate, "daemon CPU %": 100 * cpu}
        victim = lambda: scrape_like_prometheus(address, ctx, auth, seconds)  # noqa: E731
        if name == "bcrypt":
            guesser = Guesser(address, ctx)
            result = _during(guesser.run, guesser.stop, victim, pid, address[1])
            return {**result, "attacker's answers": guesser.answers}
        if name == "busy-http":
            payload = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 40
            attacker = Attacker(address, None, payload, 256, repeat=False)
        else:
            payload = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n" * 20
            attacker = Attacker(address, ctx, payload, 256, repeat=True)
        return _during(attacker.run, attacker.stop, victim, pid, address[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--attack",
        action="append",
        choices=("busy-http", "busy-tls", "bcrypt", "connect-flood", "connect-flood-data"),
        default=[],
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the victim scrapes")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    for i, name in enumerate(args.attack or ["busy-http", "busy-tls", "bcrypt"]):
        row = run_attack(name, args.seconds)
        if i == 0:
            print("| attack | " + " | ".join(row) + " |")
            print("|---" * (len(row) + 1) + "|")
        cells = [f"{v:.0f}" if isinstance(v, float) else str(v) for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
