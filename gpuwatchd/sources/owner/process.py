"""One GPU process's facts from /proc/PID: its cgroup, the launcher's variables in its
environment, and its uid.

/proc/PID/environ is the environment the process was started with, NUL-separated. Only the
variables below are kept, checked to be plain label values, and never logged: the rest of
an environment holds secrets. Reading another user's environ needs the same uid or
CAP_SYS_PTRACE; without them it is unreadable, which is normal (the cgroup still tells the
job, the step and the user). It is the process's own to set: it names a job only where the
scheduler confirms it (gpuwatchd.sources.owner), and never the user (issue 41).

The uid is the kernel's (/proc/PID/status), as the daemon's user namespace maps it: under
the shipped unit's PrivateUsers=yes every user but root and the daemon's reads as the
overflow uid (65534). That uid is then unknown (None), never `nobody` (`unmapped_uid`).
"""

from __future__ import annotations

import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.sources.base import read_file, read_small
from gpuwatchd.sources.owner.cgroup import Placement, parse_cgroup

# Slurm's step IDs for its named steps (slurm.h: SLURM_EXTERN_CONT, SLURM_BATCH_SCRIPT,
# SLURM_INTERACTIVE_STEP), as its cgroup directories name them
SLURM_STEPS = {"4294967292": "extern", "4294967291": "batch", "4294967290": "interactive"}
# a process's global rank, most specific launcher first: torchrun's RANK under srun is the
# worker's rank while SLURM_PROCID is the launcher's; mpirun inside an allocation inherits
# the batch step's SLURM_PROCID (0)
RANKS = (b"RANK", b"OMPI_COMM_WORLD_RANK", b"PMI_RANK", b"SLURM_PROCID")
# a launcher's signature: the variables torchrun, DeepSpeed, mpirun (Open MPI, MPICH,
# Intel MPI, PMIx) set in each rank. SLURM_PROCID alone is none: every process of a batch
# script or `srun jupyter` has it (0); a step of several tasks is (SLURM_STEP_NUM_TASKS)
SIGNATURE = (
    b"RANK", b"LOCAL_RANK", b"WORLD_SIZE", b"OMPI_COMM_WORLD_RANK", b"OMPI_COMM_WORLD_SIZE",
    b"PMI_RANK", b"PMI_SIZE", b"PMIX_RANK",
)  # fmt: skip
# what names the launch the ranks share: torch.distributed's rendezvous store, torchrun's
# run, the PMIx namespace of an MPI job, the Slurm step
COMMUNICATORS = (
    b"MASTER_ADDR", b"MASTER_PORT", b"TORCHELASTIC_RUN_ID", b"PMIX_NAMESPACE", b"SLURM_JOB_ID",
    b"SLURM_STEP_ID", b"SLURM_STEP_NUM_TASKS",
)  # fmt: skip
WANTED = frozenset({*RANKS, *SIGNATURE, *COMMUNICATORS})
MAX_ENVIRON = 1 << 20
_VALUE = re.compile(r"[\w.:@+-]{1,64}")  # a label value: printable, no space, bounded
_RANK = re.compile(r"[0-9]{1,7}")


@dataclass(frozen=True, slots=True)
class Launch:
    """The launcher's variables in a process's environment ("": not set)."""

    slurm_job: str = ""  # SLURM_JOB_ID
    slurm_step: str = ""  # SLURM_STEP_ID, named steps by name
    rank: str = ""  # the first of RANKS set
    run_id: str = ""  # TORCHELASTIC_RUN_ID (torchrun's --rdzv-id; its default "none" left out)
    launched: bool = False  # a launcher's signature (SIGNATURE): one rank of a job
    # the launch it shares with its job's other ranks, when `launched` and one is named:
    # "<MASTER_ADDR>:<MASTER_PORT>", "torchrun:<run id>", "pmix:<namespace>", "slurm:<J>.<S>"
    communicator: str = ""


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    place: Placement
    launch: Launch | None  # None: the environment could not be read
    uid: int | None  # real uid (/proc/PID/status); None: unknown, or not mapped here


def parse_environ(data: bytes) -> Launch:
    values: dict[bytes, str] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        text = value.decode("utf-8", "replace")
        if sep and key in WANTED and _VALUE.fullmatch(text):
            values[key] = text
    step = values.get(b"SLURM_STEP_ID", "")
    run_id = values.get(b"TORCHELASTIC_RUN_ID", "")
    ranks = (values.get(name, "") for name in RANKS)
    run_id = "" if run_id == "none" else run_id
    tasks = values.get(b"SLURM_STEP_NUM_TASKS", "")
    launched = any(_RANK.fullmatch(values.get(name, "")) for name in SIGNATURE) or (
        _RANK.fullmatch(tasks) is not None and int(tasks) > 1
    )
    return Launch(
        slurm_job=values.get(b"SLURM_JOB_ID", ""),
        slurm_step=SLURM_STEPS.get(step, step),
        rank=next((rank for rank in ranks if _RANK.fullmatch(rank)), ""),
        run_id=run_id,
        launched=launched,
        communicator=_communicator(values, run_id) if launched else "",
    )


