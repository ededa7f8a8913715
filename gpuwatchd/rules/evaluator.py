"""Evaluating compiled rule expressions against a cycle's snapshot of the store.

`Evaluator` runs a `Compiled` expression's bytecode for one GPU at a time, with the
internal functions its rewritten tree calls (series lookups, window functions,
aggregates). With a `Reads` it records what the evaluation read, so the engine can tell
when evaluating the same rule again could not come out otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.metrics import PREFIX
from gpuwatchd.rules.language import (
    AGGREGATES,
    GPU,
    NIC,
    NIC_AFFINITY,
    PCIE,
    RUN_BUDGET_FACTOR,
    WINDOW_FUNCTIONS,
    Compiled,
    Family,
    Missing,
    OverBudget,
    Selector,
)

Row = tuple[tuple[str, ...], float]


class Reads:
    """What one evaluation read. Evaluated again on the same inputs it comes out the same,
    so it need not be: none of `keys` (family, index key) has other rows, none of
    `sources` has polled (a window gains a point), no window has lost its oldest point
    (`until`), and it did not read time() (`always`)."""

    __slots__ = ("keys", "sources", "until", "always")

    def __init__(self) -> None:
        self.keys: set[tuple[str, Any]] = set()
        self.sources: set[str] = set()
        self.until = math.inf
        self.always = False

    def still(self, now: float, changed: set[tuple[str, Any]], polled: set[str]) -> bool:
        """True if an evaluation at `now` would read the same as this one did."""
        return (
            not self.always
            and now <= self.until
            and self.sources.isdisjoint(polled)
            and self.keys.isdisjoint(changed)
        )


@dataclass
class GpuRef:
    """What a rule judges: a GPU, or one GPU instance of a MIG GPU (`instance`: its GI id)."""

    gpu: str
    uuid: str
    bus_id: str | None
    instance: str = ""
    profile: str = ""  # the GPU instance's, e.g. 1g.10gb
    # a GPU instance's MIG device (its first compute instance's UUID): a GI destroyed and
    # created again with the same id is another instance, another tenant's
    mig_uuid: str = ""
    # unique on the node: the GPU's UUID, the GI id after it for an instance (a field:
    # the engine looks states up by it for every rule and GPU each cycle)
    id: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self.id = f"{self.uuid}/{self.instance}" if self.instance else self.uuid

    @property
    def name(self) -> str:
        return subject_name(self.gpu, self.instance)


def subject_name(gpu: str, instance: str) -> str:
    """How a page names what a rule judged: the GPU's index, "0"; an instance, "0/3"."""
    return f"{gpu}/{instance}" if instance else gpu


class Named(float):
    """A number a summary shows by a name: lowest_peer() / highest_peer() answer the
    peer's GPU index (its `gpu` label), shown as the peer's subject name ("3", or "0/2"
    for a MIG GPU instance: two instances of one GPU share its index); names() the count
    of the places it lists, shown as the list."""

    name: str

    def __new__(cls, value: float, name: str) -> Named:
        named = super().__new__(cls, value)
        named.name = name
        return named


def peer_name(peer: GpuRef) -> Named:
    return Named(float(peer.gpu), peer.name)


NAMES_SHOWN = 8  # places names() lists; more are counted ("and 3 more")


def format_value(value: float) -> str:
    """How a summary prints a number: its name if it has one, integers whole, else three
    significant digits."""
    if isinstance(value, Named):
        return value.name
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.3g}"


@dataclass
class Snapshot:
    """The store's live series for one cycle, indexed for per-GPU lookups."""

    now: float
    per_gpu: dict[str, dict[tuple[str, str], list[Row]]] = field(default_factory=dict)
    per_bus: dict[str, dict[str, list[Row]]] = field(default_factory=dict)
    host: dict[str, list[Row]] = field(default_factory=dict)


