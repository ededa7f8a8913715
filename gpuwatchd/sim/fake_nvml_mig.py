"""What the fake libnvidia-ml answers about MIG: the parent GPU's MIG calls, the MIG
device handles, and what changes on a GPU whose MIG mode is enabled.

`MigReads` is the part of `FakeNvmlLib` (gpuwatchd.sim.fake_nvml) that plays a GPU's
`mig` value (a `MigLayout`, gpuwatchd/sim/scenario/mig.py) as the driver does
(nvml.h; docs/hardware/2026-12-04-h200-session8 for a real H200 with MIG off;
docs/mig.md has the table):

* on the parent, whatever its mode: `nvmlDeviceGetMigMode` [current, pending]
  (NOT_SUPPORTED on a model without MIG), `GetMaxMigDeviceCount` (0 with MIG off, else
  the 1-slice profile's instance count), `GetMigDeviceHandleByIndex` (NOT_FOUND where no
  MIG device has that index), `IsMigDeviceHandle` 0, `GetGpuInstanceId` /
  `GetComputeInstanceId` / `GetDeviceHandleFromMigDeviceHandle` INVALID_ARGUMENT,
  `GetAttributes_v2` NOT_SUPPORTED, the GPU-instance profiles
  (`GetGpuInstanceProfileInfo[V]`) and `GetGpuInstanceRemainingCapacity`;
* on a MIG-enabled parent: utilization (device, process, encoder, decoder) and the core
  count answer NOT_SUPPORTED (`MIG_PARENT_UNSUPPORTED`); memory and the process lists
  are the aggregate over the instances, each process with its GPU and compute instance
  ids, or NO_PERMISSION without the MIG monitor capability (`node.mig_monitor: false`);
  while it has a GPU instance, row remapping (`nvmlDeviceGetRemappedRows` and its field
  values) answers NOT_SUPPORTED (`MIG_INSTANCES_UNSUPPORTED`);
* events: an Xid naming a GPU instance reaches an event set only with the MIG monitor
  capability (without it, only the whole GPU's); `nvmlEventMigConfigChange` is supported
  while MIG is enabled and raised on the parent when a phase creates or destroys a MIG
  device (or turns MIG on or off);
* on a MIG device handle (`MIG_HANDLE_SYMBOLS`): its identity (UUID `MIG-…`, name
  "<GPU> MIG 1g.10gb", index, GPU / compute instance ids, its parent), its GPU
  instance's memory, its own processes, its attributes; every other call answers
  NOT_SUPPORTED (clocks, power, temperature, PCIe, ECC, NVLink, fields, events belong
  to the parent), and the parent-only MIG calls INVALID_ARGUMENT. A handle whose
  instance is gone (destroyed, or MIG disabled) answers INVALID_ARGUMENT: the driver's
  handles "remain invalid and must be requested again".

A MIG device handle is one struct per GPU and instance key (`MigDevice.key`): asking
again for the same instance gives the same handle, a new instance a new one. nvml.h
allows more: handles of destroyed instances "may be reused and their properties can
change". With `mig_handle_reuse` set, a handle is its MIG device index's slot: once its
instance is gone, a new instance at that index answers through it (SUCCESS, with the new
instance's ids, UUID and memory), as a long-running client saw on a real driver. Calls
cost what `NvmlCosts` says for their name, as every other call of the fake does.
"""

from __future__ import annotations

import ctypes
import hashlib
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuwatchd.sim.fake_nvml_device import (
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    MIB,
    NOT_AVAILABLE_UINT,
    SUCCESS,
    _copy_string,
    _field,
    _kind,
    _value,
    fill_processes,
)
from gpuwatchd.sim.fakelib import symbol
from gpuwatchd.sim.scenario.mig import GiProfile, MigDevice, MigLayout, profiles_of

if TYPE_CHECKING:
    from gpuwatchd.sim.models import GpuModel
    from gpuwatchd.sim.scenario import Node, Timeline

ERROR_NO_PERMISSION = 4
# the profile indexes the driver knows (R580 on an H200 answered INVALID_ARGUMENT at 17)
PROFILE_INDEXES = 17

