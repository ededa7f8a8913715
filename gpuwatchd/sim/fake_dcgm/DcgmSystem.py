"""Fake DCGM bindings: DcgmSystem, host-engine-wide queries for one DcgmHandle."""

import ctypes

import dcgm_agent
import dcgm_fields
import dcgm_structs
import pydcgm


class DcgmSystemDiscovery:
    def __init__(self, dcgmHandle):
        self._dcgmHandle = dcgmHandle

    def GetAllGpuIds(self):
        return dcgm_agent.dcgmGetAllDevices(self._dcgmHandle.handle)

    def GetAllSupportedGpuIds(self):
        return dcgm_agent.dcgmGetAllSupportedDevices(self._dcgmHandle.handle)

    def GetGpuAttributes(self, gpuId):
        """c_dcgmDeviceAttributes_v3 of one GPU."""
        return dcgm_agent.dcgmGetDeviceAttributes(self._dcgmHandle.handle, gpuId)


class DcgmSystemFields:
    def GetFieldById(self, fieldId):
        return dcgm_fields.DcgmFieldGetById(fieldId)

    def GetFieldByTag(self, tag):
        return dcgm_fields.DcgmFieldGetByTag(tag)


class DcgmSystemProfiling:
    def __init__(self, dcgmHandle):
        self._dcgmHandle = dcgmHandle

    def Pause(self):
        """Stop profiling (fields 1001-1012 read BLANK) so Nsight can take the counters."""
        return dcgm_agent.dcgmProfPause(self._dcgmHandle.handle)

    def Resume(self):
        return dcgm_agent.dcgmProfResume(self._dcgmHandle.handle)


class DcgmSystem:
    def __init__(self, dcgmHandle):
        self._dcgmHandle = dcgmHandle
        self.discovery = DcgmSystemDiscovery(dcgmHandle)
        self.fields = DcgmSystemFields()
        self.profiling = DcgmSystemProfiling(dcgmHandle)

    def UpdateAllFields(self, waitForUpdate):
        dcgm_structs._dcgmCheckReturn(
            dcgm_agent.dcgmUpdateAllFields(self._dcgmHandle.handle, waitForUpdate)
        )

    def GetDefaultGroup(self):
        return pydcgm.DcgmGroup(self._dcgmHandle, groupId=dcgm_structs.DCGM_GROUP_ALL_GPUS)

    def GetEmptyGroup(self, groupName):
        return pydcgm.DcgmGroup(self._dcgmHandle, groupName=groupName)

    def GetGroupWithGpuIds(self, groupName, gpuIds):
        group = pydcgm.DcgmGroup(self._dcgmHandle, groupName=groupName)
        for gpuId in gpuIds:
            group.AddGpu(gpuId)
        return group

    def GetGroupWithEntities(self, groupName, entities):
        group = pydcgm.DcgmGroup(self._dcgmHandle, groupName=groupName)
        for entity in entities:
            group.AddEntity(entity.entityGroupId, entity.entityId)
        return group

    def GetAllGroupIds(self):
        return dcgm_agent.dcgmGroupGetAllIds(self._dcgmHandle.handle)

    def GetAllFieldGroups(self):
        return dcgm_agent.dcgmFieldGroupGetAll(self._dcgmHandle.handle)

    def GetFieldGroupIdByName(self, name):
        """The id (c_void_p) of the field group called `name`, or None."""
        groups = self.GetAllFieldGroups()
        for i in range(groups.numFieldGroups):
            if groups.fieldGroups[i].fieldGroupName == name:
                return ctypes.c_void_p(groups.fieldGroups[i].fieldGroupId)
        return None
