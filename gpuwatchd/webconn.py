"""One HTTP/1.1 connection of the web front (gpuwatchd/web.py): an asyncio protocol that
hands what it receives to h11 (parsing and framing, no I/O) and answers one request at
a time.

- One request is parsed, then reading pauses until it is answered: nothing is parsed
  ahead, and of what a pipelining client sends behind it the daemon holds at most what
  arrived in the same read (asyncio's 256 KiB); the rest waits in the kernel's small
  receive buffer. h11 buffers at most one unfinished head (`Connections.max_head`,
  431 past it); a finished head over `max_headers` lines or a line over `max_header`
  is answered 431 (414 for the request line); a body over `max_body` or chunked 413
  before a byte of it is read; anything h11 refuses (a malformed Content-Length...) its
  `error_status_hint`; each of them closes the connection.
- `held` counts the bytes of request heads a connection holds (h11's buffer, the head
  answered); `Connections` bounds them per connection and in all.
- A body goes to the transport `reply_buffer` at a time, the next piece once the
  transport's buffer is under its high-water mark (`pause_writing`), so a client that
  does not read holds about twice that of the daemon's memory, never a copy of the
  body: the rest stays in the one cached exposition every reply shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import sys
import termios
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import h11

from gpuwatchd.weblimits import Limits, client_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """A request as the endpoints see it: `path` percent-decoded, `headers` by lower-case
    name (the first of repeated ones), `query`'s first value of each name."""

    method: str
    target: str  # as sent: path and query
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    remote: str | None
    connection: Connection

    @classmethod
    def of(cls, event: h11.Request, connection: Connection) -> Request:
        target = event.target.decode("latin-1")
        parts = urlsplit(target)
        headers: dict[str, str] = {}
        for name, value in event.headers:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        return cls(
            method=event.method.decode("latin-1"),
            target=target,
            path=unquote(parts.path),
            query=dict(reversed(parse_qsl(parts.query, keep_blank_values=True))),
            headers=headers,
            remote=connection.remote,
            connection=connection,
        )

    @property
    def peer_certificate(self) -> dict[str, Any] | None:
        """The client's certificate, if the TLS handshake verified one."""
        transport = self.connection.transport
        return transport.get_extra_info("peercert") if transport is not None else None


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False  # close the connection once it is sent


def text(
    status: int, body: str, headers: dict[str, str] | None = None, close: bool = False
) -> Reply:
    kind = {"Content-Type": "text/plain; charset=utf-8"}
    return Reply(status, body.encode(), kind | (headers or {}), close)


def bad_request(status: int) -> Reply:
    """A request the daemon cannot read on from: its status's phrase (never an echo of
    what was sent), and the connection closed."""
    return text(status, f"{HTTPStatus(status).phrase}\n", close=True)


def head_size(event: h11.Request) -> int:
    """Bytes of a request's head as received (near enough: h11 strips the whitespace
    around header values)."""
    lines = sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items())
    return len(event.method) + len(event.target) + 12 + lines


class Connections:
    """The open connections; `held_heads` is the bytes of request heads they hold,
    bounded by `Limits.max_heads`. Called, it makes a `Connection` (asyncio's protocol
    factory); `respond` answers a request, `headers` go on every reply."""

    def __init__(
        self,
        limits: Limits,
        respond: Callable[[Request], Awaitable[Reply]],
        headers: dict[str, str],
    ) -> None:
        self.limits, self.respond, self.headers = limits, respond, headers
        self.open: set[Connection] = set()
        self.held_heads = 0
        self._date = (0, "")  # (second, its HTTP date)
        # h11's bound on a head not finished yet: a request line and `max_headers` lines
        self.max_head = (limits.max_headers + 1) * (limits.max_header + 2) + 2

    def __call__(self) -> Connection:
        return Connection(self)

    def date(self) -> str:
        """Now as an HTTP `Date` (RFC 9110: a server with a clock sends it), made once a
        second. strftime's names are English: Python leaves the C locale alone."""
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)))
        return self._date[1]

    def shed_heads(self) -> None:
        """Past `max_heads`, close the connections holding the most request heads, those
        without a right password first (they are the daemon's memory)."""
        if self.held_heads <= self.limits.max_heads:
            return
        for c in sorted(self.open, key=lambda c: (c.authenticated, -c.held)):
            if self.held_heads <= self.limits.max_heads:
                break
            c.drop()

    def drop_stuck_writers(self) -> None:
        """Past `max_unsent` bytes of replies that clients do not take, drop the clients
        stuck the longest (their bytes are the daemon's memory)."""
        # a reply is paced (`_write`): a transport holds at most about twice
        # `reply_buffer`, so with the default limits (256 x 48 KiB < 32 MiB) this walk
        # over every connection, before every reply, is skipped
        if len(self.open) * 3 * self.limits.reply_buffer <= self.limits.max_unsent:
            return
        sending = [(c, c.buffered()) for c in self.open if c.sending_since is not None]
        stuck = [(c, size) for c, size in sending if size]
        total = sum(size for _, size in stuck)
        if total <= self.limits.max_unsent:
            return
        for c, size in sorted(stuck, key=lambda stuck: stuck[0].stuck_since):
            if total <= self.limits.max_unsent:
                break
            total -= size
            c.evict()

    async def close(self, grace: float) -> None:
        """Close every connection: those answering a request get `grace` seconds."""
        handlers = {c.handler for c in self.open if c.handler is not None}
        for c in list(self.open):
            if c.handler is None:
                c.close()
        if handlers:
            await asyncio.wait(handlers, timeout=grace)
        for c in list(self.open):
            c.abort()
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


