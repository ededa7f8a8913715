"""The nvml source's reader thread and one poll's hand-off to it.

A call into a GPU wedged in the driver blocks and cannot be interrupted, so the polls'
NVML calls are made by a `_Reader` thread; `Polling.collect` waits for it at most the
source's patience, then reports the GPUs it read, the hung GPU (identity, Xids,
`gpu_nvml_hung_seconds`) and the ones not reached (last values, `gpu_nvml_stale`), and
retires a reader that blocked. `Polling` is a mixin of NvmlSource, which sets the state
it declares.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from gpuwatchd.metrics import Sample
from gpuwatchd.scheduler import name_os_thread
from gpuwatchd.sources.nvml.metrics import HUNG, LAST_XID, STALE, XID, XID_INSTANCE
from gpuwatchd.sources.nvml.reads import _Gpu
from gpuwatchd.sources.nvmlapi import ListedGpu, ProcessTable

NO_INSTANCE = 0xFFFFFFFF  # nvmlEventData_t's gpuInstanceId when the Xid is the whole GPU's
_MAX_EVENTS_PER_POLL = 1024

log = logging.getLogger("gpuwatchd.sources.nvml")


class _Done:
    """Set by the reader once a poll's work is done: a lock held until then (an Event's
    wait, set and clear run Python code on both threads; these are calls into C)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True

    def is_set(self) -> bool:
        return not self._lock.locked()


class _Poll:
    """One poll's reads, made by the reader thread: the samples of each GPU it read."""

    __slots__ = ("lock", "read", "closed", "error", "done")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read: dict[int, list[Sample]] = {}
        self.closed = False  # the poll stopped waiting: the reader stops at the next GPU
        self.error: BaseException | None = None
        self.done = _Done()


class _Reader:
    """The thread that makes the polls' NVML calls, one poll at a time. A call into a
    GPU wedged in the driver blocks and cannot be interrupted: the poll waits for it a
    bounded time, goes on without that GPU and retires this reader, which ends once its
    call returns; a new reader makes the next polls' calls."""

    _ids = itertools.count()

    def __init__(self, work: Callable[[_Poll], None]) -> None:
        self._work = work
        self._polls: queue.SimpleQueue[_Poll | None] = queue.SimpleQueue()
        self.retired = False
        self.thread = threading.Thread(
            target=self._run, name=f"nvml-reader-{next(self._ids)}", daemon=True
        )
        self.thread.start()

    def submit(self, poll: _Poll) -> None:
        self._polls.put(poll)

    def retire(self) -> None:
        self.retired = True
        self._polls.put(None)

    def _run(self) -> None:
        name_os_thread("nvml-reader")  # its CPU shows as the daemon's (top -H, benchmarks)
        while True:
            poll = self._polls.get()
            if poll is None or self.retired:
                return
            try:
                self._work(poll)
            except BaseException as e:  # handed to the poll, raised there
                poll.error = e
            poll.done.set()
            if self.retired:
                return


def _wait(done: _Done, thread: threading.Thread, timeout: float) -> bool:
    return done.wait(timeout)


