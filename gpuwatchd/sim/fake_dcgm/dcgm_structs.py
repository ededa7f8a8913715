"""Fake DCGM bindings: dcgm_structs, the constants, structs and errors of dcgm_structs.h.

Same names and layouts as DCGM's module for what gpuwatchd and the pydcgm classes use.
One difference: `_LoadDcgmLibrary` does not open libdcgm.so.4 with ctypes; it asks the
simulator (`_sim.load_library`) for a fake client library with the same C symbols.
"""

import ctypes
import string
import sys
import threading
from ctypes import (
    Structure,
    Union,
    c_char,
    c_double,
    c_int,
    c_int64,
    c_short,
    c_uint,
    c_uint16,
    c_uint32,
    c_ushort,
    c_void_p,
    sizeof,
)

import _sim
import dcgmvalue  # noqa: F401 - imported by the real module too

DCGM_MAX_STR_LENGTH = 256
DCGM_MAX_NUM_DEVICES = 32
DCGM_MAX_NUM_SWITCHES = 12
DCGM_NVLINK_MAX_LINKS_PER_GPU = 18
DCGM_MAX_CLOCKS = 256
DCGM_MAX_NUM_GROUPS = 64
DCGM_MAX_BLOB_LENGTH = 4096
DCGM_GROUP_MAX_ENTITIES_V2 = 1024
DCGM_MAX_FIELD_IDS_PER_FIELD_GROUP = 128
DCGM_MAX_NUM_FIELD_GROUPS = 64
DCGM_PROF_MAX_NUM_GROUPS_V2 = 10
DCGM_PROF_MAX_FIELD_IDS_PER_GROUP_V2 = 64

DCGM_OPERATION_MODE_AUTO = 1
DCGM_OPERATION_MODE_MANUAL = 2

DCGM_GROUP_DEFAULT = 0
DCGM_GROUP_EMPTY = 1
DCGM_GROUP_DEFAULT_NVSWITCHES = 2
DCGM_GROUP_DEFAULT_INSTANCES = 3
DCGM_GROUP_DEFAULT_COMPUTE_INSTANCES = 4
DCGM_GROUP_DEFAULT_ENTITIES = 5

DCGM_GROUP_ALL_GPUS = 0x7FFFFFFF
DCGM_GROUP_ALL_NVSWITCHES = 0x7FFFFFFE
DCGM_GROUP_ALL_INSTANCES = 0x7FFFFFFD
DCGM_GROUP_ALL_COMPUTE_INSTANCES = 0x7FFFFFFC
DCGM_GROUP_ALL_ENTITIES = 0x7FFFFFFB
DCGM_GROUP_NULL = 0x7FFFFFFA

DCGM_GEGE_FLAG_ONLY_SUPPORTED = 0x00000001
DCGM_FV_FLAG_LIVE_DATA = 0x00000001

