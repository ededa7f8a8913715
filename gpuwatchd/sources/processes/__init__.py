"""GPU processes: what feeds each GPU on the CPU side, and who else is on it.

Every poll takes which processes hold each GPU (NVML's compute and graphics lists) from
the nvml source, which lists them once per poll for both sources (its `ProcessTable`),
then reads /proc and the cgroup tree (`context.procfs`, `context.sysfs`) for the process
that matters on each GPU. Without a fresh table (the nvml source disabled, or not polled
within this source's interval) it asks NVML itself, through `context.pynvml` or the
installed nvidia-ml-py.

The main process
----------------
Per GPU, the *main* process is the one NVML lists with the most GPU memory (compute
before graphics, lowest pid on a tie), leaving out desktop processes (below). Its facts
are exported under the GPU's own labels `{gpu, uuid}` -- never with a pid label, so the
number of series is fixed per GPU whatever runs -- and a process that drives several
GPUs is read once per poll and reported under each of them. Per main process, per poll:

* `/proc/PID/stat`: CPU time (utime + stime, in USER_HZ = 1/100 s, the whole thread
  group), thread count, start time (which tells a reused pid from the process known;
  against `/proc/uptime`, read once per poll, its age: rules leave a process's start-up
  alone);
* `/proc/PID/task/*/stat`: each thread's CPU time, for the busiest thread (up to
  `max_threads` threads, the main thread first);
* `/proc/PID/task/PID/children`: its child processes (DataLoader workers) and their own
  `/proc/CHILD/stat`. Children of the process's other threads are looked up at every
  scan (below). Without `task/*/children` (a kernel built without CONFIG_PROC_CHILDREN)
  the scan reads every process's ppid instead;
* `/proc/PID/status`: `Cpus_allowed_list`, compared with the GPU's NUMA-local CPUs
  (`<sysfs>/bus/pci/devices/<bdf>/local_cpulist`, read once per GPU);
* `/proc/PID/cgroup`: cgroup v2 `0::/path` or the v1 line of the `cpu` controller; a
  path with a container runtime in it (docker, containerd, kubepods, libpod, crio,
  podman, lxc) means the process runs in a container. The CPU limit is the tightest
  `cpu.max` ("max 100000", "400000 100000"; v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`)
  on the path from that cgroup up to the root, and throttling comes from the
  `cpu.stat` of the cgroup that sets it (`nr_periods`, `nr_throttled`, `throttled_usec`;
  v1 `throttled_time` in ns), or of the process's own cgroup when nothing limits it;
* `/proc/PID/maps`, read once per process (again at every scan while not found): the
  CUDA runtime it mapped, `libcudart.so.12.1.105` -> "12.1", torch's bundled
  `libcudart-<hash>.so.11.0` -> "11.0", the pip wheel's `libcudart.so.12` -> "12" (the
  highest when several are mapped). Reading another user's maps needs root or
  CAP_SYS_PTRACE; without it the version is left out (logged once).

The job
-------
Distributed training runs one process per GPU (DDP under torchrun, mpirun, Slurm's
srun, DeepSpeed's launcher), so GPUs that serve one job have different main processes.
Processes are one job only when they synchronize, and what shows that they do is their
launcher's signature: the variables it sets in each rank's environment (RANK,
LOCAL_RANK, WORLD_SIZE; OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK; SLURM_PROCID in a step of
several tasks), read once per process from `/proc/PID/environ` with the owner
(gpuwatchd.sources.owner.process; only those variables are kept). Sharing a parent is
not enough: the kernels of one Jupyter server, or jobs started from one shell, are
siblings that never wait for each other. So the *job* of a GPU's main process
(`gpu_process_job`, a pid; equal values, one job) is:

* a process with a launcher's signature: one job with the main processes of the same
  owner (the cgroup's Slurm job and step, pod or container) whose environment names the
  same launch -- torch.distributed's MASTER_ADDR:MASTER_PORT, else torchrun's
  TORCHELASTIC_RUN_ID, else the PMIx namespace, else SLURM_JOB_ID.SLURM_STEP_ID; naming
  none, its siblings (same parent) with a signature. The job is named by their common
  parent's pid where it is a launcher (below), else by the lowest of their pids (ranks
  started through per-rank wrappers, or reparented after their launcher exited);
* a process whose environment was read and has no signature: a job of its own, named by
  its own pid (a notebook kernel, a single-GPU script);
* a process whose environment is unknown (unreadable: another user's process without
  CAP_SYS_PTRACE, which is the unprivileged daemon's normal case; or `owner_environ:
  false`): the old rule, as nothing better is known -- main processes with the same
  parent (the ppid in `/proc/PID/stat`) form one job named by that parent's pid, and one
  that shares its parent with no other is a job of its own. A parent that merely adopts
  orphans is no launcher: pid 1, pid 0 (a parent outside this pid namespace) and a
  process named `systemd` or `init` never make their children one job.

A process driving several GPUs is one job across them. The rules' `peers()` groups GPUs
by this series (docs/rules.md). The cgroup alone never makes a job (Slurm's task/cgroup
plugin puts each rank in its own `task_N` cgroup; a session, a service, a pod or a Slurm
step running Jupyter holds unrelated processes): it only keeps two launches apart.
Known limits: with the environment unknown, sibling notebooks count as one job and ranks
started through per-rank wrappers as one job each (a missed straggler rather than a
false one); a launcher that itself drives a GPU joins its children's job only then.

Rates (CPU ratios of one core, throttled share of periods) are deltas between two polls
over the time of `context.extras["clock"]` (the simulator's clock; default
time.monotonic), so they appear from the second poll on. A thread or child that was not
there at the previous poll was born since, and all its CPU time counts.

Of names, only `comm` and `Name:` are read, never command lines; of environments, only
the launcher's variables above are kept and none is logged (the rest holds secrets). The
`name` label of `gpu_process_info` is the main process's comm: one series per GPU at a
time.

The owner
---------
`gpu_owner_info{gpu, uuid, scheduler, job_id, step, rank, user, namespace, pod,
container}` (one series per owned GPU, the labels of gpuwatchd.sources.owner.LABELS):
who runs the GPU's main process -- its Slurm job, step, rank and user, its Kubernetes
pod, its container -- from its cgroup, environment and uid, a prolog's per-GPU job files
(`job_mapping_dir`) and the kubelet's pod-resources API (`pod_resources_socket`); see
gpuwatchd.sources.owner and docs/fleet.md. `owner: false` leaves it out.

MIG
---
A MIG-enabled GPU has no single main process: each of its GPU instances (GI) has one,
chosen as above among the processes NVML lists on the GI's MIG devices (its compute
instances share it), read the same way, and exported under the instance forms of the
families above (`gpu_instance_process_*`, `gpu_instance_owner_info`,
`gpu_instance_other_processes`: labels gpu, uuid, gpu_instance, profile, then the
family's own; same values and units). The GPU itself keeps only `gpu_processes`,
`gpu_desktop_processes` and `gpu_other_processes` (besides every GI's main process).
The per-device lists come with the nvml source's table (`ListedGpu.instances`); asked
here, the parent's v3 list is split by its GI/CI ids (`migdevices`). A GI's owner is its
own (gpuwatchd.sources.owner): never another tenant's.

Desktop and other tenants
-------------------------
Display servers, compositors and their helpers (`DESKTOP_PROCESSES`) take GPU time and
CPU from a training box. They are found in NVML's lists on every poll and, to see the
ones burning CPU without holding a GPU, in a scan of `/proc/*/comm` every `scan_every`
polls (`/proc/*/stat`, one small read per process: ~1 ms per 500 processes); the ones
found are read (`/proc/PID/stat`) on every poll until they exit. A name is no evidence
(any process may call itself Xorg, and `exec -a` gives it any argv[0]): a process with a
desktop comm counts only if it is on an NVML graphics list (a display server's context)
or its /proc/PID/cmdline starts with that program under a system directory
(`desktop.installed_desktop`), and it has the display server's signature (issue 41): it
runs on the host, not in a container, pod or job, and its /proc/PID/exe is a system
program's binary (root's, writable by no one else, under a system directory); where the
daemon may not read that link (another user's process without CAP_SYS_PTRACE: the
shipped unit), it runs as root, or on a virtual console (its controlling terminal), or
as the login user (systemd's user-U.slice) of a session with a process on one: a
desktop's compositor and indexer. Per GPU, `gpu_desktop_processes`
counts the desktop processes NVML lists on it and `gpu_other_processes` the other
processes sharing it with the main one. Node-wide, `desktop_cpu_cores` sums the desktop
processes' CPU use; `desktop_process_cpu_cores{name}` splits it by name, a label taken
only from the fixed list (bounded).

The same scan finds the NVSwitch fabric manager (nv-fabricmanager, comm
`nv-fabricmanage`), followed on every poll like a desktop process:
`fabric_manager_processes` counts it, for the nvlink_fabric_not_ready rule to say whether
it runs (the scan runs whatever `desktop` says).

Errors
------
NVML missing or failing to start fails the poll (SourceError, one line, retried next
poll), as does a missing procfs root. Per GPU: a lost GPU is skipped (the nvml source
reports it), a list NVML refuses is left out. Per process: a process that exits while it
is read (FileNotFoundError, ProcessLookupError) loses all its facts this poll; a garbled
or unreadable file loses the facts it feeds (logged once per kind of file at WARNING,
then at DEBUG); neither fails the poll. The pids NVML reports must be this procfs's: in a
container the daemon needs the host's pid namespace (Kubernetes `hostPID: true`).

Layout
------
The source is split by responsibility into the modules of this package; the package
itself exports the source and the one way to read a file. Import anything else from the
module that defines it.

* `procfs`: parsers of the /proc, sysfs and cgroup files (pure: bytes in, values out);
* `gpus`: NVML's per-GPU process lists (the nvml source's table, or asked here);
* `instances`, `migdevices`: a MIG-enabled GPU's GPU instances and their processes;
* `facts`: one main process read per poll, its rates, threads, children and cgroup;
* `jobs`: launch keys and `group_jobs` ("The job" above);
* `desktop`: desktop processes and the /proc scan that finds them;
* `metrics`: the metric specs;
* `source`: `ProcessesSource`, which wires them and emits the samples.

Every file is read through `_read` below (base.open_kernel_file: a FIFO or a device
where a kernel file should be is an error at once, never a poll stuck on it); the
modules look it up on the package at each call, so replacing it here reaches all reads.
"""

