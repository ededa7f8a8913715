"""Request heads against the daemon's memory (issue 41, item 1).

A request head may be ~1 MiB (128 headers of 8,190 bytes). On aiohttp, which parsed up
to 32 pipelined requests ahead, a connection that pipelined 40 such `GET /metrics` and
never read held ~65 MiB, and 6 of them OOM-killed the shipped unit; on h11 the daemon
reads no further while it answers a request, so the rest waits in the kernel. A real
`gpuwatchd run --simulate` is attacked over loopback, in a memory cgroup where the
machine allows one (tests/memcg.py), and its RSS is read either way.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import socket
import sys
import termios
import threading
from urllib.parse import urlsplit

import psutil
from daemon_process import DETAIL, running_daemon
from memcg import limited, rss_kib
from servers import wait_until
from webfront import closed_by_peer

MIB = 1 << 20
# a scrape with 126 headers of ~8,000 bytes: under the 128 x 8,190 allowed a request
BIG_HEAD = (
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-Pad-%03d: %s\r\n" % (i, b"a" * 7990) for i in range(126))
    + b"\r\n"
)
# 40 replies (>= 64 KB each) are more than the kernel's buffers take: one waits on the
# client while the requests behind it are sent
PIPELINE = BIG_HEAD * 40
# how long an attacker pushes its pipeline: a daemon that read it all (40 MiB) would
# have taken it well within this (RSS is the verdict either way); the daemon holds a
# reply the client does not read for `send_timeout` (30 s), so the attacker gives up first
PUSH = 3.0


def pipeline_heads(address: tuple[str, int], outcome: list[str]) -> None:
    """40 `GET /metrics` of ~1 MiB heads whose replies this client never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the reply cannot fit
    sock.settimeout(PUSH)
    try:
        sock.connect(address)
        sock.sendall(PIPELINE)
        outcome.append("taken")
    except OSError as e:  # not taken (TimeoutError), or closed by the daemon
        outcome.append(type(e).__name__)
    finally:
        sock.close()


def scrape(address: tuple[str, int]) -> tuple[int, int]:
    """The status and size of a scrape."""
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        return response.status, len(response.read())
    finally:
        conn.close()


def test_pipelined_request_heads_do_not_exhaust_the_daemons_memory():
    """6 connections x 40 GET /metrics with 1 MiB of headers, never read: the aiohttp
    daemon took ~25 MiB a connection here (OOM-killed when allowed 128 MiB more); now
    each connection holds one head and a read of the next (closed past
    `connection_heads`), the rest of its pipeline is never taken, and the daemon scrapes
    on."""
    with running_daemon("healthy-8gpu", *DETAIL) as url:
        address = (urlsplit(url).hostname, urlsplit(url).port)
        daemon = daemon_child()
        wait_until("a full exposition", lambda: scrape(address)[1] > 64000, 30)
        before = rss_kib(daemon.pid)["VmRSS"]
        with limited(daemon.pid, 128 * MIB) as cgroup:
            outcomes: list[str] = []
            attackers = [
                threading.Thread(target=pipeline_heads, args=(address, outcomes)) for _ in range(6)
            ]
            for thread in attackers:
                thread.start()
            for thread in attackers:
                thread.join()
            assert daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE, cgroup
            assert scrape(address)[0] == 200
            grown = (rss_kib(daemon.pid)["VmHWM"] - before) * 1024
            assert grown < 64 * MIB, f"RSS grew by {grown / MIB:.0f} MiB"
            assert "taken" not in outcomes, outcomes  # none taken in full


def daemon_child() -> psutil.Process:
    """The daemon running_daemon started: this process's child running `gpuwatchd run`
    (the suite's scenario corpus and its runs ahead are other children meanwhile, some
    of them ended and not reaped yet)."""
    (daemon,) = [p for p in psutil.Process().children() if _command(p)[1:4] == RUN]
    return daemon


RUN = ["-m", "gpuwatchd", "run"]


def _command(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def unsent(sock: socket.socket) -> int:
    """Bytes `sock` has sent that its peer has not acknowledged (SIOCOUTQ)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(out, sys.byteorder, signed=True)


def test_unfinished_request_heads_do_not_exhaust_the_daemons_memory():
    """64 connections each send a 1 MiB head and never finish it: the old daemon kept
    every one (~2 MiB of memory each); now past `max_heads` (16 MiB) in all the
    connections holding the most are closed."""
    with running_daemon("healthy-8gpu") as url:
        address = (urlsplit(url).hostname, urlsplit(url).port)
        daemon = daemon_child()
        assert scrape(address)[0] == 200
        before = rss_kib(daemon.pid)["VmRSS"]
        with limited(daemon.pid, 128 * MIB):
            clients = [socket.create_connection(address) for _ in range(64)]
            try:
                senders = [
                    threading.Thread(target=_send_quietly, args=(sock, BIG_HEAD[:-2]))
                    for sock in clients
                ]
                for thread in senders:
                    thread.start()
                for thread in senders:
                    thread.join()
                wait_until(
                    "the daemon to take every head or close its connection",
                    lambda: all(closed_by_peer(sock) or not unsent(sock) for sock in clients),
                    60,
                )
                assert daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE
                assert scrape(address)[0] == 200
                grown = (rss_kib(daemon.pid)["VmHWM"] - before) * 1024
                assert grown < 64 * MIB, f"RSS grew by {grown / MIB:.0f} MiB"
                assert any(closed_by_peer(sock) for sock in clients)
            finally:
                for sock in clients:
                    sock.close()


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # closed by the daemon meanwhile
        sock.sendall(data)
