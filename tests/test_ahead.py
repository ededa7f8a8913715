"""tests/ahead.py: a test run ahead in the child pytest passes, fails or skips here as it
did there, each on its own verdict, with the child's output for a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ahead

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import ahead

def pytest_configure(config):
    config.addinivalue_line("markers", "ahead: run ahead")

def pytest_collection_modifyitems(config, items):
    ahead.run_ahead(config, items)

def pytest_runtest_logreport(report):
    ahead.record(report)

def pytest_sessionfinish():
    ahead.clean()
"""

TESTS_RUN = """
import os
import pytest

def ran(name):
    with open(f"{name}.pid", "w") as f:
        f.write(str(os.getpid()))

@pytest.fixture
def breaks_at_teardown():
    yield
    raise RuntimeError("teardown broke")

@pytest.mark.ahead
def test_passes():
    ran("passes")

@pytest.mark.ahead
@pytest.mark.parametrize("x", [1, 2])
def test_one_of_two_fails(x):
    print("said in the child")
    assert x == 1, "two is not one"

@pytest.mark.ahead
def test_skips():
    pytest.skip("no server here")

@pytest.mark.ahead
def test_breaks_at_teardown(breaks_at_teardown):
    pass

def test_here():
    ran("here")
"""


def test_each_test_run_ahead_takes_its_own_verdict(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_some.py").write_text(TESTS_RUN)
    env = {k: v for k, v in os.environ.items() if k not in (ahead.CHILD, ahead.REPORT)}
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out
    summary = {
        line.split(" - ")[0] for line in out.splitlines() if line.startswith(("PASSED", "FAILED"))
    }
    assert summary == {
        "PASSED test_some.py::test_here",
        "PASSED test_some.py::test_passes",
        "PASSED test_some.py::test_one_of_two_fails[1]",
        "FAILED test_some.py::test_one_of_two_fails[2]",
        "FAILED test_some.py::test_breaks_at_teardown",
    }, out
    assert "SKIPPED [1]" in out and "no server here" in out, out
    # the failure's own assertion and output, from the child
    assert "AssertionError: two is not one" in out and "said in the child" in out, out
    assert "RuntimeError: teardown broke" in out and "at teardown:" in out, out
    # the marked tests ran in another process than the rest
    assert (tmp_path / "passes.pid").read_text() != (tmp_path / "here.pid").read_text()
