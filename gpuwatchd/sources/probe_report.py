"""The probe's report: what gpuwatchd.probe sends from a training process, as the daemon
checks it (pydantic; every number finite and in range). The probe source (probe.py)
validates each datagram against `Report`; where reports land (probe_gpus.py) reads its
parts. Neither imports the other for it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Bounds: what a real process can report, and what a float64 (Prometheus' sample type)
# carries exactly. A value outside them (10**400 batches, Infinity) refuses the report.
COUNT_MAX = 2**53  # counts: exact as a float64
SETTING_MAX = 2**31  # DataLoader settings, ranks, device indices
SECONDS_MAX = 1e9  # 31 years of waiting, computing or initialising
BYTES_MAX = 2**60  # an exbibyte: beyond any GPU's memory
TIMESTAMP_MAX = 1e10  # unix time in the year 2286

Count = Annotated[int, Field(ge=0, lt=COUNT_MAX)]
Setting = Annotated[int, Field(ge=0, lt=SETTING_MAX)]
Seconds = Annotated[float, Field(ge=0, lt=SECONDS_MAX)]
Bytes = Annotated[float, Field(ge=0, lt=BYTES_MAX)]
Timestamp = Annotated[float, Field(ge=0, lt=TIMESTAMP_MAX)]


class _Part(BaseModel):
    # newer probes may send more; NaN and infinities are never a measurement
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class Loader(_Part):
    num_workers: Setting | None = None
    pin_memory: bool | None = None
    prefetch_factor: Setting | None = None
    persistent_workers: bool | None = None
    batch_size: Setting | None = None


class Cuda(_Part):
    device: Setting
    uuid: str | None = Field(None, max_length=80)
    reserved_bytes: Bytes
    allocated_bytes: Bytes
    inactive_split_bytes: Bytes = 0
    largest_free_block_bytes: Bytes | None = None
    alloc_retries: Count = 0
    ooms: Count = 0
    init_seconds: Seconds | None = None
    init_timestamp: Timestamp | None = None


class Report(_Part):
    v: Annotated[int, Field(ge=1, lt=SETTING_MAX)]
    batches: Count
    wait_seconds: Seconds
    compute_seconds: Seconds
    rank: Setting | None = None
    local_rank: Setting | None = None
    loader: Loader | None = None
    cuda: Cuda | None = None
