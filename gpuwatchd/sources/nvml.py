"""Per-GPU telemetry from NVML, through the real bindings (nvidia-ml-py's `pynvml`).

The binding is `context.pynvml` when set (the simulator passes a private pynvml whose C
library is a fake), else `import pynvml`. NVML is initialised on the first poll; if that
fails (no libnvidia-ml, driver not loaded, ...) the poll raises SourceError with a
one-line reason and the next poll tries again.

Per GPU, identity (UUID, name, PCI bus id) and static limits (max clocks, max PCIe
link) are read once and cached; everything else is read on every poll from the table
`READS` (one NVML call each), plus one nvmlDeviceGetFieldValues call (PCIe replays and
ECC totals), the NVLink states and the Xid events drained from one event set.

Errors, per GPU and per call:
- NOT_SUPPORTED / FUNCTION_NOT_FOUND: the series is dropped for that GPU and the call
  is never made again on it (logged once). A read with an older alternative (clock
  event reasons -> throttle reasons) falls back to it on FUNCTION_NOT_FOUND instead.
- GPU_IS_LOST: this poll reports only `gpu_lost 1` for that GPU; other GPUs go on.
- anything else: that series is missing from this poll only.
A call that blocks (a GPU gone bad inside the driver) blocks the poll: the scheduler
reports the source down after its timeout and never starts a second call beside it.

NVML's event data carries no time, so an Xid is stamped when it is drained, with
`context.extras["now"]` (a wall-clock callable; default time.time) so that a replay in
virtual time stamps it in scenario time. `gpu_info`'s pci_bus_id is in the sysfs form
("0000:34:00.0", as the pcie source's gpu_bus_id), not NVML's "00000000:34:00.0".
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import GPU_LABELS, MetricSpec, Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError

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
PROCESSES = _gpu_gauge("gpu_compute_processes", "Compute processes running on the GPU.")
PROCESS_MEMORY = _gpu_gauge(
    "gpu_process_memory_used_bytes", "Device memory used by one process.", ("pid",)
)
XID = counter("gpu_xid_errors_total", "Xid errors reported by the driver.", GPU_LABELS + ("xid",))
LAST_XID = _gpu_gauge("gpu_last_xid_timestamp_seconds", "When the last Xid error was seen.")
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
# c_nvmlValue_t member for each NVML_VALUE_TYPE_* (0..6)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class _GpuLost(Exception):
    pass


class _Gpu:
    """What the source remembers about one GPU index."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.handle: Any = None
        self.labels: tuple[str, ...] = (str(index), "")
        self.info: Sample | None = None
        self.lost = False
        self.disabled: set[str] = set()  # read keys found unsupported on this GPU
        self.choice: dict[str, int] = {}  # read key -> alternative in use (after fallbacks)
        self.static: dict[str, Any] = {}  # read key -> value read once
        self.nvlinks: int | None = None  # None: not probed yet
        self.link_labels: list[tuple[str, ...]] = []
        self.reason_labels: list[tuple[int, tuple[str, ...]]] = []
        self.fields: list[tuple[int, str, tuple[str, ...]]] = []  # (field id, metric, labels)
        self.field_ids: list[int] = []
        self.events = "pending"  # pending | registered | unsupported
        self.xids: dict[int, int] = {}
        self.last_xid: float | None = None


def _emit_utilization(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(UTILIZATION.name, gpu.labels, value.gpu / 100))
    out.append(Sample(MEMORY_UTILIZATION.name, gpu.labels, value.memory / 100))


def _emit_memory(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(MEMORY_USED.name, gpu.labels, float(value.used)))
    out.append(Sample(MEMORY_TOTAL.name, gpu.labels, float(value.total)))


def _emit_reasons(gpu: _Gpu, mask: int, out: list[Sample]) -> None:
    for bit, labels in gpu.reason_labels:
        out.append(Sample(CLOCK_REASON.name, labels, 1.0 if mask & bit else 0.0))


def _emit_ecc_mode(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(ECC_MODE.name, gpu.labels, float(value[0])))  # [current, pending]


def _emit_processes(gpu: _Gpu, processes: Any, out: list[Sample]) -> None:
    used: dict[int, float] = {}
    for process in processes:
        memory = process.usedGpuMemory  # None where the driver cannot tell (WDDM)
        used[process.pid] = used.get(process.pid, 0.0) + (memory or 0)
    out.append(Sample(PROCESSES.name, gpu.labels, float(len(used))))
    for pid, memory in used.items():
        out.append(Sample(PROCESS_MEMORY.name, gpu.labels + (str(pid),), memory))


