"""Desktop processes by the display server's signature, not by a name (issue 41, item 6):
comm and argv[0] are a process's own (`exec -a /usr/lib/xorg/Xorg`, prctl), and a tenant
so named was no GPU's main process and made desktop_on_gpu fire. Real processes read
through this machine's /proc (as root, and as `nobody`, which may not read their
/proc/PID/exe), and a simulated node where the tenant and a real console desktop share
the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from servers import wait_until

from gpuwatchd.config import ProcessesConfig
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.processes import ProcessesSource
from gpuwatchd.sources.processes.desktop import signed_binary
from tests.test_owner import as_nobody
from tests.test_processes_source import Node

TENANT = "/user.slice/user-2002.slice/session-9.scope"  # eve, logged in over ssh (pts/1)
CONSOLE = "/user.slice/user-1000.slice/session-2.scope"  # ada at the machine (vt2)
XORG_ARGV = ["/usr/lib/xorg/Xorg", "vt2", "-displayfd", "3"]

FORGERS = Scenario.model_validate({
    "name": "forged-desktop",
    "node": {"gpu_count": 3, "host": {"processes": [
        {"pid": 4242, "uid": 2002, "cgroup": TENANT},  # eve's training job, GPU 0
        # eve's process calling itself Xorg, with a graphics context beside her job (EGL)
        {"pid": 5000, "name": "Xorg", "uid": 2002, "cgroup": TENANT, "tty": "pts/1",
         "cmdline": XORG_ARGV},
        # root in a pod, calling itself Xorg (image path /usr/lib/xorg/Xorg), GPU 1
        {"pid": 5100, "name": "Xorg", "uid": 0, "cmdline": XORG_ARGV,
         "owner": {"pod": {"uid": "6f1c3e2a-8b7d-4c55-9a10-2f4be1d07c93"}}},
        # eve's CPU burner named as GNOME's indexer, run from where it is installed
        {"pid": 5200, "name": "tracker-miner-fs-3", "uid": 2002, "cgroup": TENANT,
         "cmdline": ["/usr/libexec/tracker-miner-fs-3"]},
        # ada's real desktop on GPU 2: Xorg on vt2, gnome-shell of her session
        {"pid": 1789, "name": "Xorg", "cgroup": CONSOLE, "tty": "tty2", "cmdline": XORG_ARGV},
        {"pid": 2210, "name": "gnome-shell",
         "cgroup": "/user.slice/user-1000.slice/user@1000.service/session.slice/shell.service"},
    ]}},
    "phases": [{
        "name": "p", "duration": "10m",
        "changes": [
            {"gpus": [0], "set": {"processes": [
                {"pid": 4242, "gpu_memory_mib": 18000},
                {"pid": 5000, "name": "Xorg", "gpu_memory_mib": 400, "kind": "graphics"}]}},
            {"gpus": [1], "set": {"processes": [
                {"pid": 5100, "name": "Xorg", "gpu_memory_mib": 9000, "kind": "graphics"}]}},
            {"gpus": [2], "set": {"processes": [
                {"pid": 1789, "name": "Xorg", "gpu_memory_mib": 400, "kind": "graphics"},
                {"pid": 2210, "name": "gnome-shell", "gpu_memory_mib": 200,
                 "kind": "graphics"}]}},
        ],
        "host": {"processes": {pid: {"main_thread_cpu_percent": 100,
                                     "other_threads_cpu_percent": 0}
                               for pid in (5000, 5100, 5200, 1789, 2210)}},
    }],
})  # fmt: skip


def test_a_tenant_named_as_a_desktop_is_no_desktop(tmp_path: Path) -> None:
    """Under the shipped unit's privileges (another user's /proc/PID/exe unreadable: the
    simulator writes none): eve's `Xorg` and `tracker-miner-fs-3` and the pod's `Xorg`
    are not the desktop; ada's Xorg on vt2 and her session's gnome-shell are."""
    node = Node(FORGERS, tmp_path)
    try:
        node.poll(10.0)
        m = node.poll(15.0)
    finally:
        node.source.close()
    assert [m.gpu("gpu_desktop_processes", g) for g in range(3)] == [0, 0, 2]  # [1, 1, 2]
    assert m.gpu("gpu_other_processes", 0) == 1  # eve's graphics process beside her job
    assert m.gpu("gpu_process_pid", 1) == 5100  # the pod's process is GPU 1's main one
    assert m.node("desktop_processes") == 2  # was 5: her tracker and both forgers
    assert m.node("desktop_process_cpu_cores", "tracker-miner-fs") is None
    assert m.node("desktop_cpu_cores") == pytest.approx(2.0, abs=0.05)  # Xorg, gnome-shell


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_real_processes_renamed_xorg_are_no_desktop() -> None:
    """Two real processes of uid 4321 with comm `Xorg` and argv[0] /usr/lib/xorg/Xorg: a
    shell (`exec -a`, then /proc/self/comm) and a copy of sleep named Xorg. As root the
    daemon reads their /proc/PID/exe (bash; a file of uid 4321): no display server; as
    `nobody` it may not: not root's, not on a console: no display server either."""
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gpuwatchd-eve-"))
    home.chmod(0o755)
    copy = home / "Xorg"
    shutil.copy("/bin/sleep", copy)
    os.chown(copy, 4321, 4321)
    rename = "printf Xorg > /proc/$$/comm; while :; do sleep 1; done"
    forgers = [
        subprocess.Popen(["bash", "-c", f"exec -a /usr/lib/xorg/Xorg bash -c '{rename}'"],
                         user=4321, group=4321),
        subprocess.Popen(["bash", "-c", f"exec -a /usr/lib/xorg/Xorg {copy} 60"],
                         user=4321, group=4321),
    ]  # fmt: skip
    try:
        for forger in forgers:
            comm = Path(f"/proc/{forger.pid}/comm")
            wait_until("the forger's comm", lambda c=comm: c.read_text() == "Xorg\n", 10)
            assert Path(f"/proc/{forger.pid}/cmdline").read_bytes().startswith(b"/usr/lib/xorg")
        source = ProcessesSource(ProcessesConfig(), Context(procfs=Path("/proc"), sysfs=home))

        def labels() -> list[Any]:
            return [source._desktop_label(f.pid, "Xorg", graphics=True) for f in forgers]

        as_root, unprivileged = labels(), as_nobody(labels)  # type: ignore[arg-type]
        source.close()
    finally:
        for forger in forgers:
            forger.kill()
            forger.wait()
        shutil.rmtree(home)
    assert as_root == [None, None]  # was ["Xorg", "Xorg"]
    assert unprivileged == [None, None]


def test_a_signed_binary_is_a_system_programs(tmp_path: Path) -> None:
    root_owned = os.stat("/bin/sh")  # root's, 0755, on every Linux
    if root_owned.st_uid != 0:
        pytest.skip("/bin/sh is not root's here")
    assert signed_binary("/usr/lib/xorg/Xorg", root_owned)
    assert signed_binary("/usr/bin/gnome-shell (deleted)", root_owned)  # upgraded under it
    assert not signed_binary("/usr/bin/python3.11", root_owned)  # no desktop program
    assert not signed_binary("/home/eve/bin/Xorg", root_owned)  # not where programs go
    assert not signed_binary("/usr/bin/../../home/eve/Xorg", root_owned)
    mine = tmp_path / "Xorg"
    mine.write_bytes(b"")
    mine.chmod(0o777)
    assert not signed_binary("/usr/lib/xorg/Xorg", os.stat(mine))  # anyone may write it
