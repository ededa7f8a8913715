"""DCGM: what the GPU's engines actually do (profiling fields) and DCGM's device fields.

NVML's utilization only says that some kernel ran. DCGM's profiling fields (1001-1012)
say how busy the SMs, the tensor/FP pipes, DRAM and the PCIe/NVLink links were, which
is what the starvation rules about kernels, memory bandwidth and NCCL need.

Bindings. DCGM's Python bindings (`pydcgm`, `dcgm_structs`, `dcgm_agent`, ...) are
not on PyPI; they ship with DCGM (`/usr/share/datacenter-gpu-manager-4/bindings/python3`
for DCGM 4, `/usr/local/dcgm/bindings/python3` for DCGM 3, or `bindings_path`). They
import each other by bare name, so `load_bindings` puts the directory on `sys.path`
only while importing them, then takes it and the modules out of `sys.path` and
`sys.modules` again (restoring any same-named modules it displaced): the source holds
a private copy and the rest of the process never sees them. The simulator installs
its fake bindings (gpuwatchd/sim/fake_dcgm) the same way, under the simulated node's
root (context extras `rootfs`), and names its host engine (extras `dcgm_hostengine`).

Connection. `hostengine` is "localhost" (or "host[:port]"), "unix:///path/to/socket"
or "embedded" (an in-process host engine). One pydcgm.DcgmHandle; groups and field
groups are named `gpuwatchd_<pid>...` so that a dcgm-exporter (or a second gpuwatchd)
can share the host engine. Device fields are watched on one GPU group; profiling fields
get field groups of their own (DCGM drops the whole watch when the profiling module
refuses), watched only on GPUs whose supported profiling metric groups contain them.

States (`gpuwatchd_dcgm_state{state}`, logged once per change):
- `not_installed`: no bindings directory, or bindings but no libdcgm;
- `hostengine_down`: cannot connect;
- `connection_lost`: a connected session broke (host engine stopped or restarted);
- `error`: anything else DCGM refused while setting up;
- `connected`: reading. Per GPU, `gpuwatchd_gpu_dcgm_profiling_state{state}` is
  `active`, `paused`, `unsupported` (the GPU cannot profile) or `refused` (the watch
  failed, e.g. another profiler holds the counters; retried every `profiling_retry`).
In every state but `connected` the poll raises `DcgmUnavailable` (a SourceError that
carries the state samples), so `gpuwatchd_source_up{source="dcgm"}` is 0. Reconnects
back off exponentially (from `interval` up to `reconnect_backoff_max`) on the clock the
poll observes; a poll inside the back-off window touches nothing. A connection attempt
is bounded by `connect_timeout`, which must be shorter than the poll's `timeout`.

Blank values (DCGM's INT64/FP64 blank sentinels and their NOT_FOUND/NOT_SUPPORTED/
NOT_PERMISSIONED offsets, or a non-OK status) are absent series, never numbers.

`pause_profiling(seconds)` pauses DCGM's profiling (so Nsight can take the counters)
until the time runs out (at most `max_profiling_pause`); the poll resumes it. Hopper
and newer read profiling through GPM, which does not conflict: DCGM answers
NOT_SUPPORTED and the pause is a no-op there.

With `exporter_compat`, the source also emits dcgm-exporter's default counters (and
every configured field dcgm-exporter has a name for) under dcgm-exporter's names and
labels, with DCGM's raw units; see docs/dcgm.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, NoReturn

from gpuwatchd.config import DCGM_DEFAULT_FIELDS, DcgmConfig, SourceConfig
from gpuwatchd.metrics import GPU_LABELS, MetricSpec, Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError

log = logging.getLogger(__name__)

BINDINGS_DIRS = (
    Path("usr/share/datacenter-gpu-manager-4/bindings/python3"),  # DCGM 4
    Path("usr/local/dcgm/bindings/python3"),  # DCGM 3
)
BINDING_MODULES = ("dcgmvalue", "dcgm_structs", "dcgm_fields", "dcgm_agent", "pydcgm")

FE_GPU = 1  # dcgm_fields.DCGM_FE_GPU
PROFILING_FIELDS = frozenset(range(1001, 1013))
DEFAULT_FIELDS = DCGM_DEFAULT_FIELDS

STATES = ("connected", "not_installed", "hostengine_down", "connection_lost", "error")
PROFILING_STATES = ("active", "paused", "unsupported", "refused")
_UNSUPPORTED_PROFILING = (
    "DCGM_ST_PROFILING_NOT_SUPPORTED",
    "DCGM_ST_NOT_SUPPORTED",
    "DCGM_ST_MODULE_NOT_LOADED",
    "DCGM_ST_REQUIRES_ROOT",
    "DCGM_ST_GROUP_IS_EMPTY",
)


# -- metrics ----------------------------------------------------------------------------


def _gpu(name: str, help: str, extra: tuple[str, ...] = ()) -> MetricSpec:
    return gauge(name, help, GPU_LABELS + extra)


def _gpu_counter(name: str, help: str, extra: tuple[str, ...] = ()) -> MetricSpec:
    return counter(name, help, GPU_LABELS + extra)


STATE = gauge("dcgm_state", "1 for the DCGM source's current state, 0 for the others.", ("state",))
INFO = gauge("dcgm_info", "DCGM in use; always 1.", ("version",))
LOSSES = counter(
    "dcgm_connection_losses_total", "Times a connected DCGM session broke (host engine restarts)."
)
PAUSE_REMAINING = gauge(
    "dcgm_profiling_pause_remaining_seconds", "Time left in a requested profiling pause."
)
PROFILING_STATE = _gpu(
    "gpu_dcgm_profiling_state",
    "1 for the GPU's DCGM profiling state (active, paused, unsupported, refused), else 0.",
    ("state",),
)
GENERIC = _gpu(
    "gpu_dcgm_field_value", "A configured DCGM field without a gpuwatchd name, raw.", ("field",)
)


@dataclass(frozen=True)
class FieldMap:
    """How one DCGM field becomes samples: gpuwatchd's name and dcgm-exporter's."""

    id: int
    spec: MetricSpec | None = None  # gpuwatchd metric (None: only the generic one)
    scale: float = 1.0  # DCGM's unit -> base unit
    extra: tuple[str, ...] = ()  # values of the spec's labels after gpu, uuid
    compat: str = ""  # dcgm-exporter's name
    compat_type: Literal["gauge", "counter"] = "gauge"  # as dcgm-exporter declares it
    compat_help: str = ""


def _ratio(name: str, help: str) -> MetricSpec:
    return _gpu(name, help + " (0-1, DCGM profiling).")


GR_ENGINE = _ratio("gpu_gr_engine_active_ratio", "Fraction of time the graphics engine was busy")
SM_ACTIVE = _ratio("gpu_sm_active_ratio", "Fraction of cycles an SM had at least one warp")
SM_OCCUPANCY = _ratio("gpu_sm_occupancy_ratio", "Resident warps per SM over the maximum")
TENSOR = _ratio("gpu_tensor_active_ratio", "Fraction of cycles a tensor pipe was active")
DRAM = _ratio("gpu_dram_active_ratio", "Fraction of cycles device memory was sending or receiving")
FP64 = _ratio("gpu_fp64_active_ratio", "Fraction of cycles the FP64 pipe was active")
FP32 = _ratio("gpu_fp32_active_ratio", "Fraction of cycles the FP32 pipe was active")
FP16 = _ratio("gpu_fp16_active_ratio", "Fraction of cycles the FP16 pipe was active")
PCIE_TX = _gpu("gpu_dcgm_pcie_tx_bytes_per_second", "PCIe transmit rate, headers included (DCGM).")
PCIE_RX = _gpu("gpu_dcgm_pcie_rx_bytes_per_second", "PCIe receive rate, headers included (DCGM).")
NVLINK_TX = _gpu("gpu_nvlink_tx_bytes_per_second", "NVLink transmit rate, all links (DCGM).")
NVLINK_RX = _gpu("gpu_nvlink_rx_bytes_per_second", "NVLink receive rate, all links (DCGM).")
POWER = _gpu("gpu_dcgm_power_watts", "Power draw (DCGM).")
ENERGY = _gpu_counter("gpu_dcgm_energy_joules_total", "Energy used since the driver loaded.")
REPLAYS = _gpu_counter("gpu_dcgm_pcie_replay_errors_total", "PCIe replays (DCGM).")
LAST_XID = _gpu("gpu_dcgm_last_xid", "The last Xid error DCGM saw on the GPU; 0 if none.")
VIOLATION = _gpu_counter(
    "gpu_dcgm_clock_violation_seconds_total",
    "Time the clocks were held below the requested ones, by reason.",
    ("reason",),
)
NVLINK_ERRORS = _gpu_counter(
    "gpu_dcgm_nvlink_errors_total", "NVLink errors, all links, by type.", ("type",)
)
REMAPPED_ROWS = _gpu_counter(
    "gpu_dcgm_remapped_rows_total", "Memory rows remapped, by error type.", ("type",)
)
REMAP_FAILED = _gpu("gpu_dcgm_row_remap_failed", "1 if a row remapping has failed.")
SM_CLOCK = _gpu("gpu_dcgm_sm_clock_hertz", "SM clock (DCGM).")
MEM_CLOCK = _gpu("gpu_dcgm_memory_clock_hertz", "Memory clock (DCGM).")
MEM_TEMP = _gpu("gpu_dcgm_memory_temperature_celsius", "Memory temperature (DCGM).")
GPU_TEMP = _gpu("gpu_dcgm_temperature_celsius", "GPU temperature (DCGM).")
UTIL = _gpu("gpu_dcgm_utilization_ratio", "Fraction of time a kernel was running (DCGM).")
MEM_UTIL = _gpu("gpu_dcgm_memory_copy_utilization_ratio", "Fraction of time memory was copied.")
ENC_UTIL = _gpu("gpu_dcgm_encoder_utilization_ratio", "Video encoder utilization (DCGM).")
DEC_UTIL = _gpu("gpu_dcgm_decoder_utilization_ratio", "Video decoder utilization (DCGM).")
FB = _gpu("gpu_dcgm_framebuffer_bytes", "Device memory by use: used, free, reserved.", ("state",))
ECC = _gpu_counter("gpu_dcgm_ecc_errors_total", "ECC errors (DCGM).", ("type", "period"))
RETIRED = _gpu_counter("gpu_dcgm_retired_pages_total", "Retired memory pages.", ("cause",))

MIB = float(2**20)
_VIOLATION_HELP = "Throttling duration due to {} (in ns)."


def _maps() -> dict[int, FieldMap]:
    rows = [
        FieldMap(
            1001,
            GR_ENGINE,
            compat="DCGM_FI_PROF_GR_ENGINE_ACTIVE",
            compat_help="Ratio of time the graphics engine is active.",
        ),
        FieldMap(
            1002,
            SM_ACTIVE,
            compat="DCGM_FI_PROF_SM_ACTIVE",
            compat_help="The ratio of cycles an SM has at least 1 warp assigned.",
        ),
        FieldMap(
            1003,
            SM_OCCUPANCY,
            compat="DCGM_FI_PROF_SM_OCCUPANCY",
            compat_help="The ratio of number of warps resident on an SM.",
        ),
        FieldMap(
            1004,
            TENSOR,
            compat="DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
            compat_help="Ratio of cycles the tensor (HMMA) pipe is active.",
        ),
        FieldMap(
            1005,
            DRAM,
            compat="DCGM_FI_PROF_DRAM_ACTIVE",
            compat_help="Ratio of cycles the device memory interface is active sending or "
            "receiving data.",
        ),
        FieldMap(
            1006,
            FP64,
            compat="DCGM_FI_PROF_PIPE_FP64_ACTIVE",
            compat_help="Ratio of cycles the fp64 pipes are active.",
        ),
        FieldMap(
            1007,
            FP32,
            compat="DCGM_FI_PROF_PIPE_FP32_ACTIVE",
            compat_help="Ratio of cycles the fp32 pipes are active.",
        ),
        FieldMap(
            1008,
            FP16,
            compat="DCGM_FI_PROF_PIPE_FP16_ACTIVE",
            compat_help="Ratio of cycles the fp16 pipes are active.",
        ),
        FieldMap(
            1009,
            PCIE_TX,
            compat="DCGM_FI_PROF_PCIE_TX_BYTES",
            compat_help="The rate of data transmitted over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second.",
        ),
        FieldMap(
            1010,
            PCIE_RX,
            compat="DCGM_FI_PROF_PCIE_RX_BYTES",
            compat_help="The rate of data received over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second.",
        ),
        FieldMap(
            1011,
            NVLINK_TX,
            compat="DCGM_FI_PROF_NVLINK_TX_BYTES",
            compat_help="The rate of data transmitted over NVLink - including both "
            "protocol headers and data payloads - in bytes per second.",
        ),
        FieldMap(
            1012,
            NVLINK_RX,
            compat="DCGM_FI_PROF_NVLINK_RX_BYTES",
            compat_help="The rate of data received over NVLink - including both "
            "protocol headers and data payloads - in bytes per second.",
        ),
        FieldMap(
            100,
            SM_CLOCK,
            1e6,
            compat="DCGM_FI_DEV_SM_CLOCK",
            compat_help="SM clock frequency (in MHz).",
        ),
        FieldMap(
            101,
            MEM_CLOCK,
            1e6,
            compat="DCGM_FI_DEV_MEM_CLOCK",
            compat_help="Memory clock frequency (in MHz).",
        ),
        FieldMap(
            140,
            MEM_TEMP,
            compat="DCGM_FI_DEV_MEMORY_TEMP",
            compat_help="Memory temperature (in C).",
        ),
        FieldMap(
            150, GPU_TEMP, compat="DCGM_FI_DEV_GPU_TEMP", compat_help="GPU temperature (in C)."
        ),
        FieldMap(155, POWER, compat="DCGM_FI_DEV_POWER_USAGE", compat_help="Power draw (in W)."),
        FieldMap(
            156,
            ENERGY,
            1e-3,
            compat="DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            compat_type="counter",
            compat_help="Total energy consumption since boot (in mJ).",
        ),
        FieldMap(
            202,
            REPLAYS,
            compat="DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
            compat_type="counter",
            compat_help="Total number of PCIe retries.",
        ),
        FieldMap(
            203, UTIL, 0.01, compat="DCGM_FI_DEV_GPU_UTIL", compat_help="GPU utilization (in %)."
        ),
        FieldMap(
            204,
            MEM_UTIL,
            0.01,
            compat="DCGM_FI_DEV_MEM_COPY_UTIL",
            compat_help="Memory utilization (in %).",
        ),
        FieldMap(
            206,
            ENC_UTIL,
            0.01,
            compat="DCGM_FI_DEV_ENC_UTIL",
            compat_help="Encoder utilization (in %).",
        ),
        FieldMap(
            207,
            DEC_UTIL,
            0.01,
            compat="DCGM_FI_DEV_DEC_UTIL",
            compat_help="Decoder utilization (in %).",
        ),
        FieldMap(
            230,
            LAST_XID,
            compat="DCGM_FI_DEV_XID_ERRORS",
            compat_help="Value of the last XID error encountered.",
        ),
        FieldMap(
            251,
            FB,
            MIB,
            ("free",),
            compat="DCGM_FI_DEV_FB_FREE",
            compat_help="Framebuffer memory free (in MiB).",
        ),
        FieldMap(
            252,
            FB,
            MIB,
            ("used",),
            compat="DCGM_FI_DEV_FB_USED",
            compat_help="Framebuffer memory used (in MiB).",
        ),
        FieldMap(
            253,
            FB,
            MIB,
            ("reserved",),
            compat="DCGM_FI_DEV_FB_RESERVED",
            compat_help="Framebuffer memory reserved (in MiB).",
        ),
        FieldMap(
            310,
            ECC,
            1.0,
            ("corrected", "volatile"),
            compat="DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
            compat_type="counter",
            compat_help="Total number of single-bit volatile ECC errors.",
        ),
        FieldMap(
            311,
            ECC,
            1.0,
            ("uncorrected", "volatile"),
            compat="DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            compat_type="counter",
            compat_help="Total number of double-bit volatile ECC errors.",
        ),
        FieldMap(
            312,
            ECC,
            1.0,
            ("corrected", "aggregate"),
            compat="DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
            compat_type="counter",
            compat_help="Total number of single-bit persistent ECC errors.",
        ),
        FieldMap(
            313,
            ECC,
            1.0,
            ("uncorrected", "aggregate"),
            compat="DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
            compat_type="counter",
            compat_help="Total number of double-bit persistent ECC errors.",
        ),
        FieldMap(
            390,
            RETIRED,
            1.0,
            ("single_bit",),
            compat="DCGM_FI_DEV_RETIRED_SBE",
            compat_type="counter",
            compat_help="Total number of retired pages due to single-bit errors.",
        ),
        FieldMap(
            391,
            RETIRED,
            1.0,
            ("double_bit",),
            compat="DCGM_FI_DEV_RETIRED_DBE",
            compat_type="counter",
            compat_help="Total number of retired pages due to double-bit errors.",
        ),
        FieldMap(
            393,
            REMAPPED_ROWS,
            1.0,
            ("uncorrectable",),
            compat="DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
            compat_type="counter",
            compat_help="Number of remapped rows for uncorrectable errors",
        ),
        FieldMap(
            394,
            REMAPPED_ROWS,
            1.0,
            ("correctable",),
            compat="DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
            compat_type="counter",
            compat_help="Number of remapped rows for correctable errors",
        ),
        FieldMap(
            395,
            REMAP_FAILED,
            compat="DCGM_FI_DEV_ROW_REMAP_FAILURE",
            compat_help="Whether remapping of rows has failed",
        ),
        FieldMap(
            409,
            NVLINK_ERRORS,
            1.0,
            ("crc_flit",),
            compat="DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
            compat_type="counter",
            compat_help="Total number of NVLink flow-control CRC errors.",
        ),
        FieldMap(
            419,
            NVLINK_ERRORS,
            1.0,
            ("crc_data",),
            compat="DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
            compat_type="counter",
            compat_help="Total number of NVLink data CRC errors.",
        ),
        FieldMap(
            429,
            NVLINK_ERRORS,
            1.0,
            ("replay",),
            compat="DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
            compat_type="counter",
            compat_help="Total number of NVLink retries.",
        ),
        FieldMap(
            439,
            NVLINK_ERRORS,
            1.0,
            ("recovery",),
            compat="DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
            compat_type="counter",
            compat_help="Total number of NVLink recovery errors.",
        ),
        FieldMap(
            449,
            None,
            compat="DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
            compat_type="counter",
            compat_help="Total number of NVLink bandwidth counters for all lanes.",
        ),
    ]
    reasons = {
        240: ("power", "power constraints", "DCGM_FI_DEV_POWER_VIOLATION"),
        241: ("thermal", "thermal constraints", "DCGM_FI_DEV_THERMAL_VIOLATION"),
        242: ("sync_boost", "sync-boost constraints", "DCGM_FI_DEV_SYNC_BOOST_VIOLATION"),
        243: ("board_limit", "board limit constraints", "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION"),
        244: ("low_utilization", "low utilization", "DCGM_FI_DEV_LOW_UTIL_VIOLATION"),
        245: ("reliability", "reliability constraints", "DCGM_FI_DEV_RELIABILITY_VIOLATION"),
    }
    for fid, (reason, why, name) in reasons.items():
        rows.append(
            FieldMap(
                fid,
                VIOLATION,
                1e-9,
                (reason,),
                compat=name,
                compat_type="counter",
                compat_help=_VIOLATION_HELP.format(why),
            )
        )
    return {row.id: row for row in rows}


FIELD_MAPS = _maps()

# dcgm-exporter's default counters (etc/default-counters.csv, DCGM-Exporter 4.x): what
# `exporter_compat` watches on top of `fields`. DCGM_FI_DEV_VGPU_LICENSE_STATUS is left
# out (vGPU only: blank on bare metal); DCGM_FI_DRIVER_VERSION is a label.
COMPAT_DEFAULT_FIELDS: tuple[int, ...] = (
    100,
    101,
    140,
    150,
    155,
    156,
    202,
    203,
    204,
    206,
    207,
    230,
    251,
    252,
    253,
    449,
    393,
    394,
    395,
    1001,
    1004,
    1005,
    1009,
    1010,
)
COMPAT_GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName")
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
XID_LABELS = ("err_code", "err_msg")
# err_msg of dcgm-exporter's DCGM_FI_DEV_XID_ERRORS for common Xids (NVIDIA's Xid catalog)
XID_MESSAGES = {
    0: "No Error",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors -- Most likely to see when running "
    "multiple cuda",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
}
UNKNOWN_XID = "Unknown Error"


def compat_specs(hostname_label: str = "Hostname") -> list[MetricSpec]:
    """dcgm-exporter's metric families, as gpuwatchd emits them with exporter_compat.

    dcgm-exporter declares some as counters without a _total suffix; the Python client
    cannot render that, so every compat family is a gauge here: the names, labels and
    values are dcgm-exporter's, and PromQL (rate, increase) treats them the same.
    """
    labels = (*COMPAT_GPU_LABELS, hostname_label, DRIVER_LABEL)
    return [
        MetricSpec(m.compat, m.compat_help, labels + (XID_LABELS if m.id == 230 else ()))
        for m in FIELD_MAPS.values()
        if m.compat
    ]


# -- loading the bindings ---------------------------------------------------------------

_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class Bindings:
    """A private copy of DCGM's Python bindings, loaded from `directory`."""

    directory: Path
    modules: dict[str, ModuleType]

    @property
    def pydcgm(self) -> Any:
        return self.modules["pydcgm"]

    @property
    def structs(self) -> Any:
        return self.modules["dcgm_structs"]

    @property
    def agent(self) -> Any:
        return self.modules["dcgm_agent"]

    @property
    def fields(self) -> Any:
        return self.modules["dcgm_fields"]


