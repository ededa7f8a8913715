"""A small PyTorch training loop in three phases, with gpuwatchd.probe in it (issue 17).

  a-healthy    DataLoader(num_workers=W, pin_memory=True): the GPU is kept busy
  b-starved    the same dataset with num_workers=0: the main thread decodes every batch
  c-healthy    workers again

The dataset does real CPU work per sample (zlib-decompress a stored image, then blur,
flip and normalise it: what decoding and augmenting do), so the only change between
the phases is where that work runs. Both costs are calibrated at start: the batch size
so that one batch takes --batch-cpu-ms of one core to load, the model's depth so that
one step takes --step-ms on the device; in phase b the loop then waits about
batch-cpu-ms / step-ms per second of compute (~6 with the defaults), in a and c almost
nothing. Each step ends with loss.item() (as logging the loss does), so the probe's
compute time is the step's.

Writes JSON lines to --events: start, cuda (torch's uuid vs NVML's, CUDA init timing),
calibration, phase_start / phase_end (the probe's counters over the phase, the
allocator's state); validate.sh's analysis reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from typing import Any

import torch

# after torch, before any CUDA call: the probe times CUDA's initialisation (docs/probe.md)
from gpuwatchd import probe  # noqa: E402  (deliberately after torch)

PROBE = probe.default()

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

PHASES = ("a-healthy", "b-starved", "c-healthy")


class Events:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the run

    def add(self, kind: str, **data: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), "event": kind, **data}, default=str) + "\n")


class DecodeDataset(Dataset):
    """Images stored compressed; each read decodes and augments one (real CPU work)."""

    def __init__(self, size: int, passes: int, count: int = 64) -> None:
        self.size = size
        self.passes = passes
        g = torch.Generator().manual_seed(0)
        self.blobs = []
        for _ in range(count):
            # blocky noise: compressible, as a photo is, so zlib has real work to undo
            small = torch.randint(0, 256, (3, size // 4, size // 4), generator=g, dtype=torch.uint8)
            image = small.repeat_interleave(4, 1).repeat_interleave(4, 2)
            self.blobs.append(zlib.compress(bytes(image.flatten().tolist()), 6))

    def __len__(self) -> int:
        return 10**8  # never ends within a phase

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        raw = zlib.decompress(self.blobs[i % len(self.blobs)])
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(3, self.size, self.size)
        x = x.float()
        for _ in range(self.passes):  # a blur, the augmentation's arithmetic
            x = (x + x.roll(1, 1) + x.roll(1, 2) + x.roll(-1, 2)) * 0.25
        if i % 2:
            x = x.flip(2)
        # uint8, as image decoders return it (normalised on the device): 4x fewer bytes
        # through the workers' shared memory, whose size the lent machine may limit
        return x.to(torch.uint8), i % 10


class Net(nn.Module):
    """Patches -> `depth` residual MLP blocks -> 10 classes: big matmuls on the GPU."""

    def __init__(self, size: int, patch: int, width: int, depth: int) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(3 * patch * patch, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, p = x.shape[0], self.patch
        n = x.shape[-1] // p
        tokens = x.view(b, 3, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(b * n * n, 3 * p * p)
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + F.gelu(block(h))
        return self.head(h.view(b, n * n, -1).mean(1))


def sample_seconds(dataset: DecodeDataset, n: int = 24) -> float:
    for i in range(3):
        dataset[i]
    start = time.perf_counter()
    for i in range(n):
        dataset[i]
    return (time.perf_counter() - start) / n


class Trainer:
    def __init__(self, device: torch.device, size: int, patch: int, width: int, depth: int):
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = Net(size, patch, width, depth).to(device=device, dtype=self.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x = x.to(self.device, non_blocking=True).to(self.dtype).sub(127.5).div(64.0)
        y = y.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.model(x).float(), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()  # synchronises, as logging the loss does

    def step_seconds(self, batch: int, size: int, n: int = 6) -> float:
        x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
        y = torch.randint(0, 10, (batch,))
        for _ in range(2):
            self.step(x, y)
        start = time.perf_counter()
        for _ in range(n):
            self.step(x, y)
        return (time.perf_counter() - start) / n


def cuda_facts(device: torch.device, first_call: float) -> dict[str, Any]:
    """torch's view of the device next to NVML's, and CUDA's start-up time."""
    props = torch.cuda.get_device_properties(device)
    facts: dict[str, Any] = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_memory": props.total_memory,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "torch_uuid": str(getattr(props, "uuid", "")),
        "first_cuda_call_seconds": round(first_call, 4),
        "probe_init_seconds": (PROBE._cuda_init or (None,))[0],
    }
    try:
        import pynvml as nv

        nv.nvmlInit()
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:  # CUDA's index need not be NVML's: go by the PCI address
            address = f"{props.pci_domain_id:08x}:{bus:02x}:{props.pci_device_id:02x}.0"
            handle = nv.nvmlDeviceGetHandleByPciBusId(address)  # pynvml: no _v2 name
        else:
            handle = nv.nvmlDeviceGetHandleByIndex(device.index or 0)
        facts["nvml_uuid"] = nv.nvmlDeviceGetUUID(handle)
        nv.nvmlShutdown()
    except Exception as e:
        facts["nvml_error"] = f"{type(e).__name__}: {e}"
    bare = [u.lower().removeprefix("gpu-") for u in (facts["torch_uuid"], facts.get("nvml_uuid"))
            if u]  # fmt: skip
    facts["uuid_match"] = len(bare) == 2 and bare[0] == bare[1]
    return facts


