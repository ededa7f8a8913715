"""Fake DCGM bindings: dcgm_agent, the C API as Python functions.

Each function builds the C arguments (ctypes structs with their version set, handles,
arrays), calls the library symbol through `dcgm_structs._dcgmGetFunctionPointer`,
turns a non-OK dcgmReturn_t into the matching DCGMError subclass and returns what
DCGM's Python bindings return.
"""

import functools
from ctypes import (
    CFUNCTYPE,
    POINTER,
    byref,
    c_double,
    c_int,
    c_int32,
    c_int64,
    c_uint,
    c_uint16,
    c_uint32,
    c_void_p,
    py_object,
)

import dcgm_fields
import dcgm_structs

dcgmFP = dcgm_structs._dcgmGetFunctionPointer
_check = dcgm_structs._dcgmCheckReturn


def ensure_byte_strings():
    """str arguments go to C as UTF-8 bytes; bytes results come back as str."""

    def decode(result):
        if isinstance(result, bytes):
            return result.decode("utf-8")
        if isinstance(result, (list, tuple)):
            return type(result)(decode(r) for r in result)
        return result

    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            args = tuple(a.encode("utf-8") if isinstance(a, str) else a for a in args)
            kwargs = {k: v.encode("utf-8") if isinstance(v, str) else v for k, v in kwargs.items()}
            return decode(fn(*args, **kwargs))

        return wrapper

    return decorator


# enumeration callbacks: (gpuId, values, count, userData) and (entityGroupId, entityId, ...)
dcgmFieldValueEnumeration_f = CFUNCTYPE(
    c_int32, c_uint32, POINTER(dcgm_structs.c_dcgmFieldValue_v1), c_int32, c_void_p
)
dcgmFieldValueEntityEnumeration_f = CFUNCTYPE(
    c_int32, c_uint32, c_uint32, POINTER(dcgm_structs.c_dcgmFieldValue_v1), c_int32, c_void_p
)


@ensure_byte_strings()
def dcgmInit():
    handle = c_void_p()
    return _check(dcgmFP("dcgmInit")(byref(handle)))


@ensure_byte_strings()
def dcgmShutdown():
    return _check(dcgmFP("dcgmShutdown")())


@ensure_byte_strings()
def dcgmStartEmbedded(opMode):
    handle = c_void_p()
    _check(dcgmFP("dcgmStartEmbedded")(opMode, byref(handle)))
    return handle


@ensure_byte_strings()
def dcgmStopEmbedded(dcgm_handle):
    return _check(dcgmFP("dcgmStopEmbedded")(dcgm_handle))


@ensure_byte_strings()
def dcgmConnect(ip_address):
    handle = c_void_p()
    _check(dcgmFP("dcgmConnect")(ip_address, byref(handle)))
    return handle


@ensure_byte_strings()
def dcgmConnect_v2(ip_address, connectParams, version=dcgm_structs.c_dcgmConnectV2Params_version):
    connectParams.version = version
    handle = c_void_p()
    _check(dcgmFP("dcgmConnect_v2")(ip_address, byref(connectParams), byref(handle)))
    return handle


@ensure_byte_strings()
def dcgmConnect_v3(
    connection_string, connectParams, version=dcgm_structs.c_dcgmConnectV3Params_version
):
    connectParams.version = version
    handle = c_void_p()
    _check(dcgmFP("dcgmConnect_v3")(connection_string, byref(connectParams), byref(handle)))
    return handle


@ensure_byte_strings()
def dcgmDisconnect(dcgm_handle):
    return _check(dcgmFP("dcgmDisconnect")(dcgm_handle))


def _device_ids(name, dcgm_handle):
    count = c_uint()
    ids = (c_uint * dcgm_structs.DCGM_MAX_NUM_DEVICES)()
    _check(dcgmFP(name)(dcgm_handle, ids, byref(count)))
    return list(ids[0 : int(count.value)])


@ensure_byte_strings()
def dcgmGetAllSupportedDevices(dcgm_handle):
    return _device_ids("dcgmGetAllSupportedDevices", dcgm_handle)


@ensure_byte_strings()
def dcgmGetAllDevices(dcgm_handle):
    return _device_ids("dcgmGetAllDevices", dcgm_handle)