# dcgmReturn_t
DCGM_ST_OK = 0
DCGM_ST_BADPARAM = -1
DCGM_ST_GENERIC_ERROR = -3
DCGM_ST_MEMORY = -4
DCGM_ST_NOT_CONFIGURED = -5
DCGM_ST_NOT_SUPPORTED = -6
DCGM_ST_INIT_ERROR = -7
DCGM_ST_NVML_ERROR = -8
DCGM_ST_PENDING = -9
DCGM_ST_UNINITIALIZED = -10
DCGM_ST_TIMEOUT = -11
DCGM_ST_VER_MISMATCH = -12
DCGM_ST_UNKNOWN_FIELD = -13
DCGM_ST_NO_DATA = -14
DCGM_ST_STALE_DATA = -15
DCGM_ST_NOT_WATCHED = -16
DCGM_ST_NO_PERMISSION = -17
DCGM_ST_GPU_IS_LOST = -18
DCGM_ST_RESET_REQUIRED = -19
DCGM_ST_FUNCTION_NOT_FOUND = -20
DCGM_ST_CONNECTION_NOT_VALID = -21
DCGM_ST_GPU_NOT_SUPPORTED = -22
DCGM_ST_GROUP_INCOMPATIBLE = -23
DCGM_ST_MAX_LIMIT = -24
DCGM_ST_LIBRARY_NOT_FOUND = -25
DCGM_ST_DUPLICATE_KEY = -26
DCGM_ST_GPU_IN_SYNC_BOOST_GROUP = -27
DCGM_ST_GPU_NOT_IN_SYNC_BOOST_GROUP = -28
DCGM_ST_REQUIRES_ROOT = -29
DCGM_ST_NVVS_ERROR = -30
DCGM_ST_INSUFFICIENT_SIZE = -31
DCGM_ST_FIELD_UNSUPPORTED_BY_API = -32
DCGM_ST_MODULE_NOT_LOADED = -33
DCGM_ST_IN_USE = -34
DCGM_ST_GROUP_IS_EMPTY = -35
DCGM_ST_PROFILING_NOT_SUPPORTED = -36
DCGM_ST_PROFILING_LIBRARY_ERROR = -37
DCGM_ST_PROFILING_MULTI_PASS = -38
DCGM_ST_DIAG_ALREADY_RUNNING = -39
DCGM_ST_DIAG_BAD_JSON = -40
DCGM_ST_DIAG_BAD_LAUNCH = -41
DCGM_ST_DIAG_UNUSED = -42
DCGM_ST_DIAG_THRESHOLD_EXCEEDED = -43
DCGM_ST_INSUFFICIENT_DRIVER_VERSION = -44
DCGM_ST_INSTANCE_NOT_FOUND = -45
DCGM_ST_COMPUTE_INSTANCE_NOT_FOUND = -46
DCGM_ST_CHILD_NOT_KILLED = -47
DCGM_ST_3RD_PARTY_LIBRARY_ERROR = -48
DCGM_ST_INSUFFICIENT_RESOURCES = -49
DCGM_ST_PLUGIN_EXCEPTION = -50
DCGM_ST_NVVS_ISOLATE_ERROR = -51
DCGM_ST_NVVS_BINARY_NOT_FOUND = -52
DCGM_ST_NVVS_KILLED = -53
DCGM_ST_PAUSED = -54
DCGM_ST_ALREADY_INITIALIZED = -55
DCGM_ST_NVML_NOT_LOADED = -56
DCGM_ST_NVML_DRIVER_TIMEOUT = -57

_MESSAGES = {
    DCGM_ST_OK: "Success",
    DCGM_ST_BADPARAM: "Bad parameter passed to function",
    DCGM_ST_GENERIC_ERROR: "Generic unspecified error",
    DCGM_ST_NOT_CONFIGURED: "Setting not configured",
    DCGM_ST_NOT_SUPPORTED: "Feature not supported",
    DCGM_ST_INIT_ERROR: "DCGM initialization error",
    DCGM_ST_UNINITIALIZED: "Object is in an undefined state",
    DCGM_ST_TIMEOUT: "Timeout",
    DCGM_ST_VER_MISMATCH: "API version mismatch",
    DCGM_ST_UNKNOWN_FIELD: "Unknown field",
    DCGM_ST_NO_DATA: "No data is available",
    DCGM_ST_NOT_WATCHED: "Field is not being updated",
    DCGM_ST_NO_PERMISSION: "Not permissioned",
    DCGM_ST_GPU_IS_LOST: "GPU is unreachable",
    DCGM_ST_FUNCTION_NOT_FOUND: "Unable to find function",
    DCGM_ST_CONNECTION_NOT_VALID: "The connection to the host engine is not valid any longer",
    DCGM_ST_MAX_LIMIT: "Max limit reached for the object",
    DCGM_ST_LIBRARY_NOT_FOUND: "DCGM library could not be found",
    DCGM_ST_DUPLICATE_KEY: "Duplicate key passed to function",
    DCGM_ST_REQUIRES_ROOT: "This operation is not supported when the host engine is "
    "running as non root",
    DCGM_ST_MODULE_NOT_LOADED: "This request is serviced by a module of DCGM that is not "
    "currently loaded",
    DCGM_ST_IN_USE: "The requested operation could not be completed because the affected "
    "resource is in use",
    DCGM_ST_GROUP_IS_EMPTY: "The specified group is empty, and this operation is "
    "incompatible with an empty group",
    DCGM_ST_PROFILING_NOT_SUPPORTED: "Profiling is not supported for this group of GPUs or GPU",
    DCGM_ST_PROFILING_LIBRARY_ERROR: "The third-party Profiling module returned an "
    "unrecoverable error",
    DCGM_ST_PROFILING_MULTI_PASS: "The requested profiling metrics cannot be collected in a "
    "single pass",
    DCGM_ST_NVML_NOT_LOADED: "NVML couldn't be loaded on this system",
}

