"""Packaging and install (issue 12): the wheel carries its data and runs outside the
checkout; deploy/install.sh lays a tree into DESTDIR, again the same, and takes it away."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import tomllib
from daemon_process import require_tool
from wheel_venv import ROOT, built_wheel, scratch, wheel_venv

from gpuwatchd.sim.scenario import builtin_scenarios

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_metadata_keeps_building() -> None:
    """An SPDX license string with its file, and one exact build backend."""
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    (backend,) = PYPROJECT["build-system"]["requires"]
    assert re.fullmatch(r"setuptools==[\d.]+", backend)
    assert backend in project["optional-dependencies"]["test"]  # the same one without isolation
    log = (built_wheel().parent / "build.log").read_text()
    assert not re.search(r"deprecat", log, re.IGNORECASE), log


def test_wheel_carries_its_data() -> None:
    with zipfile.ZipFile(built_wheel()) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read("gpuwatchd-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "gpuwatchd-0.1.0.dist-info/licenses/LICENSE" in names
    assert "gpuwatchd/rules/default.yaml" in names
    assert "gpuwatchd/sim/fake_dcgm/pydcgm.py" in names
    scenarios = {Path(n).stem for n in names if n.startswith("gpuwatchd/sim/scenarios/")}
    assert scenarios >= set(builtin_scenarios())
    dashboards = {n.rsplit("/", 1)[1] for n in names if "/share/gpuwatchd/grafana/" in n}
    assert dashboards == {p.name for p in (ROOT / "grafana").glob("*.json")} != set()


def run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command of the installed wheel, from a directory that is not the checkout."""
    return subprocess.run(
        [str(venv / "bin" / "gpuwatchd"), *args],
        cwd=venv,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )


def test_installed_wheel_runs_outside_the_checkout() -> None:
    venv = wheel_venv()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import gpuwatchd; print(gpuwatchd.__file__)"],
        cwd=venv,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where).is_relative_to(venv) and not Path(where).is_relative_to(ROOT)
    assert list((venv / "share" / "gpuwatchd" / "grafana").glob("*.json"))
    listed = run(venv, "scenarios")
    assert listed.returncode == 0, listed.stderr
    assert {line.split(":")[0] for line in listed.stdout.splitlines()} == set(builtin_scenarios())
    # a packaged scenario, the default rules and the simulated DCGM bindings, end to end
    checked = run(venv, "simulate", "memory-bandwidth-bound", "--check")  # DCGM's DRAM activity
    assert checked.returncode == 0, checked.stdout + checked.stderr


INSTALL = ROOT / "deploy" / "install.sh"


def install(destdir: Path, *args: str) -> str:
    """install.sh into DESTDIR. Only the wheel is installed (no index, no dependencies:
    the test adds this session's site-packages to the laid virtualenv to run it)."""
    env = dict(
        os.environ,
        DESTDIR=str(destdir),
        PYTHON=getattr(sys, "_base_executable", sys.executable),
        PIP_NO_INDEX="1",
        PIP_NO_DEPS="1",
    )
    result = subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def tree(root: Path) -> dict[str, bytes]:
    """Every file and link under root, by path: its content or link target (no bytecode)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(root))] = os.readlink(path).encode()
        elif path.is_file() and path.suffix != ".pyc":
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def test_install_sh_lays_the_tree_upgrades_in_place_and_uninstalls() -> None:
    destdir = scratch("gpuwatchd-destdir-")
    prefix = "/opt/gpu-watch"  # not the default: the unit must follow it
    install(destdir, "--prefix", prefix, "--wheel", str(built_wheel()))
    laid = tree(destdir)
    unit = laid["etc/systemd/system/gpuwatchd.service"].decode()
    assert unit == (ROOT / "systemd" / "gpuwatchd.service").read_text().replace(
        "/opt/gpuwatchd", prefix
    )
    assert (
        laid["etc/sysusers.d/gpuwatchd.conf"]
        == (ROOT / "systemd" / "gpuwatchd.sysusers.conf").read_bytes()
    )
    assert (
        laid["etc/gpuwatchd/gpuwatchd.yaml"] == (ROOT / "systemd" / "gpuwatchd.yaml").read_bytes()
    )
    assert laid["usr/local/bin/gpuwatchd"] == f"{prefix}/bin/gpuwatchd".encode()
    assert laid[f"{prefix[1:]}/bin/gpuwatchd"].startswith(f"#!{prefix}/bin/python".encode())
    staged = [p for p, data in laid.items() if str(destdir).encode() in data and b"\0" not in data]
    assert staged == []  # every path names the final place, none the staging one

    # the laid virtualenv runs: its command checks the rules laid beside the config
    venv = destdir / prefix[1:]
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    rules = destdir / "etc" / "gpuwatchd" / "default-rules.yaml"
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "gpuwatchd", "rules", "check", str(rules)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    (site / "test-dependencies.pth").unlink()

    # again: the same tree, and the operator's configuration kept
    config = destdir / "etc" / "gpuwatchd" / "gpuwatchd.yaml"
    config.write_text("listen: 127.0.0.1:9766\n")
    output = install(destdir, "--prefix", prefix, "--wheel", str(built_wheel()))
    assert "keeping" in output and config.read_text() == "listen: 127.0.0.1:9766\n"
    again = tree(destdir)
    assert again.keys() == laid.keys()
    assert {p for p in laid if laid[p] != again[p]} <= {"etc/gpuwatchd/gpuwatchd.yaml"}

    install(destdir, "--prefix", prefix, "--uninstall")
    assert list(tree(destdir)) == ["etc/gpuwatchd/gpuwatchd.yaml"]


def test_install_sh_refuses_a_relative_prefix(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(INSTALL), "--prefix", "opt", "--uninstall"],
        env=dict(os.environ, DESTDIR=str(tmp_path)),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "absolute" in result.stderr


def test_install_sh_passes_shellcheck() -> None:
    shellcheck = subprocess.run(
        [require_tool("shellcheck"), str(INSTALL)], capture_output=True, text=True
    )
    assert shellcheck.returncode == 0, shellcheck.stdout