@dataclass(frozen=True)
class Read:
    """One NVML call per GPU per poll (or once, if static) and the samples it gives."""

    key: str  # what an unsupported call is remembered by
    functions: tuple[str, ...]  # pynvml functions, preferred first; FunctionNotFound: next
    args: tuple[str, ...] = ()  # names of pynvml constants passed after the handle
    metric: str = ""  # scalar reads: the metric, and the factor to base units
    scale: float = 1.0
    emit: Callable[[_Gpu, Any, list[Sample]], None] | None = None  # other reads
    static: bool = False  # read once per GPU, then cached


READS: tuple[Read, ...] = (
    Read("utilization", ("nvmlDeviceGetUtilizationRates",), emit=_emit_utilization),
    Read("memory", ("nvmlDeviceGetMemoryInfo",), emit=_emit_memory),
    Read("power", ("nvmlDeviceGetPowerUsage",), metric=POWER.name, scale=1e-3),  # mW
    Read("power_limit", ("nvmlDeviceGetEnforcedPowerLimit",), metric=POWER_LIMIT.name, scale=1e-3),
    Read(
        "temperature",
        ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"),
        ("NVML_TEMPERATURE_GPU",),
        metric=TEMPERATURE.name,
    ),
    Read("sm_clock", ("nvmlDeviceGetClockInfo",), ("NVML_CLOCK_SM",), SM_CLOCK.name, 1e6),
    Read(
        "sm_clock_max",
        ("nvmlDeviceGetMaxClockInfo",),
        ("NVML_CLOCK_SM",),
        SM_CLOCK_MAX.name,
        1e6,
        static=True,
    ),
    Read("mem_clock", ("nvmlDeviceGetClockInfo",), ("NVML_CLOCK_MEM",), MEM_CLOCK.name, 1e6),
    Read(
        "mem_clock_max",
        ("nvmlDeviceGetMaxClockInfo",),
        ("NVML_CLOCK_MEM",),
        MEM_CLOCK_MAX.name,
        1e6,
        static=True,
    ),
    Read("pstate", ("nvmlDeviceGetPerformanceState",), metric=PSTATE.name),
    Read(
        "clock_reasons",
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        emit=_emit_reasons,
    ),
    Read("pcie_gen", ("nvmlDeviceGetCurrPcieLinkGeneration",), metric=PCIE_GEN.name),
    Read(
        "pcie_gen_max",
        ("nvmlDeviceGetMaxPcieLinkGeneration",),
        metric=PCIE_GEN_MAX.name,
        static=True,
    ),
    Read("pcie_width", ("nvmlDeviceGetCurrPcieLinkWidth",), metric=PCIE_WIDTH.name),
    Read(
        "pcie_width_max",
        ("nvmlDeviceGetMaxPcieLinkWidth",),
        metric=PCIE_WIDTH_MAX.name,
        static=True,
    ),
    Read(
        "pcie_tx",
        ("nvmlDeviceGetPcieThroughput",),
        ("NVML_PCIE_UTIL_TX_BYTES",),
        PCIE_TX.name,
        1024.0,
    ),  # KB/s, KB = 1024 bytes
    Read(
        "pcie_rx",
        ("nvmlDeviceGetPcieThroughput",),
        ("NVML_PCIE_UTIL_RX_BYTES",),
        PCIE_RX.name,
        1024.0,
    ),
    Read("persistence_mode", ("nvmlDeviceGetPersistenceMode",), metric=PERSISTENCE.name),
    Read("ecc_mode", ("nvmlDeviceGetEccMode",), emit=_emit_ecc_mode),
    Read(
        "processes",
        ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
        emit=_emit_processes,
    ),
)

# nvmlDeviceGetFieldValues, one call per GPU: (field id constant, metric, extra labels)
FIELDS = (
    ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", PCIE_REPLAYS.name, ()),
    ("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", ECC_ERRORS.name, ("corrected",)),
    ("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", ECC_ERRORS.name, ("uncorrected",)),
)
NVLINK_KEY = "nvlink"
FIELDS_KEY = "field_values"

_INIT_HINTS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "libnvidia-ml.so.1 not found",
        "is the NVIDIA driver installed on this node?",
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": ("NVIDIA driver not loaded", "is this a GPU node?"),
    "NVML_ERROR_NO_PERMISSION": (
        "permission denied",
        "can this user open /dev/nvidiactl and /dev/nvidia*?",
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "NVML library and kernel driver versions differ",
        "was the driver upgraded without a reboot?",
    ),
}


