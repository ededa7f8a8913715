"""The in-process probe: one line in a training loop tells gpuwatchd why the GPU waits.

    from gpuwatchd import probe

    for batch in probe.watch(loader):      # a DataLoader or any iterable
        ...

or, around a fetch of your own:

    with probe.waiting():
        batch = next(it)

It measures the time blocked fetching the next batch (waiting for input) against the
time between batches (computing), reads the DataLoader's settings and, once CUDA is in
use, the caching allocator's state, and sends a small JSON report to the local gpuwatchd
about once a second over a Unix datagram socket (`GPUWATCHD_PROBE_SOCKET`, default
/run/gpuwatchd/probe.sock). The kernel tells the daemon which pid sent a report
(SO_PASSCRED), so a report can only ever describe the sender's own GPUs. Counters are
cumulative: a dropped report loses nothing but resolution.

It never blocks and never raises into the training loop: with no daemon or a restarted
daemon the report is dropped and training carries on. A full socket (the kernel queues
~10 datagrams for the daemon, shared by every process on the node) hands the report to a
thread that waits for room, at most one interval, so that another process's flood
delays this one's reports instead of shutting them out; only the latest report waits
there (they are cumulative). `GPUWATCHD_PROBE=0` turns it off. Importable without torch;
uses torch only if the program imported it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["DEFAULT_SOCKET", "Probe", "configure", "default", "waiting", "watch"]

DEFAULT_SOCKET = "/run/gpuwatchd/probe.sock"
SOCKET_ENV = "GPUWATCHD_PROBE_SOCKET"
ENABLE_ENV = "GPUWATCHD_PROBE"
VERSION = 1

T = TypeVar("T")

_LOADER_SETTINGS = (
    "num_workers",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "batch_size",
)


class Probe:
    """One training process's measurements and its channel to the daemon."""

    def __init__(
        self, socket_path: str | None = None, interval: float = 1.0, snapshot_every: float = 30.0
    ) -> None:
        self.path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.interval = interval  # seconds between reports
        self.snapshot_every = snapshot_every  # seconds between allocator snapshots (costly)
        self.enabled = os.environ.get(ENABLE_ENV, "1") != "0"
        self.batches = 0
        self.wait_seconds = 0.0
        self.compute_seconds = 0.0
        self.loader: dict[str, Any] | None = None
        self.sent = self.dropped = self.errors = 0
        self._next_report = 0.0  # perf_counter time of the next report
        self._next_snapshot = 0.0
        self._largest_free: int | None = None
        self._cuda_init: tuple[float, float] | None = None  # (seconds, unix time done)
        self._sock: socket.socket | None = None
        self._sock_pid = 0  # a forked child opens its own socket
        self._later: _Later | None = None  # waits for room in a full queue (this pid's)
        self._wait_start = 0.0
        self._last_ready: float | None = None  # when the last explicit wait ended
        self.time_cuda_init()

    # -- measuring ---------------------------------------------------------------------

    def watch(self, iterable: Iterable[T]) -> Iterator[T]:
        """Iterate `iterable`, timing each fetch; reads a DataLoader's settings."""
        settings = loader_settings(iterable)
        if settings:
            self.loader = settings
        self.time_cuda_init()
        return self._iterate(iter(iterable))

    def _iterate(self, it: Iterator[T]) -> Iterator[T]:
        clock = time.perf_counter
        last: float | None = None  # compute time starts at this loop's first batch
        while True:
            start = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            ready = clock()
            self.wait_seconds += ready - start
            if last is not None:
                self.compute_seconds += start - last
            last = ready
            self.batches += 1
            if ready >= self._next_report:
                self._report(ready)
            yield item

    def waiting(self) -> Probe:
        """`with probe.waiting(): batch = next(it)`: time outside is computing."""
        return self

    def __enter__(self) -> Probe:
        self._wait_start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        ready = time.perf_counter()
        self.wait_seconds += ready - self._wait_start
        if self._last_ready is not None:
            self.compute_seconds += self._wait_start - self._last_ready
        self._last_ready = ready
        self.batches += 1
        if ready >= self._next_report:
            self._report(ready)

    def time_cuda_init(self) -> None:
        """Time CUDA's initialisation (the first CUDA call) if it has not happened yet.

        Wraps torch.cuda._lazy_init, which every first CUDA use goes through; only
        possible when torch is imported and CUDA not yet initialised.
        """
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        original = getattr(cuda, "_lazy_init", None)
        if original is None or getattr(original, "_gpuwatchd", False):
            return
        try:
            if cuda.is_initialized():  # type: ignore[union-attr]
                return
        except Exception:
            return

        def timed_lazy_init() -> Any:
            if cuda.is_initialized():  # type: ignore[union-attr]
                return original()
            start = time.perf_counter()
            result = original()
            self._cuda_init = (time.perf_counter() - start, time.time())
            return result

        timed_lazy_init._gpuwatchd = True  # type: ignore[attr-defined]
        cuda._lazy_init = timed_lazy_init  # type: ignore[union-attr]

    # -- reporting ---------------------------------------------------------------------

    def _report(self, now: float) -> None:
        self._next_report = now + self.interval
        if not self.enabled:
            return
        try:
            data = self.report_bytes(now)
            self._socket().sendto(data, self.path)
            self.sent += 1
        except BlockingIOError:  # the daemon's queue is full: other processes' reports
            self._send_later(data)
        except OSError:  # no daemon, the socket went away
            self.dropped += 1
        except Exception:  # a bug of ours must never stop training
            self.errors += 1

    def _send_later(self, data: bytes) -> None:
        later = self._later
        if later is None or later.pid != os.getpid():  # a forked child starts its own
            later = self._later = _Later(self)
        later.put(data)

    def report_bytes(self, now: float | None = None) -> bytes:
        """The report as sent: compact JSON (schema: gpuwatchd.sources.probe_report.Report)."""
        now = time.perf_counter() if now is None else now
        report: dict[str, Any] = {
            "v": VERSION,
            "batches": self.batches,
            "wait_seconds": round(self.wait_seconds, 6),
            "compute_seconds": round(self.compute_seconds, 6),
        }
        for key, env in (("rank", "RANK"), ("local_rank", "LOCAL_RANK")):
            value = os.environ.get(env, "")
            if value.isdigit():
                report[key] = int(value)
        if self.loader:
            report["loader"] = self.loader
        cuda = self._cuda_state(now)
        if cuda:
            report["cuda"] = cuda
        return json.dumps(report, separators=(",", ":")).encode()

    def _cuda_state(self, now: float) -> dict[str, Any] | None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return None
        device = cuda.current_device()
        stats = cuda.memory_stats(device)
        state: dict[str, Any] = {
            "device": device,
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
            "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
        }
        uuid = getattr(cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            state["uuid"] = str(uuid)
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.snapshot_every
            self._largest_free = largest_free_block(cuda.memory_snapshot(), device)
        if self._largest_free is not None:
            state["largest_free_block_bytes"] = self._largest_free
        if self._cuda_init is not None:
            state["init_seconds"], state["init_timestamp"] = self._cuda_init
        return state

    def _socket(self) -> socket.socket:
        pid = os.getpid()
        if self._sock is None or self._sock_pid != pid:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            self._sock, self._sock_pid = sock, pid
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Later(threading.Thread):
    """Sends the latest report that found the queue full with a blocking send, waiting
    for room at most one interval: the kernel wakes a waiting sender when the daemon
    drains, so it gets its turn beside a process that floods (the training thread never
    waits). A newer report replaces one still waiting; the replaced one is dropped."""

    def __init__(self, probe: Probe) -> None:
        super().__init__(name="gpuwatchd-probe", daemon=True)
        self.probe, self.pid = probe, os.getpid()
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.data: bytes | None = None
        self.start()

    def put(self, data: bytes) -> None:
        with self.lock:
            if self.data is not None:
                self.probe.dropped += 1
            self.data = data
        self.ready.set()

    def run(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            while True:
                self.ready.wait()
                with self.lock:
                    data, self.data = self.data, None
                    self.ready.clear()
                if data is None:
                    continue
                sock.settimeout(self.probe.interval)
                try:
                    sock.sendto(data, self.probe.path)
                    self.probe.sent += 1
                except OSError:  # still full after an interval, or the daemon went away
                    self.probe.dropped += 1


def loader_settings(loader: object) -> dict[str, Any] | None:
    """A torch DataLoader's (or look-alike's) input settings, or None for other iterables."""
    if not hasattr(loader, "num_workers"):
        return None
    settings: dict[str, Any] = {}
    for name in _LOADER_SETTINGS:
        value = getattr(loader, name, None)
        if isinstance(value, bool | int) and not (name == "batch_size" and isinstance(value, bool)):
            settings[name] = value
    return settings


def largest_free_block(snapshot: list[dict[str, Any]], device: int) -> int:
    """The largest cached-but-free block on `device`, from torch.cuda.memory_snapshot()."""
    largest = 0
    for segment in snapshot:
        if segment.get("device") != device:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
    return largest


_default: Probe | None = None


def default() -> Probe:
    """The process's probe, created on first use."""
    global _default
    if _default is None:
        _default = Probe()
    return _default


def configure(**settings: Any) -> Probe:
    """Replace the process's probe: `configure(socket_path=..., interval=...)`."""
    global _default
    if _default is not None:
        _default.close()
    _default = Probe(**settings)
    return _default


def watch(iterable: Iterable[T]) -> Iterator[T]:
    """`for batch in probe.watch(loader):` with the process's probe."""
    return default().watch(iterable)


def waiting() -> Probe:
    """`with probe.waiting(): batch = next(it)` with the process's probe."""
    return default()
