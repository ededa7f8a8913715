"""bench/hardware/validate.sh --dry-run, started as soon as the suite is collected.

The dry run plays its phases in real time (~30 s, mostly waiting on the simulated node
and a CPU torch loop): started at collection (tests/conftest.py), it runs beside the
tests before test_hardware_script.py's, which take its outputs when they come to them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "hardware" / "validate.sh"
BUDGET = 150  # seconds: the script's own budget in a dry run

_run: tuple[subprocess.Popen[str], Path, threading.Thread] | None = None
_printed: list[str] = []


def start() -> None:
    """Start the dry run in the background (once)."""
    global _run
    if _run is not None:
        return
    out = Path(tempfile.mkdtemp(prefix="gpuwatchd-dry-run-"))
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("DRY_RUN", None)
    process = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry-run"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # taken (and reaped) as soon as it ends: no zombie among this process's children
    waiter = threading.Thread(target=_wait, args=(process,), daemon=True)
    _run = (process, out, waiter)
    waiter.start()


def _wait(process: subprocess.Popen[str]) -> None:
    try:
        printed, _ = process.communicate(timeout=BUDGET)
    except subprocess.TimeoutExpired:
        process.kill()
        printed, _ = process.communicate()
    _printed.append(printed)


def outputs() -> tuple[int, str, Path]:
    """The dry run's exit status, the tail of what it printed, and its output folder
    (started now if it was not)."""
    start()
    assert _run is not None
    process, out, waiter = _run
    waiter.join()
    return process.returncode, _printed[0][-6000:], out


def clean() -> None:
    """Stop a dry run still going and remove its outputs (at the session's end)."""
    if _run is not None:
        process, out, waiter = _run
        if process.poll() is None:
            process.kill()
        waiter.join()
        shutil.rmtree(out, ignore_errors=True)
