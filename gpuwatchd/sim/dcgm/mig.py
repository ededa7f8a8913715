"""MIG in the simulated DCGM: the GPU-instance entities nv-hostengine keeps, what they
answer, and `dcgmGetGpuInstanceHierarchy`.

As DCGM 4.6's cache manager (DcgmCacheManager.cpp): a MIG-enabled GPU's GPU instances
are DCGM_FE_GPU_I entities numbered `gpuId * maxGpcs + k` (maxGpcs: NVML's maximum MIG
device count, 7 on A100/H100/H200; k: the instance's place when DCGM enumerates them,
profile by profile), its compute instances DCGM_FE_GPU_CI entities numbered the same way;
DCGM re-reads them on NVML's MIG config change event, so an id can name another instance
after a reconfiguration. A GPU instance answers, per field (dcgm_fields.cpp's entity
level): the profiling fields of level GPU_I/GPU_CI (1001-1008, the tensor pipes) with its
own activity; the framebuffer (250-253) its MIG device's memory in MiB (the GI's, none
reserved) and the last Xid (230) the last one filed on it (an Xid whose NVML event names
the instance; those are not the GPU's); the GPU-level profiling fields (PCIe, NVLink
bytes) DCGM_ST_NO_DATA (GPM); any other field its GPU's value (DCGM remaps device fields
to the parent); the name (50) its profile, e.g. "1g.10gb" (what dcgm-exporter labels
GPU_I_PROFILE with); an entity that is not (or no longer) an instance
DCGM_ST_INSTANCE_NOT_FOUND.

The activity comes from the scenario's MIG devices (`utilization_gpu` per compute
instance, and its own `sm_active`, `tensor_active`, `dram_active`, ... where given): a
GPU instance's ratios are its compute instances' weighted by their compute slices; the
graphics engine's is their utilization, any ratio a device does not give follows it as
`profiling_defaults` derives them. The whole GPU's profiling ratios,
while MIG is on, are its instances' weighted by their share of the GPU's compute slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.sim.dcgm.fields import ST_OK, profiling_defaults
from gpuwatchd.sim.fakelib import symbol
from gpuwatchd.sim.scenario.mig import COMPUTE_SLICES, MigDevice, MigLayout

FE_GPU, FE_GPU_I, FE_GPU_CI = 1, 4, 5
MAX_GPCS = 7  # nvmlDeviceGetMaxMigDeviceCount of every MIG model the simulator has
NO_ID = 0xFFFFFFFF  # nvmlComputeInstanceId of a GPU instance's own entry


@dataclass(frozen=True)
class GpuInstance:
    """A GPU-instance entity of the host engine, and its compute instances."""

    entity: int  # DCGM's DCGM_FE_GPU_I id
    gpu_id: int  # its GPU's DCGM id
    gpu: int  # its GPU's NVML index
    devices: tuple[MigDevice, ...]  # its compute instances (MIG devices)
    ci_entities: tuple[int, ...]  # their DCGM_FE_GPU_CI ids
    activity: dict[str, float] = field(default_factory=dict, compare=False)  # its ratios

    @property
    def nvml_id(self) -> int:
        return self.devices[0].gpu_instance

    @property
    def profile_name(self) -> str:
        return self.devices[0].profile.name


def gpu_instances(gpu_id: int, gpu: int, layout: MigLayout | None) -> list[GpuInstance]:
    """The GPU-instance entities DCGM keeps for one GPU (none while MIG is off)."""
    if layout is None or not layout.enabled:
        return []
    by_gi: dict[int, list[MigDevice]] = {}
    for device in layout.devices:
        by_gi.setdefault(device.gpu_instance, []).append(device)
    # DCGM walks the GPU-instance profiles in index order, then each profile's instances
    order = sorted(by_gi, key=lambda gi: (by_gi[gi][0].profile.index, gi))
    out, cis = [], 0
    for k, gi in enumerate(order):
        devices = tuple(sorted(by_gi[gi], key=lambda d: d.compute_instance))
        ci_ids = tuple(gpu_id * MAX_GPCS + cis + i for i in range(len(devices)))
        cis += len(devices)
        entity = gpu_id * MAX_GPCS + k
        out.append(GpuInstance(entity, gpu_id, gpu, devices, ci_ids, instance_activity(devices)))
    return out


def instance_activity(devices: tuple[MigDevice, ...]) -> dict[str, float]:
    """A GPU instance's profiling ratios: its compute instances', each its own where the
    scenario gives them, else derived from its utilization, weighted by their compute
    slices over the GPU instance's."""
    slices = devices[0].profile.slices
    total = dict.fromkeys(profiling_defaults({}), 0.0)
    for d in devices:
        ratios = {**profiling_defaults({"utilization_gpu": d.utilization_gpu}), **dict(d.activity)}
        for key in total:
            total[key] += ratios[key] * d.compute_slices / slices
    return total


def gpu_activity(layout: MigLayout) -> dict[str, float]:
    """A MIG-enabled GPU's profiling ratios: each GPU instance's, weighted by its share
    of the GPU's compute slices (a 1g busy all the time is 1/7 of the GPU)."""
    total = dict.fromkeys(profiling_defaults({}), 0.0)
    for gi in gpu_instances(0, 0, layout):
        share = gi.devices[0].profile.slices / COMPUTE_SLICES
        for key, value in gi.activity.items():
            total[key] += value * share
    return total


class MigSymbols:
    """FakeDcgmLib's MIG symbols (a part of the library class)."""

    @symbol("handle")
    def _dcgmGetGpuInstanceHierarchy(self, conn: Any, state: Any, out: Any) -> int:
        msg = out._obj
        count = 0
        for gi in conn.engine.gpu_instances():
            uuid = conn.engine.uuids[gi.gpu].encode()
            count = _entry(msg, count, (FE_GPU_I, gi.entity), (FE_GPU, gi.gpu_id), uuid, gi)
            for ci, device in zip(gi.ci_entities, gi.devices, strict=True):
                count = _entry(msg, count, (FE_GPU_CI, ci), (FE_GPU_I, gi.entity), uuid, gi, device)
        msg.count = count
        return ST_OK


def _entry(
    msg: Any,
    k: int,
    entity: tuple[int, int],
    parent: tuple[int, int],
    uuid: bytes,
    gi: GpuInstance,
    device: MigDevice | None = None,
) -> int:
    """Fill msg.entityList[k] as DCGM's PopulateMigHierarchy does; returns k + 1."""
    row = msg.entityList[k]
    row.entity.entityGroupId, row.entity.entityId = entity
    row.parent.entityGroupId, row.parent.entityId = parent
    info = row.info
    info.gpuUuid = uuid
    info.nvmlGpuIndex = gi.gpu
    info.nvmlInstanceId = gi.nvml_id
    profile = gi.devices[0].profile
    if device is None:
        info.nvmlComputeInstanceId = NO_ID
        info.nvmlMigProfileId, info.nvmlProfileSlices = max(profile.id, 0), profile.slices
    else:
        info.nvmlComputeInstanceId = device.compute_instance
        info.nvmlMigProfileId, info.nvmlProfileSlices = 0, device.compute_slices
    return k + 1