def load_binding(context: Context) -> Any:
    """The NVML binding: `context.pynvml` (the simulator's) or the installed pynvml."""
    if context.pynvml is not None:
        return context.pynvml
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise SourceError(
            "NVML unavailable: the nvidia-ml-py package (module pynvml) is not installed"
        ) from None


def error_codes(nv: Any) -> dict[int, str]:
    """NVML_ERROR_* value -> its name, from the binding."""
    return {getattr(nv, n): n for n in dir(nv) if n.startswith("NVML_ERROR_")}


def init_failure(error: Any, codes: dict[int, str]) -> str:
    """The one-line reason nvmlInit failed, with a hint for the common causes."""
    code = codes.get(error.value, f"code {error.value}")
    what, hint = _INIT_HINTS.get(code, (f"nvmlInit failed: {error}", ""))
    return f"NVML unavailable: {what} ({code})" + (f"; {hint}" if hint else "")


def start_nvml(context: Context) -> tuple[Any, dict[int, str], int]:
    """Initialise NVML through the context's binding: (binding, error names, GPU count).

    Raises SourceError with a one-line reason when NVML cannot be used on this node.
    """
    nv = load_binding(context)
    codes = error_codes(nv)
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        raise SourceError(init_failure(e, codes)) from None
    try:
        count = nv.nvmlDeviceGetCount()
    except nv.NVMLError as e:
        quietly(nv, nv.nvmlShutdown)
        name = codes.get(e.value, f"code {e.value}")
        raise SourceError(f"NVML unavailable: nvmlDeviceGetCount failed: {e} ({name})") from None
    return nv, codes, count