# On a MIG-enabled GPU, "querying ... is not currently supported" (nvml.h)
MIG_PARENT_UNSUPPORTED = frozenset({
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetNumGpuCores",
})  # fmt: skip
# "In MIG mode, if device handle is provided, the API returns aggregate information, only
# if the caller has appropriate privileges" (nvml.h)
MIG_PARENT_AGGREGATE = frozenset({
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetRunningProcessDetailList",
})  # fmt: skip
# "On MIG-enabled GPUs with active instances, querying the number of remapped rows is not
# supported" (nvml.h): the call and the field values that share it, while a GI exists
MIG_INSTANCES_UNSUPPORTED = frozenset({"nvmlDeviceGetRemappedRows"})
# symbol -> MigReads method answering it on a MIG device handle (others: NOT_SUPPORTED)
MIG_HANDLE_SYMBOLS = {
    "nvmlDeviceIsMigDeviceHandle": "_mig_is_mig",
    "nvmlDeviceGetGpuInstanceId": "_mig_gpu_instance",
    "nvmlDeviceGetComputeInstanceId": "_mig_compute_instance",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": "_mig_parent",
    "nvmlDeviceGetUUID": "_mig_uuid",
    "nvmlDeviceGetName": "_mig_name",
    "nvmlDeviceGetIndex": "_mig_index",
    "nvmlDeviceGetMemoryInfo": "_mig_memory",
    "nvmlDeviceGetMemoryInfo_v2": "_mig_memory_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3": "_mig_compute_processes",
    "nvmlDeviceGetComputeRunningProcesses_v2": "_mig_compute_processes",
    "nvmlDeviceGetGraphicsRunningProcesses_v3": "_mig_graphics_processes",
    "nvmlDeviceGetGraphicsRunningProcesses_v2": "_mig_graphics_processes",
    "nvmlDeviceGetAttributes_v2": "_mig_attributes",
    "nvmlDeviceGetMaxMigDeviceCount": "_mig_not_a_parent",
    "nvmlDeviceGetMigDeviceHandleByIndex": "_mig_not_a_parent",
}


def mig_uuid(hostname: str, gpu: int, device: MigDevice) -> str:
    """A MIG device's UUID (`MIG-…`, as R470 and later name them), the same for the same
    instance (GPU instance, compute instance, profile, placement) of the same GPU."""
    gi, ci, name, placement = device.key
    digest = hashlib.sha256(f"{hostname}/gpu{gpu}/mig/{gi}/{ci}/{name}/{placement}".encode())
    return f"MIG-{uuid.UUID(bytes=digest.digest()[:16])}"


def _not_mig(pid: int) -> tuple[int, int]:
    return NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT


