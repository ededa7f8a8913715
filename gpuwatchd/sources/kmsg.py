"""The kernel log: the lines operators act on, read from /dev/kmsg, tied to GPUs.

What NVML's events and the sysfs counters leave out is in the kernel log: the process
and the driver's own words of an Xid, the NVSwitches' SXids, a GPU fallen off the bus,
PCIe AER errors naming a function, NVMe I/O timeouts, mlx5 links going down, and the
OOM killer's kills (kmsglines.py parses them).

Reading. The device is opened non-blocking and moved to the log's end (SEEK_END) when
opened: the daemon follows what is logged from its start on and never replays the ring
(at boot it holds hours of old lines). Each read returns one record; a poll reads at
most `max_records` of them (the rest wait for the next poll: a burst of lines never
stretches a poll) and stops at EAGAIN. A reader whose next record the kernel has
overwritten meanwhile gets EPIPE and is moved to the oldest record kept: the records
skipped, and any other gap in the sequence numbers, are counted as lost
(`kmsg_records_lost_total`). Sequence numbers going back mean a new ring (a node that
booted while the daemon's device stayed open cannot happen; a container's or a test's
log restarted can): the source follows it from there.

Privileges. With kernel.dmesg_restrict=1 (Debian's and Ubuntu's default) opening the
device needs CAP_SYSLOG; the shipped unit and DaemonSet grant none (docs/deploy.md has
the opt-in). Refused, the source is down with the reason and `kmsg_state`
`not_permitted`, and tries again every RETRY_REFUSED seconds; every rule that reads its
series reads them as "nothing logged", so no cause becomes not evaluable for want of it.

Ties. A line names a GPU by PCI address (Xid, fallen off the bus), a function on its
PCIe path (AER: the GPUs below it), an NVSwitch (the GPUs whose NVLinks reach it, as the
nvml source learned from NVML: ties.SwitchTable), or a pid (the GPU whose main process,
or child of it, the processes source saw: ties.PidTable). Per-GPU series are labelled
`gpu_bus_id`, as the pcie source's, and join the GPUs on it. The driver's text is kept
per GPU and event in `kmsg_gpu_message` (never exported: its labels are free text) for
the rules' summaries; node-wide lines (NVSwitch ports, NVMe, NIC links, every OOM kill)
are counted per device.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from gpuwatchd.config import KmsgConfig, SourceConfig
from gpuwatchd.metrics import Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError, settings_of
from gpuwatchd.sources.kmsglines import KERNEL_FACILITY, Line, classify, parse_record
from gpuwatchd.sources.pcie import GpuPaths
from gpuwatchd.sources.ties import pid_table, switch_table

log = logging.getLogger(__name__)

STATES = ("reading", "not_permitted", "not_present", "error")
_ANON_RSS = re.compile(r"anon-rss:(\d{1,15})kB")
RETRY_REFUSED = 60.0  # seconds between opens while the device refuses the daemon
RECORD_BYTES = 8192  # above the kernel's longest record (1 KiB text + its dictionary)

_GPU = ("gpu_bus_id",)
STATE = gauge(
    "kmsg_state",
    "1 for the kmsg source's current state (reading, not_permitted: no CAP_SYSLOG while "
    "kernel.dmesg_restrict=1, not_present: no /dev/kmsg, error), 0 for the others.",
    ("state",),
    export="nonzero",
    budget=1,
)
RECORDS = counter("kmsg_records_total", "Kernel log records read.", export="detail")
LOST = counter(
    "kmsg_records_lost_total",
    "Kernel log records overwritten before they were read (EPIPE, gaps in the sequence).",
    export="nonzero",
)
XIDS = counter(
    "kmsg_xid_errors_total",
    "Xid errors the driver logged for the GPU, by code.",
    _GPU + ("xid",),
    export="nonzero",
    budget=0,
)
EVENTS = counter(
    "kmsg_gpu_events_total",
    "Kernel log lines about the GPU, by event: fallen_off_bus; aer_correctable, "
    "aer_nonfatal, aer_fatal (a function on its PCIe path); nvswitch_nonfatal, "
    "nvswitch_fatal (an SXid of a switch its NVLinks reach); oom_kill_main, "
    "oom_kill_worker (its main process, or a child of it, killed by the OOM killer).",
    _GPU + ("event",),
    export="nonzero",
    budget=0,
)
LAST = gauge(
    "kmsg_gpu_last_event_timestamp_seconds",
    "When the kernel last logged the event (those of kmsg_gpu_events_total, and xid) for the GPU.",
    _GPU + ("event",),
    export="nonzero",
    budget=0,
)
MESSAGE = gauge(
    "kmsg_gpu_message",
    "The last line of each event for the GPU: its code, the process it names and the "
    "driver's text; the value is when it was logged. Never exported (free text): the "
    "rules' summaries quote it.",
    _GPU + ("event", "code", "pid", "process", "message"),
    export="internal",
    budget=0,
)
NVSWITCH = counter(
    "kmsg_nvswitch_errors_total",
    "SXid errors an NVSwitch logged, by switch (PCI address), port, SXid and severity.",
    ("switch", "link", "sxid", "severity"),
    export="nonzero",
    budget=0,
)
NVME = counter(
    "kmsg_nvme_timeouts_total",
    "NVMe I/O timeouts the kernel logged, by controller.",
    ("device",),
    export="nonzero",
    budget=0,
)
NIC = counter(
    "kmsg_nic_link_changes_total",
    "mlx5 links going up or down, by PCI function and new state.",
    ("bus_id", "state"),
    export="nonzero",
    budget=0,
)
OOM = counter(
    "kmsg_oom_kills_total", "Processes the OOM killer killed on the node.", export="nonzero"
)


class Device(Protocol):
    """/dev/kmsg as opened: each read() one record (BlockingIOError: none yet;
    BrokenPipeError: the next one was overwritten)."""

    def read(self) -> bytes: ...

    def close(self) -> None: ...


class KmsgDevice:
    """The kernel's /dev/kmsg, opened non-blocking at the log's end."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            os.lseek(self._fd, 0, os.SEEK_END)  # follow from now: never replay the ring
        except BaseException:
            os.close(self._fd)
            raise

    def read(self) -> bytes:
        return os.read(self._fd, RECORD_BYTES)

    def close(self) -> None:
        os.close(self._fd)


