"""The thin adapter around nvidia-ml-py (`pynvml`) the NVML-reading sources share.

Starting NVML (`start_nvml`, with one-line reasons when it cannot be used), reading the
two calls the nvml source makes most through the binding's own function pointers with
buffers kept between polls (`Direct`, `FieldValues`), and the `ProcessTable` in which
the nvml source publishes each poll's process lists for the processes source.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from gpuwatchd.sources.base import Context, SourceError

log = logging.getLogger("gpuwatchd.sources.nvml")

PROCESS_TABLE = "nvml_processes"  # context.extras key of the shared ProcessTable


@dataclass(frozen=True)
class ListedInstance:
    """One MIG device (compute instance) of a MIG-enabled GPU in a ProcessTable, as the
    nvml source read it this poll: its ids, its GPU instance's profile, UUID and the
    compute processes on its own handle (which need no MIG monitor capability)."""

    gpu_instance: int
    compute_instance: int
    profile: str  # the GPU instance's (3g.40gb also for a 1c.3g.40gb compute instance)
    mig_uuid: str  # MIG-…, what CUDA_VISIBLE_DEVICES and the kubelet name
    processes: dict[int, float]  # pid -> GPU memory bytes


@dataclass(slots=True)
class ListedGpu:
    """One GPU in a ProcessTable: its labels, bus id and process lists; not changed once
    published. Not frozen: the nvml source makes one a GPU and poll, and a frozen
    dataclass's __init__ sets each field through object.__setattr__."""

    index: int
    labels: tuple[str, ...]  # (gpu, uuid)
    bus_id: str  # sysfs form
    lists: dict[str, dict[int, float]] | None  # kind -> {pid: GPU memory bytes}; None: lost
    # MIG enabled: its MIG devices (possibly none); None: a whole GPU (MIG off or unknown)
    instances: tuple[ListedInstance, ...] | None = None


class ProcessTable:
    """The GPU process lists of the nvml source's last poll, for the processes source.

    NVML lists each GPU's processes once per poll, for both sources: the nvml source
    publishes what it read here, and the processes source uses it while it is fresh.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._gpus: list[ListedGpu] = []
        self._instances: dict[str, tuple[ListedInstance, ...]] = {}  # GPU uuid -> MIG devices

    def publish(self, read_at: float, gpus: list[ListedGpu]) -> None:
        """The poll's lists; a MIG-enabled GPU's get the MIG devices `instances` set."""
        with self._lock:
            if self._instances:
                gpus = [self._with_instances(gpu) for gpu in gpus]
            self._read_at, self._gpus = read_at, gpus

    def instances(self, uuid: str, devices: tuple[ListedInstance, ...] | None) -> None:
        """The MIG devices of GPU `uuid` read this poll (None: MIG is off), set by the
        nvml source's per-GPU reads before it publishes the poll's lists."""
        with self._lock:
            if devices is None:
                self._instances.pop(uuid, None)
            else:
                self._instances[uuid] = devices

    def _with_instances(self, gpu: ListedGpu) -> ListedGpu:
        found = self._instances.get(gpu.labels[1])
        return gpu if found is None or gpu.lists is None else replace(gpu, instances=found)

    def fresh(self, now: float, max_age: float) -> list[ListedGpu] | None:
        """The last lists if read at most `max_age` before `now` (same clock), else None."""
        with self._lock:
            if self._read_at is None or now - self._read_at > max_age:
                return None
            return self._gpus


def process_table(context: Context) -> ProcessTable:
    """The node's shared ProcessTable (one per Context, so per pipeline)."""
    table: ProcessTable = context.extras.setdefault(PROCESS_TABLE, ProcessTable())
    return table


