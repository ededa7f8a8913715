"""The web front against what anyone on the network can send (issue 13, findings 1-4).

Each test talks raw HTTP/1.1 over loopback to a real MetricsServer; none sleeps to
synchronise: waiting is bounded polling.
"""

from __future__ import annotations

import base64
import email.utils
import fcntl
import http.client
import logging
import socket
import ssl
import struct
import sys
import termios
import threading
import time

import psutil
import pytest
import trustme
from servers import wait_until
from webfront import HASH, PASSWORD, closed_by_peer, read_responses, serving

from gpuwatchd import webconfig
from gpuwatchd.web import Limits

MIB = 2**20
SMUGGLED = b"POST /api/dcgm/pause?seconds=3600 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
LAST = SMUGGLED[:-2] + b"Connection: close\r\n\r\n"  # the same, and the server closes


def request(server, method, path, headers=None, timeout=5.0):
    connection = http.client.HTTPConnection(*server.address, timeout=timeout)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


def basic(user, password):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def raw(server, data: bytes, timeout: float = 5.0) -> list[bytes]:
    """Send `data` on a fresh connection; the status line of every response, until EOF."""
    with socket.create_connection(server.address, timeout=timeout) as sock:
        sock.sendall(data)
        return read_responses(sock, timeout)


def first_status_line(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "closed without a response"
        data += chunk
    return data.split(b"\r\n", 1)[0]


def tracebacks(caplog, capfd) -> str:
    logged = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    printed = capfd.readouterr().err  # http.server printed its tracebacks to stderr
    return "\n".join(r.getMessage() for r in logged) + ("Traceback" in printed) * printed


# finding 1: bodies ------------------------------------------------------------------


def test_content_length_minus_one_is_refused_before_the_body_is_read():
    with serving() as (server, source):
        rss = psutil.Process().memory_info().rss
        sock = socket.create_connection(server.address, timeout=5)
        head = b"POST /api/dcgm/pause?seconds=1 HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"
        sock.sendall(head + b"x" * 65536)
        assert first_status_line(sock).split()[1] == b"400"
        sent = 0
        with pytest.raises(OSError):  # the server has closed: the stream breaks off early
            while sent < 64 * MIB:
                sock.sendall(b"x" * MIB)
                sent += MIB
        sock.close()
        assert sent < 16 * MIB
        assert psutil.Process().memory_info().rss - rss < 16 * MIB
        assert source.pauses == []


def test_a_body_over_the_limit_is_refused_and_not_parsed_as_a_second_request():
    with serving() as (server, source):
        body = b"x" * 65536 + SMUGGLED  # the old server read 64 KiB and parsed the rest
        head = b"POST /api/dcgm/pause?seconds=1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        responses = raw(server, head % len(body) + body)
        assert [r.split()[1] for r in responses] == [b"413"]
        assert source.pauses == []


def test_a_chunked_body_is_refused_and_not_parsed_as_a_second_request():
    with serving() as (server, source):
        chunk = f"{len(SMUGGLED):x}\r\n".encode() + SMUGGLED + b"\r\n0\r\n\r\n"
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        responses = raw(server, head + chunk)
        assert [r.split()[1] for r in responses] == [b"413"]
        assert source.pauses == []


def test_a_small_body_is_framed_by_the_parser_and_the_connection_goes_on():
    with serving() as (server, _):
        post = b"POST /api/dcgm/pause?seconds=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
        get = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        responses = raw(server, post + b"0123456789" + get)
        assert [r.split()[1] for r in responses] == [b"403", b"200"]


# finding 2: connections ---------------------------------------------------------------


def _server_side(port: int) -> int:
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_idle_connections_neither_block_scrapes_nor_stay_open():
    limits = Limits(max_connections=32, idle_timeout=1.0)
    with serving(limits=limits) as (server, _):
        idle = [socket.create_connection(server.address, timeout=5) for _ in range(300)]
        for sock in idle[::2]:  # half of them start a request and never finish it
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost:")
        try:
            for path in ("/metrics", "/healthz", "/metrics"):
                started = time.monotonic()
                assert request(server, "GET", path, timeout=2)[0] == 200
                assert time.monotonic() - started < 1
            assert _server_side(server.address[1]) <= limits.max_connections
            wait_until(
                "every idle connection to be closed", lambda: all(map(closed_by_peer, idle)), 10
            )
        finally:
            for sock in idle:
                sock.close()


# finding 3: state-changing endpoints ---------------------------------------------------


def test_pause_is_refused_unless_basic_auth_is_configured():
    with serving() as (server, source):
        status, _, body = request(server, "POST", "/api/dcgm/pause?seconds=3600")
        assert status == 403 and b"basic_auth_users" in body
        status, headers, _ = request(server, "GET", "/api/dcgm/pause?seconds=3600")
        assert status == 405 and headers["Allow"] == "POST"
        assert source.pauses == []


def test_pause_with_basic_auth_checks_the_password_logs_the_caller_and_is_rate_limited(
    tmp_path, caplog, monkeypatch
):
    checks = []
    checkpw = webconfig.bcrypt.checkpw
    monkeypatch.setattr(webconfig.bcrypt, "checkpw", lambda *a: checks.append(1) or checkpw(*a))
    caplog.set_level(logging.INFO, logger="gpuwatchd.web")
    config = {"basic_auth_users": {"alice": HASH}, "api_users": ["alice"]}
    limits = Limits(api_burst=2, api_interval=3600)
    with serving(config, limits, where=tmp_path) as (server, source):
        pause = "/api/dcgm/pause?seconds=60"
        status, headers, _ = request(server, "POST", pause)
        assert status == 401 and headers["WWW-Authenticate"] == "Basic"
        assert request(server, "POST", pause, basic("alice", "wrong"))[0] == 401
        assert request(server, "POST", pause, basic("mallory", PASSWORD))[0] == 401
        assert source.pauses == []
        assert request(server, "POST", pause, basic("alice", PASSWORD))[0] == 200
        assert source.pauses == [60]
        assert any(
            "127.0.0.1" in r.getMessage() and "alice" in r.getMessage() for r in caplog.records
        )
        assert (
            request(server, "POST", "/api/dcgm/pause?seconds=0", basic("alice", PASSWORD))[0] == 200
        )
        status, headers, _ = request(server, "POST", pause, basic("alice", PASSWORD))
        assert status == 429 and "Retry-After" in headers and source.pauses == [60, 0]
        # every endpoint is behind the password, as with exporter-toolkit
        assert request(server, "GET", "/metrics")[0] == 401
        checks.clear()
        for _ in range(5):
            assert request(server, "GET", "/metrics", basic("alice", PASSWORD))[0] == 200
        assert checks == []  # cached: a scrape does not pay bcrypt


def test_a_hung_dcgm_pause_answers_504_and_scrapes_go_on(tmp_path):
    release = threading.Event()
    config = {"basic_auth_users": {"alice": HASH}, "api_users": ["alice"]}
    with serving(config, Limits(api_timeout=0.5), where=tmp_path) as (server, source):
        source.pause_profiling = lambda seconds: release.wait(10)  # type: ignore[method-assign]
        result = []
        caller = threading.Thread(
            target=lambda: result.append(
                request(server, "POST", "/api/dcgm/pause?seconds=5", basic("alice", PASSWORD))
            )
        )
        caller.start()
        for _ in range(5):
            assert request(server, "GET", "/metrics", basic("alice", PASSWORD), timeout=1)[0] == 200
        caller.join(5)
        release.set()
        assert result[0][0] == 504


def test_the_status_page_renders_off_the_loop():
    entered, release = threading.Event(), threading.Event()

    def slow_page() -> bytes:
        entered.set()
        release.wait(10)
        return b"<html>late</html>"

    with serving() as (server, _):
        server.status_page = slow_page
        page = []
        reader = threading.Thread(target=lambda: page.append(request(server, "GET", "/")))
        reader.start()
        assert entered.wait(5)
        assert request(server, "GET", "/metrics", timeout=1)[0] == 200
        release.set()
        reader.join(5)
        assert page[0][0] == 200 and page[0][2] == b"<html>late</html>"


# finding 4: client errors, HEAD ---------------------------------------------------------


@pytest.mark.parametrize("length", [b"x", b"-1", b"1e3", b"12 34", b"0x10"])
def test_a_malformed_content_length_is_a_400_without_traceback(length, caplog, capfd):
    with serving() as (server, _):
        head = b"POST /api/dcgm/pause?seconds=1 HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n"
        responses = raw(server, head % length)
        assert [r.split()[1] for r in responses] == [b"400"]
    assert tracebacks(caplog, capfd) == ""


def test_clients_that_hang_up_mid_response_log_no_traceback(caplog, capfd):
    with serving(series=30000) as (server, _):  # a ~2 MB exposition
        for _ in range(10):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the write must block
            sock.connect(server.address)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.recv(1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset, mid-response
        wait_until("the server to drop them", lambda: _server_side(server.address[1]) == 0, 10)
        assert request(server, "GET", "/healthz")[0] == 200
    assert tracebacks(caplog, capfd) == ""


def test_heads_over_the_bounds_are_refused_and_the_connection_closed():
    """h11 parses a head whole: one over `max_headers` lines, a line over `max_header`,
    or one never finished past what such a head takes is answered 431 (a request line
    too long 414), and the connection closed (nothing after it is read as a request)."""
    limits = Limits(max_header=100, max_headers=4)
    line = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    with serving(limits=limits) as (server, _):
        assert raw(server, line + b"A: b\r\n" * 3 + b"\r\n" + LAST) == [
            b"HTTP/1.1 200 OK",
            b"HTTP/1.1 403 Forbidden",  # within the bounds: the next request is read
        ]
        assert raw(server, line + b"A: b\r\n" * 4 + b"\r\n" + SMUGGLED) == [
            b"HTTP/1.1 431 Request Header Fields Too Large"
        ]
        assert raw(server, line + b"A: " + b"b" * 98 + b"\r\n\r\n" + SMUGGLED) == [
            b"HTTP/1.1 431 Request Header Fields Too Large"
        ]
        assert raw(server, b"GET /" + b"a" * 100 + b" HTTP/1.1\r\nHost: x\r\n\r\n") == [
            b"HTTP/1.1 414 Request-URI Too Long"
        ]
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(line + b"A: b\r\n" * 100)  # never finished
            assert read_responses(sock) == [b"HTTP/1.1 431 Request Header Fields Too Large"]


def test_a_pipeline_is_read_one_request_at_a_time_and_the_rest_waits_in_the_kernel():
    """A client pipelines 700 requests of 4 KB behind a slow one (the status page, held).
    The daemon parses that one and reads no further until it is answered: what it holds
    is one head and at most one read (asyncio's 256 KiB), the rest of the pipeline
    waits in the kernel; then every request is answered in turn. (Reading on, the
    daemon would hold the whole pipeline, or close the connection past
    `connection_heads`.)"""
    entered, release = threading.Event(), threading.Event()

    def slow_page() -> bytes:
        entered.set()
        release.wait(10)
        return b"<html>late</html>"

    pad = b"X-Pad: " + b"a" * 4000 + b"\r\n"
    follow = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n"
    pipeline = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + follow * 699 + LAST
    assert len(pipeline) > 1.5 * Limits().connection_heads
    with serving() as (server, source):
        server.status_page = slow_page
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # the pipeline waits
        sock.connect(server.address)
        sender = threading.Thread(target=sock.sendall, args=(pipeline,))
        sender.start()
        try:
            assert entered.wait(10)
            (connection,) = server._connections.open
            daemons_end = connection.transport.get_extra_info("socket")
            wait_until(
                "the daemon to leave the pipeline's rest in the kernel",
                lambda: connection in server._connections.open and unread(daemons_end) >= 64 << 10,
                10,
            )
            assert sender.is_alive()
            assert connection.held <= (256 << 10) + 64, connection.held
            release.set()
            statuses = read_responses(sock, timeout=30)
            assert statuses == [b"HTTP/1.1 200 OK"] * 700 + [b"HTTP/1.1 403 Forbidden"]
            assert source.pauses == []
        finally:
            release.set()
            sock.close()
            sender.join(10)


def unread(sock: socket.socket) -> int:
    """Bytes in `sock`'s kernel receive queue, not read yet (SIOCINQ)."""
    queued = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int.from_bytes(queued, sys.byteorder, signed=True)


def test_head_answers_like_get_without_a_body():
    with serving() as (server, _):
        _, _, body = request(server, "GET", "/metrics")
        status, headers, head_body = request(server, "HEAD", "/metrics")
        assert status == 200 and head_body == b""
        assert int(headers["Content-Length"]) == len(body)
        assert request(server, "HEAD", "/healthz")[0] == 200


def test_empty_lines_between_requests_are_ignored():
    """RFC 9112 2.2: a server SHOULD ignore an empty line before a request line (a
    client's CRLF after a body, or to keep a connection alive); h11 alone answers 400."""
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with serving() as (server, _), socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(b"\r\n")
        sock.sendall(get)
        assert first_status_line(sock) == b"HTTP/1.1 200 OK"
        sock.sendall(b"\r\n\r\n")
        sock.sendall(LAST)
        assert read_responses(sock)[-1] == b"HTTP/1.1 403 Forbidden"


def test_a_reply_never_read_does_not_keep_its_connection_once_idle():
    """The last piece of a reply in the daemon's buffer, the client not reading: the
    connection, idle once the reply is handed over, is closed, and aborted after
    `send_timeout` (a graceful close waited on the client forever)."""
    limits = Limits(idle_timeout=0.2, send_timeout=2, send_buffer=4096, kernel_unsent=4096)
    with serving(limits=limits, series=400) as (server, _):
        assert 16 << 10 < len(server.exporter.latest().text) < 40 << 10
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the reply cannot fit
        sock.connect(server.address)
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_until("the reply to wait on the client", lambda: held(server) > 0, 10)
            wait_until("the daemon to drop it", lambda: not server._connections.open, 10)
        finally:
            sock.close()


def held(server) -> int:
    """Bytes of replies in the daemon's buffers, all connections together."""
    return sum(h.daemon for h in server.held_replies())


def test_replies_carry_the_date_and_the_server():
    with serving() as (server, _):
        before = time.time()
        _, headers, _ = request(server, "GET", "/healthz")
        after = time.time()
        assert headers["Server"] == "gpuwatchd"
        when = email.utils.parsedate_to_datetime(headers["Date"]).timestamp()
        assert int(before) <= when <= after


def test_methods_and_paths():
    with serving() as (server, _):
        status, headers, _ = request(server, "PUT", "/metrics")
        assert status == 405 and headers["Allow"] == "GET, HEAD"
        assert request(server, "GET", "/nope")[0] == 404


def test_configured_headers_and_rate_limit(tmp_path):
    config = {
        "http_server_config": {"headers": {"X-Frame-Options": "deny"}},
        "rate_limit": {"interval": "1h", "burst": 2},
    }
    with serving(config, where=tmp_path) as (server, _):
        status, headers, _ = request(server, "GET", "/metrics")
        assert status == 200 and headers["X-Frame-Options"] == "deny"
        assert request(server, "GET", "/metrics")[0] == 200
        assert request(server, "GET", "/metrics")[0] == 429


def test_the_dcgm_pause_verb_authenticates(tmp_path):
    from click.testing import CliRunner

    from gpuwatchd.cli import main

    config = {"basic_auth_users": {"alice": HASH}, "api_users": ["alice"]}
    with serving(config, where=tmp_path) as (server, source):
        url = "http://{}:{}".format(*server.address)
        secret = tmp_path / "password"
        secret.write_text(PASSWORD + "\n")
        verb = ["dcgm", "pause", "30", "--url", url]
        refused = CliRunner().invoke(main, verb)
        assert refused.exit_code == 1 and "401" in refused.output
        done = CliRunner().invoke(main, [*verb, "--user", "alice", "--password-file", str(secret)])
        assert done.exit_code == 0, done.output
        assert "paused for 30s (now)" in done.output and source.pauses == [30]
        bad = request(server, "POST", "/api/dcgm/pause?seconds=-1", basic("alice", PASSWORD))
        assert bad[0] == 400 and source.pauses == [30]
    gone = CliRunner().invoke(main, verb)
    assert gone.exit_code == 1 and "cannot reach gpuwatchd" in gone.output


# /healthz and probes: a kubelet's httpGet probe cannot carry a secret ------------------


def https_probe(server, path="/healthz"):
    """GET as the kubelet probes with `scheme: HTTPS`: TLS without verifying the server."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    connection = http.client.HTTPSConnection(*server.address, context=context, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_healthz_answers_probes_without_the_password_and_tells_them_nothing(tmp_path):
    with serving({"basic_auth_users": {"alice": HASH}}, where=tmp_path) as (server, _):
        status, headers, body = request(server, "GET", "/healthz")
        assert (status, body) == (200, b"ok\n") and "WWW-Authenticate" not in headers
        assert request(server, "HEAD", "/healthz")[0] == 200
        assert request(server, "POST", "/healthz")[0] == 405
        for method, path in (("GET", "/metrics"), ("GET", "/"), ("POST", "/api/dcgm/pause")):
            assert request(server, method, path)[0] == 401, path
        # credentials, when sent, are checked; the details need them
        assert request(server, "GET", "/healthz", basic("alice", "wrong"))[0] == 401
        status, _, body = request(server, "GET", "/healthz", basic("alice", PASSWORD))
        assert status == 200 and b"source dcgm: up" in body
        # a wedged render loop: 503 for the probe too, still without details
        server.exporter.now = lambda: time.time() + 3600
        assert request(server, "GET", "/healthz")[::2] == (503, b"unhealthy\n")
        status, _, body = request(server, "GET", "/healthz", basic("alice", PASSWORD))
        assert status == 503 and b"rules not evaluated for" in body


def test_a_flood_that_exhausts_the_rate_limit_does_not_fail_the_probes(tmp_path):
    config = {"basic_auth_users": {"alice": HASH}, "rate_limit": {"interval": "1h", "burst": 1}}
    with serving(config, where=tmp_path) as (server, _):
        assert request(server, "GET", "/metrics", basic("alice", PASSWORD))[0] == 200
        assert request(server, "GET", "/metrics", basic("alice", PASSWORD))[0] == 429
        assert [request(server, "GET", "/healthz")[0] for _ in range(5)] == [200] * 5
        # with credentials it is an ordinary request: limited (bcrypt is not free)
        assert request(server, "GET", "/healthz", basic("alice", PASSWORD))[0] == 429


def test_https_probes_without_a_client_certificate(tmp_path):
    """The kubelet neither verifies the server nor presents a certificate: /healthz works
    over TLS with basic auth, and cannot when client certificates are required (then a
    tcpSocket probe, docs/deploy.md)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = {"cert_file": str(tmp_path / "server.pem"), "key_file": str(tmp_path / "server.key")}
    config = {"tls_server_config": tls, "basic_auth_users": {"alice": HASH}}
    with serving(config, where=tmp_path) as (server, _):
        assert https_probe(server) == (200, b"ok\n")
        assert https_probe(server, "/metrics")[0] == 401
    tls |= {"client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "ca.pem"}
    with (
        serving({**config, "tls_server_config": tls}, where=tmp_path) as (server, _),
        pytest.raises((ssl.SSLError, ConnectionError)),
    ):
        https_probe(server)


def test_a_target_the_url_parser_refuses_is_a_bad_request_that_costs_nothing(caplog, capfd):
    """`GET //[` (urlsplit refuses it) is answered 400 and closed, with no traceback,
    and its head is let go: 40 of ~100 KB, past `max_heads` (2 MiB here) in all, leave
    scrapes served. (The first h11 front raised in its protocol callback and counted
    each such head for good: past `max_heads`, every connection was closed at its first
    read, until a restart.)"""
    limits = Limits(max_heads=2 << 20)
    pad = b"".join(b"X-%04d: " % i + b"v" * 8000 + b"\r\n" for i in range(12))
    bad = b"GET //[ HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n"
    with serving(limits=limits) as (server, _):
        for _ in range(40):
            assert raw(server, bad) == [b"HTTP/1.1 400 Bad Request"]
        assert request(server, "GET", "/healthz")[0] == 200
        wait_until("no head held", lambda: server._connections.held_heads == 0, 10)
    assert not tracebacks(caplog, capfd)


def test_small_replies_never_read_wait_for_the_last_to_leave_the_daemon():
    """A client pipelines 2,000 `GET /healthz` (replies of ~100 bytes) and never reads:
    each reply waits until the last has left the transport's buffer, so the daemon holds
    about `reply_buffer` of them and the rest of the pipeline waits unanswered. (The
    first h11 front wrote a small reply at once and read the next request: 190 MiB in
    30 s from one connection.)"""
    limits = Limits()
    with serving(limits=limits) as (server, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # never read
        sock.connect(server.address)
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)
            wait_until("the connection", lambda: len(server._connections.open) == 1, 10)
            (connection,) = server._connections.open
            # a reply waits on the client (a small reply written at once never does)
            wait_until("a reply to wait on the client", lambda: connection.stuck_since, 10)
            assert connection.buffered() <= limits.reply_buffer + 4096
            assert connection._unparsed() > 0  # requests unanswered (the kernel took ~1,000)
        finally:
            sock.close()


def test_a_client_expecting_100_continue_is_told_to_go_on():
    """curl sends `Expect: 100-continue` with a body and waits a second for the go-ahead
    unless it comes."""
    head = b"POST /api/dcgm/pause?seconds=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
    with serving() as (server, source):
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(head + b"Expect: 100-continue\r\n\r\n")
            interim = b""
            while b"\r\n\r\n" not in interim:
                interim += sock.recv(1)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(b"abc" + LAST)
            assert read_responses(sock) == [b"HTTP/1.1 403 Forbidden"] * 2
        assert source.pauses == []


def test_heads_at_the_bounds():
    """A request line of exactly `max_header` bytes (method, target, version: as aiohttp
    and Go count it) is read; one more is 414. A head never finished past the bound,
    with the default limits (the read that overran h11's bound included), gets its 431
    rather than a reset."""
    limits = Limits(max_header=100, max_headers=4)
    with serving(limits=limits) as (server, _):
        target = b"/" + b"a" * (100 - len(b"GET  HTTP/1.1") - 1)
        line = b"GET " + target + b" HTTP/1.1"
        assert len(line) == 100
        assert raw(server, line + b"\r\nHost: x\r\nConnection: close\r\n\r\n") == [
            b"HTTP/1.1 404 Not Found"
        ]
        longer = b"GET " + target + b"a HTTP/1.1\r\nHost: x\r\n\r\n"
        assert raw(server, longer) == [b"HTTP/1.1 414 Request-URI Too Long"]
    with serving() as (server, _):
        full = b"".join(b"X-%04d: " % i + b"v" * 8180 + b"\r\n" for i in range(140))
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + full)  # never finished
            assert read_responses(sock) == [b"HTTP/1.1 431 Request Header Fields Too Large"]