# Library loading state
dcgmLib = None
libLoadLock = threading.Lock()
_dcgmLib_refcount = 0


class DCGMError(Exception):
    """A DCGM return code; `DCGMError(code)` makes the code's subclass."""

    _valClassMapping: dict = {}
    _error_code_to_string = dict(_MESSAGES)
    value: int
    info: object

    def __new__(typ, value):
        if typ is DCGMError:
            typ = DCGMError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.info = None
        obj.value = value
        return obj

    def __init__(self, value=None):
        super().__init__(self.value)

    def __str__(self):
        msg = DCGMError._error_code_to_string.get(self.value)
        if msg is None:
            try:
                msg = _dcgmErrorString(self.value)
                msg = msg.decode() if isinstance(msg, bytes) else str(msg)
            except BaseException:
                msg = f"DCGM Error with code {self.value}"
        if self.info is not None:
            msg = f"{msg.rstrip('.')}: '{self.info}'"
        return msg

    def __eq__(self, other):
        return isinstance(other, DCGMError) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def SetAdditionalInfo(self, msg):
        self.info = msg


def dcgmExceptionClass(error_code):
    return DCGMError._valClassMapping.get(error_code)


def _extractDCGMErrorsAsClasses():
    """One DCGMError subclass per DCGM_ST_* code: DCGM_ST_IN_USE -> DCGMError_InUse."""
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("DCGM_ST_")]:
        code = getattr(module, name)
        class_name = "DCGMError_" + string.capwords(name[len("DCGM_ST_") :], "_").replace("_", "")

        def new(typ, _code=code):
            return DCGMError.__new__(typ, _code)

        cls = type(class_name, (DCGMError,), {"__new__": new})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        DCGMError._valClassMapping[code] = cls


_extractDCGMErrorsAsClasses()


# -- library access ---------------------------------------------------------------------------

_dcgmGetFunctionPointer_cache: dict = {}


def _dcgmGetFunctionPointer(name):
    if name in _dcgmGetFunctionPointer_cache:
        return _dcgmGetFunctionPointer_cache[name]
    with libLoadLock:
        if dcgmLib is None:
            raise DCGMError(DCGM_ST_UNINITIALIZED)
        try:
            function = getattr(dcgmLib, name)
        except AttributeError:
            raise DCGMError(DCGM_ST_FUNCTION_NOT_FOUND) from None
        _dcgmGetFunctionPointer_cache[name] = function
        return function


def _LoadDcgmLibrary(libDcgmPath=None):
    """Load the (fake) client library once."""
    global dcgmLib
    if dcgmLib is not None:
        return
    with libLoadLock:
        if dcgmLib is None:
            dcgmLib = _sim.load_library(libDcgmPath)
    if dcgmLib is None:
        _dcgmCheckReturn(DCGM_ST_LIBRARY_NOT_FOUND)


def _dcgmInit(libDcgmPath=None):
    global _dcgmLib_refcount
    _LoadDcgmLibrary(libDcgmPath)
    with libLoadLock:
        _dcgmLib_refcount += 1


