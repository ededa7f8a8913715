"""Helpers shared by the source tests: a virtual clock and samples keyed for lookups; and
what loading a FIFO raises (config and rule files must never block on one)."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatchd.metrics import Sample

Key = tuple[str, tuple[str, ...]]


class Clock:
    """A virtual clock for `context.extras["clock"]`: time moves only when a test sets `t`."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def by_key(samples: list[Sample]) -> dict[Key, float]:
    """(name without the gpuwatchd_ prefix, labels) -> value; a duplicate series fails."""
    keyed = {(s.name.removeprefix("gpuwatchd_"), s.labels): s.value for s in samples}
    assert len(keyed) == len(samples), "duplicate series"
    return keyed


class Metrics:
    """Samples by name, then by labels; a duplicate series fails. Tests subclass it with
    their own lookups."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.by_name: dict[str, dict[tuple[str, ...], float]] = defaultdict(dict)
        for name, labels, value in samples:
            assert labels not in self.by_name[name], f"duplicate series {name}{labels}"
            self.by_name[name][labels] = value


def error_loading_fifo(path: Path, load: Callable[[Path], object]) -> BaseException:
    """Make `path` a FIFO with no writer and return what `load(path)` raises; fail the
    test if it blocks (opening a FIFO for reading waits for a writer)."""
    os.mkfifo(path)
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            load(path)
        except BaseException as e:
            outcome.append(e)

    loader = threading.Thread(target=attempt, daemon=True)
    loader.start()
    loader.join(10)
    if loader.is_alive():  # stuck opening the FIFO: let it go, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"reading {path.name} blocked")
    (error,) = outcome
    return error
