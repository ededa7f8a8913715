"""MIG in scenario files: a GPU's `mig:` value, the GPU-instance profiles of each model,
and the layout the fake NVML answers from (docs/scenarios.md, "MIG"; docs/mig.md).

A GPU value `mig: {mode, pending, instances}` sets the GPU's MIG mode and its MIG
devices (one per compute instance: GPU instance id, compute instance id, the GPU
instance's profile such as `1g.10gb`, and that instance's own utilization, memory and
processes). A later phase that sets `mig` again replaces the whole layout: that is how
a scenario enables or disables MIG, or creates and destroys instances, at run time.

`MigLayout` is the resolved value (`resolve`): profiles looked up in the model's table
(`PROFILES`, what `nvmlDeviceGetGpuInstanceProfileInfoV` answers), placements chosen
first-fit as `nvidia-smi mig -cgi` does, and the whole checked: the profile exists on
the model, no more instances of a profile than it allows, placements that do not
overlap, compute instances within their GPU instance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from gpuwatchd.sim.scenario.base import GpuProcess, ProfilingRatios, Strict

if TYPE_CHECKING:
    from gpuwatchd.sim.models import GpuModel

MEMORY_SLICES = 8  # placements are in eighths of the memory (A100, H100, H200)
COMPUTE_SLICES = 7


@dataclass(frozen=True)
class GiProfile:
    """A GPU-instance profile as nvmlDeviceGetGpuInstanceProfileInfoV answers it."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_* (what the call takes); -1: not in a table
    id: int  # the profile id the driver uses for it
    name: str  # "1g.10gb" (NVML's name is "MIG 1g.10gb")
    slices: int  # compute slices (sliceCount)
    count: int  # how many instances of it a GPU can hold (instanceCount)
    sms: int  # multiprocessorCount
    memory_mib: int  # memorySizeMB (MiB)
    size: int  # memory slices a placement takes
    starts: tuple[int, ...]  # where a placement may start
    engines: tuple[int, int, int, int, int] = (1, 0, 0, 0, 0)  # copy, dec, enc, jpeg, ofa


def _table(
    rows: list[tuple[int, int, str, int, int, int, int, tuple[int, int, int, int, int]]],
) -> dict[str, GiProfile]:
    """Profiles by name from (index, id, name, slices, count, SMs, MiB, engines); the
    placements are the same on every MIG GPU (eighths of the memory)."""
    layout = {0: (1, range(7)), 1: (2, (0, 2, 4)), 2: (4, (0, 4)), 3: (4, (0,)), 4: (8, (0,)),
              7: (1, range(7)), 9: (2, (0, 2, 4, 6))}  # fmt: skip
    out = {}
    for index, pid, name, slices, count, sms, mib, engines in rows:
        size, starts = layout[index]
        starts_at = tuple(starts)
        out[name] = GiProfile(index, pid, name, slices, count, sms, mib, size, starts_at, engines)
    return out


