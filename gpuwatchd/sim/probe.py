"""The simulated node's in-process probes, handed over as the kernel hands datagrams.

Stands in for the probe source's socket (`context.extras["probe_receiver"]`): each
`receive` gives one report per probed process that runs and reports, tagged with the
pid the kernel would have attributed it to. Counters integrate the scenario's rates
over the clock (batches at 1/`step_seconds`, wait and compute seconds as shares of
wall time), so the source sees what a real probe sending once per poll would send.

A process on a MIG device sees only that device (CUDA enumerates one MIG device per
process): its `cuda_device` is the MIG device, and torch reports the MIG device's UUID,
printed without NVML's "MIG-" as a GPU's is without "GPU-".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from typing import Any

from gpuwatchd.probe import VERSION
from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sim.fake_nvml_mig import mig_uuid
from gpuwatchd.sim.scenario import Timeline

MIB = 1 << 20

DEFAULTS: dict[str, Any] = dict(
    reporting=True,
    step_seconds=0.5,
    wait_fraction=0.05,
    alloc_retries_per_minute=0.0,
)
_LOADER = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "batch_size")
_MEMORY = ("reserved", "allocated", "inactive_split", "largest_free_block")


class SimProbeReceiver:
    def __init__(self, timeline: Timeline, now: Callable[[], float], elapsed: Callable[[], float]):
        self.timeline = timeline
        self._now = now  # wall clock, for the CUDA initialisation's timestamp
        self._elapsed = elapsed
        self._integrator = Integrator()
        node = timeline.scenario.node
        self._uuids = [gpu_uuid(node.hostname, i) for i in range(node.gpu_count)]
        self._init_at: dict[int, float] = {}  # pid -> when its CUDA start finished
        # no probe ever reports: as on a node where no training process uses the probe
        self._silent = not any(timeline.host_state(t).get("probe") for t, _ in timeline.phases())

    def notify(self, wake: Callable[[], None]) -> bool:
        """As the socket's (the probe source may rest on it): True, and `wake` never
        called, only on a node whose probes never report."""
        return self._silent

    def receive(self, limit: int) -> list[tuple[int, bytes]]:
        t = self._elapsed()
        host = self.timeline.host_state(t)
        running = host.get("processes") or {}
        probes: dict[int, dict[str, Any]] = {}
        rates: dict[Hashable, float] = {}
        for pid, values in (host.get("probe") or {}).items():
            v = {**DEFAULTS, **{k: x for k, x in values.items() if x is not None}}
            if not v["reporting"] or running.get(pid, {}).get("running") is False:
                continue
            probes[pid] = v
            rates[(pid, "batches")] = 1.0 / v["step_seconds"]
            rates[(pid, "wait")] = v["wait_fraction"]
            rates[(pid, "compute")] = 1.0 - v["wait_fraction"]
            rates[(pid, "retries")] = v["alloc_retries_per_minute"] / 60.0
        totals = self._integrator.advance(t, rates)
        out = [
            (pid, json.dumps(self._report(pid, v, totals), separators=(",", ":")).encode())
            for pid, v in sorted(probes.items())
        ]
        return out[:limit]

    def _report(self, pid: int, v: dict[str, Any], totals: dict[Hashable, float]) -> dict[str, Any]:
        report: dict[str, Any] = {
            "v": VERSION,
            "batches": int(totals[(pid, "batches")]),
            "wait_seconds": totals[(pid, "wait")],
            "compute_seconds": totals[(pid, "compute")],
        }
        loader = {k: v[k] for k in _LOADER if k in v}
        if loader:
            report["loader"] = loader
        device = v.get("cuda_device")
        mig = self._mig_device(pid) if device is not None else None
        if device is not None and (device < len(self._uuids) or mig is not None):
            uuid = mig or self._uuids[device]
            cuda: dict[str, Any] = {
                "device": device,
                "uuid": uuid.removeprefix("GPU-").removeprefix("MIG-"),  # as torch prints it
                "alloc_retries": int(totals[(pid, "retries")]),
            }
            for name in _MEMORY:
                cuda[f"{name}_bytes"] = v.get(f"{name}_mib", 0.0) * MIB
            if "cuda_init_seconds" in v:
                at = self._init_at.setdefault(pid, self._now())
                cuda["init_seconds"], cuda["init_timestamp"] = v["cuda_init_seconds"], at
            report["cuda"] = cuda
        return report

    def _mig_device(self, pid: int) -> str | None:
        """The UUID of the MIG device `pid` runs on now, if it runs on one."""
        node = self.timeline.scenario.node
        for gpu, values in enumerate(self.timeline.state(self._elapsed())[0]):
            layout = values.get("mig")
            if layout is None or not layout.enabled:
                continue
            for device in layout.devices:
                if any(process["pid"] == pid for process in device.processes):
                    return mig_uuid(node.hostname, gpu, device)
        return None

    def close(self) -> None:
        pass
