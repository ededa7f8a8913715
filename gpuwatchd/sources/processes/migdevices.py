"""A MIG-enabled GPU's MIG devices when the processes source asks NVML itself (the nvml
source disabled or late): then the parent's aggregate compute list (v3: each process with
its GPU and compute instance ids) is split by MIG device, and the devices' profiles and
UUIDs come from a discovery made only when an instance not known yet shows in the list:
`nvmlDeviceGetMaxMigDeviceCount`, then per index `GetMigDeviceHandleByIndex` (NOT_FOUND:
none there), `GetGpuInstanceId`, `GetComputeInstanceId`, `GetUUID` and `GetName` (the
profile), as the nvml source discovers them (gpuwatchd.sources.nvml.mig).

Known limits of this path: without the MIG monitor capability the aggregate list is
refused (NO_PERMISSION) and an idle MIG-enabled GPU lists nothing, so both are read as a
whole GPU without processes (no main process, so no tenant is mixed with another); the
nvml source's per-device lists have neither limit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gpuwatchd.sources.nvml.mig import profile_of
from gpuwatchd.sources.nvmlapi import ListedInstance, text

log = logging.getLogger("gpuwatchd.sources.processes")

NOT_AVAILABLE = 0xFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE as a GI/CI id: not on MIG


def instance_ids(processes: Iterable[Any]) -> dict[int, tuple[int, int]]:
    """pid -> (GI, CI) of an aggregate list's processes that name an instance (v3)."""
    ids: dict[int, tuple[int, int]] = {}
    for process in processes:
        gi = getattr(process, "gpuInstanceId", NOT_AVAILABLE)
        ci = getattr(process, "computeInstanceId", NOT_AVAILABLE)
        if gi is not None and gi != NOT_AVAILABLE:
            ids[process.pid] = (int(gi), 0 if ci in (None, NOT_AVAILABLE) else int(ci))
    return ids


def discover(nv: Any, handle: Any) -> tuple[ListedInstance, ...]:
    """The GPU's MIG devices (without processes); () where NVML will not say."""
    try:
        count = int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))
    except nv.NVMLError as e:
        log.debug("processes: MIG device count: %s", e)
        return ()
    found = []
    for index in range(count):
        try:
            device = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            gi = int(nv.nvmlDeviceGetGpuInstanceId(device))
            ci = int(nv.nvmlDeviceGetComputeInstanceId(device))
            uuid, name = text(nv.nvmlDeviceGetUUID(device)), text(nv.nvmlDeviceGetName(device))
        except nv.NVMLError as e:
            if e.value != nv.NVML_ERROR_NOT_FOUND:
                log.debug("processes: MIG device %d: %s", index, e)
            continue
        found.append(ListedInstance(gi, ci, profile_of(name, None), uuid, {}))
    return tuple(found)


def split_by_instance(
    devices: tuple[ListedInstance, ...],
    ids: dict[int, tuple[int, int]],
    compute: dict[int, float],
) -> tuple[ListedInstance, ...]:
    """`devices` with the aggregate list's processes on each; a process on an instance
    discovery did not find (created since) gets one of its own, its profile unknown."""
    by_key: dict[tuple[int, int], dict[int, float]] = {}
    for pid, key in ids.items():
        by_key.setdefault(key, {})[pid] = compute.get(pid, 0.0)
    out = [
        ListedInstance(d.gpu_instance, d.compute_instance, d.profile, d.mig_uuid,
                       by_key.pop((d.gpu_instance, d.compute_instance), {}))
        for d in devices
    ]  # fmt: skip
    out += [ListedInstance(gi, ci, "", "", pids) for (gi, ci), pids in by_key.items()]
    return tuple(out)