class FieldValues:
    """Reads an array of pynvml's c_nvmlFieldValue_t: (nvmlReturn, the driver's timestamp
    in µs, the value as a number, and for an unsigned integer the modulus it wraps at,
    else None) per field. The value's width is the driver's choice per field: a real H200
    answers the PCIe byte counters as 32-bit unsigned ints.

    pynvml's structures read every member through a Python-level __getattribute__
    (about a microsecond each, several per field); the layout comes from the binding's
    own ctypes declarations, so it is the one the library wrote. The value types the
    driver answers with are read first (one struct call); the whole array is then
    decoded by one struct call made for those types, kept for the next poll (a request's
    fields keep their types from one poll to the next).
    """

    _MAX_LAYOUTS = 64  # arrays of value types kept; more (a driver that varies): start over

    def __init__(self, nv: Any) -> None:
        record, union = nv.c_nvmlFieldValue_t, nv.c_nvmlValue_t
        self._size = ctypes.sizeof(record)
        # the three members read, in the record's order; the others are skipped
        wanted = sorted(
            ("nvmlReturn", "timestamp", "value"), key=lambda n: getattr(record, n).offset
        )
        layout, at = "", 0
        for name in wanted:
            member = getattr(record, name)
            layout += "x" * (member.offset - at)
            if name == "value":
                self._value_size = member.size
                layout += "{value}"
            else:
                kind = dict(record._fields_)[name]
                layout += _standard(kind) or f"{member.size}s"
            at = member.offset + member.size
        self._layout = layout + "x" * (self._size - at)
        self._at = [wanted.index(n) for n in ("nvmlReturn", "timestamp", "value")]
        self._step = len(wanted)  # items a record unpacks to
        kind_at = record.valueType.offset
        self._type_layout = f"{kind_at}xI{self._size - kind_at - 4}x"
        # NVML_VALUE_TYPE_* is the index of the union's member (dVal, uiVal, ulVal, ...)
        self._codes = [_standard(kind) for _, kind in union._fields_]
        self._moduli = [
            1 << (8 * ctypes.sizeof(kind)) if code and code in "BHIQ" else None
            for code, (_, kind) in zip(self._codes, union._fields_, strict=True)
        ]
        self._kinds: dict[int, struct.Struct] = {}  # array length -> its value types' reader
        self._decoders: dict[tuple[int, ...], tuple[struct.Struct, tuple[Any, ...], bool]] = {}

    def read(self, array: Any) -> list[tuple[int, int, float | None, int | None]]:
        return list(zip(*self.columns(array), strict=True))

    def columns(self, array: Any) -> tuple[Sequence[int], Sequence[int], Sequence[Any], Any]:
        """What `read` gives, as its four columns (codes, timestamps, numbers, moduli)."""
        data = memoryview(array).cast("B")
        count = len(data) // self._size
        kinds = self._kinds.get(count)
        if kinds is None:
            kinds = self._kinds[count] = struct.Struct("<" + self._type_layout * count)
        types = kinds.unpack_from(data)
        decoder = self._decoders.get(types)
        if decoder is None:
            if len(self._decoders) >= self._MAX_LAYOUTS:
                self._decoders.clear()
            decoder = self._decoders[types] = self._decoder(types)
        whole, moduli, known = decoder
        flat = whole.unpack_from(data)
        code, stamp, raw = self._at
        step = self._step
        numbers: Any = flat[raw::step]
        if not known:  # a value type this binding does not know: no number
            numbers = [
                n if m is not _UNKNOWN else None for n, m in zip(numbers, moduli, strict=True)
            ]
            moduli = tuple(None if m is _UNKNOWN else m for m in moduli)
        return flat[code::step], flat[stamp::step], numbers, moduli

    def _decoder(self, types: tuple[int, ...]) -> tuple[struct.Struct, tuple[Any, ...], bool]:
        """The struct reading a whole array whose values have these types, each value's
        modulus (_UNKNOWN: a type without a number), and whether all types are known."""
        layout, moduli = "<", []
        for kind in types:
            code = self._codes[kind] if kind < len(self._codes) else None
            if code is None:
                value, modulus = f"{self._value_size}s", _UNKNOWN
            else:
                value = code + "x" * (self._value_size - struct.calcsize("<" + code))
                modulus = self._moduli[kind]
            layout += self._layout.format(value=value)
            moduli.append(modulus)
        return struct.Struct(layout), tuple(moduli), _UNKNOWN not in moduli


_UNKNOWN = object()  # FieldValues: a value type without a number


def _standard(kind: Any) -> str | None:
    """The struct code (standard size, "<") of a ctypes number type, or None."""
    code, size = getattr(kind, "_type_", None), ctypes.sizeof(kind)
    if not isinstance(code, str) or code not in "bBhHiIlLqQfd":
        return None
    if code in "fd":
        return {4: "f", 8: "d"}.get(size)
    by_size = {1: "b", 2: "h", 4: "i", 8: "q"}.get(size)
    return None if by_size is None else by_size if code.islower() else by_size.upper()