def find_bindings(
    bindings_path: Path | None, rootfs: Path = Path("/")
) -> tuple[Path | None, list[Path]]:
    """(the bindings directory or None, every place looked at)."""
    candidates = [bindings_path] if bindings_path else [rootfs / d for d in BINDINGS_DIRS]
    for candidate in candidates:
        if (candidate / "pydcgm.py").is_file():
            return candidate, candidates
    return None, candidates


def load_bindings(directory: Path) -> Bindings:
    """Import DCGM's bindings from `directory` without leaving them importable.

    They import each other by bare name (`import dcgm_structs`), so the directory goes
    first on sys.path, and any module of the same name already imported leaves
    sys.modules, while they load; then both are put back as they were. The returned
    modules still reach each other through their own globals.
    """
    directory = Path(directory)
    names = {p.stem for p in directory.glob("*.py")}
    if "pydcgm" not in names:
        raise FileNotFoundError(f"no pydcgm.py in {directory}")
    entry = str(directory)
    with _LOAD_LOCK:
        displaced = {name: sys.modules.pop(name) for name in names if name in sys.modules}
        sys.path.insert(0, entry)
        try:
            for name in BINDING_MODULES:
                importlib.import_module(name)
            modules = {name: sys.modules[name] for name in names if name in sys.modules}
        finally:
            if entry in sys.path:
                sys.path.remove(entry)
            sys.path_importer_cache.pop(entry, None)
            for name in names:
                sys.modules.pop(name, None)
            sys.modules.update(displaced)
    return Bindings(directory, modules)


