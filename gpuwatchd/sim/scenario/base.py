"""The models every part of a scenario file shares: strict parsing and a GPU process."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuProcess(Strict):
    pid: int
    name: str = "python"
    gpu_memory_mib: float = 0
    kind: Literal["compute", "graphics"] = "compute"  # which NVML process list it is in
