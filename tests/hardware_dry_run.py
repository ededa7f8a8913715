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
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "hardware" / "validate.sh"
BUDGET = 150  # seconds: the script's own budget in a dry run

_run: tuple[subprocess.Popen[str], Path] | None = None


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
    _run = (process, out)


def outputs() -> tuple[int, str, Path]:
    """The dry run's exit status, the tail of what it printed, and its output folder
    (started now if it was not)."""
    start()
    assert _run is not None
    process, out = _run
    try:
        printed, _ = process.communicate(timeout=BUDGET)
    except subprocess.TimeoutExpired:
        process.kill()
        printed, _ = process.communicate()
    return process.returncode, printed[-6000:], out


def clean() -> None:
    """Stop a dry run still going and remove its outputs (at the session's end)."""
    if _run is not None:
        process, out = _run
        if process.poll() is None:
            process.kill()
            process.communicate()
        shutil.rmtree(out, ignore_errors=True)
