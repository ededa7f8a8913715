"""NvmlSource: NVML's lifecycle, errors, identities, Xid events and each GPU's reads.

Registered as "nvml". It wires the package's parts: the polls and the reader thread
(`reader.Polling`), the NVLink expectations (`nvlink.NvLinks`), and the tables of what
is read (`reads`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from itertools import chain
from operator import mul
from typing import Any

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError
from gpuwatchd.sources.nvml.metrics import (
    CLOCK_REASONS,
    CUDA_VERSION,
    DEVICES,
    HUNG,
    INFO,
    LAST_XID,
    LOST,
    SM_COUNT,
    SPECS,
    STALE,
    XID,
    XID_INSTANCE,
)
from gpuwatchd.sources.nvml.mig import MIG_SPECS, MigReads
from gpuwatchd.sources.nvml.nvlink import NvLinks
from gpuwatchd.sources.nvml.plans import ReadPlan, field_plan
from gpuwatchd.sources.nvml.reader import Polling, _Done, _Reader, _wait
from gpuwatchd.sources.nvml.reads import (
    EVERY_POLL,
    FIELDS,
    FIELDS_KEY,
    NVLINK_COUNT,
    NVLINK_STATE,
    ONCE,
    POWER_READ,
    READS,
    SLOW,
    SLOW_FIELDS_KEY,
    Field,
    Read,
    _Entry,
    _Gpu,
    _GpuLost,
)
from gpuwatchd.sources.nvmlapi import (
    Direct,
    cuda_version_string,
    identify,
    process_table,
    quietly,
    sm_count,
    start_nvml,
)
from gpuwatchd.sources.ties import switch_table

log = logging.getLogger("gpuwatchd.sources.nvml")


@register
class NvmlSource(Polling, NvLinks, MigReads, Source):
    name = "nvml"
    metrics = SPECS + MIG_SPECS + (XID_INSTANCE,)

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self._now: Callable[[], float] = context.extras.get("now", time.time)
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._table = process_table(context)
        # how the poll waits for its reader: done.wait in real time; the simulator's
        # (virtual time) returns as soon as the reader blocks in a hung call
        self._wait_reader: Callable[[_Done, threading.Thread, float], bool] = (
            context.extras.get("nvml_wait", _wait)
        )
        self._patience = config.timeout / 2  # returned before the scheduler's timeout
        self._reader: _Reader | None = None
        self._events_lock = threading.Lock()
        self._nv: Any = None  # the binding, once NVML is initialised
        self._gpus: list[_Gpu] = []
        self._globals: list[Sample] = []
        self._driver = ""
        self._cuda = ""
        self._event_set: Any = None
        self._by_address: dict[int, _Gpu] = {}
        self._logged: set[tuple[str, str]] = set()
        # resolved from the binding by _start/_resolve
        self._codes: dict[int, str] = {}
        self._calls: dict[str, list[tuple[str, Any, tuple[Any, ...]]]] = {}
        self._fields: list[tuple[int, Field]] = []
        self._nvlink: tuple[int, int] = (0, 0)  # (state field id, count field id); 0: none
        self._nvswitch_links: set[int] = set()  # link counts of GPUs found on NVSwitches
        self._switches = switch_table(context.extras)  # NVSwitch -> GPUs, for the kmsg source
        self._reasons: list[tuple[str, int]] = []
        self._direct: Direct | None = None
        self._fall_back: set[int] = set()
        self._xid_type = 0
        self._mig_type = 0
        self._wait: Any = None

    # -- lifecycle --------------------------------------------------------------------

    def _start(self) -> None:
        nv, self._codes, count = start_nvml(self.context)
        self._driver = quietly(nv, nv.nvmlSystemGetDriverVersion) or ""
        cuda = quietly(nv, nv.nvmlSystemGetCudaDriverVersion)
        self._cuda = cuda_version_string(cuda) if cuda else ""
        self._globals = [Sample(DEVICES.name, (), float(count))]
        if cuda:
            self._globals.append(Sample(CUDA_VERSION.name, (), float(self._cuda)))
        self._resolve(nv)
        self._gpus = [_Gpu(i) for i in range(count)]
        self._by_address = {}
        self._event_set = quietly(nv, nv.nvmlEventSetCreate)
        if self._event_set is None:
            log.info("nvml: cannot create an event set; Xid errors will not be counted")
        self._nv = nv
        log.info("nvml: %d GPUs, driver %s, CUDA %s", count, self._driver, self._cuda)

    def _resolve(self, nv: Any) -> None:
        """Look the functions and constants of READS, FIELDS and the reasons up once."""

        direct = self._direct = Direct(nv)

        def bound(read: Read) -> list[tuple[str, Any, tuple[Any, ...]]]:
            args = tuple(getattr(nv, a) for a in read.args)
            bind = read.bind
            if bind is not None:
                functions = [bind(nv, f) for f in read.functions]
            else:
                functions = [getattr(nv, f, None) for f in read.functions]
            if read.listing:
                functions = [
                    f and direct.lister(name)
                    for f, name in zip(functions, read.functions, strict=True)
                ]
            return [
                (f, function, args) for f, function in zip(read.functions, functions, strict=True)
            ]

        self._calls = {read.key: bound(read) for read in (*READS, POWER_READ)}
        # a field this pynvml does not know is one the driver cannot be asked for either
        self._fields = [(getattr(nv, f.constant), f) for f in FIELDS if hasattr(nv, f.constant)]
        state = getattr(nv, NVLINK_STATE.constant, 0)
        self._nvlink = (state, getattr(nv, NVLINK_COUNT, 0) if state else 0)
        self._reasons = []
        for label, suffix in CLOCK_REASONS.items():
            bit = getattr(nv, "nvmlClocksEventReason" + suffix, None)
            bit = getattr(nv, "nvmlClocksThrottleReason" + suffix, bit)
            if bit:
                self._reasons.append((label, int(bit)))
        self._xid_type = int(nv.nvmlEventTypeXidCriticalError)
        self._mig_type = int(getattr(nv, "nvmlEventMigConfigChange", 0))  # R450+ pynvml
        self._wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        # a read falls back to its next call where the driver lacks the call, or does not
        # know the struct version this binding fills (a binding newer than the driver)
        codes = ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        self._fall_back = {getattr(nv, code) for code in codes if hasattr(nv, code)}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.retire()
            self._reader = None
        nv, self._nv = self._nv, None
        if nv is None:
            return
        if self._event_set is not None:
            quietly(nv, nv.nvmlEventSetFree, self._event_set)
            self._event_set = None
        quietly(nv, nv.nvmlShutdown)

    # -- errors -----------------------------------------------------------------------

    def _describe(self, error: Any) -> str:
        return f"{error} ({self._codes.get(error.value, f'code {error.value}')})"

    def _failed(self, gpu: _Gpu, key: str, function: str, error: Any) -> None:
        """Handle an NVMLError from one call on one GPU (raises _GpuLost)."""
        nv = self._nv
        code = error.value
        if code == nv.NVML_ERROR_GPU_IS_LOST:
            raise _GpuLost
        if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
            gpu.disabled.add(key)
            self._log_once(key, function, gpu, self._describe(error))
        elif code == nv.NVML_ERROR_NO_PERMISSION and getattr(gpu.mig, "mode", None) == 1:
            self._mig_unmonitored(gpu, function)
        elif code == nv.NVML_ERROR_UNINITIALIZED:
            self._nv = None  # someone shut NVML down: start again next poll
            why = self._describe(error)
            raise SourceError(f"NVML was shut down under us: {function} answered {why}")
        else:
            log.debug("nvml: GPU %d: %s failed: %s", gpu.index, function, self._describe(error))

    def _log_once(self, key: str, function: str, gpu: _Gpu, why: str) -> None:
        level = logging.DEBUG if (key, function) in self._logged else logging.INFO
        self._logged.add((key, function))
        log.log(level, "nvml: GPU %d: %s: %s; not asking again", gpu.index, function, why)

    def _identify(self, gpu: _Gpu) -> None:
        """Handle and identity, read once; retried each poll until they can be read."""
        nv = self._nv
        try:
            identity = identify(nv, gpu.index)
        except nv.NVMLError as e:
            gpu.lost = e.value == nv.NVML_ERROR_GPU_IS_LOST
            log.debug("nvml: GPU %d: no handle yet: %s", gpu.index, self._describe(e))
            return
        handle = identity.handle
        name = quietly(nv, nv.nvmlDeviceGetName, handle) or ""
        gpu.bus_id = identity.bus_id
        labels = (str(gpu.index), identity.uuid)
        gpu.labels = labels
        gpu.info = Sample(INFO.name, labels + (name, gpu.bus_id, self._driver, self._cuda), 1.0)
        gpu.read_flags = (Sample(STALE.name, labels, 0.0), Sample(HUNG.name, labels, 0.0))
        sms = sm_count(nv, handle)
        gpu.sm_count = None if sms is None else Sample(SM_COUNT.name, labels, float(sms))
        gpu.reason_labels = [(bit, labels + (label,)) for label, bit in self._reasons]
        gpu.reasons = gpu.nvlink_last = None  # samples kept under these labels: none yet
        gpu.reads = list(READS)
        gpu.handle = handle
        self._batch(gpu)
        address = ctypes.cast(handle, ctypes.c_void_p).value
        if address is not None:
            self._by_address[address] = gpu

    def _batch(self, gpu: _Gpu) -> None:
        """This GPU's field-values request: FIELDS and, per NVLink, its state."""
        entries = [_Entry(fid, 0, f, gpu.labels + f.extra, f.constant) for fid, f in self._fields]
        state, count = self._nvlink
        links = gpu.nvlinks = self._links(gpu, count) if count else 0
        for link in range(links):
            labels = gpu.labels + (str(link),)
            entries.append(
                _Entry(state, link, NVLINK_STATE, labels, f"{NVLINK_STATE.constant}[{link}]")
            )
        self._ask(gpu, entries)

    def _register_events(self, gpu: _Gpu) -> None:
        """Ask for this GPU's Xid events; retried each poll until it works or can't."""
        nv = self._nv
        if self._event_set is None:
            return
        try:
            if not nv.nvmlDeviceGetSupportedEventTypes(gpu.handle) & self._xid_type:
                gpu.events = "unsupported"
                return
            nv.nvmlDeviceRegisterEvents(gpu.handle, self._xid_type, self._event_set)
            gpu.events = "registered"
        except nv.NVMLError as e:
            if e.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                gpu.events = "unsupported"
            log.debug("nvml: GPU %d: Xid events: %s", gpu.index, self._describe(e))

    def _collect_gpu(self, gpu: _Gpu, out: list[Sample]) -> None:
        if gpu.handle is None:
            if gpu.lost:
                out.append(Sample(LOST.name, gpu.labels, 1.0))
            return
        mine: list[Sample] = []
        try:
            self._field_values(gpu, mine)
            self._mig(gpu, mine)  # before the reads: MIG takes the parent's utilization
            self._reads(gpu, mine)
        except _GpuLost:
            if not gpu.lost:
                log.warning("nvml: GPU %d (%s): lost (GPU_IS_LOST)", gpu.index, gpu.labels[1])
            gpu.lost = True
            gpu.counters.clear()
            gpu.kept.pop(SLOW_FIELDS_KEY, None)
            # identity and Xids stay: the Xid (79) raised as it fell off explains the loss
            self._identity(gpu, 1.0, out)
            return
        gpu.polls += 1
        if gpu.lost:
            log.info("nvml: GPU %d: answering again", gpu.index)
            gpu.lost = False
        self._identity(gpu, 0.0, out)
        out.extend(mine)

    def _identity(self, gpu: _Gpu, lost: float, out: list[Sample]) -> None:
        """gpu_info, its SM count, gpu_lost and the Xids drained for it: what a lost GPU
        still shows."""
        assert gpu.info is not None
        out.append(gpu.info)
        if gpu.sm_count is not None:
            out.append(gpu.sm_count)
        out.append(Sample(LOST.name, gpu.labels, lost))
        for xid, count in gpu.xids.items():
            out.append(Sample(XID.name, gpu.labels + (str(xid),), float(count)))
        if gpu.last_xid is not None:
            out.append(Sample(LAST_XID.name, gpu.labels, gpu.last_xid))

    def _reads(self, gpu: _Gpu, out: list[Sample]) -> None:
        """The GPU's reads by its plan: each due read's call, the others' kept samples."""
        plan = gpu.read_plan
        if plan is None or not plan.fits(gpu.reads, gpu.disabled, gpu.choice):
            plan = gpu.read_plan = ReadPlan(gpu.reads, gpu.disabled, gpu.choice, self._calls)
        kept, handle = gpu.kept, gpu.handle
        error = self._nv.NVMLError
        for read, function, args, keep, keys in plan.steps(gpu.polls):
            if keys is not None:  # reads not due: what they gave when they were read
                got: list[Any] = list(map(kept.get, keys))
                if None in got:  # one has none: each as _read_one says
                    for idle in read:
                        self._read_one(gpu, idle, out)
                else:
                    out += chain.from_iterable(got)
                continue
            if function is None:
                self._read_one(gpu, read, out)
                continue
            try:
                value = function(handle, *args)
            except error as e:
                value = self._read_failed(gpu, read, gpu.choice.get(read.key, 0), e)
                if value is _MISSING:
                    self._forget(gpu, read)
                    continue
            self._took(gpu, read, value, keep, out)

    def _read_one(self, gpu: _Gpu, read: Read, out: list[Sample]) -> None:
        """One read, unplanned: its kept samples if it is not due, else its call."""
        every = read.every
        if every != EVERY_POLL:
            samples = gpu.kept.get(read.key)
            if samples is not None and (every == ONCE or gpu.polls % every):
                out += samples  # what it gave when it was read
                return
        value = self._read(gpu, read)
        if value is _MISSING:
            self._forget(gpu, read)
            return
        self._took(gpu, read, value, every != EVERY_POLL, out)

    @staticmethod
    def _took(gpu: _Gpu, read: Read, value: Any, keep: bool, out: list[Sample]) -> None:
        """A read's value: its process list noted, its samples made (and kept, `keep`,
        for the polls that do not read it)."""
        if read.listing:
            gpu.lists[read.listing] = value
        if read.emit is None:
            samples = [Sample(read.metric, gpu.labels, value * read.scale)]
        else:
            samples = []
            read.emit(gpu, value, samples)
        if keep:
            gpu.kept[read.key] = samples
        out += samples

    def _forget(self, gpu: _Gpu, read: Read) -> None:
        """A read that gave nothing: asked again next poll, no list kept."""
        gpu.kept.pop(read.key, None)
        if read.listing:
            gpu.lists.pop(read.listing, None)

    def _read(self, gpu: _Gpu, read: Read) -> Any:
        key = read.key
        if key in gpu.disabled:
            return _MISSING
        choice = gpu.choice.get(key, 0)
        _, function, args = self._calls[key][choice]
        try:
            if function is None:  # this pynvml predates the function
                raise self._nv.NVMLError(self._nv.NVML_ERROR_FUNCTION_NOT_FOUND)
            value = function(gpu.handle, *args)
        except self._nv.NVMLError as e:
            return self._read_failed(gpu, read, choice, e)
        return value

    def _read_failed(self, gpu: _Gpu, read: Read, choice: int, error: Any) -> Any:
        """A read's call failed: its next call where this one is missing (the value it
        gives), else the error handled (_MISSING)."""
        key = read.key
        calls = self._calls[key]
        name = calls[choice][0]
        if error.value in self._fall_back and choice + 1 < len(calls):
            gpu.choice[key] = choice + 1
            self._log_once(key, name, gpu, f"{self._describe(error)}, using {calls[choice + 1][0]}")
            return self._read(gpu, read)
        self._failed(gpu, key, name, error)
        return _MISSING

    def _field_values(self, gpu: _Gpu, out: list[Sample]) -> None:
        """FIELDS and the NVLink states in one call; each field has its own nvmlReturn.
        The SLOW fields are asked every SLOW polls, their samples kept in between."""
        full = gpu.polls % SLOW == 0 or SLOW_FIELDS_KEY not in gpu.kept
        entries, request = (gpu.batch, gpu.request) if full else (gpu.fast, gpu.fast_request)
        if not entries:
            if full:
                gpu.kept[SLOW_FIELDS_KEY] = []
            out.extend(gpu.kept[SLOW_FIELDS_KEY])
            return
        nv, direct = self._nv, self._direct
        assert direct is not None
        try:
            codes, stamps, numbers, moduli = direct.field_columns(gpu.handle, request)
        except nv.NVMLError as e:
            self._failed(gpu, FIELDS_KEY, "nvmlDeviceGetFieldValues", e)
            gpu.kept.pop(SLOW_FIELDS_KEY, None)  # nothing stale: all asked again next poll
            if FIELDS_KEY in gpu.disabled:
                self._unsupported(gpu, set(gpu.batch))
            return
        slow: list[Sample] = []  # a SLOW field that failed is asked again at its next read
        plan = gpu.plans[full]
        if plan is not None and codes == plan.ok and None not in numbers:  # all answered
            for to_slow, at, end, metrics, labels, scales, rate in plan.runs:
                mine = slow if to_slow else out
                if rate is None:
                    mine += map(Sample, metrics, labels, map(mul, numbers[at:end], scales))
                else:
                    self._rate(gpu, rate, int(numbers[at]), moduli[at], stamps[at], mine)
            states = tuple(zip(plan.scopes, map(bool, numbers[plan.links]), strict=True))
            self._nvlink_samples(gpu, states, out)
            if full:
                gpu.kept[SLOW_FIELDS_KEY] = slow
            out.extend(gpu.kept[SLOW_FIELDS_KEY])
            return
        success = nv.NVML_SUCCESS
        unsupported: set[_Entry] = set()
        links: list[tuple[int, bool]] = []  # (NVLink, active), counted per GPU
        values = zip(codes, stamps, numbers, moduli, strict=True)
        for (code, stamp, number, modulus), entry in zip(values, entries, strict=True):
            if code == success and number is not None:
                field = entry.field
                if field is NVLINK_STATE:  # most of the batch on an NVLink board
                    links.append((entry.scope, bool(number)))
                    continue
                mine = out if field.every == EVERY_POLL else slow
                if field.rate:
                    self._rate(gpu, entry, int(number), modulus, stamp, mine)
                else:
                    mine.append(Sample(field.metric, entry.labels, number * field.scale))
            elif code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost
            elif code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                unsupported.add(entry)
                why = self._describe(nv.NVMLError(code))
                self._log_once(entry.what, f"field {entry.what} ({entry.field.metric})", gpu, why)
        self._nvlink_samples(gpu, links, out)
        if full:
            gpu.kept[SLOW_FIELDS_KEY] = slow
        out.extend(gpu.kept[SLOW_FIELDS_KEY])
        if unsupported:
            self._unsupported(gpu, unsupported)

    def _unsupported(self, gpu: _Gpu, entries: set[_Entry]) -> None:
        """Drop these entries from the GPU's batch; their fallbacks are read from now on,
        those without one asked again after a MIG layout change (`_mig_reask`)."""
        for entry in entries:
            fallback = entry.field.fallback
            if fallback is None:
                gpu.dropped.add(entry)
            elif fallback not in gpu.reads:
                gpu.reads.append(fallback)
        self._ask(gpu, [e for e in gpu.batch if e not in entries])

    def _ask(self, gpu: _Gpu, entries: list[_Entry]) -> None:
        assert self._direct is not None
        gpu.batch = entries
        gpu.request = self._direct.request([(e.field_id, e.scope) for e in entries])
        gpu.fast = [e for e in entries if e.field.every == EVERY_POLL]
        gpu.fast_request = self._direct.request([(e.field_id, e.scope) for e in gpu.fast])
        success = self._nv.NVML_SUCCESS
        gpu.plans = (field_plan(gpu.fast, success), field_plan(entries, success))

    def _rate(
        self,
        gpu: _Gpu,
        entry: _Entry,
        total: int,
        modulus: int | None,
        stamp_us: int,
        out: list[Sample],
    ) -> None:
        """A byte counter's rate since the last reading, by the driver's own timestamps
        (a value the driver has not sampled again since keeps the last rate). A 32-bit
        counter (the driver's choice of width) wraps: its increase is taken modulo 2**32,
        exact while fewer than 2**32 bytes pass between two readings. A wider one that
        falls was reset (the driver reloaded): no rate from that reading."""
        before, before_us, rate = gpu.counters.get(entry.field_id, (0, None, None))
        if stamp_us != before_us:
            rate = None
            if before_us is not None and stamp_us > before_us:
                added = total - before
                if modulus is not None and modulus <= 1 << 32:
                    added %= modulus
                rate = added * 1e6 / (stamp_us - before_us) if added >= 0 else None
            gpu.counters[entry.field_id] = (total, stamp_us, rate)
        if rate is not None:
            out.append(Sample(entry.field.metric, entry.labels, rate))


_MISSING = object()
