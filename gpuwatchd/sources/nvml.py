"""Per-GPU telemetry from NVML, through the real bindings (nvidia-ml-py's `pynvml`).

The binding is `context.pynvml` when set (the simulator passes a private pynvml whose C
library is a fake), else `import pynvml`. NVML is initialised on the first poll; if that
fails (no libnvidia-ml, driver not loaded, ...) the poll raises SourceError with a
one-line reason and the next poll tries again.

What a poll costs is counted in NVML calls, each tens of microseconds of CPU in the
driver. Per GPU and poll:
- one nvmlDeviceGetFieldValues for everything the driver can batch (`FIELDS`): power,
  the PCIe TX/RX byte counters (exported as rates between two polls, from the driver's
  own timestamps), the PCIe replay counter, ECC totals and mode, and the state of every
  NVLink (a field per link, scoped by link index);
- one call each for what has no field (`READS`): utilization, memory, SM clock,
  P-state, clock event reasons and the running compute processes;
- slow facts (`SLOW`: temperature, memory clock, PCIe link generation and width,
  persistence mode, power limit, the graphics processes) every `SLOW_EVERY` polls, kept
  in between;
- static facts (identity, NVLink count, maximum clocks and link) once, and once per
  GPU what its first active NVLink reaches (nvmlDeviceGetNvLinkRemoteDeviceType);
- one event wait that drains pending Xid events without blocking.
nvmlDeviceGetPcieThroughput is never called: it blocks ~20 ms per call to sample a
counter. Where the driver lacks the byte counters (before R555) the PCIe rates are left
out (logged once). A field the driver answers NOT_SUPPORTED is dropped from the batch;
where a classic call reads the same value (power) that call is used instead.

The process lists are shared: the nvml source publishes each poll's lists in a
`ProcessTable` (`context.extras["nvml_processes"]`) that the processes source reads
instead of asking NVML again.

Errors, per GPU and per call (or field):
- NOT_SUPPORTED / FUNCTION_NOT_FOUND: the series is dropped for that GPU and the call
  is never made again on it (logged once). A read with an older alternative (clock
  event reasons -> throttle reasons) falls back to it on FUNCTION_NOT_FOUND instead.
- GPU_IS_LOST: this poll reports only `gpu_lost 1`, `gpu_info` and the Xid counters
  for that GPU (the Xid 79 drained as it fell off is what explains the loss); other
  GPUs go on.
- anything else: that series is missing from this poll only.
A call that blocks (a GPU gone bad inside the driver) cannot be interrupted, so the
calls are made by a reader thread that the poll waits for at most half the source's
timeout. A GPU whose call has not returned by then is reported with its identity, its
Xids and `gpu_nvml_hung_seconds` (how long it has blocked), not its readings; GPUs the
reader had not reached yet keep their last values with `gpu_nvml_stale 1`. The blocked
reader is retired (it ends when its call returns) and a new one makes the next polls'
calls, leaving the hung GPU alone while its call is in flight: the other GPUs are read
as before (where the driver lets them; one that blocks too is left alone in turn, so at
most one thread per GPU is ever stuck). Every other read is made once per poll as
listed above: no call is added.

An NVLink is expected up (`gpu_nvlink_expected`) once it has been seen active since
the daemon started, or when the board wires every link: a GPU whose active link reaches
an NVSwitch (HGX/DGX baseboards connect all links of all GPUs to the switches; then so
is every GPU of the node with as many links), or when the config's `expected_nvlinks`
names it. A link never seen active is not otherwise: PCIe boards without an NVLink
bridge report every link inactive, and bridged H100 PCIe cards 6 of their 18 by design.
A link down before the daemon starts is thus known on an NVSwitch board or by config.

NVML's event data carries no time, so an Xid is stamped when it is drained, with
`context.extras["now"]` (a wall-clock callable; default time.time) so that a replay in
virtual time stamps it in scenario time. `gpu_info`'s pci_bus_id is in the sysfs form
("0000:34:00.0", as the pcie source's gpu_bus_id), not NVML's "00000000:34:00.0".
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwatchd.config import NvmlConfig, SourceConfig
from gpuwatchd.metrics import GPU_LABELS, MetricSpec, Sample, counter, gauge
from gpuwatchd.scheduler import name_os_thread
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError
from gpuwatchd.sources.nvmlapi import (
    Direct,
    ListedGpu,
    cuda_version_string,
    process_table,
    quietly,
    start_nvml,
    sysfs_bus_id,
)

log = logging.getLogger(__name__)


def _gpu_gauge(name: str, help: str, extra: tuple[str, ...] = ()) -> MetricSpec:
    return gauge(name, help, GPU_LABELS + extra)


INFO = gauge(
    "gpu_info",
    "GPU identity; always 1.",
    GPU_LABELS + ("model", "pci_bus_id", "driver_version", "cuda_driver_version"),
)
LOST = _gpu_gauge("gpu_lost", "1 if NVML reports the GPU lost (fallen off the bus).")
UTILIZATION = _gpu_gauge("gpu_utilization_ratio", "Fraction of time a kernel was running.")
MEMORY_UTILIZATION = _gpu_gauge(
    "gpu_memory_utilization_ratio", "Fraction of time device memory was read or written."
)
MEMORY_USED = _gpu_gauge("gpu_memory_used_bytes", "Device memory in use.")
MEMORY_TOTAL = _gpu_gauge("gpu_memory_total_bytes", "Device memory in total.")
POWER = _gpu_gauge("gpu_power_watts", "Power draw.")
POWER_LIMIT = _gpu_gauge("gpu_power_limit_watts", "Enforced power limit.")
TEMPERATURE = _gpu_gauge("gpu_temperature_celsius", "GPU core temperature.")
SM_CLOCK = _gpu_gauge("gpu_sm_clock_hertz", "Current SM clock.")
SM_CLOCK_MAX = _gpu_gauge("gpu_sm_clock_max_hertz", "Maximum SM clock.")
MEM_CLOCK = _gpu_gauge("gpu_memory_clock_hertz", "Current memory clock.")
MEM_CLOCK_MAX = _gpu_gauge("gpu_memory_clock_max_hertz", "Maximum memory clock.")
PSTATE = _gpu_gauge("gpu_performance_state", "Performance state, 0 (max) to 15 (min).")
CLOCK_REASON = _gpu_gauge(
    "gpu_clock_event_reason_active", "1 while this reason holds the clocks down.", ("reason",)
)
PCIE_GEN = _gpu_gauge("gpu_pcie_link_generation", "Current PCIe link generation.")
PCIE_GEN_MAX = _gpu_gauge(
    "gpu_pcie_link_generation_max", "Highest PCIe generation this GPU and slot support."
)
PCIE_WIDTH = _gpu_gauge("gpu_pcie_link_width", "Current PCIe link width (lanes).")
PCIE_WIDTH_MAX = _gpu_gauge("gpu_pcie_link_width_max", "Maximum PCIe link width (lanes).")
PCIE_TX = _gpu_gauge("gpu_pcie_tx_bytes_per_second", "PCIe transmit throughput (GPU to host).")
PCIE_RX = _gpu_gauge("gpu_pcie_rx_bytes_per_second", "PCIe receive throughput (host to GPU).")
PCIE_REPLAYS = counter(
    "gpu_pcie_replay_errors_total", "PCIe replays (link-level retransmissions).", GPU_LABELS
)
ECC_ERRORS = counter(
    "gpu_ecc_errors_total",
    "ECC errors over the GPU's lifetime (aggregate).",
    GPU_LABELS + ("type",),
)
PERSISTENCE = _gpu_gauge("gpu_persistence_mode", "1 if persistence mode is on.")
ECC_MODE = _gpu_gauge("gpu_ecc_mode", "1 if ECC is currently enabled.")
NVLINK = _gpu_gauge("gpu_nvlink_active", "1 if this NVLink is active.", ("link",))
NVLINK_EXPECTED = _gpu_gauge(
    "gpu_nvlink_expected",
    "1 if this NVLink should be active: seen active since the daemon started, or wired by"
    " an NVSwitch board.",
    ("link",),
)
PROCESSES = _gpu_gauge("gpu_compute_processes", "Compute processes running on the GPU.")
PROCESS_MEMORY = _gpu_gauge(
    "gpu_process_memory_used_bytes", "Device memory used by one process.", ("pid",)
)
XID = counter("gpu_xid_errors_total", "Xid errors reported by the driver.", GPU_LABELS + ("xid",))
LAST_XID = _gpu_gauge("gpu_last_xid_timestamp_seconds", "When the last Xid error was seen.")
HUNG = _gpu_gauge(
    "gpu_nvml_hung_seconds",
    "How long an NVML call on this GPU has been blocked (0: none); its readings are left "
    "out meanwhile.",
)
STALE = _gpu_gauge(
    "gpu_nvml_stale",
    "1 if this poll could not read the GPU (held up by a call on another GPU): its values "
    "are the last read.",
)
CUDA_VERSION = gauge("cuda_driver_version", "CUDA version the driver supports, e.g. 12.4.")
DEVICES = gauge("nvml_devices", "GPUs NVML reports on this node.")

# metric label -> suffix of pynvml's nvmlClocksEventReason* (or older ...ThrottleReason*)
CLOCK_REASONS = {
    "gpu_idle": "GpuIdle",
    "applications_clocks_setting": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal_slowdown": "SwThermalSlowdown",
    "hw_thermal_slowdown": "HwThermalSlowdown",
    "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
    "display_clock_setting": "DisplayClockSetting",
    "board_limit": "BoardLimit",
    "reliability": "Reliability",
}

_MAX_EVENTS_PER_POLL = 1024
SLOW_EVERY = 10  # polls between two reads of a slow fact
EVERY_POLL, SLOW, ONCE = 1, SLOW_EVERY, 0  # Read.every
KINDS = ("compute", "graphics")  # NVML's two process lists


class _GpuLost(Exception):
    pass


class _Gpu:
    """What the source remembers about one GPU index."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.handle: Any = None
        self.labels: tuple[str, ...] = (str(index), "")
        self.bus_id = ""
        self.info: Sample | None = None
        self.lost = False
        self.polls = 0  # polls that read this GPU, for the reads' cadence
        self.reads: list[Read] = []  # READS, plus the fallbacks of unsupported fields
        self.disabled: set[str] = set()  # read keys found unsupported on this GPU
        self.choice: dict[str, int] = {}  # read key -> alternative in use (after fallbacks)
        self.kept: dict[str, list[Sample]] = {}  # read key -> its samples, kept between reads
        self.reason_labels: list[tuple[int, tuple[str, ...]]] = []
        self.batch: list[_Entry] = []  # what this GPU's nvmlDeviceGetFieldValues asks for
        self.request: Any = None  # ... as the nvmlFieldValue_t array it is asked with
        # byte counter field -> (value, driver's µs timestamp, rate since the one before)
        self.counters: dict[int, tuple[int, int | None, float | None]] = {}
        self.lists: dict[str, dict[int, float]] = {}  # process lists, by kind
        self.events = "pending"  # pending | registered | unsupported
        self.xids: dict[int, int] = {}
        self.nvlinks = 0  # how many NVLinks the driver reports
        self.nvlink_seen: set[int] = set()  # links seen active since the daemon started
        self.nvlink_remote: int | None = None  # what the first active link reaches, asked once
        self.last_xid: float | None = None
        # a reader thread holds it while it calls NVML on this GPU: a reader given up on
        # (blocked in a call) keeps it, and the next readers leave the GPU alone
        self.lock = threading.Lock()
        self.busy_since: float | None = None  # when the reader holding it took it
        self.hung = False  # reported hung (logged once)
        self.last: list[Sample] = []  # the samples of its last read, for a poll without it
        self.last_lists: dict[str, dict[int, float]] | None = None