def _dcgmCheckReturn(ret):
    if ret != DCGM_ST_OK:
        raise DCGMError(ret)
    return ret


def _dcgmShutdown():
    global _dcgmLib_refcount
    _dcgmCheckReturn(_dcgmGetFunctionPointer("dcgmShutdown")())
    with libLoadLock:
        if _dcgmLib_refcount > 0:
            _dcgmLib_refcount -= 1


def _dcgmErrorString(result):
    fn = _dcgmGetFunctionPointer("dcgmErrorString")
    fn.restype = ctypes.c_char_p
    return fn(result)


# -- structures ---------------------------------------------------------------------------------


def _decoded(value):
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _encoded(fields, key, value):
    if isinstance(value, str):
        return value.encode("utf-8")
    kind = next((t for name, t, *_ in fields if name == key), None)
    if kind in (c_uint, c_int) and not isinstance(value, (c_uint32, ctypes.c_int32)):
        return int(value)
    return value


class _DcgmStructure(Structure):
    """Strings read back as str and may be assigned as str."""

    def __getattribute__(self, key):
        return _decoded(super().__getattribute__(key))

    def __setattr__(self, key, value):
        super().__setattr__(key, _encoded(self._fields_, key, value))


class DcgmUnion(Union):
    def __getattribute__(self, key):
        return _decoded(super().__getattribute__(key))

    def __setattr__(self, key, value):
        super().__setattr__(key, _encoded(self._fields_, key, value))


class _PrintableStructure(_DcgmStructure):
    _fmt_: dict = {}

    def __str__(self):
        parts = []
        for name, *_ in self._fields_:
            fmt = self._fmt_.get(name, self._fmt_.get("<default>", "%s"))
            parts.append(("%s: " + fmt) % (name, getattr(self, name)))
        return f"{type(self).__name__}({', '.join(parts)})"

    def FieldsSizeof(self):
        return sum(sizeof(kind) for _, kind, *_ in self._fields_)


def make_dcgm_version(struct, ver):
    return sizeof(struct) | (ver << 24)


class c_dcgmConnectV2Params_v2(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("persistAfterDisconnect", c_uint),
        ("timeoutMs", c_uint),
        ("addressIsUnixSocket", c_uint),
    ]


c_dcgmConnectV2Params_version2 = make_dcgm_version(c_dcgmConnectV2Params_v2, 2)
c_dcgmConnectV2Params_version = c_dcgmConnectV2Params_version2


class c_dcgmConnectV3Params_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("persistAfterDisconnect", c_uint),
        ("timeoutMs", c_uint),
    ]


c_dcgmConnectV3Params_version1 = make_dcgm_version(c_dcgmConnectV3Params_v1, 1)
c_dcgmConnectV3Params_version = c_dcgmConnectV3Params_version1


class c_dcgmGroupEntityPair_t(_PrintableStructure):
    _fields_ = [("entityGroupId", c_uint32), ("entityId", c_uint32)]

    def __eq__(self, other):
        return (self.entityGroupId, self.entityId) == (other.entityGroupId, other.entityId)


class c_dcgmGroupInfo_v3(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("count", c_uint),
        ("groupName", c_char * DCGM_MAX_STR_LENGTH),
        ("entityList", c_dcgmGroupEntityPair_t * DCGM_GROUP_MAX_ENTITIES_V2),
    ]


c_dcgmGroupInfo_version3 = make_dcgm_version(c_dcgmGroupInfo_v3, 3)


class c_dcgmFieldGroupInfo_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint32),
        ("numFieldIds", c_uint32),
        ("fieldGroupId", c_void_p),
        ("fieldGroupName", c_char * DCGM_MAX_STR_LENGTH),
        ("fieldIds", c_uint16 * DCGM_MAX_FIELD_IDS_PER_FIELD_GROUP),
    ]


