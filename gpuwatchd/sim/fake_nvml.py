"""A fake libnvidia-ml under the real pynvml: the simulator's NVML.

`make_pynvml(timeline, clock)` loads a private copy of the installed nvidia-ml-py
module (`pynvml`) and sets its `nvmlLib` (what `CDLL("libnvidia-ml.so.1")` would have
returned) to a `FakeNvmlLib`. Every pynvml function then runs unchanged: it builds its
ctypes structs and buffers, looks the C symbol up by name (versioned names such as
`nvmlDeviceGetHandleByIndex_v2` included; a symbol the fake lacks raises
`NVMLError_FunctionNotFound`), calls it, and maps the `nvmlReturn_t` it gets back to
its own `NVMLError_*` subclasses. The fake's symbols take the C arguments (`byref(x)`
objects, `create_string_buffer` arrays, structs, arrays of `c_nvmlFieldValue_t`),
write the scenario's values through them in NVML's units and return an int.

The values come from `timeline.state(clock.elapsed())`. Per GPU, the scenario's `lost`
makes every call on it answer NVML_ERROR_GPU_IS_LOST, `hung` makes it block (real time)
until the GPU is no longer hung or `release()` is called, and the model's `unsupported`
symbols answer NVML_ERROR_NOT_SUPPORTED. Tests reach the fake as
`module._gpuwatchd_fake` to inject errors (`fail`, `fail_field`), hang a GPU (`hang`),
raise Xid events (`inject_xid`) and count calls (`calls`, `gpu_calls`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import itertools
import re
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fakelib import Symbol, install_symbols, symbol
from gpuwatchd.sim.scenario import Timeline

# Return codes (nvml.h); the same numbers as pynvml's NVML_SUCCESS / NVML_ERROR_*
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_INSUFFICIENT_SIZE = 7
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
ERROR_ARGUMENT_VERSION_MISMATCH = 25
ERROR_UNKNOWN = 999

# scenario clock_event_reasons name -> pynvml constant (bit in the reasons mask)
CLOCK_EVENT_REASON_CONSTANTS = {
    "gpu_idle": "nvmlClocksEventReasonGpuIdle",
    "applications_clocks_setting": "nvmlClocksEventReasonApplicationsClocksSetting",
    "sw_power_cap": "nvmlClocksEventReasonSwPowerCap",
    "hw_slowdown": "nvmlClocksEventReasonHwSlowdown",
    "sync_boost": "nvmlClocksEventReasonSyncBoost",
    "sw_thermal_slowdown": "nvmlClocksEventReasonSwThermalSlowdown",
    "hw_thermal_slowdown": "nvmlClocksEventReasonHwThermalSlowdown",
    "hw_power_brake_slowdown": "nvmlClocksEventReasonHwPowerBrakeSlowdown",
    "display_clock_setting": "nvmlClocksEventReasonDisplayClockSetting",
}

NOT_AVAILABLE_UINT = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId when MIG is off
HANG_CAP_SECONDS = 60.0  # a hung call never blocks longer than this (real time)
REAL_TIME_RESOLUTION = 0.05  # real-time clocks: state is recomputed at most this often
MIB = 2**20

_VERSION_SUFFIX = re.compile(r"_v\d+$")
_module_ids = itertools.count()


def load_private_pynvml() -> ModuleType:
    """A fresh copy of the installed pynvml, sharing no state with `import pynvml`.

    pynvml builds its NVMLError_* classes from `sys.modules[__name__]` while it is
    executed, so the copy is registered under its own name for that time only.
    """
    import pynvml as installed

    name = f"gpuwatchd_sim_pynvml_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, installed.__file__)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a copy of pynvml from {installed.__file__}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def make_pynvml(
    timeline: Timeline,
    clock: SimClock,
    *,
    driver_loaded: bool = True,
    missing_functions: Iterable[str] = (),
    hang_cap: float = HANG_CAP_SECONDS,
) -> ModuleType:
    """A private pynvml whose C library is a FakeNvmlLib playing `timeline` at `clock`.

    The fake is reachable as `module._gpuwatchd_fake`. `driver_loaded=False` makes
    nvmlInit fail with NVML_ERROR_DRIVER_NOT_LOADED; `missing_functions` are symbols
    the fake library lacks (an older driver), so pynvml raises FunctionNotFound.
    """
    module = load_private_pynvml()
    fake = FakeNvmlLib(
        module,
        timeline,
        clock,
        driver_loaded=driver_loaded,
        missing_functions=missing_functions,
        hang_cap=hang_cap,
    )
    # nvmlLib: what _LoadNvmlLibrary's CDLL("libnvidia-ml.so.1") would have set
    vars(module).update(nvmlLib=fake, _gpuwatchd_fake=fake)
    return module


def gpu_uuid(hostname: str, index: int) -> str:
    """Deterministic `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` for a node's GPU."""
    digest = hashlib.sha256(f"{hostname}/gpu{index}".encode()).digest()
    return f"GPU-{uuid.UUID(bytes=digest[:16])}"