@ensure_byte_strings()
def dcgmGetDeviceAttributes(dcgm_handle, gpuId, version=dcgm_structs.dcgmDeviceAttributes_version3):
    if version != dcgm_structs.dcgmDeviceAttributes_version3:
        _check(dcgm_structs.DCGM_ST_VER_MISMATCH)
    attributes = dcgm_structs.c_dcgmDeviceAttributes_v3()
    attributes.version = version
    _check(dcgmFP("dcgmGetDeviceAttributes")(dcgm_handle, c_int(gpuId), byref(attributes)))
    return attributes


@ensure_byte_strings()
def dcgmGroupCreate(dcgm_handle, type, groupName):
    group_id = c_void_p()
    _check(dcgmFP("dcgmGroupCreate")(dcgm_handle, type, groupName, byref(group_id)))
    return group_id


@ensure_byte_strings()
def dcgmGroupDestroy(dcgm_handle, group_id):
    return _check(dcgmFP("dcgmGroupDestroy")(dcgm_handle, group_id))


@ensure_byte_strings()
def dcgmGroupAddDevice(dcgm_handle, group_id, gpu_id):
    return _check(dcgmFP("dcgmGroupAddDevice")(dcgm_handle, group_id, gpu_id))


@ensure_byte_strings()
def dcgmGroupAddEntity(dcgm_handle, group_id, entityGroupId, entityId):
    return _check(dcgmFP("dcgmGroupAddEntity")(dcgm_handle, group_id, entityGroupId, entityId))


@ensure_byte_strings()
def dcgmGroupGetInfo(dcgm_handle, group_id, version=dcgm_structs.c_dcgmGroupInfo_version3):
    if version != dcgm_structs.c_dcgmGroupInfo_version3:
        _check(dcgm_structs.DCGM_ST_VER_MISMATCH)
    info = dcgm_structs.c_dcgmGroupInfo_v3()
    info.version = version
    _check(dcgmFP("dcgmGroupGetInfo")(dcgm_handle, group_id, byref(info)))
    return info


@ensure_byte_strings()
def dcgmGroupGetAllIds(dcgmHandle):
    count = c_uint()
    ids = (c_void_p * dcgm_structs.DCGM_MAX_NUM_GROUPS)()
    _check(dcgmFP("dcgmGroupGetAllIds")(dcgmHandle, ids, byref(count)))
    return list(ids[0 : int(count.value)])


@ensure_byte_strings()
def dcgmFieldGroupCreate(dcgm_handle, fieldIds, fieldGroupName):
    field_group_id = c_void_p()
    ids = (c_uint16 * len(fieldIds))(*fieldIds)
    _check(
        dcgmFP("dcgmFieldGroupCreate")(
            dcgm_handle, c_int32(len(fieldIds)), byref(ids), fieldGroupName, byref(field_group_id)
        )
    )
    return field_group_id


@ensure_byte_strings()
def dcgmFieldGroupDestroy(dcgm_handle, fieldGroupId):
    return _check(dcgmFP("dcgmFieldGroupDestroy")(dcgm_handle, fieldGroupId))


@ensure_byte_strings()
def dcgmFieldGroupGetInfo(dcgm_handle, fieldGroupId):
    info = dcgm_structs.c_dcgmFieldGroupInfo_v1()
    info.version = dcgm_structs.dcgmFieldGroupInfo_version1
    info.fieldGroupId = fieldGroupId
    _check(dcgmFP("dcgmFieldGroupGetInfo")(dcgm_handle, byref(info)))
    return info


@ensure_byte_strings()
def dcgmFieldGroupGetAll(dcgm_handle):
    info = dcgm_structs.c_dcgmAllFieldGroup_v1()
    info.version = dcgm_structs.dcgmAllFieldGroup_version1
    _check(dcgmFP("dcgmFieldGroupGetAll")(dcgm_handle, byref(info)))
    return info


@ensure_byte_strings()
def dcgmUpdateAllFields(dcgm_handle, waitForUpdate):
    return _check(dcgmFP("dcgmUpdateAllFields")(dcgm_handle, c_int(waitForUpdate)))


@ensure_byte_strings()
def dcgmWatchFields(dcgm_handle, groupId, fieldGroupId, updateFreq, maxKeepAge, maxKeepSamples):
    return _check(
        dcgmFP("dcgmWatchFields")(
            dcgm_handle,
            groupId,
            fieldGroupId,
            c_int64(updateFreq),
            c_double(maxKeepAge),
            c_int32(maxKeepSamples),
        )
    )


