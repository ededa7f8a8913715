"""gpuwatchd's wheel, built once per test session and installed into a fresh venv outside
the checkout, the way install.sh lays /opt/gpuwatchd.

The venv's interpreter is the system's own (/usr/bin/pythonX.Y where it exists), so that
an unprivileged user can run it; a pyenv interpreter under /root is out of their reach.
Only the wheel is installed, without the index: its dependencies come from this test
session's venv through a .pth line (a plain path: that venv's editable install of the
checkout is not loaded), which keeps the test at seconds.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scratch(prefix: str) -> Path:
    """A directory outside the checkout that any user can read, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def built_wheel() -> Path:
    """`python -m build`: the sdist, then the wheel built from that sdist."""
    out = scratch("gpuwatchd-dist-")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    (out / "build.log").write_text(build.stdout)  # the backend's warnings, for the tests
    assert build.returncode == 0, build.stdout
    (wheel,) = out.glob("gpuwatchd-*.whl")
    return wheel


def system_python() -> str:
    """This Python's version as the system installs it, else this Python's own."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/python{version}", getattr(sys, "_base_executable", "")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


@functools.cache
def wheel_venv() -> Path:
    """A fresh venv with only the built wheel installed in it."""
    venv = scratch("gpuwatchd-venv-")
    subprocess.run([system_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--no-index", "--no-deps", str(built_wheel())],
        check=True,
    )  # fmt: skip
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv
