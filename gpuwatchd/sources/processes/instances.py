"""MIG: the GPU instances of a MIG-enabled GPU, as the processes source sees them.

A MIG-enabled GPU runs one tenant per GPU instance (GI), so it has no single main
process: each GI has its own, the process with the most GPU memory of those NVML lists
on the GI's MIG devices (compute instances, which share their GI's memory). Its facts are
exported under the instance forms of the per-GPU families (metrics.INSTANCE_FORMS:
`gpu_instance_process_*{gpu, uuid, gpu_instance, profile}`), the same values in the same
units, and the whole GPU keeps only its lists' counts.

The lists are the nvml source's: each MIG device's own compute processes, read on its
MIG device handle every poll (`ListedGpu.instances`), which needs no MIG monitor
capability, unlike the parent's aggregate list. Nothing here calls NVML.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.metrics import Sample
from gpuwatchd.sources.nvmlapi import ListedInstance
from gpuwatchd.sources.processes.gpus import _Gpu
from gpuwatchd.sources.processes.metrics import INSTANCE_FORMS


@dataclass(frozen=True)
class Instance:
    """One GPU instance of a MIG-enabled GPU and the processes on its MIG devices."""

    gpu: _Gpu
    gpu_instance: int
    profile: str  # the GI's profile, e.g. 3g.40gb
    mig_uuids: tuple[str, ...]  # its MIG devices' UUIDs, by compute instance id
    memory: dict[int, float]  # pid -> GPU memory bytes, over its compute instances

    @property
    def key(self) -> tuple[str, int]:
        """(GPU uuid, GI id): what owners are keyed by."""
        return (self.gpu.labels[1], self.gpu_instance)

    @property
    def labels(self) -> tuple[str, ...]:
        """metrics.INSTANCE_LABELS: gpu, uuid, gpu_instance, profile."""
        return (*self.gpu.labels, str(self.gpu_instance), self.profile)


def group_instances(gpu: _Gpu) -> list[Instance]:
    """The GPU instances of a MIG-enabled GPU (none for a whole GPU), by GI id; compute
    instances of one GI make one instance with all their processes."""
    if not gpu.instances:
        return []
    by_gi: dict[int, list[ListedInstance]] = {}
    for device in sorted(gpu.instances, key=lambda d: (d.gpu_instance, d.compute_instance)):
        by_gi.setdefault(device.gpu_instance, []).append(device)
    out = []
    for gi, devices in by_gi.items():
        memory: dict[int, float] = {}
        for device in devices:
            for pid, used in device.processes.items():
                memory[pid] = memory.get(pid, 0.0) + used
        uuids = tuple(d.mig_uuid for d in devices)
        out.append(Instance(gpu, gi, devices[0].profile, uuids, memory))
    return out


def instance_samples(samples: list[Sample], labels: tuple[str, ...]) -> list[Sample]:
    """Per-GPU samples of an instance's main process (labels gpu, uuid, then the family's
    own) as their instance forms under the instance's `labels`."""
    return [Sample(INSTANCE_FORMS[s.name].name, labels + s.labels[2:], s.value) for s in samples]
