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
makes every call on it answer NVML_ERROR_GPU_IS_LOST, `hung` makes it block until the
GPU is no longer hung or `release()` is called (in virtual time, `settle()` after each
step of the clock lets it see the time; `wait_for` waits for a thread that may block
on it), and the model's `unsupported`
symbols answer NVML_ERROR_NOT_SUPPORTED. A GPU's `mig` value plays MIG
(`fake_nvml_mig.MigReads`: the mode, MIG device handles, what a MIG-enabled GPU no
longer answers). Tests reach the fake as
`module._gpuwatchd_fake` to inject errors (`fail`, `fail_field`), hang a GPU (`hang`),
raise Xid events (`inject_xid`) and count calls (`calls`, `gpu_calls`, `calls_total`,
`field_calls`).

What a call costs is a setting, `NvmlCosts`: `DRIVER_COSTS` spends what a real driver
spends, as measured on an H200 (CPU in every call, as its ioctl does, per function and
per field; `nvmlDeviceGetPcieThroughput` blocking for its 21 ms sample), so benchmarks
and `run --simulate` see what a node would;
`FREE` (the default, and virtual-time `simulate`) spends nothing. The fake's own Python
work counts towards a call's cost; where it takes longer, the excess is counted in
`overshoot` (CPU seconds), what the simulator costs beyond a real driver; `python` counts
all of the fake's own work, within a call's cost or beyond it. `stats_path` (or the
environment variable GPUWATCHD_SIM_NVML_STATS) names a file the fake rewrites about once a
second with "<monotonic seconds> <calls so far> <overshoot so far> <python so far>", so a
benchmark can count the calls per second of a process it runs, leave the overshoot out of
its CPU (its CPU on a real driver's terms) and say what the fake's Python was.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import itertools
import os
import re
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml_device import (
    _RECORD,
    ERROR_DRIVER_NOT_LOADED,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_SUPPORTED,
    ERROR_TIMEOUT,
    ERROR_UNINITIALIZED,
    NOT_AVAILABLE_UINT,
    SUCCESS,
    DeviceReads,
    _copy_string,
    _FieldPlan,
    _requested,
    _value,
    fill_pci_info,
    nvml_bus_id,
)
from gpuwatchd.sim.fake_nvml_fabric import FabricReads
from gpuwatchd.sim.fake_nvml_mig import MigReads
from gpuwatchd.sim.fakelib import Symbol, install_symbols, symbol
from gpuwatchd.sim.scenario import Timeline
from gpuwatchd.sources.nvml.reader import _Done
from gpuwatchd.sources.nvmlapi import cores_per_sm

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

HANG_CAP_SECONDS = 60.0  # a hung call never blocks longer than this (real time)
REAL_TIME_RESOLUTION = 0.05  # real-time clocks: state is recomputed at most this often

_VERSION_SUFFIX = re.compile(r"_v\d+$")
# Field values a driver branch added: an older driver answers NOT_SUPPORTED for them
# (nvml.h of R555 first defines the PCIe byte counters; R535/R550 nodes lack them)
FIELDS_SINCE = {"NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 555, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 555}
# Functions a driver branch added: an older driver's library lacks the symbol (pynvml:
# FunctionNotFound). nvml.h of NVML 12.0 (R525) first declares the fabric call, 12.4
# (R550) its versioned form
FUNCTIONS_SINCE = {"nvmlDeviceGetGpuFabricInfo": 525, "nvmlDeviceGetGpuFabricInfoV": 550}


def _branch(driver_version: str) -> int:
    """The driver branch of a version string ("535.161.08" -> 535)."""
    major = driver_version.split(".", 1)[0]
    return int(major) if major.isdigit() else 0


_module_ids = itertools.count()
STATS_ENV = "GPUWATCHD_SIM_NVML_STATS"


@dataclass(frozen=True)
class NvmlCosts:
    """What the fake spends per call, as a real driver would.

    `per_call`: CPU seconds a call spends (busy, in the calling thread: a real call is an
    ioctl, busy in the kernel; unlike it, the fake holds the GIL meanwhile), or what
    `calls` says for that function. `per_field`: more CPU per field of
    nvmlDeviceGetFieldValues, or what `fields` says for that NVML_FI_* field.
    `pcie_sample`: real seconds nvmlDeviceGetPcieThroughput blocks, sampling a byte
    counter over a window (asleep: its CPU is in `calls`).
    """

    per_call: float = 0.0
    per_field: float = 0.0
    pcie_sample: float = 0.0
    calls: Mapping[str, float] = field(default_factory=dict)
    fields: Mapping[str, float] = field(default_factory=dict)


FREE = NvmlCosts()
# The CPU a real driver spends, measured on an H200 (driver 580.159.04, a Firecracker VM
# with the GPU passed through; docs/hardware/2026-12-04-h200, nvml.json): CPU equals the
# wall time for every call but the PCIe sampler. Most calls cost 1-3 µs; the ones that
# are GSP firmware round trips cost 100 µs to 1.5 ms, among them three fields of the
# batch the nvml source reads.
DRIVER_COSTS = NvmlCosts(
    per_call=2.5e-6,
    per_field=1e-6,
    pcie_sample=0.021,
    calls={
        "nvmlDeviceGetMemoryInfo": 8.7e-6,
        "nvmlDeviceGetMemoryInfo_v2": 8.7e-6,
        "nvmlDeviceGetComputeRunningProcesses_v3": 10.7e-6,
        "nvmlDeviceGetComputeRunningProcesses_v2": 10.8e-6,
        "nvmlDeviceGetComputeRunningProcesses": 7.9e-6,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": 10.5e-6,
        "nvmlDeviceGetGraphicsRunningProcesses_v2": 10.5e-6,
        "nvmlDeviceGetPersistenceMode": 7.3e-6,
        "nvmlDeviceGetCurrPcieLinkWidth": 35.9e-6,
        "nvmlDeviceGetUUID": 12.3e-6,
        "nvmlDeviceGetNvLinkState": 72.6e-6,
        "nvmlDeviceGetMaxClockInfo": 1.4e-3,
        "nvmlDeviceRegisterEvents": 0.85e-3,
        "nvmlEventSetCreate": 17.4e-6,
        "nvmlDeviceGetMigMode": 165e-6,
        "nvmlDeviceGetMaxMigDeviceCount": 161e-6,
        "nvmlDeviceGetMigDeviceHandleByIndex": 33e-6,
        "nvmlDeviceGetAttributes_v2": 24e-6,
        "nvmlDeviceGetNumGpuCores": 166e-6,
        "nvmlDeviceGetGpuInstanceProfileInfo": 806e-6,
        "nvmlDeviceGetGpuInstanceProfileInfoV": 806e-6,  # pynvml's default (v2)
        "nvmlDeviceGetPcieThroughput": 0.92e-3,
    },
    fields={  # each alone costs this plus a call (~2.5 µs)
        "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 150e-6,
        "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 171e-6,
        "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 177e-6,
    },
)


_DRIVER_WORK = bytes(4096)  # hashed ~3 µs at a time: hashlib lets go of the GIL (> 2 KiB)


def _spend(seconds: float, since: float) -> None:
    """Busy-wait until this thread has spent `seconds` of CPU since `since` (its
    thread_time then): the fake's own work counts towards what the call costs. As a
    real call through ctypes does, it runs without the GIL (but for its last few µs):
    the other threads of the process are not held up behind the driver's work."""
    end = since + seconds
    while end - time.thread_time() > 5e-6:
        hashlib.sha1(_DRIVER_WORK)
    while time.thread_time() < end:
        pass


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
    library: bool = True,
    driver_loaded: bool = True,
    missing_functions: Iterable[str] = (),
    hang_cap: float = HANG_CAP_SECONDS,
    costs: NvmlCosts = FREE,
    stats_path: str | None = None,
) -> ModuleType:
    """A private pynvml whose C library is a FakeNvmlLib playing `timeline` at `clock`.

    The fake is reachable as `module._gpuwatchd_fake`. `library=False` plays a node
    without libnvidia-ml.so.1 (no driver installed, a container started without the
    NVIDIA runtime): pynvml's own loader fails to open it and answers
    NVML_ERROR_LIBRARY_NOT_FOUND. `driver_loaded=False` makes nvmlInit fail with
    NVML_ERROR_DRIVER_NOT_LOADED; `missing_functions` are symbols the fake library lacks
    (an older driver), so pynvml raises FunctionNotFound.
    """
    module = load_private_pynvml()
    fake = FakeNvmlLib(
        module,
        timeline,
        clock,
        driver_loaded=driver_loaded,
        missing_functions=missing_functions,
        hang_cap=hang_cap,
        costs=costs,
        stats_path=stats_path,
    )
    # nvmlLib: what _LoadNvmlLibrary's CDLL("libnvidia-ml.so.1") would have set
    vars(module).update(nvmlLib=fake, _gpuwatchd_fake=fake)
    if not library:  # left for pynvml to load, with a CDLL that finds no such file
        vars(module).update(nvmlLib=None, CDLL=_no_library)
    return module


def _no_library(name: str, *args: Any, **kwargs: Any) -> Any:
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


def gpu_uuid(hostname: str, index: int) -> str:
    """Deterministic `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` for a node's GPU."""
    digest = hashlib.sha256(f"{hostname}/gpu{index}".encode()).digest()
    return f"GPU-{uuid.UUID(bytes=digest[:16])}"


@dataclass
class _Failure:
    symbol: str
    code: int
    gpu: int | None
    remaining: int | None  # None: every call


class _EventSet:
    def __init__(self, struct: Any, created_at: float) -> None:
        self.struct = struct
        self.since = created_at  # timeline events after this are still to be delivered
        self.masks: dict[int, int] = {}  # gpu -> registered event types
        # (gpu, event type, data, GPU instance id, compute instance id)
        self.pending: list[tuple[int, int, int, int, int]] = []


class FakeNvmlLib(DeviceReads, MigReads, FabricReads):
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
        costs: NvmlCosts = FREE,
        stats_path: str | None = None,
    ) -> None:
        self.nv = pynvml
        self.timeline = timeline
        self.clock = clock
        self.node = timeline.scenario.node
        self.model = self.node.model()
        self.driver_loaded = driver_loaded
        self.driver_branch = _branch(self.node.driver_version)
        self.missing = set(missing_functions) | {
            name for name, since in FUNCTIONS_SINCE.items() if self.driver_branch < since
        }
        self.hang_cap = hang_cap
        self.costs = costs
        self._request_costs: dict[tuple, float] = {}  # a field-values request -> its cost
        self._field_costs = {  # field id -> its cost, where DRIVER_COSTS names the field
            getattr(pynvml, name): c for name, c in costs.fields.items() if hasattr(pynvml, name)
        }
        self.calls_total = 0
        self.overshoot = 0.0  # CPU seconds the fake's own work spent beyond `costs`
        self.python = 0.0  # CPU seconds of the fake's own work (within `costs` or not)
        self._stats_path = stats_path or os.environ.get(STATS_ENV) or None
        self._stats_due = 0.0
        self.calls: Counter[str] = Counter()  # symbol -> calls
        self.gpu_calls: Counter[tuple[str, int]] = Counter()  # (symbol, gpu) -> calls
        self.field_calls: Counter[tuple[int, int]] = Counter()  # (field id, gpu) -> asked
        self.blocked = threading.Event()  # set when a call starts blocking on a hung GPU
        self.hang_timeouts = 0  # hung calls that gave up at hang_cap
        self._hang_changed = threading.Condition()
        self._blocked_threads: dict[threading.Thread, int] = {}  # -> epoch it last checked
        self._left_block: set[threading.Thread] = set()  # returned from a hang since
        self._epoch = 0  # settle() count: blocked calls look at the clock again
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
        self._handles: dict[int, tuple[Any, int]] = {}  # id of a handle object -> it, gpu
        self._values: list[dict[str, Any]] = []  # every GPU's scenario values ...
        self._values_at: float | None = None  # ... at this time
        self._uuids = [gpu_uuid(self.node.hostname, i) for i in range(count)]
        self._unsupported = set(self.model.unsupported)
        self._unsupported_names: dict[str, bool] = {}  # symbol or field name -> unsupported
        self._reason_bits = {
            name: int(getattr(pynvml, constant))
            for name, constant in CLOCK_EVENT_REASON_CONSTANTS.items()
        }
        # (gpu, "tx" | "rx") -> (bytes so far, the clock's time they were counted to)
        self._pcie: dict[tuple[int, str], tuple[float, float]] = {}
        # "tx" | "rx" -> ((from, to), every GPU's MB over that span): the last integral
        self._pcie_integrals: dict[str, tuple[tuple[float, float], list[float]]] = {}
        self._field_t = 0.0  # the time of the field values being read
        self._field_handlers = self._build_field_handlers()
        record = pynvml.c_nvmlFieldValue_t
        layout = [getattr(record, name).offset for name, _ in record._fields_]
        assert ctypes.sizeof(record) == _RECORD.size and layout == [0, 4, 8, 16, 24, 28, 32]
        self._field_plans: dict[tuple[int, tuple[tuple[int, int], ...]], _FieldPlan] = {}
        self._mig_init()
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
        cost = self.costs.calls.get(name, self.costs.per_call) if kind != "noinit" else 0.0
        if not cost:
            self.calls[name] += 1
            self.calls_total += 1
            if self._stats_path is not None:
                self._write_stats()
            return self._call(name, impl, kind, args)
        since = time.thread_time()  # from here the fake's own work, bookkeeping included
        self.calls[name] += 1
        self.calls_total += 1
        if self._stats_path is not None:
            self._write_stats()
        if name == "nvmlDeviceGetFieldValues":
            cost += self._fields_cost(args[1], args[2])
        try:
            return self._call(name, impl, kind, args)
        finally:
            own = time.thread_time() - since
            self.python += own
            if own > cost:  # the fake's own work took longer than the driver it plays
                self.overshoot += own - cost
            else:
                _spend(cost, since)

    def _fields_cost(self, count: Any, values: Any) -> float:
        """What the fields of one nvmlDeviceGetFieldValues request cost (kept per request)."""
        asked = _requested(count, values) or ()  # a bad count: the call only
        cost = self._request_costs.get(asked)
        if cost is None:
            by_id = self._field_costs
            cost = self._request_costs[asked] = sum(
                by_id.get(fid, self.costs.per_field) for fid, _ in asked
            )
        return cost

    def _call(self, name: str, impl: Callable[..., int], kind: str, args: tuple) -> int:
        if kind != "noinit" and self._refcount == 0:
            return ERROR_UNINITIALIZED
        if kind == "device" or kind == "index":
            gpu = self._gpu_of(args[0]) if kind == "device" else _value(args[0])
            mig = self._mig_of(args[0]) if gpu is None and kind == "device" else None
            if mig is not None:  # a MIG device handle: its parent's faults, then its own
                gpu = mig[0]
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
            if (values["hung"] or self._forced_hung) and self._is_hung(gpu, values):
                values = self._block(gpu)
                if values["lost"]:
                    return ERROR_GPU_IS_LOST
            if mig is not None:
                return self._mig_handle_call(name, gpu, mig[1], args)
            unsupported = self._unsupported_names.get(name)
            if unsupported is None:
                unsupported = self._is_unsupported(name)
            if unsupported:
                return ERROR_NOT_SUPPORTED
            if values["mig"] is not None and values["mig"].enabled:
                code = self._mig_parent_code(name, gpu)
                if code is not None:
                    return code
            return impl(gpu, *args)
        if self._failures:
            code = self._injected(name, None)
            if code is not None:
                return code
        return impl(*args)

    def _write_stats(self) -> None:
        now = time.monotonic()
        if now < self._stats_due or self._stats_path is None:
            return
        self._stats_due = now + 1.0
        tmp = f"{self._stats_path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{now:.6f} {self.calls_total} {self.overshoot:.6f} {self.python:.6f}\n")
        os.replace(tmp, self._stats_path)

    def _gpu_of(self, handle: Any) -> int | None:
        known = self._handles.get(id(handle))
        if known is not None and known[0] is handle:  # the same pointer object as before
            return known[1]
        try:
            gpu = self._device_index.get(ctypes.addressof(handle.contents))
        except (AttributeError, ValueError, TypeError):  # NULL or not a device handle
            return None
        if gpu is not None:  # kept alive here, so its id stays its own
            self._handles[id(handle)] = (handle, gpu)
        return gpu

    def _is_unsupported(self, name: str) -> bool:
        unsupported = self._unsupported_names.get(name)
        if unsupported is None:
            base = _VERSION_SUFFIX.sub("", name)
            unsupported = (
                name in self._unsupported
                or base in self._unsupported
                or self.driver_branch < FIELDS_SINCE.get(name, 0)
            )
            self._unsupported_names[name] = unsupported
        return unsupported

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
        self._field_plans.clear()

    def clear_failures(self) -> None:
        self._failures.clear()
        self._field_failures.clear()
        self._field_plans.clear()

    def hang(self, gpu: int) -> None:
        """Make every call on `gpu` block until `release()` (or hang_cap)."""
        self._forced_hung.add(gpu)
        self._released.clear()

    def release(self) -> None:
        """Unblock every hung call now and stop hung GPUs from blocking (until `hang`)."""
        self._forced_hung.clear()
        self._released.set()
        with self._hang_changed:
            self._hang_changed.notify_all()

    def inject_xid(
        self, gpu: int, xid: int, gpu_instance: int | None = None, compute_instance: int = 0
    ) -> None:
        """Raise an Xid on `gpu` now, as the kernel driver would, for registered sets; on
        a MIG GPU instance (its GI and CI ids in the event) if `gpu_instance` is given
        (delivered only with the MIG monitor capability: `_mig_delivered`)."""
        xid_type = int(self.nv.nvmlEventTypeXidCriticalError)
        ids = (
            (NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT)
            if gpu_instance is None
            else (gpu_instance, compute_instance)
        )
        if not self._mig_delivered(ids[0]):
            return
        with self._events_changed:
            for event_set in self._event_sets.values():
                if event_set.masks.get(gpu, 0) & xid_type:
                    event_set.pending.append((gpu, xid_type, xid, *ids))
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
        t = self._now()
        if t != self._values_at:
            self._values, self._values_at = self.timeline.state(t)[0], t
        return self._values[gpu]

    def _is_hung(self, gpu: int, values: dict[str, Any]) -> bool:
        if self._released.is_set():
            return False
        return gpu in self._forced_hung or bool(values["hung"])

    def _block(self, gpu: int) -> dict[str, Any]:
        """Block the calling thread while `gpu` is hung, as a driver call into a wedged
        GPU does; return its values when it answers.

        Real time: the hang is re-checked every 10 ms. Virtual time: only when
        `settle()` says the clock moved, so that where a blocked call returns is the
        same on every replay. Either way for at most `hang_cap` (real seconds).
        """
        me = threading.current_thread()
        virtual = self.clock.virtual
        deadline = time.monotonic() + self.hang_cap
        with self._hang_changed:
            self.blocked.set()
            try:
                while True:
                    values = self._gpu_values(gpu)
                    if not self._is_hung(gpu, values):
                        return values
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.hang_timeouts += 1
                        return values
                    self._blocked_threads[me] = self._epoch  # checked at this epoch
                    self._hang_changed.notify_all()
                    self._hang_changed.wait(remaining if virtual else min(0.01, remaining))
            finally:
                self._blocked_threads.pop(me, None)
                self._left_block.add(me)
                self._hang_changed.notify_all()

    def settle(self) -> None:
        """Virtual time, after the clock moved: let every call blocked on a hung GPU look
        at the clock again, and wait until each is blocked again or its thread has ended
        (a call that returned finishes its poll's work on that GPU, then its thread
        ends): what runs next sees the same state on every replay."""
        me = threading.current_thread()  # a call it made itself has returned already
        deadline = time.monotonic() + self.hang_cap  # a thread that goes on for good
        with self._hang_changed:
            if not self._blocked_threads and not self._left_block:
                return
            self._epoch += 1
            self._hang_changed.notify_all()
            while time.monotonic() < deadline:
                self._left_block = {t for t in self._left_block if t.is_alive() and t is not me}
                epoch = self._epoch
                if not self._left_block and all(
                    at == epoch for at in self._blocked_threads.values()
                ):
                    return
                self._hang_changed.wait(0.001)
            self._left_block.clear()

    def wait_for(self, done: _Done, thread: threading.Thread, timeout: float) -> bool:
        """Virtual time's wait for `thread` to set `done`: True once it has, False as soon
        as the thread blocks in a call on a hung GPU (where real time would wait out
        `timeout`). The nvml source waits for its GPU reader through this
        (`context.extras["nvml_wait"]`)."""
        # done.wait wakes the moment the poll's work is done (the common case); the short
        # timeout only bounds how late a thread that blocked on a hung GPU is noticed
        while not done.wait(0.005):
            with self._hang_changed:
                if thread in self._blocked_threads:
                    return False
            if not thread.is_alive():
                return done.is_set()
        return True

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
    def _nvmlDeviceGetNumGpuCores(self, gpu: int, handle: Any, out: Any) -> int:
        if not self.model.sm_count:
            return ERROR_NOT_SUPPORTED
        out._obj.value = self.model.sm_count * cores_per_sm(self.model.compute_capability)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetCudaComputeCapability(
        self, gpu: int, handle: Any, major: Any, minor: Any
    ) -> int:
        major._obj.value, minor._obj.value = self.model.compute_capability
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPciInfo_v3(self, gpu: int, handle: Any, out: Any) -> int:
        fill_pci_info(out._obj, self.timeline.topology.gpu(gpu).bdf, self.model.pci_device_id)
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

    def _supported_events(self, gpu: int) -> int:
        nv = self.nv
        mask = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypePState
        if self.model.datacenter:
            mask |= nv.nvmlEventTypeSingleBitEccError | nv.nvmlEventTypeDoubleBitEccError
        return int(mask) | self._mig_event_types(gpu)

    @symbol("device")
    def _nvmlDeviceGetSupportedEventTypes(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._supported_events(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceRegisterEvents(self, gpu: int, handle: Any, types: Any, set_handle: Any) -> int:
        event_set = self._event_set(set_handle)
        if event_set is None:
            return ERROR_INVALID_ARGUMENT
        mask = _value(types)
        if mask & ~self._supported_events(gpu):
            return ERROR_NOT_SUPPORTED
        with self._lock:
            self._pull_timeline_events(event_set)  # those before the call: not recorded
            event_set.masks[gpu] = event_set.masks.get(gpu, 0) | mask
        return SUCCESS

    def _pull_timeline_events(self, event_set: _EventSet) -> None:
        now = self.clock.elapsed()
        xid_type = int(self.nv.nvmlEventTypeXidCriticalError)
        for event in self.timeline.xid_events(event_set.since, now):
            if event_set.masks.get(event.gpu, 0) & xid_type:
                values = self.timeline.state(event.time)[0][event.gpu]
                ids = xid_instance(values.get("mig"), event.xid)
                if self._mig_delivered(ids[0]):
                    event_set.pending.append((event.gpu, xid_type, event.xid, *ids))
        event_set.pending += self._mig_config_events(event_set.masks, event_set.since, now)
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
                    gpu, event_type, data, gi, ci = event_set.pending.pop(0)
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return ERROR_TIMEOUT
                self._events_changed.wait(min(remaining, 0.01))
        event = out._obj
        event.device = ctypes.pointer(self._devices[gpu])
        event.eventType, event.eventData = event_type, data
        # as the driver: the MIG instance the error hit, 0xFFFFFFFF for the whole GPU
        event.gpuInstanceId, event.computeInstanceId = gi, ci
        return SUCCESS


def xid_instance(layout: Any, xid: int) -> tuple[int, int]:
    """(GPU instance id, compute instance id) an Xid event carries: the MIG device whose
    scenario `xid` lists it, on a MIG-enabled GPU; else NOT_AVAILABLE_UINT for both."""
    if layout is not None and layout.enabled:
        for device in layout.devices:
            if xid in device.xids:
                return device.gpu_instance, device.compute_instance
    return NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT


__all__ = [
    "CLOCK_EVENT_REASON_CONSTANTS",
    "DRIVER_COSTS",
    "FREE",
    "FUNCTIONS_SINCE",
    "FakeNvmlLib",
    "NvmlCosts",
    "gpu_uuid",
    "load_private_pynvml",
    "make_pynvml",
    "nvml_bus_id",
    "xid_instance",
]
