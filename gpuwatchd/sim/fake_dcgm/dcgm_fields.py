"""Fake DCGM bindings: dcgm_fields, field ids, types, entity groups and field metadata.

Field ids are DCGM's (stable across versions). Both the names used up to DCGM 4.5 (and
by dcgm-exporter) and the names DCGM 4.6 introduced are defined for the fields the
simulator serves. Metadata (DcgmFieldGetById/ByTag) comes from the client library.
Loaded from where DCGM 3 installs its bindings, c_dcgm_field_meta_t has DCGM 3.x's
layout (no entityLevel).
"""

from ctypes import (
    POINTER,
    addressof,
    c_char,
    c_char_p,
    c_int,
    c_short,
    c_ubyte,
    c_uint,
    c_uint32,
    memmove,
    sizeof,
)

import _sim
import dcgm_structs

# Field types
DCGM_FT_BINARY = "b"
DCGM_FT_DOUBLE = "d"
DCGM_FT_INT64 = "i"
DCGM_FT_STRING = "s"
DCGM_FT_TIMESTAMP = "t"

# Field scopes
DCGM_FS_GLOBAL = 0
DCGM_FS_ENTITY = 1
DCGM_FS_DEVICE = DCGM_FS_ENTITY

# Entity groups
DCGM_FE_NONE = 0
DCGM_FE_GPU = 1
DCGM_FE_VGPU = 2
DCGM_FE_SWITCH = 3
DCGM_FE_GPU_I = 4
DCGM_FE_GPU_CI = 5
DCGM_FE_LINK = 6
DCGM_FE_CPU = 7
DCGM_FE_CPU_CORE = 8

c_dcgm_field_eid_t = c_uint32

DCGM_FI_UNKNOWN = 0
DCGM_FI_DRIVER_VERSION = 1
DCGM_FI_NVML_VERSION = 2
DCGM_FI_DEV_COUNT = 4
DCGM_FI_DEV_NAME = 50
DCGM_FI_DEV_UUID = 54
DCGM_FI_DEV_PCI_BUSID = 57
DCGM_FI_DEV_SM_CLOCK = 100
DCGM_FI_DEV_MEM_CLOCK = 101
DCGM_FI_DEV_MEMORY_TEMP = 140
DCGM_FI_DEV_GPU_TEMP = 150
DCGM_FI_DEV_POWER_USAGE = 155
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 156
DCGM_FI_DEV_PSTATE = 190
DCGM_FI_DEV_PCIE_TX_THROUGHPUT = 200
DCGM_FI_DEV_PCIE_RX_THROUGHPUT = 201
DCGM_FI_DEV_PCIE_REPLAY_COUNTER = 202
DCGM_FI_DEV_GPU_UTIL = 203
DCGM_FI_DEV_MEM_COPY_UTIL = 204
DCGM_FI_DEV_ENC_UTIL = 206
DCGM_FI_DEV_DEC_UTIL = 207
DCGM_FI_DEV_XID_ERRORS = 230
DCGM_FI_DEV_POWER_VIOLATION = 240
DCGM_FI_DEV_THERMAL_VIOLATION = 241
DCGM_FI_DEV_SYNC_BOOST_VIOLATION = 242
DCGM_FI_DEV_BOARD_LIMIT_VIOLATION = 243
DCGM_FI_DEV_LOW_UTIL_VIOLATION = 244
DCGM_FI_DEV_RELIABILITY_VIOLATION = 245
DCGM_FI_DEV_FB_TOTAL = 250
DCGM_FI_DEV_FB_FREE = 251
DCGM_FI_DEV_FB_USED = 252
DCGM_FI_DEV_FB_RESERVED = 253
DCGM_FI_DEV_ECC_SBE_VOL_TOTAL = 310
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL = 311
DCGM_FI_DEV_ECC_SBE_AGG_TOTAL = 312
DCGM_FI_DEV_ECC_DBE_AGG_TOTAL = 313
DCGM_FI_DEV_RETIRED_SBE = 390
DCGM_FI_DEV_RETIRED_DBE = 391
DCGM_FI_DEV_RETIRED_PENDING = 392
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS = 393
DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS = 394
DCGM_FI_DEV_ROW_REMAP_FAILURE = 395
DCGM_FI_DEV_ROW_REMAP_PENDING = 396
DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 409
DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 419
DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 429
DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 439
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL = 449
DCGM_FI_DEV_VGPU_LICENSE_STATUS = 526
DCGM_FI_PROF_GR_ENGINE_ACTIVE = 1001
DCGM_FI_PROF_SM_ACTIVE = 1002
DCGM_FI_PROF_SM_OCCUPANCY = 1003
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE = 1004
DCGM_FI_PROF_DRAM_ACTIVE = 1005
DCGM_FI_PROF_PIPE_FP64_ACTIVE = 1006
DCGM_FI_PROF_PIPE_FP32_ACTIVE = 1007
DCGM_FI_PROF_PIPE_FP16_ACTIVE = 1008
DCGM_FI_PROF_PCIE_TX_BYTES = 1009
DCGM_FI_PROF_PCIE_RX_BYTES = 1010
DCGM_FI_PROF_NVLINK_TX_BYTES = 1011
DCGM_FI_PROF_NVLINK_RX_BYTES = 1012
DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE = 1013
DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE = 1014