dcgmFieldGroupInfo_version1 = make_dcgm_version(c_dcgmFieldGroupInfo_v1, 1)


class c_dcgmAllFieldGroup_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint32),
        ("numFieldGroups", c_uint32),
        ("fieldGroups", c_dcgmFieldGroupInfo_v1 * DCGM_MAX_NUM_FIELD_GROUPS),
    ]


dcgmAllFieldGroup_version1 = make_dcgm_version(c_dcgmAllFieldGroup_v1, 1)


class c_dcgmClockSet_v1(_PrintableStructure):
    _fields_ = [("version", c_uint), ("memClock", c_uint), ("smClock", c_uint)]


class c_dcgmDeviceSupportedClockSets_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("count", c_uint),
        ("clockSet", c_dcgmClockSet_v1 * DCGM_MAX_CLOCKS),
    ]


class c_dcgmDeviceThermals_v1(_PrintableStructure):
    _fields_ = [("version", c_uint), ("slowdownTemp", c_uint), ("shutdownTemp", c_uint)]


class c_dcgmDevicePowerLimits_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("curPowerLimit", c_uint),
        ("defaultPowerLimit", c_uint),
        ("enforcedPowerLimit", c_uint),
        ("minPowerLimit", c_uint),
        ("maxPowerLimit", c_uint),
    ]


class c_dcgmDeviceIdentifiers_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("brandName", c_char * DCGM_MAX_STR_LENGTH),
        ("deviceName", c_char * DCGM_MAX_STR_LENGTH),
        ("pciBusId", c_char * DCGM_MAX_STR_LENGTH),
        ("serial", c_char * DCGM_MAX_STR_LENGTH),
        ("uuid", c_char * DCGM_MAX_STR_LENGTH),
        ("vbios", c_char * DCGM_MAX_STR_LENGTH),
        ("inforomImageVersion", c_char * DCGM_MAX_STR_LENGTH),
        ("pciDeviceId", c_uint32),
        ("pciSubSystemId", c_uint32),
        ("driverVersion", c_char * DCGM_MAX_STR_LENGTH),
        ("virtualizationMode", c_uint32),
    ]


class c_dcgmDeviceMemoryUsage_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("bar1Total", c_uint),
        ("fbTotal", c_uint),
        ("fbUsed", c_uint),
        ("fbFree", c_uint),
    ]


class c_dcgmDeviceSettings_v2(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("persistenceModeEnabled", c_uint),
        ("migModeEnabled", c_uint),
        ("confidentialComputeMode", c_uint),
    ]


class c_dcgmDeviceAttributes_v3(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("clockSets", c_dcgmDeviceSupportedClockSets_v1),
        ("thermalSettings", c_dcgmDeviceThermals_v1),
        ("powerLimits", c_dcgmDevicePowerLimits_v1),
        ("identifiers", c_dcgmDeviceIdentifiers_v1),
        ("memoryUsage", c_dcgmDeviceMemoryUsage_v1),
        ("settings", c_dcgmDeviceSettings_v2),
    ]


dcgmDeviceAttributes_version3 = make_dcgm_version(c_dcgmDeviceAttributes_v3, 3)


class c_dcgmFieldValue_v1_value(DcgmUnion):
    _fields_ = [
        ("i64", c_int64),
        ("dbl", c_double),
        ("str", c_char * DCGM_MAX_STR_LENGTH),
        ("blob", ctypes.c_byte * DCGM_MAX_BLOB_LENGTH),
    ]


class c_dcgmFieldValue_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("fieldId", c_ushort),
        ("fieldType", c_short),
        ("status", c_int),
        ("ts", c_int64),
        ("value", c_dcgmFieldValue_v1_value),
    ]


dcgmFieldValue_version1 = make_dcgm_version(c_dcgmFieldValue_v1, 1)


class c_dcgmFieldValue_v2(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("entityGroupId", c_uint),
        ("entityId", c_uint),
        ("fieldId", c_ushort),
        ("fieldType", c_short),
        ("status", c_int),
        ("unused", c_uint),
        ("ts", c_int64),
        ("value", c_dcgmFieldValue_v1_value),
    ]


