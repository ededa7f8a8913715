"""Who sent a probe report, as the daemon shares its queue and its tracked pids: the
sender's *tenant*, something it cannot multiply (issue 41, item 3).

Not its uid: under the shipped unit's PrivateUsers=yes the kernel gives 65534 for every
user but root and the daemon's, so all tenants were one; and a process with CAP_SETUID in
a user namespace of its own (a root container, a rootless one with 65,536 subordinate
uids) sends under as many uids as it likes. Not its pid: one per fork. Its cgroup is set by
its scheduler or login manager, and a tenant can only make cgroups below the one it was
given, so the tenant is that cgroup cut where the tenant's own subtree begins
(owner.cgroup.tenant): its Slurm job, its pod, its login user's slice, its outermost
container, else the first two levels of the path. A process at the root of every hierarchy
(no systemd, no scheduler) is told by its kernel uid; one whose cgroup cannot be read
(exited, or outside the daemon's pid namespace: pid 0) shares one tenant with all such.

`Roster` bounds the pids whose reports the source keeps, per tenant and in all.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from gpuwatchd.sources.base import read_small
from gpuwatchd.sources.owner.cgroup import tenant
from gpuwatchd.sources.owner.process import parse_uid

UNKNOWN = "?"  # the tenant of a sender whose cgroup cannot be read


class Tenants:
    """pid -> tenant, each read once (/proc/PID/cgroup) until `renew` (every poll: a pid
    may be reused meanwhile) and at most `limit` pids at a time. Shared by the socket's
    draining thread and the poll; a race costs a read, never a wrong answer."""

    def __init__(self, procfs: str = "/proc", limit: int = 4096) -> None:
        self._proc = procfs
        self._limit = limit
        self._known: dict[int, str] = {}

    def of(self, pid: int) -> str:
        known = self._known.get(pid)
        if known is None:
            known = self._read(pid) if pid > 0 else UNKNOWN
            if len(self._known) >= self._limit:
                self._known = {}
            self._known[pid] = known
        return known

    def renew(self) -> None:
        self._known = {}

    def _read(self, pid: int) -> str:
        try:
            text = read_small(f"{self._proc}/{pid}/cgroup", 65536).decode("utf-8", "replace")
            found = tenant(text)
            if found is not None:
                return found
            uid = parse_uid(read_small(f"{self._proc}/{pid}/status", 65536))
        except OSError:
            return UNKNOWN
        return UNKNOWN if uid is None else f"uid:{uid}"


# Tracked pids: each costs a /proc/PID/stat read a poll, and 2,287 cheap reporters made a
# poll take 32-114 ms (issue 41). A node runs a rank per GPU or MIG instance.
MAX_PIDS = 256
PIDS_PER_TENANT = 64


class Tracked(Protocol):
    tenant: str
    seen: float  # when its latest report came


T = TypeVar("T", bound=Tracked)


class Roster(Generic[T]):
    """The pids whose reports are kept, at most `per_tenant` of one tenant and `most` in
    all. At `most`, a new pid of a tenant with fewer takes the place of the stalest pid of
    the tenant tracking the most (as the Inbox does with datagrams), so neither one tenant
    nor many keep another's pids out."""

    def __init__(self, most: int = MAX_PIDS, per_tenant: int = PIDS_PER_TENANT) -> None:
        self.most = most
        self.per_tenant = per_tenant
        self.pids: dict[int, T] = {}
        self._counts: dict[str, int] = {}

    def room(self, tenant: str) -> bool:
        """Whether a new pid of `tenant` may be added (making room if it may)."""
        mine = self._counts.get(tenant, 0)
        if mine >= self.per_tenant:
            return False
        if len(self.pids) < self.most:
            return True
        biggest = max(self._counts, key=self._counts.__getitem__)
        if mine + 1 >= self._counts[biggest]:
            return False
        theirs = (pid for pid, state in self.pids.items() if state.tenant == biggest)
        self.remove(min(theirs, key=lambda pid: self.pids[pid].seen))
        return True

    def add(self, pid: int, state: T) -> None:
        self.pids[pid] = state
        self._counts[state.tenant] = self._counts.get(state.tenant, 0) + 1

    def remove(self, pid: int) -> None:
        tenant = self.pids.pop(pid).tenant
        self._counts[tenant] -= 1
        if not self._counts[tenant]:
            del self._counts[tenant]
