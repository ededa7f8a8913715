"""The probe in a real PyTorch training loop (CPU build), reporting over the real socket.

A child process trains on a real DataLoader over a slow dataset, with `probe.watch`;
the daemon's probe source receives on its real socket, the kernel names the child, and
the simulated node's NVML lists the child on GPU 0. No GPU is needed: on the CPU build
the CUDA part takes its fallback (no `cuda` section, no CUDA series).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.config import ProbeConfig
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources.probe import ProbeSource

TRAIN = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from gpuwatchd import probe

workers, item_seconds, step_seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

class Slow(Dataset):
    def __len__(self):
        return 1_000_000
    def __getitem__(self, i):
        time.sleep(item_seconds)  # reading and decoding a sample
        return torch.ones(16)

loader = DataLoader(
    Slow(), batch_size=4, num_workers=workers, pin_memory=False,
    prefetch_factor=4 if workers else None, persistent_workers=workers > 0,
)
probe.configure(interval=0.2)
for batch in probe.watch(loader):
    (batch * 2).sum()
    time.sleep(step_seconds)  # the training step
"""

WAIT = "gpuwatchd_probe_wait_seconds_total"
COMPUTE = "gpuwatchd_probe_compute_seconds_total"
BATCHES = "gpuwatchd_probe_batches_total"


def on_gpu0(pid: int) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "torch",
            "node": {"gpu_count": 2},
            "phases": [
                {
                    "name": "train",
                    "duration": "1h",
                    "changes": [
                        {"gpus": [0], "set": {"processes": [{"pid": pid, "gpu_memory_mib": 900}]}}
                    ],
                }
            ],
        }
    )


@pytest.fixture
def training(tmp_path: Path) -> Iterator[object]:
    children: list[subprocess.Popen[bytes]] = []
    nodes: list[tuple[SimNode, ProbeSource]] = []

    def start(workers: int, item_seconds: float, step_seconds: float):
        socket_path = tmp_path / f"probe{len(children)}.sock"
        script = tmp_path / "train.py"
        script.write_text(TRAIN)
        child = subprocess.Popen(
            [sys.executable, str(script), str(workers), str(item_seconds), str(step_seconds)],
            env={"GPUWATCHD_PROBE_SOCKET": str(socket_path), "PATH": "/usr/bin:/bin"},
        )
        children.append(child)
        node = SimNode(on_gpu0(child.pid), virtual=True)
        context = node.context()
        del context.extras["probe_receiver"]  # the real socket, the real kernel
        source = ProbeSource(ProbeConfig(socket=socket_path), context)
        nodes.append((node, source))
        return child, node, source

    yield start
    for child in children:
        child.kill()
        child.wait()
    for node, source in nodes:
        source.close()
        node.close()


def steady_state(node: SimNode, source: ProbeSource, after: int, batches: int) -> dict[str, float]:
    """GPU 0's probe series once `after` batches are done, and the change over `batches`
    more: waits for reports (events), not for a fixed time; gives up after 3 minutes."""
    first: dict[str, float] | None = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        node.clock.advance(1.0)  # virtual: the rate limit refills, nothing expires
        node.tick()
        values = {s.name: s.value for s in source.collect() if s.labels[:1] == ("0",)}
        if values.get(BATCHES, 0) >= after and first is None:
            first = values
        if first is not None and values[BATCHES] - first[BATCHES] >= batches:
            delta = {k: values[k] - first[k] for k in (WAIT, COMPUTE, BATCHES)}
            return {**values, **{f"delta:{k}": v for k, v in delta.items()}}
        time.sleep(0.2)
    raise AssertionError("no steady reports from the training process within 3 minutes")


def test_single_process_loader_starves_the_step(training) -> None:
    child, node, source = training(workers=0, item_seconds=0.01, step_seconds=0.005)
    values = steady_state(node, source, after=5, batches=20)
    assert values["gpuwatchd_probe_pid"] == child.pid
    assert values["gpuwatchd_probe_loader_workers"] == 0
    assert values["gpuwatchd_probe_loader_pin_memory"] == 0
    assert "gpuwatchd_probe_loader_prefetch_factor" not in values  # None without workers
    assert values["gpuwatchd_probe_loader_batch_size"] == 4
    # 4 items x 10 ms of loading per batch against a 5 ms step
    assert values[f"delta:{WAIT}"] / values[f"delta:{COMPUTE}"] > 0.8
    assert not any(name.startswith("gpuwatchd_probe_cuda_") for name in values)  # CPU build


def test_worker_processes_keep_the_step_fed(training) -> None:
    child, node, source = training(workers=3, item_seconds=0.005, step_seconds=0.06)
    values = steady_state(node, source, after=20, batches=20)
    assert values["gpuwatchd_probe_loader_workers"] == 3
    assert values["gpuwatchd_probe_loader_prefetch_factor"] == 4
    assert values["gpuwatchd_probe_loader_persistent_workers"] == 1
    # 3 workers make a batch every ~7 ms against a 60 ms step: the loop barely waits
    assert values[f"delta:{WAIT}"] / values[f"delta:{COMPUTE}"] < 0.3
