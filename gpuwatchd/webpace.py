"""A reply's body paced into its connection (gpuwatchd/web.py, issue 23).

asyncio's transports copy whatever the kernel's socket buffer does not take into their
own buffer: a client that pipelines scrapes and never reads would hold a copy of a whole
exposition (220 KB for 8 GPUs, MBs for more) per connection in the daemon's memory.
`PacedBody` hands the body to the transport a piece at a time, the next piece only once
the transport's buffer is under its high-water mark (aiohttp's drain), so the unsent
rest stays in the one cached bytes object that every reply shares.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload


class PacedBody(Payload):
    """A reply's body handed to the transport `chunk` bytes at a time, each once the
    transport has taken the last (its buffer under the high-water mark, aiohttp's
    drain): a client that does not read holds about `chunk` of the daemon's memory plus
    the kernel's buffer, never a copy of the whole body (which stays one shared bytes
    object, the cached exposition's). Content-Length is the body's, as for bytes."""

    _autoclose = True  # nothing to close: bytes in memory

    def __init__(self, value: bytes, chunk: int, content_type: str) -> None:
        super().__init__(value, content_type=content_type)
        self._size = len(value)
        self._chunk = max(1, chunk)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._value).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        view = memoryview(self._value)[:content_length]
        for start in range(0, len(view), self._chunk):
            await writer.write(view[start : start + self._chunk])
            await writer.drain()  # waits while the transport holds over its high-water mark


def pace(request: web.BaseRequest, response: web.StreamResponse, chunk: int) -> None:
    """A body over `chunk` goes out `chunk` bytes at a time (`PacedBody`), gzipped ones
    too (the cached gzip bytes, gpuwatchd/web.py)."""
    if not isinstance(response, web.Response):
        return
    body = response.body
    if not isinstance(body, bytes) or len(body) <= chunk:
        return
    kind = response.headers.get("Content-Type", "application/octet-stream")
    response.body = PacedBody(body, chunk, kind)
