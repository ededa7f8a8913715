"""The rule language: Python expression syntax, parsed by simpleeval, run as bytecode.

An expression is parsed once, at load, by simpleeval (Python's own `ast` underneath),
checked against the series the sources declare, and rewritten so that evaluation needs
no name lookups: every series reference becomes a call to an internal function with
the index of a pre-built `Selector`. The rewritten tree (numbers, operators and those
calls, nothing else) is compiled by Python once and evaluated without builtins.
Load-time problems (syntax, unknown series, unknown labels, wrong argument types, a
labelled family used as a single value) carry the line and column of the offending
node. docs/rules.md is the reference.
"""

from __future__ import annotations

import ast
import difflib
import math
import string
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from simpleeval import SimpleEval

from gpuwatchd.config import parse_duration
from gpuwatchd.metrics import PREFIX, MetricSpec
from gpuwatchd.rules.timing import time_atoms


class Missing(Exception):
    """An input the expression needed has no value for this GPU: not evaluable. `source`:
    the source whose series was missing ("" for a missing peer, a division by zero)."""

    def __init__(self, message: str, source: str = "") -> None:
        super().__init__(message)
        self.source = source


class OverBudget(Missing):
    """The evaluation read more rows and samples than its bound (Evaluator.budget): not
    evaluable, its message the reason (a family with more series than SERIES_MAXIMA)."""


@dataclass(frozen=True)
class Problem:
    """A load-time problem in one field of one rule, with a position where known."""

    field: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}, column {self.column}: " if self.line is not None else ""
        return f"{self.field}: {where}{self.message}"


