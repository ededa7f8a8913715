"""Benchmark: one tenant floods the probe socket; does another tenant's report get through?

Run by hand as root: `python bench/bench_probe_flood.py [SECONDS] [FLOODERS]` (default 4
and 1). Results are recorded in docs/performance.md. Not a test.

- The daemon's side (`--serve`): the real ProbeSocket and its draining thread, and a poll
  loop standing in for the daemon's (every second: `receive`, then 30 ms of evaluation),
  in a process of its own under the shipped unit's `CPUQuota=50%` (a cgroup v1 `cpu`
  group with quota 50 ms per 100 ms; without one the run says so).
- FLOODERS C programs, each as uid `nobody`, sending datagrams as fast as the kernel
  takes them (blocking sends: each waits for room in the socket's queue).
- The victim: another uid (root), the real probe (gpuwatchd.probe.Probe) reporting every
  100 ms: its training thread never blocks; a report that finds the queue full waits in
  the probe's sending thread for room (at most an interval).

Prints the victim's reports the kernel took and the daemon delivered to its polls, the
polls that ran (and the slowest), the draining thread's CPU and the datagrams dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FLOODER_C = r"""
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
int main(int argc, char **argv) {
    int s = socket(AF_UNIX, SOCK_DGRAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
    const char m[] = "{\"v\":1,\"batches\":1,\"wait_seconds\":1,\"compute_seconds\":1}"; /* FLOOD */
    for (;;) sendto(s, m, sizeof m - 1, 0, (struct sockaddr *)&a, sizeof a);
}
"""
FLOOD = b'{"v":1,"batches":1,"wait_seconds":1,"compute_seconds":1}'  # the flooders' datagram
CGROUP = Path("/sys/fs/cgroup/cpu/gpuwatchd-bench")
NOBODY = 65534


def thread_cpu(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(path: Path, seconds: float) -> None:
    """The daemon's side; prints one JSON line when done."""
    from gpuwatchd.sources.probe import INBOX_CAPACITY, ProbeSocket

    daemon = ProbeSocket(path, 8192)
    drain = daemon._thread
    print("ready", flush=True)
    victim = polls = 0
    slowest = 0.0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        began = time.monotonic()
        victim += sum(d != FLOOD for _, d in daemon.receive(INBOX_CAPACITY))
        spin = time.thread_time()
        while time.thread_time() - spin < 0.030:  # the evaluation's CPU
            pass
        polls += 1
        took = time.monotonic() - began
        slowest = max(slowest, took)
        time.sleep(max(0.0, 1.0 - took))
    assert drain.native_id is not None
    result = {
        "victim_delivered": victim,
        "polls": polls,
        "slowest_poll_s": round(slowest, 3),
        "drain_cpu_s": thread_cpu(drain.native_id),
        "wall_s": round(time.monotonic() - start, 2),
        "dropped": daemon.dropped,
    }
    daemon.close()
    print(json.dumps(result), flush=True)


def quota() -> bool:
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "cpu.cfs_period_us").write_text("100000")
        (CGROUP / "cpu.cfs_quota_us").write_text("50000")
    except OSError as e:
        print(f"no CPU quota ({e}): the daemon's side runs unlimited")
        return False
    return True


def flooder(binary: Path, path: Path) -> subprocess.Popen[bytes]:
    def drop() -> None:
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    return subprocess.Popen([str(binary), str(path)], preexec_fn=drop)


def victim(path: Path, seconds: float) -> tuple[int, int]:
    from gpuwatchd.probe import Probe

    p = Probe(socket_path=str(path), interval=0.1)
    reports = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p.batches += 1
        p._report(time.perf_counter())  # what watch() does once an interval has passed
        reports += 1
        time.sleep(0.1)
    time.sleep(0.2)  # the last report that waited for room: sent, or dropped by now
    return reports, p.sent


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    flooders = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-flood-"))
    work.chmod(0o755)
    binary = work / "flood"
    (work / "flood.c").write_text(FLOODER_C)
    subprocess.run(["cc", "-O2", "-o", str(binary), str(work / "flood.c")], check=True)
    path = work / "probe.sock"
    limited = quota()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(path), str(seconds + 1)],
        stdout=subprocess.PIPE,
        text=True,
    )
    if limited:
        (CGROUP / "cgroup.procs").write_text(str(server.pid))
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    floods = [flooder(binary, path) for _ in range(flooders)]
    time.sleep(0.5)  # the flood is on before the victim starts
    sent, taken = victim(path, seconds)
    result = json.loads(server.stdout.readline())
    for f in floods:
        f.kill()
        f.wait()
    server.wait()
    print(f"flooders (uid nobody)               {flooders}")
    print(f"CPU quota of the daemon's side      {'50 %' if limited else 'none'}")
    print(f"victim reports sent / kernel took   {sent} / {taken}")
    print(f"victim reports delivered to polls   {result['victim_delivered']}")
    print(f"polls run in {result['wall_s']} s (slowest)       "
          f"{result['polls']} ({result['slowest_poll_s']} s)")  # fmt: skip
    share = result["drain_cpu_s"] / result["wall_s"] * 100
    print(f"draining thread CPU                 {result['drain_cpu_s']:.2f} s ({share:.0f} %)")
    print(f"datagrams dropped by the daemon     {result['dropped']}")


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        threading.current_thread().name = "poll"
        serve(Path(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
