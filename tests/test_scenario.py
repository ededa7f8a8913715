from pathlib import Path

import pytest
import yaml

from gpuwatchd.config import ConfigError
from gpuwatchd.sim.scenario import Scenario, Timeline, builtin_scenarios, load_scenario


def scenario(**overrides) -> Scenario:
    data = {
        "name": "t",
        "node": {"gpu_count": 4},
        "phases": [
            {
                "name": "warm",
                "duration": "10s",
                "set": {"pstate": 0},
                "ramp": {"utilization_gpu": [0, 100]},
            },
            {
                "name": "fault",
                "duration": "20s",
                "changes": [
                    {"gpus": [1], "set": {"pcie_gen": 3, "xid": [79]}},
                ],
                "bridges": {"sw0-up": {"gen": 2}},
            },
        ],
    }
    data.update(overrides)
    return Scenario.model_validate(data)


def test_builtin_scenarios_load():
    assert {"healthy-8gpu", "idle-8gpu", "pcie-gen3-under-load"} <= set(builtin_scenarios())
    for name in builtin_scenarios():
        assert load_scenario(name).name == name


def test_ramps_persist_and_changes_target_gpus():
    timeline = Timeline(scenario())
    gpus, bridges = timeline.state(5)
    assert gpus[0]["utilization_gpu"] == 50 and gpus[0]["pstate"] == 0
    assert gpus[1]["pcie_gen"] == 4  # the A100's max until the fault phase
    gpus, bridges = timeline.state(15)
    assert [g["utilization_gpu"] for g in gpus] == [100] * 4  # ramp end value persists
    assert [g["pcie_gen"] for g in gpus] == [4, 3, 4, 4]
    assert bridges["sw0-up"]["gen"] == 2 and bridges["sw1-up"]["gen"] == 4


def test_idle_defaults_before_anything_happens():
    gpus, _ = Timeline(scenario()).state(0)
    assert gpus[2]["clock_event_reasons"] == ["gpu_idle"]
    assert gpus[2]["power_w"] == pytest.approx(60)  # 15 % of the A100's 400 W


def test_looping_repeats_the_timeline_and_its_events():
    timeline = Timeline(scenario(), loop=True)
    assert timeline.duration == 30
    assert timeline.state(35)[0][0]["utilization_gpu"] == 50
    events = timeline.xid_events(0, 75)
    assert [(e.time, e.gpu, e.xid) for e in events] == [(10, 1, 79), (40, 1, 79), (70, 1, 79)]
    assert Timeline(scenario()).xid_events(10, 75) == []  # (t0, t1]: t0 excluded, no loop


def test_topology_switched_and_direct():
    timeline = Timeline(scenario())
    path = [f.name for f in timeline.topology.path_to_root("gpu3")]
    assert path == ["rp1", "sw1-up", "sw1-dp1", "gpu3"]
    direct = Timeline(scenario(node={"gpu_count": 2, "pcie_topology": "direct"}))
    assert [f.name for f in direct.topology.path_to_root("gpu1")] == ["rp1", "gpu1"]
    assert len({direct.topology.gpu(i).bdf for i in range(2)}) == 2


