"""Rules on a MIG node: a workload's causes judged per GPU instance, the GPU's physics per
GPU, peers across the instances of one job, instances coming and going (docs/mig.md)."""

from __future__ import annotations

from gpuwatchd.metrics import PREFIX, Sample, instance_form
from gpuwatchd.rules import Catalog, RuleEngine, parse_rules
from gpuwatchd.rules.engine import FIRING, INACTIVE, NOT_EVALUABLE
from gpuwatchd.sources import load_builtin_sources
from gpuwatchd.store import Store


def _catalog() -> Catalog:
    """The built-in families, with the instance forms the rules below read."""
    specs = {name: list(source.metrics) for name, source in load_builtin_sources().items()}
    by_name = {s.name: s for s in specs["processes"]}
    for whole in ("gpu_process_cpu_cores", "gpu_process_job", "gpu_process_info"):
        form = instance_form(by_name[PREFIX + whole])
        if form.name not in by_name:
            specs["processes"].append(form)
    return Catalog(specs)


CATALOG = _catalog()
MIG, WHOLE = ("0", "GPU-mig"), ("1", "GPU-whole")
# GI id -> profile of GPU 0's instances
PROFILES = {"1": "3g.40gb", "2": "4g.40gb"}


def rules(expr: str, name: str = "cause_x", summary: str = "", mig: str = "") -> str:
    return f"""
rules:
  - name: {name}
    dimension: input
    severity: warning
    expr: "{expr}"
    for: 0s
    summary: "{summary or "it holds"}"
    remedy: fix it
    {f"mig: {mig}" if mig else ""}
"""


class MigNode:
    """GPU 0 in MIG mode with instances, GPU 1 whole; the store fed as the sources would."""

    def __init__(self, text: str) -> None:
        self.store = Store(history_seconds=600)
        self.up = {"nvml", "processes"}
        self.engine = RuleEngine(
            self.store, parse_rules(text, "test.yaml", CATALOG), self.up.__contains__, CATALOG
        )
        self.instances = dict(PROFILES)
        self.mig_uuids = {gi: f"MIG-{gi}" for gi in PROFILES}
        self.nvml_lists_instances = True  # False: NVML's instance info is missing
        self.transitions: list = []

    def step(
        self,
        now: float,
        cpu: dict[str, float],
        jobs: dict[str, float] | None = None,
        temperature: float = 50,
    ) -> None:
        """`cpu`/`jobs`: by GI id on GPU 0, "whole" for GPU 1, "mig" for GPU 0 itself
        (before MIG is on)."""
        nvml = []
        for gpu, uuid in (MIG, WHOLE):
            info = (gpu, uuid, "A100", f"0000:1{gpu}:00.0", "550", "12.4")
            nvml.append(Sample(PREFIX + "gpu_info", info, 1))
            nvml.append(Sample(PREFIX + "gpu_temperature_celsius", (gpu, uuid), temperature))
        for gi, profile in self.instances.items() if self.nvml_lists_instances else ():
            labels = (*MIG, gi, "0", profile, self.mig_uuids[gi])
            nvml.append(Sample(PREFIX + "gpu_instance_info", labels, 1))
        self.store.update("nvml", now, nvml)
        processes = []
        for where, value in cpu.items():
            job = (jobs or {}).get(where, 100.0)
            if where in ("whole", "mig"):
                gpu = WHOLE if where == "whole" else MIG
                processes.append(Sample(PREFIX + "gpu_process_cpu_cores", gpu, value))
                processes.append(Sample(PREFIX + "gpu_process_job", gpu, job))
                info = (*gpu, "python", "12.4")
                processes.append(Sample(PREFIX + "gpu_process_info", info, 1))
            elif where in self.instances:
                labels = (*MIG, where, self.instances[where])
                processes.append(Sample(PREFIX + "gpu_instance_process_cpu_cores", labels, value))
                processes.append(Sample(PREFIX + "gpu_instance_process_job", labels, job))
                info = (*labels, "python" if where == "1" else "vllm", "12.4")
                processes.append(Sample(PREFIX + "gpu_instance_process_info", info, 1))
        self.store.update("processes", now, processes)
        self.transitions = self.engine.evaluate(now)

    def states(self, cause: str = "cause_x", gpu: str = "GPU-") -> dict[str, str]:
        """GpuRef.id -> state of `cause` wherever the engine judges it (on GPUs whose
        uuid starts with `gpu`)."""
        return {
            key: s.state
            for (key, name), s in self.engine.states.items()
            if name == cause and key.startswith(gpu)
        }