# A100 80GB and H100 80GB: as `nvidia-smi mig -lgip` lists them (NVIDIA's MIG user
# guide); H200: as the driver answered on a real one (docs/hardware/
# 2026-12-04-h200-session8, mig.json). Keyed by the model's nvmlDeviceGetName.
_A100_80GB = _table([
    (0, 19, "1g.10gb", 1, 7, 14, 9728, (1, 0, 0, 0, 0)),
    (1, 14, "2g.20gb", 2, 3, 28, 19968, (2, 1, 0, 0, 0)),
    (2, 9, "3g.40gb", 3, 2, 42, 40192, (3, 2, 0, 0, 0)),
    (3, 5, "4g.40gb", 4, 1, 56, 40192, (4, 2, 0, 0, 0)),
    (4, 0, "7g.80gb", 7, 1, 98, 81152, (7, 5, 0, 1, 1)),
    (7, 20, "1g.10gb+me", 1, 1, 14, 9728, (1, 1, 0, 1, 1)),
    (9, 15, "1g.20gb", 1, 4, 14, 19968, (1, 1, 0, 0, 0)),
])  # fmt: skip
_H100_80GB = _table([
    (0, 19, "1g.10gb", 1, 7, 16, 9984, (1, 1, 0, 1, 0)),
    (1, 14, "2g.20gb", 2, 3, 32, 20096, (2, 2, 0, 2, 0)),
    (2, 9, "3g.40gb", 3, 2, 60, 40448, (3, 3, 0, 3, 0)),
    (3, 5, "4g.40gb", 4, 1, 64, 40448, (4, 4, 0, 4, 0)),
    (4, 0, "7g.80gb", 7, 1, 132, 81152, (8, 7, 0, 7, 1)),
    (7, 20, "1g.10gb+me", 1, 1, 16, 9984, (1, 1, 0, 1, 1)),
    (9, 15, "1g.20gb", 1, 4, 26, 20096, (1, 1, 0, 1, 0)),
])  # fmt: skip
_H200 = _table([
    (0, 19, "1g.18gb", 1, 7, 16, 16384, (1, 1, 0, 1, 0)),
    (1, 14, "2g.35gb", 2, 3, 32, 33280, (2, 2, 0, 2, 0)),
    (2, 9, "3g.71gb", 3, 2, 60, 71424, (3, 3, 0, 3, 0)),
    (3, 5, "4g.71gb", 4, 1, 64, 71424, (4, 4, 0, 4, 0)),
    (4, 0, "7g.141gb", 7, 1, 132, 143360, (8, 7, 0, 7, 1)),
    (7, 20, "1g.18gb+me", 1, 1, 16, 16384, (1, 1, 0, 1, 1)),
    (9, 15, "1g.35gb", 1, 4, 26, 33280, (1, 1, 0, 1, 0)),
])  # fmt: skip
PROFILES: dict[str, dict[str, GiProfile]] = {
    "NVIDIA A100-SXM4-80GB": _A100_80GB,
    "NVIDIA A100 80GB PCIe": _A100_80GB,
    "NVIDIA H100 80GB HBM3": _H100_80GB,
    "NVIDIA H200": _H200,
}


def profiles_of(model: GpuModel) -> dict[str, GiProfile]:
    """The model's GPU-instance profiles by name (none where it has no MIG or no table)."""
    return PROFILES.get(model.name, {}) if model.mig else {}


# an instance's own profiling ratios (MigInstance), as GPU values name them
ACTIVITY = ("sm_active", "sm_occupancy", "tensor_active", "dram_active", "fp64_active",
            "fp32_active", "fp16_active")  # fmt: skip


class MigInstance(ProfilingRatios):
    """One MIG device: a compute instance of a GPU instance, and what runs on it."""

    gpu_instance: int = Field(ge=0, le=14)  # the GI id (nvidia-smi's "GI ID")
    compute_instance: int = Field(0, ge=0, le=7)  # the CI id within it
    profile: str  # the GPU instance's profile, e.g. 1g.10gb
    placement: int | None = Field(None, ge=0, lt=MEMORY_SLICES)  # start slice; default first fit
    compute_slices: int | None = Field(None, ge=1, le=COMPUTE_SLICES)  # a CI smaller than its GI
    # for a model without a profile table: the GPU instance's own size
    slices: int | None = Field(None, ge=1, le=COMPUTE_SLICES)
    multiprocessors: int | None = Field(None, ge=1)
    memory_mib: int | None = Field(None, ge=1)
    # what runs on it: NVML reads memory and processes per instance; utilization is what
    # DCGM's per-instance activity would show (NVML has none on MIG)
    utilization_gpu: float = Field(0, ge=0, le=100)
    # its profiling ratios (ProfilingRatios: fields 1002-1008), apart from its
    # utilization (1001, the graphics engine); default: derived from utilization as the
    # whole GPU's are (SMs 90 % of it, tensor and DRAM idle). An instance-local hang: a
    # kernel that never ends keeps utilization at 100 % with its SMs, pipes and DRAM idle
    memory_used_mib: float = Field(0, ge=0)
    processes: list[GpuProcess] = []
    # Xid codes of the GPU's own (a phase's `xid`) that the driver reports on this
    # instance (its GI and CI ids in the event); the others carry none (the whole GPU)
    xid: list[int] = []
    # its MIG device index (nvmlDeviceGetMigDeviceHandleByIndex); default: the lowest
    # free one, in GI/CI order. The driver's indexes can have holes (index 2 NOT_FOUND,
    # 3 a device), as after a compute instance was destroyed: give them to play that.
    index: int | None = Field(None, ge=0, lt=COMPUTE_SLICES)


