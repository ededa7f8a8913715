"""How the simulator's writers put files: whole, and only when they changed.

A reader (a source polling in its own thread) must never see a half-written file, so
content goes to a temporary file that is renamed over the old one. Rewriting unchanged
files every tick would cost most of a writer's time, so the last content of each path
is remembered and only a change is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable

# A file that refuses reading with EACCES, even to root: sysctl checks a write-only
# entry's mode itself (proc_sys_permission), not through CAP_DAC_OVERRIDE.
UNREADABLE = "/proc/sys/vm/drop_caches"


class Files:
    def __init__(self) -> None:
        self._content: dict[str, str] = {}
        self._made: set[str] = set()
        self.writes = 0  # files written so far (changes, not calls)

    def put(self, path: str, content: str) -> bool:
        """Write `content` to `path` if it differs from what is there; True if written."""
        return self._replace(path, content, lambda tmp: _write(tmp, content))

    def deny(self, path: str) -> bool:
        """Make `path` refuse reading with EACCES, as /proc/PID/environ does to a reader
        that may not ptrace the process (the simulated daemon may run as root). A symlink:
        the reader follows it, as the kernel's own /proc links are followed."""
        return self._replace(path, UNREADABLE, _symlink_to_unreadable)

    def _replace(self, path: str, content: str, make: Callable[[str], object]) -> bool:
        """Put what `make` creates at a temporary path over `path`, unless `content` (what
        it stands for) is already there; True if written."""
        if self._content.get(path) == content:
            return False
        head, _, tail = path.rpartition("/")
        if head not in self._made:
            os.makedirs(head, exist_ok=True)
            self._made.add(head)
        tmp = f"{head}/.{tail}.tmp"
        make(tmp)
        os.replace(tmp, path)
        self._content[path] = content
        self.writes += 1
        return True

    def forget(self, directory: str) -> None:
        """Forget every path under `directory` (which the caller has just removed)."""
        prefix = directory.rstrip("/") + "/"
        for path in [p for p in self._content if p.startswith(prefix)]:
            del self._content[path]
        self._made = {d for d in self._made if d != directory and not d.startswith(prefix)}


def _write(path: str, content: str) -> None:
    with open(path, "w") as f:
        f.write(content)


def _symlink_to_unreadable(path: str) -> None:
    if os.path.lexists(path):  # left by an interrupted write
        os.unlink(path)
    os.symlink(UNREADABLE, path)