def test_a_workload_cause_is_judged_on_each_instance_and_named_by_it():
    node = MigNode(rules("gpu_process_cpu_cores > 0.9", summary="{{ gpu_process_cpu_cores }}"))
    node.step(0, cpu={"1": 1.0, "2": 0.2, "whole": 1.0})
    # the MIG GPU itself has no main process: only its instances are judged
    assert node.states() == {"GPU-mig/1": FIRING, "GPU-mig/2": INACTIVE, "GPU-whole": FIRING}
    assert node.engine.firing() == [("0/1", "cause_x", "1"), ("1", "cause_x", "1")]
    rows = node.engine.rows()
    active = dict(rows[PREFIX + "starvation_active"])
    assert active == {
        ("0", "GPU-mig", "cause_x", "input", "warning", "1"): 1,
        ("1", "GPU-whole", "cause_x", "input", "warning", ""): 1,
    }
    assert dict(rows[PREFIX + "gpu_starved"]) == {MIG: 1, WHOLE: 1}


def test_a_cause_of_the_gpu_physics_stays_per_gpu():
    node = MigNode(rules("gpu_temperature_celsius > 80"))
    node.step(0, cpu={"1": 1.0, "2": 0.2}, temperature=90)
    assert node.states() == {"GPU-mig": FIRING, "GPU-whole": FIRING}


def test_a_rule_says_what_it_judges_on_a_mig_gpu():
    node = MigNode(rules("gpu_temperature_celsius > 80", mig="instance"))
    node.step(0, cpu={"1": 1.0, "2": 0.2}, temperature=90)
    assert node.states() == {"GPU-mig/1": FIRING, "GPU-mig/2": FIRING, "GPU-whole": FIRING}
    node = MigNode(rules("gpu_process_cpu_cores > 0.9", mig="gpu"))
    node.step(0, cpu={"1": 1.0, "2": 0.2, "whole": 1.0})
    # the whole MIG GPU has no main process of its own: not evaluable there
    assert node.states() == {"GPU-mig": NOT_EVALUABLE, "GPU-whole": FIRING}


def test_peers_span_the_instances_of_one_job():
    """GI 2 idles while GI 1 of the same job works: a straggler across instances; the
    whole GPU of another job is nobody's peer."""
    text = rules("gpu_process_cpu_cores < 0.5 and max(peers(gpu_process_cpu_cores)) > 0.9")
    node = MigNode(text)
    node.step(0, cpu={"1": 1.0, "2": 0.2, "whole": 1.0}, jobs={"whole": 200})
    states = node.states()
    assert states["GPU-mig/2"] == FIRING and states["GPU-mig/1"] == INACTIVE
    assert states["GPU-whole"] == INACTIVE
    node.step(10, cpu={"1": 1.0, "2": 0.2, "whole": 1.0}, jobs={"2": 300, "whole": 200})
    assert node.states()["GPU-mig/2"] != FIRING  # another job now: no peer


def test_label_matchers_and_windows_read_the_instance_form():
    text = rules(
        "count(series('gpu_process_info', name='vllm')) > 0 "
        "and avg_over(gpu_process_cpu_cores, '1m') > 0.5"
    )
    node = MigNode(text)
    for t in range(0, 60, 10):
        node.step(t, cpu={"1": 1.0, "2": 0.9 if t < 30 else 0.0})
    # GI 1 runs python, not vllm; GI 2's average over the minute: 0.45
    assert node.states(gpu="GPU-mig") == {"GPU-mig/1": INACTIVE, "GPU-mig/2": INACTIVE}
    node = MigNode(text)
    for t in range(0, 60, 10):
        node.step(t, cpu={"1": 1.0, "2": 0.9})
    assert node.states(gpu="GPU-mig") == {"GPU-mig/1": INACTIVE, "GPU-mig/2": FIRING}


def test_an_instance_destroyed_takes_its_state_with_it():
    node = MigNode(rules("gpu_process_cpu_cores > 0.9"))
    node.step(0, cpu={"1": 1.0, "2": 1.0})
    assert set(node.states(gpu="GPU-mig")) == {"GPU-mig/1", "GPU-mig/2"}
    del node.instances["2"]
    node.step(10, cpu={"1": 1.0})
    assert node.states(gpu="GPU-mig") == {"GPU-mig/1": FIRING}
    assert "GPU-mig/2" not in node.engine.gpus
    # MIG disabled: no instance left, the GPU's own main process is judged again
    node.instances.clear()
    node.step(20, cpu={})
    assert set(node.states(gpu="GPU-mig")) == {"GPU-mig"}


