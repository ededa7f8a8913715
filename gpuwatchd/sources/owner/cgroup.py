"""Where a process runs, from its /proc/PID/cgroup: a Slurm step, a Kubernetes pod, a
container, or none of these.

The file has one `hierarchy-ID:controllers:path` line per hierarchy (cgroup v1, and the
`0::` line of hybrid systems) or the single `0::/path` line of cgroup v2. Each path is read
on its own and the most specific answer wins (Slurm, then Kubernetes, then a container):
on v1 a job may show in one hierarchy only (Slurm's proctrack/cgroup moves the process in
`freezer` while `cpu` stays at slurmd.service).

Paths are taken component by component, so the same rule reads a path seen from the host
and one seen from inside a cgroup namespace (a daemon in a container without the host's
cgroup namespace reads `0::/../../kubepods-…-pod<UID>.slice/cri-containerd-<ID>.scope`):
`..` components are skipped.

A scheduler's directories count only where the scheduler makes them, from the root of
the hierarchy: Slurm's `/slurm[_<node>]/uid_U/job_J` (v1) and
`/system.slice/[<node>_]slurmstepd.scope/job_J` (v2), Kubernetes' `kubepods…` tree.
Anywhere else they are a tenant's own: systemd delegates `user@UID.service` (and a
container may own its subtree), so a tenant can name a cgroup
`…/uid_<victim>/job_<J>/step_0` or `…/kubepods-pod<UID>.slice` and must not be charged
as that job or pod (issue 23).

The login user of systemd's `/user.slice/user-U.slice/…` (a session, a user manager) is
the uid of the path too: under the shipped unit's PrivateUsers=yes, /proc/PID/status shows
65534 for every user but root and the daemon's, and a path names the real one (issue 41).
`tenant` cuts a path where the tenant's own subtree begins: what the probe shares its
queue by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

# a pod UID: a UUID (with `_` for `-` in systemd slice names), or the 32 hex digits of a
# static pod's UID (a hash of its manifest)
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_CGROUPFS_POD = re.compile(rf"pod({_UID})")  # cgroupfs driver: kubepods[/qos]/pod<UID>
# systemd driver: kubepods-<qos>-pod<UID>.slice (guaranteed pods: no qos); kubelet-
# prefixed when the kubelet runs in a container of its own (kind)
_SYSTEMD_POD = re.compile(rf"(?:kubelet-)?kubepods(?:-[a-z]+)?-pod({_UID})\.slice")
# a container's own cgroup: <runtime>-<ID>.scope (systemd), <runtime>-<ID> (cgroupfs),
# also as the last two fields of containerd's `<slice>:cri-containerd:<ID>` (v1 + systemd)
_PREFIXES = "cri-containerd|crio|docker|libpod|libpod-payload"
_SCOPE = re.compile(rf"({_PREFIXES})[-:]([0-9a-f]{{64}})(?:\.scope)?")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# the scheme Kubernetes writes before a container ID (`containerd://…`), by cgroup prefix
_RUNTIMES = {
    "cri-containerd": "containerd",
    "crio": "cri-o",
    "docker": "docker",
    "libpod": "podman",
    "libpod-payload": "podman",
}
_JOB = re.compile(r"job_([0-9]{1,12})")
_STEP = re.compile(r"step_([0-9A-Za-z_.+-]{1,32})")  # 0, 1, …, batch, extern, interactive
_UID_DIR = re.compile(r"uid_([0-9]{1,10})")
_USER_SLICE = re.compile(r"user-([0-9]{1,10})\.slice")  # systemd's slice of a login user
_SLURM_V1_ROOT = re.compile(r"slurm(?:_[0-9A-Za-z_.-]{1,64})?")  # /slurm_<node>: multiple slurmd
# what may lie between the root and a pod: kubepods' QoS levels (both drivers), kind's
# kubelet-prefixed slices, containerd's service on v1 with systemd (root-owned, none of them
# delegated)
_POD_ANCESTOR = re.compile(
    r"kubelet\.slice|(?:kubelet-)?kubepods(?:-[a-z]+)?(?:\.slice)?|burstable|besteffort"
    r"|system\.slice|containerd\.service"
)
_RANK = {"process": 0, "container": 1, "kubernetes": 2, "slurm": 3}


@dataclass(frozen=True, slots=True)
class Placement:
    """What a process's cgroup says about who runs it; empty fields are unknown."""

    scheduler: str = "process"  # "slurm", "kubernetes", "container" or "process"
    job_id: str = ""  # Slurm job
    step: str = ""  # Slurm step: "0", "1", …, "batch", "extern", "interactive"
    # the uid a root-made directory names: a Slurm job's owner (v1 `uid_U`), else the
    # login user of systemd's `/user.slice/user-U.slice`
    uid: int | None = None
    pod_uid: str = ""  # Kubernetes pod UID, with dashes
    # "<runtime>://<ID>" (containerd, cri-o, docker, podman), or the bare ID (runtime unknown)
    container: str = ""


NOWHERE = Placement()


def parse_cgroup(text: str) -> Placement:
    """The most specific placement any line of a /proc/PID/cgroup file names."""
    paths: dict[str, None] = {}  # v1 hierarchies mostly repeat one path: read it once
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        _, sep, path = rest.partition(":")  # the path itself may hold ':' (containerd, v1)
        if sep:
            paths[path] = None
    best = NOWHERE
    for path in paths:
        found = place(path)
        if _weight(found) > _weight(best):
            best = found
    return best


