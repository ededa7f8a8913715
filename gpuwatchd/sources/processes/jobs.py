"""Which GPU main processes are one job: launcher signatures, then shared parents.

`launch_key` reduces a process's owner and launcher environment (read by
gpuwatchd.sources.owner) to what the ranks of one launch share; `group_jobs` turns the
main processes of this poll into `gpu_process_job` values, which the rules' `peers()`
groups GPUs by. The rules themselves are "The job" in gpuwatchd.sources.processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwatchd.sources.owner import ProcessFacts

# parents that adopt orphans (subreapers) rather than launch a job: their children are
# never one job however many GPUs they use
ADOPTERS = frozenset({"systemd", "init"})

# parents whose children are ranks of one launch, told without their environment (the
# daemon without CAP_SYS_PTRACE reads another user's comm and cmdline, not its environ):
# by comm, or by the module a Python launcher runs (`python -m torch.distributed.run`).
# Any other parent (a JupyterLab server, a shell, a scheduler's wrapper) starts processes
# that may never synchronize: grouping them would invent stragglers (issue 39 item 5)
LAUNCHER_COMMS = frozenset({
    "torchrun", "deepspeed", "accelerate", "horovodrun", "mpirun", "mpiexec", "orterun",
    "orted", "prterun", "prted", "hydra_pmi_proxy", "slurmstepd",
})  # fmt: skip
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher")

# launch_key() of a process whose environment was read and names no launcher
ALONE: tuple[str, ...] = ()


def launch_key(facts: ProcessFacts | None) -> tuple[str, ...] | None:
    """What a GPU main process's ranks share ("The job" in the package's docstring): its
    owner (the cgroup's scheduler, Slurm job and step, pod, container) and the launch its
    environment names (Launch.communicator; "" when none, then the parent tells); ALONE
    for a readable environment without a launcher's signature; None when the environment
    is unknown (unreadable, not read, or the process gone)."""
    if facts is None or facts.launch is None:
        return None
    if not facts.launch.launched:
        return ALONE
    place = facts.place
    return (
        place.scheduler, place.job_id, place.step, place.pod_uid, place.container,
        facts.launch.communicator,
    )  # fmt: skip


def is_launcher(comm: str, argv: list[str]) -> bool:
    """A launcher by its comm, or a Python running a launcher module (its argv)."""
    if comm in LAUNCHER_COMMS:
        return True
    pairs = zip(argv, argv[1:], strict=False)
    return any(a == "-m" and b.startswith(LAUNCHER_MODULES) for a, b in pairs)


def group_jobs(
    parents: dict[int, int],
    adopter: Callable[[int], bool],
    keys: dict[int, tuple[str, ...] | None] | None = None,
    launches: Callable[[int], bool] | None = None,
) -> dict[int, int]:
    """pid -> job of GPU main processes given as {pid: ppid} and their launch_key() (none
    given: all unknown).

    Unknown: their parent's pid when it is the parent of another unknown one, is neither
    0 nor 1, is no `adopter(ppid)` (a subreaper) and, given `launches`, `launches(ppid)`
    (a launcher by its command), else their own pid. ALONE: their own
    pid. A key: the processes with the same key (and, when it names no launch, the same
    parent) are one job, named by their common parent where it is a launcher, else by
    their lowest pid."""
    keys = keys or {}
    by_parent: dict[int, list[int]] = {}
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for pid, ppid in parents.items():
        key = keys.get(pid)
        if key is None:
            by_parent.setdefault(ppid, []).append(pid)
        elif key == ALONE:
            by_key[("pid", pid)] = [pid]
        else:  # a launch that names nothing shared: its ranks are siblings
            by_key.setdefault(key if key[-1] else (*key, str(ppid)), []).append(pid)
    jobs: dict[int, int] = {}
    for ppid, pids in by_parent.items():
        launcher = len(pids) > 1 and ppid > 1 and not adopter(ppid)
        launcher = launcher and (launches is None or launches(ppid))
        for pid in pids:
            jobs[pid] = ppid if launcher else pid
    for pids in by_key.values():
        shared = {parents[pid] for pid in pids}
        ppid = shared.pop() if len(shared) == 1 else 0
        job = ppid if len(pids) > 1 and ppid > 1 and not adopter(ppid) else min(pids)
        jobs.update(dict.fromkeys(pids, job))
    return jobs


class _Memo:
    """A reader of process facts that reads each pid once per poll."""

    def __init__(self, read: Callable[[int], ProcessFacts | None]) -> None:
        self._read = read
        self._facts: dict[int, ProcessFacts | None] = {}

    def __call__(self, pid: int) -> ProcessFacts | None:
        if pid not in self._facts:
            self._facts[pid] = self._read(pid)
        return self._facts[pid]