class _Poll:
    """One poll's reads, made by the reader thread: the samples of each GPU it read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read: dict[int, list[Sample]] = {}
        self.closed = False  # the poll stopped waiting: the reader stops at the next GPU
        self.error: BaseException | None = None


class _Reader:
    """The thread that makes the polls' NVML calls, one poll at a time. A call into a
    GPU wedged in the driver blocks and cannot be interrupted: the poll waits for it a
    bounded time, goes on without that GPU and retires this reader, which ends once its
    call returns; a new reader makes the next polls' calls."""

    _ids = itertools.count()

    def __init__(self, work: Callable[[_Poll], None]) -> None:
        self._work = work
        self._go = threading.Event()
        self.done = threading.Event()
        self.poll = _Poll()
        self.retired = False
        self.thread = threading.Thread(
            target=self._run, name=f"nvml-reader-{next(self._ids)}", daemon=True
        )
        self.thread.start()

    def submit(self, poll: _Poll) -> None:
        self.poll = poll
        self.done.clear()
        self._go.set()

    def retire(self) -> None:
        self.retired = True
        self._go.set()

    def _run(self) -> None:
        name_os_thread("nvml-reader")  # its CPU shows as the daemon's (top -H, benchmarks)
        while True:
            self._go.wait()
            self._go.clear()
            if self.retired:
                return
            poll = self.poll
            try:
                self._work(poll)
            except BaseException as e:  # handed to the poll, raised there
                poll.error = e
            self.done.set()
            if self.retired:
                return


