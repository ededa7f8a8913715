"""Which processes hold each GPU: NVML's compute and graphics lists, per GPU.

Taken from the nvml source's `ProcessTable` when it is fresh (`_listed`), else asked of
NVML by this source itself (`_start`, `_identify`, `_list`: the v3 list functions,
falling back to v2, a list the GPU does not support left out for good; on a MIG-enabled
GPU its processes by MIG device, from the GI/CI ids of the v3 list, see migdevices). A
mixin of ProcessesSource, which sets the state it declares.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.sources.base import Context, SourceError
from gpuwatchd.sources.nvmlapi import ListedGpu, ListedInstance, identify, start_nvml
from gpuwatchd.sources.processes.migdevices import discover, instance_ids, split_by_instance

log = logging.getLogger("gpuwatchd.sources.processes")

KINDS = ("compute", "graphics")


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    labels: tuple[str, ...] = ()
    bus_id: str = ""
    local_cpus: frozenset[int] | None = None
    local_read_at: int = -1  # poll of the last local_cpulist attempt
    choice: dict[str, int] = field(default_factory=dict)  # kind -> function in use
    disabled: set[str] = field(default_factory=set)  # kinds NVML does not support here
    # MIG enabled: its MIG devices and their processes this poll; None: a whole GPU
    instances: tuple[ListedInstance, ...] | None = None
    # asked here: (GI, CI) of each compute process (MIG only) and the MIG devices known
    mig_ids: dict[int, tuple[int, int]] = field(default_factory=dict)
    mig_devices: tuple[ListedInstance, ...] = ()


class NvmlLists:
    """ProcessesSource's GPU records and their lists of processes."""

    context: Context
    _nv: Any
    _codes: dict[int, str]
    _gpus: list[_Gpu]
    _shared: dict[int, _Gpu]
    _functions: dict[str, list[tuple[str, Any]]]

    def _start(self) -> None:
        nv, self._codes, count = start_nvml(self.context)
        self._functions = {
            kind: [
                (name, getattr(nv, name, None))
                for name in (
                    f"nvmlDevice{api}RunningProcesses_v3",
                    f"nvmlDevice{api}RunningProcesses_v2",
                )
            ]
            for kind, api in (("compute", "GetCompute"), ("graphics", "GetGraphics"))
        }
        self._gpus = [_Gpu(i, labels=(str(i), "")) for i in range(count)]
        self._nv = nv
        log.info("processes: NVML started, %d GPUs", count)

    def _identify(self, gpu: _Gpu) -> None:
        nv = self._nv
        try:
            identity = identify(nv, gpu.index)
        except nv.NVMLError as e:
            log.debug("processes: GPU %d: no handle yet: %s", gpu.index, e)
            return
        gpu.bus_id, gpu.handle = identity.bus_id, identity.handle
        gpu.labels = (str(gpu.index), identity.uuid)

    def _list(self, gpu: _Gpu) -> dict[str, dict[int, float]] | None:
        """kind -> {pid: GPU memory bytes} for the lists NVML gave; None: the GPU is lost."""
        nv = self._nv
        lists: dict[str, dict[int, float]] = {}
        for kind in KINDS:
            if kind in gpu.disabled:
                continue
            functions = self._functions[kind]
            while True:
                choice = gpu.choice.get(kind, 0)
                name, function = functions[choice]
                try:
                    if function is None:
                        raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
                    processes = function(gpu.handle)
                except nv.NVMLError as e:
                    code = e.value
                    if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND and choice + 1 < len(functions):
                        gpu.choice[kind] = choice + 1
                        continue
                    if code == nv.NVML_ERROR_GPU_IS_LOST:
                        return None
                    if code == nv.NVML_ERROR_UNINITIALIZED:
                        self._nv = None
                        raise SourceError(f"NVML was shut down under us: {name}: {e}") from None
                    if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                        gpu.disabled.add(kind)
                        log.info("processes: GPU %d: %s: %s; not asking again", gpu.index, name, e)
                    else:
                        log.debug("processes: GPU %d: %s failed: %s", gpu.index, name, e)
                    break
                used: dict[int, float] = {}
                for process in processes:
                    memory = process.usedGpuMemory or 0  # None where the driver can't tell
                    used[process.pid] = used.get(process.pid, 0.0) + memory
                lists[kind] = used
                if kind == "compute":
                    gpu.mig_ids = instance_ids(processes)
                break
        return lists

    def _listed(self, shared: list[ListedGpu]) -> list[tuple[_Gpu, dict[str, dict[int, float]]]]:
        """The nvml source's lists, on this source's GPU records (lost GPUs left out)."""
        on_gpu = []
        for listed in shared:
            gpu = self._shared.get(listed.index)
            if gpu is None or gpu.labels != listed.labels:
                gpu = self._shared[listed.index] = _Gpu(listed.index, labels=listed.labels)
            gpu.bus_id, gpu.instances = listed.bus_id, listed.instances
            if listed.lists is not None and listed.labels[1]:
                on_gpu.append((gpu, listed.lists))
        return on_gpu

    def _ask_nvml(self) -> list[tuple[_Gpu, dict[str, dict[int, float]]]]:
        """Each GPU's lists, asked of NVML by this source (lost GPUs left out)."""
        on_gpu = []
        for gpu in self._gpus:
            if gpu.handle is None:
                self._identify(gpu)
                if gpu.handle is None:
                    continue
            gpu.mig_ids = {}
            lists = self._list(gpu)
            if lists is not None:
                gpu.instances = self._mig_instances(gpu, lists.get("compute", {}))
                on_gpu.append((gpu, lists))
        return on_gpu

    def _mig_instances(
        self, gpu: _Gpu, compute: dict[int, float]
    ) -> tuple[ListedInstance, ...] | None:
        """Asked here: a MIG-enabled GPU's MIG devices with their processes, from the
        GI/CI ids of its aggregate list (None: no process names an instance, a whole
        GPU or an idle one). Discovery again only when an unknown instance shows."""
        if not gpu.mig_ids:
            gpu.mig_devices = ()  # a layout may change while nothing runs: discover again
            return None
        known = {(d.gpu_instance, d.compute_instance) for d in gpu.mig_devices}
        if not set(gpu.mig_ids.values()) <= known:
            gpu.mig_devices = discover(self._nv, gpu.handle)
        return split_by_instance(gpu.mig_devices, gpu.mig_ids, compute)