class Direct:
    """The field values and the process lists through the binding's own function
    pointers (`_nvmlGetFunctionPointer`, as its wrappers do), with buffers kept between
    polls: pynvml's wrappers allocate, fill member by member and convert to Python
    objects on every call, and ask each process list for its length first (two calls).
    Here a poll is one call each while the buffer is big enough. Without that function
    (a pynvml that no longer has it), the wrappers are used."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.values = FieldValues(nv)
        self._pointer = getattr(nv, "_nvmlGetFunctionPointer", None)
        self._info = nv.c_nvmlProcessInfo_t
        pid, memory = self._info.pid.offset, self._info.usedGpuMemory.offset
        self._pid, self._memory = struct.Struct("<I"), struct.Struct("<Q")
        self._at = (pid, memory, ctypes.sizeof(self._info))
        # per thread: a reader given up on (blocked in a call) may still write into its own
        self._buffers = threading.local()
        self._unknown = int(nv.NVML_VALUE_NOT_AVAILABLE_ulonglong.value)

    def request(self, ids: list[tuple[int, int]]) -> Any:
        """A reusable nvmlFieldValue_t array asking for these (field id, scope id)."""
        array = (self.nv.c_nvmlFieldValue_t * len(ids))()
        for value, (field_id, scope) in zip(array, ids, strict=True):
            value.fieldId, value.scopeId = field_id, scope
        return array

    def field_values(
        self, handle: Any, request: Any
    ) -> list[tuple[int, int, float | None, int | None]]:
        return list(zip(*self.field_columns(handle, request), strict=True))

    def field_columns(
        self, handle: Any, request: Any
    ) -> tuple[Sequence[int], Sequence[int], Sequence[Any], Any]:
        """`field_values` as `FieldValues.columns`: one column per item, not a tuple per field."""
        nv = self.nv
        if self._pointer is None:
            ids = [(v.fieldId, v.scopeId) for v in request]
            return self.values.columns(nv.nvmlDeviceGetFieldValues(handle, ids))
        call = self._pointer("nvmlDeviceGetFieldValues")
        code = call(handle, ctypes.c_int32(len(request)), ctypes.byref(request))
        if code != nv.NVML_SUCCESS:
            raise nv.NVMLError(code)
        return self.values.columns(request)

    def lister(self, name: str) -> Callable[[Any], dict[int, float]]:
        """nvmlDevice{Compute,Graphics}RunningProcesses[_vN] as {pid: GPU memory bytes}."""
        nv = self.nv

        def wrapped(handle: Any) -> dict[int, float]:
            used: dict[int, float] = {}
            for process in getattr(nv, name)(handle):
                memory = process.usedGpuMemory  # None where the driver cannot tell (WDDM)
                used[process.pid] = used.get(process.pid, 0.0) + (memory or 0)
            return used

        def direct(handle: Any) -> dict[int, float]:
            assert self._pointer is not None
            call = self._pointer(name)
            buffers = self._buffers
            buffer = getattr(buffers, "buffer", None)
            if buffer is None:
                buffer = buffers.buffer = (self._info * 16)()
            count = ctypes.c_uint(len(buffer))
            code = call(handle, ctypes.byref(count), buffer)
            while code == nv.NVML_ERROR_INSUFFICIENT_SIZE:  # more processes than room
                buffer = buffers.buffer = (self._info * (count.value * 2 + 5))()
                count = ctypes.c_uint(len(buffer))
                code = call(handle, ctypes.byref(count), buffer)
            if code != nv.NVML_SUCCESS:
                raise nv.NVMLError(code)
            memory = memoryview(buffer).cast("B")
            pid_at, memory_at, size = self._at
            used: dict[int, float] = {}
            for base in range(0, count.value * size, size):
                (pid,) = self._pid.unpack_from(memory, base + pid_at)
                (value,) = self._memory.unpack_from(memory, base + memory_at)
                used[pid] = used.get(pid, 0.0) + (0 if value == self._unknown else value)
            return used

        return wrapped if self._pointer is None else direct


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


def text(value: Any) -> str:
    """An NVML string answer as str (pynvml gives bytes or str, by version)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:34:00.0" -> "0000:34:00.0", as in sysfs (and the pcie source)."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    if not rest:
        return nvml_bus_id
    return f"{int(domain or '0', 16):04x}:{rest}"


@dataclass(frozen=True)
class Identity:
    handle: Any
    uuid: str
    bus_id: str  # as in sysfs; "" where NVML would not say


def identify(nv: ModuleType, index: int) -> Identity:
    """GPU `index`'s handle, UUID and PCI address; NVMLError if NVML has no handle or UUID
    for it yet (a GPU still initialising, or lost)."""
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    uuid = nv.nvmlDeviceGetUUID(handle)
    pci_info = getattr(nv, "nvmlDeviceGetPciInfo_v3", None) or nv.nvmlDeviceGetPciInfo
    pci = quietly(nv, pci_info, handle)
    return Identity(handle, uuid, sysfs_bus_id(pci.busId) if pci is not None else "")


def quietly(nv: ModuleType, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, or None if NVML answers with an error."""
    try:
        return function(*args)
    except nv.NVMLError as e:
        log.debug("nvml: %s failed: %s", getattr(function, "__name__", function), e)
        return None


# FP32 cores per SM by CUDA compute capability (CUDA C++ Programming Guide, "Arithmetic
# Instructions"): what turns nvmlDeviceGetNumGpuCores into a count of SMs
CORES_PER_SM = {(7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64}
CORES_PER_SM_LATER = 128  # 8.6, 8.7, 8.9, 9.0, 10.x, 12.x


def cores_per_sm(capability: tuple[int, int]) -> int:
    return CORES_PER_SM.get(capability, CORES_PER_SM_LATER)


def sm_count(nv: ModuleType, handle: Any) -> int | None:
    """The GPU's streaming multiprocessors, or None where the driver cannot say (before
    R520, or a MIG device). Two calls, once per GPU (~170 µs on an H200)."""
    cores_of = getattr(nv, "nvmlDeviceGetNumGpuCores", None)
    if cores_of is None:
        return None
    cores = quietly(nv, cores_of, handle)
    capability = quietly(nv, nv.nvmlDeviceGetCudaComputeCapability, handle)
    if not cores or capability is None:
        return None
    return int(cores) // cores_per_sm(tuple(capability))