# -- the source ---------------------------------------------------------------------------


class DcgmUnavailable(SourceError):
    """The source cannot read DCGM this poll; `samples` say why (the state gauges)."""

    def __init__(self, message: str, samples: list[Sample]) -> None:
        super().__init__(message)
        self.samples = samples


@dataclass
class _Gpu:
    id: int
    labels: tuple[str, ...]
    name: str
    profiling: str = "refused"  # one of PROFILING_STATES; refused until watched
    why: str = ""  # why profiling is not active
    fields: frozenset[int] = frozenset()  # profiling fields DCGM supports on this GPU
    emit: dict[int, list[tuple[str, tuple[str, ...], float]]] = field(default_factory=dict)
    compat: tuple[str, ...] = ()
    state_samples: dict[str, list[Sample]] = field(default_factory=dict)


@dataclass
class _Watch:
    group: Any  # pydcgm.DcgmGroup
    field_group: Any  # pydcgm.DcgmFieldGroup
    gpus: list[int]
    profiling: bool


@dataclass
class _Session:
    bindings: Bindings
    handle: Any  # pydcgm.DcgmHandle
    system: Any  # pydcgm.DcgmSystem
    version: str
    gpus: dict[int, _Gpu]
    watches: list[_Watch] = field(default_factory=list)
    profiling_paused: bool = False
    pause_unsupported: bool = False
    profiling_retry_at: float | None = None


