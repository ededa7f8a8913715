"""Real-time end-to-end tests started at collection, in a pytest of their own.

A test module that waits minutes of real time on servers and simulated nodes sets
`AHEAD = True` (and each of its tests begins `if ahead.ran_ahead(__name__): return`):
conftest starts its tests in a child pytest as soon as they are
collected, and runs them last in this one, where each only takes the child's verdict.
A child process, not a thread: other tests patch process-wide state (time.sleep,
socket.socket) that a run beside them would see.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

CHILD = "GPUWATCHD_AHEAD_CHILD"  # set in the child pytest: it runs the tests itself
BUDGET = 300  # seconds for a module's tests in the child

_started: dict[str, tuple[subprocess.Popen[str], threading.Thread]] = {}
_verdicts: dict[str, tuple[int, str]] = {}


def in_child() -> bool:
    return os.environ.get(CHILD) == "1"


def start(module: str, nodeids: list[str]) -> None:
    """Start the child pytest for `module`'s selected tests (once)."""
    if module in _started or in_child():
        return
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
        env={**os.environ, CHILD: "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # taken (and reaped) as soon as it ends: no zombie among this process's children
    waiter = threading.Thread(target=_wait, args=(module, child), daemon=True)
    _started[module] = (child, waiter)
    waiter.start()


def _wait(module: str, child: subprocess.Popen[str]) -> None:
    try:
        printed, _ = child.communicate(timeout=BUDGET)
    except subprocess.TimeoutExpired:
        child.kill()
        printed, _ = child.communicate()
        printed += f"\n(killed after {BUDGET} s)"
    _verdicts[module] = (child.returncode, printed)


def ran_ahead(module: str) -> bool:
    """In the parent pytest: True once the child passed `module`'s tests (a failure in
    it fails here, with its output); False where the test is to run itself."""
    if in_child() or module not in _started:
        return False
    _started[module][1].join()
    returncode, printed = _verdicts[module]
    if returncode != 0:
        pytest.fail(f"in the child pytest (tests/ahead.py), exit {returncode}:\n{printed[-8000:]}")
    return True


def clean() -> None:
    """Stop children still running (a session cut short)."""
    for child, waiter in _started.values():
        if child.poll() is None:
            child.kill()
        waiter.join()