class Polling:
    """NvmlSource's polls: the hand-off to its reader and the reader's work."""

    _nv: Any
    _patience: float
    _reader: _Reader | None
    _wait_reader: Callable[[_Done, threading.Thread, float], bool]
    _events_lock: threading.Lock
    _gpus: list[_Gpu]
    _globals: list[Sample]
    _clock: Callable[[], float]
    _table: ProcessTable
    _start: Callable[[], None]
    _identify: Callable[[_Gpu], None]
    _register_events: Callable[[_Gpu], None]
    _event_set: Any
    _wait: Callable[..., Any]
    _xid_type: int
    _mig_type: int
    _mig_event: Callable[[_Gpu], None]
    _by_address: dict[int, _Gpu]
    _now: Callable[[], float]
    _describe: Callable[[Any], str]
    _collect_gpu: Callable[[_Gpu, list[Sample]], None]

    def collect(self) -> list[Sample]:
        """The reader thread reads every GPU it can; what it has not read within
        `_patience` (a call blocked on a GPU) is reported without waiting longer."""
        if self._nv is None:
            self._start()
        poll, reader = _Poll(), self._reader
        if reader is None:
            reader = self._reader = _Reader(self._read_gpus)
        reader.submit(poll)
        if not self._wait_reader(poll.done, reader.thread, self._patience):
            with poll.lock:  # the reader adds no GPU to poll.read after this
                poll.closed = True
            reader.retire()
            self._reader = None
        elif poll.error is not None:
            raise poll.error
        read = poll.read  # done or closed: no longer written
        out = list(self._globals)
        listed = []
        now = self._clock()
        for gpu in self._gpus:
            samples, since = read.get(gpu.index), gpu.busy_since
            lists: dict[str, dict[int, float]] | None = None
            if samples is None and since is not None:  # inside a call that has not returned
                self._hung(gpu, now - since, out)
            else:  # read, or else not reached this poll (held up behind a GPU that blocked)
                out += gpu.last if samples is None else samples
                flags = gpu.read_flags
                if flags is not None:  # identified
                    out += flags if samples is not None else (_stale(gpu), flags[1])
                lists = gpu.last_lists
            for (gi, profile, xid), count in gpu.instance_xids.items():
                out.append(Sample(XID_INSTANCE.name, (*gpu.labels, gi, profile, str(xid)), count))
            listed.append(ListedGpu(gpu.index, gpu.labels, gpu.bus_id, lists))
        self._table.publish(now, listed)
        return out

    def _hung(self, gpu: _Gpu, seconds: float, out: list[Sample]) -> None:
        """A GPU whose call blocks: what it is and its Xids, no readings (unknown now)."""
        if not gpu.hung:
            gpu.hung = True
            log.warning(
                "nvml: GPU %d: an NVML call on it has not returned for %.1fs; the other "
                "GPUs are read without it",
                gpu.index,
                seconds,
            )
        if gpu.info is not None:
            out.append(gpu.info)
        for xid, count in gpu.xids.items():
            out.append(Sample(XID.name, gpu.labels + (str(xid),), float(count)))
        if gpu.last_xid is not None:
            out.append(Sample(LAST_XID.name, gpu.labels, gpu.last_xid))
        out.append(Sample(HUNG.name, gpu.labels, seconds))

    def _read_gpus(self, poll: _Poll) -> None:
        """The reader's work for one poll: identities and event registrations, the Xid
        events, then each GPU's reads. A GPU is taken (its lock) for each step; one held
        by a reader given up on is left alone. Stops at the next GPU once the poll has
        stopped waiting for it."""
        for gpu in self._gpus:
            if gpu.handle is not None and gpu.events != "pending":
                continue
            if not self._take(gpu, poll):
                if poll.closed:
                    return
                continue
            try:
                if gpu.handle is None:
                    self._identify(gpu)
                if gpu.handle is not None and gpu.events == "pending":
                    self._register_events(gpu)
            finally:
                self._give(gpu)
        if self._events_lock.acquire(blocking=False):  # not while a drain is stuck
            try:
                self._drain_xid_events()
            finally:
                self._events_lock.release()
        for gpu in self._gpus:
            if not self._take(gpu, poll):
                if poll.closed:
                    return
                continue
            mine: list[Sample] = []
            try:
                self._collect_gpu(gpu, mine)
                if gpu.hung:
                    log.info("nvml: GPU %d: NVML calls return again", gpu.index)
                    gpu.hung = False
                gpu.last = mine
                gpu.last_lists = None if gpu.lost else dict(gpu.lists)
            finally:
                self._give(gpu)
            with poll.lock:
                if poll.closed:
                    return
                poll.read[gpu.index] = mine

    def _drain_xid_events(self) -> None:
        """Take every pending event without waiting (timeout 0): Xids, and MIG
        configuration changes (`_mig_event`: the GPU's MIG devices are read again now)."""
        if self._event_set is None:
            return
        nv = self._nv
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                data = self._wait(self._event_set, 0)
            except nv.NVMLError as e:
                if e.value != nv.NVML_ERROR_TIMEOUT:
                    log.debug("nvml: event wait failed: %s", self._describe(e))
                return
            gpu = self._by_address.get(ctypes.cast(data.device, ctypes.c_void_p).value or 0)
            if gpu is None:
                continue
            if data.eventType & self._xid_type:
                self._count_xid(gpu, data)
            elif data.eventType & self._mig_type:
                self._mig_event(gpu)

    def _count_xid(self, gpu: _Gpu, data: Any) -> None:
        """An Xid, counted for the GPU; on a MIG-enabled GPU the event names the GPU
        instance it hit (gpuInstanceId; 0xFFFFFFFF: the whole GPU's), counted for that
        instance too."""
        xid = int(data.eventData)
        gpu.xids[xid] = gpu.xids.get(xid, 0) + 1
        gpu.last_xid = self._now()
        gi = int(getattr(data, "gpuInstanceId", NO_INSTANCE))
        if gi == NO_INSTANCE:
            log.warning("nvml: GPU %d: Xid %d", gpu.index, xid)
            return
        key = (str(gi), _profile_of(gpu, gi), xid)
        gpu.instance_xids[key] = gpu.instance_xids.get(key, 0) + 1
        log.warning("nvml: GPU %d: Xid %d on MIG GPU instance %d", gpu.index, xid, gi)

    def _take(self, gpu: _Gpu, poll: _Poll) -> bool:
        if poll.closed or not gpu.lock.acquire(blocking=False):
            return False
        gpu.busy_since = self._clock()
        return True

    def _give(self, gpu: _Gpu) -> None:
        gpu.busy_since = None
        gpu.lock.release()


def _stale(gpu: _Gpu) -> Sample:
    """gpu_nvml_stale 1: the GPU was not reached this poll (its last values stand)."""
    return Sample(STALE.name, gpu.labels, 1.0)


def _profile_of(gpu: _Gpu, gi: int) -> str:
    """The profile of the GPU's MIG GPU instance `gi`, as discovered (mig.py); "" if the
    instance is not known yet."""
    for device in getattr(gpu.mig, "devices", None) or ():
        if device.labels[2] == str(gi):
            return str(device.labels[4])
    return ""
