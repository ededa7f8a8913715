"""What the fake libnvidia-ml answers about a device: the scenario's values of a GPU.

`DeviceReads` is the part of `FakeNvmlLib` (gpuwatchd.sim.fake_nvml) that implements the
symbols reading one GPU (utilization, memory, power, clocks, PCIe, modes, ECC, NVLink,
processes, field values, and what other tools ask), in NVML's units and with the
support each product has. The library around it routes every call (faults, hangs,
costs) and gives each symbol the GPU's values at the clock's time.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.sim.fakelib import symbol
from gpuwatchd.sim.scenario.kmsg import NVSWITCHES, nvswitch_bdf
from gpuwatchd.sim.sysfs import LinkModel

if TYPE_CHECKING:
    from gpuwatchd.sim.clock import SimClock
    from gpuwatchd.sim.fake_nvml import NvmlCosts
    from gpuwatchd.sim.models import GpuModel
    from gpuwatchd.sim.scenario import Timeline

# Return codes (nvml.h); the same numbers as pynvml's NVML_SUCCESS / NVML_ERROR_*
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_INSUFFICIENT_SIZE = 7
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
ERROR_ARGUMENT_VERSION_MISMATCH = 25
ERROR_UNKNOWN = 999

NOT_AVAILABLE_UINT = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId when MIG is off
MIB = 2**20

FieldReader = Callable[[int, dict[str, Any], int], "int | None"]
# nvmlFieldValue_t: fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn, value
_RECORD = struct.Struct("<IIqqIIQ")
_RECORD_IDS = struct.Struct("<II32x")


def nvml_bus_id(bdf: str) -> tuple[str, int, int, int]:
    """NVML's busId ("00000000:34:00.0", 8-digit domain, upper case) and its parts."""
    domain_s, bus_s, devfn = bdf.split(":")
    device_s = devfn.split(".")[0]
    domain, bus, device = int(domain_s, 16), int(bus_s, 16), int(device_s, 16)
    return f"{domain:08X}:{bus:02X}:{device:02X}.0", domain, bus, device


def fill_pci_info(info: Any, bdf: str, device_id: int) -> None:
    """An nvmlPciInfo_t for the NVIDIA function at `bdf`."""
    bus_id, domain, bus, device = nvml_bus_id(bdf)
    info.busId = bus_id.encode()
    info.busIdLegacy = f"{domain:04X}:{bus:02X}:{device:02X}.0".encode()
    info.domain, info.bus, info.device = domain, bus, device
    info.pciDeviceId = info.pciSubSystemId = (device_id << 16) | 0x10DE


# The fields a real H200 (R580) answers as NVML_VALUE_TYPE_UNSIGNED_INT, 32 bits: the PCIe
# byte counters wrap at 2**32 ("Value can be wrapped", nvml.h), seen on the hardware every
# ~19 s at 220 MB/s (docs/hardware/2026-12-04-h200-session8). The others are unsigned
# long long.
UINT_FIELDS = (
    "NVML_FI_DEV_POWER_INSTANT",
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES",
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
)


@dataclass
class _FieldPlan:
    # (field id, scope, code, reader or None, NVML_VALUE_TYPE_*, the value's modulus)
    fields: list[tuple[int, int, int, Any, int, int]]
    counted: list[tuple[int, int]]  # (field id, gpu) of each, for field_calls
    records: struct.Struct  # all of the request's records, packed at once


def _value(arg: Any) -> int:
    """An integer argument as the C function sees it (ctypes scalar or Python int)."""
    return int(arg.value) if hasattr(arg, "value") else int(arg)