def _communicator(values: dict[bytes, str], run_id: str) -> str:
    """The first name of the launch its ranks share (Launch.communicator); "" if none."""
    address, port = values.get(b"MASTER_ADDR"), values.get(b"MASTER_PORT")
    job, step = values.get(b"SLURM_JOB_ID"), values.get(b"SLURM_STEP_ID")
    namespace = values.get(b"PMIX_NAMESPACE")
    if address and port:
        return f"{address}:{port}"
    if run_id:
        return f"torchrun:{run_id}"
    if namespace:
        return f"pmix:{namespace}"
    return f"slurm:{job}.{step}" if job and step else ""


def parse_uid(status: bytes) -> int | None:
    """The real uid: the first number of /proc/PID/status's `Uid:` line."""
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return None


def parse_start(stat: bytes) -> int:
    """The start time in /proc/PID/stat (field 22): a pid and it tell processes apart."""
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19])


class Gone(Exception):
    """The process exited while it was being read."""


def unmapped_uid(proc: str = "/proc") -> int | None:
    """The uid the kernel shows, to this process, for users its user namespace does not
    map: the overflow uid (65534) where that uid is not itself mapped (PrivateUsers=yes
    maps root and the daemon's user only); None where it is (the host's namespace maps
    every uid), so that it is a real user's."""
    try:
        overflow = int(read_small(f"{proc}/sys/kernel/overflowuid"))
        lines = read_small(f"{proc}/self/uid_map").decode().splitlines()
        ranges = [tuple(int(n) for n in line.split()) for line in lines if line.strip()]
    except (OSError, ValueError):
        return None
    if any(first <= overflow < first + count for first, _, count in ranges):
        return None
    return overflow


class ProcessReader:
    """Reads GPU processes under a procfs root. The cgroup is read on every call (a process
    can be moved: pam_slurm_adopt, systemd); the environment and the uid once per process,
    told apart from a later one with its pid by the start time. `unmapped`: the uid that
    stands for any user the daemon's namespace does not map (unmapped_uid), read as None."""

    def __init__(self, procfs: Path, read_environ: bool = True, unmapped: int | None = None):
        self.procfs = procfs
        self.read_environ = read_environ
        self.unmapped = unmapped
        self._known: dict[int, tuple[int, Launch | None, int | None]] = {}

    def read(
        self, pid: int, stat: bytes | None = None, cgroup: bytes | None = None
    ) -> ProcessFacts | None:
        """The process's facts; None if it is gone (or its cgroup cannot be read).
        `stat`, `cgroup`: its files as the caller read them just now (None: read here)."""
        base = f"{self.procfs}/{pid}"
        try:
            stat = _read(f"{base}/stat", 4096) if stat is None else stat[:4096]
            start = parse_start(stat)
            cgroup = _read(f"{base}/cgroup", 65536) if cgroup is None else cgroup[:65536]
            place = parse_cgroup(cgroup.decode("utf-8", "replace"))
            known = self._known.get(pid)
            if known is None or known[0] != start:
                known = (start, self._launch(base), self._uid(base))
                self._known[pid] = known
        except (Gone, OSError, ValueError, IndexError):
            self._known.pop(pid, None)
            return None
        return ProcessFacts(place, known[1], known[2])

    def keep(self, pids: set[int]) -> None:
        """Forget the processes that are not in `pids` (no longer on a GPU)."""
        self._known = {pid: known for pid, known in self._known.items() if pid in pids}

    def _launch(self, base: str) -> Launch | None:
        if not self.read_environ:
            return None
        try:
            return parse_environ(_read(f"{base}/environ", MAX_ENVIRON))
        except Gone:
            raise
        except OSError:  # EACCES: another user's process, no CAP_SYS_PTRACE
            return None

    def _uid(self, base: str) -> int | None:
        uid = parse_uid(_read(f"{base}/status", 65536))
        return None if uid == self.unmapped else uid


def _read(path: str, limit: int) -> bytes:
    try:
        return read_file(path, limit)
    except (FileNotFoundError, ProcessLookupError) as e:
        raise Gone(path) from e


def user_name(uid: int) -> str:
    """The user's name on this host, or the uid as text."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


__all__ = [
    "Launch",
    "ProcessFacts",
    "ProcessReader",
    "parse_environ",
    "parse_uid",
    "unmapped_uid",
    "user_name",
]