@ensure_byte_strings()
def dcgmUnwatchFields(dcgm_handle, groupId, fieldGroupId):
    return _check(dcgmFP("dcgmUnwatchFields")(dcgm_handle, groupId, fieldGroupId))


@ensure_byte_strings()
def dcgmGetLatestValues(dcgm_handle, groupId, fieldGroupId, enumCB, userData):
    fn = dcgmFP("dcgmGetLatestValues")
    return _check(fn(dcgm_handle, groupId, fieldGroupId, enumCB, py_object(userData)))


@ensure_byte_strings()
def dcgmGetLatestValues_v2(dcgm_handle, groupId, fieldGroupId, enumCB, userData):
    fn = dcgmFP("dcgmGetLatestValues_v2")
    return _check(fn(dcgm_handle, groupId, fieldGroupId, enumCB, py_object(userData)))


@ensure_byte_strings()
def dcgmGetValuesSince_v2(dcgm_handle, groupId, fieldGroupId, sinceTimestamp, enumCB, userData):
    next_since = c_int64()
    fn = dcgmFP("dcgmGetValuesSince_v2")
    _check(
        fn(
            dcgm_handle,
            groupId,
            fieldGroupId,
            c_int64(sinceTimestamp),
            byref(next_since),
            enumCB,
            py_object(userData),
        )
    )
    return next_since.value


@ensure_byte_strings()
def dcgmEntityGetLatestValues(dcgmHandle, entityGroup, entityId, fieldIds):
    values = (dcgm_structs.c_dcgmFieldValue_v1 * len(fieldIds))()
    ids = (c_uint16 * len(fieldIds))(*fieldIds)
    fn = dcgmFP("dcgmEntityGetLatestValues")
    _check(
        fn(
            dcgmHandle,
            c_uint(entityGroup),
            dcgm_fields.c_dcgm_field_eid_t(entityId),
            ids,
            c_uint(len(fieldIds)),
            values,
        )
    )
    return values


@ensure_byte_strings()
def dcgmEntitiesGetLatestValues(dcgmHandle, entities, fieldIds, flags):
    values = (dcgm_structs.c_dcgmFieldValue_v2 * (len(fieldIds) * len(entities)))()
    pairs = (dcgm_structs.c_dcgmGroupEntityPair_t * len(entities))(*entities)
    ids = (c_uint16 * len(fieldIds))(*fieldIds)
    fn = dcgmFP("dcgmEntitiesGetLatestValues")
    _check(fn(dcgmHandle, pairs, c_uint(len(entities)), ids, c_uint(len(fieldIds)), flags, values))
    return values


@ensure_byte_strings()
def dcgmGetGpuInstanceHierarchy(dcgm_handle):
    hierarchy = dcgm_structs.c_dcgmMigHierarchy_v2()
    hierarchy.version = dcgm_structs.c_dcgmMigHierarchy_version2
    _check(dcgmFP("dcgmGetGpuInstanceHierarchy")(dcgm_handle, byref(hierarchy)))
    return hierarchy


@ensure_byte_strings()
def dcgmProfGetSupportedMetricGroups(dcgmHandle, gpuId):
    msg = dcgm_structs.c_dcgmProfGetMetricGroups_v3()
    msg.version = dcgm_structs.dcgmProfGetMetricGroups_version3
    msg.gpuId = gpuId
    _check(dcgmFP("dcgmProfGetSupportedMetricGroups")(dcgmHandle, byref(msg)))
    return msg


@ensure_byte_strings()
def dcgmProfPause(dcgmHandle):
    return _check(dcgmFP("dcgmProfPause")(dcgmHandle))


@ensure_byte_strings()
def dcgmProfResume(dcgmHandle):
    return _check(dcgmFP("dcgmProfResume")(dcgmHandle))


@ensure_byte_strings()
def dcgmVersionInfo():
    msg = dcgm_structs.c_dcgmVersionInfo_v2()
    msg.version = dcgm_structs.dcgmVersionInfo_version2
    _check(dcgmFP("dcgmVersionInfo")(byref(msg)))
    return msg


@ensure_byte_strings()
def dcgmHostengineIsHealthy(dcgmHandle):
    health = dcgm_structs.c_dcgmHostengineHealth_v1()
    health.version = dcgm_structs.dcgmHostengineHealth_version1
    _check(dcgmFP("dcgmHostengineIsHealthy")(dcgmHandle, byref(health)))
    return health