class Evaluator:
    """Evaluates compiled expressions for one GPU at a time; Missing means not evaluable."""

    def __init__(
        self,
        window: Callable[[str, tuple[str, ...], float], list[tuple[float, float]]],
        values: Callable[[str, tuple[str, ...], float], tuple[float, float, Sequence[float]]],
    ) -> None:
        self._window = window  # (time, value) points of one series since a time
        self._values = values  # ... their values only, and the first and last ones' times
        self.snapshot = Snapshot(0.0)
        self.gpus: list[GpuRef] = []
        self.gpu = GpuRef("", "", None)
        self.compiled: Compiled | None = None
        self.reads: Reads | None = None  # what the evaluation in progress reads, if asked
        # a timed expression's atoms (timing.py), in the order evaluated: (index, outcome)
        self.atoms: list[tuple[int, bool]] | None = None
        self._ahead = 0.0  # time() is the snapshot's time plus this (timing.py's check)
        self._jobs: dict[str, float | None] = {}  # by GpuRef.id
        # what peers() groups by (PEER_GROUPING's families; set by the engine)
        self.grouping: list[Selector] = []
        # rows and samples the evaluation in progress has read, and the most it may
        # (RUN_BUDGET_FACTOR times its load-time cost): past it, OverBudget
        self.work = 0
        self.budget = math.inf
        functions: dict[str, Callable[..., Any]] = {
            "_value": self._value,
            "_present": self._present,
            "_default": self._default,
            "_peers": self._peers,
            "_lowest_peer": self._lowest_peer,
            "_highest_peer": self._highest_peer,
            "_peers_of": self._peers_of,
            "_lowest_peer_of": self._lowest_peer_of,
            "_highest_peer_of": self._highest_peer_of,
            "_when": self._when,
            "_names": self._names,
            "_div": self._div,
            "_abs": abs,
            "_time": self._time,
            "_atom": self._atom,
            "_max_of": max,
            "_min_of": min,
        }
        for name in WINDOW_FUNCTIONS:
            functions["_" + name] = getattr(self, "_w_" + name)
        for name in AGGREGATES:
            functions[f"_{name}_series"] = self._series_aggregate(name)
            functions[f"_{name}_list"] = self._list_aggregate(name)
        self._globals: dict[str, Any] = {"__builtins__": {}, **functions}

    # the cycle ------------------------------------------------------------------
    def begin(self, snapshot: Snapshot, gpus: list[GpuRef]) -> None:
        self.snapshot = snapshot
        self.gpus = gpus
        self._jobs = {}

    def evaluate(self, compiled: Compiled, gpu: GpuRef, reads: Reads | None = None) -> float:
        """The expression's value for `gpu`; raises Missing, or anything a bug raises.
        With `reads`, what the evaluation reads is added to it (and a timed expression's
        atoms are kept in `atoms`)."""
        self.compiled, self.gpu, self.reads = compiled, gpu, reads
        self.atoms = [] if reads is not None and compiled.timed else None
        self.work, self.budget = 0, compiled.cost * RUN_BUDGET_FACTOR
        try:
            value = eval(compiled.bytecode(), self._globals)
            return value if isinstance(value, Named) else float(value)
        finally:
            self.reads, self.budget = None, math.inf

    def stands_until(self, compiled: Compiled, gpu: GpuRef, later: float) -> bool:
        """True if the timed expression just evaluated for `gpu` (its `atoms` kept) takes
        the same path to the same outcome with time() at any moment up to `later`: its
        atoms come out the same at `later` (timing.py). The snapshot stays as it is."""
        atoms = self.atoms
        if atoms is None:
            return False
        self.compiled, self.gpu, self.atoms = compiled, gpu, []
        self.work, self.budget = 0, compiled.cost * RUN_BUDGET_FACTOR
        self._ahead = later - self.snapshot.now
        try:
            eval(compiled.bytecode(), self._globals)
        except Missing:
            pass  # an outcome as any other: the atoms before it tell its path
        except Exception:  # a bug's: cannot tell, evaluated again each cycle
            return False
        finally:
            later_atoms, self.atoms = self.atoms, atoms
            self._ahead, self.budget = 0.0, math.inf
        return later_atoms == atoms

    def _spend(self, read: int) -> None:
        """Count rows or samples read; OverBudget once past the evaluation's budget."""
        self.work += read
        if self.work > self.budget:
            self._over_budget()

    def _over_budget(self) -> None:
        assert self.compiled is not None
        raise OverBudget(
            f"evaluation stopped: it read more than {self.budget:.0f} series and "
            f"samples ({RUN_BUDGET_FACTOR} x its cost, {self.compiled.cost:.0f}): a "
            "family has more series than the bounds in docs/rules.md allow"
        )

    # lookups --------------------------------------------------------------------
    def family(self, selector: Selector, gpu: GpuRef | None = None) -> Family:
        """The family a lookup reads for `gpu`: the selector's, or on a GPU instance its
        instance form (the instance's own series of the same physics)."""
        family = selector.family
        if (gpu or self.gpu).instance and family.instance_form is not None:
            return family.instance_form
        return family

    def rows(self, selector: Selector, gpu: GpuRef | None = None) -> list[Row]:
        gpu = gpu or self.gpu
        family = selector.family  # self.family(selector, gpu), without a call
        if gpu.instance and family.instance_form is not None:
            family = family.instance_form
        name = family.spec.name
        key: Any
        if family.scope == GPU:
            key = (gpu.gpu, gpu.uuid)
            rows = self.snapshot.per_gpu.get(name, {}).get(key, [])
            if gpu.instance and family.per_instance:  # the instance's own rows
                rows = [r for r in rows if r[0][2] == gpu.instance]
        elif family.scope == PCIE:
            key = gpu.bus_id or ""
            rows = self.snapshot.per_bus.get(name, {}).get(key, [])
        elif family.scope == NIC:
            key = None
            rows = self.snapshot.host.get(name, [])
            self._spend(len(rows))  # every port's series looked at
            ports = self._nearest_ports(gpu)
            if ports:
                rows = [r for r in rows if r[0][:2] in ports]
        else:
            key = None
            rows = self.snapshot.host.get(name, [])
        if self.reads is not None:
            self.reads.keys.add((name, key))
        if family.scope != NIC:
            self.work += len(rows)  # self._spend(len(rows)), without a call
            if self.work > self.budget:
                self._over_budget()
        matchers = selector.matchers
        if matchers:
            # an instance form's labels: its family's, two more (gpu_instance, profile) before
            shift = len(family.spec.labels) - len(selector.family.spec.labels)
            if len(matchers) == 1:  # the usual selector: no generator per row
                ((i, v),) = matchers
                rows = [r for r in rows if r[0][i + shift] in v]
            else:
                rows = [r for r in rows if all(r[0][i + shift] in v for i, v in matchers)]
        return rows

    def _nearest_ports(self, gpu: GpuRef) -> set[tuple[str, ...]]:
        """The (device, port) pairs of the IB/RoCE ports nearest `gpu` on PCIe (the
        infiniband source's NIC_AFFINITY); empty where the node does not show them."""
        name, key = PREFIX + NIC_AFFINITY, gpu.bus_id or ""
        if self.reads is not None:
            self.reads.keys.add((name, key))
        return {r[0][1:3] for r in self.snapshot.per_bus.get(name, {}).get(key, [])}

    def _sel(self, index: int) -> Selector:
        assert self.compiled is not None
        return self.compiled.selectors[index]

    def _one(self, selector: Selector, gpu: GpuRef | None = None) -> float:
        rows = self.rows(selector, gpu)
        if not rows:
            raise Missing(selector.describe(), self.family(selector, gpu).source)
        return rows[0][1]

    def _value(self, index: int) -> float:
        return self._one(self._sel(index))

    def _present(self, index: int) -> bool:
        return bool(self.rows(self._sel(index)))

    def _default(self, index: int, fallback: float) -> float:
        rows = self.rows(self._sel(index))
        return rows[0][1] if rows else fallback

    def _time(self) -> float:
        if self.reads is not None:
            self.reads.always = True
        return self.snapshot.now + self._ahead

    def _atom(self, index: int, outcome: bool) -> bool:
        if self.atoms is not None:
            self.atoms.append((index, outcome))
        return outcome

    def _div(self, a: float, b: float) -> float:
        if b == 0:
            raise Missing("division by zero")
        return a / b

    def _job(self, gpu: GpuRef) -> float | None:
        """What peers() groups `gpu` by: its main process's job, else that process's pid
        (where the job series is absent), else None (no main process known)."""
        if gpu.id not in self._jobs:
            job = None
            for selector in self.grouping:
                rows = self.rows(selector, gpu)
                if rows:
                    job = rows[0][1]
                    break
            self._jobs[gpu.id] = job
        elif self.reads is not None:  # what it read, for this evaluation's reads too
            for selector in self.grouping:
                family = self.family(selector, gpu)
                self.reads.keys.add((family.spec.name, (gpu.gpu, gpu.uuid)))
        return self._jobs[gpu.id]

    def _peers(self, index: int) -> list[float]:
        """The selector's value on the other GPUs of this GPU's job."""
        return [value for _, value in self._peer_values(index)]

    def _lowest_peer(self, index: int) -> float:
        """The other GPU (or GPU instance) of this GPU's job where the selector is lowest
        (the first in subject order on a tie): names a peer in a summary."""
        return self._extreme_peer(index, 1.0)

    def _highest_peer(self, index: int) -> float:
        """As _lowest_peer, where the selector is highest."""
        return self._extreme_peer(index, -1.0)

    def _peers_of(self, judge: Callable[[], float]) -> list[float]:
        """An expression's value on each other GPU of this GPU's job, judged there."""
        return [value for _, value in self._peer_judgements(judge)]

    def _lowest_peer_of(self, judge: Callable[[], float]) -> float:
        return self._named_peer(self._peer_judgements(judge), 1.0)

    def _highest_peer_of(self, judge: Callable[[], float]) -> float:
        return self._named_peer(self._peer_judgements(judge), -1.0)

    def _extreme_peer(self, index: int, sign: float) -> Named:
        return self._named_peer(self._peer_values(index), sign)

    @staticmethod
    def _named_peer(values: list[tuple[GpuRef, float]], sign: float) -> Named:
        if not values:
            raise Missing("no peers")
        # min() keeps the first of equals: the peers come in subject order (by index, a
        # GPU before its instances)
        peer, _ = min(values, key=lambda pair: sign * pair[1])
        return peer_name(peer)

    def _names(self, index: int, template: str, others: tuple[tuple[str, int], ...]) -> Named:
        """The nonzero series of the selector, each told by `template` from its labels and
        the same-labelled series of `others` (family name, selector); no value if none."""
        selector = self._sel(index)
        labels = self.family(selector).spec.labels
        rows = [r for r in self.rows(selector) if r[1]]
        if not rows:
            raise Missing(f"no nonzero {selector.describe()}")
        values = {
            name: {r[0]: r[1] for r in self.rows(self._sel(other))} for name, other in others
        }
        shown = []
        for key, _ in sorted(rows)[:NAMES_SHOWN]:
            fields: dict[str, str] = dict(zip(labels, key, strict=True))
            for name, by_key in values.items():
                value = by_key.get(key)
                fields[name] = "unknown" if value is None else format_value(value)
            shown.append(template.format_map(fields))
        more = len(rows) - len(shown)
        return Named(len(rows), ", ".join(shown) + (f" and {more} more" if more else ""))

    @staticmethod
    def _when(holds: float, value: float) -> float:
        """`value` where `holds`, else no value (a summary's optional clause drops out)."""
        if not holds:
            raise Missing("condition not met")
        return value

    def _peer_values(self, index: int) -> list[tuple[GpuRef, float]]:
        """(the peer; the selector's value) on the other GPUs (and GPU instances) of this
        GPU's job."""
        selector = self._sel(index)
        values = []
        for other in self._job_peers():
            rows = self.rows(selector, other)
            if rows:
                values.append((other, rows[0][1]))
        return values

    def _job_peers(self) -> list[GpuRef]:
        """The other GPUs (and GPU instances) of this GPU's job; none without a job."""
        mine = self._job(self.gpu)
        if mine is None:
            return []
        return [o for o in self.gpus if o.id != self.gpu.id and self._job(o) == mine]

    def _peer_judgements(self, judge: Callable[[], float]) -> list[tuple[GpuRef, float]]:
        """(the peer; `judge`'s value evaluated as if the peer were this GPU) on the other
        GPUs of this GPU's job; a peer where it has no value is left out, as peers() leaves
        out a peer without the series."""
        me, values = self.gpu, []
        for other in self._job_peers():
            self.gpu = other
            try:
                values.append((other, float(judge())))
            except Missing:
                pass
            finally:
                self.gpu = me
        return values

    def _series_aggregate(self, how: str) -> Callable[[int], float]:
        def aggregate(index: int) -> float:
            selector = self._sel(index)
            rows = self.rows(selector)
            if how == "count":
                return float(len(rows))
            if how == "sum":
                return math.fsum(r[1] for r in rows)
            if not rows:
                raise Missing(selector.describe(), self.family(selector).source)
            values = [r[1] for r in rows]
            return _reduce(how, values)

        return aggregate

    @staticmethod
    def _list_aggregate(how: str) -> Callable[[list[float]], float]:
        def aggregate(values: list[float]) -> float:
            if how == "count":
                return float(len(values))
            if how == "sum":
                return math.fsum(values)
            if not values:
                raise Missing("no peers")
            return _reduce(how, values)

        return aggregate

    # windows --------------------------------------------------------------------
    def _points(self, index: int, seconds: float) -> list[list[tuple[float, float]]]:
        selector = self._sel(index)
        family = self.family(selector)  # the GPU's, or on an instance its instance form
        rows = self.rows(selector)
        if not rows:
            if selector.multi:
                return []
            raise Missing(selector.describe(), family.source)
        since = self.snapshot.now - seconds
        name = family.spec.name
        series = []
        for labels, _ in rows:
            series.append(self._window(name, labels, since))
            self._spend(len(series[-1]))
        reads = self.reads
        if reads is not None:  # a new point, or the oldest leaving, changes the window
            reads.sources.add(family.source)
            for points in series:
                if points:
                    reads.until = min(reads.until, points[0][0] + seconds)
        return series

    def _single(self, index: int, seconds: float) -> Sequence[float]:
        """The values of the one series a window function of one series reads."""
        selector = self._sel(index)
        family = self.family(selector)
        rows = self.rows(selector)
        if not rows:
            raise Missing(selector.describe(), family.source)
        first, last, values = self._values(
            family.spec.name, rows[0][0], self.snapshot.now - seconds
        )
        self._spend(len(values))
        reads = self.reads
        if reads is not None and values and min(values) == max(values):
            # every point the same: more of them (the series' value unchanged: it is read)
            # or fewer change nothing, until the window is empty (the last one leaves it)
            reads.until = min(reads.until, last + seconds)
        elif reads is not None:  # a new point, or the oldest leaving, changes the window
            reads.sources.add(family.source)
            reads.until = min(reads.until, first + seconds)
        if not values:
            raise Missing(selector.describe(), family.source)
        return values

    # A window whose points are all the same gives that value (a spread of 0) exactly,
    # however many points it holds: `_single` lets such a window gain points unevaluated,
    # and fsum([0.7] * 3) / 3 is 0.6999999999999998.
    def _w_avg_over(self, index: int, seconds: float) -> float:
        values = self._single(index, seconds)
        same = _all_same(values)
        return math.fsum(values) / len(values) if same is None else same

    def _w_stddev_over(self, index: int, seconds: float) -> float:
        values = self._single(index, seconds)
        if _all_same(values) is not None:
            return 0.0
        mean = math.fsum(values) / len(values)
        return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))

    def _w_quantile_over(self, q: float, index: int, seconds: float) -> float:
        values = self._single(index, seconds)
        same = _all_same(values)
        if same is not None and 0 <= q <= 1:
            return same
        return _quantile(q, sorted(values))

    def _extreme(
        self, index: int, seconds: float, pick: Callable[[Iterable[float]], float]
    ) -> float:
        values = [v for points in self._points(index, seconds) for _, v in points]
        if not values:
            raise Missing(self._sel(index).describe())
        return pick(values)

    def _w_min_over(self, index: int, seconds: float) -> float:
        return self._extreme(index, seconds, min)

    def _w_max_over(self, index: int, seconds: float) -> float:
        return self._extreme(index, seconds, max)

    def _w_change(self, index: int, seconds: float) -> float:
        """Increase of a counter over the window, resets handled; summed over series."""
        return math.fsum(_increase(points)[0] for points in self._points(index, seconds))

    def _w_rate(self, index: int, seconds: float) -> float:
        total = 0.0
        for points in self._points(index, seconds):
            increase, span = _increase(points)
            if span > 0:
                total += increase / span
        return total


def _all_same(values: Sequence[float]) -> float | None:
    """The one value of a window whose points are all equal to it; None otherwise."""
    first = values[0]
    return first if values.count(first) == len(values) else None


def _reduce(how: str, values: Sequence[float]) -> float:
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return math.fsum(values) / len(values)  # avg


def _quantile(q: float, ordered: list[float]) -> float:
    """Linear interpolation between closest ranks, as Prometheus' quantile_over_time."""
    if not 0 <= q <= 1:
        return math.nan
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    weight = rank - low
    return ordered[low] * (1 - weight) + ordered[high] * weight


def _increase(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(increase, seconds covered) of a counter's points; a drop is a reset from zero."""
    if len(points) < 2:
        return 0.0, 0.0
    increase = 0.0
    previous = points[0][1]
    for _, value in points[1:]:
        increase += value - previous if value >= previous else value
        previous = value
    return increase, points[-1][0] - points[0][0]