class KmsgDown(SourceError):
    """The device cannot be read; `samples` say why (the state gauges)."""

    def __init__(self, message: str, samples: list[Sample]) -> None:
        super().__init__(message)
        self.samples = samples


@register
class KmsgSource(Source):
    name = "kmsg"
    metrics = (STATE, RECORDS, LOST, XIDS, EVENTS, LAST, MESSAGE, NVSWITCH, NVME, NIC, OOM)

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self.settings = settings_of(config, KmsgConfig)
        self._open: Callable[[str], Device] = context.extras.get("kmsg_open", KmsgDevice)
        self._now: Callable[[], float] = context.extras.get("now", time.time)
        self._device: Device | None = None
        self._refusal: KmsgDown | None = None  # the open refused: retried RETRY_REFUSED on
        self._refused_at = 0.0
        self._state = "reading"
        self._gpus = GpuPaths(os.path.join(os.fspath(context.sysfs), "bus", "pci", "devices"))
        self._seen: set[str] = set()  # every GPU address sysfs has shown
        self._pids = pid_table(context.extras)
        self._switches = switch_table(context.extras)
        self._seq: int | None = None
        self._oom: dict[str, dict[str, str]] = {}  # pid -> its oom-kill: summary's fields
        self.records = self.lost = self.restarts = 0
        self._counts: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._last: dict[tuple[str, str], float] = {}  # (GPU, event) -> when
        self._messages: dict[tuple[str, str], tuple[tuple[str, ...], float]] = {}
        # the samples last made and what they were made at: (state, records read); the
        # series change only with a record read (or the state), and most polls read none
        self._made: tuple[tuple[str, int], list[Sample]] | None = None

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None

    def collect(self) -> list[Sample]:
        device = self._device or self._start()
        now, refreshed = self._now(), False
        for _ in range(self.settings.max_records):
            try:
                data = device.read()
            except BlockingIOError:
                break  # read up to the end
            except BrokenPipeError:
                continue  # overwritten: moved to the oldest record; its seq tells the loss
            except InterruptedError:
                continue
            except OSError as e:
                self.close()
                raise self._down("error", f"reading {self.settings.path}: {e.strerror or e}") from e
            record = parse_record(data)
            if record is None:
                continue
            self._follow(record.seq)
            if record.facility != KERNEL_FACILITY:
                continue  # user space writing to /dev/kmsg: not the kernel's word
            line = classify(record.text)
            if line is not None:
                if not refreshed and line.kind in ("xid", "fallen_off_bus", "aer"):
                    self._refresh_gpus()
                    refreshed = True
                self._take(line, now)
        made, at = self._made, (self._state, self.records)
        if made is None or made[0] != at:
            made = self._made = (at, self._samples())
        return made[1][:]

    # -- the device -----------------------------------------------------------------

    def _start(self) -> Device:
        path, now = os.fspath(self.settings.path), self._now()
        if self._refusal is not None and now - self._refused_at < RETRY_REFUSED:
            raise self._refusal  # privileges change with a restart, not every second
        self._refusal = None
        try:
            device = self._open(path)
        except PermissionError as e:
            self._refusal, self._refused_at = (
                self._down("not_permitted", self._refused(path, e)),
                now,
            )
            raise self._refusal from e
        except FileNotFoundError as e:
            raise self._down(
                "not_present",
                f"{path} does not exist (a container without the host's /dev/kmsg?)",
            ) from e
        except OSError as e:
            raise self._down("error", f"cannot open {path}: {e.strerror or e}") from e
        self._device, self._seq = device, None
        if self._state != "reading":
            log.info("kmsg: reading %s from its end", path)
        self._state = "reading"
        return device

    def _refused(self, path: str, error: OSError) -> str:
        restrict = os.path.join(os.fspath(self.context.procfs), "sys", "kernel", "dmesg_restrict")
        try:
            with open(restrict) as f:
                restricted = f.read().strip() == "1"
        except OSError:
            restricted = None
        why = {
            True: "kernel.dmesg_restrict=1: reading the kernel log needs CAP_SYSLOG",
            False: "kernel.dmesg_restrict=0, so the unit's sandbox refuses it "
            "(ProtectKernelLogs=, DevicePolicy=) or a container's device list",
            None: "reading the kernel log needs CAP_SYSLOG where kernel.dmesg_restrict=1",
        }[restricted]
        code = errno.errorcode.get(error.errno or 0, "refused")
        return f"{path}: {code}: {why} (docs/deploy.md: the kernel log)"

    def _down(self, state: str, reason: str) -> KmsgDown:
        self._state = state
        return KmsgDown(f"{state}: {reason}", self._state_samples())

    def _follow(self, seq: int) -> None:
        """Count the records skipped (overwritten) and a ring that started again."""
        self.records += 1
        last, self._seq = self._seq, seq
        if last is None:
            return
        if seq <= last:
            self.restarts += 1
            log.info("kmsg: the kernel log started again (sequence %d after %d)", seq, last)
        elif seq > last + 1:
            self.lost += seq - last - 1

    # -- lines to series ----------------------------------------------------------------

    def _refresh_gpus(self) -> None:
        try:
            entries = os.listdir(self._gpus.devices_dir)
        except OSError:
            return
        self._gpus.refresh(entries)
        self._seen.update(path[0].bdf for path in self._gpus.paths())

    def _take(self, line: Line, now: float) -> None:
        if line.kind == "sxid":
            severity = "fatal" if line.fatal else "nonfatal"
            self._counts[(NVSWITCH.name, (line.device, line.link, line.code, severity))] += 1
            kind = "Fatal" if line.fatal else "Non-fatal"
            port = f" link {line.link}" if line.link else ""
            text = (
                f"SXid {line.code} ({kind}) on {line.switch} ({line.device}){port}: {line.message}"
            )
            for gpu in self._switches.gpus(line.device):
                self._gpu_event(gpu, "nvswitch_" + severity, now, line.code, "", "", text)
        elif line.kind == "xid":
            if line.device in self._seen:
                self._counts[(XIDS.name, (line.device, line.code))] += 1
                who = f" in {line.process or 'a process'} (pid {line.pid})" if line.pid else ""
                text = f"Xid {line.code}{who}: {line.message}"
                self._gpu_event(line.device, "xid", now, line.code, line.pid, line.process,
                                text, count=False)  # fmt: skip
        elif line.kind == "fallen_off_bus":
            if line.device in self._seen:
                self._gpu_event(line.device, "fallen_off_bus", now, "", "", "", line.message)
        elif line.kind == "aer":
            for path in self._gpus.paths():
                if any(fn.bdf == line.device for fn in path):
                    text = f"{line.device}: {line.message}"
                    self._gpu_event(path[0].bdf, line.code, now, "", "", "", text)
        elif line.kind == "nvme_timeout":
            self._counts[(NVME.name, (line.device,))] += 1
        elif line.kind == "nic_link":
            self._counts[(NIC.name, (line.device, line.code))] += 1
        elif line.kind == "oom_summary":
            fields = dict(line.fields)
            if fields.get("pid", "").isdigit():
                self._oom = {fields["pid"]: fields}  # the kill that follows names it
        elif line.kind == "oom_kill":
            self._oom_kill(line, now)

    def _oom_kill(self, line: Line, now: float) -> None:
        self._counts[(OOM.name, ())] += 1
        where = self._pids.lookup(int(line.pid))
        if where is None:
            return  # no GPU's process: counted for the node only
        fields = self._oom.pop(line.pid, {})
        constraint = fields.get("constraint", "")
        scope = {
            "CONSTRAINT_MEMCG": f"its cgroup's memory limit ({fields.get('oom_memcg', '?')})",
            "CONSTRAINT_NONE": "the node out of memory",
        }.get(constraint, constraint.lower() or "out of memory")
        rss = _ANON_RSS.search(line.message)
        size = f", {int(rss.group(1)) / 2**20:.1f} GiB resident" if rss else ""
        text = f"{line.process} (pid {line.pid}) killed by the OOM killer: {scope}{size}"
        self._gpu_event(where.bus_id, "oom_kill_" + where.role, now, "", line.pid,
                        line.process, text)  # fmt: skip

    def _gpu_event(
        self, gpu: str, event: str, now: float, code: str, pid: str, process: str,
        message: str, count: bool = True,
    ) -> None:  # fmt: skip
        if count:
            self._counts[(EVENTS.name, (gpu, event))] += 1
        self._last[(gpu, event)] = now
        self._messages[(gpu, event)] = ((gpu, event, code, pid, process, message), now)

    def _samples(self) -> list[Sample]:
        out = self._state_samples()
        out.append(Sample(RECORDS.name, (), float(self.records)))
        out.append(Sample(LOST.name, (), float(self.lost)))
        out.append(Sample(OOM.name, (), float(self._counts[(OOM.name, ())])))
        out += [Sample(name, labels, float(n)) for (name, labels), n in self._counts.items()
                if name != OOM.name]  # fmt: skip
        out += [Sample(LAST.name, key, t) for key, t in self._last.items()]
        out += [Sample(MESSAGE.name, labels, t) for labels, t in self._messages.values()]
        return out

    def _state_samples(self) -> list[Sample]:
        return [Sample(STATE.name, (s,), float(s == self._state)) for s in STATES]


__all__ = ["Device", "KmsgDevice", "KmsgSource", "STATES"]
