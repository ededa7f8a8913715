"""The web front against a client without a password (issue 23, findings 1, 2, 6 and 7).

Real TLS clients (trustme certificates) and raw sockets on loopback against a real
MetricsServer. Attackers connect from 127.0.0.2, the scraper from 127.0.0.1: two hosts as
the server sees them. No sleeps: each step waits on what the server visibly did.
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import threading
from pathlib import Path

import bcrypt
import pytest
import trustme
from servers import wait_until
from webfront import HASH, PASSWORD, serving

from gpuwatchd import webconfig
from gpuwatchd.web import Limits
from gpuwatchd.webconfig import BasicAuth, WebConfigError, load_web_config
from gpuwatchd.weblimits import client_group

ATTACKER = ("127.0.0.2", 0)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_config(where: Path, ca: trustme.CA, **extra) -> dict:
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(where / "server.pem"))
    cert.private_key_pem.write_to_path(str(where / "server.key"))
    tls = {"cert_file": str(where / "server.pem"), "key_file": str(where / "server.key")}
    return {"tls_server_config": tls, "basic_auth_users": {"prometheus": HASH}, **extra}


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def connection(server, context=None, source=None) -> http.client.HTTPConnection:
    if context is None:
        return http.client.HTTPConnection(*server.address, timeout=10, source_address=source)
    return http.client.HTTPSConnection(
        *server.address, context=context, timeout=10, source_address=source
    )


def get(conn: http.client.HTTPConnection, path="/metrics", headers=None, method="GET") -> int:
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    response.read()
    return response.status


def once(server, path="/metrics", headers=None, context=None, source=None, method="GET") -> int:
    conn = connection(server, context, source)
    try:
        return get(conn, path, headers, method)
    finally:
        conn.close()


# finding 1: busy connections ------------------------------------------------------------


def stuck_readers(server, count: int, pipelined: int) -> list[socket.socket]:
    """`count` attacker connections that pipeline `pipelined` GET /metrics and never read
    (a receive buffer too small for one reply)."""
    # the attack needs replies that the kernel's buffers cannot hold
    assert len(server.exporter.latest().text) > 4 * server.limits.send_buffer
    stuck = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the reply cannot fit
        sock.bind(ATTACKER)
        sock.settimeout(10)
        sock.connect(server.address)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * pipelined)
        stuck.append(sock)
    return stuck


def test_clients_that_never_read_their_replies_do_not_lock_scrapers_out():
    """Every slot held by a pipeline whose (4 MB) replies are never read: the old server
    never evicted a connection mid-reply and refused every new one for 30 s."""
    limits = Limits(max_connections=8)
    with serving(limits=limits, series=60000) as (server, _):
        stuck = stuck_readers(server, limits.max_connections, pipelined=3)
        try:
            for sock in stuck:  # every reply has begun: each connection is mid-reply
                assert sock.recv(1, socket.MSG_PEEK)
            assert once(server) == 200  # a new connection: one stuck reader made room
            assert once(server, "/healthz") == 200
        finally:
            for sock in stuck:
                sock.close()


def test_replies_that_are_never_read_hold_a_bounded_buffer_per_connection():
    """8 connections pipeline GET /metrics (a ~4 MB exposition) and never read. The old
    server handed each reply whole to asyncio's transport, which copied what the kernel
    did not take into the daemon's memory (3.2 MB a connection here, up to 220 KB x 256
    under the busy-http attack), past 370 KB queued in the kernel; now a connection
    holds at most about twice `reply_buffer` of it and `kernel_unsent` in the kernel,
    and a scraper still gets its scrape."""
    limits = Limits(max_connections=16)
    stalled = 8
    with serving(limits=limits, series=60000) as (server, _):
        stuck = stuck_readers(server, stalled, pipelined=5)
        try:
            # every reply has filled the kernel's buffers and waits on its client (within
            # `send_timeout`, past which it is dropped)
            wait_until(
                "every pipeline's reply to wait on its client",
                lambda: sum(h.waiting for h in server.held_replies()) == stalled,
                limits.send_timeout / 2,
            )
            held = server.held_replies()
            assert len(held) == stalled, held
            bound = 2 * limits.reply_buffer + 4096  # its high-water mark, one write, a head
            assert max(h.daemon for h in held) <= bound, held
            assert sum(h.daemon for h in held) <= stalled * bound, held
            # and the kernel's send queue: its not-yet-sent mark, passed by one write at most
            assert max(h.kernel for h in held) <= limits.kernel_unsent + bound, held
            assert once(server) == 200
            assert once(server, "/healthz") == 200
        finally:
            for sock in stuck:
                sock.close()


def test_past_max_unsent_the_client_stuck_the_longest_is_dropped():
    """Three clients that never read their (4 MB) replies, `max_unsent` room for about
    one reply's buffer: when the third reply starts, the first stuck is dropped and the
    other two are kept."""
    limits = Limits(max_unsent=48 << 10)
    with serving(limits=limits, series=60000) as (server, _):
        stuck: list[socket.socket] = []
        try:
            for count in (1, 2, 3):
                stuck += stuck_readers(server, 1, pipelined=1)
                waiting = min(count, 2)  # the third's reply drops the first's
                wait_until(
                    f"{waiting} replies to wait on their clients",
                    lambda n=waiting: sum(h.waiting for h in server.held_replies()) >= n,
                    10,
                )
            wait_until("the first one dropped", lambda: len(server.held_replies()) == 2, 10)
            assert [h.waiting for h in server.held_replies()] == [True, True]
            kept = {c.transport.get_extra_info("peername")[1] for c in server._connections.open}
            assert kept == {sock.getsockname()[1] for sock in stuck[1:]}
        finally:
            for sock in stuck:
                sock.close()


def test_connections_with_a_right_password_are_evicted_last(tmp_path, ca):
    """TLS + basic auth at the connection cap: anonymous clients that keep connecting
    (and pass for the most recently active) close one another, not Prometheus' keep-alive
    connection, which the old server closed as the one idle the longest."""
    limits = Limits(max_connections=4)
    context = client_context(ca)
    with serving(tls_config(tmp_path, ca), limits, where=tmp_path) as (server, _):
        scraper = connection(server, context)
        anonymous = []
        try:
            assert get(scraper, headers=basic("prometheus", PASSWORD)) == 200
            for _ in range(2 * limits.max_connections):
                conn = connection(server, context, ATTACKER)
                assert get(conn, "/healthz") == 200  # accepted, and active after the scraper
                anonymous.append(conn)
            assert get(scraper, headers=basic("prometheus", PASSWORD)) == 200  # the same one
        finally:
            scraper.close()
            for conn in anonymous:
                conn.close()


# finding 2: the bcrypt queue -------------------------------------------------------------


def held_wrong_passwords(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """bcrypt (the library) made to hold each wrong password until `release` is set;
    `entered` is set once one is held."""
    entered, release = threading.Event(), threading.Event()
    checkpw = webconfig.bcrypt.checkpw

    def slow_wrong(password: bytes, hashed: bytes) -> bool:
        if password != PASSWORD.encode():
            entered.set()
            release.wait(10)
        return checkpw(password, hashed)

    monkeypatch.setattr(webconfig.bcrypt, "checkpw", slow_wrong)
    return entered, release


def test_wrong_passwords_from_one_host_do_not_keep_a_right_one_from_another_waiting(
    tmp_path, ca, monkeypatch
):
    """20 wrong passwords from 127.0.0.2 hold the password check (the first one blocks
    until released); the scraper's right password, not cached yet, is still checked. The
    old server queued 8 checks for everyone and answered the scraper 429."""
    entered, release = held_wrong_passwords(monkeypatch)
    context = client_context(ca)
    with serving(tls_config(tmp_path, ca), where=tmp_path) as (server, _):
        answers: list[int] = []

        def guess(n: int) -> None:
            headers = basic("prometheus", f"guess{n}")
            answers.append(once(server, headers=headers, context=context, source=ATTACKER))

        guessers = [threading.Thread(target=guess, args=(n,)) for n in range(20)]
        for thread in guessers:
            thread.start()
        # 1 check running and at most 8 waiting (the old queue) or 2 (per host): >= 11 refused
        wait_until("the guesses to fill the queue", lambda: answers.count(429) >= 11, 10)
        assert entered.is_set()
        scraped: list[int] = []
        scraper = threading.Thread(
            target=lambda: scraped.append(
                once(server, headers=basic("prometheus", PASSWORD), context=context)
            )
        )
        scraper.start()
        wait_until("the scraper to be answered or queued", lambda: scraped or _queued(server), 10)
        release.set()
        scraper.join(10)
        for thread in guessers:
            thread.join(10)
        assert scraped == [200]
        assert sorted(set(answers)) == [401, 429]


def test_wrong_passwords_from_many_hosts_do_not_lock_a_right_one_out(tmp_path, monkeypatch):
    """Issue 41: 2 wrong passwords from each of 32 hosts fill the 64 places behind the
    check running (held); the scraper's right password, not cached yet, takes the place
    of one of theirs and is answered 200. The old queue answered it 429 while they
    lasted (and after a restart every scraper's password is uncached)."""
    entered, release = held_wrong_passwords(monkeypatch)
    config = {"basic_auth_users": {"prometheus": HASH}}
    with serving(config, where=tmp_path) as (server, _):
        answers: list[int] = []

        def guess(host: str) -> None:
            headers = basic("prometheus", "guess")
            answers.append(once(server, headers=headers, source=(host, 0)))

        holder = threading.Thread(target=guess, args=("127.0.0.100",))
        holder.start()
        wait_until("a wrong password to hold the check", entered.is_set, 10)
        hosts = [f"127.0.0.{n}" for n in range(2, 34) for _ in range(2)]
        guessers = [threading.Thread(target=guess, args=(host,)) for host in hosts]
        for thread in guessers:
            thread.start()
        wait_until("32 hosts to wait", lambda: len(server._password_turns._waiting) == 32, 10)
        scraped: list[int] = []
        scraper = threading.Thread(
            target=lambda: scraped.append(once(server, headers=basic("prometheus", PASSWORD)))
        )
        scraper.start()
        wait_until("the scraper to be answered or queued", lambda: scraped or _queued(server), 10)
        release.set()
        for thread in [scraper, holder, *guessers]:
            thread.join(10)
        assert scraped == [200]
        assert sorted(set(answers)) == [401, 429]


def test_a_verified_client_certificate_never_waits_behind_unverified_checks(
    tmp_path, ca, monkeypatch
):
    """Issue 41: with client certificates verified when given, a scraper presenting one
    (its password not cached yet) waits in the first lane, served before the wrong
    passwords queued ahead of it from another host."""
    entered, release = held_wrong_passwords(monkeypatch)
    config = tls_config(tmp_path, ca)
    ca.cert_pem.write_to_path(str(tmp_path / "clients.pem"))
    config["tls_server_config"].update(
        client_auth_type="VerifyClientCertIfGiven", client_ca_file=str(tmp_path / "clients.pem")
    )
    scraper_context = client_context(ca)
    ca.issue_cert("prometheus.example").configure_cert(scraper_context)
    with serving(config, where=tmp_path) as (server, _):
        answers: list[int] = []

        def call(context: ssl.SSLContext, password: str, source=None) -> None:
            headers = basic("prometheus", password)
            answers.append(once(server, headers=headers, context=context, source=source))

        threads = [threading.Thread(target=call, args=(client_context(ca), "x", ATTACKER))]
        threads[0].start()
        wait_until("a wrong password to hold the check", entered.is_set, 10)
        threads += [
            threading.Thread(target=call, args=(client_context(ca), "x", ATTACKER))
            for _ in range(2)
        ]
        threads.append(threading.Thread(target=call, args=(scraper_context, PASSWORD)))
        for thread in threads[1:]:
            thread.start()
        turns = server._password_turns
        wait_until("all to wait", lambda: sum(map(len, turns._waiting.values())) == 3, 10)
        assert (0, "127.0.0.1") in turns._waiting  # the first lane: served before lane 1
        release.set()
        for thread in threads:
            thread.join(10)
        assert sorted(answers) == [200, 401, 401, 401]


def test_address_groups():
    """IPv6 clients share their /64's turns (one host or pod network has a whole /64)."""
    assert client_group("2001:db8:1:2:aaaa::1") == client_group("2001:db8:1:2::ffff")
    assert client_group("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert client_group("2001:db8:1:3::1") != client_group("2001:db8:1:2::1")
    assert client_group("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_group("10.0.0.1") != client_group("10.0.0.2")


def _queued(server) -> bool:
    turns = getattr(server, "_password_turns", None)
    return turns is not None and any(key[1] == "127.0.0.1" for key in turns._waiting)


def test_an_unknown_user_costs_what_the_files_users_cost():
    """The hash an unknown user is checked against has the cost of the file's own (the
    old fixed cost-10 hash answered unknown users of a cost-12 file 4x faster)."""
    assert HASH.startswith("$2b$04$")
    assert BasicAuth({"alice": HASH}).unknown.startswith("$2b$04$")


def test_every_password_check_costs_the_files_highest_cost(tmp_path, monkeypatch):
    """Issue 41: in a file mixing costs (exporter-toolkit's own test data mixes 10, 12
    and 18), a wrong password for a cost-4 user cost 2^4 bcrypt rounds and one for an
    unknown user 2^6 (the dummy at the file's highest): the time of a 401 told whether
    the user exists. Now every check, right or wrong, known or not, costs 2^6."""
    rounds: list[int] = []
    checkpw = webconfig.bcrypt.checkpw

    def counted(password: bytes, hashed: bytes) -> bool:
        rounds.append(2 ** int(hashed.split(b"$")[2]))
        return checkpw(password, hashed)

    monkeypatch.setattr(webconfig.bcrypt, "checkpw", counted)
    dear = bcrypt.hashpw(b"other", bcrypt.gensalt(6)).decode()
    config = {"basic_auth_users": {"prometheus": HASH, "oncall": dear}}
    with serving(config, where=tmp_path) as (server, _):
        work = []
        for user, password, status in [
            ("prometheus", "wrong", 401),
            ("nobody", "wrong", 401),
            ("oncall", "wrong", 401),
            ("prometheus", PASSWORD, 200),
            ("oncall", "other", 200),
        ]:
            rounds.clear()
            assert once(server, headers=basic(user, password)) == status
            work.append(sum(rounds))
        assert work == [2**6] * 5


# finding 6: the rate limit ---------------------------------------------------------------


def test_the_rate_limit_is_per_client_and_spent_only_after_authentication(tmp_path, ca):
    config = tls_config(tmp_path, ca, rate_limit={"interval": "1h", "burst": 2})
    context = client_context(ca)
    right = basic("prometheus", PASSWORD)
    with serving(config, where=tmp_path) as (server, _):
        # anonymous requests and wrong passwords from 127.0.0.2 spend nobody's tokens
        for headers in ({}, {}, {}, basic("prometheus", "wrong"), basic("prometheus", "x")):
            assert once(server, headers=headers, context=context, source=ATTACKER) == 401
        assert [once(server, headers=right, context=context) for _ in range(3)] == [200, 200, 429]
        # 127.0.0.1 spent its own: 127.0.0.2 still has its burst
        assert once(server, headers=right, context=context, source=ATTACKER) == 200


# finding 7: a read-only role -------------------------------------------------------------


def test_only_api_users_may_change_state(tmp_path, ca):
    users = {"prometheus": HASH, "oncall": HASH}
    config = tls_config(tmp_path, ca, basic_auth_users=users, api_users=["oncall"])
    context = client_context(ca)
    pause = "/api/dcgm/pause?seconds=3600"
    with serving(config, where=tmp_path) as (server, source):
        scraper = basic("prometheus", PASSWORD)
        assert once(server, headers=scraper, context=context) == 200
        assert once(server, pause, scraper, context, method="POST") == 403
        assert source.pauses == []
        assert once(server, pause, basic("oncall", PASSWORD), context, method="POST") == 200
        assert source.pauses == [3600]


def test_api_users_must_be_basic_auth_users(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{HASH}'\napi_users: [oncall]\n")
    with pytest.raises(WebConfigError, match="api_users: expected names of basic_auth_users"):
        load_web_config(path)
