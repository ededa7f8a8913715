"""DCGM's Python bindings: finding and loading them privately, and their object registries.

The bindings (`pydcgm`, `dcgm_structs`, `dcgm_agent`, ...) are not on PyPI; they ship
with DCGM. They import each other by bare name, so `load_bindings` puts the directory
on `sys.path` only while importing them, then takes it and the modules out of
`sys.path` and `sys.modules` again (restoring any same-named modules it displaced): the
source holds a private copy and the rest of the process never sees them.

Whoever can write that directory, a file in it or a directory above it runs code as the
daemon, so it is refused unless only root and the daemon's user can write any of them
(gpuwatchd/filetrust.py), `__pycache__` included: Python runs the compiled code it
finds there. The check and the import go through the directory's real path, so no link
can be swapped in between.

Since DCGM 4.5, pydcgm tracks objects in class-level registries meant for DCGM's own
tests: `DcgmHandle.handles` keeps every handle it connected (`Shutdown()` leaves it
there) and `DcgmFieldGroup.groups` every field group until its `Delete()`. A daemon
that reconnects for months must untrack them itself: `disconnect` and `forget`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuwatchd.filetrust import distrust_tree

BINDINGS_DIRS = (
    Path("usr/share/datacenter-gpu-manager-4/bindings/python3"),  # DCGM 4
    Path("usr/local/dcgm/bindings/python3"),  # DCGM 3
)
BINDING_MODULES = ("dcgmvalue", "dcgm_structs", "dcgm_fields", "dcgm_agent", "pydcgm")

log = logging.getLogger(__package__)

_LOAD_LOCK = threading.Lock()


class UntrustedBindings(Exception):
    """A bindings directory that someone other than root or the daemon's user could
    change; the message names what and how to fix it."""


@dataclass(frozen=True)
class Bindings:
    """A private copy of DCGM's Python bindings, loaded from `directory`."""

    directory: Path
    modules: dict[str, ModuleType]

    @property
    def pydcgm(self) -> Any:
        return self.modules["pydcgm"]

    @property
    def structs(self) -> Any:
        return self.modules["dcgm_structs"]

    @property
    def agent(self) -> Any:
        return self.modules["dcgm_agent"]

    @property
    def fields(self) -> Any:
        return self.modules["dcgm_fields"]

    @property
    def value(self) -> Any:
        return self.modules["dcgmvalue"]

    def describe(self, error: Any) -> str:
        """ "DCGM_ST_NAME: message" of a DCGMError."""
        code = getattr(error, "value", None)
        structs = self.structs
        names = {getattr(structs, n): n for n in reversed(dir(structs)) if n.startswith("DCGM_ST_")}
        return f"{names.get(code, f'DCGM error {code}')}: {error}"

    def disconnect(self, handle: Any) -> None:
        """Shut a pydcgm.DcgmHandle down and untrack it (DcgmHandle.handles, DCGM 4.5+)."""
        try:
            handle.Shutdown()
        except Exception as e:  # a dead connection may refuse even this
            log.debug("dcgm: disconnecting failed: %s", e)
        registry = self.pydcgm.DcgmHandle
        with getattr(registry, "handleLock", contextlib.nullcontext()):
            handles = getattr(registry, "handles", [])
            if handle in handles:
                handles.remove(handle)

    def delete(self, field_group: Any) -> None:
        """Delete a pydcgm.DcgmFieldGroup of ours in DCGM where it can, and untrack it
        whatever happens: pydcgm's Delete() raises before letting go of a dead connection,
        and the object's finaliser would then, whenever it runs, untrack a later
        connection's field group that got the same id from a restarted host engine."""
        try:
            field_group.Delete()
        except Exception as e:  # a dead connection, or bindings of another version
            log.debug(
                "dcgm: deleting field group %s failed: %s", getattr(field_group, "name", "?"), e
            )
        finally:
            self.forget(field_group)

    def forget(self, field_group: Any) -> None:
        """Untrack a pydcgm.DcgmFieldGroup without asking DCGM (its connection is gone)."""
        registry = self.pydcgm.DcgmFieldGroup
        group_id = getattr(field_group, "fieldGroupId", None)
        with getattr(registry, "groupLock", contextlib.nullcontext()):
            groups = getattr(registry, "groups", {})
            if group_id is not None and groups.get(group_id.value) is field_group:
                del groups[group_id.value]
        field_group._dcgmHandle = None  # nor will its __del__ ask DCGM


def find_bindings(
    bindings_path: Path | None, rootfs: Path = Path("/")
) -> tuple[Path | None, list[Path]]:
    """(the bindings directory or None, every place looked at)."""
    candidates = [bindings_path] if bindings_path else [rootfs / d for d in BINDINGS_DIRS]
    for candidate in candidates:
        if (candidate / "pydcgm.py").is_file():
            return candidate, candidates
    return None, candidates


def load_bindings(directory: Path) -> Bindings:
    """Import DCGM's bindings from `directory` without leaving them importable.

    They import each other by bare name (`import dcgm_structs`), so the directory goes
    first on sys.path, and any module of the same name already imported leaves
    sys.modules, while they load; then both are put back as they were. The returned
    modules still reach each other through their own globals. Raises UntrustedBindings,
    importing nothing, if others could change what would be imported
    (filetrust.distrust_tree).
    """
    directory = Path(directory)
    entry = os.path.realpath(directory)  # checked and imported: no link to swap between
    names = {p.stem for p in Path(entry).glob("*.py")}
    if "pydcgm" not in names:
        raise FileNotFoundError(f"no pydcgm.py in {directory}")
    if (why := distrust_tree(entry)) is not None:
        raise UntrustedBindings(why)
    with _LOAD_LOCK:
        displaced = {name: sys.modules.pop(name) for name in names if name in sys.modules}
        sys.path.insert(0, entry)
        try:
            for name in BINDING_MODULES:
                importlib.import_module(name)
            modules = {name: sys.modules[name] for name in names if name in sys.modules}
        finally:
            if entry in sys.path:
                sys.path.remove(entry)
            sys.path_importer_cache.pop(entry, None)
            for name in names:
                sys.modules.pop(name, None)
            sys.modules.update(displaced)
    return Bindings(directory, modules)
