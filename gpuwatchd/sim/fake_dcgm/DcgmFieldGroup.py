"""Fake DCGM bindings: DcgmFieldGroup, a named set of field ids in the host engine.

Like DCGM 4.5+'s, every field group it creates is kept in `DcgmFieldGroup.groups` until
`Delete()`: one that is never deleted (say, after its watch failed) stays for good.
"""

import contextlib
import threading

import dcgm_agent
import dcgm_structs


class DcgmFieldGroup:
    groups: dict = {}  # field group id -> the object that created it, until Delete()
    groupLock = threading.RLock()

    def __init__(self, dcgmHandle, name="", fieldIds=None, fieldGroupId=None):
        """Create the field group `name` with `fieldIds` (the name must be unused in the
        host engine), or with `fieldGroupId`, wrap an existing one."""
        self.name = name
        self.fieldIds = fieldIds or []
        self._dcgmHandle = dcgmHandle
        self.wasCreated = False
        if fieldGroupId is not None:
            self.fieldGroupId = fieldGroupId
            info = dcgm_agent.dcgmFieldGroupGetInfo(dcgmHandle.handle, fieldGroupId)
            self.name = info.fieldGroupName
            self.fieldIds = list(info.fieldIds[0 : info.numFieldIds])
            return
        self.fieldGroupId = None
        self.fieldGroupId = dcgm_agent.dcgmFieldGroupCreate(dcgmHandle.handle, self.fieldIds, name)
        self.wasCreated = True
        with DcgmFieldGroup.groupLock:
            DcgmFieldGroup.groups.setdefault(self.fieldGroupId.value, self)

    def Delete(self):
        """Destroy the field group in the host engine if this process created it (a group
        only wrapped by id is left alone), and forget it."""
        with DcgmFieldGroup.groupLock:
            destroy = (
                self.fieldGroupId is not None
                and DcgmFieldGroup.groups.pop(self.fieldGroupId.value, None) is not None
            )
        if destroy:
            dcgm_agent.dcgmFieldGroupDestroy(self._dcgmHandle.handle, self.fieldGroupId)
        self.fieldGroupId = None
        self._dcgmHandle = None

    @classmethod
    def clear(cls):
        with cls.groupLock:
            cls.groups.clear()

    def __del__(self):
        if getattr(self, "_dcgmHandle", None) is None or not self.wasCreated:
            return
        # the group, the connection or the modules may already be gone
        with contextlib.suppress(dcgm_structs.DCGMError, AttributeError, TypeError):
            self.Delete()
