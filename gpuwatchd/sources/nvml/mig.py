"""MIG: each GPU's MIG mode, its MIG devices and what NVML reads per instance.

On a MIG-enabled GPU NVML answers per instance, not per GPU (docs/mig.md):
`nvmlDeviceGetUtilizationRates` is NOT_SUPPORTED on the parent (the source then leaves
`gpu_utilization_ratio` out; nothing stands in for it) and on the MIG devices alike;
memory and processes are read on each MIG device's handle, clocks, power, temperature,
PCIe, ECC and NVLink stay the parent's.

What it costs, per MIG-capable GPU (A100, H100, H200; `nvmlDeviceGetMigMode` answers
NOT_SUPPORTED elsewhere and is never asked again):
- MIG off: the mode (~165 µs on an H200) at the first poll, every `OFF_EVERY` polls
  (a pending change), and at once when the parent's utilization turns NOT_SUPPORTED
  (MIG was enabled: that is how the driver shows it first);
- MIG on: the mode and each MIG device's UUID (~12 µs; a handle the driver reused for
  a new instance) every `SLOW_EVERY` polls (disabled, a pending change), one
  `nvmlDeviceGetMigDeviceHandleByIndex` (~33 µs) past the known devices every
  `SLOW_EVERY` polls (an instance created), and per MIG device and poll its memory and
  compute processes (~9 + ~11 µs);
- discovery (all slots up to `nvmlDeviceGetMaxMigDeviceCount`; per device its UUID,
  GPU/compute instance ids, name and attributes) only when the mode turns on, a device
  appears, a device's handle stops answering (INVALID_ARGUMENT / NOT_FOUND: its
  instance was destroyed), or an `nvmlEventMigConfigChange` arrives (asked for once MIG
  is on, in a registration of its own: `_mig_watch`), which reads the change in the
  poll that drains it.
After a mode change or a discovery, the fields the driver refused are asked again (row
remapping is NOT_SUPPORTED on a MIG GPU with instances), and the Xid counts of GPU
instances gone, or made again under their id, are dropped.
NVML's MIG device indexes can have holes (NOT_FOUND at 2, a device at 3): the discovery
skips empty indexes, as NVIDIA's samples do (nvitop stops at the first one), and the
probe asks the index past the highest known device and, where there are holes, the
lowest one and another in turn.

The parent's reads that MIG changes (utilization, the SM count) are asked again when
MIG is disabled. `MigReads` is a mixin of NvmlSource, which sets the state it declares.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwatchd.metrics import GPU_LABELS, Sample, gauge
from gpuwatchd.sources.nvml.metrics import MEMORY_TOTAL, MEMORY_USED, PROCESSES, SM_COUNT
from gpuwatchd.sources.nvml.reads import SLOW_EVERY, SLOW_FIELDS_KEY, _Entry, _Gpu, _GpuLost
from gpuwatchd.sources.nvmlapi import ListedInstance, ProcessTable, sm_count, text

log = logging.getLogger("gpuwatchd.sources.nvml")

OFF_EVERY = 6 * SLOW_EVERY  # polls between two reads of the mode of a GPU with MIG off
MIG_LABELS = GPU_LABELS + ("gpu_instance", "compute_instance", "profile")
# the parent's reads MIG makes NOT_SUPPORTED: asked again once MIG is disabled
PARENT_KEYS = ("utilization",)

# none of these show on a node without MIG (budget 0: the series budget's healthy node)
MIG_MODE = gauge(
    "gpu_mig_mode",
    "1 while MIG is enabled on the GPU (NVML then has no utilization for it, see "
    "docs/mig.md); absent otherwise.",
    GPU_LABELS,
    export="nonzero",
)
MIG_CHANGE_PENDING = gauge(
    "gpu_mig_mode_change_pending",
    "1 while a MIG mode change waits for the next GPU reset; absent otherwise.",
    GPU_LABELS,
    export="nonzero",
)
INSTANCE_INFO = gauge(
    "gpu_instance_info",
    "A MIG device (compute instance) of the GPU, with its UUID (what CUDA_VISIBLE_DEVICES "
    "names); always 1.",
    MIG_LABELS + ("mig_uuid",),
    budget=0,
)
# what the rules read on a GPU instance for the GPU's memory and process count (the
# instance's rows; of a GI with several compute instances, its first's process count)
INSTANCE_MEMORY_USED = replace(
    gauge(
        "gpu_instance_memory_used_bytes",
        "Device memory in use in the MIG device's GPU instance (its compute instances share it).",
        MIG_LABELS,
        budget=0,
    ),
    instance_of=MEMORY_USED.name,
)
INSTANCE_MEMORY_TOTAL = replace(
    gauge(
        "gpu_instance_memory_total_bytes",
        "Device memory of the MIG device's GPU instance.",
        MIG_LABELS,
        budget=0,
    ),
    instance_of=MEMORY_TOTAL.name,
)
INSTANCE_PROCESSES = replace(
    gauge(
        "gpu_instance_compute_processes",
        "Compute processes running on the MIG device.",
        MIG_LABELS,
        budget=0,
    ),
    instance_of=PROCESSES.name,
)
INSTANCE_SMS = gauge(
    "gpu_instance_multiprocessors",
    "Streaming multiprocessors of the MIG device.",
    MIG_LABELS,
    export="detail",
)
MIG_SPECS = (
    MIG_MODE,
    MIG_CHANGE_PENDING,
    INSTANCE_INFO,
    INSTANCE_MEMORY_USED,
    INSTANCE_MEMORY_TOTAL,
    INSTANCE_PROCESSES,
    INSTANCE_SMS,
)


@dataclass
class MigDevice:
    """One MIG device as discovered: its handle and what labels its series."""

    index: int
    handle: Any
    uuid: str
    labels: tuple[str, ...]  # MIG_LABELS
    sms: int | None
    processes: dict[int, float] = field(default_factory=dict)  # pid -> bytes, last read


@dataclass
class MigState:
    """What the source knows of one GPU's MIG (`_Gpu.mig`)."""

    capable: bool = True  # False once the mode answers NOT_SUPPORTED
    mode: int | None = None  # current mode, once read
    pending: int | None = None
    max_devices: int = 0
    devices: list[MigDevice] = field(default_factory=list)
    stale: bool = False  # rediscover (and read the mode) at the next poll
    util_checked: bool = False  # the mode was read after utilization went unsupported
    published: bool = False  # its MIG devices are in the ProcessTable
    gis: dict[str, frozenset[str]] = field(default_factory=dict)  # GI id -> its MIG UUIDs


