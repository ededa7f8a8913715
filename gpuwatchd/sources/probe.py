"""Reports from gpuwatchd.probe inside training processes, attributed by the kernel.

The daemon binds a Unix datagram socket (`sources.probe.socket`) with SO_PASSCRED:
every datagram arrives with the sender's pid as the kernel saw it (SCM_CREDENTIALS), so
a report describes the process that really sent it and can only land on the GPUs NVML
lists that pid on. (With pid namespaces the kernel gives the pid in the daemon's
namespace; the daemon needs the host's, as NVML does: hostPID in Kubernetes.)

A thread drains the socket as datagrams arrive into a queue shared fairly between the
senders' tenants (`Inbox`; probe_tenants: the sender's cgroup cut where its own subtree
begins, never its uid, which PrivateUsers=yes merges and CAP_SETUID multiplies); each
poll empties it. A report is checked against `Report`
(size, JSON, schema, every number finite and in range); a bad one or one over the pid's
rate limit is counted by `result` and dropped, and never fails the poll. The socket's
directory must be the daemon's (or root's) and writable by no other user (see
`_safe_directory`). The latest report of each pid is kept until the pid exits or stays silent
for `expire_after`; at most 64 pids of one tenant and 256 in all are tracked
(probe_tenants.Roster: a poll reads each one's /proc/PID/stat). A pid that reports but is
on no GPU is counted in `probe_unplaced_processes`; what is dropped or unplaced is logged
at most once a minute.

While no pid is known (nothing to expire or place), a poll that receives nothing hands
back the last poll's samples, and the source rests (`idle`): its lane's thread sleeps
until a datagram comes instead of polling every second (scheduler.py).

Per GPU, the probed process with the most memory on it supplies the series: its batch
counters, DataLoader settings and, on the GPU its CUDA device is, the caching
allocator's state; on a MIG-enabled GPU, per GPU instance, under the families' instance
forms (probe_gpus: where the reports land). The simulator stands in for the kernel with
`context.extras["probe_receiver"]`, which hands over (pid, datagram) pairs the same way.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import select
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from gpuwatchd.config import ProbeConfig, SourceConfig
from gpuwatchd.metrics import Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError, read_small, settings_of
from gpuwatchd.sources.nvmlapi import quietly
from gpuwatchd.sources.probe_gpus import GPU_SPECS, INSTANCE_FORMS, Placer
from gpuwatchd.sources.probe_report import Report
from gpuwatchd.sources.probe_tenants import Roster, Tenants

log = logging.getLogger(__name__)

_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
RESULTS = ("accepted", "malformed", "too_large", "rate_limited", "queue_full", "pid_limit")


# -- metrics ----------------------------------------------------------------------------


REPORTS = counter(
    "probe_reports_total",
    "Probe reports received, by result: accepted, or dropped as malformed (not JSON, not "
    "the schema, a number out of range), too_large, rate_limited (the pid's), queue_full "
    "(the daemon's queue was full, from the tenant queuing the most; or the tenant was past "
    "its share of a drain window), pid_limit (a new pid of a tenant with as many tracked "
    "as one may have)",
    ("result",),
    export="nonzero",
)
# 0 on every node whose jobs run no probe: shown once one reports
PROCESSES = gauge(
    "probe_processes", "Processes whose probe reports are current", export="nonzero"
)
UNPLACED = gauge(
    "probe_unplaced_processes",
    "Processes reporting that NVML lists on no GPU (a pid namespace other than the host's?)",
    export="nonzero",
)


# -- the receiving end ------------------------------------------------------------------


class Receiver(Protocol):
    def receive(self, limit: int) -> list[tuple[int, bytes]]:
        """(sender pid, datagram) pairs waiting now, at most `limit` of them."""
        ...

    def close(self) -> None: ...

    # optional (the socket's): `notify(wake) -> bool`, True if nothing waits now and
    # `wake` will be called, once, when something comes


INBOX_CAPACITY = 1024  # datagrams waiting for a poll, all senders together (<= 8 MiB)


class Inbox:
    """Datagrams waiting for the next poll, queued per sender tenant (probe_tenants).

    Bounded by `capacity` in all. When it is full, the tenant holding the most loses its
    newest datagram ("queue_full"), so a tenant that floods only ever loses its own share
    and every other tenant's reports still get through; `take` serves the tenants in turn.
    """

    def __init__(self, capacity: int = INBOX_CAPACITY) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._queues: dict[str, deque[tuple[int, bytes]]] = {}
        self._size = 0
        self._lock = threading.Lock()

    def put(self, tenant: str, pid: int, data: bytes) -> None:
        with self._lock:
            mine = self._queues.setdefault(tenant, deque())
            if self._size >= self.capacity:
                self.dropped += 1
                biggest = max(self._queues.values(), key=len)
                if len(mine) + 1 >= len(biggest):
                    return  # this tenant holds (about) the most: its own datagram goes
                biggest.pop()
                self._size -= 1
            mine.append((pid, data))
            self._size += 1

    def __len__(self) -> int:
        return self._size

    def take(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to `limit` datagrams, oldest first within a tenant, one tenant after another."""
        out: list[tuple[int, bytes]] = []
        with self._lock:
            while self._size and len(out) < limit:
                for tenant, queue in list(self._queues.items()):
                    if len(out) == limit:
                        break
                    if queue:
                        out.append(queue.popleft())
                        self._size -= 1
                    if not queue:
                        del self._queues[tenant]
        return out


