"""DCGM's side of the simulated DCGM: return codes, limits, blank sentinels, the field table.

What the simulated host engine and client library share: DCGM's constants (as in
dcgm_structs.h), the fields it serves with their types and tags (as in dcgm_fields.cpp),
the profiling metric groups an Ampere/Hopper part reports, and how scenario values map
to profiling ratios and violation time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VERSIONS = {"4": "4.2.3", "3": "3.3.9"}

# dcgmReturn_t (dcgm_structs.h)
ST_OK = 0
ST_BADPARAM = -1
ST_GENERIC_ERROR = -3
ST_NOT_CONFIGURED = -5
ST_NOT_SUPPORTED = -6
ST_INIT_ERROR = -7
ST_UNINITIALIZED = -10
ST_VER_MISMATCH = -12
ST_UNKNOWN_FIELD = -13
ST_NO_DATA = -14
ST_NOT_WATCHED = -16
ST_GPU_IS_LOST = -18
ST_CONNECTION_NOT_VALID = -21
ST_MAX_LIMIT = -24
ST_DUPLICATE_KEY = -26
ST_IN_USE = -34
ST_GROUP_IS_EMPTY = -35
ST_PROFILING_NOT_SUPPORTED = -36
ST_INSTANCE_NOT_FOUND = -45

# Blank sentinels (dcgmvalue.py / dcgm_structs.h)
INT64_BLANK = 0x7FFFFFFFFFFFFFF0
FP64_BLANK = 140737488355328.0
STR_BLANK = "<<<NULL>>>"
NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED = 1, 2, 3  # offsets from the blank base

FE_GPU = 1
FE_GPU_I, FE_GPU_CI = 4, 5  # MIG GPU instances and compute instances
GROUP_DEFAULT = 0
GROUP_EMPTY = 1
GROUP_ALL_GPUS = 0x7FFFFFFF
MAX_STR_LENGTH = 256
MAX_BLOB_LENGTH = 4096
MAX_NUM_DEVICES = 32  # DCGM_MAX_NUM_DEVICES: GPUs one host engine handles
MAX_NUM_GROUPS = 64
MAX_FIELD_IDS_PER_FIELD_GROUP = 128  # the array size: a field group holds at most 127
MAX_NUM_FIELD_GROUPS = 64
REAL_TIME_RESOLUTION = 0.05  # real-time clocks: sample times are quantized to this

VBIOS = "92.00.45.00.03"
SUPPORTED_CLOCKS_BLOB = bytes(range(16))  # a binary field's value: some struct's bytes


def brand(datacenter: bool) -> str:
    return "NVIDIA" if datacenter else "GeForce"


def serial(gpu: int) -> str:
    return f"{1560000000000 + gpu}"


# Hopper and newer read profiling metrics through GPM: no pause/resume (DCGM_ST_NOT_SUPPORTED)
GPM_PCI_DEVICE_IDS = frozenset({0x2330})
FB_RESERVED_FRACTION = 0.0068  # what the driver keeps for itself (A100 80GB: ~557 MiB)


@dataclass(frozen=True)
class FieldInfo:
    id: int
    tag: str  # as in DCGM's field table
    type: str  # DCGM_FT_*: "d" double, "i" int64, "s" string, "b" binary (a blob)
    profiling: bool = False


def is_profiling(fid: int) -> bool:
    """DCGM_FIELD_ID_IS_PROF_FIELD (dcgm_fields_internal.hpp, DCGM 4.6): the ids DCGM hands
    to its profiling module, whose refusal drops the watch of a whole field group."""
    return 1001 <= fid <= 1096 or fid in (1532, 1533)


def _fields(*rows: tuple[int, str, str]) -> dict[int, FieldInfo]:
    return {fid: FieldInfo(fid, tag, ft, is_profiling(fid)) for fid, tag, ft in rows}


# Per-link NVLink counters (tag prefix: field ids of links 0-5, 6-11, 12-14 and 15-17)
NVLINK_LINK_FIELDS = {
    "nvlink_flit_crc_error_count": (400, 451, 406, 481),
    "nvlink_data_crc_error_count": (410, 457, 416, 484),
    "nvlink_replay_error_count": (420, 463, 426, 487),
    "nvlink_recovery_error_count": (430, 469, 436, 491),
    "nvlink_throughput": (440, 475, 446, 494),  # KiB, like 449 (all links)
}
NVLINK_MAX_LINKS = 18


def nvlink_link_field(kind: str, link: int) -> int:
    """The field id of one NVLink link's counter (DCGM numbered links 12-17 later)."""
    starts = NVLINK_LINK_FIELDS[kind]
    for first, start in zip((15, 12, 6, 0), reversed(starts), strict=True):
        if link >= first:
            return start + link - first
    raise ValueError(link)


