"""Rate limits and fair turns for the web front (gpuwatchd/web.py), all on its event loop.

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