def _weight(found: Placement) -> tuple[int, bool]:
    return _RANK[found.scheduler], found.uid is not None


def place(path: str) -> Placement:
    """The placement one cgroup path names."""
    parts = _parts(path)
    if not parts:
        return NOWHERE
    found = _slurm(parts) or _kubernetes(parts) or _container(parts) or NOWHERE
    uid = _login_uid(parts)
    return replace(found, uid=uid) if uid is not None and found.uid is None else found


def _parts(path: str) -> list[str]:
    return [part for part in path.strip().split("/") if part not in ("", ".", "..")]


def _login_uid(parts: list[str]) -> int | None:
    """U of `/user.slice/user-U.slice/…`: logind makes it root's, so a user cannot leave it
    (nor make it deeper: `user@U.service` below is the user's own)."""
    if len(parts) < 2 or parts[0] != "user.slice":
        return None
    match = _USER_SLICE.fullmatch(parts[1])
    return int(match[1]) if match and int(match[1]) < 2**32 - 1 else None


def tenant(text: str) -> str | None:
    """What a process's cgroup (a /proc/PID/cgroup file) says of who runs it, cut where
    that tenant's own subtree begins, so that it cannot be multiplied: its Slurm job, its
    pod, its login user's slice, the outermost container, else the first two levels of
    systemd's path (`system.slice/x.service`); None for a process at the root."""
    found = parse_cgroup(text)
    if found.scheduler == "slurm":
        return f"slurm:{found.job_id}"
    if found.scheduler == "kubernetes":
        return f"pod:{found.pod_uid}"
    if found.uid is not None:
        return f"user:{found.uid}"  # before containers: a user's own subtree holds its own
    parts = _parts(_systemd_path(text))
    for i, part in enumerate(parts):
        if _runtime_id(part):
            return "cgroup:" + "/".join(parts[: i + 1])  # the outermost: its engine made it
    return "cgroup:" + "/".join(parts[:2]) if parts else None


def _systemd_path(text: str) -> str:
    """The path of the hierarchy that organizes processes: v2's (`0::`), else v1's
    `name=systemd`, else the first that is not the root."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if sep and _parts(path):
            paths.setdefault(controllers, path)
    return paths.get("") or paths.get("name=systemd") or next(iter(paths.values()), "")


def _slurm(parts: list[str]) -> Placement | None:
    """v1: /slurm/uid_U/job_J/step_S[/task_T]; cgroup/v2 plugin:
    /system.slice/[<node>_]slurmstepd.scope/job_J/step_S/{user/task_T,slurm}."""
    if len(parts) >= 3 and _SLURM_V1_ROOT.fullmatch(parts[0]):
        uid = _UID_DIR.fullmatch(parts[1])
        if uid is None:
            return None
    elif len(parts) >= 3 and parts[0] == "system.slice" and parts[1].endswith("slurmstepd.scope"):
        uid = None
    else:
        return None
    job = _JOB.fullmatch(parts[2])
    if job is None:
        return None
    step = _STEP.fullmatch(parts[3]) if len(parts) > 3 else None
    return Placement(
        "slurm", job_id=job[1], step=step[1] if step else "", uid=int(uid[1]) if uid else None
    )


def _kubernetes(parts: list[str]) -> Placement | None:
    """The pod the kubepods tree holds from the root, and the container cgroup under it
    (a pod-like name any deeper is the pod's own business, never another pod)."""
    for i, part in enumerate(parts):
        # containerd 1.4 on v1 with systemd: <pod slice>:cri-containerd:<ID>
        slice_, _, colon = part.partition(":")
        pod = _SYSTEMD_POD.fullmatch(slice_)
        if pod is None and any(a.startswith("kubepods") for a in parts[:i]):
            pod = _CGROUPFS_POD.fullmatch(part)
        if pod is not None:
            below = colon or (parts[i + 1] if i + 1 < len(parts) else "")
            uid = pod[1].replace("_", "-")
            return Placement("kubernetes", pod_uid=uid, container=_runtime_id(below))
        if not _POD_ANCESTOR.fullmatch(part):
            return None
    return None


def _container(parts: list[str]) -> Placement | None:
    """The innermost docker or podman container: docker-<ID>.scope, /docker/<ID>,
    libpod-<ID>[.scope][/container] (not the libpod-conmon- monitor beside it)."""
    for i in reversed(range(len(parts))):
        container = _runtime_id(parts[i])
        if container and "://" not in container:  # a bare ID is docker's only under /docker
            container = f"docker://{container}" if i and parts[i - 1] == "docker" else ""
        if container:
            return Placement("container", container=container)
    return None


def _runtime_id(part: str) -> str:
    """`<runtime>://<ID>` for a container's cgroup name, the bare ID when it names no
    runtime (the cgroupfs driver's `<ID>`), "" when it is no container (conmon, a slice)."""
    scope = _SCOPE.fullmatch(part)
    if scope:
        return f"{_RUNTIMES[scope[1]]}://{scope[2]}"
    return part if _HEX64.fullmatch(part) else ""
