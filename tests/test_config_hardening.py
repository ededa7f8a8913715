"""Start-up and configuration (issue 13, finding 10): signals from the first instant,
clean messages for every bad config, sane bounds, and SIGHUP reloading the config."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from series import error_loading_fifo

from gpuwatchd.config import ConfigError, load_config
from gpuwatchd.daemon import Pipeline
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import load_scenario
from tests.test_rules_load import GOOD


def write(tmp_path: Path, text: str | bytes, name: str = "gpuwatchd.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


class Daemon:
    """`gpuwatchd run --simulate idle-8gpu` as a subprocess (`script` runs first), its
    stderr collected by a thread."""

    def __init__(self, *args: str, script: str = "") -> None:
        run = ["run", "--simulate", "idle-8gpu", "--listen", "127.0.0.1:0", *args]
        code = script + f"\nfrom gpuwatchd.cli import main\nmain({run!r})\n"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def logged(self, text: str, within: float = 60) -> str:
        """The first line containing `text`, once logged (bounded wait)."""
        deadline = time.monotonic() + within
        while True:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                pytest.fail(f"exited (rc={self.proc.returncode}):\n{''.join(self.lines)}")
            assert time.monotonic() < deadline, f"{text!r} never logged:\n{''.join(self.lines)}"
            time.sleep(0.05)

    def url(self) -> str:
        return self.logged("gpuwatchd: serving").rsplit(" on ", 1)[1].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(30) == 0, "".join(self.lines)
        finally:
            self.proc.kill()
            self._reader.join(10)


# -- signals ----------------------------------------------------------------------------


def test_sighup_is_caught_before_anything_slow_is_imported() -> None:
    code = (
        "import signal, sys; import gpuwatchd.cli; "
        "print(signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("nohup", [False, True])
def test_other_commands_get_sighup_back_as_it_was_at_exec(nohup: bool) -> None:
    # `simulate` under nohup must survive a hang-up; without it, SIGHUP ends it as ever
    code = (
        "import os, signal; from gpuwatchd import signals; signals.release(); "
        "os.kill(os.getpid(), signal.SIGHUP); print('alive')"
    )
    # set either way: a suite started under nohup hands its children SIGHUP ignored
    disposition = signal.SIG_IGN if nohup else signal.SIG_DFL
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, disposition),
    )
    if nohup:
        assert (out.returncode, out.stdout.strip()) == (0, "alive")
    else:
        assert out.returncode == -signal.SIGHUP


def test_a_production_daemon_loads_no_simulator_code(tmp_path: Path) -> None:
    # the simulator's models and scenarios cost a node's daemon memory for nothing: a
    # daemon built as `gpuwatchd run` builds it, each source polled once (on this
    # machine: no NVML, no DCGM), has loaded none of it
    code = textwrap.dedent(
        f"""
        import sys
        import gpuwatchd.cli
        from gpuwatchd.config import load_config
        from gpuwatchd.daemon import Daemon
        probe = {{"socket": {str(tmp_path / "probe.sock")!r}}}
        daemon = Daemon(load_config(None, listen="127.0.0.1:0", sources={{"probe": probe}}))
        for source in daemon.pipeline.sources:
            try:
                source.collect()
            except Exception:
                pass
        daemon.pipeline.close()
        simulator = ("gpuwatchd.sim", "gpuwatchd.doctor")  # sim.check, sim.detection too
        print(sorted(m for m in sys.modules if m.startswith(simulator)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_sighup_while_the_daemon_starts_is_remembered_not_fatal() -> None:
    starting = textwrap.dedent(
        """
        import os, signal
        from gpuwatchd import daemon
        real = daemon.Daemon.__init__
        def starting(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGHUP)  # a reload asked for mid-start-up
            real(self, *args, **kwargs)
        daemon.Daemon.__init__ = starting
        """
    )
    daemon = Daemon(script=starting)
    try:
        daemon.url()  # alive and serving
        daemon.logged("rules: loaded")  # the remembered SIGHUP, acted on
    finally:
        daemon.stop()


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["plain", "nohup"])
def test_other_commands_keep_sighups_inherited_action(monkeypatch, inherited) -> None:
    # SIGHUP back as it was at exec: its default, or ignored under nohup (whichever
    # disposition the suite itself was started with)
    from click.testing import CliRunner

    from gpuwatchd import signals
    from gpuwatchd.cli import main

    monkeypatch.setattr(signals, "INHERITED", inherited)
    previous = signal.getsignal(signal.SIGHUP)
    try:
        assert CliRunner().invoke(main, ["metrics"]).exit_code == 0  # any quick command
        assert signal.getsignal(signal.SIGHUP) == inherited
    finally:
        signal.signal(signal.SIGHUP, previous)


# -- clean messages, sane bounds --------------------------------------------------------


def test_a_port_out_of_range_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: 127.0.0.1:99999\n")
    with pytest.raises(ConfigError, match=rf"{path}: listen: expected HOST:PORT.*0-65535"):
        load_config(path)
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "run", "--listen", "host:99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "listen: expected HOST:PORT" in proc.stderr


def test_a_config_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, b"listen: 0.0.0.0:9766\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path}: not UTF-8 text: byte 0xe9 on line 2"):
        load_config(path)


def test_deeply_nested_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "sources: " + "[" * 20_000)
    with pytest.raises(ConfigError, match=rf"{path}: not valid YAML"):
        load_config(path)


def test_a_fifo_as_the_config_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatchd.yaml"
    error = error_loading_fifo(path, load_config)
    assert isinstance(error, ConfigError) and "not a regular file" in str(error)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("evaluation_interval: 0.000001", "evaluation_interval"),
        ("evaluation_interval: 1.0e+300", "evaluation_interval"),  # overflows a wait
        ("sources: {nvml: {interval: 1ms}}", "sources.nvml.interval"),
        ("sources: {probe: {interval: 50ms}}", "sources.probe.interval"),
        ("sources: {cpu: {timeout: 0s}}", "sources.cpu.timeout"),
        ("sources: {probe: {expire_after: 1.0e+300}}", "sources.probe.expire_after"),
        ("history: 1.0e+300", "history"),
    ],
)
def test_durations_have_sane_bounds(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}: {key}: Input should be"):
        load_config(path)


def test_the_smallest_intervals_allowed() -> None:
    config = load_config(None, evaluation_interval="100ms", sources={"nvml": {"interval": 0.1}})
    assert config.evaluation_interval == 0.1 and config.sources.nvml.interval == 0.1


# -- SIGHUP reloads the config ----------------------------------------------------------


@pytest.fixture
def pipeline(tmp_path: Path):
    node = SimNode(load_scenario("idle-8gpu"), virtual=True)
    made: list[Pipeline] = []

    def make(text: str) -> Pipeline:
        made.append(Pipeline(load_config(write(tmp_path, text)), node.context(), node.clock.now))
        return made[-1]

    yield make
    for p in made:
        p.close()
    node.close()


def test_a_reload_applies_what_it_can_and_names_what_needs_a_restart(
    tmp_path: Path, pipeline, caplog: pytest.LogCaptureFixture
) -> None:
    rules = write(tmp_path, GOOD, "rules.yaml")
    running = pipeline("sources: {nvml: {interval: 1s}, dcgm: {enabled: false}}\n")
    new = load_config(
        write(
            tmp_path,
            f"""
            rules_file: {rules}
            evaluation_interval: 2s
            listen: 127.0.0.1:9999
            sources:
              nvml: {{interval: 3s, timeout: 2500ms}}
              dcgm: {{enabled: true}}
              disks: {{max_devices: 8}}
            """.replace("\n            ", "\n"),
        )
    )
    with caplog.at_level(logging.INFO):
        applied = running.reconfigure(new)
    assert applied.rules_file == rules and running.rules_watcher.path == rules
    assert applied.evaluation_interval == 2
    nvml = next(p for p in running.pollers if p.name == "nvml")
    assert (nvml.interval, nvml.timeout) == (3, 2.5)
    assert (applied.listen, applied.sources.dcgm.enabled) == ("0.0.0.0:9766", False)
    assert applied.sources.disks.max_devices == 64
    restart = next(r.getMessage() for r in caplog.records if "restart" in r.getMessage())
    for key in ("listen", "sources.dcgm.enabled", "sources.disks.max_devices"):
        assert key in restart


def test_sighup_reloads_the_config_of_a_running_daemon(tmp_path: Path) -> None:
    holds = GOOD.replace("> 0.5", "< 0.5")  # idle GPUs: it fires, so it is exported
    first = write(tmp_path, holds, "first.yaml")
    second = write(tmp_path, holds.replace("cause_x", "cause_second"), "second.yaml")
    config = write(tmp_path, f"rules_file: {first}\n")
    daemon = Daemon("--config", str(config))
    try:
        url = daemon.url()
        config.write_text(f"rules_file: {second}\nhistory: 5m\n")
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while 'cause="cause_second"' not in scrape(url):
            assert time.monotonic() < deadline, "the new rule file was never loaded"
            time.sleep(0.1)
        assert "restart" in daemon.logged("config: history changed")
    finally:
        daemon.stop()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()
