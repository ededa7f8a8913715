"""Real-time tests started at collection, in one pytest of their own beside this one.

A test that mostly waits on real time (servers' scrapes and evaluations, a simulated node's
timeline) is marked `@pytest.mark.ahead` (a module: `pytestmark = pytest.mark.ahead`).
When the suite holds other tests too, conftest starts the marked ones at collection in a
child pytest, one after another, and puts a stand-in for each at the end of this run
(`TakenAhead`): it takes that test's own verdict from the child (its failure and output, or
its skip). So the waits of the real-time tests overlap this process's tests instead of
adding to them. A child process, not a thread: other tests patch process-wide state
(time.sleep, socket.socket) that a run beside them would see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

CHILD = "GPUWATCHD_AHEAD_CHILD"  # set in the child pytest: it runs the tests itself
REPORT = "GPUWATCHD_AHEAD_REPORT"  # where the child writes each test's verdict
BUDGET = 600  # seconds for all the tests run ahead (they took ~3 minutes here)

_child: tuple[subprocess.Popen[str], threading.Thread, Path] | None = None
_printed: list[str] = []
_verdicts: dict[str, dict[str, Any]] = {}


def in_child() -> bool:
    return os.environ.get(CHILD) == "1"


def marked(item: pytest.Item) -> bool:
    return item.get_closest_marker("ahead") is not None


def run_ahead(config: pytest.Config, items: list[pytest.Item]) -> None:
    """At collection: start the marked tests in the child pytest where there is something
    else to run beside them, and put their stand-ins last in `items`."""
    marked_items = [item for item in items if marked(item)]
    if not marked_items or len(marked_items) == len(items) or in_child():
        return  # nothing to run beside them: they run here
    start([item.nodeid for item in marked_items], config.rootpath)
    items[:] = [item for item in items if not marked(item)] + [
        TakenAhead.standing_in(item) for item in marked_items
    ]


def start(nodeids: list[str], rootdir: Path) -> None:
    """Start the child pytest for `nodeids` (relative to `rootdir`), run in that order
    (once)."""
    global _child
    if _child is not None or in_child():
        return
    report = Path(tempfile.mkstemp(prefix="gpuwatchd-ahead-", suffix=".jsonl")[1])
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
        cwd=rootdir,
        env={**os.environ, CHILD: "1", REPORT: str(report)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # taken (and reaped) as soon as it ends: no zombie among this process's children
    waiter = threading.Thread(target=_wait, args=(child,), daemon=True)
    _child = (child, waiter, report)
    waiter.start()


def _wait(child: subprocess.Popen[str]) -> None:
    try:
        printed, _ = child.communicate(timeout=BUDGET)
    except subprocess.TimeoutExpired:
        child.kill()
        printed, _ = child.communicate()
        printed += f"\n(killed after {BUDGET} s)"
    _printed.append(printed)


def record(report: pytest.TestReport) -> None:
    """In the child (else nothing): append a phase's verdict where the parent reads it
    (a test's first failure or skip is its verdict; a pass is one only for the call)."""
    path = os.environ.get(REPORT)
    if not in_child() or not path or not (report.failed or report.skipped or report.when == "call"):
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2].removeprefix("Skipped: ")  # (path, line, "Skipped: why")
    else:
        sections = "\n".join(f"{name}\n{content}" for name, content in report.sections)
        text = f"{report.longreprtext}\n{sections}" if report.failed else ""
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def _verdict(nodeid: str) -> dict[str, Any] | None:
    """The child's verdict on `nodeid` once it has ended; None where it gave none."""
    assert _child is not None
    child, waiter, report = _child
    waiter.join()
    if not _verdicts and report.exists():
        for line in report.read_text(encoding="utf-8").splitlines():
            verdict = json.loads(line)
            first = _verdicts.setdefault(verdict["nodeid"], verdict)
            if first["outcome"] == "passed" and verdict["outcome"] != "passed":
                _verdicts[verdict["nodeid"]] = verdict  # a teardown's failure after a pass
    return _verdicts.get(nodeid)


class TakenAhead(pytest.Item):
    """In this pytest, a test run ahead: its outcome is the child's verdict on it."""

    def __init__(self, *, where: tuple[Any, int | None, str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._where = where

    @classmethod
    def standing_in(cls, item: pytest.Item) -> TakenAhead:
        assert item.parent is not None
        return cls.from_parent(item.parent, name=item.name, where=item.reportinfo())

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self._where

    def runtest(self) -> None:
        verdict = _verdict(self.nodeid)
        if verdict is None:
            child = _child[0] if _child else None
            code = child.returncode if child else None
            printed = _printed[0] if _printed else ""
            pytest.fail(
                f"no verdict from the child pytest (tests/ahead.py), exit {code}:\n"
                f"{printed[-8000:]}",
                pytrace=False,
            )
        if verdict["outcome"] == "skipped":
            pytest.skip(verdict["text"])
        if verdict["outcome"] == "failed":
            pytest.fail(
                f"in the child pytest (tests/ahead.py), at {verdict['when']}:\n"
                f"{verdict['text'][-8000:]}",
                pytrace=False,
            )


def clean() -> None:
    """Stop a child still running (a session cut short) and remove its report."""
    if _child is not None:
        child, waiter, report = _child
        if child.poll() is None:
            child.kill()
        waiter.join()
        report.unlink(missing_ok=True)
