"""Real-time end-to-end runs started at collection, beside the rest of the suite.

A test module that waits minutes of real time on servers and simulated nodes names its
run `AHEAD` (a function of a fresh directory, returning what the test prints): conftest
starts it in a thread as soon as the module's test is collected and the test, run near
the end, takes its result (or its failure, traceback and all). The run's assertions are
the test's; only where they wait moves.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

Run = Callable[[Path], str]

_started: dict[str, tuple[Future[str], Path]] = {}


def start(name: str, run: Run) -> None:
    """Start `run` in a thread of its own (once per name)."""
    if name not in _started:
        where = Path(tempfile.mkdtemp(prefix=f"gpuwatchd-{name}-"))
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"ahead-{name}")
        _started[name] = (pool.submit(run, where), where)
        pool.shutdown(wait=False)


def result(name: str, run: Run) -> str:
    """What `run` returned (started now if it was not); its exception, raised here."""
    start(name, run)
    return _started[name][0].result()


def clean() -> None:
    """Wait for runs still going (a session cut short) and remove their directories."""
    for future, where in _started.values():
        future.exception()
        shutil.rmtree(where, ignore_errors=True)
