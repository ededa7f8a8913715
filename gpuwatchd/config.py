"""The daemon's configuration: one YAML file, validated, every field defaulted.

Errors name the file, the key path and what was expected; unknown keys are errors.
"""

from __future__ import annotations

import os
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from gpuwatchd.filetrust import refusal

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_LISTEN = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]*):\d{1,5}$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(Exception):
    """A configuration problem, already phrased for the operator."""


MAX_FILE_BYTES = 1 << 20  # a config or rule file (the default rules: 28 KB)


class FileError(Exception):
    """A file that cannot be read as configuration; the message says why."""


def read_text_file(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    """A configuration file's UTF-8 text, read so that it cannot block or run away: a
    regular file only (a FIFO would hold the reader until someone writes to it), at most
    `limit` bytes, that only root or the daemon's user can write (gpuwatchd/filetrust.py).
    Raises FileError."""
    real = os.path.realpath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(real, flags)
    except OSError as e:
        raise FileError(f"cannot read: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if (problem := refusal(real, st)) is not None:
            raise FileError(problem)
        data = b""
        if st.st_size <= limit:  # read one byte more: a file that grew is caught too
            while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
                data += chunk
        size = max(st.st_size, len(data))
        if size > limit:
            raise FileError(f"is {size} bytes, more than the {limit} allowed")
    except OSError as e:
        raise FileError(f"cannot read: {e.strerror}") from e
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise FileError(f"not UTF-8 text: byte 0x{data[e.start]:02x} on line {line}") from e


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
    if int(value.rpartition(":")[2]) > 65535:
        raise ValueError("expected HOST:PORT with a port of 0-65535")
    return value


MIN_INTERVAL = 0.1  # polling or evaluating more often burns CPU and measures nothing new
MAX_INTERVAL = 86400.0  # a day
MAX_DURATION = 7 * 86400.0  # a week: anything longer is a mistake (and overflows a wait)
Duration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=MAX_DURATION)]
Interval = Annotated[
    float, BeforeValidator(parse_duration), Field(ge=MIN_INTERVAL, le=MAX_INTERVAL)
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(Strict):
    enabled: bool = True
    interval: Interval = 5.0
    timeout: Duration = 3.0


class NvmlConfig(SourceConfig):
    interval: Interval = 1.0
    timeout: Duration = 2.0
    # NVLinks every GPU with NVLink must have up besides those seen up since the daemon
    # started: "all", or link indices (bridged H100 PCIe: 0-3, 6-9, 12-15). Says what a
    # board without NVSwitches wires, so a link down before the start counts too
    expected_nvlinks: Literal["all"] | tuple[Annotated[int, Field(ge=0, le=63)], ...] = ()


class PcieConfig(SourceConfig):
    interval: Interval = 10.0


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

    # gpuwatchd_cpu_busy_ratio{cpu} and _interrupt_ratio{cpu} for every core (a series per
    # core and family: off by default, per NUMA node instead; node_exporter has per-CPU)
    per_core: bool = False
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


DCGM_DEFAULT_FIELDS: tuple[int, ...] = (
    *range(1001, 1013),  # profiling: engine/SM/pipe/DRAM activity, PCIe and NVLink bytes/s
    *(155, 156),  # power, energy
    *(202, 230),  # PCIe replays, last Xid
    *range(240, 246),  # clock violation (throttle) time
    *(409, 419, 429, 439),  # NVLink CRC flit/data, replay, recovery errors
    *(393, 394),  # remapped rows (pending and failure: the nvml source, for every node)
)


def _check_hostengine(value: Any) -> Any:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            'expected "localhost", "host:port", "unix:///path/to/socket" or "embedded"'
        )
    if value.startswith("unix://") and not value.removeprefix("unix://").startswith("/"):
        raise ValueError('a unix socket address is an absolute path: "unix:///run/dcgm.sock"')
    return value.strip()


# DCGM's text and binary fields (dcgm_fields.cpp, DCGM 3.3 to 4.6; an id keeps its type):
# their values are strings or structs, not numbers
DCGM_TEXT_FIELDS = frozenset(
    {1, 2, 3, 50, 51, 53, 54, 56, 57, 68, 80, 81, 82, 85, 172, 520, 521, 523, 524, 532, 533}
    | {571, 572, 877, 878, 1140, 1141, 1502, 1524}
)
DCGM_BINARY_FIELDS = frozenset(
    {60, 61, 62, 75, 76, 77, 91, 130, 165, 166, 167, 205, 220, 221, 362, *range(501, 514)}
    | {528, 529, 530, 531}
)


def _check_fields(value: Any) -> Any:
    if isinstance(value, list):
        seen: list[int] = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= 65535:
                raise ValueError(f"expected DCGM field ids (1-65535), got {item!r}")
            if item in DCGM_TEXT_FIELDS or item in DCGM_BINARY_FIELDS:
                kind = "text field (DCGM_FT_STRING)"
                if item in DCGM_BINARY_FIELDS:
                    kind = "binary field (DCGM_FT_BINARY)"
                raise ValueError(
                    f"field {item} is a {kind}; expected numeric DCGM fields (int64 or double)"
                )
            if item not in seen:
                seen.append(item)
        return seen
    return value