def cuda_version_string(version: int) -> str:
    """12040 (as nvmlSystemGetCudaDriverVersion returns it) -> "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:34:00.0" -> "0000:34:00.0", as in sysfs (and the pcie source)."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    if not rest:
        return nvml_bus_id
    return f"{int(domain or '0', 16):04x}:{rest}"


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
        PROCESSES,
        PROCESS_MEMORY,
        XID,
        LAST_XID,
        CUDA_VERSION,
        DEVICES,
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self._now: Callable[[], float] = context.extras.get("now", time.time)
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
        self._fields: list[tuple[int, str, tuple[str, ...]]] = []
        self._reasons: list[tuple[str, int]] = []
        self._xid_type = 0
        self._wait: Any = None
        self._max_links = 0

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

        def bound(read: Read) -> list[tuple[str, Any, tuple[Any, ...]]]:
            args = tuple(getattr(nv, a) for a in read.args)
            return [(f, getattr(nv, f, None), args) for f in read.functions]

        self._calls = {read.key: bound(read) for read in READS}
        self._fields = [(getattr(nv, f), metric, extra) for f, metric, extra in FIELDS]
        self._reasons = []
        for label, suffix in CLOCK_REASONS.items():
            bit = getattr(nv, "nvmlClocksEventReason" + suffix, None)
            bit = getattr(nv, "nvmlClocksThrottleReason" + suffix, bit)
            if bit:
                self._reasons.append((label, int(bit)))
        self._xid_type = int(nv.nvmlEventTypeXidCriticalError)
        self._wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        self._max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))

    def close(self) -> None:
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
        if self._nv is None:
            self._start()
        out = list(self._globals)
        for gpu in self._gpus:
            if gpu.handle is None:
                self._identify(gpu)
            if gpu.handle is not None and gpu.events == "pending":
                self._register_events(gpu)
        self._drain_events()
        for gpu in self._gpus:
            self._collect_gpu(gpu, out)
        return out

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
        bus_id = sysfs_bus_id(pci.busId) if pci is not None else ""
        labels = (str(gpu.index), uuid)
        gpu.labels = labels
        gpu.info = Sample(INFO.name, labels + (name, bus_id, self._driver, self._cuda), 1.0)
        gpu.reason_labels = [(bit, labels + (label,)) for label, bit in self._reasons]
        gpu.fields = [(fid, metric, labels + extra) for fid, metric, extra in self._fields]
        gpu.field_ids = [fid for fid, _, _ in gpu.fields]
        gpu.handle = handle
        address = ctypes.cast(handle, ctypes.c_void_p).value
        if address is not None:
            self._by_address[address] = gpu

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
            self._reads(gpu, mine)
            self._field_values(gpu, mine)
            self._nvlinks(gpu, mine)
        except _GpuLost:
            if not gpu.lost:
                log.warning("nvml: GPU %d (%s): lost (GPU_IS_LOST)", gpu.index, gpu.labels[1])
            gpu.lost = True
            out.append(Sample(LOST.name, gpu.labels, 1.0))
            return
        if gpu.lost:
            log.info("nvml: GPU %d: answering again", gpu.index)
            gpu.lost = False
        assert gpu.info is not None
        out.append(gpu.info)
        out.append(Sample(LOST.name, gpu.labels, 0.0))
        out.extend(mine)
        for xid, count in gpu.xids.items():
            out.append(Sample(XID.name, gpu.labels + (str(xid),), float(count)))
        if gpu.last_xid is not None:
            out.append(Sample(LAST_XID.name, gpu.labels, gpu.last_xid))

    def _reads(self, gpu: _Gpu, out: list[Sample]) -> None:
        missing = _MISSING
        for read in READS:
            value = self._read(gpu, read)
            if value is missing:
                continue
            if read.emit is None:
                out.append(Sample(read.metric, gpu.labels, value * read.scale))
            else:
                read.emit(gpu, value, out)

    def _read(self, gpu: _Gpu, read: Read) -> Any:
        key = read.key
        if key in gpu.disabled:
            return _MISSING
        if read.static and key in gpu.static:
            return gpu.static[key]
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
        if read.static:
            gpu.static[key] = value
        return value

    def _field_values(self, gpu: _Gpu, out: list[Sample]) -> None:
        """PCIe replays and ECC totals in one call; each field has its own nvmlReturn."""
        if not gpu.field_ids:
            return
        nv = self._nv
        try:
            values = nv.nvmlDeviceGetFieldValues(gpu.handle, gpu.field_ids)
        except nv.NVMLError as e:
            self._failed(gpu, FIELDS_KEY, "nvmlDeviceGetFieldValues", e)
            if FIELDS_KEY in gpu.disabled:
                gpu.field_ids = []
            return
        unsupported: set[int] = set()
        for value, (field_id, metric, labels) in zip(values, gpu.fields, strict=False):
            code = value.nvmlReturn
            if code == nv.NVML_SUCCESS and value.valueType < len(_VALUE_MEMBERS):
                member = _VALUE_MEMBERS[value.valueType]
                out.append(Sample(metric, labels, float(getattr(value.value, member))))
            elif code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost
            elif code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                unsupported.add(field_id)
                why = self._describe(nv.NVMLError(code))
                self._log_once(f"field {field_id}", f"field {field_id} ({metric})", gpu, why)
        if unsupported:
            gpu.fields = [f for f in gpu.fields if f[0] not in unsupported]
            gpu.field_ids = [f[0] for f in gpu.fields]

    def _nvlinks(self, gpu: _Gpu, out: list[Sample]) -> None:
        """Links 0..N-1; N is found on the first poll (the first link NVML refuses)."""
        if NVLINK_KEY in gpu.disabled:
            return
        nv = self._nv
        probing = gpu.nvlinks is None
        end = self._max_links if gpu.nvlinks is None else gpu.nvlinks
        for link in range(end):
            try:
                active = nv.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except nv.NVMLError as e:
                if e.value == nv.NVML_ERROR_GPU_IS_LOST:
                    raise _GpuLost from None
                if probing:
                    self._probe_ended(gpu, link, e)
                    return
                log.debug("nvml: GPU %d: NVLink %d: %s", gpu.index, link, self._describe(e))
                continue
            out.append(Sample(NVLINK.name, self._link_labels(gpu, link), float(active)))
        gpu.nvlinks = end

    def _probe_ended(self, gpu: _Gpu, link: int, error: Any) -> None:
        nv = self._nv
        if error.value in (nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_SUPPORTED):
            gpu.nvlinks = link  # links 0..link-1 exist
        elif error.value == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
            gpu.nvlinks = 0
        else:
            return  # count again next poll
        if link == 0 or gpu.nvlinks == 0:
            gpu.disabled.add(NVLINK_KEY)
            self._log_once(NVLINK_KEY, "nvmlDeviceGetNvLinkState", gpu, self._describe(error))

    def _link_labels(self, gpu: _Gpu, link: int) -> tuple[str, ...]:
        labels = gpu.link_labels
        if link >= len(labels):
            labels.extend(gpu.labels + (str(i),) for i in range(len(labels), link + 1))
        return labels[link]


_MISSING = object()


def quietly(nv: ModuleType, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, or None if NVML answers with an error."""
    try:
        return function(*args)
    except nv.NVMLError as e:
        log.debug("nvml: %s failed: %s", getattr(function, "__name__", function), e)
        return None
