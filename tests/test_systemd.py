"""systemd/: the unit passes systemd's own checks, its command line starts the daemon as
its user, the default config shows every key with its default, and the watchdog
protocol is spoken by the evaluation loop (issue 12)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from daemon_process import require_tool
from wheel_venv import ROOT, scratch, wheel_venv

from gpuwatchd.config import Config, load_config
from gpuwatchd.daemon import Daemon
from gpuwatchd.notify import Notifier, watchdog_interval
from gpuwatchd.sim.scenario import load_scenario

UNIT = ROOT / "systemd" / "gpuwatchd.service"
CONFIG = ROOT / "systemd" / "gpuwatchd.yaml"
SYSUSERS = ROOT / "systemd" / "gpuwatchd.sysusers.conf"
PREFIX = "/opt/gpuwatchd"  # where the unit expects install.sh's venv
EXPOSURE_LIMIT = 1.4  # systemd-analyze security's overall exposure (docs/deploy.md)


def directives(path: Path) -> dict[str, list[str]]:
    """`Section.Key` -> its values in order, as systemd reads a unit file."""
    found: dict[str, list[str]] = defaultdict(list)
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found[f"{section}.{key.strip()}"].append(value.strip())
    return found


def command_line(exec_start: str) -> list[str]:
    """An ExecStart= value as the argv systemd executes: words split with quotes, `$$`
    a literal `$` (no other variable is used in the unit)."""
    return [word.replace("$$", "$") for word in shlex.split(exec_start)]


def unit_for_prefix(prefix: Path, directory: Path) -> Path:
    """The unit as install.sh lays it for `--prefix`."""
    unit = directory / "gpuwatchd.service"
    unit.write_text(UNIT.read_text().replace(PREFIX, str(prefix)))
    return unit


def microseconds(timespan: str) -> int:
    """A systemd time span ("30s", "1min 5s") in µs, by systemd's own parser."""
    out = subprocess.run(
        [require_tool("systemd-analyze"), "timespan", timespan],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(re.search(r"μs: (\d+)", out).group(1))  # type: ignore[union-attr]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = unit_for_prefix(wheel_venv(), tmp_path)
    result = subprocess.run(
        [require_tool("systemd-analyze"), "verify", str(unit)], capture_output=True, text=True
    )
    assert (result.returncode, result.stderr) == (0, "")


def test_unit_exposure_is_low() -> None:
    result = subprocess.run(
        [require_tool("systemd-analyze"), "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
    )
    match = re.search(r"Overall exposure level for gpuwatchd.service: (\d+\.\d)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= EXPOSURE_LIMIT, result.stdout
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert f"exposure level {match.group(1)}" in deploy, "docs/deploy.md: record the new score"


def test_unit_is_hardened_as_documented() -> None:
    service = directives(UNIT)

    def one(key: str) -> str:
        (value,) = service[f"Service.{key}"]
        return value

    assert one("Type") == "notify" and microseconds(one("WatchdogSec")) > 0
    assert one("Restart") == "on-failure"
    assert one("User") == "gpuwatchd" and "DynamicUser" not in service
    assert one("CapabilityBoundingSet") == "" and one("NoNewPrivileges") == "yes"
    assert one("ProtectSystem") == "strict"
    assert one("DevicePolicy") == "closed" and one("DeviceAllow") == "char-nvidia* rw"
    assert service["Service.SystemCallFilter"][0] == "@system-service"
    assert one("MemoryDenyWriteExecute") == "yes"
    # the probe socket lies in the RuntimeDirectory systemd creates for the user
    assert Config().sources.probe.socket.parent == Path("/run") / one("RuntimeDirectory")
    # every directive is justified: a comment sits above each block of them
    blocks = re.split(r"\n\s*\n", UNIT.read_text().split("[Service]", 1)[1])
    assert all(block.lstrip().startswith(("#", "[")) for block in blocks if block.strip())


def uncommented(text: str) -> str:
    """The config with every commented-out key switched on."""
    return re.sub(r"^#(\s*[a-z_]+:(?:\s|$))", r"\1", text, flags=re.MULTILINE)


def keys(tree: dict, prefix: str = "") -> set[str]:
    found = set()
    for key, value in tree.items():
        found.add(prefix + key)
        if isinstance(value, dict):
            found |= keys(value, f"{prefix}{key}.")
    return found


def test_default_config_shows_every_key_with_its_default(tmp_path: Path) -> None:
    assert load_config(CONFIG) == Config()  # as shipped: all defaults
    every = tmp_path / "every.yaml"
    every.write_text(uncommented(CONFIG.read_text()))
    assert load_config(every) == Config()  # the values shown are the defaults
    assert keys(yaml.safe_load(every.read_text())) == keys(Config().model_dump())


def test_sysusers_creates_the_units_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    sysusers = require_tool("systemd-sysusers")
    subprocess.run([sysusers, f"--root={tmp_path}", str(SYSUSERS)], check=True)
    user = directives(UNIT)["Service.User"][0]
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert re.search(rf"^{user}:x:\d+:\d+:.*:/:/usr/sbin/nologin$", passwd, re.MULTILINE)


@pytest.fixture
def notify_socket() -> Iterator[socket.socket]:
    """A stand-in for systemd's notification socket that the unit's user can send to."""
    path = scratch("gpuwatchd-notify-") / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    path.chmod(0o666)
    sock.settimeout(30)
    with sock:
        yield sock


def receive(sock: socket.socket, timeout: float) -> str | None:
    sock.settimeout(timeout)
    try:
        return sock.recv(4096).decode().strip()
    except TimeoutError:
        return None


def stopping(sock: socket.socket) -> bool:
    """STOPPING=1 arrives, after any watchdog pings still queued."""
    while (message := receive(sock, 10)) == "WATCHDOG=1":
        pass
    return message == "STOPPING=1"


def as_user(user: str) -> list[str]:
    """setpriv as systemd applies User=, NoNewPrivileges= and CapabilityBoundingSet=."""
    if os.geteuid() != 0:
        return []  # cannot switch: run as ourselves
    subprocess.run([require_tool("systemd-sysusers"), str(SYSUSERS)], check=True)
    return [
        require_tool("setpriv"),
        f"--reuid={user}",
        f"--regid={user}",
        "--clear-groups",
        "--no-new-privs",
        "--bounding-set=-all",
        "--",
    ]


# MemoryDenyWriteExecute= by the kernel's own switch (PR_SET_MDWE, Linux >= 6.3), which
# systemd's seccomp filter mirrors: no writable+executable memory, kept across exec
MDWE = (
    "import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
    "libc.prctl(65, 1, 0, 0, 0) == 0 or sys.exit(ctypes.get_errno()); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def memory_deny_write_execute() -> list[str]:
    if subprocess.run([sys.executable, "-c", MDWE, "true"]).returncode != 0:
        return []  # an older kernel: not checked here
    return [sys.executable, "-c", MDWE]


def test_exec_start_serves_a_simulated_node_as_the_units_user(
    notify_socket: socket.socket,
) -> None:
    """The unit's ExecStart, environment and user, prefix and config mapped to a venv of
    the built wheel and the shipped config; systemd's part played by the test, with
    MemoryDenyWriteExecute= (the simulated DCGM bindings use ctypes callbacks)."""
    service = directives(UNIT)
    (exec_start,) = service["Service.ExecStart"]
    command = command_line(exec_start.replace(PREFIX, str(wheel_venv())))
    command = [str(CONFIG) if arg == "/etc/gpuwatchd/gpuwatchd.yaml" else arg for arg in command]
    command += ["--simulate", "healthy-8gpu", "--listen", "127.0.0.1:0"]
    (user,) = service["Service.User"]
    environment = dict(
        item.split("=", 1) for line in service["Service.Environment"] for item in shlex.split(line)
    )
    environment |= {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
        "HOME": "/",
        "USER": user,
        "LOGNAME": user,
        "NOTIFY_SOCKET": notify_socket.getsockname(),
        "WATCHDOG_USEC": str(microseconds(service["Service.WatchdogSec"][0])),
    }
    assert service["Service.MemoryDenyWriteExecute"] == ["yes"]
    proc = subprocess.Popen(
        memory_deny_write_execute() + as_user(user) + command,
        env=environment,
        cwd="/",
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        deadline, message = time.monotonic() + 60, None
        while message is None and proc.poll() is None and time.monotonic() < deadline:
            message = receive(notify_socket, 0.5)
        assert message == "READY=1", proc.stderr.read() if proc.poll() is not None else ""
        assert receive(notify_socket, 10) == "WATCHDOG=1"
        url = next(line for line in proc.stderr if "gpuwatchd: serving" in line)
        healthz = url.rsplit(" on ", 1)[1].strip().replace("/metrics", "/healthz")
        deadline = time.monotonic() + 20  # every source polls once (a slow one: later)
        while True:
            with urllib.request.urlopen(healthz, timeout=10) as response:
                body = response.read().decode()
            if ": down" not in body or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert body.startswith("ok\n") and "source dcgm: up" in body and ": down" not in body
        proc.send_signal(signal.SIGTERM)
        assert stopping(notify_socket)
        assert proc.wait(15) == 0
    finally:
        proc.kill()
        proc.wait()


def runs(pid: int, argv: list[str]) -> bool:
    """Whether the process has exec'd `argv` (not: a wrapper, or a child not yet exec'd)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [
            os.fsencode(arg) for arg in argv
        ]
    except OSError:
        return False


def test_a_sighup_at_any_instant_of_start_up_is_harmless() -> None:
    """Issue 23 (8g): `python -m gpuwatchd run` started as the unit's ExecStart starts the
    daemon, SIGHUP sent as soon as Python is exec'd and every few ms while it starts: it
    comes up and serves. The first tens of ms are Python's own start-up, before any of the
    package's code can catch the signal: only a disposition inherited across exec covers
    them."""
    service = directives(UNIT)
    (exec_start,) = service["Service.ExecStart"]
    command = command_line(exec_start)
    at = command.index(f"{PREFIX}/bin/gpuwatchd")  # the program the unit runs: the module
    command[at : at + 1] = [sys.executable, "-m", "gpuwatchd"]
    command = [str(CONFIG) if arg == "/etc/gpuwatchd/gpuwatchd.yaml" else arg for arg in command]
    command += ["--simulate", "idle-8gpu", "--listen", "127.0.0.1:0"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 5  # a wrapper's own start (< 1 ms) aside: from
        while not runs(proc.pid, command[at:]) and time.monotonic() < deadline:  # Python's
            pass  # exec on
        sent, started = 0, time.monotonic()
        while time.monotonic() - started < 0.5 and proc.poll() is None:  # start-up
            proc.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.002 if sent < 20 else 0.02)
        lines: list[str] = []
        for line in proc.stderr:  # the daemon prints its bound address once it serves
            lines.append(line)
            if "gpuwatchd: serving" in line:
                break
        assert proc.poll() is None, f"killed by SIGHUP (rc={proc.wait()}): {''.join(lines)}"
        url = lines[-1].rsplit(" on ", 1)[1].strip()
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and b"\n# TYPE gpuwatchd_" in response.read()
        proc.send_signal(signal.SIGHUP)  # once it runs, SIGHUP reloads, as before
        for line in proc.stderr:
            if "rules: loaded" in line:
                break
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.kill()
        proc.wait()


def test_watchdog_pings_stop_while_the_evaluation_loop_is_wedged(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.getsockname())
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # pings every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    config = load_config(None, listen="127.0.0.1:0", evaluation_interval=0.1)
    daemon = Daemon(config, load_scenario("healthy-8gpu"))
    wedged, hung, released = threading.Event(), threading.Event(), threading.Event()
    evaluate_once = daemon.evaluate_once

    def wedging() -> None:
        if wedged.is_set():
            hung.set()
            released.wait()  # a hung call, as a stuck lock or driver would leave it
        evaluate_once()

    monkeypatch.setattr(daemon, "evaluate_once", wedging)
    daemon.start()
    try:
        assert receive(notify_socket, 30) == "READY=1"
        pings, until = 0, time.monotonic() + 1.2  # 12 cycles of 100 ms
        while (left := until - time.monotonic()) > 0:
            pings += receive(notify_socket, left) == "WATCHDOG=1"
        assert 1 <= pings <= 7  # every 0.2 s (half the interval), not every cycle
        wedged.set()
        assert hung.wait(5)
        while receive(notify_socket, 0.05) is not None:
            pass  # pings sent before the loop hung
        assert receive(notify_socket, 1.5) is None  # silent: systemd would now kill it
        wedged.clear()
        released.set()
        assert receive(notify_socket, 5) == "WATCHDOG=1"  # alive again
    finally:
        released.set()
        daemon.stop()
    assert stopping(notify_socket)


def test_watchdog_is_off_unless_meant_for_this_process() -> None:
    pid = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None
    Notifier(1.0, environ={}).alive()  # outside systemd: nothing to do, nothing fails