def _nvlink_link_fields() -> list[tuple[int, str, str]]:
    return [
        (nvlink_link_field(kind, link), f"{kind}_l{link}", "i")
        for kind in NVLINK_LINK_FIELDS
        for link in range(NVLINK_MAX_LINKS)
    ]


FIELDS: dict[int, FieldInfo] = _fields(
    (1, "driver_version", "s"),
    (2, "nvml_version", "s"),
    (4, "device_count", "i"),
    (50, "name", "s"),
    (51, "brand", "s"),
    (52, "nvml_index", "i"),
    (53, "serial_number", "s"),
    (54, "uuid", "s"),
    (57, "pci_busid", "s"),
    (85, "vbios_version", "s"),
    (100, "sm_clock", "i"),
    (101, "memory_clock", "i"),
    (130, "supported_clocks", "b"),
    (140, "memory_temp", "i"),
    (150, "gpu_temp", "i"),
    (155, "power_usage", "d"),
    (156, "total_energy_consumption", "i"),
    (190, "pstate", "i"),
    (200, "pcie_tx_throughput", "i"),
    (201, "pcie_rx_throughput", "i"),
    (202, "pcie_replay_counter", "i"),
    (203, "gpu_utilization", "i"),
    (204, "mem_copy_utilization", "i"),
    (206, "enc_utilization", "i"),
    (207, "dec_utilization", "i"),
    (230, "xid_errors", "i"),
    (240, "power_violation", "i"),
    (241, "thermal_violation", "i"),
    (242, "sync_boost_violation", "i"),
    (243, "board_limit_violation", "i"),
    (244, "low_util_violation", "i"),
    (245, "reliability_violation", "i"),
    (250, "fb_total", "i"),
    (251, "fb_free", "i"),
    (252, "fb_used", "i"),
    (253, "fb_resv", "i"),
    (310, "ecc_sbe_volatile_total", "i"),
    (311, "ecc_dbe_volatile_total", "i"),
    (312, "ecc_sbe_aggregate_total", "i"),
    (313, "ecc_dbe_aggregate_total", "i"),
    (390, "retired_pages_sbe", "i"),
    (391, "retired_pages_dbe", "i"),
    (392, "retired_pages_pending", "i"),
    (393, "uncorrectable_remapped_rows", "i"),
    (394, "correctable_remapped_rows", "i"),
    (395, "row_remap_failure", "i"),
    (396, "row_remap_pending", "i"),
    (409, "nvlink_flit_crc_error_count_total", "i"),
    (419, "nvlink_data_crc_error_count_total", "i"),
    (429, "nvlink_replay_error_count_total", "i"),
    (439, "nvlink_recovery_error_count_total", "i"),
    (449, "nvlink_throughput_total", "i"),
    (526, "vgpu_instance_license_status", "i"),
    (1001, "gr_engine_active", "d"),
    (1002, "sm_active", "d"),
    (1003, "sm_occupancy", "d"),
    (1004, "tensor_active", "d"),
    (1005, "dram_active", "d"),
    (1006, "fp64_active", "d"),
    (1007, "fp32_active", "d"),
    (1008, "fp16_active", "d"),
    (1009, "pcie_tx_bytes", "i"),
    (1010, "pcie_rx_bytes", "i"),
    (1011, "nvlink_tx_bytes", "i"),
    (1012, "nvlink_rx_bytes", "i"),
    (1013, "tensor_imma_active", "d"),
    (1014, "tensor_hmma_active", "d"),
    *_nvlink_link_fields(),
)
TAGS = {info.tag: fid for fid, info in FIELDS.items()}
# The entity level of the served fields below GPU level (dcgm_fields.cpp, 3.3.9 and 4.6
# alike): what a MIG GPU instance answers itself; every other field is the GPU's
# (PCIe/NVLink bytes too). Among the device fields: the name and UUID, the framebuffer
# (250-253: the instance's MIG device's memory) and the last Xid (230: the instance's).
FIELD_LEVELS = {
    **dict.fromkeys((50, 54, 230, 250, 251, 252, 253), FE_GPU_CI),
    **dict.fromkeys((1001, 1002, 1003, 1004, 1006, 1007, 1008, 1013, 1014), FE_GPU_CI),
    1005: FE_GPU_I,  # DRAM: a GPU instance's memory is shared by its compute instances
}