def test_errors_name_the_file_and_the_key(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nphases:\n  - name: p\n    duration: 1m\n    set: {utilisation: 5}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: phases\.0\.set\.utilisation: Extra inputs"):
        load_scenario(path)
    path.write_text("name: x\nnode: {gpu_model: v100}\nphases: [{name: p, duration: 1s}]\n")
    with pytest.raises(ConfigError, match="unknown model 'v100'"):
        load_scenario(path)
    path.write_text("name: x\nphases: [{name: p, duration: 1s, ramp: {pstate: [0, 8]}, set: {}}]\n")
    load_scenario(path)  # pstate is numeric: rampable
    path.write_text("name: x\nphases: [{name: p, duration: 1s, ramp: {processes: [0, 8]}}]\n")
    with pytest.raises(ConfigError, match="not a numeric GPU value"):
        load_scenario(path)


def test_unknown_scenario_names_the_builtins():
    with pytest.raises(ConfigError, match="healthy-8gpu"):
        load_scenario("no-such-scenario")


def test_host_values_merge_key_by_key_and_ramp_by_path():
    s = Scenario.model_validate(
        {
            "name": "host",
            "node": {"host": {"processes": [{"pid": 4242}]}},
            "phases": [
                {
                    "name": "a",
                    "duration": 10,
                    "host": {
                        "disks": {"nvme0n1": {"util_percent": 10, "await_ms": 1}},
                        "processes": {4242: {"main_thread_cpu_percent": 40, "workers": 8}},
                    },
                },
                {
                    "name": "b",
                    "duration": 10,
                    "host": {
                        "disks": {"nvme0n1": {"util_percent": 99}},
                        "processes": {4242: {"workers": 0}},
                    },
                    "host_ramp": {"processes.4242.main_thread_cpu_percent": [40, 100]},
                },
            ],
        }
    )
    timeline = Timeline(s)
    host = timeline.host_state(15)
    assert host["disks"]["nvme0n1"] == {"util_percent": 99, "await_ms": 1}
    assert host["processes"][4242] == {"main_thread_cpu_percent": 70, "workers": 0}
    assert host["dcgm_hostengine_up"] is True and host["cpu_busy_percent"] == 2.0
    assert timeline.host_state(5)["processes"][4242]["workers"] == 8


def test_host_ramp_paths_are_checked():
    with pytest.raises(ValueError, match="host_ramp.disks.nvme0n1.colour"):
        Scenario.model_validate(
            {
                "name": "x",
                "phases": [
                    {"name": "p", "duration": 1, "host_ramp": {"disks.nvme0n1.colour": [0, 1]}}
                ],
            }
        )
    Scenario.model_validate(
        {
            "name": "x",
            "phases": [
                {
                    "name": "p",
                    "duration": 1,
                    "host_ramp": {"cpu_busy_percent": [0, 1], "core_busy_percent.3": [0, 100]},
                }
            ],
        }
    )


def test_host_paths_through_names_with_dots():
    """IRQ action names hold dots (`nvidia@pci:0000:13:00.0`, `virtio0-input.0`): a ramp
    or noise path through one splits at its first and last dot only."""
    s = Scenario.model_validate({
        "name": "x",
        "noise": {"seed": 1, "host": {"interrupts.virtio0-input.0.rate": "10%"}},
        "phases": [{
            "name": "p", "duration": 100,
            "host": {"interrupts": {"virtio0-input.0": {"rate": 1000}}},
            "host_ramp": {"interrupts.nvidia@pci:0000:13:00.0.rate": [0, 5000],
                          "core_iowait_percent.3": [0, 50]},
        }],
    })  # fmt: skip
    host = Timeline(s).host_state(50)
    assert host["interrupts"]["nvidia@pci:0000:13:00.0"]["rate"] == pytest.approx(2500)
    assert host["core_iowait_percent"][3] == pytest.approx(25)
    assert 900 <= host["interrupts"]["virtio0-input.0"]["rate"] <= 1100
    assert set(host["interrupts"]) == {"nvidia@pci:0000:13:00.0", "virtio0-input.0"}
    with pytest.raises(ValueError, match="host_ramp.interrupts.mlx5_comp0@pci:0000:0c:00.0"):
        Scenario.model_validate({"name": "x", "phases": [{
            "name": "p", "duration": 1,
            "host_ramp": {"interrupts.mlx5_comp0@pci:0000:0c:00.0": [0, 1]}}]})  # fmt: skip


def test_integrator_turns_rates_into_rising_counters():
    from gpuwatchd.sim.counters import Integrator

    counters = Integrator()
    assert counters.advance(0, {"irq": 100.0}) == {"irq": 0.0}
    assert counters.advance(2, {"irq": 10.0, "new": 1.0}) == {"irq": 200.0, "new": 0.0}
    assert counters.advance(3, {}) == {"irq": 210.0, "new": 1.0}
    assert counters.advance(1, {"irq": 5.0}) == {"irq": 210.0, "new": 1.0}  # never backwards
    # a counter reads the same at t however many writes came in between (floats too)
    every_second, once = Integrator(), Integrator()
    for t in range(0, 11):
        every_second.advance(t, {"irq": 0.1})
    once.advance(0, {"irq": 0.1})
    assert once.advance(10, {"irq": 0.1}) == every_second.totals


def test_timeline_says_when_values_hold():
    from gpuwatchd.sim.scenario import Scenario, Timeline

    scenario = Scenario.model_validate({"name": "t", "node": {"gpu_count": 1}, "phases": [
        {"name": "a", "duration": 10},
        {"name": "b", "duration": 10, "ramp": {"temperature_c": [40, 60]}},
        {"name": "c", "duration": 10, "host_ramp": {"cpu_busy_percent": [0, 50]}},
    ]})  # fmt: skip
    timeline = Timeline(scenario)
    assert timeline.constant(1, 9) and timeline.constant(9, 9)
    assert not timeline.constant(9, 10)  # phase b starts at 10
    assert not timeline.constant(11, 12)  # a GPU ramp runs ...
    assert timeline.constant(11, 12, gpus=False)  # ... but no host value moves
    assert not timeline.constant(21, 22, gpus=False)  # a host ramp
    assert timeline.constant(31, 100)  # after the end, everything stays
    looping = Timeline(scenario, loop=True)
    assert not looping.constant(29, 31) and not looping.constant(0, 45)


# -- noise ----------------------------------------------------------------------------------


def noisy(seed: int = 1, **noise) -> Scenario:
    return scenario(
        noise={"seed": seed, **noise},
        node={"gpu_count": 4,
              "initial_host": {"processes": {4242: {"main_thread_cpu_percent": 60}}}},
        phases=[
            {"name": "busy", "duration": "30s",
             "set": {"utilization_gpu": 50, "power_w": 200, "pcie_rx_mb_s": 1000}},
            {"name": "ramp", "duration": "30s", "ramp": {"pcie_rx_mb_s": [1000, 0]}},
        ],
    )  # fmt: skip


def test_noise_is_seeded_bounded_and_drawn_once_a_period():
    spec = {"gpu": {"utilization_gpu": 60, "power_w": "10%"}}
    one, same, other = (Timeline(noisy(s, **spec)) for s in (1, 1, 2))
    values = [[g["utilization_gpu"] for g in one.state(t)[0]] for t in range(30)]
    assert values == [[g["utilization_gpu"] for g in same.state(t)[0]] for t in range(30)]
    assert values != [[g["utilization_gpu"] for g in other.state(t)[0]] for t in range(30)]
    flat = [v for row in values for v in row]
    assert min(flat) == 0 and max(flat) == 100  # clamped to the value's bounds
    assert len(set(flat)) > 30  # every GPU draws its own, every second
    assert all(180 <= g["power_w"] <= 220 for t in range(30) for g in one.state(t)[0])
    # one draw holds for the whole period
    assert one.state(5.1)[0][2]["utilization_gpu"] == one.state(5.9)[0][2]["utilization_gpu"]
    coarse = Timeline(noisy(1, every="10s", **spec))
    assert coarse.state(11)[0][0]["power_w"] == coarse.state(19.5)[0][0]["power_w"]
    assert Timeline(noisy(1)).state(3)[0][0]["utilization_gpu"] == 50  # no noise: flat


def test_noisy_rates_integrate_to_counters_that_only_rise():
    timeline = Timeline(noisy(gpu={"pcie_rx_mb_s": "50%"}))
    # the integral is the noisy rate's: the sum of its 1 s draws (and of the ramp's)
    total = timeline.integral("pcie_rx_mb_s", 0, 60)
    by_second = [timeline.integral("pcie_rx_mb_s", t, t + 1) for t in range(60)]
    assert total == pytest.approx([sum(s[i] for s in by_second) for i in range(4)])
    assert by_second[3][1] == pytest.approx(timeline.state(3.5)[0][1]["pcie_rx_mb_s"])
    assert all(v >= 0 for s in by_second for v in s)  # clamped at 0: counters never fall
    assert total != pytest.approx(Timeline(noisy()).integral("pcie_rx_mb_s", 0, 60))
    split = timeline.integral("pcie_rx_mb_s", 0, 12.25)
    rest = timeline.integral("pcie_rx_mb_s", 12.25, 60)
    assert [a + b for a, b in zip(split, rest, strict=True)] == pytest.approx(total)


def test_host_noise_and_what_stays_constant():
    gpu_only = Timeline(noisy(gpu={"utilization_gpu": 5}))
    assert gpu_only.constant(0.2, 5.8, gpus=False)  # the host does not move
    assert not gpu_only.constant(0.2, 1.2)
    host = Timeline(noisy(host={"processes.4242.main_thread_cpu_percent": 30,
                                "processes.9.threads": 2}))  # fmt: skip
    assert host.constant(1.2, 4.8, gpus=False) and not host.constant(1.2, 5.0, gpus=False)
    drawn = [host.host_state(t)["processes"][4242]["main_thread_cpu_percent"]
             for t in range(0, 150, 5)]  # a draw per 5 s (host_every)
    assert all(30 <= v <= 90 for v in drawn) and len(set(drawn)) > 20
    assert host.host_state(11)["processes"] == host.host_state(14.9)["processes"]
    assert 9 not in host.host_state(4)["processes"]  # a value never set is not invented
    looped = Timeline(noisy(gpu={"utilization_gpu": 20}), loop=True)
    assert looped.state(65)[0][0]["utilization_gpu"] == looped.state(5)[0][0]["utilization_gpu"]
    assert looped.integral("utilization_gpu", 59.5, 60.5) == pytest.approx(
        [a + b for a, b in zip(looped.integral("utilization_gpu", 59.5, 60),
                               looped.integral("utilization_gpu", 0, 0.5), strict=True)]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("noise", "message"),
    [
        ({"gpu": {"pcie_replay_count": 1}}, "gpu.pcie_replay_count: a counter"),
        ({"gpu": {"utilisation_gpu": 1}}, "gpu.utilisation_gpu: not a numeric GPU value"),
        ({"gpu": {"clock_event_reasons": 1}}, "not a numeric GPU value"),
        ({"gpu": {"power_w": "lots"}}, "gpu.power_w: an amplitude is a number or a percentage"),
        ({"gpu": {"power_w": -1}}, "gpu.power_w: an amplitude is a finite number >= 0"),
        ({"host": {"disks.nvme0n1": 1}}, "host.disks.nvme0n1: not a numeric host value"),
        ({"every": 0}, "noise.every: Input should be greater than 0"),
    ],
)
def test_noise_is_checked(tmp_path: Path, noise, message):
    path = tmp_path / "s.yaml"
    data = scenario().model_dump(mode="json", exclude_defaults=True)
    path.write_text(yaml.safe_dump({**data, "noise": noise}))
    with pytest.raises(ConfigError, match="noise") as e:
        load_scenario(path)
    assert message in str(e.value)


def test_an_expectation_names_a_cause_or_a_metric_with_bounds():
    from gpuwatchd.sim.scenario import Expectation

    e = Expectation(metric="gpuwatchd_source_up", labels={"source": "nvml"}, below=1)
    assert e.what == 'gpuwatchd_source_up{source="nvml"} < 1'
    assert Expectation(metric="gpuwatchd_gpu_nvml_hung_seconds", above=0).what == (
        "gpuwatchd_gpu_nvml_hung_seconds > 0")
    assert Expectation(cause="gpu_lost").what == "gpu_lost"
    for bad, why in (
        ({}, "exactly one"),
        ({"cause": "gpu_lost", "metric": "gpuwatchd_source_up", "below": 1}, "exactly one"),
        ({"metric": "gpuwatchd_source_up"}, "needs above and/or below"),
        ({"cause": "gpu_lost", "above": 1}, "only with metric"),
    ):
        with pytest.raises(ValueError, match=why):
            Expectation.model_validate(bad)


@pytest.mark.parametrize(
    "durations", [["10s", "20s", "5m", "1m"], [0.1, 0.2, 0.3, 0.7, 1.1, 0.1, 0.3, 2.9, 0.35]]
)
def test_the_state_kept_at_phase_starts_is_every_phase_applied(durations):
    """Timeline keeps the state at each phase's start, so that a time applies only its
    own phase: the values are those of applying every phase from the first (the path it
    keeps where starts summed in floats would leave a phase a hair short of whole)."""
    phases = [
        {
            "name": f"p{i}",
            "duration": d,
            "ramp": {"utilization_gpu": [i, i + 50], "pcie_tx_mb_s": [0, 10 * i]},
            "changes": [{"gpus": [i % 4], "set": {"pstate": i, "nvlink_down": [i]}}],
            "bridges": {"sw0-up": {"gen": 1 + i % 4}},
            "host": {"cpu_busy_percent": i},
            "host_ramp": {"iowait_percent": [0, i]},
        }
        for i, d in enumerate(durations)
    ]
    noise = {"seed": 1, "gpu": {"power_w": "5%"}, "host": {"cpu_busy_percent": 2}}
    data = {"name": "t", "node": {"gpu_count": 4}, "phases": phases, "noise": noise}
    kept, every = (Timeline(Scenario.model_validate(data)) for _ in range(2))
    every._starts_at = every._starts_at[:1]  # no phase applied: each t applies all it follows
    edges = [*kept._starts, kept.duration]
    times = {-1.0, kept.duration + 1, *(k * kept.duration / 97 for k in range(98))}
    times |= {e + d for e in edges for d in (-1e-9, 0.0, 1e-9)}
    for t in sorted(times):
        assert repr(kept.state(t)) == repr(every.state(t))
        assert repr(kept.host_state(t)) == repr(every.host_state(t))
        assert kept.integral("pcie_tx_mb_s", 0, t) == every.integral("pcie_tx_mb_s", 0, t)
    whole = isinstance(durations[0], str)  # whole seconds add up exactly: a start per phase
    assert (len(kept._starts_at) == len(durations)) == whole