def _wait(done: threading.Event, thread: threading.Thread, timeout: float) -> bool:
    return done.wait(timeout)


def _emit_utilization(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(UTILIZATION.name, gpu.labels, value.gpu / 100))
    out.append(Sample(MEMORY_UTILIZATION.name, gpu.labels, value.memory / 100))


def _emit_memory(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(MEMORY_USED.name, gpu.labels, float(value.used)))
    out.append(Sample(MEMORY_TOTAL.name, gpu.labels, float(value.total)))


def _emit_reasons(gpu: _Gpu, mask: int, out: list[Sample]) -> None:
    for bit, labels in gpu.reason_labels:
        out.append(Sample(CLOCK_REASON.name, labels, 1.0 if mask & bit else 0.0))


def _emit_compute(gpu: _Gpu, used: dict[int, float], out: list[Sample]) -> None:
    out.append(Sample(PROCESSES.name, gpu.labels, float(len(used))))
    for pid, memory in used.items():
        out.append(Sample(PROCESS_MEMORY.name, gpu.labels + (str(pid),), memory))


def _no_samples(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    """A read for the processes source only (the graphics processes)."""


@dataclass(frozen=True)
class Read:
    """One NVML call per GPU and the samples it gives, made every `every` polls (the
    value kept in between) or, with `every` 0, once."""

    key: str  # what an unsupported call is remembered by
    functions: tuple[str, ...]  # pynvml functions, preferred first; FunctionNotFound: next
    args: tuple[str, ...] = ()  # names of pynvml constants passed after the handle
    metric: str = ""  # scalar reads: the metric, and the factor to base units
    scale: float = 1.0
    emit: Callable[[_Gpu, Any, list[Sample]], None] | None = None  # other reads
    every: int = EVERY_POLL
    listing: str = ""  # a process list ("compute", "graphics"), read by Direct


READS: tuple[Read, ...] = (
    Read("utilization", ("nvmlDeviceGetUtilizationRates",), emit=_emit_utilization),
    Read("memory", ("nvmlDeviceGetMemoryInfo",), emit=_emit_memory),
    Read("sm_clock", ("nvmlDeviceGetClockInfo",), ("NVML_CLOCK_SM",), SM_CLOCK.name, 1e6),
    Read("pstate", ("nvmlDeviceGetPerformanceState",), metric=PSTATE.name),
    Read(
        "clock_reasons",
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        emit=_emit_reasons,
    ),
    Read(
        "compute_processes",
        ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
        emit=_emit_compute,
        listing="compute",
    ),
    # slow facts (the temperature too: the rules only quote it)
    Read(
        "temperature",
        ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"),
        ("NVML_TEMPERATURE_GPU",),
        metric=TEMPERATURE.name,
        every=SLOW,
    ),
    Read(
        "mem_clock",
        ("nvmlDeviceGetClockInfo",),
        ("NVML_CLOCK_MEM",),
        MEM_CLOCK.name,
        1e6,
        every=SLOW,
    ),
    Read("pcie_gen", ("nvmlDeviceGetCurrPcieLinkGeneration",), metric=PCIE_GEN.name, every=SLOW),
    Read("pcie_width", ("nvmlDeviceGetCurrPcieLinkWidth",), metric=PCIE_WIDTH.name, every=SLOW),
    Read(
        "persistence_mode",
        ("nvmlDeviceGetPersistenceMode",),
        metric=PERSISTENCE.name,
        every=SLOW,
    ),
    Read(
        "power_limit",
        ("nvmlDeviceGetEnforcedPowerLimit",),
        metric=POWER_LIMIT.name,
        scale=1e-3,  # mW
        every=SLOW,
    ),
    Read(
        "graphics_processes",
        ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
        emit=_no_samples,
        every=SLOW,
        listing="graphics",
    ),
    # static facts
    Read(
        "sm_clock_max",
        ("nvmlDeviceGetMaxClockInfo",),
        ("NVML_CLOCK_SM",),
        SM_CLOCK_MAX.name,
        1e6,
        every=ONCE,
    ),
    Read(
        "mem_clock_max",
        ("nvmlDeviceGetMaxClockInfo",),
        ("NVML_CLOCK_MEM",),
        MEM_CLOCK_MAX.name,
        1e6,
        every=ONCE,
    ),
    Read(
        "pcie_gen_max",
        ("nvmlDeviceGetMaxPcieLinkGeneration",),
        metric=PCIE_GEN_MAX.name,
        every=ONCE,
    ),
    Read(
        "pcie_width_max",
        ("nvmlDeviceGetMaxPcieLinkWidth",),
        metric=PCIE_WIDTH_MAX.name,
        every=ONCE,
    ),
)
# where the driver does not batch power (before R535), the classic call reads it
POWER_READ = Read("power", ("nvmlDeviceGetPowerUsage",), metric=POWER.name, scale=1e-3)  # mW


@dataclass(frozen=True)
class Field:
    """A value of the nvmlDeviceGetFieldValues batch and the sample it gives."""

    constant: str  # pynvml's NVML_FI_* name
    metric: str
    scale: float = 1.0
    extra: tuple[str, ...] = ()  # label values after gpu and uuid
    rate: bool = False  # a byte counter: exported as bytes per second between two polls
    fallback: Read | None = None  # reads the value where the driver lacks the field


FIELDS: tuple[Field, ...] = (
    Field("NVML_FI_DEV_POWER_INSTANT", POWER.name, 1e-3, fallback=POWER_READ),  # mW
    Field("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", PCIE_TX.name, rate=True),  # R555+
    Field("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", PCIE_RX.name, rate=True),
    Field("NVML_FI_DEV_PCIE_REPLAY_COUNTER", PCIE_REPLAYS.name),
    Field("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", ECC_ERRORS.name, extra=("corrected",)),
    Field("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", ECC_ERRORS.name, extra=("uncorrected",)),
    Field("NVML_FI_DEV_ECC_CURRENT", ECC_MODE.name),
)
# one per link, scoped by the link's index (R525+); the count is read once per GPU
NVLINK_STATE = Field("NVML_FI_DEV_NVLINK_GET_STATE", NVLINK.name)
NVLINK_COUNT = "NVML_FI_DEV_NVLINK_LINK_COUNT"
FIELDS_KEY = "field_values"


@dataclass(frozen=True)
class _Entry:
    """A field of one GPU's batch, resolved: its id, scope and full labels."""

    field_id: int
    scope: int
    field: Field
    labels: tuple[str, ...]
    what: str  # for the log: the constant, with the scope


@register
class NvmlSource(Source):
    name = "nvml"
    metrics = (
        INFO,
        LOST,
        UTILIZATION,
        MEMORY_UTILIZATION,
        MEMORY_USED,
        MEMORY_TOTAL,
        POWER,
        POWER_LIMIT,
        TEMPERATURE,
        SM_CLOCK,
        SM_CLOCK_MAX,
        MEM_CLOCK,
        MEM_CLOCK_MAX,
        PSTATE,
        CLOCK_REASON,
        PCIE_GEN,
        PCIE_GEN_MAX,
        PCIE_WIDTH,
        PCIE_WIDTH_MAX,
        PCIE_TX,
        PCIE_RX,
        PCIE_REPLAYS,
        ECC_ERRORS,
        PERSISTENCE,
        ECC_MODE,
        NVLINK,
        NVLINK_EXPECTED,
        PROCESSES,
        PROCESS_MEMORY,
        XID,
        LAST_XID,
        HUNG,
        STALE,
        CUDA_VERSION,
        DEVICES,
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self._now: Callable[[], float] = context.extras.get("now", time.time)
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._table = process_table(context)
        # how the poll waits for its reader: done.wait in real time; the simulator's
        # (virtual time) returns as soon as the reader blocks in a hung call
        self._wait_reader: Callable[[threading.Event, threading.Thread, float], bool] = (
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
        self._reasons: list[tuple[str, int]] = []
        self._direct: Direct | None = None
        self._xid_type = 0
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
        self._wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait

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

    # -- polling ----------------------------------------------------------------------

    def collect(self) -> list[Sample]:
        """The reader thread reads every GPU it can; what it has not read within
        `_patience` (a call blocked on a GPU) is reported without waiting longer."""
        if self._nv is None:
            self._start()
        poll, reader = _Poll(), self._reader
        if reader is None:
            reader = self._reader = _Reader(self._read_gpus)
        reader.submit(poll)
        if not self._wait_reader(reader.done, reader.thread, self._patience):
            with poll.lock:
                poll.closed = True
            reader.retire()
            self._reader = None
        elif poll.error is not None:
            raise poll.error
        with poll.lock:
            read = dict(poll.read)
        out = list(self._globals)
        listed = []
        now = self._clock()
        for gpu in self._gpus:
            samples, since = read.get(gpu.index), gpu.busy_since
            lists: dict[str, dict[int, float]] | None = None
            if samples is None and since is not None:  # inside a call that has not returned
                self._hung(gpu, now - since, out)
            else:  # read, or else not reached this poll (held up behind a GPU that blocked)
                out.extend(gpu.last if samples is None else samples)
                if gpu.info is not None:
                    out.append(Sample(STALE.name, gpu.labels, float(samples is None)))
                    out.append(Sample(HUNG.name, gpu.labels, 0.0))
                lists = gpu.last_lists
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
                self._drain_events()
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

    def _take(self, gpu: _Gpu, poll: _Poll) -> bool:
        if poll.closed or not gpu.lock.acquire(blocking=False):
            return False
        gpu.busy_since = self._clock()
        return True

    def _give(self, gpu: _Gpu) -> None:
        gpu.busy_since = None
        gpu.lock.release()

    def _identify(self, gpu: _Gpu) -> None:
        """Handle and identity, read once; retried each poll until they can be read."""
        nv = self._nv
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(gpu.index)
            uuid = nv.nvmlDeviceGetUUID(handle)
        except nv.NVMLError as e:
            gpu.lost = e.value == nv.NVML_ERROR_GPU_IS_LOST
            log.debug("nvml: GPU %d: no handle yet: %s", gpu.index, self._describe(e))
            return
        name = quietly(nv, nv.nvmlDeviceGetName, handle) or ""
        pci_info = getattr(nv, "nvmlDeviceGetPciInfo_v3", None) or nv.nvmlDeviceGetPciInfo
        pci = quietly(nv, pci_info, handle)
        gpu.bus_id = sysfs_bus_id(pci.busId) if pci is not None else ""
        labels = (str(gpu.index), uuid)
        gpu.labels = labels
        gpu.info = Sample(INFO.name, labels + (name, gpu.bus_id, self._driver, self._cuda), 1.0)
        gpu.reason_labels = [(bit, labels + (label,)) for label, bit in self._reasons]
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

    def _links(self, gpu: _Gpu, count_field: int) -> int:
        """How many NVLinks the GPU has (0: none, or the driver cannot tell)."""
        nv, direct = self._nv, self._direct
        assert direct is not None
        try:
            ((code, _, count),) = direct.field_values(
                gpu.handle, direct.request([(count_field, 0)])
            )
        except nv.NVMLError as e:
            log.debug("nvml: GPU %d: NVLink count: %s", gpu.index, self._describe(e))
            return 0
        return int(count) if code == nv.NVML_SUCCESS and count is not None else 0

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

    def _drain_events(self) -> None:
        """Take every pending Xid event without waiting (timeout 0)."""
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
            if not data.eventType & self._xid_type:
                continue
            gpu = self._by_address.get(ctypes.cast(data.device, ctypes.c_void_p).value or 0)
            if gpu is not None:
                xid = int(data.eventData)
                gpu.xids[xid] = gpu.xids.get(xid, 0) + 1
                gpu.last_xid = self._now()
                log.warning("nvml: GPU %d: Xid %d", gpu.index, xid)

    def _collect_gpu(self, gpu: _Gpu, out: list[Sample]) -> None:
        if gpu.handle is None:
            if gpu.lost:
                out.append(Sample(LOST.name, gpu.labels, 1.0))
            return
        mine: list[Sample] = []
        try:
            self._field_values(gpu, mine)
            self._reads(gpu, mine)
        except _GpuLost:
            if not gpu.lost:
                log.warning("nvml: GPU %d (%s): lost (GPU_IS_LOST)", gpu.index, gpu.labels[1])
            gpu.lost = True
            gpu.counters.clear()
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
        """gpu_info, gpu_lost and the Xids drained for it: what a lost GPU still shows."""
        assert gpu.info is not None
        out.append(gpu.info)
        out.append(Sample(LOST.name, gpu.labels, lost))
        for xid, count in gpu.xids.items():
            out.append(Sample(XID.name, gpu.labels + (str(xid),), float(count)))
        if gpu.last_xid is not None:
            out.append(Sample(LAST_XID.name, gpu.labels, gpu.last_xid))

    def _reads(self, gpu: _Gpu, out: list[Sample]) -> None:
        polls, kept = gpu.polls, gpu.kept
        for read in gpu.reads:
            key, every = read.key, read.every
            if every != EVERY_POLL and key in kept and (every == ONCE or polls % every):
                out.extend(kept[key])  # what it gave when it was read
                continue
            value = self._read(gpu, read)
            if value is _MISSING:
                kept.pop(key, None)  # asked again next poll
                if read.listing:
                    gpu.lists.pop(read.listing, None)
                continue
            if read.listing:
                gpu.lists[read.listing] = value
            if read.emit is None:
                samples = [Sample(read.metric, gpu.labels, value * read.scale)]
            else:
                samples = []
                read.emit(gpu, value, samples)
            if every != EVERY_POLL:
                kept[key] = samples
            out.extend(samples)

    def _read(self, gpu: _Gpu, read: Read) -> Any:
        key = read.key
        if key in gpu.disabled:
            return _MISSING
        calls = self._calls[key]
        choice = gpu.choice.get(key, 0)
        name, function, args = calls[choice]
        try:
            if function is None:  # this pynvml predates the function
                raise self._nv.NVMLError(self._nv.NVML_ERROR_FUNCTION_NOT_FOUND)
            value = function(gpu.handle, *args)
        except self._nv.NVMLError as e:
            if e.value == self._nv.NVML_ERROR_FUNCTION_NOT_FOUND and choice + 1 < len(calls):
                gpu.choice[key] = choice + 1
                self._log_once(key, name, gpu, f"{self._describe(e)}, using {calls[choice + 1][0]}")
                return self._read(gpu, read)
            self._failed(gpu, key, name, e)
            return _MISSING
        return value

    def _field_values(self, gpu: _Gpu, out: list[Sample]) -> None:
        """FIELDS and the NVLink states in one call; each field has its own nvmlReturn."""
        if not gpu.batch:
            return
        nv, direct = self._nv, self._direct
        assert direct is not None
        try:
            values = direct.field_values(gpu.handle, gpu.request)
        except nv.NVMLError as e:
            self._failed(gpu, FIELDS_KEY, "nvmlDeviceGetFieldValues", e)
            if FIELDS_KEY in gpu.disabled:
                self._unsupported(gpu, set(range(len(gpu.batch))))
            return
        success = nv.NVML_SUCCESS
        unsupported: set[int] = set()
        for i, ((code, stamp, number), entry) in enumerate(zip(values, gpu.batch, strict=True)):
            if code == success and number is not None:
                if entry.field.rate:
                    self._rate(gpu, entry, int(number), stamp, out)
                else:
                    out.append(Sample(entry.field.metric, entry.labels, number * entry.field.scale))
                    if entry.field is NVLINK_STATE:
                        self._nvlink_expected(gpu, entry, bool(number), out)
            elif code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost
            elif code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                unsupported.add(i)
                why = self._describe(nv.NVMLError(code))
                self._log_once(entry.what, f"field {entry.what} ({entry.field.metric})", gpu, why)
        if unsupported:
            self._unsupported(gpu, unsupported)

    def _nvlink_expected(self, gpu: _Gpu, entry: _Entry, active: bool, out: list[Sample]) -> None:
        """Whether this link should be up (see the module's docstring): no call per poll,
        one nvmlDeviceGetNvLinkRemoteDeviceType per GPU at its first active link."""
        link = entry.scope
        if active:
            gpu.nvlink_seen.add(link)
            if gpu.nvlink_remote is None:
                gpu.nvlink_remote = self._remote_type(gpu, link)
                if gpu.nvlink_remote == getattr(self._nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                    self._nvswitch_links.add(gpu.nvlinks)
        configured = self.config.expected_nvlinks if isinstance(self.config, NvmlConfig) else ()
        expected = (
            active
            or link in gpu.nvlink_seen
            or gpu.nvlinks in self._nvswitch_links
            or configured == "all"
            or link in configured
        )
        out.append(Sample(NVLINK_EXPECTED.name, entry.labels, 1.0 if expected else 0.0))

    def _remote_type(self, gpu: _Gpu, link: int) -> int:
        """What an active link reaches (NVML_NVLINK_DEVICE_TYPE_*); UNKNOWN (0xFF) if the
        driver or binding cannot tell (it is not asked again)."""
        nv = self._nv
        function = getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        if function is None:
            return 0xFF
        try:
            return int(function(gpu.handle, link))
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from e
            log.debug("nvml: GPU %d: NVLink %d remote type: %s", gpu.index, link, self._describe(e))
            return 0xFF

    def _unsupported(self, gpu: _Gpu, indices: set[int]) -> None:
        """Drop these entries from the GPU's batch; their fallbacks are read from now on."""
        for i in sorted(indices):
            fallback = gpu.batch[i].field.fallback
            if fallback is not None and fallback not in gpu.reads:
                gpu.reads.append(fallback)
        self._ask(gpu, [e for i, e in enumerate(gpu.batch) if i not in indices])

    def _ask(self, gpu: _Gpu, entries: list[_Entry]) -> None:
        assert self._direct is not None
        gpu.batch = entries
        gpu.request = self._direct.request([(e.field_id, e.scope) for e in entries])

    def _rate(self, gpu: _Gpu, entry: _Entry, total: int, stamp_us: int, out: list[Sample]) -> None:
        """A byte counter's rate since the last reading, by the driver's own timestamps
        (a value the driver has not sampled again since keeps the last rate)."""
        before, before_us, rate = gpu.counters.get(entry.field_id, (0, None, None))
        if stamp_us != before_us:
            rate = None  # the first reading, or a counter that wrapped or reset: no rate yet
            if before_us is not None and stamp_us > before_us and total >= before:
                rate = (total - before) * 1e6 / (stamp_us - before_us)
            gpu.counters[entry.field_id] = (total, stamp_us, rate)
        if rate is not None:
            out.append(Sample(entry.field.metric, entry.labels, rate))


_MISSING = object()