class CompileError(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


# ---------------------------------------------------------------------------- catalog

GPU, PCIE, NIC, HOST = "gpu", "pcie", "nic", "host"
# what joins a NIC family (labelled device, port) to a GPU: the ports nearest it on PCIe
NIC_AFFINITY = "ib_port_gpu_distance"


@dataclass(frozen=True)
class Family:
    """A metric family as the language sees it: bare name, scope, free labels, source."""

    name: str  # without the gpuwatchd_ prefix
    spec: MetricSpec
    source: str
    # gpu (joined on gpu/uuid), pcie (on gpu_bus_id), nic (an IB/RoCE port's, on the ports
    # nearest the GPU: NIC_AFFINITY; every port where the node does not show it), host
    scope: str
    # the family's per-MIG-GPU-instance form (metrics.instance_form), read in its place
    # when a rule judges a GPU instance (docs/mig.md)
    instance_form: Family | None = None

    @property
    def per_instance(self) -> bool:
        """A MIG GPU instance has its own series of this family: it is judged per instance
        (an instance form, or a family labelled by gpu_instance itself)."""
        return self.instance_form is not None or self.spec.labels[2:3] == ("gpu_instance",)

    @property
    def own_labels(self) -> tuple[str, ...]:
        """Labels other than the ones that join the family to a GPU."""
        skip = {GPU: 2, PCIE: 1, NIC: 0, HOST: 0}[self.scope]
        return self.spec.labels[skip:]

    def label_max(self, label: str) -> int:
        """The most values `label` takes (for one GPU; for the node in host and NIC
        families): the cost's worst case."""
        return SERIES_MAXIMA.get((self.scope, label), _MULTI_SERIES)

    @property
    def max_series(self) -> int:
        """The most series a lookup looks at (the cost's worst case)."""
        return math.prod(self.label_max(label) for label in self.own_labels)


class Catalog:
    """Every family the sources can produce, by bare name."""

    def __init__(self, specs_by_source: dict[str, Iterable[MetricSpec]]) -> None:
        self.families: dict[str, Family] = {}
        for source, specs in specs_by_source.items():
            for spec in specs:
                if spec.labels[:2] == ("gpu", "uuid"):
                    scope = GPU
                elif spec.labels[:1] == ("gpu_bus_id",):
                    scope = PCIE
                elif spec.labels[:2] == ("device", "port"):
                    scope = NIC
                else:
                    scope = HOST
                name = spec.name.removeprefix(PREFIX)
                self.families[name] = Family(name, spec, source, scope)
        for family in list(self.families.values()):
            whole = (family.spec.instance_of or "").removeprefix(PREFIX)
            if whole in self.families:
                self.families[whole] = replace(self.families[whole], instance_form=family)

    @classmethod
    def builtin(cls) -> Catalog:
        from gpuwatchd.sources import load_builtin_sources

        return cls({name: src.metrics for name, src in load_builtin_sources().items()})

    def suggest(self, name: str) -> str:
        close = difflib.get_close_matches(name, self.families, n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class Selector:
    """Series of one family for the GPU being evaluated, with label matchers."""

    family: Family
    # (index into the spec's labels, the values it may have: one, or a list's)
    matchers: tuple[tuple[int, tuple[str, ...]], ...]
    multi: bool  # may match several series per GPU: must be aggregated
    max_matched: int = 1  # the most series it may match (the cost's worst case)

    def describe(self) -> str:
        if not self.matchers:
            return self.family.name
        labels = self.family.spec.labels
        inner = ", ".join(
            f"{labels[i]}={v[0]!r}" if len(v) == 1 else f"{labels[i]}={list(v)!r}"
            for i, v in self.matchers
        )
        return f"series({self.family.name!r}, {inner})"


# ------------------------------------------------------------------- the functions

NUM, STR, SEL, LIST = "number", "string", "series", "list of numbers"

# name -> argument kinds ("sel": a series reference, "dur": a duration string literal,
# "num": a number expression); the functions' behaviour is in Evaluator
WINDOW_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "avg_over": ("sel", "dur"),
    "min_over": ("sel", "dur"),
    "max_over": ("sel", "dur"),
    "stddev_over": ("sel", "dur"),
    "quantile_over": ("num", "sel", "dur"),
    "rate": ("sel", "dur"),
    "change": ("sel", "dur"),
}
# window functions that sum (or take the extreme of) several series; the others need one
MULTI_WINDOW = {"rate", "change", "min_over", "max_over"}
# what peers() groups GPUs by, in order of preference: the main process's job (ranks of
# one launch, told by their launcher's variables and owner; siblings without them are
# jobs of their own), else the main process itself (gpuwatchd.sources.processes)
PEER_GROUPING = ("gpu_process_job", "gpu_process_pid")
AGGREGATES = ("max", "min", "sum", "avg", "count")

# Bounds on what a rule file may ask of the engine, per GPU and cycle (`rules check`
# enforces them, with the position): a mistaken or hostile file must not exhaust the
# parser's stack, stall evaluation, or make the engine multiply thousand-digit integers.
MAX_EXPRESSION_CHARS = 4096  # the default rules' longest expression: 1111
MAX_DEPTH = 50  # nesting of the syntax tree; the default rules' deepest: 10
MAX_NUMBER = 1e18  # number literals; integers are evaluated as floats
MAX_STRING_CHARS = 256  # durations, series names, label values
# Cost: the steps one evaluation may take. A node is one; a series lookup looks at every
# series of its family (for this GPU; host and NIC families: the node's), as many as
# SERIES_MAXIMA allows; a window function reads its samples, counted at one a second (at
# most the store's 3600 points) for each series it may match; peers() looks up up to 64
# GPUs. The evaluator counts the rows and samples it reads and stops an evaluation past
# RUN_BUDGET_FACTOR times this cost (OverBudget): a node beyond the maxima, or sources
# polling up to 10 times a second (config.MIN_INTERVAL), cost no more than that.
MAX_EXPRESSION_COST = 50_000
MAX_FILE_COST = 300_000  # every rule's expression and summary placeholders together
_WINDOW_POINTS, _MULTI_SERIES, _PEERS = 3600, 16, 64
RUN_BUDGET_FACTOR = 10
# The most values a label takes (for one GPU; for the node in host and NIC families),
# where not _MULTI_SERIES (a small fixed set: reasons, severities, classes...); a family's
# series at most the product over its labels. 1: an attribute of another label's value
# (a process's cudart, a port's firmware). docs/rules.md's Bounds section lists them.
SERIES_MAXIMA: dict[tuple[str, str], int] = {
    (HOST, "cpu"): 1024,  # logical CPUs
    (HOST, "device"): 64,  # block devices
    (HOST, "numa_node"): 64,
    (HOST, "name"): 32,  # desktop process names: a fixed list of 24
    (HOST, "resource"): 3,  # pressure: cpu, io, memory
    (HOST, "kind"): 2,  # some, full
    (HOST, "window"): 3,  # 10s, 60s, 300s
    (GPU, "pid"): 1024,  # processes on one GPU
    (GPU, "name"): 1024,  # a process's name (gpu_process_info)
    (GPU, "cudart"): 1,
    **{(GPU, label): 1 for label in ("mountpoint", "tie")},  # an NFS mount's (device's)
    (GPU, "job_id"): 1024,  # an owner per process at most (gpu_owner_info)
    **{(GPU, label): 1 for label in ("scheduler", "step", "rank", "user")},
    **{(GPU, label): 1 for label in ("namespace", "pod", "container")},
    (GPU, "xid"): 32,  # distinct Xid codes one GPU reports while the daemon runs
    (GPU, "field"): 128,  # DCGM fields watched (a field group holds 127)
    (GPU, "link"): 18,  # NVLinks (H100, B200: 18)
    (GPU, "gpu_instance"): 8,  # MIG: 7 instances at most
    (GPU, "compute_instance"): 8,
    **{(GPU, label): 1 for label in ("profile", "mig_uuid")},
    **{(GPU, label): 1 for label in ("model", "pci_bus_id", "driver_version")},
    (GPU, "cuda_driver_version"): 1,
    (PCIE, "device"): 16,  # PCIe functions on the GPU's path (IB devices: distances)
    (PCIE, "role"): 1,  # a function's
    (PCIE, "severity"): 3,  # AER: correctable, nonfatal, fatal
    (PCIE, "port"): 2,
    # the kernel log's per-GPU families: an event (a fixed list of 9), an Xid code; the
    # line a (GPU, event) last logged, whose code, pid, process and text are its attributes
    (PCIE, "event"): 9,
    (PCIE, "xid"): 32,
    **{(PCIE, label): 1 for label in ("code", "pid", "process", "message")},
    (NIC, "device"): 16,  # IB/RoCE devices on the node
    (NIC, "port"): 2,  # ports per device
    **{(NIC, label): 1 for label in ("link_layer", "hca_type", "fw_ver")},
}


@dataclass
class Compiled:
    """One compiled expression: its bytecode, its selectors, its inputs. The rewritten
    tree is not kept: ~3,000 nodes for the default rules, 0.6 MiB held for nothing."""

    text: str
    # the rewritten tree compiled by Python: it holds only numbers, operators and calls of
    # the evaluator's own functions (the checker let nothing else through), so it runs
    # with no builtins at all
    code: Any = field(repr=False, compare=False)
    selectors: list[Selector]
    sources: frozenset[str]  # sources whose series it needs (present() excluded)
    max_window: float = 0.0
    cost: float = 0.0  # evaluation steps, at most (see MAX_EXPRESSION_COST)
    # time() is read only in comparisons that flip at most once (timing.py), each
    # wrapped in _atom(): how long the outcome stands can be told
    timed: bool = False
    # the families its window functions read (the ones whose history must be kept)
    windows: frozenset[str] = frozenset()

    def bytecode(self) -> Any:
        return self.code


def _windowed(tree: ast.AST, selectors: list[Selector]) -> frozenset[str]:
    """The families the window functions of a rewritten tree read."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            kinds = WINDOW_FUNCTIONS.get(node.func.id.removeprefix("_"))
            if kinds is not None and node.func.id.startswith("_"):
                index = node.args[kinds.index("sel")]
                if isinstance(index, ast.Constant) and isinstance(index.value, int):
                    names.add(selectors[index.value].family.spec.name)
    return frozenset(names)


class _Checker:
    """Walks simpleeval's tree: checks names, labels and types; rewrites references."""

    def __init__(self, catalog: Catalog, field_name: str) -> None:
        self.catalog = catalog
        self.field = field_name
        self.selectors: list[Selector] = []
        self.required_sources: set[str] = set()
        self.max_window = 0.0
        self.problems: list[Problem] = []
        self._optional = 0
        self.cost = 0.0

    # helpers --------------------------------------------------------------------
    def fail(self, node: ast.AST, message: str) -> None:
        line = getattr(node, "lineno", None)
        col = getattr(node, "col_offset", None)
        if line is not None and col is not None:
            col = col - 1 if line == 1 else col  # the "(" the expression was wrapped in
            col += 1  # 1-based
        self.problems.append(Problem(self.field, message, line, col))

    def spend(self, node: ast.AST, steps: float) -> None:
        """Count evaluation steps; the node that takes the cost past the bound is named."""
        before, self.cost = self.cost, self.cost + steps
        if before <= MAX_EXPRESSION_COST < self.cost:
            self.fail(
                node,
                f"costs more than the {MAX_EXPRESSION_COST} steps allowed per GPU and cycle "
                "(a window function reads a sample per second of its window, of each series "
                "it may match; docs/rules.md, Bounds)",
            )

    def _call(self, name: str, *args: ast.expr) -> ast.Call:
        return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])

    def _const(self, value: Any) -> ast.Constant:
        return ast.Constant(value=value)

    def selector(self, node: ast.expr) -> Selector | None:
        """The selector a bare name or a series(...) call denotes, or None (not one)."""
        if isinstance(node, ast.Name):
            family = self.catalog.families.get(node.id)
            if family is None:
                if node.id.startswith(PREFIX) and node.id.removeprefix(PREFIX) in (
                    self.catalog.families
                ):
                    self.fail(
                        node,
                        f"write series names without the {PREFIX} prefix: "
                        f"{node.id.removeprefix(PREFIX)!r}",
                    )
                else:
                    self.fail(node, f"unknown series {node.id!r}{self.catalog.suggest(node.id)}")
                return None
            return self._make(family, (), node)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and (node.func.id == "series")
        ):
            if len(node.args) != 1:
                self.fail(node, "series() takes one series name, then label=value matchers")
                return None
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            elif isinstance(arg, ast.Name):
                name = arg.id
            else:
                self.fail(arg, "series(): the first argument is a series name")
                return None
            family = self.catalog.families.get(name)
            if family is None:
                self.fail(arg, f"unknown series {name!r}{self.catalog.suggest(name)}")
                return None
            matchers: list[tuple[int, tuple[str, ...]]] = []
            for kw in node.keywords:
                if kw.arg is None or kw.arg not in family.own_labels:
                    own = ", ".join(family.own_labels) or "none"
                    self.fail(kw.value, f"{name!r} has no label {kw.arg!r} (its labels: {own})")
                    return None
                values = _label_values(kw.value)
                if values is None:
                    self.fail(
                        kw.value,
                        f"label {kw.arg}: expected a string or a list of up to "
                        f"{_MULTI_SERIES} strings, e.g. {kw.arg}='x' or {kw.arg}=['x', 'y']",
                    )
                    return None
                matchers.append((family.spec.labels.index(kw.arg), values))
            return self._make(family, tuple(matchers), node)
        return None

    def _make(
        self, family: Family, matchers: tuple[tuple[int, tuple[str, ...]], ...], node: ast.AST
    ) -> Selector:
        labels = family.spec.labels
        # a label matched to one value is fixed; one matched to a list still varies
        matched = {labels[i] for i, v in matchers if len(v) == 1}
        free = [label for label in family.own_labels if label not in matched]
        if (
            family.scope == PCIE
            and "role" in matched
            and dict((labels[i], v) for i, v in matchers).get("role") == ("gpu",)
        ):
            free = [label for label in free if label != "device"]  # the GPU's own function
        listed = {labels[i]: len(v) for i, v in matchers if len(v) > 1}
        most = math.prod(
            min(listed[label], family.label_max(label)) if label in listed
            else family.label_max(label)
            for label in free
        )  # fmt: skip
        selector = Selector(family, matchers, multi=bool(free), max_matched=most)
        self.spend(node, family.max_series)  # the lookup looks at every series
        if not self._optional:
            self.required_sources.add(family.source)
        self.selectors.append(selector)
        affinity = self.catalog.families.get(NIC_AFFINITY)
        if family.scope == NIC and affinity is not None:  # indexed for the join, not required
            self.selectors.append(Selector(affinity, (), multi=True))
        return selector

    def _index(self, selector: Selector) -> ast.Constant:
        return self._const(self.selectors.index(selector))

    def duration(self, node: ast.expr) -> float | None:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (str, int, float))
            and (not isinstance(node.value, bool))
        ):
            try:
                seconds = parse_duration(node.value)
            except ValueError:
                pass
            else:
                if seconds > 0:
                    self.max_window = max(self.max_window, seconds)
                    return seconds
        self.fail(node, "expected a duration literal such as '30s', '5m' or '1m30s'")
        return None

    # the walk ---------------------------------------------------------------------
    def expect(self, node: ast.expr, kind: str) -> ast.expr | None:
        """Check `node` as a `kind` value; return the rewritten node (None: a problem)."""
        got, rewritten = self.visit(node)
        if got is None or rewritten is None:
            return None
        if got == kind:
            return rewritten
        if kind == NUM and isinstance(got, Selector):
            if got.multi:
                own = [lbl for lbl in got.family.own_labels]
                self.fail(
                    node,
                    f"{got.describe()} has several series per GPU (labels: {', '.join(own)}): "
                    "pick one with series(name, label='value') or aggregate with "
                    "max(), min(), sum(), avg() or count()",
                )
                return None
            return self._call("_value", self._index(got))
        what = "a series" if isinstance(got, Selector) else f"a {got}"
        self.fail(node, f"expected a {kind} here, got {what}")
        return None

    def visit(self, node: ast.expr) -> tuple[Any, ast.expr | None]:
        """(type, rewritten node): type is NUM, STR, LIST or a Selector."""
        self.spend(node, 1)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool):
                return NUM, node
            if isinstance(node.value, (int, float)):  # in range: checked by _bounds
                return NUM, ast.Constant(value=float(node.value))  # never a bignum
            if isinstance(node.value, str):
                return STR, node
            self.fail(node, f"unsupported literal {node.value!r}")
            return None, None
        if isinstance(node, ast.Name):
            if node.id in ("true", "false"):
                self.fail(node, f"write {node.id.capitalize()} (Python spelling)")
                return None, None
            selector = self.selector(node)
            return (selector, node) if selector is not None else (None, None)
        if isinstance(node, ast.BoolOp):
            values = [self.expect(v, NUM) for v in node.values]
            if any(v is None for v in values):
                return None, None
            return NUM, ast.BoolOp(op=node.op, values=values)  # type: ignore[arg-type]
        if isinstance(node, ast.Compare):
            left = self.expect(node.left, NUM)
            rights = [self.expect(c, NUM) for c in node.comparators]
            for op in node.ops:
                if isinstance(op, (ast.In, ast.NotIn, ast.Is, ast.IsNot)):
                    self.fail(node, "only <, <=, >, >=, == and != compare values")
                    return None, None
            if left is None or any(r is None for r in rights):
                return None, None
            return NUM, ast.Compare(left=left, ops=node.ops, comparators=rights)  # type: ignore[arg-type]
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
                self.fail(node, "only +, -, * and / are arithmetic operators here")
                return None, None
            left, right = self.expect(node.left, NUM), self.expect(node.right, NUM)
            if left is None or right is None:
                return None, None
            if isinstance(node.op, ast.Div):  # x / 0 is not evaluable, not an error
                return NUM, self._call("_div", left, right)
            return NUM, ast.BinOp(left=left, op=node.op, right=right)
        if isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
                self.fail(node, "unsupported operator")
                return None, None
            operand = self.expect(node.operand, NUM)
            return (NUM, ast.UnaryOp(op=node.op, operand=operand)) if operand else (None, None)
        if isinstance(node, ast.IfExp):
            test = self.expect(node.test, NUM)
            # a branch's series are needed only where the test takes it: not required
            # sources (down, the branch taken finds no value: not evaluable all the same)
            self._optional += 1
            parts = [test, *(self.expect(n, NUM) for n in (node.body, node.orelse))]
            self._optional -= 1
            if any(p is None for p in parts):
                return None, None
            return NUM, ast.IfExp(test=parts[0], body=parts[1], orelse=parts[2])  # type: ignore[arg-type]
        if isinstance(node, ast.Call):
            return self.call(node)
        kind = type(node).__name__
        self.fail(node, f"{kind} is not part of the rule language")
        return None, None

    def call(self, node: ast.Call) -> tuple[Any, ast.expr | None]:
        if not isinstance(node.func, ast.Name):
            self.fail(node, "only the rule language's functions can be called")
            return None, None
        name = node.func.id
        if name == "series":
            selector = self.selector(node)
            return (selector, node) if selector else (None, None)
        if node.keywords:
            self.fail(node.keywords[0].value, f"{name}() takes no keyword arguments")
            return None, None
        args = node.args
        if name in WINDOW_FUNCTIONS:
            kinds = WINDOW_FUNCTIONS[name]
            if len(args) != len(kinds):
                self.fail(
                    node,
                    f"{name}() takes {len(kinds)} arguments: "
                    f"{', '.join(kinds).replace('sel', 'series').replace('dur', 'duration')}",
                )
                return None, None
            out: list[ast.expr] = []
            points = 0.0  # samples it reads
            for arg, kind in zip(args, kinds, strict=True):
                if kind == "sel":
                    got, _ = self.visit(arg)
                    if got is None:
                        return None, None
                    if not isinstance(got, Selector):
                        self.fail(arg, f"{name}(): expected a series name or series(...)")
                        return None, None
                    if got.multi and name not in MULTI_WINDOW:
                        self.fail(
                            arg,
                            f"{got.describe()} has several series per GPU: "
                            f"{name}() needs one (select it with series(..., label='x'))",
                        )
                        return None, None
                    out.append(self._index(got))
                elif kind == "dur":
                    seconds = self.duration(arg)
                    if seconds is None:
                        return None, None
                    out.append(self._const(seconds))
                    points = min(seconds, _WINDOW_POINTS) * got.max_matched
                else:
                    value = self.expect(arg, NUM)
                    if value is None:
                        return None, None
                    out.append(value)
            self.spend(node, points)
            return NUM, self._call("_" + name, *out)
        if name in AGGREGATES:
            if len(args) == 1:
                got, rewritten = self.visit(args[0])
                if got is None or rewritten is None:
                    return None, None
                if isinstance(got, Selector):
                    return NUM, self._call(f"_{name}_series", self._index(got))
                if got == LIST:
                    return NUM, self._call(f"_{name}_list", rewritten)
                self.fail(args[0], f"{name}() of one argument aggregates a series or peers(...)")
                return None, None
            if name in ("max", "min") and len(args) >= 2:
                values = [self.expect(a, NUM) for a in args]
                if any(v is None for v in values):
                    return None, None
                return NUM, self._call(f"_{name}_of", *values)  # type: ignore[arg-type]
            self.fail(node, f"{name}() takes a series, peers(...), or (max/min) 2+ numbers")
            return None, None
        if name in ("peers", "lowest_peer", "highest_peer"):
            return self._peer_call(node, name)
        if name == "names":
            return self._names_call(node)
        if name in ("present", "default"):
            want = 1 if name == "present" else 2
            if len(args) != want:
                takes = "a series" if want == 1 else "a series and a number"
                self.fail(node, f"{name}() takes {takes}")
                return None, None
            self._optional += 1
            got, _ = self.visit(args[0])
            self._optional -= 1
            if got is None:
                return None, None
            if not isinstance(got, Selector):
                self.fail(args[0], f"{name}(): expected a series name or series(...)")
                return None, None
            if name == "present":
                return NUM, self._call("_present", self._index(got))
            if got.multi:
                self.fail(args[0], f"default(): {got.describe()} has several series per GPU")
                return None, None
            fallback = self.expect(args[1], NUM)
            if fallback is None:
                return None, None
            return NUM, self._call("_default", self._index(got), fallback)
        if name == "abs":
            if len(args) != 1:
                self.fail(node, "abs() takes one number")
                return None, None
            value = self.expect(args[0], NUM)
            return (NUM, self._call("_abs", value)) if value is not None else (None, None)
        if name == "when":  # a summary's value only where it means something
            if len(args) != 2:
                self.fail(node, "when() takes a condition and a number")
                return None, None
            test, value = self.expect(args[0], NUM), self.expect(args[1], NUM)
            if test is None or value is None:
                return None, None
            return NUM, self._call("_when", test, value)
        if name == "time":
            if args:
                self.fail(node, "time() takes no arguments")
                return None, None
            return NUM, self._call("_time")
        known = sorted(
            [*WINDOW_FUNCTIONS, *AGGREGATES, "series", "peers", "lowest_peer", "highest_peer"]
            + ["present", "default", "abs", "when", "time", "names"]
        )
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}()?)" if close else ""
        self.fail(node.func, f"unknown function {name}(){hint}")
        return None, None


    def _peer_call(self, node: ast.Call, name: str) -> tuple[Any, ast.expr | None]:
        """peers(x), lowest_peer(x), highest_peer(x): x is a series with one value per GPU,
        or any number expression, judged on each peer GPU as if it were this one (the
        same test a rule applies to its own GPU, applied to a peer)."""
        if len(node.args) != 1:
            self.fail(node, f"{name}() takes one series or expression")
            return None, None
        arg, before = node.args[0], self.cost
        got, rewritten = self.visit(arg)
        if got is None or rewritten is None:
            return None, None
        # the series peers() groups GPUs by are inputs too (the engine indexes the
        # families an expression's selectors name), though never required ones
        for grouping in PEER_GROUPING:
            family = self.catalog.families.get(grouping)
            if family is not None:
                self.selectors.append(Selector(family, (), multi=False))
        if isinstance(got, Selector):
            if got.multi:
                self.fail(arg, f"{name}(): expected a series with one value per GPU")
                return None, None
            self.spend(node, _PEERS * got.family.max_series)  # a lookup per peer GPU
            return (LIST if name == "peers" else NUM), self._call(f"_{name}", self._index(got))
        if got != NUM:
            self.fail(arg, f"{name}(): expected a series or a number expression")
            return None, None
        self.spend(node, (_PEERS - 1) * (self.cost - before))  # evaluated on every peer
        judge = ast.Lambda(
            args=ast.arguments(
                posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[],
                kwarg=None, defaults=[],
            ),
            body=rewritten,
        )  # fmt: skip
        return (LIST if name == "peers" else NUM), self._call(f"_{name}_of", judge)


    def _names_call(self, node: ast.Call) -> tuple[Any, ast.expr | None]:
        """names(s, 'template'): the series `s` matches for this GPU that are nonzero, each
        told by `template`, where {label} is one of `s`'s labels and {family} another
        family's value on the series with the same labels ('{role} {device} at
        Gen{pcie_link_generation}'). In a summary: the place the on-call acts on."""
        args = node.args
        template = args[1] if len(args) == 2 else None
        if not (isinstance(template, ast.Constant) and isinstance(template.value, str)):
            self.fail(node, "names() takes a series and a template string, e.g. '{device}'")
            return None, None
        got, _ = self.visit(args[0])
        if got is None:
            return None, None
        if not isinstance(got, Selector):
            self.fail(args[0], "names(): expected a series name or series(...)")
            return None, None
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(template.value) if f is not None]
        except ValueError as e:
            self.fail(template, f"names(): template: {e}")
            return None, None
        others: list[ast.expr] = []
        for name in dict.fromkeys(fields):
            if name in got.family.own_labels:
                continue
            other = self.catalog.families.get(name)
            if other is None or other.spec.labels != got.family.spec.labels:
                own = ", ".join(got.family.own_labels) or "none"
                self.fail(
                    template,
                    f"names(): {{{name}}} is neither a label of {got.family.name!r} ({own}) "
                    "nor a family with the same labels",
                )
                return None, None
            selector = self._make(other, got.matchers, template)
            pair: list[ast.expr] = [self._const(name), self._index(selector)]
            others.append(ast.Tuple(elts=pair, ctx=ast.Load()))
        return NUM, self._call(
            "_names", self._index(got), template, ast.Tuple(elts=others, ctx=ast.Load())
        )