def allocator_state(device: torch.device) -> dict[str, Any] | None:
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {
        "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
        "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
        "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
        "largest_free_block_bytes": probe.largest_free_block(
            torch.cuda.memory_snapshot(), device.index or 0
        ),
    }


def probe_counts() -> dict[str, Any]:
    return {
        "batches": PROBE.batches,
        "wait_seconds": round(PROBE.wait_seconds, 4),
        "compute_seconds": round(PROBE.compute_seconds, 4),
        "sent": PROBE.sent,
        "dropped": PROBE.dropped,
        "errors": PROBE.errors,
        "socket": PROBE.path,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--phase-seconds", default="60,120,90", help="seconds of a,b,c (or one for all three)"
    )
    parser.add_argument("--events", required=True)
    parser.add_argument("--workers", type=int, help="for a and c (default: min(12, CPUs - 3))")
    parser.add_argument("--start-at", type=float, help="unix time to begin phase a (dry run)")
    parser.add_argument("--step-ms", type=float, help="target device time of one step")
    parser.add_argument("--batch-cpu-ms", type=float, help="target CPU time to load one batch")
    args = parser.parse_args()

    seconds = [float(x) for x in args.phase_seconds.split(",")]
    seconds = seconds * 3 if len(seconds) == 1 else seconds
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # CPU (the dry run) is small; the GPU gets big matmuls
    size, patch, width = (96, 12, 4096) if cuda else (32, 8, 64)
    step_ms = args.step_ms or (25.0 if cuda else 10.0)
    batch_cpu_ms = args.batch_cpu_ms or (150.0 if cuda else 40.0)
    cpus = len(os.sched_getaffinity(0))
    workers = args.workers or max(1, min(12, cpus - 3))
    # one thread per process: in phase b the decoding runs on the main thread, as PIL does
    torch.set_num_threads(1)
    events = Events(args.events)
    events.add("start", pid=os.getpid(), device=str(device), cpus=cpus, workers=workers,
               torch=torch.__version__, python=sys.version.split()[0])  # fmt: skip

    if cuda:
        start = time.perf_counter()
        torch.zeros(1, device=device)  # CUDA initialises here (the probe times it)
        torch.cuda.synchronize(device)
        events.add("cuda", **cuda_facts(device, time.perf_counter() - start))

    dataset = DecodeDataset(size, passes=6)
    per_sample = sample_seconds(dataset)
    batch = max(8, min(512, round(batch_cpu_ms / 1000 / per_sample)))
    probe_depth = 4
    per_step = Trainer(device, size, patch, width, probe_depth).step_seconds(batch, size)
    depth = max(1, min(96, round(probe_depth * step_ms / 1000 / per_step)))
    trainer = Trainer(device, size, patch, width, depth)
    measured = trainer.step_seconds(batch, size)
    events.add("calibration", sample_ms=round(per_sample * 1000, 3), batch_size=batch,
               batch_cpu_ms=round(per_sample * batch * 1000, 1), depth=depth,
               step_ms=round(measured * 1000, 2), width=width, image_size=size,
               expected_starved_ratio=round(per_sample * batch / measured, 2))  # fmt: skip
    if cuda:
        torch.cuda.synchronize(device)

    if args.start_at:
        time.sleep(max(0.0, args.start_at - time.time()))
    for name, phase_seconds in zip(PHASES, seconds, strict=True):
        n_workers = 0 if name == "b-starved" else workers
        loader = DataLoader(
            dataset,
            batch_size=batch,
            num_workers=n_workers,
            pin_memory=cuda,
            prefetch_factor=2 if n_workers else None,
        )
        before = probe_counts()
        start = time.time()
        events.add("phase_start", phase=name, num_workers=n_workers)
        end = start + phase_seconds
        batches = probe.watch(loader)
        for x, y in batches:
            trainer.step(x, y)
            if time.time() >= end:
                break
        batches.close()  # drops the loader's iterator: its workers exit now
        after = probe_counts()
        wait = after["wait_seconds"] - before["wait_seconds"]
        compute = after["compute_seconds"] - before["compute_seconds"]
        n = after["batches"] - before["batches"]
        events.add(
            "phase_end",
            phase=name,
            batches=n,
            batches_per_s=round(n / max(1e-9, time.time() - start), 2),
            ratio=round(wait / compute, 3) if compute > 0 else None,
            loader=probe.loader_settings(loader),
            probe=after,
            cuda=allocator_state(device),
        )
    events.add("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
