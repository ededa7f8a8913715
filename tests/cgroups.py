"""A cgroup path of a test's choosing for one process, where the machine lets a test make
one (as root, in a writable hierarchy).

The probe tells senders apart, and the owner reads a login user, by the path of a
process's cgroup in the hierarchy that organizes processes: cgroup v2's (`0::`), else v1's
`name=systemd`. `placed` makes the path's directories there, moves the process in, and
removes them after; where no such hierarchy is writable, or the path's first directory
exists already (a real systemd's tree: never touched), it yields None.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def _hierarchy() -> Path | None:
    """The mount point of cgroup v2, else of v1's name=systemd hierarchy."""
    v1 = None
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, kind, options, *_ = line.split()
            if kind == "cgroup2":
                return Path(point)
            if kind == "cgroup" and "name=systemd" in options.split(","):
                v1 = Path(point)
    return v1


@contextlib.contextmanager
def placed(pid: int, path: str) -> Iterator[str | None]:
    """`pid` in the cgroup `path` ("/a/b/c", made below the hierarchy's root) while the
    block runs; yields `path`, or None where it cannot be done."""
    root = _hierarchy()
    parts = [p for p in path.split("/") if p]
    if os.geteuid() != 0 or root is None or not parts or (root / parts[0]).exists():
        yield None
        return
    made = [root.joinpath(*parts[: i + 1]) for i in range(len(parts))]
    try:
        for directory in made:
            directory.mkdir()
        (made[-1] / "cgroup.procs").write_text(str(pid))
    except OSError:
        _remove(root, made)
        yield None
        return
    try:
        yield path
    finally:
        _remove(root, made)


def _remove(root: Path, made: list[Path]) -> None:
    """Back to the root whatever is still in the leaf, then the directories, deepest first."""
    with contextlib.suppress(OSError):
        for left in (made[-1] / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(left)
    for directory in reversed(made):
        with contextlib.suppress(OSError):
            directory.rmdir()
