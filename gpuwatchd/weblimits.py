"""The web front's bounds, rate limits and fair turns (gpuwatchd/web.py, on its event loop).

- `Limits`: every bound the web front keeps (connections, time, bytes).
- `TokenBucket`: Go's rate.Limiter semantics, the web config's `rate_limit`.
- `ClientBuckets`: one bucket per client address, so one client spending its tokens
  (or many anonymous requests) never spends another's (issue 23, finding 6).
- `FairTurns`: one password check at a time, waiters served round robin by source and
  verified clients first, so a flood of wrong passwords from one place cannot keep a
  right one from another waiting (issue 23, finding 2), nor from many places (issue 41).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256  # well under systemd's default 1,024 fds for the whole daemon
    idle_timeout: float = 75.0  # over a 1-minute scrape interval, so keep-alive is reused
    handshake_timeout: float = 10.0
    send_timeout: float = 30.0
    slow_reply: float = 2.0  # a reply that took longer: the connection is closed after it
    max_unsent: int = 32 << 20  # bytes of replies waiting on their clients, all together
    # a connection's transport buffer (the daemon's memory) holds at most about twice
    # this of a reply the client is not reading: its high-water mark and one write
    reply_buffer: int = 16 << 10
    # connections the kernel completes before the daemon accepts them (Linux caps it at
    # net.core.somaxconn, 4,096 since 5.4): room for a flood's burst while the loop is busy
    backlog: int = 4096
    # new connections per client address group (an IPv6 /64): `connect_burst` at once,
    # then one per `connect_interval` s; beyond, reset at accept (issue 41: a flood of
    # ~53k/s kept every other client's connect out). Far above what a scraper or a
    # kubelet opens (one per scrape or probe); the cap holds most of the burst
    connect_burst: int = 1024
    connect_interval: float = 1 / 64
    accept_batch: int = 64  # connections accepted per turn of the event loop
    defer_accept: int = 1  # s a connection may stay silent before it is accepted anyway
    # kernel send buffer per connection (Linux doubles it): a reader takes an exposition
    # without a trip through the loop
    send_buffer: int = 256 << 10
    kernel_unsent: int = 128 << 10  # of it not yet sent (TCP_NOTSENT_LOWAT)
    max_body: int = 4096
    # a request head: at most `max_headers` lines of `max_header` bytes, ~1 MiB in all
    # (Go's MaxHeaderBytes, node_exporter's); 431 beyond, 414 for a longer request line
    max_header: int = 8190
    max_headers: int = 128
    # bytes of request heads received and not yet answered (h11's buffer and the head
    # being answered): past `connection_heads` on one connection (one full head and the
    # read that overran it, asyncio's 256 KiB at most: the client gets its 431; as Go,
    # one request at a time) it is closed, past `max_heads` in all those holding the most
    connection_heads: int = (1 << 20) + (320 << 10)
    max_heads: int = 16 << 20
    # kernel receive buffer per connection (Linux doubles it): what the daemon does not
    # read yet waits there, not in a buffer autotuned up to 6 MB (memory the unit is charged)
    receive_buffer: int = 64 << 10
    api_burst: int = 3  # /api/: 3 calls at once, then one every api_interval seconds
    api_interval: float = 20.0
    # password checks queued behind the one running, per lane (verified clients, others)
    bcrypt_waiting: int = 64
    bcrypt_per_client: int = 2  # of them from one address group (IPv6: a /64)
    api_timeout: float = 10.0  # DCGM may hang: the caller gets 504, a worker thread waits


class TokenBucket:
    """`burst` tokens, one more every `interval` seconds (Go's rate.Limiter semantics)."""

    def __init__(self, interval: float, burst: int) -> None:
        self.interval, self.burst = interval, burst
        self.tokens, self.last = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) / self.interval)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ClientBuckets:
    """A `TokenBucket` per client; the `clients` least recently seen are remembered.

    Forgetting a client refills its bucket: bounded memory against many addresses
    costs at most a burst per forgotten address, which the cap makes rare.
    """

    def __init__(self, interval: float, burst: int, clients: int = 4096) -> None:
        self.interval, self.burst, self.clients = interval, burst, clients
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def take(self, client: Hashable) -> bool:
        bucket = self._buckets.pop(client, None) or TokenBucket(self.interval, self.burst)
        self._buckets[client] = bucket  # most recently seen last
        while len(self._buckets) > self.clients:
            self._buckets.popitem(last=False)
        return bucket.take()


def client_group(address: str | None) -> str | None:
    """The group a client address shares its turns with: an IPv6 address's /64 (one
    host or pod network hands out a whole /64), an IPv4 address alone."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip)


class NoRoom(Exception):
    """No place to wait for a turn, or the place was given to a client with fewer."""


class FairTurns:
    """One holder at a time; the waiters of each key take turns (round robin), every
    waiter of the first lane (`lane=0`, verified clients) before any other. Each lane
    holds at most `total` waiters, `per_key` of one key: a key with fewer waiting than
    the lane's largest takes the place of that one's newest (which gets `NoRoom`), so
    many keys keeping a lane full lock no other key out (issue 41)."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key, self.total = per_key, total
        self._waiting: dict[tuple[int, Hashable], deque[asyncio.Future[None]]] = {}
        self._count = [0, 0]  # waiters per lane
        self._held = False

    @asynccontextmanager
    async def turn(self, key: Hashable, lane: int = 1) -> AsyncIterator[None]:
        """Holds the turn inside; raises `NoRoom` if there is no place to wait."""
        if self._held or self._waiting:
            self._make_room((lane, key))
            await self._wait((lane, key))
        else:
            self._held = True
        try:
            yield
        finally:
            self._pass_on()

    def _make_room(self, key: tuple[int, Hashable]) -> None:
        mine = len(self._waiting.get(key, ()))
        if mine >= self.per_key:
            raise NoRoom
        if self._count[key[0]] < self.total:
            return
        lane = [k for k in self._waiting if k[0] == key[0]]
        largest = max(lane, key=lambda k: len(self._waiting[k]))
        if len(self._waiting[largest]) <= mine + 1:
            raise NoRoom  # no key holds more than this one would
        newest = self._waiting[largest][-1]
        self._forget(largest, newest)
        newest.set_exception(NoRoom())

    async def _wait(self, key: tuple[int, Hashable]) -> None:
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(mine)
        self._count[key[0]] += 1
        try:
            await mine
        except asyncio.CancelledError:
            if mine.done() and not mine.cancelled() and mine.exception() is None:
                self._pass_on()  # handed the turn as it was cancelled: hand it on
            else:
                self._forget(key, mine)
            raise

    def _forget(self, key: tuple[int, Hashable], waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._count[key[0]] -= 1
            if not queue:
                del self._waiting[key]

    def _pass_on(self) -> None:
        """The turn to the next key's first waiter; that key goes to the back."""
        self._held = False
        if not self._waiting:
            return
        key = min(self._waiting, key=lambda k: k[0])  # dicts keep order: the first of its lane
        queue = self._waiting.pop(key)
        waiter = queue.popleft()
        self._count[key[0]] -= 1
        if queue:
            self._waiting[key] = queue  # to the back of the round
        self._held = True
        waiter.set_result(None)