class MigConfig(Strict):
    """A GPU's MIG mode and its MIG devices (`mig:` in a GPU's values)."""

    mode: Literal["enabled", "disabled"] = "enabled"
    # the mode after the next GPU reset (nvidia-smi -mig N sets it); default: `mode`
    pending: Literal["enabled", "disabled"] | None = None
    instances: list[MigInstance] = []

    @model_validator(mode="after")
    def _instances_need_mig(self) -> MigConfig:
        if self.mode == "disabled" and self.instances:
            raise ValueError("instances: only with mode: enabled")
        return self


@dataclass(frozen=True)
class MigDevice:
    """A resolved MIG device (compute instance): what its MIG device handle answers."""

    gpu_instance: int
    compute_instance: int
    profile: GiProfile
    placement: int
    compute_slices: int
    utilization_gpu: float
    memory_used_mib: float  # this compute instance's processes' share of its GI's memory
    processes: tuple[dict[str, Any], ...]
    xids: tuple[int, ...] = ()  # the GPU's Xids that land on it (MigInstance.xid)
    index: int = 0  # its MIG device index (MigInstance.index)
    activity: tuple[tuple[str, float], ...] = ()  # profiling ratios the scenario set

    @property
    def name(self) -> str:
        """The MIG device's profile as its name ends: 1g.10gb, or 1c.3g.40gb for a
        compute instance smaller than its GPU instance."""
        if self.compute_slices == self.profile.slices:
            return self.profile.name
        return f"{self.compute_slices}c.{self.profile.name}"

    @property
    def sms(self) -> int:
        return self.profile.sms * self.compute_slices // self.profile.slices

    @property
    def key(self) -> tuple[int, int, str, int]:
        """What identifies it: a device with another key is another one (a new handle)."""
        return (self.gpu_instance, self.compute_instance, self.name, self.placement)


@dataclass(frozen=True)
class MigLayout:
    """A GPU's MIG mode and devices, in MIG device index order (by default by GI id, then
    CI id, densely from 0; a scenario may leave holes)."""

    enabled: bool
    pending: bool
    devices: tuple[MigDevice, ...] = ()

    def gi_memory_used_mib(self, gpu_instance: int) -> float:
        """Memory used in a GPU instance: its compute instances share it."""
        return sum(d.memory_used_mib for d in self.devices if d.gpu_instance == gpu_instance)


def resolve(config: MigConfig, model: GpuModel) -> MigLayout:
    """The layout `config` describes on `model`; ValueError naming the problem."""
    if not model.mig:
        raise ValueError(f"{model.name} does not support MIG")
    enabled = config.mode == "enabled"
    pending = (config.pending or config.mode) == "enabled"
    profiles, placed = _gpu_instances(config.instances, model)
    devices = []
    seen: set[tuple[int, int]] = set()
    for i, inst in enumerate(config.instances):
        if (inst.gpu_instance, inst.compute_instance) in seen:
            raise ValueError(f"instances.{i}: GI {inst.gpu_instance} CI "
                             f"{inst.compute_instance} is given twice")  # fmt: skip
        seen.add((inst.gpu_instance, inst.compute_instance))
        profile = profiles[inst.gpu_instance]
        slices = inst.compute_slices or profile.slices
        devices.append(MigDevice(
            inst.gpu_instance, inst.compute_instance, profile, placed[inst.gpu_instance],
            slices, inst.utilization_gpu, inst.memory_used_mib,
            tuple(p.model_dump() for p in inst.processes), tuple(inst.xid),
            activity=tuple((k, float(v)) for k in ACTIVITY if (v := getattr(inst, k)) is not None),
        ))  # fmt: skip
    indexes = _indexes(config.instances, devices)
    devices = [replace(d, index=indexes[(d.gpu_instance, d.compute_instance)]) for d in devices]
    layout = MigLayout(enabled, pending, tuple(sorted(devices, key=lambda d: d.index)))
    _check_sizes(layout)
    return layout


def _indexes(instances: list[MigInstance], devices: list[MigDevice]) -> dict[tuple[int, int], int]:
    """Each (GI, CI)'s MIG device index: the scenario's, else the lowest free one in
    GI/CI order."""
    given = {(i.gpu_instance, i.compute_instance): i.index for i in instances}
    taken = [n for n in given.values() if n is not None]
    if len(set(taken)) < len(taken):
        raise ValueError("instances: two MIG devices are given the same index")
    out: dict[tuple[int, int], int] = {}
    free = (n for n in range(COMPUTE_SLICES) if n not in taken)
    for d in sorted(devices, key=lambda d: d.key):
        wanted = given[(d.gpu_instance, d.compute_instance)]
        out[(d.gpu_instance, d.compute_instance)] = next(free) if wanted is None else wanted
    return out