class DcgmConfig(SourceConfig):
    """gpuwatchd.sources.dcgm: DCGM profiling and device fields (docs/dcgm.md)."""

    interval: Interval = 5.0
    timeout: Duration = 5.0
    bindings_path: Path | None = None  # None: where DCGM 4, then DCGM 3, install them
    hostengine: Annotated[str, BeforeValidator(_check_hostengine)] = "localhost"
    connect_timeout: Duration = 2.0  # one connection attempt (DCGM's own default is 5 s)
    fields: Annotated[list[int], BeforeValidator(_check_fields)] = Field(
        default_factory=lambda: list(DCGM_DEFAULT_FIELDS)
    )
    exporter_compat: bool = False  # also emit dcgm-exporter's metric names and labels
    compat_hostname_label: Literal["Hostname", "hostname"] = "Hostname"
    reconnect_backoff_max: Duration = 300.0
    profiling_retry: Duration = 60.0  # retry a refused profiling watch this often
    max_profiling_pause: Duration = 3600.0

    @model_validator(mode="after")
    def _timeouts(self) -> DcgmConfig:
        if self.connect_timeout >= self.timeout:
            raise ValueError(
                f"connect_timeout ({self.connect_timeout:g}s) must be shorter than "
                f"timeout ({self.timeout:g}s)"
            )
        return self


class ProcessesConfig(SourceConfig):
    """gpuwatchd.sources.processes: the processes on each GPU (NVML), /proc and cgroups."""

    interval: Interval = 5.0
    # polls between two scans of /proc (desktop processes that hold no GPU, the fabric
    # manager, children of other threads, cudart not found yet, workers on kernels
    # without task/*/children)
    scan_every: int = Field(12, ge=1)
    desktop: bool = True  # count desktop processes the scan finds (else only NVML's lists)
    max_threads: int = Field(1024, ge=1)  # threads read per process per poll
    # owner attribution (docs/fleet.md): gpuwatchd_gpu_owner_info per owned GPU
    owner: bool = True
    # read the launcher's variables in /proc/PID/environ (SLURM_*, RANK, WORLD_SIZE, …;
    # only those kept, never logged). On: they tell a job's ranks from sibling notebooks
    # (peers()) and give the rank; unreadable (another user, no CAP_SYS_PTRACE) costs
    # nothing but that
    owner_environ: bool = True
    job_mapping_dir: Path | None = None  # a prolog's per-GPU job files; None: not read
    # the kubelet's pod-resources socket (absent off Kubernetes: not asked); None: never
    pod_resources_socket: Path | None = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    pod_resources_timeout: Duration = Field(0.5, le=10.0)  # one List call
    pod_resources_refresh: Duration = Field(10.0, ge=1.0, le=3600.0)  # List at most this often

    @model_validator(mode="after")
    def _pod_resources_timeout(self) -> ProcessesConfig:
        if self.pod_resources_timeout >= self.timeout:
            raise ValueError(
                f"pod_resources_timeout ({self.pod_resources_timeout:g}s) must be shorter "
                f"than timeout ({self.timeout:g}s): the List call runs within a poll"
            )
        return self


class ProbeConfig(SourceConfig):
    """gpuwatchd.sources.probe: reports of gpuwatchd.probe inside training processes."""

    interval: Interval = 1.0
    timeout: Duration = 2.0
    # created mode 0666: any local process may report, the kernel names the sender
    socket: Path = Path("/run/gpuwatchd/probe.sock")
    max_report_bytes: int = Field(8192, ge=256)  # a bigger datagram is dropped
    max_reports_per_second: float = Field(5.0, gt=0)  # per pid, bursts of twice that
    expire_after: Duration = 30.0  # a pid silent this long is forgotten (a dead one at once)


class KmsgConfig(SourceConfig):
    # the kernel log's lines are events: read them within a second of their logging, so
    # that the rules' evidence has them when NVML's Xid event fires a cause (one read
    # that finds nothing costs a system call)
    interval: Interval = 1.0
    path: Path = Path("/dev/kmsg")
    max_records: int = Field(1000, ge=1, le=100_000)  # per poll; the rest wait for the next


class SourcesConfig(Strict):
    nvml: NvmlConfig = NvmlConfig()
    pcie: PcieConfig = PcieConfig()
    dcgm: DcgmConfig = DcgmConfig()
    interrupts: InterruptsConfig = InterruptsConfig()
    cpu: CpuConfig = CpuConfig()
    disks: DisksConfig = DisksConfig()
    infiniband: InfinibandConfig = InfinibandConfig()
    processes: ProcessesConfig = ProcessesConfig()
    probe: ProbeConfig = ProbeConfig()
    kmsg: KmsgConfig = KmsgConfig()

    def enabled(self) -> dict[str, SourceConfig]:
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if getattr(self, name).enabled
        }


class Config(Strict):
    listen: Annotated[str, BeforeValidator(_check_listen)] = "0.0.0.0:9766"
    evaluation_interval: Interval = 1.0  # how often the rules run (scrapes render)
    history: Duration = 600.0  # how far back rules can look
    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    rules_file: Path | None = None
    web_config_file: Path | None = None  # exporter-toolkit's format: TLS, basic auth
    # also export the families marked `detail` in docs/metrics.md (the rules' evidence,
    # configuration and constants: about 3x the series); the rules and the status page
    # read them either way
    detail_metrics: bool = False
    sources: SourcesConfig = SourcesConfig()

    def listen_address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


def _describe(error: ErrorDetails) -> str:
    path = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}, got {brief(error.get('input'))}"


def brief(value: Any) -> str:
    """repr() of a value as an error shows it: bounded, even for a YAML alias bomb."""
    return _BRIEF.repr(value)


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80


def load_config(path: Path | None, **overrides: Any) -> Config:
    """Read and validate `path` (None: all defaults), then apply non-None overrides."""
    data: dict[str, Any] = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(read_text_file(Path(path)))
        except FileError as e:
            raise ConfigError(f"{where}: {e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from e
        except RecursionError as e:
            raise ConfigError(f"{where}: not valid YAML: nested too deeply") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        data = loaded or {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(f"{where}: {_describe(err)}" for err in e.errors())) from e
