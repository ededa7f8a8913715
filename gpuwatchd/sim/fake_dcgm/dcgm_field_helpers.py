"""Fake DCGM bindings: dcgm_field_helpers, Python-friendly field values and collections.

`DcgmFieldValue` turns a c_dcgmFieldValue_v1 into `.value` (int, float or str), `.ts`
(µs since the epoch) and `.isBlank` (a non-OK status, or a blank sentinel). The
collections gather what the enumeration callbacks deliver:
`values[gpuId][fieldId]` (v1) or `values[entityGroupId][entityId][fieldId]` (entity),
each a DcgmFieldValueTimeSeries in timestamp order.
"""

import ctypes
from typing import Any

import dcgm_agent
import dcgm_fields
import dcgm_structs
import dcgmvalue


class DcgmFieldValue:
    def __init__(self, rawValue):
        if not isinstance(rawValue, dcgm_structs.c_dcgmFieldValue_v1):
            raise Exception(f"Unexpected rawValue type {type(rawValue)}")
        self.ts = rawValue.ts
        self.fieldId = rawValue.fieldId
        self.fieldType = chr(rawValue.fieldType)
        self.isBlank = False
        self.value: Any = None
        if rawValue.status != dcgm_structs.DCGM_ST_OK:
            self.isBlank = True
            return
        if self.fieldType == dcgm_fields.DCGM_FT_DOUBLE:
            self.value = float(rawValue.value.dbl)
            self.isBlank = dcgmvalue.DCGM_FP64_IS_BLANK(self.value)
        elif self.fieldType in (dcgm_fields.DCGM_FT_INT64, dcgm_fields.DCGM_FT_TIMESTAMP):
            self.value = int(rawValue.value.i64)
            self.isBlank = dcgmvalue.DCGM_INT64_IS_BLANK(self.value)
        elif self.fieldType == dcgm_fields.DCGM_FT_STRING:
            self.value = str(rawValue.value.str)
            self.isBlank = dcgmvalue.DCGM_STR_IS_BLANK(self.value)
        elif self.fieldType == dcgm_fields.DCGM_FT_BINARY:
            raise Exception(f"Blobs not handled yet for fieldId {self.fieldId}")
        else:
            raise Exception(f"Unhandled fieldType: {self.fieldType}")


class DcgmFieldValueTimeSeries:
    def __init__(self):
        self.values = []  # in timestamp order

    def __len__(self):
        return len(self.values)

    def __getitem__(self, key):
        return self.values[key]

    def InsertValue(self, value):
        if not self.values or value.ts >= self.values[-1].ts:
            self.values.append(value)
            return
        for i, existing in enumerate(self.values):
            if value.ts < existing.ts:
                self.values.insert(i, value)
                return


def py_helper_dcgm_field_values_since_callback(gpuId, values, numValues, userData):
    collection = ctypes.cast(userData, ctypes.py_object).value
    collection._ProcessValues(gpuId, values[0:numValues])
    return 0


helper_dcgm_field_values_since_callback = dcgm_agent.dcgmFieldValueEnumeration_f(
    py_helper_dcgm_field_values_since_callback
)


def py_helper_dcgm_field_values_since_entity_callback(
    entityGroupId, entityId, values, numValues, userData
):
    collection = ctypes.cast(userData, ctypes.py_object).value
    collection._ProcessValues(entityGroupId, entityId, values[0:numValues])
    return 0


helper_dcgm_field_values_since_entity_callback = dcgm_agent.dcgmFieldValueEntityEnumeration_f(
    py_helper_dcgm_field_values_since_entity_callback
)


class DcgmFieldValueCollection:
    """values[gpuId][fieldId] -> DcgmFieldValueTimeSeries."""

    def __init__(self, handle, groupId):
        self.values = {}
        self.entityValues = {}
        self._handle = handle
        self._groupId = groupId
        self._numValuesSeen = 0
        self._nextSinceTimestamp = 0

    def _ProcessValues(self, gpuId, values):
        self._numValuesSeen += len(values)
        series = self.values.setdefault(gpuId, {})
        for raw in values:
            value = DcgmFieldValue(raw)
            series.setdefault(value.fieldId, DcgmFieldValueTimeSeries()).InsertValue(value)

    def GetLatestValues(self, fieldGroup):
        ret = dcgm_agent.dcgmGetLatestValues(
            self._handle,
            self._groupId,
            fieldGroup.fieldGroupId,
            helper_dcgm_field_values_since_callback,
            self,
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def EmptyValues(self):
        self.values = {}
        self._numValuesSeen = 0


class DcgmFieldValueEntityCollection:
    """values[entityGroupId][entityId][fieldId] -> DcgmFieldValueTimeSeries."""

    def __init__(self, handle, groupId):
        self.values = {}
        self._handle = handle
        self._groupId = groupId
        self._numValuesSeen = 0
        self._nextSinceTimestamp = 0

    def _ProcessValues(self, entityGroupId, entityId, values):
        self._numValuesSeen += len(values)
        series = self.values.setdefault(entityGroupId, {}).setdefault(entityId, {})
        for raw in values:
            value = DcgmFieldValue(raw)
            series.setdefault(value.fieldId, DcgmFieldValueTimeSeries()).InsertValue(value)

    def GetLatestValues(self, fieldGroup):
        ret = dcgm_agent.dcgmGetLatestValues_v2(
            self._handle,
            self._groupId,
            fieldGroup.fieldGroupId,
            helper_dcgm_field_values_since_entity_callback,
            self,
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def GetAllSinceLastCall(self, fieldGroup):
        before = self._numValuesSeen
        self._nextSinceTimestamp = dcgm_agent.dcgmGetValuesSince_v2(
            self._handle,
            self._groupId,
            fieldGroup.fieldGroupId,
            self._nextSinceTimestamp,
            helper_dcgm_field_values_since_entity_callback,
            self,
        )
        return self._numValuesSeen - before

    def EmptyValues(self):
        self.values = {}
        self._numValuesSeen = 0