# The names DCGM 4.6 gave the same ids
DCGM_FI_SYSTEM_DRIVER_VERSION = DCGM_FI_DRIVER_VERSION
DCGM_FI_DEV_GPU_TEMP_CELSIUS = DCGM_FI_DEV_GPU_TEMP
DCGM_FI_DEV_MEMORY_TEMP_CELSIUS = DCGM_FI_DEV_MEMORY_TEMP
DCGM_FI_DEV_BOARD_POWER_WATTS = DCGM_FI_DEV_POWER_USAGE
DCGM_FI_DEV_PCIE_REPLAY_TOTAL = DCGM_FI_DEV_PCIE_REPLAY_COUNTER
DCGM_FI_DEV_GPU_UTIL_RATIO = DCGM_FI_DEV_GPU_UTIL
DCGM_FI_DEV_XID_ERROR = DCGM_FI_DEV_XID_ERRORS
DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL = DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS
DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL = DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS
DCGM_FI_DEV_ROW_REMAP_FAILED = DCGM_FI_DEV_ROW_REMAP_FAILURE
DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL = DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_TOTAL = DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
DCGM_FI_DEV_NVLINK_REPLAY_ERROR_TOTAL = DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_TOTAL = DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL = DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL
DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO = DCGM_FI_PROF_GR_ENGINE_ACTIVE
DCGM_FI_PROF_SM_UTIL_RATIO = DCGM_FI_PROF_SM_ACTIVE
DCGM_FI_PROF_SM_OCCUPANCY_RATIO = DCGM_FI_PROF_SM_OCCUPANCY
DCGM_FI_PROF_TENSOR_UTIL_RATIO = DCGM_FI_PROF_PIPE_TENSOR_ACTIVE
DCGM_FI_PROF_DRAM_UTIL_RATIO = DCGM_FI_PROF_DRAM_ACTIVE
DCGM_FI_PROF_FP64_UTIL_RATIO = DCGM_FI_PROF_PIPE_FP64_ACTIVE
DCGM_FI_PROF_FP32_UTIL_RATIO = DCGM_FI_PROF_PIPE_FP32_ACTIVE
DCGM_FI_PROF_FP16_UTIL_RATIO = DCGM_FI_PROF_PIPE_FP16_ACTIVE
DCGM_FI_PROF_IMMA_UTIL_RATIO = DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE
DCGM_FI_PROF_HMMA_UTIL_RATIO = DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE

DCGM_FI_MAX_FIELDS = 1700

dcgmFP = dcgm_structs._dcgmGetFunctionPointer

SHORTNAME_LENGTH = 10
UNIT_LENGTH = 4
TAG_LENGTH = 48


class c_dcgm_field_output_format_t(dcgm_structs._PrintableStructure):
    _fields_ = [
        ("shortName", c_char * SHORTNAME_LENGTH),
        ("unit", c_char * UNIT_LENGTH),
        ("width", c_short),
    ]


_META_HEAD: list[tuple[str, type]] = [
    ("fieldId", c_short),
    ("fieldType", c_char),
    ("size", c_ubyte),
    ("tag", c_char * TAG_LENGTH),
    ("scope", c_int),
]
if _sim.bindings_major(__file__) == "3":
    # DCGM 3.x's bindings (to 3.3.9): no nvmlFieldId or entityLevel, and valueFormat
    # inline, though libdcgm's C struct has them (the same size: the copy reads them as
    # the format's first bytes). DCGM 4.0 added the two fields and made it a pointer.
    _META_TAIL: list[tuple[str, type]] = [("valueFormat", c_dcgm_field_output_format_t)]
else:
    _META_TAIL = [
        ("nvmlFieldId", c_int),
        ("entityLevel", c_uint),
        ("valueFormat", POINTER(c_dcgm_field_output_format_t)),
    ]


class c_dcgm_field_meta_t(dcgm_structs._PrintableStructure):
    _fields_ = _META_HEAD + _META_TAIL


def DcgmFieldsInit():
    ret = dcgmFP("DcgmFieldsInit")()
    assert ret == 0, f"Got return {ret} from DcgmFieldsInit"


def _copy_meta(pointer):
    if not pointer:
        return None
    meta = c_dcgm_field_meta_t()
    memmove(addressof(meta), pointer, sizeof(meta))
    return meta


def DcgmFieldGetById(fieldId):
    """Metadata (c_dcgm_field_meta_t) of a field id, or None."""
    DcgmFieldsInit()
    fn = dcgmFP("DcgmFieldGetById")
    fn.restype = POINTER(c_dcgm_field_meta_t)
    return _copy_meta(fn(fieldId))


def DcgmFieldGetByTag(tag):
    DcgmFieldsInit()
    fn = dcgmFP("DcgmFieldGetByTag")
    fn.restype = POINTER(c_dcgm_field_meta_t)
    return _copy_meta(fn(c_char_p(tag.encode("utf-8"))))


def DcgmFieldGetTagById(fieldId):
    field = DcgmFieldGetById(fieldId)
    return field.tag if field else None


def DcgmFieldGetIdByTag(fieldTag):
    field = DcgmFieldGetByTag(fieldTag)
    return field.fieldId if field else None
