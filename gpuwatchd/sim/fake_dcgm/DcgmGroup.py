"""Fake DCGM bindings: DcgmGroup, a group of GPUs and what can be done with it."""

import threading

import dcgm_agent
import dcgm_field_helpers
import dcgm_fields
import dcgm_structs
import pydcgm


class DcgmGroupSamples:
    def __init__(self, dcgmHandle, groupId, dcgmGroup):
        self._dcgmHandle = dcgmHandle
        self._groupId = groupId
        self._dcgmGroup = dcgmGroup

    def WatchFields(self, fieldGroup, updateFreq, maxKeepAge, maxKeepSamples):
        """Sample the field group's fields on this group every updateFreq µs."""
        ret = dcgm_agent.dcgmWatchFields(
            self._dcgmHandle.handle,
            self._groupId,
            fieldGroup.fieldGroupId,
            updateFreq,
            maxKeepAge,
            maxKeepSamples,
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def UnwatchFields(self, fieldGroup):
        ret = dcgm_agent.dcgmUnwatchFields(
            self._dcgmHandle.handle, self._groupId, fieldGroup.fieldGroupId
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def GetLatest(self, fieldGroup):
        """DcgmFieldValueCollection: .values[gpuId][fieldId][-1].value."""
        collection = dcgm_field_helpers.DcgmFieldValueCollection(
            self._dcgmHandle.handle, self._groupId
        )
        collection.GetLatestValues(fieldGroup)
        return collection

    def GetLatest_v2(self, fieldGroup):
        """DcgmFieldValueEntityCollection: .values[entityGroupId][entityId][fieldId][-1]."""
        collection = dcgm_field_helpers.DcgmFieldValueEntityCollection(
            self._dcgmHandle.handle, self._groupId
        )
        collection.GetLatestValues(fieldGroup)
        return collection

    def GetAllSinceLastCall_v2(self, dfvec, fieldGroup):
        if dfvec is None:
            dfvec = dcgm_field_helpers.DcgmFieldValueEntityCollection(
                self._dcgmHandle.handle, self._groupId
            )
            dfvec.GetLatestValues(fieldGroup)
        else:
            dfvec.GetAllSinceLastCall(fieldGroup)
            if len(dfvec.values) == 0:
                dfvec.GetLatestValues(fieldGroup)
        return dfvec

    def UpdateAllFields(self, waitForUpdate):
        self._dcgmHandle.GetSystem().UpdateAllFields(waitForUpdate)


class DcgmGroupProfiling:
    def __init__(self, dcgmHandle, groupId, dcgmGroup):
        self._dcgmHandle = dcgmHandle
        self._groupId = groupId
        self._dcgmGroup = dcgmGroup

    def GetSupportedMetricGroups(self):
        """c_dcgmProfGetMetricGroups_v3 for the group's first GPU."""
        gpuIds = self._dcgmGroup.GetGpuIds()
        if len(gpuIds) < 1:
            raise dcgm_structs.DCGMError_GroupIsEmpty
        return dcgm_agent.dcgmProfGetSupportedMetricGroups(self._dcgmHandle.handle, gpuIds[0])


class DcgmGroup:
    groups: dict = {}
    groupLock = threading.RLock()

    def __init__(
        self, dcgmHandle, groupId=None, groupName=None, groupType=dcgm_structs.DCGM_GROUP_EMPTY
    ):
        """Wrap `groupId`, or create a group called `groupName` (empty by default)."""
        self._dcgmHandle = dcgmHandle
        if groupId is None and groupName is None:
            raise pydcgm.DcgmException("Either groupId or groupName is required")
        if groupId is not None:
            self._groupId = groupId
        else:
            self._groupId = dcgm_agent.dcgmGroupCreate(dcgmHandle.handle, groupType, groupName)
        self.name = groupName
        self.samples: DcgmGroupSamples | None = DcgmGroupSamples(dcgmHandle, self._groupId, self)
        self.profiling: DcgmGroupProfiling | None = DcgmGroupProfiling(
            dcgmHandle, self._groupId, self
        )

    def Delete(self):
        self.samples = None
        self.profiling = None
        if self._groupId is not None and not self._IsGroupIdStatic():
            ret = dcgm_agent.dcgmGroupDestroy(self._dcgmHandle.handle, self._groupId)
            dcgm_structs._dcgmCheckReturn(ret)
        self._groupId = None

    def _IsGroupIdStatic(self):
        return self._groupId in (
            dcgm_structs.DCGM_GROUP_ALL_GPUS,
            dcgm_structs.DCGM_GROUP_ALL_NVSWITCHES,
        )

    def AddGpu(self, gpuId):
        if self._IsGroupIdStatic():
            raise pydcgm.DcgmException("Can't add a GPU to a static group")
        ret = dcgm_agent.dcgmGroupAddDevice(self._dcgmHandle.handle, self._groupId, gpuId)
        dcgm_structs._dcgmCheckReturn(ret)

    def AddEntity(self, entityGroupId, entityId):
        if self._IsGroupIdStatic():
            raise pydcgm.DcgmException("Can't add an entity to a static group")
        ret = dcgm_agent.dcgmGroupAddEntity(
            self._dcgmHandle.handle, self._groupId, entityGroupId, entityId
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def GetGpuIds(self):
        info = dcgm_agent.dcgmGroupGetInfo(self._dcgmHandle.handle, self._groupId)
        return [
            info.entityList[i].entityId
            for i in range(info.count)
            if info.entityList[i].entityGroupId == dcgm_fields.DCGM_FE_GPU
        ]

    def GetEntities(self):
        info = dcgm_agent.dcgmGroupGetInfo(self._dcgmHandle.handle, self._groupId)
        return info.entityList[0 : info.count]

    def GetId(self):
        return self._groupId