def _copy_string(buf: Any, size: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _value(size):
        return ERROR_INSUFFICIENT_SIZE
    buf.value = data
    return SUCCESS


def _requested(count: Any, values: Any) -> tuple[tuple[int, int], ...] | None:
    """The (field id, scope id) pairs an nvmlDeviceGetFieldValues call asks for, read
    from the caller's array's memory; None for a count the array cannot hold."""
    array = values._obj
    n = _value(count)
    if n < 0 or n > len(array):
        return None
    return tuple(_RECORD_IDS.iter_unpack(memoryview(array).cast("B")[: n * _RECORD.size]))


class DeviceReads:
    """The symbols that read one GPU; a part of FakeNvmlLib."""

    if TYPE_CHECKING:  # what the library around it provides
        nv: Any
        model: GpuModel
        timeline: Timeline
        clock: SimClock
        costs: NvmlCosts
        field_calls: Counter[tuple[int, int]]
        _reason_bits: dict[str, int]
        _field_failures: dict[tuple[int | None, int], int]
        _field_handlers: dict[int, tuple[str, FieldReader]]
        _field_plans: dict[tuple[int, tuple[tuple[int, int], ...]], _FieldPlan]
        _pcie: dict[tuple[int, str], tuple[float, float]]
        _pcie_integrals: dict[str, tuple[tuple[float, float], list[float]]]
        _field_t: float

        def _gpu_values(self, gpu: int) -> dict[str, Any]: ...

        def _mig_refused_fields(self, gpu: int, values: dict[str, Any]) -> dict[int, int]: ...

        def _now(self) -> float: ...

        def _is_unsupported(self, name: str) -> bool: ...

        def _instance_ids(self, gpu: int) -> Callable[[int], tuple[int, int]]: ...

    # -- utilization, memory, power, temperature, clocks ----------------------------------

    @symbol("device")
    def _nvmlDeviceGetUtilizationRates(self, gpu: int, handle: Any, out: Any) -> int:
        values = self._gpu_values(gpu)
        out._obj.gpu = round(values["utilization_gpu"])
        out._obj.memory = round(values["utilization_memory"])
        return SUCCESS

    def _memory(self, gpu: int) -> tuple[int, int]:
        total = self.model.memory_total_mib * MIB
        used = min(total, round(self._gpu_values(gpu)["memory_used_mib"] * MIB))
        return total, used

    @symbol("device")
    def _nvmlDeviceGetMemoryInfo(self, gpu: int, handle: Any, out: Any) -> int:
        total, used = self._memory(gpu)
        out._obj.total, out._obj.used, out._obj.free = total, used, total - used
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMemoryInfo_v2(self, gpu: int, handle: Any, out: Any) -> int:
        memory = out._obj
        if memory.version != self.nv.nvmlMemory_v2:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        total, used = self._memory(gpu)
        memory.total, memory.reserved, memory.used = total, 0, used
        memory.free = total - used
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPowerUsage(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = round(self._gpu_values(gpu)["power_w"] * 1000)  # mW
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetEnforcedPowerLimit(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = round(self._gpu_values(gpu)["power_limit_w"] * 1000)  # mW
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPowerManagementDefaultLimit(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = round(self.model.power_limit_w * 1000)  # the board's, in mW
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPowerManagementLimit(self, gpu: int, handle: Any, out: Any) -> int:
        return self._nvmlDeviceGetEnforcedPowerLimit(gpu, handle, out)

    def _temperature(self, gpu: int, sensor: int) -> int | None:
        if sensor != self.nv.NVML_TEMPERATURE_GPU:
            return None
        return round(self._gpu_values(gpu)["temperature_c"])

    @symbol("device")
    def _nvmlDeviceGetTemperature(self, gpu: int, handle: Any, sensor: Any, out: Any) -> int:
        value = self._temperature(gpu, _value(sensor))
        if value is None:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetTemperatureV(self, gpu: int, handle: Any, out: Any) -> int:
        reading = out._obj
        if reading.version != self.nv.nvmlTemperature_v1:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        value = self._temperature(gpu, reading.sensorType)
        if value is None:
            return ERROR_INVALID_ARGUMENT
        reading.temperature = value
        return SUCCESS

    def _clock(self, gpu: int, clock_type: int, maximum: bool) -> int | None:
        nv = self.nv
        if clock_type in (nv.NVML_CLOCK_GRAPHICS, nv.NVML_CLOCK_SM):
            key, limit = "sm_clock_mhz", self.model.max_sm_clock_mhz
        elif clock_type == nv.NVML_CLOCK_MEM:
            key, limit = "mem_clock_mhz", self.model.max_mem_clock_mhz
        elif clock_type == nv.NVML_CLOCK_VIDEO:  # video clock tracks SM at ~87 %
            key, limit = "sm_clock_mhz", round(self.model.max_sm_clock_mhz * 0.87)
            if not maximum:
                return round(self._gpu_values(gpu)[key] * 0.87)
        else:
            return None
        return limit if maximum else round(self._gpu_values(gpu)[key])

    @symbol("device")
    def _nvmlDeviceGetClockInfo(self, gpu: int, handle: Any, clock_type: Any, out: Any) -> int:
        value = self._clock(gpu, _value(clock_type), maximum=False)
        if value is None:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxClockInfo(self, gpu: int, handle: Any, clock_type: Any, out: Any) -> int:
        value = self._clock(gpu, _value(clock_type), maximum=True)
        if value is None:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPerformanceState(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self._gpu_values(gpu)["pstate"])
        return SUCCESS

    def _reasons(self, gpu: int) -> int:
        mask = 0
        for name in self._gpu_values(gpu)["clock_event_reasons"]:
            mask |= self._reason_bits[name]
        return mask

    @symbol("device")
    def _nvmlDeviceGetCurrentClocksEventReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._reasons(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._reasons(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetSupportedClocksEventReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self.nv.nvmlClocksEventReasonAll)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetSupportedClocksThrottleReasons(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self.nv.nvmlClocksEventReasonAll)
        return SUCCESS

    # -- PCIe -----------------------------------------------------------------------------

    def _max_gen(self, gpu: int) -> int:
        """Max generation "possible with this device and system": min of both ends."""
        topology = self.timeline.topology
        fn = topology.gpu(gpu)
        parent = topology.functions.get(fn.parent) if fn.parent else None
        return min(fn.max_gen, parent.max_gen) if parent else fn.max_gen

    def _current_link(self, gpu: int) -> tuple[int, int]:
        """The GPU's link as it trained (the sysfs writer's link model: the lower of both
        ends' maxima and wishes), so NVML and sysfs agree."""
        model = self.__dict__.get("_link_model")
        if model is None:
            model = self.__dict__["_link_model"] = LinkModel(self.timeline.topology)
        t = self._now()
        gpus, bridges = self.timeline.state(t)
        kept = self.__dict__.get("_links_at")
        if kept is None or kept[0] != t:  # one tree's links serve every GPU's call at t
            kept = self.__dict__["_links_at"] = (t, model.states(gpus, bridges))
        gen, width = kept[1][self.timeline.topology.gpu_names[gpu]]
        values = gpus[gpu]
        return gen or int(values["pcie_gen"]), width or int(values["pcie_width"])

    @symbol("device")
    def _nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._current_link(gpu)[0]
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._max_gen(gpu)
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetGpuMaxPcieLinkGeneration(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self.timeline.topology.gpu(gpu).max_gen  # the GPU's own
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetCurrPcieLinkWidth(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = self._current_link(gpu)[1]
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetMaxPcieLinkWidth(self, gpu: int, handle: Any, out: Any) -> int:
        # like the generation, "possible with this GPU and system": the lower of both ends
        topology = self.timeline.topology
        fn = topology.gpu(gpu)
        parent = topology.functions.get(fn.parent) if fn.parent else None
        out._obj.value = min(fn.max_width, parent.max_width) if parent else fn.max_width
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPcieThroughput(self, gpu: int, handle: Any, counter: Any, out: Any) -> int:
        if self.costs.pcie_sample:  # the driver samples its byte counter over a window
            time.sleep(self.costs.pcie_sample)
        which = _value(counter)
        if which == self.nv.NVML_PCIE_UTIL_TX_BYTES:
            mb_s = self._gpu_values(gpu)["pcie_tx_mb_s"]
        elif which == self.nv.NVML_PCIE_UTIL_RX_BYTES:
            mb_s = self._gpu_values(gpu)["pcie_rx_mb_s"]
        else:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = round(mb_s * 1e6 / 1024)  # KB/s, KB = 1024 bytes
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetPcieReplayCounter(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = int(self._gpu_values(gpu)["pcie_replay_count"])
        return SUCCESS

    # -- modes, ECC, NVLink, processes -----------------------------------------------------

    @symbol("device")
    def _nvmlDeviceGetPersistenceMode(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = 1 if self._gpu_values(gpu)["persistence_mode"] else 0
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetEccMode(self, gpu: int, handle: Any, current: Any, pending: Any) -> int:
        current._obj.value = pending._obj.value = 1 if self.model.datacenter else 0
        return SUCCESS

    def _ecc_total(self, gpu: int, error_type: int) -> int | None:
        if error_type == self.nv.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(self._gpu_values(gpu)["ecc_corrected_total"])
        if error_type == self.nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return int(self._gpu_values(gpu)["ecc_uncorrected_total"])
        return None

    @symbol("device")
    def _nvmlDeviceGetRemappedRows(
        self, gpu: int, handle: Any, correctable: Any, uncorrectable: Any, pending: Any,
        failed: Any,
    ) -> int:  # fmt: skip
        values = self._gpu_values(gpu)
        correctable._obj.value = int(values["remapped_rows_correctable_total"])
        uncorrectable._obj.value = int(values["remapped_rows_uncorrectable_total"])
        pending._obj.value = int(values["row_remap_pending"])
        failed._obj.value = int(values["row_remap_failed"])
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetTotalEccErrors(
        self, gpu: int, handle: Any, error_type: Any, counter_type: Any, out: Any
    ) -> int:
        # volatile (since driver load) and aggregate (lifetime) read the same here
        value = self._ecc_total(gpu, _value(error_type))
        if value is None or _value(counter_type) not in (0, 1):
            return ERROR_INVALID_ARGUMENT
        out._obj.value = value
        return SUCCESS

    def _nvlink_active(self, gpu: int, values: dict[str, Any], link: int) -> bool:
        """Wired by the board (`Timeline.nvlinks_wired`) and not set down by the scenario."""
        return link in self.timeline.nvlinks_wired[gpu] and link not in values["nvlink_down"]

    @symbol("device")
    def _nvmlDeviceGetNvLinkState(self, gpu: int, handle: Any, link: Any, out: Any) -> int:
        index = _value(link)
        if not 0 <= index < self.model.nvlinks:
            return ERROR_INVALID_ARGUMENT
        out._obj.value = 1 if self._nvlink_active(gpu, self._gpu_values(gpu), index) else 0
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetNvLinkRemoteDeviceType(
        self, gpu: int, handle: Any, link: Any, out: Any
    ) -> int:
        """NVSWITCH on an NVSwitch board, GPU for a bridge or direct link; an inactive link
        has no remote (UNKNOWN)."""
        index = _value(link)
        if self.model.nvlinks == 0 or self._is_unsupported("nvmlDeviceGetNvLinkState"):
            return ERROR_NOT_SUPPORTED
        if not 0 <= index < self.model.nvlinks:
            return ERROR_INVALID_ARGUMENT
        if not self._nvlink_active(gpu, self._gpu_values(gpu), index):
            out._obj.value = self.nv.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
        elif self.timeline.nvlink_fabric == "nvswitch":
            out._obj.value = self.nv.NVML_NVLINK_DEVICE_TYPE_SWITCH
        else:
            out._obj.value = self.nv.NVML_NVLINK_DEVICE_TYPE_GPU
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetNvLinkRemotePciInfo_v2(
        self, gpu: int, handle: Any, link: Any, out: Any
    ) -> int:
        """The PCI function an active link reaches (Timeline.nvlink_peers): another GPU,
        or an NVSwitch (link k reaches switch k mod the board's count). The driver learns
        the remote end by training the link: an inactive one answers NOT_SUPPORTED."""
        index = _value(link)
        if self.model.nvlinks == 0 or self._is_unsupported("nvmlDeviceGetNvLinkState"):
            return ERROR_NOT_SUPPORTED
        if not 0 <= index < self.model.nvlinks:
            return ERROR_INVALID_ARGUMENT
        peers = self.timeline.nvlink_peers[gpu]
        if index not in peers or not self._nvlink_active(gpu, self._gpu_values(gpu), index):
            return ERROR_NOT_SUPPORTED
        peer = peers[index]
        if peer is not None:
            fill_pci_info(out._obj, self.timeline.topology.gpu(peer).bdf, self.model.pci_device_id)
            return SUCCESS
        count, device_id = NVSWITCHES.get(self.model.compute_capability[0], NVSWITCHES[9])
        fill_pci_info(out._obj, nvswitch_bdf(index % count), device_id)
        return SUCCESS

    def _running_processes(self, gpu: int, kind: str, count: Any, infos: Any) -> int:
        """nvmlDeviceGet{Compute,Graphics}RunningProcesses: each process with its MIG
        GPU and compute instance (NVML's "not available" with MIG off)."""
        processes = [p for p in self._gpu_values(gpu)["processes"] if _kind(p) == kind]
        return fill_processes(processes, count, infos, self._instance_ids(gpu))

    @symbol("device")
    def _nvmlDeviceGetComputeRunningProcesses_v3(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "compute", count, infos)

    @symbol("device")
    def _nvmlDeviceGetComputeRunningProcesses_v2(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "compute", count, infos)

    @symbol("device")
    def _nvmlDeviceGetGraphicsRunningProcesses_v3(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "graphics", count, infos)

    @symbol("device")
    def _nvmlDeviceGetGraphicsRunningProcesses_v2(
        self, gpu: int, handle: Any, count: Any, infos: Any
    ) -> int:
        return self._running_processes(gpu, "graphics", count, infos)

    # -- what other tools ask (nvitop-exporter in bench/bench_vs_peer.py) ----------------

    def _video(self, gpu: int, out: Any, period: Any) -> int:
        out._obj.value, period._obj.value = 0, 167_000  # idle, over the driver's µs window
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetEncoderUtilization(self, gpu: int, handle: Any, out: Any, period: Any) -> int:
        return self._video(gpu, out, period)  # the model's `unsupported`: no NVENC

    @symbol("device")
    def _nvmlDeviceGetDecoderUtilization(self, gpu: int, handle: Any, out: Any, period: Any) -> int:
        return self._video(gpu, out, period)

    @symbol("device")
    def _nvmlDeviceGetFanSpeed(self, gpu: int, handle: Any, out: Any) -> int:
        out._obj.value = 30  # percent; passively cooled models list it `unsupported`
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetConfComputeMemSizeInfo(self, gpu: int, handle: Any, out: Any) -> int:
        return ERROR_NOT_SUPPORTED  # confidential computing is off

    @symbol("device")
    def _nvmlDeviceGetRunningProcessDetailList(self, gpu: int, handle: Any, out: Any) -> int:
        """R545's list of the processes of a mode (compute, graphics, MPS: none, all),
        with the two-call protocol: too small an array gives the count and
        INSUFFICIENT_SIZE."""
        details = out._obj
        if details.version != self.nv.nvmlProcessDetailList_v1:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        kinds = {0: ("compute",), 1: ("graphics",), 2: (), 3: ("compute", "graphics")}
        wanted = kinds.get(int(details.mode))
        if wanted is None:
            return ERROR_INVALID_ARGUMENT
        processes = [p for p in self._gpu_values(gpu)["processes"] if _kind(p) in wanted]
        capacity = details.numProcArrayEntries
        details.numProcArrayEntries = len(processes)
        if not processes:
            return SUCCESS
        if len(processes) > capacity or not details.procArray:
            return ERROR_INSUFFICIENT_SIZE
        ids = self._instance_ids(gpu)
        for i, process in enumerate(processes):
            entry = details.procArray[i]
            entry.pid = int(_field(process, "pid"))
            entry.usedGpuMemory = round(float(_field(process, "gpu_memory_mib")) * MIB)
            entry.gpuInstanceId, entry.computeInstanceId = ids(entry.pid)
            entry.usedGpuCcProtectedMemory = 0
        return SUCCESS

    @symbol("device")
    def _nvmlDeviceGetProcessUtilization(
        self, gpu: int, handle: Any, samples: Any, count: Any, since: Any
    ) -> int:
        """One sample per compute process: the GPU's utilization, as if it ran alone."""
        values = self._gpu_values(gpu)
        processes = [p for p in values["processes"] if _kind(p) == "compute"]
        if not processes:
            return ERROR_NOT_FOUND  # no samples since `since`
        capacity = count._obj.value
        count._obj.value = len(processes)
        if samples is None or len(processes) > capacity:
            return ERROR_INSUFFICIENT_SIZE
        stamp = int(self.clock.now() * 1e6)
        for sample, process in zip(samples, processes, strict=False):
            sample.pid, sample.timeStamp = int(_field(process, "pid")), stamp
            sample.smUtil = round(values["utilization_gpu"])
            sample.memUtil = round(values["utilization_memory"])
            sample.encUtil = sample.decUtil = 0
        return SUCCESS

    # -- field values ---------------------------------------------------------------------

    def _build_field_handlers(self) -> dict[int, tuple[str, FieldReader]]:
        """field id -> (symbol whose support it shares, reader of (gpu, values, scope id)).

        A reader answers an integer in the field's unit from the GPU's scenario values,
        or None for a scope the GPU lacks (NVML_ERROR_INVALID_ARGUMENT). The PCIe byte
        counters share their support with their own field name, so a model can list them
        unsupported (drivers before R555 lack them).
        """
        nv = self.nv

        def scenario(key: str, scale: float = 1.0) -> FieldReader:
            return lambda gpu, values, scope: round(values[key] * scale)

        def nvlink_state(gpu: int, values: dict[str, Any], link: int) -> int | None:
            if not 0 <= link < self.model.nvlinks:
                return None
            return 1 if self._nvlink_active(gpu, values, link) else 0

        ecc = "nvmlDeviceGetTotalEccErrors"
        remap = "nvmlDeviceGetRemappedRows"
        datacenter = int(self.model.datacenter)
        ecc_mode = ("nvmlDeviceGetEccMode", lambda gpu, values, scope: datacenter)
        power = ("nvmlDeviceGetPowerUsage", scenario("power_w", 1000))  # mW
        tx, rx = "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"
        return {
            nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (
                "nvmlDeviceGetPcieReplayCounter",
                scenario("pcie_replay_count"),
            ),
            nv.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (ecc, scenario("ecc_corrected_total")),
            nv.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (ecc, scenario("ecc_uncorrected_total")),
            nv.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (ecc, scenario("ecc_corrected_total")),
            nv.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (ecc, scenario("ecc_uncorrected_total")),
            nv.NVML_FI_DEV_ECC_CURRENT: ecc_mode,
            nv.NVML_FI_DEV_REMAPPED_COR: (remap, scenario("remapped_rows_correctable_total")),
            nv.NVML_FI_DEV_REMAPPED_UNC: (remap, scenario("remapped_rows_uncorrectable_total")),
            nv.NVML_FI_DEV_REMAPPED_PENDING: (remap, scenario("row_remap_pending")),
            nv.NVML_FI_DEV_REMAPPED_FAILURE: (remap, scenario("row_remap_failed")),
            nv.NVML_FI_DEV_ECC_PENDING: ecc_mode,
            nv.NVML_FI_DEV_POWER_INSTANT: power,
            nv.NVML_FI_DEV_POWER_AVERAGE: power,
            nv.NVML_FI_DEV_POWER_CURRENT_LIMIT: (
                "nvmlDeviceGetEnforcedPowerLimit",
                scenario("power_limit_w", 1000),  # mW
            ),
            getattr(nv, tx): (tx, lambda gpu, values, scope: self._pcie_bytes(gpu, "tx")),
            getattr(nv, rx): (rx, lambda gpu, values, scope: self._pcie_bytes(gpu, "rx")),
            nv.NVML_FI_DEV_NVLINK_LINK_COUNT: (
                "nvmlDeviceGetNvLinkState",
                lambda gpu, values, scope: self.model.nvlinks,
            ),
            nv.NVML_FI_DEV_NVLINK_GET_STATE: ("nvmlDeviceGetNvLinkState", nvlink_state),
        }

    def _pcie_bytes(self, gpu: int, direction: str) -> int:
        """Bytes through the GPU's link since the driver loaded: the scenario's MB/s,
        integrated over the clock's time up to the field values' timestamp (a counter
        that only rises, loops included)."""
        t = self._field_t
        counted, at = self._pcie.get((gpu, direction), (0.0, 0.0))
        if t > at:
            # every GPU's integral over the same span: a poll of 8 GPUs computes it once
            last = self._pcie_integrals.get(direction)
            if last is None or last[0] != (at, t):
                last = (at, t), self.timeline.integral(f"pcie_{direction}_mb_s", at, t)
                self._pcie_integrals[direction] = last
            counted, at = counted + last[1][gpu] * 1e6, t
            self._pcie[(gpu, direction)] = (counted, at)
        return int(counted)

    @symbol("device")
    def _nvmlDeviceGetFieldValues(self, gpu: int, handle: Any, count: Any, values: Any) -> int:
        """Fills the caller's nvmlFieldValue_t array as the C library does: its memory
        (pynvml's structures are slow to read and write member by member from Python).
        What each requested field needs is worked out once per request and kept."""
        asked = _requested(count, values)
        if asked is None:
            return ERROR_INVALID_ARGUMENT
        plan = self._field_plans.get((gpu, asked))
        if plan is None:
            plan = self._field_plans[(gpu, asked)] = self._plan(gpu, asked)
        self.field_calls.update(plan.counted)
        stamp = int((self.clock.start_wall + self.clock.elapsed()) * 1e6)  # µs since the epoch
        self._field_t = stamp / 1e6 - self.clock.start_wall  # the time the values are of
        state = self._gpu_values(gpu)
        refused = self._mig_refused_fields(gpu, state)  # a MIG-enabled GPU's, per call
        out: list[int] = []
        add = out.extend
        for field_id, scope, code, read, kind, modulus in plan.fields:
            value = 0
            if refused and field_id in refused and read is not None:
                code, read = refused[field_id], None
            if read is not None:
                got = read(gpu, state, scope)
                code, value = (ERROR_INVALID_ARGUMENT, 0) if got is None else (SUCCESS, got)
            add((field_id, scope, stamp, 0, kind, code, value % modulus))
        plan.records.pack_into(values._obj, 0, *out)
        return SUCCESS

    def _plan(self, gpu: int, asked: tuple[tuple[int, int], ...]) -> _FieldPlan:
        """Per field asked: its injected failure or NOT_SUPPORTED, else its reader."""
        failures, handlers = self._field_failures, self._field_handlers
        nv = self.nv
        uint = {getattr(nv, name) for name in UINT_FIELDS if hasattr(nv, name)}
        fields: list[tuple[int, int, int, FieldReader | None, int, int]] = []
        for field_id, scope in asked:
            code = failures.get((gpu, field_id))
            if code is None:
                code = failures.get((None, field_id))
            handler = handlers.get(field_id)
            if code is None and (handler is None or self._is_unsupported(handler[0])):
                code = ERROR_NOT_SUPPORTED
            read = handler[1] if code is None and handler is not None else None
            kind, bits = (
                (nv.NVML_VALUE_TYPE_UNSIGNED_INT, 32)
                if field_id in uint
                else (nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 64)
            )
            fields.append((field_id, scope, code or 0, read, int(kind), 1 << bits))
        counted = [(field_id, gpu) for field_id, _ in asked]
        return _FieldPlan(fields, counted, struct.Struct("<" + _RECORD.format[1:] * len(asked)))


def fill_processes(
    processes: list[Any], count: Any, infos: Any, ids: Callable[[int], tuple[int, int]]
) -> int:
    """The two-call protocol of nvmlDeviceGet{Compute,Graphics}RunningProcesses: with too
    small a buffer (or none), the count and INSUFFICIENT_SIZE. `ids(pid)`: the process's
    MIG GPU and compute instance ids."""
    capacity = count._obj.value
    count._obj.value = len(processes)
    if len(processes) > capacity or (processes and infos is None):
        return ERROR_INSUFFICIENT_SIZE
    for info, process in zip(infos or (), processes, strict=False):
        info.pid = int(_field(process, "pid"))
        info.usedGpuMemory = round(float(_field(process, "gpu_memory_mib")) * MIB)
        info.gpuInstanceId, info.computeInstanceId = ids(info.pid)
    return SUCCESS


def _field(process: Any, key: str) -> Any:
    return process[key] if isinstance(process, dict) else getattr(process, key)


def _kind(process: Any) -> str:
    """Which NVML list a scenario process is in: "compute" (the default) or "graphics"."""
    if isinstance(process, dict):
        return str(process.get("kind", "compute"))
    return str(getattr(process, "kind", "compute"))
