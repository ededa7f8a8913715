"""Benchmark: what gpuwatchd.probe adds to each batch of a training loop, and its memory.

Run by hand: `python bench/bench_probe.py [BATCHES]` (default 1 000 000). Results are
recorded in docs/performance.md. Not a test: timings belong in numbers, not asserts.

1. Per-batch overhead: a loop over BATCHES items of a plain iterable, bare and through
   `probe.watch`, reporting once a second to a real bound socket that a thread drains
   (as the daemon would); the difference per batch, best of 5 runs each.
2. The same through `with probe.waiting():` around each fetch.
3. Memory: Python's allocated blocks, and the bytes still held that were allocated
   under the probe's code (tracemalloc), before and after BATCHES batches (no growth
   expected: the probe keeps counters, not per-batch records).
4. One report: building the JSON and sending it.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

from gpuwatchd import probe


def bare(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        pass
    return time.perf_counter() - start


def watched(p: probe.Probe, n: int) -> float:
    start = time.perf_counter()
    for _ in p.watch(range(n)):
        pass
    return time.perf_counter() - start


def explicit(p: probe.Probe, n: int) -> float:
    it = iter(range(n))
    start = time.perf_counter()
    for _ in range(n):
        with p.waiting():
            next(it)
    return time.perf_counter() - start


def drain(sock: socket.socket, stop: threading.Event) -> None:
    sock.settimeout(0.1)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            sock.recv(65536)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    path = Path(tempfile.mkdtemp()) / "probe.sock"
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    daemon.bind(str(path))
    stop = threading.Event()
    thread = threading.Thread(target=drain, args=(daemon, stop), daemon=True)
    thread.start()
    p = probe.Probe(socket_path=str(path), interval=1.0)

    base = min(bare(n) for _ in range(5))
    watch = min(watched(p, n) for _ in range(5))
    marked = min(explicit(p, n) for _ in range(5))
    print(f"batches per run                {n}")
    print(f"bare loop                      {base / n * 1e9:8.0f} ns/batch")
    print(f"probe.watch                    {watch / n * 1e9:8.0f} ns/batch")
    print(f"  added                        {(watch - base) / n * 1e9:8.0f} ns/batch")
    print(f"with probe.waiting()           {marked / n * 1e9:8.0f} ns/batch")
    print(f"  added (vs a bare next())     {(marked - base) / n * 1e9:8.0f} ns/batch")
    print(f"reports sent / dropped         {p.sent} / {p.dropped}")

    tracemalloc.start(25)
    watched(p, 1000)  # warm: first report, socket
    only_probe = [tracemalloc.Filter(True, probe.__file__, all_frames=True)]
    blocks0 = sys.getallocatedblocks()
    before = tracemalloc.take_snapshot().filter_traces(only_probe)
    watched(p, n)
    after = tracemalloc.take_snapshot().filter_traces(only_probe)
    blocks1 = sys.getallocatedblocks()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    print(f"allocated blocks, {n} batches  {blocks0} -> {blocks1} ({blocks1 - blocks0:+d})")
    print(f"bytes held by the probe's code {grown:+d} after {n} batches")

    reps = 10_000
    start = time.perf_counter()
    for _ in range(reps):
        p._report(time.perf_counter())
    print(f"one report (build + send)      {(time.perf_counter() - start) / reps * 1e6:8.1f} µs")
    print(f"report size                    {len(p.report_bytes())} bytes")
    stop.set()
    thread.join()
    daemon.close()


if __name__ == "__main__":
    main()
