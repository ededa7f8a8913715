"""Import circles: modules that import each other (under TYPE_CHECKING too) make each one
only understandable with the other, and break at import time when a name moves.

Issue 42 item 8 untangled the MIG work's two: the DCGM session and its MIG part share
`sources/dcgm/model.py`; the probe source and where its reports land share
`sources/probe_report.py`. Other circles (the simulator's fake NVML modules, a package's
`__init__` and its submodules) are not judged here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import gpuwatchd

PACKAGE = Path(gpuwatchd.__file__).parent
JUDGED_PROBE = "gpuwatchd.sources.probe"  # probe.py, probe_gpus.py, probe_report.py


def modules() -> dict[str, Path]:
    """gpuwatchd's modules by dotted name (the fake DCGM bindings are not a package)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "fake_dcgm" in parts:
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gpuwatchd modules `name` imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known or base in known:
                    out.add(full if full in known else base)
    out.discard(name)
    return out


@cache
def import_graph() -> dict[str, set[str]]:
    """Each of gpuwatchd's modules -> the gpuwatchd modules it imports (read once)."""
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in order:
            visit(v)
    return found


def test_the_dcgm_source_and_the_probe_import_in_one_direction():
    graph = import_graph()
    known = graph.keys()
    judged = {
        n for n in known if n.startswith(("gpuwatchd.sources.dcgm", "gpuwatchd.sources.probe"))
    }
    assert "gpuwatchd.sources.dcgm.mig" in judged and "gpuwatchd.sources.probe_gpus" in judged
    assert [sorted(c) for c in circles(graph) if c & judged] == []


def reachable(graph: dict[str, set[str]], start: set[str]) -> dict[str, str]:
    """Every module `start` imports, directly or not: module -> a module that imports it."""
    seen: dict[str, str] = {}
    todo = sorted(start)
    while todo:
        name = todo.pop()
        for imported in graph[name] - seen.keys() - start:
            seen[imported] = name
            todo.append(imported)
    return seen


def test_the_rules_engine_imports_no_simulator():
    """The engine runs on every node; the simulator and the scenario checking judge it
    from outside (issue 39 item 6: `sim/check.py` and `sim/detection.py`, once under
    `rules/`), so nothing the rules package imports, directly or not, is simulator code."""
    graph = import_graph()
    known = graph.keys()
    rules = {n for n in known if n == "gpuwatchd.rules" or n.startswith("gpuwatchd.rules.")}
    assert "gpuwatchd.rules.engine" in rules and "gpuwatchd.sim.check" in known
    simulator = ("gpuwatchd.sim.", "gpuwatchd.simulate")
    found = {
        f"{importer} imports {name}"
        for name, importer in reachable(graph, rules).items()
        if name == "gpuwatchd.sim" or name.startswith(simulator)
    }
    assert sorted(found) == []


# What the daemon's run path must not load (issue 46: its resident memory): basic auth's
# bcrypt only where a web config asks for it, no prometheus_client (its exposition module
# brings http.server, wsgiref and urllib.request), the kubelet's gRPC only where the
# processes source asks a pod resources socket, DCGM's bindings only once DCGM is found,
# no aiohttp (its web server imports its whole client: 16 MiB; the web front is h11's),
# and no simulator.
NOT_ON_THE_RUN_PATH = ("bcrypt", "prometheus_client", "grpc", "dcgm_agent", "pydcgm", "aiohttp")
RUN_PATH = (
    "import sys, gpuwatchd.cli, gpuwatchd.daemon, gpuwatchd.web;"
    "from gpuwatchd.sources import load_builtin_sources; load_builtin_sources();"
    "print(' '.join(sys.modules))"
)


def test_the_run_path_leaves_what_a_plain_node_never_uses_unloaded():
    out = subprocess.run(
        [sys.executable, "-c", RUN_PATH], capture_output=True, text=True, check=True
    )
    loaded = set(out.stdout.split())
    assert "gpuwatchd.daemon" in loaded and "gpuwatchd.sources.dcgm.source" in loaded
    unwanted = {m for m in loaded if m.split(".")[0] in NOT_ON_THE_RUN_PATH}
    assert sorted(unwanted) == []
    assert sorted(m for m in loaded if m.startswith("gpuwatchd.sim")) == []
