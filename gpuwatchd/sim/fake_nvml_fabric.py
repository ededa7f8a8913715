"""What the fake libnvidia-ml answers about a GPU's NVLink fabric registration.

`FabricReads` is the part of `FakeNvmlLib` (gpuwatchd.sim.fake_nvml) that implements
nvmlDeviceGetGpuFabricInfo (R525+, the unversioned `nvmlGpuFabricInfo_t`) and
nvmlDeviceGetGpuFabricInfoV (R550+, versioned: `nvmlGpuFabricInfo_v2_t`, and from R580
`_v3_t`, whose `version` the caller sets; any other version answers
NVML_ERROR_ARGUMENT_VERSION_MISMATCH), as nvml.h declares them: "For Hopper or newer
fully supported devices"; on an NVSwitch system the GPU registers with the fabric
manager, and the call reports where that stands. Elsewhere (pre-Hopper, PCIe and
consumer boards, SXM boards without NVSwitches) they answer NVML_ERROR_NOT_SUPPORTED, as
nvidia-smi's "Fabric: N/A" on an L40S or a GeForce card shows. A symbol the node's
driver branch predates is absent (FUNCTIONS_SINCE in fake_nvml): pynvml raises
FunctionNotFound.

The driver writes nvml.h's layout into the caller's memory, so these write through
structures declared from the header (`HEADER_LAYOUTS`), not pynvml's: the state is an
`unsigned char` there (pynvml declares a c_uint; the three bytes after it are padding,
left as the caller had them). The values are the scenario's `fabric` (state, status);
the cluster UUID, clique id and health mask are what a single-node HGX H100/H200 reports
(nvidia-smi -q on R590: a zero UUID, clique 0, every health field N/A).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from gpuwatchd.sim.fake_nvml_device import (
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_SUPPORTED,
    SUCCESS,
)
from gpuwatchd.sim.fakelib import symbol

if TYPE_CHECKING:
    from gpuwatchd.sim.models import GpuModel
    from gpuwatchd.sim.scenario import Timeline

UUID_LEN = 16  # NVML_GPU_FABRIC_UUID_LEN
STATES = {"not_supported": 0, "not_started": 1, "in_progress": 2, "completed": 3}


class _V1(ctypes.Structure):  # nvmlGpuFabricInfo_t
    _fields_ = [
        ("clusterUuid", ctypes.c_ubyte * UUID_LEN),
        ("status", ctypes.c_int),  # nvmlReturn_t
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),  # nvmlGpuFabricState_t: unsigned char
    ]


class _V2(ctypes.Structure):  # nvmlGpuFabricInfo_v2_t
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * UUID_LEN),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
        ("healthMask", ctypes.c_uint),
    ]


class _V3(ctypes.Structure):  # nvmlGpuFabricInfo_v3_t (nvmlGpuFabricInfoV_t in R580's nvml.h)
    _fields_ = [*_V2._fields_, ("healthSummary", ctypes.c_ubyte)]


def struct_version(layout: type[ctypes.Structure], version: int) -> int:
    """NVML_STRUCT_VERSION(data, ver): sizeof(the struct) | ver << 24."""
    return ctypes.sizeof(layout) | version << 24


HEADER_LAYOUTS = {"v1": _V1, "v2": _V2, "v3": _V3}
V2, V3 = struct_version(_V2, 2), struct_version(_V3, 3)  # 0x02000024, 0x03000028
V3_SINCE = 580  # the branch whose nvml.h (13.0) first has nvmlGpuFabricInfo_v3_t


def _address(out: Any) -> int | None:
    """Where a pointer argument points (byref(struct), a POINTER); None: NULL or by value."""
    if hasattr(out, "_obj"):
        return ctypes.addressof(out._obj)
    if isinstance(out, ctypes._Pointer) and out:
        return ctypes.addressof(out.contents)
    return None


class FabricReads:
    """nvmlDeviceGetGpuFabricInfo[V]; a part of FakeNvmlLib."""

    if TYPE_CHECKING:  # what the library around it provides
        nv: Any
        model: GpuModel
        timeline: Timeline
        driver_branch: int

        def _gpu_values(self, gpu: int) -> dict[str, Any]: ...

    def _fabric_supported(self) -> bool:
        """Hopper or later, an SXM module on a board whose NVLinks reach NVSwitches."""
        model = self.model
        return (
            model.compute_capability >= (9, 0)
            and model.sxm
            and self.timeline.nvlink_fabric == "nvswitch"
        )

    def _fill_fabric(self, info: Any, gpu: int) -> None:
        fabric = self._gpu_values(gpu)["fabric"]
        ctypes.memset(ctypes.addressof(info.clusterUuid), 0, UUID_LEN)
        info.status = int(getattr(self.nv, fabric["status"]))
        info.cliqueId = 0
        info.state = STATES[fabric["state"]]

    @symbol("device")
    def _nvmlDeviceGetGpuFabricInfo(self, gpu: int, handle: Any, out: Any) -> int:
        if not self._fabric_supported():
            return ERROR_NOT_SUPPORTED
        address = _address(out)
        if address is None:
            return ERROR_INVALID_ARGUMENT
        self._fill_fabric(_V1.from_address(address), gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetGpuFabricInfoV(self, gpu: int, handle: Any, out: Any) -> int:
        if not self._fabric_supported():
            return ERROR_NOT_SUPPORTED
        address = _address(out)
        if address is None:
            return ERROR_INVALID_ARGUMENT
        version = ctypes.c_uint.from_address(address).value
        accepted = (V2, V3) if self.driver_branch >= V3_SINCE else (V2,)
        if version not in accepted:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        info: Any = (_V3 if version == V3 else _V2).from_address(address)
        self._fill_fabric(info, gpu)
        info.healthMask = 0  # every field NVML_GPU_FABRIC_HEALTH_MASK_*_NOT_SUPPORTED
        if version == V3:
            info.healthSummary = 0  # NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
        return SUCCESS
