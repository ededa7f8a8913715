"""Connect floods (issue 41 item 6): a flood from one address group must not keep other
clients' new connections out. Raw sockets on loopback against a real MetricsServer; the
flooder connects from 127.0.0.2, the scraper from 127.0.0.1. No sleeps: each step waits
on what the server visibly did."""

from __future__ import annotations

import select
import socket
import struct

from webfront import closed_by_peer, serving

from gpuwatchd.web import Limits

FLOODER = ("127.0.0.2", 0)
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def connect(server, source=None, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(server.address, timeout=10, source_address=source)
    sock.sendall(send)
    sock.settimeout(None)  # blocking: closed_by_peer's MSG_DONTWAIT answers at once
    return sock


def answer(sock: socket.socket) -> bytes:
    """The status line the server sends back, b"" if it closes or resets instead."""
    sock.settimeout(10)
    try:
        return sock.recv(4096).split(b"\r\n")[0]
    except ConnectionResetError:
        return b""


def test_a_group_past_its_connect_budget_is_reset_others_are_not():
    """The old server took every connection a flood made (each a task, a parser, a
    slot); now a group past its budget is reset at accept, another group's served."""
    with serving(limits=Limits(connect_burst=4, connect_interval=3600)) as (server, _):
        within = [connect(server, FLOODER, REQUEST) for _ in range(4)]
        assert [answer(sock) for sock in within] == [b"HTTP/1.1 200 OK"] * 4
        assert answer(connect(server, FLOODER, REQUEST)) == b""
        assert answer(connect(server, send=REQUEST)) == b"HTTP/1.1 200 OK"
        for sock in within:
            sock.close()


def test_connections_that_send_nothing_never_reach_the_daemon():
    """TCP_DEFER_ACCEPT: a connect and a reset, as a flood sends them, stay in the
    kernel, so they neither cost the daemon an accept nor spend the group's budget."""
    reset = struct.pack("ii", 1, 0)
    with serving(limits=Limits(connect_burst=4, connect_interval=3600)) as (server, _):
        for _ in range(20):
            sock = connect(server, FLOODER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
            sock.close()
        assert answer(connect(server, FLOODER, REQUEST)) == b"HTTP/1.1 200 OK"


def test_at_the_cap_a_flood_closes_its_own_connections_not_another_groups():
    """The cap full of the flooder's half-sent requests, the scraper's connection (its
    request not finished yet) and the flooder's next ones: the old server closed the
    connection idle the longest, which after as many new ones as the cap was the
    scraper's; now the group holding the most connections loses its own."""
    limits = Limits(max_connections=8)
    half = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
    with serving(limits=limits) as (server, _):
        held = [connect(server, FLOODER, half) for _ in range(limits.max_connections)]
        scraper = connect(server, send=half)
        for n in range(1, limits.max_connections + 1):
            wait_closed([*held, scraper], n)  # room made for the last one
            held.append(connect(server, FLOODER, half))
        wait_closed([*held, scraper], limits.max_connections + 1)
        assert not closed_by_peer(scraper)
        scraper.sendall(b"\r\n")
        assert answer(scraper) == b"HTTP/1.1 200 OK"
        for sock in [scraper, *held]:
            sock.close()


def wait_closed(socks: list[socket.socket], count: int) -> None:
    """Until the server has closed `count` of `socks` (one it closes reads its end)."""
    while len(gone := [s for s in socks if closed_by_peer(s)]) < count:
        readable, _, _ = select.select([s for s in socks if s not in gone], [], [], 10)
        assert readable, f"{len(gone)} of {len(socks)} connections closed, not {count}"
