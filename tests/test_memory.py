"""gpuwatchd/memory.py on this machine's glibc: each check runs in a fresh interpreter (a
process's arenas and heap are its own) and asks glibc itself (`malloc_info`) or the
kernel (`VmRSS`), with a twin without the call so that the check can fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gpuwatchd import memory

pytestmark = pytest.mark.skipif(memory._libc() is None, reason="glibc only")

ARENAS = """
import ctypes, os, tempfile, threading
from gpuwatchd import memory
if LIMIT:
    memory.limit_arenas()
# one allocation that outlives its thread: glibc keeps the arena it came from in use
kept, ready, go = [], threading.Barrier(8), threading.Event()
def allocate():
    ready.wait()  # all alive at once: none can inherit a finished thread's arena
    kept.append(bytearray(64 << 10))  # over pymalloc's 512 B, under the mmap threshold
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile() as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(open(out.name).read().count("<heap nr="))
"""

TRIM = """
import gc
from gpuwatchd import memory
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
# 64 MiB of 4 KiB blocks, then every one but each 64th freed: the heap cannot shrink
# from its top, so glibc keeps the free pages in between until malloc_trim hands them back
blocks = [bytearray(4000) for _ in range(16384)]
kept = blocks[::64]
del blocks
gc.collect()
before = rss()
if TRIM:
    memory.release_startup_garbage()
print(before - rss())
"""


def _run(script: str, **flags: bool) -> int:
    prelude = "".join(f"{name} = {value}\n" for name, value in flags.items())
    code = prelude + textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_threads_share_at_most_two_malloc_arenas():
    assert _run(ARENAS, LIMIT=False) > memory.ARENAS  # glibc's default: one per thread
    assert _run(ARENAS, LIMIT=True) <= memory.ARENAS


def test_freed_start_up_memory_goes_back_to_the_kernel():
    assert _run(TRIM, TRIM=False) < 8 << 10  # KiB: glibc keeps what was freed
    assert _run(TRIM, TRIM=True) > 48 << 10  # most of the 63 MiB freed