def profile_of(name: str, attributes: Any) -> str:
    """The GPU instance's profile (1g.10gb, as dcgm-exporter's GPU_I_PROFILE) from the MIG
    device's name ("NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb": the part after "MIG", less a
    smaller compute instance's "1c."), else from its attributes."""
    _, found, tail = name.rpartition(" MIG ")
    if found and tail:
        head, _, rest = tail.partition(".")
        return rest if head.endswith("c") and head[:-1].isdigit() and rest else tail
    if attributes is None:
        return ""
    gigabytes = math.ceil(attributes.memorySizeMB / 1024)
    return f"{attributes.gpuInstanceSliceCount}g.{gigabytes}gb"


class MigReads:
    """NvmlSource's MIG mode, discovery and per-instance reads."""

    _nv: Any
    _table: ProcessTable
    _event_set: Any
    _mig_type: int
    _ask: Callable[[_Gpu, list[_Entry]], None]
    _calls: dict[str, list[tuple[str, Any, tuple[Any, ...]]]]
    _describe: Callable[[Any], str]
    _log_once: Callable[[str, str, _Gpu, str], None]
    _logged: set[tuple[str, str]]

    def _mig(self, gpu: _Gpu, out: list[Sample]) -> None:
        """This poll's MIG reads of a GPU (see the module's docstring for the cadence)."""
        state: MigState | None = gpu.mig
        if state is None:
            state = gpu.mig = MigState()
        if not state.capable:
            return
        polls = gpu.polls
        unsupported = "utilization" in gpu.disabled and not state.util_checked
        due = SLOW_EVERY if state.mode == 1 else OFF_EVERY
        if state.mode is None or state.stale or polls % due == 0 or unsupported:
            state.util_checked = "utilization" in gpu.disabled
            self._mig_mode(gpu, state)
        if state.mode == 1:
            slow = not state.stale and polls % SLOW_EVERY == 0
            if slow and self._mig_reused(gpu, state):
                state.stale = True
            appeared = slow and not state.stale and self._mig_appeared(gpu, state)
            if state.stale or appeared:
                self._mig_discover(gpu, state)
            listed = self._mig_instances(gpu, state, out)
            self._table.instances(gpu.labels[1], tuple(listed))  # for the processes source
            state.published = True
        elif state.published:  # MIG disabled: a whole GPU again for the processes source
            self._table.instances(gpu.labels[1], None)
            state.published = False
        # only while set (as gpu_nvlink_down): a GPU without MIG keeps its series as before
        if state.mode == 1:
            out.append(Sample(MIG_MODE.name, gpu.labels, 1.0))
        if state.pending is not None and state.pending != state.mode:
            out.append(Sample(MIG_CHANGE_PENDING.name, gpu.labels, 1.0))

    def _mig_call(self, gpu: _Gpu, function: Any, *args: Any) -> Any:
        """`function(*args)`; an NVMLError is raised (GPU_IS_LOST as _GpuLost)."""
        nv = self._nv
        try:
            return function(*args)
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from e
            raise

    def _mig_mode(self, gpu: _Gpu, state: MigState) -> None:
        nv = self._nv
        try:
            current, pending = self._mig_call(gpu, nv.nvmlDeviceGetMigMode, gpu.handle)
        except (nv.NVMLError, AttributeError) as e:
            code = getattr(e, "value", nv.NVML_ERROR_FUNCTION_NOT_FOUND)
            if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                state.capable = False
                self._log_once("mig", "nvmlDeviceGetMigMode", gpu, "no MIG on this GPU")
            else:
                log.debug("nvml: GPU %d: MIG mode: %s", gpu.index, self._describe(e))
            return
        state.pending = int(pending)
        if int(current) != state.mode:
            self._mig_changed(gpu, state, int(current))
        elif state.stale and current != 1:
            state.stale = False

    def _mig_changed(self, gpu: _Gpu, state: MigState, mode: int) -> None:
        """The mode changed (or was read the first time)."""
        first = state.mode is None
        state.mode, state.devices, state.stale = mode, [], mode == 1
        if mode == 1:
            gpu.disabled.update(PARENT_KEYS)  # NOT_SUPPORTED on a MIG-enabled GPU
            state.util_checked = True
            log.info(
                "nvml: GPU %d: MIG enabled: NVML has no utilization for a MIG-enabled GPU, "
                "so gpu_utilization_ratio is left out; memory and processes are read per "
                "MIG device (gpuwatchd_gpu_instance_*; docs/mig.md)",
                gpu.index,
            )
            self._mig_watch(gpu)
        elif not first:
            log.info("nvml: GPU %d: MIG disabled: reading it as a whole GPU again", gpu.index)
            gpu.disabled.difference_update(PARENT_KEYS)
            state.util_checked = False
        if not first:  # NVML counts a MIG-enabled GPU's cores no more
            sms = sm_count(self._nv, gpu.handle)
            gpu.sm_count = None if sms is None else Sample(SM_COUNT.name, gpu.labels, float(sms))
            self._mig_forget(gpu, state, {})  # a mode change leaves no instance standing
            self._mig_reask(gpu)
        for key in PARENT_KEYS:
            gpu.kept.pop(key, None)

    def _mig_watch(self, gpu: _Gpu) -> None:
        """Ask for the GPU's MIG configuration changes (nvmlEventMigConfigChange: an
        instance created or destroyed), so a change, a reused handle included, is read
        in the poll that drains it (`_mig_event`) rather than at the slow re-check. A
        registration of its own: one the driver refuses (NOT_SUPPORTED) registers none
        of the types asked (nvml.h), and the Xids must not go with it."""
        nv, kind = self._nv, self._mig_type
        if self._event_set is None or not kind:
            return
        try:
            if self._mig_call(gpu, nv.nvmlDeviceGetSupportedEventTypes, gpu.handle) & kind:
                self._mig_call(gpu, nv.nvmlDeviceRegisterEvents, gpu.handle, kind, self._event_set)
        except nv.NVMLError as e:
            log.debug("nvml: GPU %d: MIG events: %s", gpu.index, self._describe(e))

    def _mig_event(self, gpu: _Gpu) -> None:
        """A MIG configuration change on the GPU: its mode and devices, read this poll."""
        state: MigState | None = gpu.mig
        if state is not None and state.mode == 1:
            state.stale = True

    def _mig_forget(self, gpu: _Gpu, state: MigState, gis: dict[str, frozenset[str]]) -> None:
        """An instance's Xid counts end with it: those of a GPU instance gone, or made
        again under its id (other MIG devices: another tenant's), are dropped. `gis`:
        the GPU instances now, by id, with their MIG UUIDs."""
        gone = {gi for gi, uuids in state.gis.items() if gis.get(gi) != uuids}
        state.gis = gis
        if gone:  # a new dict: the poll may be reading the old one
            gpu.instance_xids = {k: n for k, n in gpu.instance_xids.items() if k[0] not in gone}

    def _mig_reask(self, gpu: _Gpu) -> None:
        """The fields the driver refused, asked again at the next poll: a MIG layout
        change changes what it answers (nvml.h: no remapped rows on a MIG-enabled GPU
        with instances; they are back once MIG is off or its instances are gone)."""
        if gpu.dropped:
            self._ask(gpu, gpu.batch + sorted(gpu.dropped, key=lambda e: (e.field_id, e.scope)))
            gpu.dropped = set()
            gpu.kept.pop(SLOW_FIELDS_KEY, None)  # the SLOW fields too

    def _mig_unmonitored(self, gpu: _Gpu, function: str) -> None:
        """A MIG-enabled GPU's aggregate answered NO_PERMISSION: no MIG monitor
        capability. Said once per GPU, with what it costs (docs/mig.md)."""
        if ("mig_monitor", gpu.labels[1]) in self._logged:
            return
        self._logged.add(("mig_monitor", gpu.labels[1]))
        log.warning(
            "nvml: GPU %d: %s answered NO_PERMISSION on a MIG-enabled GPU: no MIG monitor "
            "capability (/proc/driver/nvidia/capabilities/mig/monitor), so the whole GPU's "
            "memory and processes are not read and the driver delivers no Xid that hits a "
            "single MIG instance (docs/mig.md)",
            gpu.index,
            function,
        )

    def _mig_reused(self, gpu: _Gpu, state: MigState) -> bool:
        """Whether a known handle now answers for another instance (one UUID read per
        device): nvml.h lets the driver reuse a destroyed instance's handle for a new one
        ("their properties can change"), which then answers SUCCESS under the old labels."""
        nv = self._nv
        for device in state.devices:
            try:
                uuid = text(self._mig_call(gpu, nv.nvmlDeviceGetUUID, device.handle))
            except nv.NVMLError as e:
                if e.value in (nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_FOUND):
                    return True
                continue
            if uuid != device.uuid:
                log.info("nvml: GPU %d: MIG device %d is another instance now (%s, was %s)",
                         gpu.index, device.index, uuid, device.uuid)  # fmt: skip
                return True
        return False

    def _mig_appeared(self, gpu: _Gpu, state: MigState) -> bool:
        """Whether a MIG device has appeared at an index no known device has: the one past
        the highest known (one call where the indexes are dense) and, where they have
        holes (NVML's can: NOT_FOUND at 2, a device at 3), the lowest hole and one other
        in turn (at most three calls)."""
        nv, known = self._nv, {d.index for d in state.devices}
        holes = [i for i in range(state.max_devices) if i not in known]
        if not holes:
            return False
        past = max(known, default=-1) + 1
        turn = holes[(gpu.polls // SLOW_EVERY) % len(holes)]
        for index in dict.fromkeys(i for i in (past, holes[0], turn) if i < state.max_devices):
            try:
                self._mig_call(gpu, nv.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, index)
            except nv.NVMLError:
                continue
            return True
        return False

    def _mig_discover(self, gpu: _Gpu, state: MigState) -> None:
        """Every MIG device of the GPU, from index 0 to the most it can have."""
        nv = self._nv
        state.stale, state.devices = False, []
        try:
            state.max_devices = int(
                self._mig_call(gpu, nv.nvmlDeviceGetMaxMigDeviceCount, gpu.handle)
            )
        except nv.NVMLError as e:
            log.debug("nvml: GPU %d: MIG device count: %s", gpu.index, self._describe(e))
            state.stale = True
            return
        for index in range(state.max_devices):
            try:
                handle = self._mig_call(
                    gpu, nv.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, index
                )
                state.devices.append(self._mig_identify(gpu, index, handle))
            except nv.NVMLError as e:
                if e.value != nv.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no device there
                    log.debug("nvml: GPU %d: MIG device %d: %s", gpu.index, index,
                              self._describe(e))  # fmt: skip
        profiles = ", ".join(d.labels[4] for d in state.devices) or "none"
        log.info("nvml: GPU %d: %d MIG devices (%s)", gpu.index, len(state.devices), profiles)
        gis: dict[str, frozenset[str]] = {}
        for device in state.devices:
            gis[device.labels[2]] = gis.get(device.labels[2], frozenset()) | {device.uuid}
        self._mig_forget(gpu, state, gis)
        self._mig_reask(gpu)

    def _mig_identify(self, gpu: _Gpu, index: int, handle: Any) -> MigDevice:
        """A MIG device's identity, read once per discovery (NVMLError if it cannot be)."""
        nv = self._nv
        uuid = text(self._mig_call(gpu, nv.nvmlDeviceGetUUID, handle))
        gi = self._mig_call(gpu, nv.nvmlDeviceGetGpuInstanceId, handle)
        ci = self._mig_call(gpu, nv.nvmlDeviceGetComputeInstanceId, handle)
        name = text(self._mig_call(gpu, nv.nvmlDeviceGetName, handle))
        try:
            attributes = self._mig_call(gpu, nv.nvmlDeviceGetAttributes_v2, handle)
        except nv.NVMLError:
            attributes = None
        labels = gpu.labels + (str(gi), str(ci), profile_of(name, attributes))
        sms = None if attributes is None else int(attributes.multiprocessorCount)
        return MigDevice(index, handle, uuid, labels, sms)

    def _mig_instances(self, gpu: _Gpu, state: MigState, out: list[Sample]) -> list[ListedInstance]:
        """Each MIG device's memory and compute processes; a handle that no longer
        answers (its instance destroyed, MIG disabled) sends the GPU to discovery.
        Returns the devices read, with their processes, for the processes source."""
        nv = self._nv
        _, processes, _ = self._calls["compute_processes"][gpu.choice.get("compute_processes", 0)]
        listed: list[ListedInstance] = []
        for device in state.devices:
            try:
                memory = self._mig_call(gpu, nv.nvmlDeviceGetMemoryInfo, device.handle)
                if processes is not None:  # None: this pynvml predates the call
                    device.processes = self._mig_call(gpu, processes, device.handle)
            except nv.NVMLError as e:
                if e.value in (nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_FOUND):
                    state.stale = True  # the mode and the devices, read again next poll
                    return listed
                log.debug("nvml: GPU %d: MIG device %s: %s", gpu.index, device.uuid,
                          self._describe(e))  # fmt: skip
                continue
            labels = device.labels
            gi, ci, profile = labels[2:5]
            listed.append(ListedInstance(int(gi), int(ci), profile, device.uuid,
                                         dict(device.processes)))  # fmt: skip
            out.append(Sample(INSTANCE_INFO.name, labels + (device.uuid,), 1.0))
            out.append(Sample(INSTANCE_MEMORY_USED.name, labels, float(memory.used)))
            out.append(Sample(INSTANCE_MEMORY_TOTAL.name, labels, float(memory.total)))
            out.append(Sample(INSTANCE_PROCESSES.name, labels, float(len(device.processes))))
            if device.sms is not None:
                out.append(Sample(INSTANCE_SMS.name, labels, float(device.sms)))
        return listed