def test_a_mig_gpus_own_state_ends_once_its_instances_are_judged():
    """MIG enabled under a cause firing on the whole GPU: the GPU's state for a rule now
    judged on its instances ends (resolved, not left firing), and nothing is exported
    for it; MIG off again, the GPU is judged afresh."""
    node = MigNode(rules("gpu_process_cpu_cores > 0.9"))
    node.instances.clear()
    node.step(0, cpu={"mig": 1.0})
    assert node.states(gpu="GPU-mig") == {"GPU-mig": FIRING}
    node.instances = dict(PROFILES)
    node.step(10, cpu={"1": 0.2, "2": 0.2})
    assert node.states(gpu="GPU-mig") == {"GPU-mig/1": INACTIVE, "GPU-mig/2": INACTIVE}
    ended = [(t.gpu, t.instance, t.old, t.new) for t in node.transitions]
    assert ended == [("0", "", FIRING, INACTIVE)]
    rows = node.engine.rows()
    assert rows[PREFIX + "starvation_active"] == []
    assert dict(rows[PREFIX + "gpu_starved"])[MIG] == 0
    node.instances.clear()
    node.step(20, cpu={"mig": 0.2})
    assert node.states(gpu="GPU-mig") == {"GPU-mig": INACTIVE}


def test_an_instance_created_again_is_a_new_tenants():
    """GI 1 destroyed and created again between two polls (same id, a new MIG device):
    the old tenant's firing state is not the new one's."""
    node = MigNode(rules("gpu_process_cpu_cores > 0.9"))
    node.step(0, cpu={"1": 1.0, "2": 0.2})
    assert node.states()["GPU-mig/1"] == FIRING
    node.mig_uuids["1"] = "MIG-new"
    node.step(10, cpu={"1": 1.0, "2": 0.2})
    moves = [(t.instance, t.old, t.new) for t in node.transitions]
    assert moves == [("1", FIRING, INACTIVE), ("1", INACTIVE, FIRING)]


def test_instances_stand_while_nvml_is_down():
    """A stale NVML source shows no instances for a while: they are as last known, their
    states kept (no flapping of every instance's causes on a restart)."""
    node = MigNode(rules("gpu_process_cpu_cores > 0.9"))
    node.step(0, cpu={"1": 1.0, "2": 0.2})
    node.up.discard("nvml")
    node.nvml_lists_instances = False
    node.step(10, cpu={"1": 1.0, "2": 0.2})
    assert node.states(gpu="GPU-mig") == {"GPU-mig/1": FIRING, "GPU-mig/2": INACTIVE}
    assert node.transitions == []


def test_a_mig_gpu_in_a_vm_throttled_and_stolen():
    """The corpus's mig-thermal-steal-a100: clock_throttled on the GPU (as busy as its
    busiest instance), cpu_steal on the busy instance only, never on the empty one."""
    from gpuwatchd.config import Config
    from gpuwatchd.sim.scenario import load_scenario
    from gpuwatchd.simulate import Simulation

    simulation = Simulation(load_scenario("mig-thermal-steal-a100"), Config())
    try:
        result = simulation.run()
    finally:
        simulation.close()
    fired = {(t.cause, t.where) for t in result.transitions if t.new == FIRING}
    assert fired == {("clock_throttled", "0"), ("cpu_steal", "0/1")}


def test_a_summary_names_a_peer_instance_by_its_instance():
    """lowest_peer() / highest_peer() on a MIG GPU name the instance ("0/2"), not the
    GPU's index its instances share; a whole GPU reads as its index."""
    summary = (
        "idle peer {{ lowest_peer(gpu_process_cpu_cores) }},"
        " busy peer {{ highest_peer(gpu_process_cpu_cores) }}"
    )
    text = rules("max(peers(gpu_process_cpu_cores)) > 0.9", summary=summary)
    node = MigNode(text)
    node.step(0, cpu={"1": 0.1, "2": 0.95, "whole": 0.5})
    summaries = {k: s.summary for (k, _), s in node.engine.states.items() if s.state == FIRING}
    assert summaries == {
        "GPU-mig/1": "idle peer 1, busy peer 0/2",
        "GPU-whole": "idle peer 0/1, busy peer 0/2",
    }
