"""The source contract: one kind of telemetry, one class, polled on its own interval."""

from __future__ import annotations

import errno
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import MetricSpec, Sample

Settings = TypeVar("Settings", bound=SourceConfig)


def settings_of(config: SourceConfig, kind: type[Settings]) -> Settings:
    """`config` as its source's own settings: a plain SourceConfig (as a test or a
    generic caller gives) takes the class's defaults for the rest."""
    if isinstance(config, kind):
        return config
    return kind.model_validate({name: getattr(config, name) for name in SourceConfig.model_fields})


class SourceError(Exception):
    """The whole source failed this poll (its series go stale); the message says why."""


@dataclass
class Context:
    """What sources may touch on this node: file roots and the NVML binding to use.

    Tests and the simulator point the roots at written trees and pass a simulated
    `pynvml`; production passes /proc, /sys and the real nvidia-ml-py module.
    """

    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    pynvml: ModuleType | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Source(ABC):
    name: ClassVar[str]
    metrics: ClassVar[tuple[MetricSpec, ...]]

    def __init__(self, config: SourceConfig, context: Context) -> None:
        self.config = config
        self.context = context

    @abstractmethod
    def collect(self) -> list[Sample]:
        """Return every current sample, or raise SourceError (or anything) on failure."""

    def close(self) -> None:  # noqa: B027 - most sources hold nothing
        """Release what the source holds (library handles, threads)."""


def not_mounted(path: object, setting: str, root: Path) -> SourceError:
    """The error for a kernel file or directory that is not there at all."""
    return SourceError(
        f"{path} does not exist: is {setting} mounted at {root}? "
        f"(set `{setting}:` in the config to where it is)"
    )


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_kernel_file(path: str) -> int:
    """A descriptor for reading a kernel file, opened so that it cannot block the poll.

    procfs and sysfs pseudo-files are regular files; anything else put at such a path (a
    FIFO, a device) is refused: opening a FIFO to read waits for a writer forever, and a
    poll stuck there never ends. O_NONBLOCK also turns a pseudo-file that would wait for
    data (like /proc/kmsg) into EAGAIN. Raises OSError.
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO or a device?)", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_each(paths: Iterable[str], limit: int = 4096) -> list[bytes | None]:
    """`read_small` of each path, None where it raised OSError or ValueError: a poll's
    many sysfs attributes read in one loop, without three Python calls a file. What is
    not a regular file (a FIFO, a device) is None, refused as `open_kernel_file` does."""
    out: list[bytes | None] = []
    open_, fstat, read, close, regular = os.open, os.fstat, os.read, os.close, stat.S_ISREG
    for path in paths:
        try:
            fd = open_(path, _OPEN_FLAGS)
            try:
                data = read(fd, limit) if regular(fstat(fd).st_mode) else None
            finally:
                close(fd)
        except (OSError, ValueError):
            data = None
        out.append(data)
    return out


def read_small(path: str, limit: int = 4096) -> bytes:
    """A sysfs attribute (one value) in a single read; raises OSError."""
    fd = open_kernel_file(path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def read_file(path: str, limit: int = 4 << 20) -> bytes:
    """A kernel file's bytes, up to `limit`, read to its end; raises OSError."""
    fd = open_kernel_file(path)
    try:
        parts: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(1 << 16, limit - size))
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def read_text(path: str) -> str:
    """A kernel file's text (raises OSError); bytes that are not UTF-8 become U+FFFD."""
    return read_file(path).decode("utf-8", "replace")


def read_kernel_file(path: str, setting: str, root: Path, limit: int = 4 << 20) -> str:
    """A procfs/sysfs file's text, or a SourceError that names the file and the setting."""
    try:
        return read_file(path, limit).decode("utf-8", "replace")
    except FileNotFoundError as e:
        raise not_mounted(path, setting, root) from e
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from e