class MigReads:
    """The MIG symbols and MIG device handles; a part of FakeNvmlLib."""

    if TYPE_CHECKING:  # what the library around it provides
        nv: Any
        model: GpuModel
        node: Node
        _devices: list[Any]

        timeline: Timeline
        _field_handlers: dict[int, tuple[str, Any]]

        def _gpu_values(self, gpu: int) -> dict[str, Any]: ...

    mig_handle_reuse = False  # a test hook: handles are index slots, reused (see above)

    def _mig_init(self) -> None:
        self._mig_structs: dict[tuple[int, Any], Any] = {}
        # handle address -> (GPU, instance key), or (GPU, MIG device index) when reused
        self._mig_by_address: dict[int, tuple[int, Any]] = {}
        self._mig_profiles: dict[str, GiProfile] = profiles_of(self.model)
        self._mig_max = max((p.count for p in self._mig_profiles.values()), default=7)

    # -- the layout ---------------------------------------------------------------------

    def _layout(self, gpu: int) -> MigLayout | None:
        """The GPU's MIG layout while its mode is enabled, else None."""
        layout: MigLayout | None = self._gpu_values(gpu)["mig"]
        return layout if layout is not None and layout.enabled else None

    def _mig_of(self, handle: Any) -> tuple[int, Any] | None:
        """(GPU, instance key or index slot) of a MIG device handle; None for anything else."""
        try:
            return self._mig_by_address.get(ctypes.addressof(handle.contents))
        except (AttributeError, ValueError, TypeError):  # NULL or not a handle
            return None

    def _mig_handle(self, gpu: int, device: MigDevice) -> Any:
        key: Any = device.index if self.mig_handle_reuse else device.key
        struct = self._mig_structs.get((gpu, key))
        if struct is None:
            struct = self._mig_structs[(gpu, key)] = self.nv.struct_c_nvmlDevice_t()
            self._mig_by_address[ctypes.addressof(struct)] = (gpu, key)
        return struct

    def _instance_ids(self, gpu: int) -> Callable[[int], tuple[int, int]]:
        """pid -> (GPU instance id, compute instance id) of the GPU's processes: NVML's
        "not available" for both where MIG is off."""
        layout = self._layout(gpu)
        if layout is None:
            return _not_mig
        ids = {
            int(_field(p, "pid")): (d.gpu_instance, d.compute_instance)
            for d in layout.devices
            for p in d.processes
        }
        return lambda pid: ids.get(pid, (NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT))

    def _mig_parent_code(self, name: str, gpu: int) -> int | None:
        """What a MIG-enabled parent answers instead of the call's usual answer, if it
        does (None: answer as usual; the aggregate is the GPU's values, which a `mig:`
        value sets to its instances' processes and memory)."""
        if name in MIG_PARENT_UNSUPPORTED:
            return ERROR_NOT_SUPPORTED
        if name in MIG_PARENT_AGGREGATE and not self.node.mig_monitor:
            return ERROR_NO_PERMISSION
        if name in MIG_INSTANCES_UNSUPPORTED and self._gpu_values(gpu)["mig"].devices:
            return ERROR_NOT_SUPPORTED
        return None

    def _mig_refused_fields(self, gpu: int, values: dict[str, Any]) -> dict[int, int]:
        """Field id -> what a MIG-enabled parent answers for it instead of its value (a
        field answers as the call it shares its support with); empty with MIG off."""
        layout = values["mig"]
        if layout is None or not layout.enabled:
            return {}
        handlers: dict[int, tuple[str, Any]] = self._field_handlers
        codes = {fid: self._mig_parent_code(name, gpu) for fid, (name, _) in handlers.items()}
        return {fid: code for fid, code in codes.items() if code is not None}

    def _mig_handle_call(self, name: str, gpu: int, key: Any, args: tuple) -> int:
        """A call on a MIG device handle (the GPU's faults already applied); `key` is its
        instance's key, or (handles reused) its MIG device index."""
        layout = self._layout(gpu)
        device = None
        if layout is not None:
            slot = isinstance(key, int)
            device = next((d for d in layout.devices if (d.index if slot else d.key) == key), None)
        if device is None:  # destroyed, or MIG disabled: the handle is no longer valid
            return ERROR_INVALID_ARGUMENT
        method = MIG_HANDLE_SYMBOLS.get(name)
        if method is None:
            return ERROR_NOT_SUPPORTED
        answer: int = getattr(self, method)(gpu, layout, device, *args[1:])
        return answer

    # -- the parent's MIG calls -----------------------------------------------------------

    @symbol("device")
    def _nvmlDeviceGetMigMode(self, gpu: int, handle: Any, current: Any, pending: Any) -> int:
        if not self.model.mig:
            return ERROR_NOT_SUPPORTED
        layout: MigLayout | None = self._gpu_values(gpu)["mig"]
        current._obj.value = int(layout is not None and layout.enabled)
        pending._obj.value = int(layout is not None and layout.pending)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceIsMigDeviceHandle(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = 0  # a parent's handle (a MIG device's answers 1)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxMigDeviceCount(self, gpu: int, handle: Any, out: Any) -> int:
        """ "Returns zero if MIG is not supported or enabled" (nvml.h)."""
        out._obj.value = self._mig_max if self._layout(gpu) is not None else 0
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMigDeviceHandleByIndex(
        self, gpu: int, handle: Any, index: Any, out: Any
    ) -> int:
        layout, i = self._layout(gpu), _value(index)
        device = None if layout is None else next((d for d in layout.devices if d.index == i), None)
        if device is None:  # as the H200 answered index 0 with MIG off; or a hole
            return ERROR_NOT_FOUND
        out._obj.contents = self._mig_handle(gpu, device)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetGpuInstanceId(self, gpu: int, handle: Any, out: Any) -> int:
        return ERROR_INVALID_ARGUMENT  # not a MIG device handle

    @symbol("device")
    def _nvmlDeviceGetComputeInstanceId(self, gpu: int, handle: Any, out: Any) -> int:
        return ERROR_INVALID_ARGUMENT

    @symbol("device")
    def _nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, gpu: int, handle: Any, out: Any) -> int:
        return ERROR_INVALID_ARGUMENT

    @symbol("device")
    def _nvmlDeviceGetAttributes_v2(self, gpu: int, handle: Any, out: Any) -> int:
        return ERROR_NOT_SUPPORTED  # "currently only supports MIG device handles"

    def _profile_at(self, index: int) -> GiProfile | int:
        if not 0 <= index < PROFILE_INDEXES:
            return ERROR_INVALID_ARGUMENT
        found = [p for p in self._mig_profiles.values() if p.index == index]
        return found[0] if found else ERROR_NOT_SUPPORTED

    def _fill_profile(self, info: Any, profile: GiProfile, name: bool) -> None:
        info.id, info.isP2pSupported = profile.id, 0
        info.sliceCount, info.instanceCount = profile.slices, profile.count
        info.multiprocessorCount, info.memorySizeMB = profile.sms, profile.memory_mib
        (info.copyEngineCount, info.decoderCount, info.encoderCount, info.jpegCount,
         info.ofaCount) = profile.engines  # fmt: skip
        if name:
            info.name = f"MIG {profile.name}".encode()

    @symbol("device")
    def _nvmlDeviceGetGpuInstanceProfileInfoV(
        self, gpu: int, handle: Any, index: Any, out: Any
    ) -> int:
        """A GPU-instance profile by index (answered with MIG off too, as on the H200)."""
        if not self.model.mig:
            return ERROR_NOT_SUPPORTED
        if out._obj.version != self.nv.nvmlGpuInstanceProfileInfo_v2:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        profile = self._profile_at(_value(index))
        if isinstance(profile, int):
            return profile
        self._fill_profile(out._obj, profile, name=True)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetGpuInstanceProfileInfo(
        self, gpu: int, handle: Any, index: Any, out: Any
    ) -> int:
        if not self.model.mig:
            return ERROR_NOT_SUPPORTED
        profile = self._profile_at(_value(index))
        if isinstance(profile, int):
            return profile
        self._fill_profile(out._obj, profile, name=False)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetGpuInstanceRemainingCapacity(
        self, gpu: int, handle: Any, profile_id: Any, out: Any
    ) -> int:
        """How many more GPU instances of a profile fit (all of them with MIG off)."""
        wanted = _value(profile_id)
        profile = next((p for p in self._mig_profiles.values() if p.id == wanted), None)
        if not self.model.mig or profile is None:
            return ERROR_INVALID_ARGUMENT
        layout: MigLayout | None = self._gpu_values(gpu)["mig"]
        gis = {d.gpu_instance: d for d in (layout.devices if layout else ())}
        used = {s for d in gis.values() for s in range(d.placement, d.placement + d.profile.size)}
        free = [s for s in profile.starts if not used & set(range(s, s + profile.size))]
        existing = sum(d.profile.name == profile.name for d in gis.values())
        out._obj.value = max(0, min(len(free), profile.count - existing))
        return SUCCESS

    # -- a MIG device handle's answers --------------------------------------------------

    def _mig_is_mig(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        out._obj.value = 1
        return SUCCESS

    def _mig_gpu_instance(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        out._obj.value = device.gpu_instance
        return SUCCESS

    def _mig_compute_instance(
        self, gpu: int, layout: MigLayout, device: MigDevice, out: Any
    ) -> int:
        out._obj.value = device.compute_instance
        return SUCCESS

    def _mig_parent(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        out._obj.contents = self._devices[gpu]
        return SUCCESS

    def _mig_uuid(self, gpu: int, layout: MigLayout, device: MigDevice, buf: Any, size: Any) -> int:
        return _copy_string(buf, size, mig_uuid(self.node.hostname, gpu, device))

    def _mig_name(self, gpu: int, layout: MigLayout, device: MigDevice, buf: Any, size: Any) -> int:
        return _copy_string(buf, size, f"{self.model.name} MIG {device.name}")

    def _mig_index(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        out._obj.value = device.index  # what GetMigDeviceHandleByIndex takes
        return SUCCESS

    def _gi_memory(self, layout: MigLayout, device: MigDevice) -> tuple[int, int]:
        """(total, used) bytes of the device's GPU instance, which its CIs share."""
        total = device.profile.memory_mib * MIB
        return total, min(total, round(layout.gi_memory_used_mib(device.gpu_instance) * MIB))

    def _mig_memory(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        total, used = self._gi_memory(layout, device)
        out._obj.total, out._obj.used, out._obj.free = total, used, total - used
        return SUCCESS

    def _mig_memory_v2(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        memory = out._obj
        if memory.version != self.nv.nvmlMemory_v2:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        total, used = self._gi_memory(layout, device)
        memory.total, memory.reserved, memory.used = total, 0, used
        memory.free = total - used
        return SUCCESS

    def _mig_compute_processes(
        self, gpu: int, layout: MigLayout, device: MigDevice, count: Any, infos: Any
    ) -> int:
        processes = [p for p in device.processes if _kind(p) == "compute"]
        ids = (device.gpu_instance, device.compute_instance)
        return fill_processes(processes, count, infos, lambda pid: ids)

    def _mig_graphics_processes(
        self, gpu: int, layout: MigLayout, device: MigDevice, count: Any, infos: Any
    ) -> int:
        return fill_processes([], count, infos, _not_mig)  # MIG has no graphics

    def _mig_attributes(self, gpu: int, layout: MigLayout, device: MigDevice, out: Any) -> int:
        attributes, profile = out._obj, device.profile
        attributes.multiprocessorCount = device.sms
        (attributes.sharedCopyEngineCount, attributes.sharedDecoderCount,
         attributes.sharedEncoderCount, attributes.sharedJpegCount,
         attributes.sharedOfaCount) = profile.engines  # fmt: skip
        attributes.gpuInstanceSliceCount = profile.slices
        attributes.computeInstanceSliceCount = device.compute_slices
        attributes.memorySizeMB = profile.memory_mib
        return SUCCESS

    def _mig_not_a_parent(self, gpu: int, layout: MigLayout, device: MigDevice, *args: Any) -> int:
        return ERROR_INVALID_ARGUMENT

    # -- events -------------------------------------------------------------------------

    def _mig_event_types(self, gpu: int) -> int:
        """The MIG event types the GPU supports now: nvmlEventMigConfigChange while its
        MIG mode is enabled. DCGM registers it only on a MIG-enabled GPU; a registration
        that asks for a type the GPU does not support registers none of those it asks
        for (nvml.h), so a client asks for it on its own."""
        return int(self.nv.nvmlEventMigConfigChange) if self._layout(gpu) is not None else 0

    def _mig_delivered(self, gpu_instance: int) -> bool:
        """Whether an Xid naming this GPU instance (NOT_AVAILABLE_UINT: the whole GPU) is
        delivered. nvml.h (nvmlEventSetWait_v2): in MIG mode the events of every instance
        only with the MIG monitor capability; without it only the events that affect all
        instances (`node.mig_monitor: false` plays that)."""
        return gpu_instance == NOT_AVAILABLE_UINT or self.node.mig_monitor

    def _mig_config_events(
        self, masks: dict[int, int], t0: float, t1: float
    ) -> list[tuple[int, int, int, int, int]]:
        """nvmlEventMigConfigChange events in (t0, t1] for the GPUs registered for them:
        one per phase start there that creates or destroys a MIG device of the GPU (or
        turns MIG on or off), on the parent, with no data and no instance ids."""
        kind = int(self.nv.nvmlEventMigConfigChange)
        gpus = [gpu for gpu, mask in masks.items() if mask & kind]
        events = []
        for start in self._phase_starts(t0, t1) if gpus else ():
            before, after = self.timeline.state(start - 1e-6)[0], self.timeline.state(start)[0]
            for gpu in gpus:
                if _mig_keys(before[gpu]) != _mig_keys(after[gpu]):
                    events.append((gpu, kind, 0, NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT))
        return events

    def _phase_starts(self, t0: float, t1: float) -> list[float]:
        """The times in (t0, t1] after 0 at which a phase starts (each loop's)."""
        timeline = self.timeline
        starts = [start for start, _ in timeline.phases()]
        period = timeline.duration if timeline.loop and timeline.duration > 0 else 0.0
        cycles = range(int(t0 // period), int(t1 // period) + 1) if period else range(1)
        found = {c * period + s for c in cycles for s in starts}
        return sorted(t for t in found if t0 < t <= t1 and t > 0)


def _mig_keys(values: dict[str, Any]) -> frozenset[Any] | None:
    """What a MIG configuration change changes: the GPU's MIG devices (None: MIG off)."""
    layout: MigLayout | None = values.get("mig")
    if layout is None or not layout.enabled:
        return None
    return frozenset(d.key for d in layout.devices)