from __future__ import annotations

from gpuwatchd.sources.base import read_file, read_small
from gpuwatchd.sources.processes.procfs import _Gone
from gpuwatchd.sources.processes.source import ProcessesSource

# -- reading: the package's one way to read a file ------------------------------------------

_ONE_READ = 1 << 16  # a file this small is read in one read() call


def _read(path: str, limit: int = 1 << 20) -> bytes:
    """A kernel file's bytes (procfs, sysfs, cgroupfs); raises OSError, FileNotFoundError
    when it is not there.

    Opened by base.open_kernel_file, so it never blocks. A `limit` up to 64 KiB is a
    small file (stat, comm, one value): one read() of up to 64 KiB (base.read_small: the
    per-thread hot loop pays one call per file); a larger `limit` is read to the end of
    the file, up to `limit` (base.read_file: maps, children).
    """
    if limit <= _ONE_READ:
        return read_small(path, _ONE_READ)
    return read_file(path, limit)


def _proc_read(path: str, limit: int = 1 << 20) -> bytes:
    """A /proc/PID file; the process having exited is _Gone, not an error."""
    try:
        return _read(path, limit)
    except (FileNotFoundError, ProcessLookupError) as e:
        raise _Gone(path) from e


def _text(path: str) -> str | None:
    """A sysfs/cgroup file as text; None if it cannot be read."""
    try:
        return _read(path, 65536).decode("utf-8", "replace")
    except OSError:
        return None


__all__ = ["ProcessesSource"]