def _label_values(node: ast.expr) -> tuple[str, ...] | None:
    """A matcher's value: 'x', or ['x', 'y', ...] (up to _MULTI_SERIES); None if neither."""
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    values = [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if not values or len(values) != len(items) or len(values) > _MULTI_SERIES:
        return None
    if any(len(v) > MAX_STRING_CHARS for v in values):
        return None
    return tuple(values)


def compile_expression(text: str, catalog: Catalog, field_name: str = "expr") -> Compiled:
    """Parse with simpleeval, check against `catalog`, rewrite; CompileError if wrong."""
    stripped = text.strip()
    if not stripped:
        raise CompileError([Problem(field_name, "empty expression")])
    if len(stripped) > MAX_EXPRESSION_CHARS:
        limit = MAX_EXPRESSION_CHARS  # where the limit falls: its line and column
        where = (stripped.count("\n", 0, limit) + 1, limit - stripped.rfind("\n", 0, limit))
        message = f"{len(stripped)} characters, more than the {limit} allowed"
        raise CompileError([Problem(field_name, message, *where)])
    try:
        # wrapped in parentheses so an expression may span lines (YAML block scalars)
        node = SimpleEval.parse("(" + stripped + "\n)")
    except (RecursionError, MemoryError) as e:  # how CPython's parser says "too deep"
        raise CompileError([Problem(field_name, "nested too deeply to parse", 1, 1)]) from e
    except SyntaxError as e:
        lines = stripped.split("\n")
        line, col = e.lineno, e.offset
        if line is None or line > len(lines):  # ran into the closing ")": the end
            line, col = len(lines), len(lines[-1]) + 1
        elif line == 1 and col is not None:
            col = max(1, col - 1)  # the "(" the expression was wrapped in
        raise CompileError([Problem(field_name, f"syntax error: {e.msg}", line, col)]) from e
    if not isinstance(node, ast.Expr):
        raise CompileError([Problem(field_name, "expected an expression", 1, 1)])
    checker = _Checker(catalog, field_name)
    _bounds(node.value, checker)  # first: the checker recurses, and converts literals
    if checker.problems:
        raise CompileError(checker.problems)
    rewritten = checker.expect(node.value, NUM)
    if checker.problems or rewritten is None:
        raise CompileError(checker.problems or [Problem(field_name, "invalid expression")])
    tree = ast.fix_missing_locations(ast.Expression(body=rewritten)).body
    tree, timed = time_atoms(tree)
    return Compiled(
        stripped,
        compile(ast.Expression(body=tree), "<rule>", "eval"),
        checker.selectors,
        frozenset(checker.required_sources),
        checker.max_window,
        cost=checker.cost,
        timed=timed,
        windows=_windowed(tree, checker.selectors),
    )


def _bounds(tree: ast.expr, checker: _Checker) -> None:
    """Depth and literal bounds, checked without recursion."""
    stack: list[tuple[ast.AST, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            checker.fail(node, f"nested more than {MAX_DEPTH} deep")
            return
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not abs(value) <= MAX_NUMBER:  # NaN and infinities too
                    checker.fail(
                        node, f"expected a number literal of at most {MAX_NUMBER:g} in magnitude"
                    )
            elif isinstance(value, str) and len(value) > MAX_STRING_CHARS:
                checker.fail(
                    node, f"expected a string literal of at most {MAX_STRING_CHARS} characters"
                )
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
