"""The daemon's HTTP front: /metrics, /healthz, / and POST /api/dcgm/pause.

One asyncio event loop on its own thread serves every connection, so an idle or slow
client costs a socket and a few KB, never a thread; h11 parses and frames HTTP/1.1, one
request at a time per connection (gpuwatchd/webconn.py). What a cluster network can
throw at it is bounded (`Limits`, gpuwatchd/weblimits.py):
- connections: at most `max_connections`, TLS handshakes included; at the cap one is
  closed to make room, so a scraper always gets in: one of the address group holding the
  most (a flood closes its own, issue 41), a connection whose reply the client is not
  reading first (the longest stuck first), then the one idle the longest, and those
  that have given a right password only when no other is left (issue 23);
- connects (issue 41): a connection reaches accept() once its client has sent something
  (TCP_DEFER_ACCEPT: a connect-and-reset flood costs the kernel alone), and each address
  group has a budget of new connections, past which one is reset at accept, before a
  task, TLS or a parser is spent on it;
- time: a connection without a complete request for `idle_timeout` is closed (this also
  bounds headers sent slowly), a TLS handshake gets `handshake_timeout`, a response the
  client does not read within `send_timeout` is dropped, and a connection whose reply
  took over `slow_reply` to send is closed after it, so a pipeline of requests that are
  never read holds at most one reply;
- bytes: per connection, at most `send_buffer` of kernel buffer, `kernel_unsent` of it
  not yet sent, and about twice `reply_buffer` of the daemon's memory, whatever the
  reply's size: a body goes to the transport `reply_buffer` at a time, each piece once
  it holds under that; at most `max_unsent` waiting on clients in all: past it, the
  connection stuck the longest is dropped;
- request heads (issue 41): ~1 MiB each (128 headers of 8,190 bytes, Go's default;
  431 beyond); none parsed ahead of the one answered, and nothing read meanwhile: the
  rest waits in a small kernel receive buffer. A connection holding more than one full
  head and a read unanswered is closed, and past `max_heads` in all those holding the
  most;
- bodies: no endpoint takes one. h11 frames every request and answers a malformed length
  with 400; a body over `max_body` or chunked is refused with 413 before a byte of it is
  read and the connection is closed, so nothing that follows is parsed as a request;
- slow work (the status page, the DCGM pause, bcrypt, gzip) runs on a few threads, never
  on the loop: a scrape returns the exposition's cached bytes (gzipped once per body).
- passwords: one bcrypt check at a time, waiters served round robin by client address
  group (an IPv6 /64), a verified TLS client certificate or a user already verified
  from that group before any other, at most `bcrypt_per_client` waiting per group and
  `bcrypt_waiting` per lane; a group with fewer waiting takes the place of the newest
  of the group with the most (gpuwatchd/weblimits.py).
TLS, basic auth, extra headers and a rate limit (per client address, spent only by
requests that passed authentication) come from exporter-toolkit's web config file
(gpuwatchd/webconfig.py). `/api/...` changes state: POST only, refused unless basic auth
is configured and the user is one of its `api_users`, rate-limited, and every call is
logged with its caller. `/healthz`
without credentials answers anyone, with its status only, for probes (docs/security.md).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import math
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from gpuwatchd.exposition import OPENMETRICS_TYPE, gzip_accepted, gzip_body
from gpuwatchd.status_page import StatusPage
from gpuwatchd.webconfig import BasicAuth, WebConfig, load_web_config, peer_sans, ssl_context
from gpuwatchd.webconn import Connections, Reply, Request, text
from gpuwatchd.weblimits import (
    ClientBuckets,
    FairTurns,
    Limits,
    NoRoom,
    TokenBucket,
    client_group,
)

if TYPE_CHECKING:
    from gpuwatchd.exporter import Exporter

log = logging.getLogger(__name__)

TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READ = ("GET", "HEAD")
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's; Python has it since 3.7
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class Held(NamedTuple):
    """A connection's bytes of replies not taken by its client: in the daemon's memory
    (its transport's buffer), in the kernel's send queue (`SIOCOUTQ`); and whether its
    writes wait on the client to read."""

    daemon: int
    kernel: int
    waiting: bool


def wants_openmetrics(accept: str | None) -> bool:
    return any(
        part.split(";")[0].strip() == "application/openmetrics-text"
        for part in (accept or "").split(",")
    )


def basic_credentials(header: str) -> tuple[str, str] | None:
    """(user, password) of an `Authorization: Basic ...` header (RFC 7617, UTF-8)."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, colon, password = (
            base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        )
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return None
    return (user, password) if colon else None