# Profiling metric groups (majorId, minorId, field ids) as an Ampere/Hopper part reports
# them; the minor groups of one major id need separate passes (DCGM multiplexes them).
METRIC_GROUPS: tuple[tuple[int, int, tuple[int, ...]], ...] = (
    (0, 1, (1002, 1003, 1004, 1007)),
    (0, 2, (1006,)),
    (0, 3, (1008,)),
    (1, 0, (1005,)),
    (2, 0, (1009, 1010)),
    (3, 0, (1001,)),
    (4, 0, (1011, 1012)),
    (0, 4, (1013,)),  # the integer and half-precision tensor pipes
    (0, 5, (1014,)),
)
NVLINK_PROFILING_FIELDS = frozenset({1011, 1012})

# clock event reasons (scenario names) that count as time in each violation field
VIOLATIONS: dict[int, frozenset[str]] = {
    240: frozenset({"sw_power_cap", "hw_power_brake_slowdown"}),
    241: frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"}),
    242: frozenset({"sync_boost"}),
    243: frozenset(),
    244: frozenset({"gpu_idle"}),
    245: frozenset(),
}


def blank(field_type: str, offset: int = 0) -> Any:
    """DCGM's blank sentinel for a field type, plus NOT_FOUND/NOT_SUPPORTED/... offset."""
    if field_type == "d":
        return FP64_BLANK + offset
    if field_type in "sb":  # a blob has no sentinel: its status says why it is missing
        return {0: STR_BLANK, 1: "<<<NOT_FOUND>>>", 2: "<<<NOT_SUPPORTED>>>"}.get(
            offset, "<<<NOT_PERM>>>"
        )
    return INT64_BLANK + offset


def profiling_defaults(values: dict[str, Any]) -> dict[str, float]:
    """Profiling ratios the scenario left unset, derived from NVML's utilization.

    gr_engine_active follows utilization_gpu, sm_active is 90 % of it and sm_occupancy
    half of that, dram_active follows utilization_memory; pipes stay at 0. Scenarios
    about kernels (a hung collective, a memory-bound job) set these values explicitly.
    """
    gr = float(values.get("utilization_gpu") or 0.0) / 100
    sm = 0.9 * gr
    return {
        "gr_engine_active": gr,
        "sm_active": sm,
        "sm_occupancy": 0.5 * sm,
        "tensor_active": 0.0,
        "dram_active": float(values.get("utilization_memory") or 0.0) / 100,
        "fp64_active": 0.0,
        "fp32_active": 0.0,
        "fp16_active": 0.0,
    }


PROFILING_VALUES = {
    1001: "gr_engine_active",
    1002: "sm_active",
    1003: "sm_occupancy",
    1004: "tensor_active",
    1005: "dram_active",
    1006: "fp64_active",
    1007: "fp32_active",
    1008: "fp16_active",
    1014: "tensor_active",  # HMMA: the half-precision tensor work training runs
}


class Status(Exception):
    """A dcgmReturn_t raised inside the host engine, answered by the library symbol."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code