# The draining thread's bounds (issue 23, item 3). Unbounded, a flood kept it reading
# at the whole of the unit's CPUQuota=50%: the polls, evaluation and web front starved.
DRAIN_WINDOW = 0.1  # seconds: the budget's period (CPUQuota's, 100 ms), or until a poll
DRAIN_CPU_SHARE = 0.1  # of one core: at most 10 ms of CPU per window, a fifth of the quota
DRAIN_BURST = 64  # datagrams read between two looks at the CPU spent
TENANT_SHARE = 256  # datagrams one tenant may queue per window (256 ranks' burst); then dropped


class DrainBudget:
    """What the draining thread may spend per window (DRAIN_WINDOW, or until the next
    poll, whichever ends first): `cpu_share` of a core, then it rests until the window
    ends, the kernel meanwhile holding (and refusing) what is sent, for every sender
    alike; and `per_tenant` datagrams per tenant, past which one is dropped before any
    work but reading its tenant is done on it. `cpu_clock` must be the draining thread's
    (time.thread_time)."""

    def __init__(
        self,
        cpu_share: float = DRAIN_CPU_SHARE,
        per_tenant: int = TENANT_SHARE,
        window: float = DRAIN_WINDOW,
        cpu_clock: Callable[[], float] = time.thread_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_tenant = per_tenant
        self.window = window
        self._cpu_limit = cpu_share * window
        self._cpu_clock = cpu_clock
        self._clock = clock
        self._start = -math.inf
        self._cpu_start = 0.0
        self._counts: dict[str, int] = {}
        self._renewed = threading.Event()
        self.resting = threading.Event()  # set while the thread rests (for tests)

    def begin(self) -> None:
        """The draining thread, before a burst: a new window once the last has ended."""
        if self._renewed.is_set() or self._clock() - self._start >= self.window:
            self._renewed.clear()
            if self._clock() - self._start >= self.window:
                self._counts = {}
            self._start, self._cpu_start = self._clock(), self._cpu_clock()

    def admit(self, tenant: str) -> bool:
        queued = self._counts.get(tenant, 0)
        if queued >= self.per_tenant:
            return False
        self._counts[tenant] = queued + 1
        return True

    def spent(self) -> bool:
        return self._cpu_clock() - self._cpu_start >= self._cpu_limit

    def rest(self) -> None:
        self.resting.set()
        self._renewed.wait(max(0.0, self._start + self.window - self._clock()))
        self.resting.clear()

    def renew(self) -> None:
        """A poll took the inbox: every tenant's share and the CPU budget start again."""
        self._counts = {}
        self._renewed.set()


class ProbeSocket:
    """The daemon's Unix datagram socket, drained by a thread as datagrams arrive.

    The kernel queues at most net.unix.max_dgram_qlen (10 by default) datagrams on the
    socket, whatever SO_RCVBUF says, and a sender meeting a full queue gets EAGAIN: a
    socket read once a poll loses most of what many processes send at once. The thread
    moves each datagram, with the sender's pid as the kernel gives it, into an Inbox that
    the poll empties, queued by the pid's tenant (`tenants`).
    """

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        capacity: int = INBOX_CAPACITY,
        budget: DrainBudget | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        try:
            self._sock = _bind(path)
        except OSError as e:
            why = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else e.strerror
            raise SourceError(
                f"cannot listen for probe reports on {path}: {why or e} "
                "(set `sources.probe.socket:` to a path in a directory of the daemon's own)"
            ) from None
        self._sock.setblocking(False)
        self._ancillary = socket.CMSG_SPACE(_UCRED.size)
        self._inbox = Inbox(capacity)
        self._budget = budget or DrainBudget()
        self._tenants = tenants or Tenants()
        self._lock = threading.Lock()
        self._closing = False
        self._wake: Callable[[], None] | None = None  # `notify`'s, until a datagram comes
        self._thread = threading.Thread(
            target=self._wait_and_drain, name="probe-socket", daemon=True
        )
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Datagrams dropped: the inbox was full, or their tenant had spent its share."""
        return self._inbox.dropped

    def _wait_and_drain(self) -> None:
        readable = select.poll()  # not select(): the descriptor may be above 1023
        readable.register(self._sock, select.POLLIN)
        while not self._closing:
            if any(events & select.POLLNVAL for _, events in readable.poll()):
                return  # closed under us
            self._budget.begin()
            self._drain(DRAIN_BURST)
            if self._budget.spent():
                self._budget.rest()  # the kernel queues (and refuses) meanwhile

    def _drain(self, most: int) -> None:
        """Move up to `most` datagrams the kernel holds into the inbox. Under the lock, so
        that a poll's `receive` sees every datagram whose send returned before it. One
        from a tenant past its share of this window is dropped before any other work."""
        with self._lock:
            for _ in range(most):
                if self._closing:
                    return
                try:
                    # one byte more than allowed, to tell a too-large datagram from a full one
                    data, ancillary, flags, _ = self._sock.recvmsg(
                        self.max_bytes + 1, self._ancillary
                    )
                except OSError:  # BlockingIOError: all taken
                    return
                pid = 0
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                        pid = _UCRED.unpack_from(payload)[0]
                tenant = self._tenants.of(pid)
                if not self._budget.admit(tenant):
                    self._inbox.dropped += 1  # under self._lock, as every put
                    continue
                if flags & socket.MSG_TRUNC:
                    data = data + b"\0"  # marks it too large whatever was read
                self._inbox.put(tenant, pid, data)
                wake, self._wake = self._wake, None
                if wake is not None:
                    wake()

    def receive(self, limit: int) -> list[tuple[int, bytes]]:
        """What waits, after what the kernel still holds (at most `limit` more: under a
        flood its queue never empties). Each poll starts a new budget."""
        self._drain(min(limit, INBOX_CAPACITY))
        with self._lock:  # not in the middle of a burst's admissions
            self._budget.renew()
        return self._inbox.take(limit)

    def notify(self, wake: Callable[[], None]) -> bool:
        """Have `wake` called (once, by the draining thread) when the next datagram comes;
        False, and no call, if one is waiting already. Under the drain's lock, so that
        none can come in between unseen."""
        with self._lock:
            if len(self._inbox) or self._closing:
                return False
            self._wake = wake
        return True

    def close(self) -> None:
        self._closing = True
        self._budget.renew()  # ends a rest
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's poll
        self._thread.join(5)
        self._sock.close()
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                self.path.unlink()


def _bind(path: Path) -> socket.socket:
    """A socket bound at `path`, mode 0666, in a directory no other user controls."""
    _safe_directory(path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, "something that is not a socket is there; left alone")
        _take_over(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # room for bursts
        sock.bind(os.fspath(path))
        # no other user can replace the new socket in a safe directory; still, never
        # follow a symlink to chmod something else (os.chmod has no lchmod on Linux)
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(errno.EEXIST, "what is at the path now is not the socket bound")
        os.chmod(path, 0o666)  # any local process may report; the kernel says who
    except BaseException:
        sock.close()
        raise
    return sock


def _safe_directory(directory: Path) -> None:
    """Create the socket's directory (0755, the daemon's), or check that an existing one
    (systemd's RuntimeDirectory=, a hostPath) belongs to the daemon's user or root and
    that no other user may write in it: whoever can write there can replace the socket
    with a symbolic link. The sticky bit (/tmp) does not make a shared directory safe:
    another user can bind the path first, while the daemon is down, and receive every
    tenant's reports, or squat it to keep the probe out. Checked through a descriptor
    opened without following a symbolic link."""
    where = f"{directory} "
    try:
        os.mkdir(directory, 0o755)
        created = True
    except FileExistsError:
        created = False
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if stat.S_ISLNK(os.lstat(directory).st_mode):
            raise OSError(e.errno, where + "is a symbolic link; use the real directory") from e
        raise OSError(e.errno, where + "is not a directory") from e
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (me, 0):
            raise OSError(
                errno.EPERM,
                where + f"is owned by uid {st.st_uid}, not by the daemon's (uid {me}) or root",
            )
        if created:
            os.fchmod(fd, 0o755)  # whatever the umask (systemd's UMask=0077)
            st = os.fstat(fd)
        group_writable = st.st_mode & stat.S_IWGRP and st.st_gid not in (os.getegid(), 0)
        if st.st_mode & stat.S_IWOTH or group_writable:  # sticky or not
            raise OSError(
                errno.EPERM,
                where + f"(mode {stat.S_IMODE(st.st_mode):04o}) is writable by other users",
            )
    finally:
        os.close(fd)


def _take_over(path: Path) -> None:
    """Remove a dead daemon's socket file; refuse a live one's (doctor beside a daemon)."""
    if os.lstat(path).st_uid not in (os.geteuid(), 0):
        raise OSError(errno.EPERM, "another user's socket is there; left alone")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(os.fspath(path))
    except ConnectionRefusedError:
        path.unlink()  # nobody bound to it: left by a daemon that died
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another process (a running gpuwatchd?) receives on it")


# -- the source -------------------------------------------------------------------------

LOG_EVERY = 60.0  # seconds between two lines of one kind (drops, unplaced pids)
MAX_LISTED = 10  # pids a line names


@dataclass
class _Pid:
    report: Report
    seen: float  # clock time of its latest accepted report
    tokens: float  # rate limit: reports it may still send now
    refilled: float
    start: int | None  # the sender's start time (/proc/PID/stat): pid + start is one process
    tenant: str  # whose pids it counts among (probe_tenants)


class _Lines:
    """A line of each kind at most every LOG_EVERY seconds: a flood of new senders made
    a line each (1,068 a second, issue 23), then one a poll (issue 41)."""

    def __init__(self) -> None:
        self._next: dict[str, float] = {}

    def ready(self, kind: str, now: float) -> bool:
        if now < self._next.get(kind, -math.inf):
            return False
        self._next[kind] = now + LOG_EVERY
        return True


@register
class ProbeSource(Source):
    name = "probe"
    # per GPU, the node's, then per MIG GPU instance (the per-GPU ones' instance forms)
    metrics = (*GPU_SPECS, REPORTS, PROCESSES, UNPLACED, *INSTANCE_FORMS.values())

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self.settings = settings_of(config, ProbeConfig)
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._receiver: Receiver | None = context.extras.get("probe_receiver")
        self._proc = os.fspath(context.procfs)
        self._tenants = Tenants(self._proc)
        self._roster: Roster[_Pid] = Roster()
        self._results = dict.fromkeys(RESULTS, 0)
        self._lines = _Lines()
        self._dropped: dict[str, int] = {}  # by result, since the last line saying so
        self._first_drop: tuple[int, str, str] | None = None  # (pid, result, why) of those
        self._unplaced: set[int] = set()
        self._newly_unplaced: list[int] = []  # since the last line saying so
        self._placer = Placer(context, self.settings.interval, self._clock)  # NVML's side
        self._quiet: list[Sample] | None = None  # the last samples, while no pid is known

    def close(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
        nv = self._placer.nv
        self._placer.close()
        if nv is not None:
            quietly(nv, nv.nvmlShutdown)

    def collect(self) -> list[Sample]:
        if self._receiver is None:
            self._receiver = ProbeSocket(
                self.settings.socket, self.settings.max_report_bytes, tenants=self._tenants
            )
        now = self._clock()
        received = self._receiver.receive(INBOX_CAPACITY)  # all since the last poll
        dropped = getattr(self._receiver, "dropped", 0)
        if self._quiet is not None and not received and dropped == self._results["queue_full"]:
            return self._quiet  # nothing came, no pid to expire or place: the same as before
        for pid, data in received:
            self._accept(pid, data, now)
        self._tenants.renew()  # a pid may be another process by the next poll
        self._results["queue_full"] = dropped
        self._log_drops(now)
        self._expire(now)
        samples: list[Sample] = []
        pids = self._roster.pids
        reports = {pid: state.report for pid, state in pids.items()}
        placed = self._placer.samples(reports, samples) if reports else set()
        unplaced = pids.keys() - placed
        self._log_unplaced(unplaced, now)
        samples.extend(Sample(REPORTS.name, (r,), float(n)) for r, n in self._results.items())
        samples.append(Sample(PROCESSES.name, (), float(len(pids))))
        samples.append(Sample(UNPLACED.name, (), float(len(unplaced))))
        self._quiet = None if pids else samples
        return samples

    def _log_unplaced(self, unplaced: set[int], now: float) -> None:
        """Pids newly on no GPU, in one line a minute at most (issue 41: a line a pid)."""
        room = MAX_LISTED - len(self._newly_unplaced)
        self._newly_unplaced += sorted(unplaced - self._unplaced)[:room]
        self._unplaced = unplaced
        if self._newly_unplaced and self._lines.ready("unplaced", now):
            new, self._newly_unplaced = self._newly_unplaced, []
            log.warning(
                "probe: pid %s reports but NVML lists it on no GPU (%d pid(s) in all now); "
                "is the daemon in the host's pid namespace?",
                ", ".join(map(str, new)), len(unplaced),
            )  # fmt: skip

    def idle(self, wake: Callable[[], None]) -> bool:
        """True if the last poll's samples stay as they are until a datagram comes (no pid
        is known, to expire or place, and none waits); the socket then calls `wake`.
        Never with a receiver that cannot tell; the simulator's says so only where the
        scenario has no probe at all."""
        notify = getattr(self._receiver, "notify", None)
        return self._quiet is not None and notify is not None and bool(notify(wake))

    # -- accepting ----------------------------------------------------------------------

    def _accept(self, pid: int, data: bytes, now: float) -> None:
        if len(data) > self.settings.max_report_bytes:
            self._drop(pid, "too_large", f"{len(data)} bytes or more")
            return
        state = self._roster.pids.get(pid)
        if state is not None and not self._take_token(state, now):
            self._results["rate_limited"] += 1
            return
        try:
            report = Report.model_validate(json.loads(data))
        # JSONDecodeError is a ValueError; a deeply nested array exhausts the decoder's stack
        except (ValueError, ValidationError, RecursionError) as e:
            self._drop(pid, "malformed", str(e).splitlines()[0])
            return
        if pid <= 0:
            self._drop(pid, "malformed", "no sender credentials")
            return
        if state is None:
            tenant = self._tenants.of(pid)
            if not self._roster.room(tenant):
                self._drop(pid, "pid_limit", f"{tenant} has as many pids reporting as it may")
                return
            rate = self.settings.max_reports_per_second
            start = self._start_time(pid)
            self._roster.add(pid, _Pid(report, now, 2 * rate - 1, now, start, tenant))
        else:
            state.report, state.seen = report, now
        self._results["accepted"] += 1

    def _take_token(self, state: _Pid, now: float) -> bool:
        rate = self.settings.max_reports_per_second
        state.tokens = min(2 * rate, state.tokens + (now - state.refilled) * rate)
        state.refilled = now
        if state.tokens < 1:
            return False
        state.tokens -= 1
        return True

    def _drop(self, pid: int, result: str, why: str) -> None:
        self._results[result] += 1
        self._dropped[result] = self._dropped.get(result, 0) + 1
        if self._first_drop is None:
            self._first_drop = (pid, result, why)

    def _log_drops(self, now: float) -> None:
        """The reports dropped since the last such line, in one line a minute at most."""
        if self._first_drop is None or not self._lines.ready("drops", now):
            return
        counts, self._dropped = self._dropped, {}
        (pid, result, why), self._first_drop = self._first_drop, None
        log.warning(
            "probe: dropped %d report(s) (%s); the first, pid %d (%s): %s",
            sum(counts.values()), ", ".join(f"{r} {n}" for r, n in sorted(counts.items())),
            pid, result, why,
        )  # fmt: skip

    def _expire(self, now: float) -> None:
        """Forget a pid silent too long, exited, or now another process (the pid reused:
        its report must not land on the new process's GPUs)."""
        for pid, state in list(self._roster.pids.items()):
            start = self._start_time(pid)
            if (
                now - state.seen > self.settings.expire_after
                or start is None
                or (start != state.start)
            ):
                self._roster.remove(pid)

    def _start_time(self, pid: int) -> int | None:
        """/proc/PID/stat's starttime (field 22, after the last ')'); None if gone."""
        try:
            fields = read_small(f"{self._proc}/{pid}/stat", 4096).rpartition(b")")[2].split()
            return int(fields[19])
        except (OSError, ValueError, IndexError):
            return None