class _Throttled:
    """At most one log line per `every` seconds; counts what it held back."""

    def __init__(self, every: float = 10.0) -> None:
        self.every, self.next, self.held = every, 0.0, 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self.next:
            self.held += 1
            return
        held, self.held, self.next = self.held, 0, now + self.every
        log.warning(message + (f" (and {held} more held back)" if held else ""), *args)


class MetricsServer:
    """The HTTP(S) endpoint on its own thread; `address` is the bound (host, port).

    `status_page` renders `/` (default: sources and GPUs, no causes); `web_config_file` is
    an exporter-toolkit web config (TLS, basic auth, headers, rate limit). The socket is
    bound here, so a busy port or a bad web config fails at start-up.
    """

    def __init__(
        self,
        exporter: Exporter,
        host: str,
        port: int,
        status_page: Callable[[], bytes] | None = None,
        web_config_file: Path | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.exporter = exporter
        self.status_page = status_page or StatusPage(
            exporter.store, exporter.pollers, exporter.now, to_wall=exporter.to_wall
        )
        self.limits = limits = limits or Limits()
        self.config = load_web_config(web_config_file) if web_config_file else WebConfig()
        tls = self.config.tls
        self._ssl = ssl_context(tls, web_config_file) if tls and web_config_file else None
        self._sans = set(tls.client_allowed_sans or ()) if tls else set()
        self._auth = BasicAuth(self.config.users) if self.config.users else None
        rate = self.config.rate_limit
        self._limiter = ClientBuckets(rate.interval, rate.burst) if rate.interval else None
        self._api_bucket = TokenBucket(limits.api_interval, limits.api_burst)
        self._api_refusals, self._accept_errors = _Throttled(), _Throttled()
        self._connect_refusals = _Throttled()
        self._password_turns = FairTurns(limits.bcrypt_per_client, limits.bcrypt_waiting)
        self._verified: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        self._page: tuple[float, asyncio.Future[bytes]] | None = None
        self._gzip: dict[str, tuple[bytes, asyncio.Future[bytes]]] = {}  # kind: (body, gzipped)
        self._handshakes: dict[asyncio.Task[None], tuple[float, str | None]] = {}  # since, group
        self._connects = ClientBuckets(limits.connect_interval, limits.connect_burst)
        self._routes: dict[str, tuple[tuple[str, ...], Callable[..., Awaitable[Reply]]]] = {
            "/metrics": (READ, self._metrics),
            "/healthz": (READ, self._healthz),
            "/": (READ, self._status_page),
            "/api/dcgm/pause": (("POST",), self._dcgm_pause),
        }
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=limits.backlog)
        # accepted connections inherit it (and the TCP window it sets)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, limits.receive_buffer)
        # a connection reaches accept() once its client has sent something (HTTP and TLS
        # clients speak first), or after `defer_accept` s: one that connects and resets,
        # as a connect flood does, costs the kernel alone (nginx's `deferred`)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, limits.defer_accept)
        self._socket.setblocking(False)
        bound = self._socket.getsockname()
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))
        self._loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="http-work")
        self._bcrypt_thread = ThreadPoolExecutor(1, thread_name_prefix="http-bcrypt")
        self._gzip_thread = ThreadPoolExecutor(1, thread_name_prefix="http-gzip")
        self._thread = threading.Thread(target=self._serve, name="http", daemon=True)
        self._describe(web_config_file)

    def _describe(self, web_config_file: Path | None) -> None:
        tls = self.config.tls
        log.info(
            "web: %s on %s:%d%s%s",
            self.scheme,
            *self.address,
            f", client certificates: {tls.client_auth_type}" if tls else "",
            f", basic auth for {len(self.config.users)} user(s)" if self._auth else "",
        )
        if self._auth and not self._ssl:
            log.warning("web: %s: basic auth without TLS sends passwords in clear", web_config_file)
        ignored = tls.curve_preferences if tls else []
        if ignored:
            log.info("web: curve_preferences %s ignored (OpenSSL's defaults are used)", ignored)

    @property
    def scheme(self) -> str:
        return "https" if self._ssl else "http"

    # -- life cycle, called from the daemon's thread -----------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)
        else:
            self._socket.close()
            self._loop.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._bcrypt_thread.shutdown(wait=False, cancel_futures=True)
        self._gzip_thread.shutdown(wait=False, cancel_futures=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        headers = {**self.config.http_server_config.headers, "Server": "gpuwatchd"}
        self._connections = Connections(self.limits, self._route, headers)
        self._accepting()
        await self._stopping.wait()
        self._loop.remove_reader(self._socket)
        self._socket.close()
        for task in list(self._handshakes):
            task.cancel()
        await self._connections.close(grace=1.0)

    # -- connections -------------------------------------------------------------------

    def _accepting(self) -> None:
        self._loop.add_reader(self._socket, self._accept_ready)

    def _accept_ready(self) -> None:
        """Accept what the kernel holds: a connection from an address group past its
        connect budget is reset at once (no task, TLS or parser: a flood costs an accept
        and a close each, issue 41), up to `accept_batch` a turn of the loop; one let in
        ends the turn, for its task to start before the next is counted."""
        for _ in range(self.limits.accept_batch):
            try:
                conn, address = self._socket.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of fds or memory: back off instead of spinning
                self._accept_errors.warning("web: accept failed: %s", e)
                self._loop.remove_reader(self._socket)
                self._loop.call_later(0.1, self._accepting)
                return
            group = client_group(address[0] if address else None)
            if not self._connects.take(group):
                self._reset(conn, group)
            elif self._open_count() >= self.limits.max_connections and not self._make_room(group):
                conn.close()  # every connection is mid-request: this one waits for none
            else:
                self._admit(conn, group)
                return

    def _reset(self, conn: socket.socket, group: str | None) -> None:
        """Close with a reset (no TIME_WAIT left on the daemon's side) and say so."""
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        conn.close()
        limits = self.limits
        self._connect_refusals.warning(
            "web: reset a connection from %s: past %d connections at once, then %g a second",
            group,
            limits.connect_burst,
            1 / limits.connect_interval,
        )

    def _admit(self, conn: socket.socket, group: str | None) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # an 8-GPU exposition is ~220 KB: let one send() take it rather than a dozen
        # trips through the loop (kernel memory, held only while a client is slow)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer)
        # ... of which at most `kernel_unsent` not yet sent: a client that does not
        # read leaves the rest of its reply in the shared exposition (webconn's paced writes)
        conn.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, self.limits.kernel_unsent)
        task = self._loop.create_task(self._open(conn))
        self._handshakes[task] = (time.monotonic(), group)

        def cancelled(done: asyncio.Task[None]) -> None:
            if done.cancelled():  # to make room, maybe before it started and owned `conn`
                conn.close()

        task.add_done_callback(cancelled)

    async def _open(self, conn: socket.socket) -> None:
        """`conn` as a `Connection`, after the TLS handshake when there is one."""
        loop = asyncio.get_running_loop()
        timeout = self.limits.handshake_timeout if self._ssl else None
        try:
            await loop.connect_accepted_socket(
                self._connections, conn, ssl=self._ssl, ssl_handshake_timeout=timeout
            )
        except OSError as e:  # a failed or timed-out handshake (ssl.SSLError is an OSError)
            log.debug("web: connection dropped before its first request: %s", e)
        finally:  # counted as a connection from now on, if it is one
            self._handshakes.pop(asyncio.current_task(), None)  # type: ignore[arg-type]

    def held_replies(self, timeout: float = 10.0) -> list[Held]:
        """Each open connection's bytes of replies its client has not taken, and whether
        its writes wait on the client; from any thread (tests, diagnostics)."""

        async def held() -> list[Held]:
            return [
                Held(
                    mine := c.buffered(),
                    c.unsent() - mine,
                    c.writing_paused,
                )
                for c in self._connections.open
            ]

        return asyncio.run_coroutine_threadsafe(held(), self._loop).result(timeout)

    def _open_count(self) -> int:
        return len(self._handshakes) + len(self._connections.open)

    def _make_room(self, newcomer: str | None) -> bool:
        """Close one connection for a newcomer from address group `newcomer`: a client's
        that has not given a right password before one that has; of those, one of the
        group holding the most connections (the newcomer counted: a flood from one group
        closes its own, issue 41); of those, the one holding the most bytes of replies its
        client has not taken (the slowest reader), else the one idle the longest (a
        handshake counts by its start). One inside a handler, not sending (a password
        check, the DCGM call), is left alone."""
        connections = self._connections.open
        held = Counter(c.group for c in connections)
        held.update(group for _, group in self._handshakes.values())
        held[newcomer] += 1
        candidates: list[tuple[tuple[bool, int, bool, float], Callable[[], object]]] = [
            ((c.authenticated, -held[c.group], not unsent, -unsent or c.last_active), c.evict)
            for c in connections
            if not c.busy or c.sending_since is not None
            for unsent in (c.unsent(),)
        ]
        candidates += [
            ((False, -held[group], True, at), functools.partial(self._cancel, task))
            for task, (at, group) in self._handshakes.items()
        ]
        if not candidates:
            return False
        min(candidates, key=lambda candidate: candidate[0])[1]()
        return True

    def _cancel(self, handshake: asyncio.Task[None]) -> None:
        """Cancel now, and count it gone now (its callbacks run after this turn)."""
        handshake.cancel()
        self._handshakes.pop(handshake, None)

    # -- requests ----------------------------------------------------------------------

    async def _route(self, request: Request) -> Reply:
        # A liveness probe cannot hold a secret (a kubelet's httpGet headers are plain text
        # in the pod spec), so /healthz without credentials answers anyone, with only its
        # status: one word, nothing about the node (see _healthz).
        probe = request.path == "/healthz" and "authorization" not in request.headers
        if self._sans and not self._sans & peer_sans(request.peer_certificate):
            return text(403, "client certificate has none of the allowed SANs\n", close=True)
        user = None
        if self._auth is not None and not probe:
            user_or_refusal = await self._authenticate(request)
            if isinstance(user_or_refusal, Reply):
                return user_or_refusal
            user = user_or_refusal
        # the rate limit counts per client and only what passed authentication, so neither
        # another client nor anonymous requests spend a scraper's tokens (issue 23)
        if not probe and self._limiter is not None and not self._limiter.take(request.remote):
            return text(429, "too many requests\n")
        methods, endpoint = self._routes.get(request.path, ((), None))
        if endpoint is None:
            return text(404, "not found\n")
        if request.method not in methods:
            return text(
                405, f"{request.path} accepts {', '.join(methods)}\n", {"Allow": ", ".join(methods)}
            )
        return await endpoint(request, user)

    async def _authenticate(self, request: Request) -> Reply | str:
        assert self._auth is not None
        credentials = basic_credentials(request.headers.get("authorization", ""))
        if credentials is not None:
            user, password = credentials
            ok = self._auth.cached(user, password) or await self._bcrypt(request, user, password)
            if ok is None:
                return text(
                    429, "too many password checks at once; try again\n", {"Retry-After": "1"}
                )
            if ok:
                request.connection.authenticated = True
                return user
        return text(401, "unauthorized\n", {"WWW-Authenticate": "Basic"})

    def _lane(self, request: Request, source: str | None, user: str) -> int:
        """0 (served before any other) for a client with a verified TLS certificate or a
        user already verified from its address group, else 1."""
        if request.peer_certificate:  # empty unless the handshake verified one
            return 0
        return 0 if (source, user) in self._verified else 1

    async def _bcrypt(self, request: Request, user: str, password: str) -> bool | None:
        """bcrypt on its thread, when this client's turn comes; None: no place to wait."""
        assert self._auth is not None
        source = client_group(request.remote)
        connection = request.connection
        connection.waiting_password = True  # dropped for memory, it is cancelled
        try:
            async with self._password_turns.turn(source, self._lane(request, source, user)):
                loop = asyncio.get_running_loop()
                check = self._auth.check
                ok = await loop.run_in_executor(self._bcrypt_thread, check, user, password)
        except NoRoom:
            return None
        finally:
            connection.waiting_password = False
        if ok:
            self._verified[(source, user)] = None
            while len(self._verified) > 1024:
                self._verified.popitem(last=False)
        return ok

    # -- endpoints -----------------------------------------------------------------------

    async def _metrics(self, request: Request, user: str | None) -> Reply:
        try:
            current = self.exporter.scrape()
        except Exception:  # a bug in rendering: the last good bytes; /healthz says so
            log.exception("rendering the exposition failed; serving the last one")
            current = self.exporter.current
        if wants_openmetrics(request.headers.get("accept")):
            body, kind = current.openmetrics, OPENMETRICS_TYPE
        else:
            body, kind = current.text, TEXT_TYPE
        headers = {"Content-Type": kind, "Vary": "Accept-Encoding"}
        # gzip where the scraper accepts it, as Prometheus does: an 8-GPU body shrinks ~13x
        if gzip_accepted(request.headers.get("accept-encoding", "")):
            body = await self._gzipped(kind, body)
            headers["Content-Encoding"] = "gzip"
        return Reply(200, body, headers)

    async def _gzipped(self, kind: str, body: bytes) -> bytes:
        """`body` gzipped once per exposition and format, as the plain bytes are rendered
        once (issue 41: each scrape compressed it again, 1-2 ms of the event loop), on a
        thread of its own: scrapes of the same body share one compression."""
        cached = self._gzip.get(kind)
        if cached is None or cached[0] is not body:  # the exporter reuses unchanged bytes
            job = asyncio.get_running_loop().run_in_executor(self._gzip_thread, gzip_body, body)
            cached = self._gzip[kind] = (body, job)
        return await asyncio.shield(cached[1])

    async def _healthz(self, request: Request, user: str | None) -> Reply:
        """Healthy while the evaluation loop is alive and scrapes render; sources being down
        is not unhealthy.

        With basic auth configured, a caller without credentials (a kubelet probe) gets
        the status and one word; the details (the loop's age, sources) need the password.
        """
        age = self.exporter.now() - self.exporter.refreshed_at
        failed = self.exporter.render_error
        healthy = age <= 30 and failed is None
        if self._auth is not None and user is None:
            return text(200, "ok\n") if healthy else text(503, "unhealthy\n")
        if failed is not None:
            return text(503, f"the last scrape's exposition failed to render: {failed}\n")
        if not healthy:
            return text(503, f"rules not evaluated for {age:.0f}s\n")
        lines = [
            f"source {p.name}: {'up' if p.health.up else 'down'}" for p in self.exporter.pollers
        ]
        return text(200, "ok\n" + "".join(line + "\n" for line in lines))

    async def _status_page(self, request: Request, user: str | None) -> Reply:
        """Rendered off the loop, at most once per evaluation cycle however many ask."""
        cycle = self.exporter.refreshed_at
        if self._page is None or self._page[0] != cycle:
            page = asyncio.get_running_loop().run_in_executor(self._workers, self.status_page)
            self._page = (cycle, page)
        try:
            body = await asyncio.shield(self._page[1])
        except Exception:  # a bug in the page answers 500 instead of dropping the connection
            log.exception("status page failed")
            self._page = None
            return text(500, "status page failed; see the daemon's log\n")
        return Reply(200, body, {"Content-Type": "text/html; charset=utf-8"})

    async def _dcgm_pause(self, request: Request, user: str | None) -> Reply:
        """POST /api/dcgm/pause?seconds=N: pause DCGM profiling for N s (0: resume now)."""
        caller = f"{request.remote} (user {user})" if user else str(request.remote)
        if self._auth is None:
            self._api_refusals.warning(
                "web: refused %s from %s: basic auth is not configured", request.path, caller
            )
            return text(
                403,
                "refused: /api/ changes the daemon's state and needs basic auth; set "
                "basic_auth_users in the web config file (--web.config.file)\n",
            )
        if user not in self.config.api_users:  # a scrape credential only reads
            self._api_refusals.warning(
                "web: refused %s from %s: not one of api_users", request.path, caller
            )
            return text(
                403,
                f"refused: user {user} may read but not change state; list it in api_users "
                "in the web config file (--web.config.file)\n",
            )
        if not self._api_bucket.take():
            self._api_refusals.warning(
                "web: refused %s from %s: rate limited", request.path, caller
            )
            retry = f"{self.limits.api_interval:.0f}"
            return text(
                429, f"too many /api/ calls; try again in {retry}s\n", {"Retry-After": retry}
            )
        source = next((p.source for p in self.exporter.pollers if p.name == "dcgm"), None)
        pause = getattr(source, "pause_profiling", None)
        if pause is None:
            return text(404, "the dcgm source is not enabled\n")
        try:
            seconds = float(request.query["seconds"])
        except (KeyError, ValueError):
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            return text(400, "expected ?seconds=N, N >= 0 (0 resumes profiling now)\n")
        loop = asyncio.get_running_loop()
        wait = self.limits.api_timeout
        try:  # DCGM may hang: the call holds a worker thread, never the loop
            result = await asyncio.wait_for(
                loop.run_in_executor(self._workers, pause, seconds), wait
            )
        except asyncio.TimeoutError:
            log.warning("web: %s from %s: DCGM did not answer in %gs", request.target, caller, wait)
            return text(504, f"DCGM did not answer in {wait:g}s\n")
        log.info("web: %s %s from %s: %s", request.method, request.target, caller, result)
        return Reply(
            200, (json.dumps(result) + "\n").encode(), {"Content-Type": "application/json"}
        )
