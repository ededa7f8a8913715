"""The models every part of a scenario file shares: strict parsing and a GPU process."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfilingRatios(Strict):
    """DCGM's profiling ratios, 0-1 (fields 1002-1008), of a GPU or a MIG instance."""

    sm_active: float | None = Field(None, ge=0, le=1)
    sm_occupancy: float | None = Field(None, ge=0, le=1)
    tensor_active: float | None = Field(None, ge=0, le=1)
    dram_active: float | None = Field(None, ge=0, le=1)
    fp64_active: float | None = Field(None, ge=0, le=1)
    fp32_active: float | None = Field(None, ge=0, le=1)
    fp16_active: float | None = Field(None, ge=0, le=1)


class GpuProcess(Strict):
    pid: int
    name: str = "python"
    gpu_memory_mib: float = 0
    kind: Literal["compute", "graphics"] = "compute"  # which NVML process list it is in