class Connection(asyncio.Protocol):
    """A client's connection: h11's state, the request being answered (`handler`), and
    what the connection cap needs (when it last did something, whether it is stuck)."""

    def __init__(self, connections: Connections) -> None:
        self.connections, self.limits = connections, connections.limits
        self.parser: h11.Connection | None = h11.Connection(
            h11.SERVER, max_incomplete_event_size=connections.max_head
        )
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.group: str | None = None  # its client's address group (weblimits.client_group)
        self.held = 0  # bytes of request heads: h11's buffer + `answering`
        self.answering = 0  # the head of the request being answered
        self.handler: asyncio.Task[None] | None = None  # answering a request
        self.waiting_password = False  # its handler waits on a password check
        self.sending_since: float | None = None  # a reply is being sent since
        self.authenticated = False  # has given a right password: evicted last
        self.last_active = time.monotonic()
        self.writing_paused = False  # the transport holds over its high-water mark
        self._writable = asyncio.Event()
        self._writable.set()
        self._idle: asyncio.TimerHandle | None = None
        self._request: h11.Request | None = None  # parsed, its body being read

    # -- asyncio's callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if peer else None
        self.group = client_group(self.remote)
        # pause_writing past `reply_buffer` held, not asyncio's 64 KB: what a
        # connection holds of a reply is bounded by this (`_write`)
        with contextlib.suppress(NotImplementedError):
            self.transport.set_write_buffer_limits(high=self.limits.reply_buffer)
        self.connections.open.add(self)
        self._wait_for_request()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.parser is None:  # dropped
            return
        if not self._unparsed() and self.parser.their_state in (h11.IDLE, h11.DONE):
            # between requests: empty lines are ignored (RFC 9112 2.2, as aiohttp and Go
            # do; h11 answers them 400). Clients send one after a body, or to keep alive
            data = data.lstrip(b"\r\n")
            if not data:
                return
        self.parser.receive_data(data)
        self._next_request()
        self._recount()

    def eof_received(self) -> bool:
        if self.parser is not None:
            self.parser.receive_data(b"")
            self._next_request()  # a head cut short is answered 400
        # plain TCP: keep sending the reply being answered (TLS closes either way)
        tls = self.transport is not None and self.transport.get_extra_info("sslcontext")
        return self.handler is not None and not tls

    def connection_lost(self, exc: BaseException | None) -> None:
        self.connections.open.discard(self)
        if self._idle is not None:  # a flood leaves no timers behind
            self._idle.cancel()
        self.parser = None  # lets go of what h11 holds
        if self.handler is None:  # else the handler's end lets go of its head
            self.answering = 0
        self._count()
        self._writable.set()  # a reply waiting to write finds the connection closed

    def pause_writing(self) -> None:
        self.writing_paused = True
        self._writable.clear()

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._writable.set()

    # -- reading: one request at a time -----------------------------------------------

    def _next_request(self) -> None:
        """Parse until a request is complete (its small body read), then answer it with
        reading paused; refusals are answered as soon as the head is parsed."""
        while self.handler is None and self.parser is not None:
            try:
                event = self.parser.next_event()
            except h11.RemoteProtocolError as e:
                self._malformed(e)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self.answering = head_size(event)
                refusal = self._refuse(event)
                if refusal is not None:
                    self._answer(event, refusal)
                    return
                self._request = event
                if self.parser.they_are_waiting_for_100_continue and self.transport:
                    go_on = h11.InformationalResponse(
                        status_code=100, headers=[], reason=b"Continue"
                    )
                    self.transport.write(self.parser.send(go_on) or b"")  # curl waits 1 s
            elif isinstance(event, h11.EndOfMessage) and self._request is not None:
                request, self._request = self._request, None  # counted in `answering`
                self._answer(request, None)
                return
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return
            # h11.Data: a body within `max_body`, framed and not used

    def _refuse(self, event: h11.Request) -> Reply | None:
        """A head over the bounds, or a body the daemon will not read."""
        limits = self.limits
        if len(event.method) + len(event.target) + 10 > limits.max_header:
            return text(414, f"request line over {limits.max_header} bytes\n", close=True)
        if len(event.headers) > limits.max_headers or any(
            len(name) + len(value) + 2 > limits.max_header for name, value in event.headers
        ):
            size = f"at most {limits.max_headers} of {limits.max_header} bytes"
            return text(431, f"request header fields too large ({size})\n", close=True)
        fields = dict(event.headers)  # h11 has checked Content-Length's form
        if (
            b"transfer-encoding" in fields
            or int(fields.get(b"content-length", 0)) > limits.max_body
        ):
            refused = f"no request bodies here (at most {limits.max_body} bytes, not chunked)\n"
            return text(413, refused, close=True)  # its body must not be read as a request
        return None

    def _malformed(self, error: h11.RemoteProtocolError) -> None:
        """h11 refused what the client sent: its status if a reply can still go, and
        close (nothing after it can be framed)."""
        log.debug("web: a bad request from %s: %s", self.remote, error)
        if self.parser is not None and self.parser.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            status = error.error_status_hint  # the body does not echo what was sent
            self._answer(None, bad_request(status))
        else:
            self.abort()

    # -- answering -------------------------------------------------------------------

    def _answer(self, event: h11.Request | None, reply: Reply | None) -> None:
        """Answer `event` (or send `reply`) on a task of its own, reading paused."""
        if self._idle is not None:
            self._idle.cancel()
        if self.transport is not None:
            self.transport.pause_reading()
        request = None
        if event is not None:
            try:
                request = Request.of(event, self)
            except ValueError:  # a target urlsplit refuses (`//[`)
                reply = bad_request(400)
        self.handler = asyncio.get_running_loop().create_task(self._reply(request, reply))

    async def _reply(self, request: Request | None, reply: Reply | None) -> None:
        close = True
        try:
            if reply is None:
                assert request is not None
                reply = await self._respond(request)
            slow = await self._send(reply, request is not None and request.method == "HEAD")
            close = reply.close or slow
        except ConnectionError as e:
            log.debug("web: %s: %s", self.remote, e)
        except h11.LocalProtocolError:  # a bug of ours: this connection cannot go on
            log.exception("web: replying to %s failed", self.remote)
            self.abort()
        finally:
            self.handler, self.answering = None, 0
            self.last_active = time.monotonic()
            self._next_cycle(close)

    async def _respond(self, request: Request) -> Reply:
        try:
            return await self.connections.respond(request)
        except Exception:  # a bug in an endpoint answers 500, not a dropped connection
            log.exception("web: %s %s failed", request.method, request.path)
            return text(500, "internal error; see the daemon's log\n", close=True)

    async def _send(self, reply: Reply, head_only: bool) -> bool:
        """Send `reply`, bounded: a client that does not read within `send_timeout` is
        dropped. True if it took over `slow_reply` (a pipeline of requests read slowly
        would hold one reply after another: the connection is closed after it)."""
        self.connections.drop_stuck_writers()
        started = self.sending_since = time.monotonic()
        # a timer, not wait_for: no task per reply (abort: close() would wait for the
        # unread bytes; the write then finds the connection closed)
        deadline = asyncio.get_running_loop().call_later(self.limits.send_timeout, self.abort)
        try:
            await self._write(reply, head_only)
        finally:
            deadline.cancel()
            self.sending_since = None
        return time.monotonic() - started > self.limits.slow_reply

    async def _write(self, reply: Reply, head_only: bool) -> None:
        """The head and the body, `reply_buffer` at a time, each piece once the
        transport holds under its high-water mark (Content-Length framing: h11 counts
        the body and passes it through, so the pieces are the cached bytes' own)."""
        parser, transport = self.parser, self.transport
        if parser is None or transport is None or transport.is_closing():
            raise ConnectionResetError("closed before the reply")
        headers = {**reply.headers, **self.connections.headers}
        headers["Date"] = self.connections.date()
        headers["Content-Length"] = str(len(reply.body))
        if reply.close:
            headers["Connection"] = "close"
        phrase = HTTPStatus(reply.status).phrase.encode()
        head = h11.Response(status_code=reply.status, headers=list(headers.items()), reason=phrase)
        body = b"" if head_only else reply.body
        start = parser.send(head) or b""
        framed = parser.send_with_data_passthrough(h11.Data(data=body)) if body else [body]
        if framed != [body] or parser.send(h11.EndOfMessage()):  # as Content-Length frames
            raise h11.LocalProtocolError("the body was framed other than by Content-Length")
        view, chunk = memoryview(body), max(1, self.limits.reply_buffer)
        first = max(0, chunk - len(start))
        # a small reply in one write, once the last has left the transport's buffer: a
        # pipeline of requests never read holds at most about `reply_buffer` of replies
        await self._drained(transport)
        transport.write(start + view[:first])
        for offset in range(first, len(view), chunk):
            await self._drained(transport)
            transport.write(view[offset : offset + chunk])

    async def _drained(self, transport: asyncio.Transport) -> None:
        """Once the transport holds under its high-water mark."""
        if self.writing_paused:
            await self._writable.wait()
        if transport.is_closing():
            raise ConnectionResetError("closed while sending the reply")

    def _next_cycle(self, close: bool) -> None:
        """After a reply: the next request, or close as h11 or the reply says."""
        self._recount()
        parser, transport = self.parser, self.transport
        if parser is None or transport is None or transport.is_closing():
            return
        if close or parser.our_state is not h11.DONE or parser.their_state is not h11.DONE:
            self.close()  # after the reply, which is in its buffer
            return
        parser.start_next_cycle()
        self._wait_for_request()
        transport.resume_reading()
        self._next_request()
        self._recount()

    def _wait_for_request(self) -> None:
        """Closed unless a request is complete within `idle_timeout` (also bounds a head
        sent slowly, and a connection that never sends one)."""
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.limits.idle_timeout, self._idle_out)

    def _idle_out(self) -> None:
        if self.handler is None:
            log.debug("web: closing a connection idle for %gs", self.limits.idle_timeout)
            self.close()

    # -- bounds ----------------------------------------------------------------------

    def _unparsed(self) -> int:
        """Bytes h11 holds unparsed (it says so publicly only by copying them,
        `trailing_data`)."""
        return len(self.parser._receive_buffer) if self.parser is not None else 0

    def _count(self) -> int:
        """`held` anew, and the total's."""
        held = self._unparsed() + self.answering
        self.connections.held_heads += held - self.held
        self.held = held
        return held

    def _recount(self) -> None:
        """`held` anew; over a bound, connections are closed."""
        if self._count() > self.limits.connection_heads:
            log.debug("web: closing a connection holding %d bytes of request heads", self.held)
            self.drop()
        self.connections.shed_heads()

    def drop(self) -> None:
        """Close now and let go of the request heads held: h11's buffer, and the head in
        a handler waiting on a password check (cancelled; one sending fails)."""
        self.abort()
        if self.waiting_password and self.handler is not None:
            self.handler.cancel()
            self.answering = 0
        self.parser = None
        self._count()

    def evict(self) -> None:
        """Closed to make room: at once if a reply waits on the client to read it."""
        if self.sending_since is not None or self.buffered():
            self.abort()
        else:
            self.close()

    def close(self) -> None:
        """Once the reply in the transport's buffer is sent: within `send_timeout`, else
        aborted (a client that never reads its end would keep the connection)."""
        # once only: asyncio's TLS transport closed twice forgets its connection (3.11)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
            if self.buffered():
                asyncio.get_running_loop().call_later(self.limits.send_timeout, self.abort)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    @property
    def busy(self) -> bool:
        """Answering a request (evicted only while sending)."""
        return self.handler is not None

    @property
    def stuck_since(self) -> float:
        """When the reply now waiting on the client to read it began; 0 if none waits.
        (`sending_since` alone would count a reply already in the kernel's buffer.)"""
        if self.sending_since is None:
            return 0.0
        return self.sending_since if self.buffered() else 0.0

    def buffered(self) -> int:
        """Bytes of replies in the transport's buffer (the daemon's memory)."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def unsent(self) -> int:
        """Bytes of replies the client has not taken: in our buffer, then the kernel's
        (SIOCOUTQ: sent but not acknowledged, or not sent: the client's window is shut)."""
        if self.transport is None:
            return 0
        queued = 0
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                outq = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                queued = int.from_bytes(outq, sys.byteorder, signed=True)
        return self.buffered() + queued
