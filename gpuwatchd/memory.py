"""What the daemon asks of glibc's allocator to keep its resident memory small (issue 46).

glibc gives each thread that allocates an arena of its own (up to 8 per core): the
daemon's ten threads each held a partly used one. Two arenas serve them as well, the GIL
lets one thread run Python at a time. Start-up (imports, the rule file, the config's
validators) leaves freed memory inside the heap that glibc keeps until asked to give it
back. Elsewhere (musl, macOS) these are no-ops.
"""

from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)
ARENAS = 2


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: libc's among them
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_arenas() -> None:
    """Before the threads start: at most ARENAS malloc arenas."""
    libc = _libc()
    if libc is not None and not libc.mallopt(M_ARENA_MAX, ARENAS):
        log.debug("mallopt(M_ARENA_MAX) refused")


def release_startup_garbage() -> None:
    """Once serving: collect start-up's garbage and hand glibc's free pages back."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