def _profile(inst: MigInstance, model: GpuModel) -> GiProfile:
    table = profiles_of(model)
    found = table.get(inst.profile)
    sizes = (inst.slices, inst.multiprocessors, inst.memory_mib)
    if found is not None and sizes == (None, None, None):
        return found
    if None in sizes:
        known = f" ({', '.join(table)})" if table else ""
        raise ValueError(
            f"profile: {inst.profile!r} is not a profile of {model.name}{known}; "
            "give slices, multiprocessors and memory_mib for one of your own"
        )
    slices, sms, mib = sizes
    assert slices is not None and sms is not None and mib is not None
    size = 8 if slices == 7 else 4 if slices >= 3 else slices
    starts = tuple(range(0, MEMORY_SLICES - size + 1, size if size > 1 else 1))[:7]
    return GiProfile(-1, -1, inst.profile, slices, COMPUTE_SLICES // slices, sms, mib, size,
                     starts)  # fmt: skip


def _gpu_instances(
    instances: list[MigInstance], model: GpuModel
) -> tuple[dict[int, GiProfile], dict[int, int]]:
    """Each GPU instance's profile and placement (first fit, explicit ones first)."""
    profiles: dict[int, GiProfile] = {}
    wanted: dict[int, int | None] = {}
    for i, inst in enumerate(instances):
        try:
            profile = _profile(inst, model)
        except ValueError as e:
            raise ValueError(f"instances.{i}.{e}") from None
        gi = inst.gpu_instance
        other = inst.placement not in (None, wanted.get(gi))
        if gi in profiles and (profiles[gi] != profile or other):
            raise ValueError(f"instances.{i}: GI {gi} is given with another profile or placement")
        profiles[gi] = profile
        wanted[gi] = inst.placement if inst.placement is not None else wanted.get(gi)
    used: set[int] = set()
    placed: dict[int, int] = {}
    for gi in sorted(profiles, key=lambda g: wanted[g] is None):
        profile, start = profiles[gi], wanted[gi]
        options = profile.starts if start is None else (start,)
        fits = [s for s in options if not used & set(range(s, s + profile.size))]
        if start is not None and start not in profile.starts or not fits:
            raise ValueError(f"GI {gi} ({profile.name}): no free placement"
                             + (f" at {start}" if start is not None else ""))  # fmt: skip
        placed[gi] = fits[0]
        used |= set(range(fits[0], fits[0] + profile.size))
    return profiles, placed


def _check_sizes(layout: MigLayout) -> None:
    by_gi: dict[int, list[MigDevice]] = {}
    for d in layout.devices:
        by_gi.setdefault(d.gpu_instance, []).append(d)
    counts: dict[str, int] = {}
    for gi, devices in by_gi.items():
        profile = devices[0].profile
        counts[profile.name] = counts.get(profile.name, 0) + 1
        if counts[profile.name] > profile.count:
            raise ValueError(f"at most {profile.count} GPU instances of {profile.name}")
        if sum(d.compute_slices for d in devices) > profile.slices:
            raise ValueError(f"GI {gi}: its compute instances take more than its "
                             f"{profile.slices} slices")  # fmt: skip
        if layout.gi_memory_used_mib(gi) > profile.memory_mib:
            raise ValueError(f"GI {gi}: memory_used_mib over its {profile.memory_mib} MiB")
    if sum(d[0].profile.slices for d in by_gi.values()) > COMPUTE_SLICES:
        raise ValueError(f"the GPU instances take more than {COMPUTE_SLICES} compute slices")


def mig_values(config: MigConfig, model: GpuModel) -> dict[str, Any]:
    """The GPU values a `mig:` setting stands for: the layout and, with instances, the
    GPU's processes and memory in use (what the parent's aggregate queries answer, and
    the pids the processes writer gives a /proc entry)."""
    layout = resolve(config, model)
    values: dict[str, Any] = {"mig": layout}
    if layout.enabled:
        values["processes"] = [p for d in layout.devices for p in d.processes]
        values["memory_used_mib"] = sum(d.memory_used_mib for d in layout.devices)
    return values