def _parse_hostengine(address: str) -> dict[str, Any]:
    if address == "embedded":
        return {}
    if address.startswith("unix://"):
        return {"unixSocketPath": address.removeprefix("unix://")}
    return {"ipAddress": address}


def _version(raw: str) -> str:
    match = re.search(r"(?:^|;)version:([^;]+)", raw)
    return match.group(1) if match else raw.strip()[:32]


def _ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6"."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


@register
class DcgmSource(Source):
    name = "dcgm"
    metrics = (
        STATE,
        INFO,
        LOSSES,
        PAUSE_REMAINING,
        PROFILING_STATE,
        GENERIC,
        *dict.fromkeys(m.spec for m in FIELD_MAPS.values() if m.spec is not None),
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        if not isinstance(config, DcgmConfig):
            config = DcgmConfig.model_validate(config.model_dump())
        super().__init__(config, context)
        self.config: DcgmConfig = config
        extras = context.extras
        self._clock: Callable[[], float] = extras.get("clock", time.monotonic)
        self._rootfs = Path(extras.get("rootfs", "/"))
        self._hostengine: str = extras.get("dcgm_hostengine") or config.hostengine
        self._hostname: str = extras.get("hostname") or socket.gethostname()
        self._pid = os.getpid()
        self._native = list(config.fields)
        compat = COMPAT_DEFAULT_FIELDS if config.exporter_compat else ()
        self._watched = list(dict.fromkeys([*config.fields, *compat]))
        self._profiling = [f for f in self._watched if f in PROFILING_FIELDS]
        self._device = [f for f in self._watched if f not in PROFILING_FIELDS]
        if config.exporter_compat:
            # a gpuwatchd source's metrics are a class attribute; compat adds families
            self.metrics = (  # type: ignore[misc]
                *type(self).metrics,
                *compat_specs(config.compat_hostname_label),
            )
        self._lock = threading.Lock()  # one DCGM conversation at a time
        self._bindings: Bindings | None = None
        self._session: _Session | None = None
        self._state = "not_installed"
        self._reason = "not started"
        self._logged: tuple[str, str] | None = None
        self._failures = 0
        self._retry_at: float | None = None
        self._losses = 0
        self._version = ""
        self._pause_until: float | None = None
        self._changes: dict[tuple[str, str, str], list[int]] = {}  # profiling states to log
        self._state_samples = {
            s: [Sample(STATE.name, (t,), float(s == t)) for t in STATES] for s in STATES
        }

    # -- public API -----------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    def pause_profiling(self, seconds: float) -> dict[str, Any]:
        """Pause DCGM profiling for `seconds` (capped), resumed automatically after.

        Applied at once when DCGM is connected and no poll is running, else by the next
        poll. Returns {"paused", "seconds", "applied", "state"}.
        """
        if not math.isfinite(seconds):
            raise ValueError(f"pause_profiling: expected a number of seconds, got {seconds!r}")
        seconds = min(float(seconds), self.config.max_profiling_pause)
        if seconds <= 0:
            return self.resume_profiling()
        self._pause_until = self._clock() + seconds
        log.info("dcgm: profiling pause requested for %gs", seconds)
        applied = self._apply_now()
        return {"paused": True, "seconds": seconds, "applied": applied, "state": self._state}

    def resume_profiling(self) -> dict[str, Any]:
        self._pause_until = None
        applied = self._apply_now()
        return {"paused": False, "seconds": 0.0, "applied": applied, "state": self._state}

    def pause_remaining(self) -> float:
        until = self._pause_until
        return max(0.0, until - self._clock()) if until is not None else 0.0

    def _apply_now(self) -> bool:
        if not self._lock.acquire(timeout=min(1.0, self.config.timeout)):
            return False  # a poll holds DCGM (or is stuck in it): the next poll applies it
        try:
            session = self._session
            if session is None:
                return False
            try:
                self._apply_pause(session, self._clock())
            except Exception as e:  # the poll will find out and handle it
                log.debug("dcgm: applying the profiling pause failed: %s", e)
                return False
            return True
        finally:
            self._lock.release()

    # -- polling --------------------------------------------------------------------------

    def collect(self) -> list[Sample]:
        with self._lock:
            now = self._clock()
            if self._session is None:
                self._start(now)
            session = self._session
            assert session is not None
            structs = session.bindings.structs
            try:
                self._apply_pause(session, now)
                self._retry_profiling(session, now)
                out = self._read(session)
            except structs.DCGMError as e:
                self._drop_session(session, connected=False)
                if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                    self._losses += 1
                    self._fail(
                        now,
                        "connection_lost",
                        f"lost the connection to nv-hostengine "
                        f"at {self._hostengine} ({self._code(e)}); reconnecting",
                    )
                self._fail(now, "error", f"reading DCGM failed: {self._code(e)}")
            out.extend(self._status(session, now))
            return out

    def close(self) -> None:
        """Give the counters back (resume a pause of ours), remove our groups, disconnect."""
        if not self._lock.acquire(timeout=self.config.timeout):
            log.warning("dcgm: a poll is stuck in DCGM; closing without cleaning up")
            return
        try:
            session, self._session = self._session, None
            if session is not None:
                if session.profiling_paused:
                    self._quietly(session, session.system.profiling.Resume)
                self._drop_session(session, connected=True)
        finally:
            self._lock.release()

    # -- states ---------------------------------------------------------------------------

    def _set_state(self, state: str, reason: str) -> None:
        """Enter `state`; log it once per change (the scheduler warns that the source is
        down, with this reason, so this line is INFO)."""
        self._state, self._reason = state, reason
        if self._logged is None or self._logged[0] != state:
            log.info("dcgm: %s: %s", state.replace("_", " "), reason)
        elif self._logged[1] != reason:
            log.debug("dcgm: %s: %s", state, reason)
        self._logged = (state, reason)

    def _unavailable(self) -> DcgmUnavailable:
        samples = [*self._state_samples[self._state], Sample(LOSSES.name, (), self._losses)]
        return DcgmUnavailable(f"{self._state}: {self._reason}", samples)

    def _fail(self, now: float, state: str, reason: str) -> NoReturn:
        """Record a failed attempt, schedule the next one, raise DcgmUnavailable."""
        self._failures += 1
        if state == "connection_lost":
            delay = 0.0  # reconnect on the next poll; back off if that fails
        else:
            base = max(self.config.interval, 1.0)
            delay = min(self.config.reconnect_backoff_max, base * 2 ** (self._failures - 1))
        self._retry_at = now + delay
        self._set_state(state, reason)
        log.debug("dcgm: next attempt in %gs", delay)
        raise self._unavailable()

    def _code(self, error: Any) -> str:
        """ "DCGM_ST_NAME: message" of a DCGMError."""
        structs = self._bindings.structs if self._bindings else None
        value = getattr(error, "value", None)
        names = (
            [n for n in dir(structs) if n.startswith("DCGM_ST_") and getattr(structs, n) == value]
            if structs is not None
            else []
        )
        return f"{names[0] if names else f'DCGM error {value}'}: {error}"

    # -- connecting -----------------------------------------------------------------------

    def _start(self, now: float) -> None:
        if self._retry_at is not None and now < self._retry_at:
            raise self._unavailable()
        bindings = self._load(now)
        structs = bindings.structs
        where = {"ipAddress": None, "unixSocketPath": None, **_parse_hostengine(self._hostengine)}
        try:
            handle = bindings.pydcgm.DcgmHandle(
                timeoutMs=int(self.config.connect_timeout * 1000),
                persistAfterDisconnect=False,
                **where,
            )
        except structs.DCGMError as e:
            if e.value == structs.DCGM_ST_LIBRARY_NOT_FOUND:
                self._fail(
                    now,
                    "not_installed",
                    f"DCGM's Python bindings are at "
                    f"{bindings.directory} but libdcgm is not installed ({self._code(e)})",
                )
            if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                self._fail(
                    now,
                    "hostengine_down",
                    f"cannot connect to nv-hostengine at "
                    f"{self._hostengine} ({self._code(e)}); is it running "
                    "(systemctl status nvidia-dcgm)?",
                )
            self._fail(now, "error", f"starting DCGM failed: {self._code(e)}")
        try:
            session = self._setup(bindings, handle, now)
        except structs.DCGMError as e:
            self._quietly_shutdown(handle)
            if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                self._fail(
                    now,
                    "hostengine_down",
                    f"nv-hostengine at {self._hostengine} went "
                    f"away while setting up ({self._code(e)})",
                )
            self._fail(now, "error", f"setting up DCGM watches failed: {self._code(e)}")
        except Exception as e:  # bindings of another DCGM version may differ: say what broke
            self._quietly_shutdown(handle)
            self._fail(now, "error", f"setting up DCGM failed: {type(e).__name__}: {e}")
        self._session = session
        self._log_profiling_changes()
        self._failures = 0
        self._retry_at = None
        gpus = session.gpus.values()
        profiling = [g.id for g in gpus if g.profiling == "active"]
        self._set_state(
            "connected",
            f"DCGM {session.version} at {self._hostengine}: {len(session.gpus)} GPUs, "
            f"{len(self._device)} device fields, profiling on GPUs [{_ranges(profiling)}]",
        )

    def _load(self, now: float) -> Bindings:
        if self._bindings is not None:
            return self._bindings
        directory, looked = find_bindings(self.config.bindings_path, self._rootfs)
        if directory is None:
            where = ", ".join(str(p) for p in looked)
            self._fail(
                now,
                "not_installed",
                f"DCGM's Python bindings not found (looked in "
                f"{where}); install datacenter-gpu-manager-4 or set "
                "sources.dcgm.bindings_path",
            )
        try:
            self._bindings = load_bindings(directory)
        except Exception as e:
            self._fail(
                now,
                "not_installed",
                f"cannot load DCGM's Python bindings from {directory}: {type(e).__name__}: {e}",
            )
        assert self._bindings is not None
        return self._bindings

    def _setup(self, bindings: Bindings, handle: Any, now: float) -> _Session:
        self._changes.clear()  # profiling states of an attempt that failed are not news
        agent = bindings.agent
        system = handle.GetSystem()
        version = ""
        with contextlib.suppress(bindings.structs.DCGMError):
            version = _version(agent.dcgmVersionInfo().rawBuildInfoString)
        self._version = version
        gpus: dict[int, _Gpu] = {}
        for gpu_id in system.discovery.GetAllSupportedGpuIds():
            attrs = system.discovery.GetGpuAttributes(gpu_id).identifiers
            gpu = _Gpu(int(gpu_id), (str(gpu_id), str(attrs.uuid)), str(attrs.deviceName))
            gpu.compat = (
                str(gpu_id),
                str(attrs.uuid),
                str(attrs.pciBusId),
                f"nvidia{gpu_id}",
                str(attrs.deviceName),
                self._hostname,
                str(attrs.driverVersion),
            )
            gpus[gpu.id] = gpu
        session = _Session(bindings, handle, system, version, gpus)
        if gpus:
            self._watch_device(session)
            self._watch_profiling(session, now, list(gpus.values()))
            session.system.UpdateAllFields(1)
        for gpu in gpus.values():
            self._prepare(gpu)
        return session

    def _group_name(self, suffix: str = "") -> str:
        return f"gpuwatchd_{self._pid}{suffix}"

    def _field_group(self, session: _Session, name: str, ids: list[int]) -> Any:
        """A field group called `name`, replacing a stale one of ours with that name.

        Field group names are unique in a host engine; one of ours can outlive us (a
        persisting connection, a crash). pydcgm only deletes groups the same object
        created, so the stale one is destroyed through the C API.
        """
        stale = session.system.GetFieldGroupIdByName(name)
        if stale is not None:
            session.bindings.agent.dcgmFieldGroupDestroy(session.handle.handle, stale)
        return session.bindings.pydcgm.DcgmFieldGroup(session.handle, name, ids)

    def _watch(
        self, session: _Session, name: str, gpus: list[int], ids: list[int], profiling: bool
    ) -> _Watch:
        group = session.system.GetGroupWithGpuIds(name, gpus)
        try:
            field_group = self._field_group(session, name, ids)
            interval = self.config.interval
            group.samples.WatchFields(field_group, int(interval * 1e6), max(30.0, 3 * interval), 2)
        except session.bindings.structs.DCGMError:
            self._quietly(session, group.Delete)
            raise
        watch = _Watch(group, field_group, gpus, profiling)
        session.watches.append(watch)
        return watch

    def _watch_device(self, session: _Session) -> None:
        if self._device:
            self._watch(session, self._group_name(), sorted(session.gpus), self._device, False)

    def _watch_profiling(self, session: _Session, now: float, gpus: list[_Gpu]) -> None:
        """Watch the profiling fields each GPU supports, one field group per set of them."""
        if not self._profiling:
            for gpu in gpus:
                gpu.profiling, gpu.why = "unsupported", "no profiling fields configured"
            return
        structs = session.bindings.structs
        unsupported = {getattr(structs, n, None) for n in _UNSUPPORTED_PROFILING}
        by_fields: dict[frozenset[int], list[int]] = {}
        for gpu in gpus:
            try:
                groups = session.bindings.agent.dcgmProfGetSupportedMetricGroups(
                    session.handle.handle, gpu.id
                )
            except structs.DCGMError as e:
                if e.value not in unsupported:
                    raise
                self._profiling_state(gpu, "unsupported", self._code(e))
                continue
            supported = {
                int(groups.metricGroups[i].fieldIds[j])
                for i in range(groups.numMetricGroups)
                for j in range(groups.metricGroups[i].numFieldIds)
            }
            wanted = frozenset(f for f in self._profiling if f in supported)
            if not wanted:
                self._profiling_state(
                    gpu,
                    "unsupported",
                    "DCGM reports no supported profiling metric groups for the configured fields",
                )
                continue
            missing = sorted(set(self._profiling) - wanted)
            if missing and gpu.profiling != "active":
                log.info(
                    "dcgm: GPU %d: profiling fields %s not supported; watching %s",
                    gpu.id,
                    missing,
                    sorted(wanted),
                )
            gpu.fields = wanted
            by_fields.setdefault(wanted, []).append(gpu.id)
        for fields, gpu_ids in sorted(by_fields.items(), key=lambda kv: kv[1]):
            suffix = f"_prof{min(gpu_ids)}"
            try:
                self._watch(session, self._group_name(suffix), gpu_ids, sorted(fields), True)
            except structs.DCGMError as e:
                if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                    raise
                for gpu_id in gpu_ids:
                    self._profiling_state(session.gpus[gpu_id], "refused", self._code(e))
                session.profiling_retry_at = now + self.config.profiling_retry
                continue
            for gpu_id in gpu_ids:
                self._profiling_state(session.gpus[gpu_id], "active", "")

    def _profiling_state(self, gpu: _Gpu, state: str, why: str) -> None:
        if (gpu.profiling, gpu.why) != (state, why):
            self._changes.setdefault((state, why, gpu.name), []).append(gpu.id)
        gpu.profiling, gpu.why = state, why
        if state not in ("active", "paused"):
            gpu.fields = frozenset()

    def _log_profiling_changes(self) -> None:
        """One line per new (state, reason, model), naming the GPUs: logged once per change."""
        for (state, why, model), ids in self._changes.items():
            level = logging.INFO if state in ("active", "paused") else logging.WARNING
            log.log(
                level,
                "dcgm: profiling %s on GPUs [%s] (%s)%s",
                state,
                _ranges(ids),
                model,
                f": {why}" if why else "",
            )
        self._changes.clear()

    def _retry_profiling(self, session: _Session, now: float) -> None:
        retry = session.profiling_retry_at
        if retry is None or now < retry:
            return
        session.profiling_retry_at = None
        refused = [g for g in session.gpus.values() if g.profiling == "refused"]
        if refused:
            self._watch_profiling(session, now, refused)
            self._log_profiling_changes()
            for gpu in refused:
                self._prepare(gpu)

    def _apply_pause(self, session: _Session, now: float) -> None:
        until = self._pause_until
        wanted = until is not None and now < until
        if until is not None and not wanted:
            self._pause_until = None
        if wanted == session.profiling_paused or session.pause_unsupported:
            return
        structs = session.bindings.structs
        try:
            if wanted:
                session.system.profiling.Pause()
            else:
                session.system.profiling.Resume()
        except structs.DCGMError as e:
            if e.value != structs.DCGM_ST_NOT_SUPPORTED:
                raise
            session.pause_unsupported = True
            log.info(
                "dcgm: profiling pause not supported by this DCGM/GPU (%s); profilers "
                "can run beside DCGM here (GPM)",
                self._code(e),
            )
            return
        session.profiling_paused = wanted
        for gpu in session.gpus.values():
            if wanted and gpu.profiling == "active":
                self._profiling_state(gpu, "paused", "paused on request")
            elif not wanted and gpu.profiling == "paused":
                self._profiling_state(gpu, "active", "")
        self._log_profiling_changes()

    # -- reading --------------------------------------------------------------------------

    def _prepare(self, gpu: _Gpu) -> None:
        """Precompute every (metric, labels, scale) a value of each field becomes."""
        compat = self.config.exporter_compat
        gpu.emit = {}
        for fid in self._watched:
            rows: list[tuple[str, tuple[str, ...], float]] = []
            mapping = FIELD_MAPS.get(fid)
            if fid in self._native:
                if mapping is not None and mapping.spec is not None:
                    rows.append((mapping.spec.name, gpu.labels + mapping.extra, mapping.scale))
                else:
                    rows.append((GENERIC.name, gpu.labels + (str(fid),), 1.0))
            if compat and mapping is not None and mapping.compat:
                rows.append((mapping.compat, gpu.compat, 1.0))
            gpu.emit[fid] = rows
        gpu.state_samples = {
            s: [
                Sample(PROFILING_STATE.name, gpu.labels + (t,), float(s == t))
                for t in PROFILING_STATES
            ]
            for s in PROFILING_STATES
        }

    def _read(self, session: _Session) -> list[Sample]:
        out: list[Sample] = []
        gpus = session.gpus
        for watch in session.watches:
            if watch.profiling and session.profiling_paused:
                continue  # blank while paused
            collection = watch.group.samples.GetLatest_v2(watch.field_group)
            for gpu_id, values in collection.values.get(FE_GPU, {}).items():
                gpu = gpus.get(gpu_id)
                if gpu is None:
                    continue
                for fid, series in values.items():
                    value = series[-1]
                    if value.isBlank or value.value is None:
                        continue
                    rows = gpu.emit.get(fid)
                    if not rows:
                        continue
                    number = float(value.value)
                    for name, labels, scale in rows:
                        if name == "DCGM_FI_DEV_XID_ERRORS":
                            code = int(number)
                            labels = labels + (str(code), XID_MESSAGES.get(code, UNKNOWN_XID))
                        out.append(Sample(name, labels, number * scale))
        return out

    def _status(self, session: _Session, now: float) -> list[Sample]:
        out = list(self._state_samples["connected"])
        out.append(Sample(LOSSES.name, (), float(self._losses)))
        if session.version:
            out.append(Sample(INFO.name, (session.version,), 1.0))
        out.append(Sample(PAUSE_REMAINING.name, (), self.pause_remaining()))
        if self._profiling:
            for gpu in session.gpus.values():
                out.extend(gpu.state_samples[gpu.profiling])
        return out

    # -- teardown -------------------------------------------------------------------------

    def _drop_session(self, session: _Session, connected: bool) -> None:
        """Forget the session; if the connection still works, remove our groups first."""
        if self._session is session:
            self._session = None
        if connected:
            for watch in session.watches:
                self._quietly(session, watch.group.samples.UnwatchFields, watch.field_group)
                self._quietly(session, watch.field_group.Delete)
                self._quietly(session, watch.group.Delete)
        else:  # gone with the host engine: don't ask it, and let pydcgm forget them
            tracked = getattr(session.bindings.pydcgm.DcgmFieldGroup, "groups", None)
            for watch in session.watches:
                field_group = watch.field_group
                if isinstance(tracked, dict) and field_group.fieldGroupId is not None:
                    tracked.pop(field_group.fieldGroupId.value, None)
                field_group._dcgmHandle = None
        session.watches.clear()
        self._quietly_shutdown(session.handle)

    def _quietly(self, session: _Session, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except session.bindings.structs.DCGMError as e:
            log.debug("dcgm: %s failed: %s", getattr(function, "__name__", function), e)
            return None

    def _quietly_shutdown(self, handle: Any) -> None:
        try:
            handle.Shutdown()
        except Exception as e:  # a dead connection may refuse even this
            log.debug("dcgm: disconnecting failed: %s", e)


__all__ = [
    "BINDINGS_DIRS",
    "COMPAT_DEFAULT_FIELDS",
    "DEFAULT_FIELDS",
    "FIELD_MAPS",
    "Bindings",
    "DcgmConfig",
    "DcgmSource",
    "DcgmUnavailable",
    "FieldMap",
    "compat_specs",
    "find_bindings",
    "load_bindings",
]
