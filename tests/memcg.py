"""A memory cgroup for one process, where this machine lets the tests make one.

The shipped unit runs the daemon under `MemoryMax=384M`: a test that attacks its memory
should see it OOM-killed where that limit would kill it, not only read its RSS. cgroup v2
(a `memory` controller the tests may enable) or v1 (`/sys/fs/cgroup/memory`, writable as
root) is used; elsewhere `limited` yields None and the test goes by RSS alone.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _make(limit: int) -> Path | None:
    name = f"gpuwatchd-test-{uuid.uuid4().hex[:12]}"
    v2 = ROOT / "cgroup.controllers"
    with contextlib.suppress(OSError):
        if v2.exists() and "memory" in v2.read_text().split():
            (ROOT / "cgroup.subtree_control").write_text("+memory")
            group = ROOT / name
            group.mkdir()
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
            return group
    with contextlib.suppress(OSError):
        group = ROOT / "memory" / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        return group
    return None


@contextlib.contextmanager
def limited(pid: int, limit: int) -> Iterator[Path | None]:
    """Moves `pid` into a new cgroup allowed `limit` bytes from now on (what it held
    before stays charged where it was: the limit bounds its growth); None where no
    cgroup can be made. The cgroup is removed after (once the process has left it)."""
    group = _make(limit)
    if group is None:
        yield None
        return
    home = _cgroup_of(pid, group)
    try:
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        with contextlib.suppress(OSError):
            for left in (group / "cgroup.procs").read_text().split():
                (home / "cgroup.procs").write_text(left)  # back where it was
            os.rmdir(group)


def _cgroup_of(pid: int, group: Path) -> Path:
    """The directory of `pid`'s cgroup in the hierarchy `group` belongs to."""
    v1 = group.parent.name == "memory"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if ("memory" in controllers.split(",")) if v1 else controllers == "":
            return group.parent / path.lstrip("/")
    return group.parent


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (its peak) of `pid`, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields
