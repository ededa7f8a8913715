"""`gpuwatchd simulate`: virtual time through the real sources, deterministic."""

import re
from importlib import resources
from pathlib import Path

import yaml
from click.testing import CliRunner

from gpuwatchd.cli import main


def simulate(*args: str) -> str:
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code == 0, result.output
    return result.output


def phase_rows(output: str, phase: str) -> dict[str, list[str]]:
    block = output.split(f"end of phase {phase!r}")[1].split("\n\n")[0]
    rows = [line.split() for line in block.splitlines()[2:]]
    return {row[0]: row[1:] for row in rows}


def test_phases_show_what_the_sources_saw(tmp_path: Path):
    # the built-in scenario with its phases cut to 2, 3 and 1 minutes (the corpus plays
    # it whole; the averages a phase's row shows need only a few of its minutes)
    builtin = resources.files("gpuwatchd.sim.scenarios") / "pcie-gen3-under-load.yaml"
    scenario = yaml.safe_load(builtin.read_text())
    for phase, minutes in zip(scenario["phases"], (2, 3, 1), strict=True):
        phase["duration"] = f"{minutes}m"
    path = tmp_path / "pcie.yaml"
    path.write_text(yaml.safe_dump(scenario))
    output = simulate(str(path))
    assert re.match(r"scenario pcie-gen3-under-load: simulated 360s in [\d.]+s wall", output)
    before = phase_rows(output, "training")
    after = phase_rows(output, "gpu3-link-at-gen3")
    # columns: util%, pstate, power W, pcie gen, max gen, width
    assert before["3"] == ["95", "0", "335", "4", "4", "16"]
    assert after["3"] == ["48", "0", "210", "3", "4", "16"]
    assert all(after[g][3] == "4" for g in "0124567")


def test_replays_are_deterministic():
    first, second = simulate("idle-8gpu", "--until", "120"), simulate("idle-8gpu", "--until", "120")
    strip = lambda text: re.sub(r"in [\d.]+s wall", "", text)  # noqa: E731
    assert strip(first) == strip(second)


def test_metrics_flag_prints_the_final_exposition():
    output = simulate("idle-8gpu", "--until", "5", "--metrics")
    assert 'gpuwatchd_gpu_utilization_ratio{gpu="0"' in output
    assert 'gpuwatchd_pcie_link_degraded{device=' in output  # idle links train down


def test_unknown_scenario_is_a_clear_error():
    result = CliRunner().invoke(main, ["simulate", "no-such-scenario"])
    assert result.exit_code == 1
    assert "unknown scenario 'no-such-scenario'" in result.output


def test_hung_scenarios_replay_in_virtual_time(tmp_path):
    """A blocked NVML call holds up its GPU's reader thread, not virtual time."""
    path = tmp_path / "hang.yaml"
    phase = "{name: p, duration: 1m, changes: [{gpus: [1], set: {hung: true}}]}"
    path.write_text(f"name: hang\nnode: {{gpu_count: 2}}\nphases:\n  - {phase}\n")
    result = CliRunner().invoke(main, ["simulate", str(path), "--metrics"])
    assert result.exit_code == 0, result.output
    assert 'gpuwatchd_gpu_nvml_hung_seconds{gpu="1"' in result.output


def _read_by_the_host_sources(name: str, until: float, every_tick: bool) -> list[tuple]:
    from gpuwatchd.config import Config
    from gpuwatchd.sim.scenario import load_scenario
    from gpuwatchd.simulate import Simulation

    simulation = Simulation(load_scenario(name), Config())
    if every_tick:  # every writer at every tick, whoever polls
        tick = simulation.node.tick
        simulation.node.tick = lambda due=None: tick()  # type: ignore[method-assign]
    store = simulation.pipeline.store
    sources = ("cpu", "interrupts", "disks", "infiniband", "processes", "pcie")
    seen: list[tuple] = []
    try:
        simulation.run(until=until, on_step=lambda t: seen.append(
            (t, [sorted(store.source_latest(source)) for source in sources])))
    finally:
        simulation.close()
    return seen


def test_files_are_written_for_the_sources_due_and_read_the_same(monkeypatch):
    """Writers whose readers are not due are left behind while the host's values hold
    (the counters then read the same whenever they are written); every source reads
    exactly what it reads with every writer written every second."""
    # host-cpu-bound: host values jittered (noise), a new draw every 5 s
    for name, until in (("interrupt-storm", 330), ("dataloader-single-process", 120),
                        ("host-cpu-bound", 60)):
        assert _read_by_the_host_sources(name, until, False) == (
            _read_by_the_host_sources(name, until, True))