def nvml_bus_id(bdf: str) -> tuple[str, int, int, int]:
    """NVML's busId ("00000000:34:00.0", 8-digit domain, upper case) and its parts."""
    domain_s, bus_s, devfn = bdf.split(":")
    device_s = devfn.split(".")[0]
    domain, bus, device = int(domain_s, 16), int(bus_s, 16), int(device_s, 16)
    return f"{domain:08X}:{bus:02X}:{device:02X}.0", domain, bus, device


@dataclass
class _Failure:
    symbol: str
    code: int
    gpu: int | None
    remaining: int | None  # None: every call


def _value(arg: Any) -> int:
    """An integer argument as the C function sees it (ctypes scalar or Python int)."""
    return int(arg.value) if hasattr(arg, "value") else int(arg)


class _EventSet:
    def __init__(self, struct: Any, created_at: float) -> None:
        self.struct = struct
        self.since = created_at  # timeline events after this are still to be delivered
        self.masks: dict[int, int] = {}  # gpu -> registered event types
        self.pending: list[tuple[int, int, int]] = []  # (gpu, event type, data)


class FakeNvmlLib:
    """libnvidia-ml's symbols as Python callables with the C signatures."""

    def __init__(
        self,
        pynvml: ModuleType,
        timeline: Timeline,
        clock: SimClock,
        *,
        driver_loaded: bool = True,
        missing_functions: Iterable[str] = (),
        hang_cap: float = HANG_CAP_SECONDS,
    ) -> None:
        self.nv = pynvml
        self.timeline = timeline
        self.clock = clock
        self.node = timeline.scenario.node
        self.model = self.node.model()
        self.driver_loaded = driver_loaded
        self.missing = set(missing_functions)
        self.hang_cap = hang_cap
        self.calls: Counter[str] = Counter()  # symbol -> calls
        self.gpu_calls: Counter[tuple[str, int]] = Counter()  # (symbol, gpu) -> calls
        self.blocked = threading.Event()  # set when a call starts blocking on a hung GPU
        self.hang_timeouts = 0  # hung calls that gave up at hang_cap
        self._released = threading.Event()
        self._forced_hung: set[int] = set()
        self._failures: list[_Failure] = []
        self._field_failures: dict[tuple[int | None, int], int] = {}
        self._refcount = 0
        self._lock = threading.Lock()
        self._events_changed = threading.Condition(self._lock)
        self._event_sets: dict[int, _EventSet] = {}
        count = self.node.gpu_count
        self._devices = [pynvml.struct_c_nvmlDevice_t() for _ in range(count)]
        self._device_index = {ctypes.addressof(s): i for i, s in enumerate(self._devices)}
        self._uuids = [gpu_uuid(self.node.hostname, i) for i in range(count)]
        self._unsupported = set(self.model.unsupported)
        self._reason_bits = {
            name: int(getattr(pynvml, constant))
            for name, constant in CLOCK_EVENT_REASON_CONSTANTS.items()
        }
        self._field_handlers = self._build_field_handlers()
        self._install_symbols()

    # -- the symbol table -------------------------------------------------------------

    def _install_symbols(self) -> None:
        """Expose each `_nvmlXxx` implementation as the symbol `nvmlXxx`, via _invoke.

        Instance attributes, so `getattr(lib, name)` finds them; a symbol in `missing`
        is simply absent, and pynvml turns the AttributeError into FunctionNotFound.
        """
        install_symbols(self, self.missing)

    def symbols(self) -> list[str]:
        """Every symbol this fake library exports."""
        return sorted(name for name, v in vars(self).items() if isinstance(v, Symbol))

    def _invoke(self, name: str, impl: Callable[..., int], kind: str, args: tuple) -> int:
        self.calls[name] += 1
        if kind != "noinit" and self._refcount == 0:
            return ERROR_UNINITIALIZED
        if kind == "device" or kind == "index":
            gpu = self._gpu_of(args[0]) if kind == "device" else _value(args[0])
            if gpu is None or not 0 <= gpu < len(self._devices):
                return ERROR_INVALID_ARGUMENT
            self.gpu_calls[(name, gpu)] += 1
            if self._failures:
                code = self._injected(name, gpu)
                if code is not None:
                    return code
            values = self._gpu_values(gpu)
            if values["lost"]:
                return ERROR_GPU_IS_LOST
            if self._is_hung(gpu, values):
                values = self._block(gpu)
                if values["lost"]:
                    return ERROR_GPU_IS_LOST
            if self._is_unsupported(name):
                return ERROR_NOT_SUPPORTED
            return impl(gpu, *args)
        if self._failures:
            code = self._injected(name, None)
            if code is not None:
                return code
        return impl(*args)

    def _gpu_of(self, handle: Any) -> int | None:
        try:
            return self._device_index.get(ctypes.addressof(handle.contents))
        except (AttributeError, ValueError, TypeError):  # NULL or not a device handle
            return None

    def _is_unsupported(self, name: str) -> bool:
        return name in self._unsupported or _VERSION_SUFFIX.sub("", name) in self._unsupported

    # -- test hooks ---------------------------------------------------------------------

    def fail(
        self, symbol: str, code: int, gpu: int | None = None, times: int | None = None
    ) -> None:
        """Make `symbol` (on `gpu`, or on any GPU / a system call) return `code`.

        `times`: only for that many calls; None: until `clear_failures()`.
        """
        self._failures.append(_Failure(symbol, code, gpu, times))

    def fail_field(self, field_id: int, code: int, gpu: int | None = None) -> None:
        """Make nvmlDeviceGetFieldValues report `code` in this field's nvmlReturn."""
        self._field_failures[(gpu, field_id)] = code

    def clear_failures(self) -> None:
        self._failures.clear()
        self._field_failures.clear()

    def hang(self, gpu: int) -> None:
        """Make every call on `gpu` block until `release()` (or hang_cap)."""
        self._forced_hung.add(gpu)
        self._released.clear()

    def release(self) -> None:
        """Unblock every hung call now and stop hung GPUs from blocking (until `hang`)."""
        self._forced_hung.clear()
        self._released.set()

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Raise an Xid on `gpu` now, as the kernel driver would, for registered sets."""
        xid_type = int(self.nv.nvmlEventTypeXidCriticalError)
        with self._events_changed:
            for event_set in self._event_sets.values():
                if event_set.masks.get(gpu, 0) & xid_type:
                    event_set.pending.append((gpu, xid_type, xid))
            self._events_changed.notify_all()

    def _injected(self, name: str, gpu: int | None) -> int | None:
        for failure in self._failures:
            if failure.symbol != name or (failure.gpu is not None and failure.gpu != gpu):
                continue
            if failure.remaining is not None:
                if failure.remaining <= 0:
                    continue
                failure.remaining -= 1
            return failure.code
        return None

    # -- the timeline ---------------------------------------------------------------------

    def _now(self) -> float:
        t = self.clock.elapsed()
        if not self.clock.virtual:  # don't rebuild the whole node's state on every call
            t = int(t / REAL_TIME_RESOLUTION) * REAL_TIME_RESOLUTION
        return t

    def _gpu_values(self, gpu: int) -> dict[str, Any]:
        return self.timeline.state(self._now())[0][gpu]

    def _is_hung(self, gpu: int, values: dict[str, Any]) -> bool:
        if self._released.is_set():
            return False
        return gpu in self._forced_hung or bool(values["hung"])

    def _block(self, gpu: int) -> dict[str, Any]:
        """Wait (real time) while `gpu` is hung; return its values when it answers."""
        deadline = time.monotonic() + self.hang_cap
        self.blocked.set()
        while True:
            values = self._gpu_values(gpu)
            if not self._is_hung(gpu, values):
                return values
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.hang_timeouts += 1
                return values
            self._released.wait(min(0.01, remaining))

    # -- init, errors, system ---------------------------------------------------------

    @symbol("noinit")
    def _nvmlInitWithFlags(self, flags: Any) -> int:
        if not self.driver_loaded:
            return ERROR_DRIVER_NOT_LOADED
        self._refcount += 1
        return SUCCESS

    @symbol("system")
    def _nvmlShutdown(self) -> int:
        self._refcount -= 1
        return SUCCESS

    @symbol("noinit")
    def _nvmlErrorString(self, result: Any) -> bytes:
        text = self.nv.NVMLError._errcode_to_string.get(_value(result), "Unknown Error")
        return str(text).encode()  # restype c_char_p: ctypes hands back bytes

    @symbol("system")
    def _nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        return _copy_string(buf, size, self.node.driver_version)

    @symbol("system")
    def _nvmlSystemGetNVMLVersion(self, buf: Any, size: Any) -> int:
        cuda_major = self.node.cuda_driver_version // 1000
        return _copy_string(buf, size, f"{cuda_major}.{self.node.driver_version}")

    @symbol("system")
    def _nvmlSystemGetCudaDriverVersion(self, out: Any) -> int:
        out._obj.value = self.node.cuda_driver_version
        return SUCCESS

    @symbol("system")
    def _nvmlSystemGetCudaDriverVersion_v2(self, out: Any) -> int:
        return self._nvmlSystemGetCudaDriverVersion(out)

    @symbol("system")
    def _nvmlDeviceGetCount_v2(self, out: Any) -> int:
        out._obj.value = len(self._devices)
        return SUCCESS

    # -- identity -------------------------------------------------------------------------

    @symbol("index")
    def _nvmlDeviceGetHandleByIndex_v2(self, gpu: int, index: Any, out: Any) -> int:
        out._obj.contents = self._devices[gpu]
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetIndex(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = gpu
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetUUID(self, gpu: int, handle: Any, buf: Any, size: Any) -> int:
        return _copy_string(buf, size, self._uuids[gpu])

    @symbol("device")
    def _nvmlDeviceGetName(self, gpu: int, handle: Any, buf: Any, size: Any) -> int:
        return _copy_string(buf, size, self.model.name)

    @symbol("device")
    def _nvmlDeviceGetPciInfo_v3(self, gpu: int, handle: Any, out: Any) -> int:
        info = out._obj
        bus_id, domain, bus, device = nvml_bus_id(self.timeline.topology.gpu(gpu).bdf)
        info.busId = bus_id.encode()
        info.busIdLegacy = f"{domain:04X}:{bus:02X}:{device:02X}.0".encode()
        info.domain, info.bus, info.device = domain, bus, device
        info.pciDeviceId = (self.model.pci_device_id << 16) | 0x10DE
        info.pciSubSystemId = (self.model.pci_device_id << 16) | 0x10DE
        return SUCCESS

    # -- utilization, memory, power, temperature, clocks ----------------------------------

    @symbol("device")
    def _nvmlDeviceGetUtilizationRates(self, gpu: int, handle: Any, out: Any) -> int:
        values = self._gpu_values(gpu)
        out._obj.gpu = round(values["utilization_gpu"])
        out._obj.memory = round(values["utilization_memory"])
        return SUCCESS

    def _memory(self, gpu: int) -> tuple[int, int]:
        total = self.model.memory_total_mib * MIB
        used = min(total, round(self._gpu_values(gpu)["memory_used_mib"] * MIB))
        return total, used

    @symbol("device")
    def _nvmlDeviceGetMemoryInfo(self, gpu: int, handle: Any, out: Any) -> int:
        total, used = self._memory(gpu)
        out._obj.total, out._obj.used, out._obj.free = total, used, total - used
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMemoryInfo_v2(self, gpu: int, handle: Any, out: Any) -> int:
        memory = out._obj
        if memory.version != self.nv.nvmlMemory_v2:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        total, used = self._memory(gpu)
        memory.total, memory.reserved, memory.used = total, 0, used
        memory.free = total - used
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPowerUsage(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = round(self._gpu_values(gpu)["power_w"] * 1000)  # mW
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetEnforcedPowerLimit(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = round(self.model.power_limit_w * 1000)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPowerManagementLimit(self, gpu: int, handle: Any, out: Any) -> int:
        return self._nvmlDeviceGetEnforcedPowerLimit(gpu, handle, out)

    def _temperature(self, gpu: int, sensor: int) -> int | None:
        if sensor != self.nv.NVML_TEMPERATURE_GPU:
            return None
        return round(self._gpu_values(gpu)["temperature_c"])

    @symbol("device")
    def _nvmlDeviceGetTemperature(self, gpu: int, handle: Any, sensor: Any, out: Any) -> int:
        value = self._temperature(gpu, _value(sensor))
        if value is None:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetTemperatureV(self, gpu: int, handle: Any, out: Any) -> int:
        reading = out._obj
        if reading.version != self.nv.nvmlTemperature_v1:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        value = self._temperature(gpu, reading.sensorType)
        if value is None:
            return ERROR_INVALID_ARGUMENT
        reading.temperature = value
        return SUCCESS

    def _clock(self, gpu: int, clock_type: int, maximum: bool) -> int | None:
        nv = self.nv
        if clock_type in (nv.NVML_CLOCK_GRAPHICS, nv.NVML_CLOCK_SM):
            key, limit = "sm_clock_mhz", self.model.max_sm_clock_mhz
        elif clock_type == nv.NVML_CLOCK_MEM:
            key, limit = "mem_clock_mhz", self.model.max_mem_clock_mhz
        elif clock_type == nv.NVML_CLOCK_VIDEO:  # video clock tracks SM at ~87 %
            key, limit = "sm_clock_mhz", round(self.model.max_sm_clock_mhz * 0.87)
            if not maximum:
                return round(self._gpu_values(gpu)[key] * 0.87)
        else:
            return None
        return limit if maximum else round(self._gpu_values(gpu)[key])

    @symbol("device")
    def _nvmlDeviceGetClockInfo(self, gpu: int, handle: Any, clock_type: Any, out: Any) -> int:
        value = self._clock(gpu, _value(clock_type), maximum=False)
        if value is None:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxClockInfo(self, gpu: int, handle: Any, clock_type: Any, out: Any) -> int:
        value = self._clock(gpu, _value(clock_type), maximum=True)
        if value is None:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPerformanceState(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self._gpu_values(gpu)["pstate"])
        return SUCCESS

    def _reasons(self, gpu: int) -> int:
        mask = 0
        for name in self._gpu_values(gpu)["clock_event_reasons"]:
            mask |= self._reason_bits[name]
        return mask

    @symbol("device")
    def _nvmlDeviceGetCurrentClocksEventReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._reasons(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._reasons(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetSupportedClocksEventReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self.nv.nvmlClocksEventReasonAll)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetSupportedClocksThrottleReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self.nv.nvmlClocksEventReasonAll)
        return SUCCESS

    # -- PCIe -----------------------------------------------------------------------------

    def _max_gen(self, gpu: int) -> int:
        """Max generation "possible with this device and system": min of both ends."""
        topology = self.timeline.topology
        fn = topology.gpu(gpu)
        parent = topology.functions.get(fn.parent) if fn.parent else None
        return min(fn.max_gen, parent.max_gen) if parent else fn.max_gen

    @symbol("device")
    def _nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self._gpu_values(gpu)["pcie_gen"])
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._max_gen(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetGpuMaxPcieLinkGeneration(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self.model.pcie_max_gen
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetCurrPcieLinkWidth(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self._gpu_values(gpu)["pcie_width"])
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxPcieLinkWidth(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self.timeline.topology.gpu(gpu).max_width
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPcieThroughput(self, gpu: int, handle: Any, counter: Any, out: Any) -> int:
        which = _value(counter)
        if which == self.nv.NVML_PCIE_UTIL_TX_BYTES:
            mb_s = self._gpu_values(gpu)["pcie_tx_mb_s"]
        elif which == self.nv.NVML_PCIE_UTIL_RX_BYTES:
            mb_s = self._gpu_values(gpu)["pcie_rx_mb_s"]
        else:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = round(mb_s * 1e6 / 1024)  # KB/s, KB = 1024 bytes
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPcieReplayCounter(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self._gpu_values(gpu)["pcie_replay_count"])
        return SUCCESS

    # -- modes, ECC, NVLink, processes -----------------------------------------------------

    @symbol("device")
    def _nvmlDeviceGetPersistenceMode(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = 1 if self._gpu_values(gpu)["persistence_mode"] else 0
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetEccMode(self, gpu: int, handle: Any, current: Any, pending: Any) -> int:
        current._obj.value = pending._obj.value = 1 if self.model.datacenter else 0
        return SUCCESS

    def _ecc_total(self, gpu: int, error_type: int) -> int | None:
        if error_type == self.nv.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(self._gpu_values(gpu)["ecc_corrected_total"])
        if error_type == self.nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return int(self._gpu_values(gpu)["ecc_uncorrected_total"])
        return None

    @symbol("device")
    def _nvmlDeviceGetTotalEccErrors(
        self, gpu: int, handle: Any, error_type: Any, counter_type: Any, out: Any
    ) -> int:
        # volatile (since driver load) and aggregate (lifetime) read the same here
        value = self._ecc_total(gpu, _value(error_type))
        if value is None or _value(counter_type) not in (0, 1):
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetNvLinkState(self, gpu: int, handle: Any, link: Any, out: Any) -> int:
        index = _value(link)
        if not 0 <= index < self.model.nvlinks:
            return ERROR_INVALID_ARGUMENT
        down = self._gpu_values(gpu)["nvlink_down"]
        out._obj.value = 0 if index in down else 1
        return SUCCESS

    def _running_processes(self, gpu: int, kind: str, count: Any, infos: Any) -> int:
        """The two-call protocol of nvmlDeviceGet{Compute,Graphics}RunningProcesses:
        with too small a buffer (or none), the count and INSUFFICIENT_SIZE."""
        processes = [p for p in self._gpu_values(gpu)["processes"] if _kind(p) == kind]
        capacity = count._obj.value
        count._obj.value = len(processes)
        if len(processes) > capacity or (processes and infos is None):
            return ERROR_INSUFFICIENT_SIZE
        for info, process in zip(infos or (), processes, strict=False):
            info.pid = int(_field(process, "pid"))
            info.usedGpuMemory = round(float(_field(process, "gpu_memory_mib")) * MIB)
            info.gpuInstanceId = info.computeInstanceId = NOT_AVAILABLE_UINT
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetComputeRunningProcesses_v3(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "compute", count, infos)

    @symbol("device")
    def _nvmlDeviceGetComputeRunningProcesses_v2(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "compute", count, infos)

    @symbol("device")
    def _nvmlDeviceGetGraphicsRunningProcesses_v3(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "graphics", count, infos)

    @symbol("device")
    def _nvmlDeviceGetGraphicsRunningProcesses_v2(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "graphics", count, infos)

    # -- field values ---------------------------------------------------------------------

    def _build_field_handlers(self) -> dict[int, tuple[str, Callable[[int], int]]]:
        """field id -> (symbol whose support it shares, reader returning an integer)."""
        nv = self.nv

        def scenario(key: str) -> Callable[[int], int]:
            return lambda gpu: int(self._gpu_values(gpu)[key])

        ecc = "nvmlDeviceGetTotalEccErrors"
        return {
            nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (
                "nvmlDeviceGetPcieReplayCounter",
                scenario("pcie_replay_count"),
            ),
            nv.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (ecc, scenario("ecc_corrected_total")),
            nv.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (ecc, scenario("ecc_uncorrected_total")),
            nv.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (ecc, scenario("ecc_corrected_total")),
            nv.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (ecc, scenario("ecc_uncorrected_total")),
            nv.NVML_FI_DEV_NVLINK_LINK_COUNT: (
                "nvmlDeviceGetNvLinkState",
                lambda gpu: self.model.nvlinks,
            ),
        }

    @symbol("device")
    def _nvmlDeviceGetFieldValues(self, gpu: int, handle: Any, count: Any, values: Any) -> int:
        array = values._obj
        n = _value(count)
        if n < 0 or n > len(array):
            return ERROR_INVALID_ARGUMENT
        stamp = int(self.clock.now() * 1e6)  # microseconds since the epoch
        ull = self.nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        for i in range(n):
            field = array[i]
            field.timestamp, field.latencyUsec = stamp, 0
            code = self._field_failures.get((gpu, field.fieldId))
            if code is None:
                code = self._field_failures.get((None, field.fieldId))
            handler = self._field_handlers.get(field.fieldId)
            if code is None and (handler is None or self._is_unsupported(handler[0])):
                code = ERROR_NOT_SUPPORTED
            if code is not None:
                field.nvmlReturn = code
                continue
            assert handler is not None
            field.valueType = ull
            field.value.ullVal = handler[1](gpu)
            field.nvmlReturn = SUCCESS
        return SUCCESS

    # -- events ---------------------------------------------------------------------------

    def _event_set(self, handle: Any) -> _EventSet | None:
        try:
            return self._event_sets.get(ctypes.addressof(handle.contents))
        except (AttributeError, ValueError, TypeError):
            return None

    @symbol("system")
    def _nvmlEventSetCreate(self, out: Any) -> int:
        struct = self.nv.struct_c_nvmlEventSet_t()
        with self._lock:
            # events raised at or after creation are delivered
            since = self.clock.elapsed() - 1e-9
            self._event_sets[ctypes.addressof(struct)] = _EventSet(struct, since)
        out._obj.contents = struct
        return SUCCESS

    @symbol("system")
    def _nvmlEventSetFree(self, handle: Any) -> int:
        event_set = self._event_set(handle)
        if event_set is None:
            return ERROR_INVALID_ARGUMENT
        with self._lock:
            del self._event_sets[ctypes.addressof(event_set.struct)]
        return SUCCESS

    def _supported_events(self) -> int:
        nv = self.nv
        mask = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypePState
        if self.model.datacenter:
            mask |= nv.nvmlEventTypeSingleBitEccError | nv.nvmlEventTypeDoubleBitEccError
        return int(mask)

    @symbol("device")
    def _nvmlDeviceGetSupportedEventTypes(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._supported_events()
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceRegisterEvents(self, gpu: int, handle: Any, types: Any, set_handle: Any) -> int:
        event_set = self._event_set(set_handle)
        if event_set is None:
            return ERROR_INVALID_ARGUMENT
        mask = _value(types)
        if mask & ~self._supported_events():
            return ERROR_NOT_SUPPORTED
        with self._lock:
            event_set.masks[gpu] = event_set.masks.get(gpu, 0) | mask
        return SUCCESS

    def _pull_timeline_events(self, event_set: _EventSet) -> None:
        now = self.clock.elapsed()
        xid_type = int(self.nv.nvmlEventTypeXidCriticalError)
        for event in self.timeline.xid_events(event_set.since, now):
            if event_set.masks.get(event.gpu, 0) & xid_type:
                event_set.pending.append((event.gpu, xid_type, event.xid))
        event_set.since = max(event_set.since, now)

    @symbol("system")
    def _nvmlEventSetWait_v2(self, handle: Any, out: Any, timeout_ms: Any) -> int:
        event_set = self._event_set(handle)
        if event_set is None:
            return ERROR_INVALID_ARGUMENT
        deadline = time.monotonic() + min(_value(timeout_ms) / 1000, self.hang_cap)
        with self._events_changed:
            while True:
                self._pull_timeline_events(event_set)
                if event_set.pending:
                    gpu, event_type, data = event_set.pending.pop(0)
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return ERROR_TIMEOUT
                self._events_changed.wait(min(remaining, 0.01))
        event = out._obj
        event.device = ctypes.pointer(self._devices[gpu])
        event.eventType, event.eventData = event_type, data
        event.gpuInstanceId = event.computeInstanceId = NOT_AVAILABLE_UINT
        return SUCCESS


def _copy_string(buf: Any, size: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _value(size):
        return ERROR_INSUFFICIENT_SIZE
    buf.value = data
    return SUCCESS


def _field(process: Any, key: str) -> Any:
    return process[key] if isinstance(process, dict) else getattr(process, key)


def _kind(process: Any) -> str:
    """Which NVML list a scenario process is in: "compute" (the default) or "graphics"."""
    if isinstance(process, dict):
        return str(process.get("kind", "compute"))
    return str(getattr(process, "kind", "compute"))


__all__ = [
    "CLOCK_EVENT_REASON_CONSTANTS",
    "FakeNvmlLib",
    "gpu_uuid",
    "load_private_pynvml",
    "make_pynvml",
    "nvml_bus_id",
]
