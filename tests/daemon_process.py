"""Start `gpuwatchd run --simulate` as a real subprocess and find where it listens."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import pytest
import yaml

from gpuwatchd.sim.scenario import SCENARIO_PACKAGE

# `--config` for a daemon that exports every family, those shown only in detail too
DETAIL = ("--config", str(Path(__file__).parent / "fixtures" / "config" / "detail_metrics.yaml"))


@contextmanager
def running_daemon(scenario: str, *extra: str) -> Iterator[str]:
    """Yields the /metrics URL once the daemon prints that it serves; stops it after."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--simulate",
            scenario,
            "--listen",
            "127.0.0.1:0",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    url = None
    for line in proc.stderr:  # the daemon prints its bound address once it serves
        if "gpuwatchd: serving" in line:
            url = line.rsplit(" on ", 1)[1].strip()
            break
    if url is None:
        proc.kill()
        pytest.fail(f"daemon exited before serving (rc={proc.wait()})")
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def require_tool(name: str) -> str:
    """Path of a real tool; CI installs them, so missing there is a failure, not a skip."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; .ci/run should install it")
        pytest.skip(f"{name} not installed (apt-get install prometheus)")
    return path


def shorten(scenario: str, durations: dict[str, str], tmp_path: Path) -> Path:
    """A built-in scenario with its phases' durations replaced (and its expectations
    dropped: the end-to-end tests check alerts, not causes)."""
    data = yaml.safe_load((resources.files(SCENARIO_PACKAGE) / f"{scenario}.yaml").read_text())
    for phase in data["phases"]:
        phase["duration"] = durations[phase["name"]]
    data.pop("expect", None)
    path = tmp_path / f"{scenario}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
