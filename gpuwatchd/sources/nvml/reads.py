"""What the nvml source reads on each GPU, and what it remembers about one GPU.

`READS`: one NVML call each (utilization, memory, clocks, P-state, clock event reasons,
the process lists; slow facts every `SLOW_EVERY` polls; static facts once), `POWER_READ`
where the driver does not batch power. `FIELDS`: one nvmlDeviceGetFieldValues batch
(power, PCIe byte and replay counters, ECC), plus the NVLink state per link
(`NVLINK_STATE`, scoped by link; `NVLINK_COUNT` read once). `_Gpu`: one GPU's handle,
identity, cadence, kept samples, counters, Xids, NVLinks and the reader's lock.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpuwatchd.metrics import Sample
from gpuwatchd.sources.nvml.metrics import (
    CLOCK_REASON,
    ECC_ERRORS,
    ECC_MODE,
    FABRIC_STATE,
    FABRIC_STATUS,
    MEM_CLOCK,
    MEM_CLOCK_MAX,
    MEMORY_TOTAL,
    MEMORY_USED,
    MEMORY_UTILIZATION,
    NVLINK,
    PCIE_GEN,
    PCIE_GEN_MAX,
    PCIE_REPLAYS,
    PCIE_RX,
    PCIE_TX,
    PCIE_WIDTH,
    PCIE_WIDTH_MAX,
    PERSISTENCE,
    POWER,
    POWER_DEFAULT_LIMIT,
    POWER_LIMIT,
    PROCESS_MEMORY,
    PROCESSES,
    PSTATE,
    REMAP_FAILED,
    REMAP_PENDING,
    SM_CLOCK,
    SM_CLOCK_MAX,
    TEMPERATURE,
    UTILIZATION,
)
from gpuwatchd.sources.nvmlapi import error_codes

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
        # gpu_nvml_stale 0 and gpu_nvml_hung_seconds 0: what a poll that read it adds
        self.read_flags: tuple[Sample, Sample] | None = None
        self.sm_count: Sample | None = None  # static, read with the identity
        self.lost = False
        self.polls = 0  # polls that read this GPU, for the reads' cadence
        self.reads: list[Read] = []  # READS, plus the fallbacks of unsupported fields
        self.disabled: set[str] = set()  # read keys found unsupported on this GPU
        self.choice: dict[str, int] = {}  # read key -> alternative in use (after fallbacks)
        self.kept: dict[str, list[Sample]] = {}  # read key -> its samples, kept between reads
        self.reason_labels: list[tuple[int, tuple[str, ...]]] = []
        # the last poll's clock event reasons mask and its samples: the mask seldom changes
        self.reasons: tuple[int, list[Sample]] | None = None
        self.batch: list[_Entry] = []  # what this GPU's nvmlDeviceGetFieldValues asks for
        self.request: Any = None  # ... as the nvmlFieldValue_t array it is asked with
        self.fast: list[_Entry] = []  # the batch's fields read every poll (the others: SLOW)
        self.fast_request: Any = None
        self.plans: tuple[Any, Any] = (None, None)  # plans.FieldPlan of fast and batch
        self.read_plan: Any = None  # plans.ReadPlan, made again when what it used changes
        # fields dropped NOT_SUPPORTED (no fallback): asked again when the MIG layout
        # changes (nvml.h: no remapped rows on a MIG GPU with instances)
        self.dropped: set[_Entry] = set()
        # byte counter field -> (value, driver's µs timestamp, rate since the one before)
        self.counters: dict[int, tuple[int, int | None, float | None]] = {}
        self.lists: dict[str, dict[int, float]] = {}  # process lists, by kind
        self.events = "pending"  # pending | registered | unsupported
        self.xids: dict[int, int] = {}  # every Xid of the GPU, MIG instances' included
        # a MIG GPU instance's Xids (the event's gpuInstanceId): (GI id, profile, Xid) -> count
        self.instance_xids: dict[tuple[str, str, int], int] = {}
        self.nvlinks = 0  # how many NVLinks the driver reports
        self.nvlink_seen: set[int] = set()  # links seen active since the daemon started
        self.nvlink_remote: int | None = None  # what the first active link reaches, asked once
        self.nvlink_peer: dict[int, int | None] = {}  # link -> the GPU it reaches (None: none)
        # the last poll's NVLink states, what NvLinks knew then, and the samples they gave
        self.nvlink_last: tuple[tuple[Any, ...], list[Sample]] | None = None
        self.last_xid: float | None = None
        # a reader thread holds it while it calls NVML on this GPU: a reader given up on
        # (blocked in a call) keeps it, and the next readers leave the GPU alone
        self.lock = threading.Lock()
        self.busy_since: float | None = None  # when the reader holding it took it
        self.hung = False  # reported hung (logged once)
        self.last: list[Sample] = []  # the samples of its last read, for a poll without it
        self.last_lists: dict[str, dict[int, float]] | None = None
        self.mig: Any = None  # its MIG mode and devices (mig.MigState), once read


def _emit_utilization(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(UTILIZATION.name, gpu.labels, value.gpu / 100))
    out.append(Sample(MEMORY_UTILIZATION.name, gpu.labels, value.memory / 100))


def _emit_memory(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    out.append(Sample(MEMORY_USED.name, gpu.labels, float(value.used)))
    out.append(Sample(MEMORY_TOTAL.name, gpu.labels, float(value.total)))


def _emit_reasons(gpu: _Gpu, mask: int, out: list[Sample]) -> None:
    last = gpu.reasons
    if last is None or last[0] != mask:  # else the same samples as the last poll's
        samples = [
            Sample(CLOCK_REASON.name, labels, 1.0 if mask & bit else 0.0)
            for bit, labels in gpu.reason_labels
        ]
        last = gpu.reasons = (mask, samples)
    out += last[1]


def _emit_compute(gpu: _Gpu, used: dict[int, float], out: list[Sample]) -> None:
    out.append(Sample(PROCESSES.name, gpu.labels, float(len(used))))
    for pid, memory in used.items():
        out.append(Sample(PROCESS_MEMORY.name, gpu.labels + (str(pid),), memory))


def _no_samples(gpu: _Gpu, value: Any, out: list[Sample]) -> None:
    """A read for the processes source only (the graphics processes)."""


# -- the NVLink fabric ----------------------------------------------------------------
# nvmlGpuFabricState_t: NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, _NOT_STARTED, _IN_PROGRESS,
# _COMPLETED
FABRIC_NOT_SUPPORTED, FABRIC_COMPLETED = 0, 3
# the struct each call fills, as pynvml declares it (its V constructor sets `version`)
FABRIC_STRUCTS = {
    "nvmlDeviceGetGpuFabricInfoV": "c_nvmlGpuFabricInfoV_t",
    "nvmlDeviceGetGpuFabricInfo": "c_nvmlGpuFabricInfo_t",
}


class FabricInfo(NamedTuple):
    state: int  # nvmlGpuFabricState_t
    status: int  # nvmlReturn_t the registration ended with
    error: str  # its NVML_ERROR_* name


def bind_fabric(nv: Any, name: str) -> Callable[[Any], FabricInfo] | None:
    """The call `name` of FABRIC_STRUCTS as handle -> FabricInfo; None where the binding
    lacks the function or its struct. A GPU that answers SUCCESS with the state
    NOT_SUPPORTED (seen on GB200 nodes) is treated as one that answers NOT_SUPPORTED."""
    function, struct = getattr(nv, name, None), getattr(nv, FABRIC_STRUCTS[name], None)
    if function is None or struct is None:
        return None
    codes = error_codes(nv)

    def read(handle: Any) -> FabricInfo:
        info = struct()
        function(handle, ctypes.byref(info))
        # nvml.h's state is an unsigned char; pynvml reads it as a c_uint, whose other
        # three bytes are padding the driver need not write
        state = info.state & 0xFF
        if state == FABRIC_NOT_SUPPORTED:
            raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
        status = int(info.status)
        return FabricInfo(state, status, codes.get(status, f"code {status}"))

    return read


def _emit_fabric(gpu: _Gpu, info: FabricInfo, out: list[Sample]) -> None:
    """The state, and the status where a completed registration failed (nvml.h: the
    status is to be read only once the state is completed)."""
    out.append(Sample(FABRIC_STATE.name, gpu.labels, float(info.state)))
    if info.state == FABRIC_COMPLETED and info.status != 0:
        out.append(Sample(FABRIC_STATUS.name, gpu.labels + (info.error,), float(info.status)))


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
    # builds the call from the binding and a function's name (None: the binding lacks
    # it), for a call that fills a struct; else the binding's function, called as is
    bind: Callable[[Any, str], Callable[..., Any] | None] | None = None


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
    # the GPU's NVLink fabric registration (NVSwitch boards, Hopper and later; elsewhere
    # NOT_SUPPORTED, asked once); the versioned call from R550, the first one from R525
    Read(
        "fabric",
        tuple(FABRIC_STRUCTS),
        emit=_emit_fabric,
        every=SLOW,
        bind=bind_fabric,
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
    Read(  # a cap below it was set (nvidia-smi -pl, a facility's power policy)
        "power_default_limit",
        ("nvmlDeviceGetPowerManagementDefaultLimit",),
        metric=POWER_DEFAULT_LIMIT.name,
        scale=1e-3,  # mW
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
    rate: bool = False  # a byte counter: exported as bytes per second between two reads
    fallback: Read | None = None  # reads the value where the driver lacks the field
    every: int = EVERY_POLL  # or SLOW: the rest of the batch asks without it in between


# The PCIe counters are GSP firmware round trips, 150-180 µs of CPU each on an H200 (the
# other fields ~1 µs; docs/hardware/2026-12-04-h200). The byte counters are 32 bits there
# and wrap at 2**32 bytes: read every poll, a rate is exact up to 4.29 GB/s at the default
# 1 s interval (read every 10 s, it aliased above 429 MB/s). The replay counter is read
# every SLOW polls: its rule looks at 5 minutes.
FIELDS: tuple[Field, ...] = (
    Field("NVML_FI_DEV_POWER_INSTANT", POWER.name, 1e-3, fallback=POWER_READ),  # mW
    Field("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", PCIE_TX.name, rate=True),  # R555+
    Field("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", PCIE_RX.name, rate=True),
    Field("NVML_FI_DEV_PCIE_REPLAY_COUNTER", PCIE_REPLAYS.name, every=SLOW),
    Field("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", ECC_ERRORS.name, extra=("corrected",)),
    Field("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", ECC_ERRORS.name, extra=("uncorrected",)),
    Field("NVML_FI_DEV_ECC_CURRENT", ECC_MODE.name),
    # set at an uncorrectable error, cleared by the reset that applies the remap
    Field("NVML_FI_DEV_REMAPPED_PENDING", REMAP_PENDING.name, every=SLOW),
    Field("NVML_FI_DEV_REMAPPED_FAILURE", REMAP_FAILED.name, every=SLOW),
)
# one per link, scoped by the link's index (R525+); the count is read once per GPU
NVLINK_STATE = Field("NVML_FI_DEV_NVLINK_GET_STATE", NVLINK.name)
NVLINK_COUNT = "NVML_FI_DEV_NVLINK_LINK_COUNT"
FIELDS_KEY = "field_values"
SLOW_FIELDS_KEY = "field_values_slow"  # gpu.kept: the SLOW fields' samples


@dataclass(frozen=True)
class _Entry:
    """A field of one GPU's batch, resolved: its id, scope and full labels."""

    field_id: int
    scope: int
    field: Field
    labels: tuple[str, ...]
    what: str  # for the log: the constant, with the scope
