"""Fake DCGM bindings: DcgmHandle, a connection to a host engine (or an embedded one).

Like DCGM 4.5+'s, every handle it connects is appended to `DcgmHandle.handles` and
stays there after `Shutdown()`: a client that reconnects must untrack old handles itself.
"""

import contextlib
import threading

import dcgm_agent
import dcgm_structs
import pydcgm


class DcgmHandle:
    handleLock = threading.Lock()
    handles: list = []  # every handle this class connected, never removed by Shutdown()

    def __init__(
        self,
        handle=None,
        ipAddress=None,
        opMode=dcgm_structs.DCGM_OPERATION_MODE_AUTO,
        persistAfterDisconnect=False,
        unixSocketPath=None,
        timeoutMs=0,
        decoratorHandle=None,
    ):
        """Connect to `ipAddress` ("host[:port]") or `unixSocketPath`, or with neither,
        start an embedded host engine. `handle`: wrap an existing dcgmHandle_t instead.
        timeoutMs: how long a connection attempt may take (0: DCGM's default, 5000 ms)."""
        self._handleCreated = False
        self._persistAfterDisconnect = persistAfterDisconnect
        self._fromDecorator = bool(decoratorHandle)
        self._ipAddress = ipAddress
        if handle is not None:
            self.handle = handle
            self._fromDecorator = True if decoratorHandle is None else decoratorHandle
            return
        if ipAddress is not None and unixSocketPath is not None:
            raise dcgm_structs.dcgmExceptionClass(dcgm_structs.DCGM_ST_BADPARAM)

        dcgm_structs._dcgmInit()
        dcgm_agent.dcgmInit()

        if ipAddress is None and unixSocketPath is None:
            self.handle = dcgm_agent.dcgmStartEmbedded(opMode)
            self.isEmbedded = True
            self._handleCreated = True
            self._track()
            return

        params = dcgm_structs.c_dcgmConnectV3Params_v1()
        params.version = dcgm_structs.c_dcgmConnectV3Params_version
        params.timeoutMs = timeoutMs
        params.persistAfterDisconnect = 1 if persistAfterDisconnect else 0
        address = "tcp://" + ipAddress if ipAddress is not None else "unix://" + unixSocketPath
        self.handle = dcgm_agent.dcgmConnect_v3(address, params)
        self.isEmbedded = False
        self._handleCreated = True
        self._track()

    def _track(self):
        if not self._fromDecorator:
            with DcgmHandle.handleLock:
                DcgmHandle.handles.append(self)

    @classmethod
    def reset(cls):
        with cls.handleLock:
            handles, cls.handles = cls.handles[:], []
        for handle in handles:
            if handle._handleCreated:
                handle.Shutdown()

    def __del__(self):
        if getattr(self, "_handleCreated", False):
            self.Shutdown()

    def GetSystem(self):
        return pydcgm.DcgmSystem(self)

    def __StopDcgm__(self):
        if self.isEmbedded:
            dcgm_agent.dcgmStopEmbedded(self.handle)
        else:
            dcgm_agent.dcgmDisconnect(self.handle)

    def FromDecorator(self):
        return self._fromDecorator

    def Shutdown(self):
        if not self._handleCreated:
            return
        with contextlib.suppress(AttributeError):  # interpreter shutdown: modules are gone
            self.__StopDcgm__()
        self._handleCreated = False
        self.handle = None
        # as in DCGM 4.5+: the handle stays in DcgmHandle.handles (only reset() empties it)

    @staticmethod
    def Unload():
        dcgm_agent.dcgmShutdown()

    def GetIpAddress(self):
        return self._ipAddress
