"""The nvml source's metric specs, and the clock event reasons it reports by label."""

from __future__ import annotations

from gpuwatchd.metrics import GPU_LABELS, counter, gauge, instance_form
from gpuwatchd.metrics import gpu_gauge as _gpu_gauge

INFO = gauge(
    "gpu_info",
    "GPU identity; always 1.",
    GPU_LABELS + ("model", "pci_bus_id", "driver_version", "cuda_driver_version"),
)
LOST = _gpu_gauge(
    "gpu_lost", "1 if NVML reports the GPU lost (fallen off the bus).", export="nonzero"
)
UTILIZATION = _gpu_gauge("gpu_utilization_ratio", "Fraction of time a kernel was running.")
MEMORY_UTILIZATION = _gpu_gauge(
    "gpu_memory_utilization_ratio",
    "Fraction of time device memory was read or written.",
    export="detail",
)
MEMORY_USED = _gpu_gauge("gpu_memory_used_bytes", "Device memory in use.")
MEMORY_TOTAL = _gpu_gauge("gpu_memory_total_bytes", "Device memory in total.")
POWER = _gpu_gauge("gpu_power_watts", "Power draw.")
POWER_LIMIT = _gpu_gauge("gpu_power_limit_watts", "Enforced power limit.")
POWER_DEFAULT_LIMIT = _gpu_gauge(
    "gpu_power_default_limit_watts",
    "The board's default power limit (an enforced limit below it was lowered).",
    export="detail",
)
TEMPERATURE = _gpu_gauge("gpu_temperature_celsius", "GPU core temperature.")
SM_COUNT = _gpu_gauge(
    "gpu_multiprocessors",
    "Streaming multiprocessors (CUDA cores / cores per SM of its capability).",
    export="detail",
)
SM_CLOCK = _gpu_gauge("gpu_sm_clock_hertz", "Current SM clock.")
SM_CLOCK_MAX = _gpu_gauge("gpu_sm_clock_max_hertz", "Maximum SM clock.", export="detail")
MEM_CLOCK = _gpu_gauge("gpu_memory_clock_hertz", "Current memory clock.", export="detail")
MEM_CLOCK_MAX = _gpu_gauge("gpu_memory_clock_max_hertz", "Maximum memory clock.", export="detail")
PSTATE = _gpu_gauge(
    "gpu_performance_state", "Performance state, 0 (max) to 15 (min).", export="detail"
)
CLOCK_REASON = _gpu_gauge(
    "gpu_clock_event_reason_active",
    "1 while this reason holds the clocks down.",
    ("reason",),
    export="nonzero",
    budget=1,
)
# a link below what both its ends support shows as gpuwatchd_pcie_link_degraded (issue 46)
PCIE_GEN = _gpu_gauge(
    "gpu_pcie_link_generation", "Current PCIe link generation.", export="detail"
)
PCIE_GEN_MAX = _gpu_gauge(
    "gpu_pcie_link_generation_max",
    "Highest PCIe generation this GPU and slot support.",
    export="detail",
)
PCIE_WIDTH = _gpu_gauge(
    "gpu_pcie_link_width", "Current PCIe link width (lanes).", export="detail"
)
PCIE_WIDTH_MAX = _gpu_gauge(
    "gpu_pcie_link_width_max", "Maximum PCIe link width (lanes).", export="detail"
)
# the driver's byte counters are 32 bits on an H200: exact while under 2**32 bytes a poll
PCIE_TX = _gpu_gauge(
    "gpu_pcie_tx_bytes_per_second",
    "PCIe transmit throughput (GPU to host) since the last poll; aliases past 2^32 bytes a poll.",
)
PCIE_RX = _gpu_gauge(
    "gpu_pcie_rx_bytes_per_second",
    "PCIe receive throughput (host to GPU) since the last poll; aliases past 2^32 bytes a poll.",
)
PCIE_REPLAYS = counter(
    "gpu_pcie_replay_errors_total",
    "PCIe replays (link-level retransmissions).",
    GPU_LABELS,
    export="nonzero",
)
ECC_ERRORS = counter(
    "gpu_ecc_errors_total",
    "ECC errors over the GPU's lifetime (aggregate).",
    GPU_LABELS + ("type",),
    export="nonzero",
)
PERSISTENCE = _gpu_gauge("gpu_persistence_mode", "1 if persistence mode is on.", export="detail")
ECC_MODE = _gpu_gauge("gpu_ecc_mode", "1 if ECC is currently enabled.", export="detail")
REMAP_PENDING = _gpu_gauge(
    "gpu_row_remap_pending",
    "1 if a memory row remap waits for the next GPU reset (row remapping GPUs).",
    export="nonzero",
)
REMAP_FAILED = _gpu_gauge(
    "gpu_row_remap_failed",
    "1 if a memory row could not be remapped: a bank has no spare row left.",
    export="nonzero",
)
# NVLinks per GPU as counts (a series per link and family cost 18 x 2 per H100), and the
# links down by index only while they are (issue 24)
NVLINK = _gpu_gauge(
    "gpu_nvlinks_active", "NVLinks of the GPU that are active.", export="detail"
)
NVLINK_EXPECTED = _gpu_gauge(
    "gpu_nvlinks_expected",
    "NVLinks of the GPU that should be active: seen active since the daemon started, or "
    "wired by an NVSwitch board (or named by expected_nvlinks).",
    export="detail",
)
NVLINK_DOWN = _gpu_gauge(
    "gpu_nvlink_down",
    "1 for each NVLink that should be active and is not; absent otherwise.",
    ("link",),
    export="nonzero",
)
NVLINK_DOWN_PEER = _gpu_gauge(
    "gpu_nvlink_down_peer_gpu",
    "Index of the GPU that an expected but inactive NVLink of this GPU reached (the lowest;"
    " present only while such a link is down, and only for links between GPUs).",
)
# The GPU's registration with the NVLink fabric (nvmlDeviceGetGpuFabricInfoV): one series
# per GPU that has one (NVSwitch boards, Hopper and later), none elsewhere; the status
# only while a completed registration failed. The cluster UUID and clique id are left
# out: a single-node HGX board reports a zero UUID and clique 0 (nvidia-smi -q on R590),
# and no rule reads them (they matter on multi-node NVLink domains, GB200 NVL72)
FABRIC_STATE = _gpu_gauge(
    "gpu_fabric_state",
    "The GPU's registration with the NVLink fabric (NVSwitch systems, Hopper and later): "
    "1 not started, 2 in progress, 3 completed; absent where the GPU has none.",
)
FABRIC_STATUS = _gpu_gauge(
    "gpu_fabric_status",
    "The nvmlReturn_t a completed NVLink fabric registration failed with (its name in "
    "`status`); absent while it succeeded.",
    ("status",),
    export="nonzero",
)
PROCESSES = _gpu_gauge(
    "gpu_compute_processes", "Compute processes running on the GPU.", export="detail"
)
# a series per pid is a new series per GPU at each job start: the GPU's total is
# gpu_memory_used_bytes, the main process's name and owner are the processes source's
PROCESS_MEMORY = _gpu_gauge(
    "gpu_process_memory_used_bytes", "Device memory used by one process.", ("pid",), export="detail"
)
XID = counter(
    "gpu_xid_errors_total",
    "Xid errors reported by the driver.",
    GPU_LABELS + ("xid",),
    export="nonzero",
)
# an Xid NVML's event names a MIG GPU instance for (gpuInstanceId); XID counts it too
XID_INSTANCE = instance_form(
    XID, "Xid errors the driver reported on the MIG GPU instance.", judged=False
)
LAST_XID = _gpu_gauge(
    "gpu_last_xid_timestamp_seconds", "When the last Xid error was seen.", export="nonzero"
)
HUNG = _gpu_gauge(
    "gpu_nvml_hung_seconds",
    "How long an NVML call on this GPU has been blocked (0: none); its readings are left "
    "out meanwhile.",
    export="nonzero",
)
STALE = _gpu_gauge(
    "gpu_nvml_stale",
    "1 if this poll could not read the GPU (held up by a call on another GPU): its values "
    "are the last read.",
    export="nonzero",
)
# constants: gpu_info carries the CUDA version, and a series per GPU
CUDA_VERSION = gauge(
    "cuda_driver_version", "CUDA version the driver supports, e.g. 12.4.", export="detail"
)
DEVICES = gauge("nvml_devices", "GPUs NVML reports on this node.", export="detail")

