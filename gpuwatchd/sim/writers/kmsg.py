"""The simulated node's /dev/kmsg: the kernel's ring of log records, as the device reads.

The kmsg source opens its device through `context.extras["kmsg_open"]` (on a real node,
`os.open` of /dev/kmsg) and reads it through the same three calls either way; this is
the other end, with the character device's semantics (Documentation/ABI/testing/
dev-kmsg): an open refused with EPERM where kernel.dmesg_restrict=1 and the daemon has
no CAP_SYSLOG; each read one whole record `prio,seq,usec,-;text\\n`; EAGAIN once the
reader is at the end (opened non-blocking); EPIPE once the reader's next record has
been overwritten (the ring holds `capacity` records), the reader then moved to the
oldest one kept. An open starts at the ring's end, as the source's SEEK_END does.
`<procfs>/sys/kernel/dmesg_restrict` says which applies, as on a real node.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import deque
from pathlib import Path

from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline

RING_RECORDS = 4096  # a 1 MiB log buffer (log_buf_len) of ~250-byte records
BOOTED = 1000.0  # seconds before the scenario's start (as /proc/uptime says)


def _escape(text: str) -> str:
    """The device escapes control characters and backslashes as \\xNN."""
    return "".join(f"\\x{ord(c):02x}" if c < " " or c in "\\\x7f" else c for c in text)


class SimKmsg:
    """The ring; `write(t)` logs every line of the timeline due by t."""

    def __init__(
        self, procfs_root: Path, timeline: Timeline, permitted: bool, capacity: int = RING_RECORDS
    ) -> None:
        self.timeline = timeline
        self.permitted = permitted
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._next = 0  # the sequence number of the next record
        self._lock = threading.Lock()
        self._written = -1.0  # lines up to here are in the ring (a line at 0 is due at 0)
        restrict = "1" if timeline.scenario.node.dmesg_restrict else "0"
        Files().put(os.path.join(procfs_root, "sys", "kernel", "dmesg_restrict"), restrict + "\n")

    def write(self, t: float) -> None:
        for line in self.timeline.kernel_lines(self._written, t):
            self.log(line.level, line.time, line.text)
        self._written = max(self._written, t)

    def log(self, level: int, t: float, text: str, facility: int = 0) -> None:
        """Add a record logged at scenario time t."""
        usec = int((BOOTED + t) * 1e6)
        with self._lock:
            record = f"{facility * 8 + level},{self._next},{usec},-;{_escape(text)}\n"
            self._ring.append((self._next, record.encode()))
            self._next += 1

    def restart(self) -> None:
        """A new ring under open readers (sequence numbers from 0 again)."""
        with self._lock:
            self._ring.clear()
            self._next = 0

    def open(self, path: str) -> SimKmsgDevice:
        if not self.permitted:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        with self._lock:
            return SimKmsgDevice(self, self._next)

    def read(self, position: int) -> tuple[int, bytes]:
        """(the reader's position after it, the record at `position`); raises as the
        device does."""
        with self._lock:
            first = self._ring[0][0] if self._ring else self._next
            if position > self._next:  # the ring started again below the reader
                position = first
            if position < first:
                raise _Overwritten(first)
            if position >= self._next:
                raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
            return position + 1, self._ring[position - first][1]


class _Overwritten(Exception):
    def __init__(self, first: int) -> None:
        self.first = first


class SimKmsgDevice:
    """One open file description of the simulated /dev/kmsg."""

    def __init__(self, ring: SimKmsg, position: int) -> None:
        self._ring = ring
        self._position = position

    def read(self) -> bytes:
        try:
            self._position, record = self._ring.read(self._position)
        except _Overwritten as e:
            self._position = e.first
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
        return record

    def close(self) -> None:
        self._position = -1
