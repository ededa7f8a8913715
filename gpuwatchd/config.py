"""The daemon's configuration: one YAML file, validated, every field defaulted.

Errors name the file, the key path and what was expected; unknown keys are errors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)
from pydantic_core import ErrorDetails

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_LISTEN = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]*):\d{1,5}$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(Exception):
    """A configuration problem, already phrased for the operator."""


def parse_duration(value: Any) -> float:
    """Seconds from a number or a Prometheus-style duration ("500ms", "10s", "1m30s")."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 10s, 1m or a number of seconds")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _DURATION.match(value.strip()):
        return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    raise ValueError("expected a duration such as 10s, 1m or a number of seconds")


def _check_listen(value: Any) -> Any:
    if not (isinstance(value, str) and _LISTEN.match(value)):
        raise ValueError("expected HOST:PORT, e.g. 0.0.0.0:9766 or [::1]:9766")
    return value


Duration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(Strict):
    enabled: bool = True
    interval: Duration = 5.0
    timeout: Duration = 3.0


class NvmlConfig(SourceConfig):
    interval: Duration = 1.0
    timeout: Duration = 2.0


class PcieConfig(SourceConfig):
    interval: Duration = 10.0


def _check_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"expected a regular expression, {pattern!r} is not one ({e})") from e
    return pattern


Regex = Annotated[str, AfterValidator(_check_regex)]


class InterruptsConfig(SourceConfig):
    """gpuwatchd.sources.interrupts: /proc/interrupts rates by class and CPU."""

    cpu_floor: float = Field(100.0, ge=0)  # interrupts/s of one class on one CPU to show it
    storm_threshold: float = Field(10_000.0, gt=0)  # interrupts/s of one row: a storm
    max_cpu_series: int = Field(256, ge=0)  # at most this many {cpu,class} series
    include: tuple[Regex, ...] = ()  # regexes (searched) on action names; none: every row
    exclude: tuple[Regex, ...] = ()


class CpuConfig(SourceConfig):
    """gpuwatchd.sources.cpu: /proc/stat, /proc/pressure/*, /proc/meminfo."""

    per_core: bool = True  # gpuwatchd_cpu_busy_ratio{cpu} for every core
    saturated_threshold: float = Field(0.9, gt=0, le=1)  # a core busier than this is saturated
    pressure: bool = True  # read /proc/pressure/* (PSI)


class DisksConfig(SourceConfig):
    """gpuwatchd.sources.disks: /proc/diskstats as iostat -x shows it, per whole device."""

    include: Regex = ""  # searched in the device name; empty: every device
    exclude: Regex = r"^(?:z?ram|loop|dm-|sr|fd|nbd)[0-9]+$"  # empty: none
    max_devices: int = Field(64, ge=1)  # a bound on series: devices past it (by name) are left out


class InfinibandConfig(SourceConfig):
    """gpuwatchd.sources.infiniband: /sys/class/infiniband port state, rate and counters."""

    include: Regex = ""  # searched in the device name; empty: every device
    exclude: Regex = ""
    # "<device>/<port>" fnmatch pattern -> the port's expected (best) rate in Gb/s
    expected_rates: dict[str, Annotated[float, Field(gt=0)]] = {}
    xmit_wait_bytes_per_tick: float = Field(8.0, gt=0)  # port_xmit_wait tick -> bytes (ibdiagnet)


class SourcesConfig(Strict):
    nvml: NvmlConfig = NvmlConfig()
    pcie: PcieConfig = PcieConfig()
    interrupts: InterruptsConfig = InterruptsConfig()
    cpu: CpuConfig = CpuConfig()
    disks: DisksConfig = DisksConfig()
    infiniband: InfinibandConfig = InfinibandConfig()

    def enabled(self) -> dict[str, SourceConfig]:
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if getattr(self, name).enabled
        }


class Config(Strict):
    listen: Annotated[str, BeforeValidator(_check_listen)] = "0.0.0.0:9766"
    evaluation_interval: Duration = 1.0  # how often rules run and the exposition is rendered
    history: Duration = 600.0  # how far back rules can look
    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    rules_file: Path | None = None
    sources: SourcesConfig = SourcesConfig()

    def listen_address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


def _describe(error: ErrorDetails) -> str:
    path = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}, got {error.get('input')!r}"


def load_config(path: Path | None, **overrides: Any) -> Config:
    """Read and validate `path` (None: all defaults), then apply non-None overrides."""
    data: dict[str, Any] = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"{where}: cannot read: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        data = loaded or {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(f"{where}: {_describe(err)}" for err in e.errors())) from e
