"""What DCGM's fields become: gpuwatchd's metrics, dcgm-exporter's names, and which fields
can be read as numbers at all.

Field ids are DCGM's and stable across versions (DCGM 4.6 renamed the constants).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

from gpuwatchd.config import DCGM_DEFAULT_FIELDS
from gpuwatchd.metrics import (
    Export,
    MetricSpec,
    counter,
    gauge,
    gpu_counter,
    gpu_gauge,
    instance_form,
)
from gpuwatchd.sources.nvml.metrics import UTILIZATION

FE_GPU = 1  # dcgm_fields.DCGM_FE_GPU
# MIG: a GPU instance, a compute instance (dcgm_fields.DCGM_FE_GPU_I, DCGM_FE_GPU_CI)
FE_GPU_I, FE_GPU_CI = 4, 5
# DCGM's own test for a profiling field (DCGM_FIELD_ID_IS_PROF_FIELD, dcgm_fields_internal.hpp,
# 4.6): DCGM_FI_PROF_FIRST_ID..LAST_ID (1001-1096) and the per-link NVLink bytes (1532/1533).
# DCGM forwards these to the profiling module and, when it refuses, drops the watch of the
# whole field group. Older DCGMs end the range earlier (3.x 1075, 4.2 1079, 4.5 1083) and
# have no other fields in it.
PROFILING_FIELDS = frozenset({*range(1001, 1097), 1532, 1533})
DEFAULT_FIELDS = DCGM_DEFAULT_FIELDS
NVML_INDEX = 52  # DCGM_FI_DEV_NVML_INDEX: the `gpu` label, DCGM's GPU id being another number
# DCGM_MAX_FIELD_IDS_PER_FIELD_GROUP is 128, and dcgmFieldGroupCreate wants fewer
MAX_FIELDS_PER_GROUP = 127
STATES = ("connected", "not_installed", "hostengine_down", "connection_lost", "error")
PROFILING_STATES = ("active", "paused", "unsupported", "refused")

# -- which fields, in which field groups ----------------------------------------------------


def profiling_ids(dcgm_fields: Any) -> frozenset[int]:
    """The profiling module's field ids as these bindings name them: every DCGM_FI_PROF_*
    constant of their dcgm_fields, which in every DCGM from 2.4 to 4.6 is exactly the ids
    DCGM_FIELD_ID_IS_PROF_FIELD covers (a newer DCGM's profiling fields included), plus
    PROFILING_FIELDS for bindings that name fewer."""
    named = (
        value
        for name, value in vars(dcgm_fields).items()
        if name.startswith("DCGM_FI_PROF_") and type(value) is int
    )
    return PROFILING_FIELDS | frozenset(named)


NUMERIC_TYPES = frozenset("dit")  # DCGM_FT_DOUBLE, _INT64, _TIMESTAMP
TYPE_NAMES = {"s": "text", "b": "binary"}  # DCGM_FT_STRING, _BINARY


@dataclass(frozen=True)
class FieldPlan:
    """The fields the source watches and how they are grouped for DCGM."""

    native: tuple[int, ...]  # configured: exported under gpuwatchd's names
    watched: tuple[int, ...]  # those and, with exporter_compat, dcgm-exporter's defaults
    profiling_ids: frozenset[int] = PROFILING_FIELDS  # which ids DCGM's profiling module serves

    @classmethod
    def of(cls, configured: Iterable[int], compat: Iterable[int] = ()) -> FieldPlan:
        native = tuple(dict.fromkeys(configured))
        return cls(native, tuple(dict.fromkeys([*native, *compat])))

    @functools.cached_property  # read by every poll's status
    def profiling(self) -> list[int]:
        return [f for f in self.watched if f in self.profiling_ids]

    def device_groups(self) -> list[list[int]]:
        """The device fields in field groups DCGM accepts, the NVML index first: the
        profiling fields need groups of their own (DCGM drops a refused group's watch)."""
        skip = self.profiling_ids | {NVML_INDEX}
        ids = [NVML_INDEX, *(f for f in self.watched if f not in skip)]
        return [ids[i : i + MAX_FIELDS_PER_GROUP] for i in range(0, len(ids), MAX_FIELDS_PER_GROUP)]

    def classified(self, profiling: frozenset[int]) -> FieldPlan:
        """This plan with the bindings' own profiling fields (profiling_ids)."""
        return replace(self, profiling_ids=profiling)

    def without(self, ids: Iterable[int]) -> FieldPlan:
        drop = set(ids)
        return replace(
            self,
            native=tuple(f for f in self.native if f not in drop),
            watched=tuple(f for f in self.watched if f not in drop),
        )


# The entity level of the fields below the GPU's, as DCGM's field table gives it
# (dcgm_fields.cpp: the same in 3.3.9 and 4.6): for bindings whose field metadata lacks it
# (DCGM 3.x's c_dcgm_field_meta_t has no entityLevel, though libdcgm's struct does).
ENTITY_LEVELS = {
    **dict.fromkeys((50, 54, 68, 90, 92, 93, 230, 250, 251, 252, 253, 254), FE_GPU_CI),
    **dict.fromkeys((1001, 1002, 1003, 1004, 1006, 1007, 1008, 1013, 1014, 1015, 1016), FE_GPU_CI),
    1005: FE_GPU_I,  # DRAM: a GPU instance's memory, shared by its compute instances
}


def entity_level(dcgm_fields: Any, fid: int) -> int | None:
    """The entity group at which DCGM answers field `fid` itself (DCGM_FE_*), from DCGM's
    own metadata where the bindings carry it, else from ENTITY_LEVELS; None: unknown field."""
    meta = dcgm_fields.DcgmFieldGetById(fid)
    if meta is None:
        return None
    level = getattr(meta, "entityLevel", None)
    return ENTITY_LEVELS.get(fid, FE_GPU) if level is None else int(level)


def instance_level(dcgm_fields: Any, ids: Iterable[int]) -> frozenset[int]:
    """The fields of `ids` a MIG GPU instance answers itself: DCGM gives them the entity
    level GPU_I or GPU_CI (the profiling ratios 1001-1008 and the tensor pipes, and among
    the device fields the framebuffer 250-254 and the last Xid 230; PCIe and NVLink bytes
    are the GPU's). Any other field read on a GPU instance is its GPU's value (DCGM
    remaps it) or blank."""
    return frozenset(f for f in ids if entity_level(dcgm_fields, f) in (FE_GPU_I, FE_GPU_CI))


def not_numbers(dcgm_fields: Any, ids: Iterable[int]) -> dict[int, str]:
    """Why DCGM cannot give each field of `ids` as a number, by id, from DCGM's own field
    metadata (the client library's): the config only knows DCGM 4.6's text fields."""
    problems = {}
    for fid in ids:
        meta = dcgm_fields.DcgmFieldGetById(fid)
        if meta is None:
            problems[fid] = f"{fid}: unknown to this DCGM"
            continue
        kind = meta.fieldType
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind not in NUMERIC_TYPES:
            problems[fid] = f"{fid} ({meta.tag}): a {TYPE_NAMES.get(kind, repr(kind))} field"
    return problems


# -- metrics ----------------------------------------------------------------------------


_gpu = gpu_gauge


def _gpu_counter(
    name: str, help: str, extra: tuple[str, ...] = (), export: Export = "nonzero", **kw: Any
) -> MetricSpec:
    """A counter of rare events (errors, violations): shown from its first event."""
    return gpu_counter(name, help, extra, export, **kw)


STATE = gauge(
    "dcgm_state",
    "1 for the DCGM source's current state, 0 for the others.",
    ("state",),
    export="nonzero",
    budget=1,
)
INFO = gauge("dcgm_info", "DCGM in use; always 1.", ("version",), export="detail")
LOSSES = counter(
    "dcgm_connection_losses_total",
    "Times a connected DCGM session broke (host engine restarts).",
    export="nonzero",
)
PAUSE_REMAINING = gauge(
    "dcgm_profiling_pause_remaining_seconds",
    "Time left in a requested profiling pause.",
    export="nonzero",
)
PROFILING_STATE = _gpu(
    "gpu_dcgm_profiling_state",
    "1 for the GPU's DCGM profiling state (active, paused, unsupported, refused), else 0.",
    ("state",),
    export="detail",
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


def _ratio(name: str, help: str, export: Export = "always") -> MetricSpec:
    return _gpu(name, help + " (0-1, DCGM profiling).", export=export)


# what NVML's utilization, sm_active and tensor_active already say, and the pipes no rule
# names: kept for the rules and detail_metrics (issue 46: ~24 series a GPU)
GR_ENGINE = _ratio(
    "gpu_gr_engine_active_ratio", "Fraction of time the graphics engine was busy", "detail"
)
SM_ACTIVE = _ratio("gpu_sm_active_ratio", "Fraction of cycles an SM had at least one warp")
SM_OCCUPANCY = _ratio(
    "gpu_sm_occupancy_ratio", "Resident warps per SM over the maximum", "detail"
)
TENSOR = _ratio("gpu_tensor_active_ratio", "Fraction of cycles a tensor pipe was active")
DRAM = _ratio("gpu_dram_active_ratio", "Fraction of cycles device memory was sending or receiving")
FP64 = _ratio("gpu_fp64_active_ratio", "Fraction of cycles the FP64 pipe was active", "detail")
FP32 = _ratio("gpu_fp32_active_ratio", "Fraction of cycles the FP32 pipe was active", "detail")
FP16 = _ratio("gpu_fp16_active_ratio", "Fraction of cycles the FP16 pipe was active", "detail")
PCIE_TX = _gpu(
    "gpu_dcgm_pcie_tx_bytes_per_second",
    "PCIe transmit rate, headers included (DCGM).",
    export="detail",
)
PCIE_RX = _gpu(
    "gpu_dcgm_pcie_rx_bytes_per_second",
    "PCIe receive rate, headers included (DCGM).",
    export="detail",
)
NVLINK_TX = _gpu("gpu_nvlink_tx_bytes_per_second", "NVLink transmit rate, all links (DCGM).")
NVLINK_RX = _gpu("gpu_nvlink_rx_bytes_per_second", "NVLink receive rate, all links (DCGM).")
POWER = _gpu("gpu_dcgm_power_watts", "Power draw (DCGM).", export="detail")
ENERGY = _gpu_counter(
    "gpu_dcgm_energy_joules_total", "Energy used since the driver loaded.", export="detail"
)
REPLAYS = _gpu_counter("gpu_dcgm_pcie_replay_errors_total", "PCIe replays (DCGM).")
LAST_XID = _gpu(
    "gpu_dcgm_last_xid", "The last Xid error DCGM saw on the GPU; 0 if none.", export="nonzero"
)
VIOLATION = _gpu_counter(
    "gpu_dcgm_clock_violation_seconds_total",
    "Time the clocks were held below the requested ones, by reason.",
    ("reason",),
    budget=1,
)
NVLINK_ERRORS = _gpu_counter(
    "gpu_dcgm_nvlink_errors_total", "NVLink errors, all links, by type.", ("type",)
)
REMAPPED_ROWS = _gpu_counter(
    "gpu_dcgm_remapped_rows_total", "Memory rows remapped, by error type.", ("type",)
)
REMAP_FAILED = _gpu(
    "gpu_dcgm_row_remap_failed", "1 if a row remapping has failed.", export="nonzero"
)
SM_CLOCK = _gpu("gpu_dcgm_sm_clock_hertz", "SM clock (DCGM).", export="detail")
MEM_CLOCK = _gpu("gpu_dcgm_memory_clock_hertz", "Memory clock (DCGM).", export="detail")
MEM_TEMP = _gpu("gpu_dcgm_memory_temperature_celsius", "Memory temperature (DCGM).")
GPU_TEMP = _gpu("gpu_dcgm_temperature_celsius", "GPU temperature (DCGM).", export="detail")
UTIL = _gpu(
    "gpu_dcgm_utilization_ratio", "Fraction of time a kernel was running (DCGM).", export="detail"
)
MEM_UTIL = _gpu(
    "gpu_dcgm_memory_copy_utilization_ratio", "Fraction of time memory was copied.", export="detail"
)
ENC_UTIL = _gpu("gpu_dcgm_encoder_utilization_ratio", "Video encoder utilization (DCGM).")
DEC_UTIL = _gpu("gpu_dcgm_decoder_utilization_ratio", "Video decoder utilization (DCGM).")
FB = _gpu(
    "gpu_dcgm_framebuffer_bytes",
    "Device memory by use: used, free, reserved.",
    ("state",),
    export="detail",
)
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

# The per-MIG-GPU-instance form (gpuwatchd_gpu_instance_*) of each profiling family a GPU
# instance answers (instance_level): same meaning and unit as the GPU's (docs/mig.md)
# Shown: what a rule or panel reads per instance; the graphics engine's activity is shown
# as the instance's utilization (below: the same value), the FP pipes only as detail (up
# to 7 instances a GPU: every series is paid for by the fleet's Prometheus)
_DETAIL_PER_INSTANCE = (1001, 1006, 1007, 1008)
INSTANCE_SPECS: dict[int, MetricSpec] = {
    fid: instance_form(spec, export="detail" if fid in _DETAIL_PER_INSTANCE else None)
    for fid in range(1001, 1009)
    if (spec := FIELD_MAPS[fid].spec) is not None
}
# NVML has no utilization on a MIG GPU or its instances. An instance's graphics engine
# activity (1001) is the same physics, the share of time a kernel ran (dcgm-exporter's
# stand-in for DCGM_FI_DEV_GPU_UTIL on MIG): the instance's utilization, so the rules
# that judge a workload by it judge an instance's (docs/mig.md)
INSTANCE_UTILIZATION = instance_form(
    UTILIZATION,
    "Fraction of time a kernel was running on the MIG GPU instance: DCGM's graphics "
    "engine activity of the instance (NVML has no utilization on MIG).",
)

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
# dcgm-exporter's GPU labels, then its MIG ones: a GPU instance's profile (DCGM_FI_DEV_NAME
# read on it, "1g.10gb") and NVML id; "" (no label, to Prometheus) on a whole GPU's series
COMPAT_GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName")
COMPAT_MIG_LABELS = ("GPU_I_PROFILE", "GPU_I_ID")
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
XID_LABELS = ("err_code", "err_msg")


def compat_specs(hostname_label: str = "Hostname") -> list[MetricSpec]:
    """dcgm-exporter's metric families, as gpuwatchd emits them with exporter_compat.

    dcgm-exporter declares some as counters without a _total suffix; the Python client
    cannot render that, so every compat family is a gauge here: the names, labels and
    values are dcgm-exporter's, and PromQL (rate, increase) treats them the same.
    """
    labels = (*COMPAT_GPU_LABELS, *COMPAT_MIG_LABELS, hostname_label, DRIVER_LABEL)
    return [
        MetricSpec(m.compat, m.compat_help, labels + (XID_LABELS if m.id == 230 else ()))
        for m in FIELD_MAPS.values()
        if m.compat
    ]