dcgmFieldValue_version2 = make_dcgm_version(c_dcgmFieldValue_v2, 2)


class c_dcgmProfMetricGroupInfo_v2(_PrintableStructure):
    _fields_ = [
        ("majorId", c_ushort),
        ("minorId", c_ushort),
        ("numFieldIds", c_uint32),
        ("fieldIds", c_ushort * DCGM_PROF_MAX_FIELD_IDS_PER_GROUP_V2),
    ]


class c_dcgmProfGetMetricGroups_v3(_PrintableStructure):
    _fields_ = [
        ("version", c_uint32),
        ("unused", c_uint32),
        ("gpuId", c_uint32),
        ("numMetricGroups", c_uint32),
        ("metricGroups", c_dcgmProfMetricGroupInfo_v2 * DCGM_PROF_MAX_NUM_GROUPS_V2),
    ]


dcgmProfGetMetricGroups_version3 = make_dcgm_version(c_dcgmProfGetMetricGroups_v3, 3)


class c_dcgmVersionInfo_v2(_PrintableStructure):
    _fields_ = [
        ("version", c_uint32),
        ("rawBuildInfoString", c_char * (DCGM_MAX_STR_LENGTH * 2)),
    ]


dcgmVersionInfo_version2 = make_dcgm_version(c_dcgmVersionInfo_v2, 2)
dcgmVersionInfo_version = dcgmVersionInfo_version2


class c_dcgmHostengineHealth_v1(_PrintableStructure):
    _fields_ = [("version", c_uint), ("overallHealth", c_uint)]


dcgmHostengineHealth_version1 = make_dcgm_version(c_dcgmHostengineHealth_v1, 1)
dcgmHostengineHealth_version = dcgmHostengineHealth_version1


# MIG: dcgmGetGpuInstanceHierarchy's answer (dcgm_structs.h, DCGM 4.6): every GPU instance
# (entity DCGM_FE_GPU_I, parent the GPU) and compute instance (DCGM_FE_GPU_CI, parent its
# GPU instance) of every MIG-enabled GPU, GPU instances each followed by their CIs
DCGM_MAX_INSTANCES_PER_GPU = 8
DCGM_MAX_COMPUTE_INSTANCES_PER_GPU = DCGM_MAX_INSTANCES_PER_GPU
DCGM_MAX_TOTAL_INSTANCES = 14
DCGM_MAX_HIERARCHY_INFO = DCGM_MAX_NUM_DEVICES * DCGM_MAX_TOTAL_INSTANCES
DCGM_MAX_INSTANCES = DCGM_MAX_NUM_DEVICES * DCGM_MAX_INSTANCES_PER_GPU


class c_dcgmMigEntityInfo_t(_PrintableStructure):
    _fields_ = [
        ("gpuUuid", c_char * 128),
        ("nvmlGpuIndex", c_uint),
        ("nvmlInstanceId", c_uint),  # the GPU instance's NVML id (nvidia-smi's GI ID)
        ("nvmlComputeInstanceId", c_uint),  # 0xFFFFFFFF for a GPU instance
        ("nvmlMigProfileId", c_uint),
        ("nvmlProfileSlices", c_uint),
    ]


class c_dcgmMigHierarchyInfo_v2(_PrintableStructure):
    _fields_ = [
        ("entity", c_dcgmGroupEntityPair_t),
        ("parent", c_dcgmGroupEntityPair_t),
        ("info", c_dcgmMigEntityInfo_t),
    ]


class c_dcgmMigHierarchy_v2(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("count", c_uint),
        ("entityList", c_dcgmMigHierarchyInfo_v2 * DCGM_MAX_HIERARCHY_INFO),
    ]


c_dcgmMigHierarchy_version2 = make_dcgm_version(c_dcgmMigHierarchy_v2, 2)