# every family the nvml source exports, in the order it documents them
SPECS = (
    INFO,
    LOST,
    UTILIZATION,
    MEMORY_UTILIZATION,
    MEMORY_USED,
    MEMORY_TOTAL,
    POWER,
    POWER_LIMIT,
    POWER_DEFAULT_LIMIT,
    TEMPERATURE,
    SM_COUNT,
    SM_CLOCK,
    SM_CLOCK_MAX,
    MEM_CLOCK,
    MEM_CLOCK_MAX,
    PSTATE,
    CLOCK_REASON,
    PCIE_GEN,
    PCIE_GEN_MAX,
    PCIE_WIDTH,
    PCIE_WIDTH_MAX,
    PCIE_TX,
    PCIE_RX,
    PCIE_REPLAYS,
    ECC_ERRORS,
    PERSISTENCE,
    ECC_MODE,
    REMAP_PENDING,
    REMAP_FAILED,
    NVLINK,
    NVLINK_EXPECTED,
    NVLINK_DOWN,
    NVLINK_DOWN_PEER,
    FABRIC_STATE,
    FABRIC_STATUS,
    PROCESSES,
    PROCESS_MEMORY,
    XID,
    LAST_XID,
    HUNG,
    STALE,
    CUDA_VERSION,
    DEVICES,
)

# metric label -> suffix of pynvml's nvmlClocksEventReason* (or older ...ThrottleReason*)
CLOCK_REASONS = {
    "gpu_idle": "GpuIdle",
    "applications_clocks_setting": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal_slowdown": "SwThermalSlowdown",
    "hw_thermal_slowdown": "HwThermalSlowdown",
    "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
    "display_clock_setting": "DisplayClockSetting",
    "board_limit": "BoardLimit",
    "reliability": "Reliability",
}
