"""GPU product profiles the simulator can build nodes from (values as NVML reports them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class GpuModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # nvmlDeviceGetName
    pci_device_id: int  # PCI device id (vendor is always 0x10de)
    pci_class: int = 0x030200  # 3D controller; GeForce/RTX report 0x030000 (VGA)
    memory_total_mib: int
    power_limit_w: float
    max_sm_clock_mhz: int
    max_mem_clock_mhz: int
    pcie_max_gen: int
    pcie_max_width: int = 16
    nvlinks: int = 0  # NVLinks the chip has (NVML_FI_DEV_NVLINK_LINK_COUNT)
    # the links an NVLink bridge connects on a PCIe card (empty: all); the others are
    # inactive by design, as 6 of an H100 PCIe's 18
    nvlink_bridge_links: tuple[int, ...] = ()
    sxm: bool = False  # an SXM module on a baseboard, every NVLink wired (not a PCIe card)
    datacenter: bool = True
    dcgm_profiling: bool = True  # DCGM profiling metrics (1001-1012); not on GeForce or pre-Volta
    mig: bool = False  # supports MIG (nvmlDeviceGetMigMode answers; MIG itself is off)
    # streaming multiprocessors and CUDA compute capability: nvmlDeviceGetNumGpuCores
    # answers sm_count x the capability's cores per SM (0: NOT_SUPPORTED, an older driver)
    sm_count: int = 0
    compute_capability: tuple[int, int] = (8, 0)
    # NVML functions this product answers with NVML_ERROR_NOT_SUPPORTED
    unsupported: tuple[str, ...] = ()


BUILTIN_MODELS: dict[str, GpuModel] = {
    "a100-sxm4-80gb": GpuModel(
        name="NVIDIA A100-SXM4-80GB",
        sm_count=108,
        compute_capability=(8, 0),
        pci_device_id=0x20B2,
        memory_total_mib=81920,
        power_limit_w=400,
        max_sm_clock_mhz=1410,
        max_mem_clock_mhz=1593,
        pcie_max_gen=4,
        nvlinks=12,
        sxm=True,
        mig=True,
        # no NVENC, no fans (SXM)
        unsupported=("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetFanSpeed"),
    ),
    "h100-sxm5-80gb": GpuModel(
        name="NVIDIA H100 80GB HBM3",
        sm_count=132,
        compute_capability=(9, 0),
        pci_device_id=0x2330,
        memory_total_mib=81559,
        power_limit_w=700,
        max_sm_clock_mhz=1980,
        max_mem_clock_mhz=2619,
        pcie_max_gen=5,
        nvlinks=18,
        sxm=True,
        mig=True,
        unsupported=("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetFanSpeed"),
    ),
    # as NVML reported a real one (docs/hardware/2026-12-04-h200): 0x2335, 143771 MiB,
    # 700 W default limit, SM 1980 / memory 3201 MHz, PCIe Gen5 x16
    "h200-sxm-141gb": GpuModel(
        name="NVIDIA H200",
        sm_count=132,
        compute_capability=(9, 0),
        pci_device_id=0x2335,
        memory_total_mib=143771,
        power_limit_w=700,
        max_sm_clock_mhz=1980,
        max_mem_clock_mhz=3201,
        pcie_max_gen=5,
        nvlinks=18,
        sxm=True,
        mig=True,
        unsupported=("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetFanSpeed"),
    ),
    # PCIe cards with NVLink: all links inactive without a bridge (node `nvlink: bridge`)
    "a100-pcie-80gb": GpuModel(
        name="NVIDIA A100 80GB PCIe",
        sm_count=108,
        compute_capability=(8, 0),
        pci_device_id=0x20B5,
        memory_total_mib=81920,
        power_limit_w=300,
        max_sm_clock_mhz=1410,
        max_mem_clock_mhz=1512,
        pcie_max_gen=4,
        nvlinks=12,  # three bridges, four links each
        mig=True,
        unsupported=("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetFanSpeed"),  # passive
    ),
    "h100-pcie": GpuModel(
        name="NVIDIA H100 PCIe",
        sm_count=114,
        compute_capability=(9, 0),
        pci_device_id=0x2331,
        memory_total_mib=81559,
        power_limit_w=350,
        max_sm_clock_mhz=1755,
        max_mem_clock_mhz=1593,
        pcie_max_gen=5,
        nvlinks=18,
        # the bridges connect 12 links; 4, 5, 10, 11, 16 and 17 stay inactive by design
        nvlink_bridge_links=(0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15),
        mig=True,
        unsupported=("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetFanSpeed"),
    ),
    # a PCIe Gen4 x8 card: at its best at x8 in any x16 slot
    "a2": GpuModel(
        name="NVIDIA A2",
        sm_count=10,
        compute_capability=(8, 6),
        pci_device_id=0x25B6,
        memory_total_mib=15356,
        power_limit_w=60,
        max_sm_clock_mhz=1770,
        max_mem_clock_mhz=6251,
        pcie_max_gen=4,
        pcie_max_width=8,
        nvlinks=0,
        unsupported=("nvmlDeviceGetNvLinkState", "nvmlDeviceGetFanSpeed"),  # passive cooling
    ),
    "l40s": GpuModel(
        name="NVIDIA L40S",
        sm_count=142,
        compute_capability=(8, 9),
        pci_device_id=0x26B9,
        memory_total_mib=46068,
        power_limit_w=350,
        max_sm_clock_mhz=2520,
        max_mem_clock_mhz=9001,
        pcie_max_gen=4,
        nvlinks=0,
        unsupported=("nvmlDeviceGetNvLinkState", "nvmlDeviceGetFanSpeed"),  # passive cooling
    ),
    "rtx-4090": GpuModel(
        name="NVIDIA GeForce RTX 4090",
        sm_count=128,
        compute_capability=(8, 9),
        pci_device_id=0x2684,
        pci_class=0x030000,
        memory_total_mib=24564,
        power_limit_w=450,
        max_sm_clock_mhz=3105,
        max_mem_clock_mhz=10501,
        pcie_max_gen=4,
        nvlinks=0,
        datacenter=False,
        dcgm_profiling=False,
        unsupported=(
            "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetEccMode",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",  # no ECC, no row remapping
        ),
    ),
}
