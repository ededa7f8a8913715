"""time() in a rule: telling when evaluating it again could not come out otherwise.

A rule that reads time() ("an Xid in the last 10 minutes": `time() - last_xid < 600`) is
evaluated every cycle though its inputs stay: time moves. Most such rules compare a
number that only grows (or only falls) with time against one that does not change with
it; such a comparison flips at most once. Where every time() of an expression is inside
such a comparison (an *atom*), the atoms it evaluates, in order, decide everything time
changes in it: if they come out the same with time() at `now` and at a later moment,
each one holds throughout (it flips at most once), so the evaluation takes the same
path to the same outcome at every moment between, and the rule need not be evaluated
again until then (`Reads.until`). The compiler wraps each atom in `_atom(k, comparison)`,
which the evaluator records.
"""

from __future__ import annotations

import ast
import copy

ATOM = "_atom"
TIME = "_time"
# how far ahead an idle rule that reads time() is checked: one evaluation more each time
# spares it this many seconds of cycles (less near a flip, where it is evaluated each cycle)
TIME_HORIZON = 60.0

_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_MONOTONE = ("_max_of", "_min_of")  # non-decreasing in every argument


def time_atoms(tree: ast.expr) -> tuple[ast.expr, bool]:
    """`tree` with its atoms wrapped in `_atom(k, ...)`, and True if every time() in it is
    inside one (False: time() reaches the outcome otherwise, and the tree is unchanged)."""
    if not _reads_time(tree):
        return tree, False
    wrapper = _Wrap()
    wrapped = wrapper.visit(copy.deepcopy(tree))  # the transformer rewrites in place
    if any(_is_time(node) for node in ast.walk(wrapped) if node not in wrapper.inside):
        return tree, False
    return ast.fix_missing_locations(wrapped), True


class _Wrap(ast.NodeTransformer):
    def __init__(self) -> None:
        self.atoms = 0
        self.inside: set[ast.AST] = set()  # nodes within an atom

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        if not (_reads_time(node) and _is_atom(node)):
            self.generic_visit(node)
            return node
        self.inside.update(ast.walk(node))
        index = ast.Constant(value=self.atoms)
        self.atoms += 1
        return ast.Call(func=ast.Name(id=ATOM, ctx=ast.Load()), args=[index, node], keywords=[])


def _is_atom(node: ast.Compare) -> bool:
    """One ordering comparison of two numbers whose difference is monotone in time(): one
    grows and the other falls, or does not move. (Two that both grow can cross twice:
    `max(time(), a) <= min(time(), b)` holds only between a and b.)"""
    if len(node.ops) != 1 or not isinstance(node.ops[0], _ORDER):
        return False
    left, right = _trend(node.left), _trend(node.comparators[0])
    return left is not None and right is not None and _same([left, -right]) is not None


def _trend(node: ast.expr) -> int | None:
    """+1 if the number never falls as time() grows, -1 if it never rises, 0 if time()
    does not reach it; None if it may do either (or cannot be told here)."""
    if not _reads_time(node):
        return 0
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if name == TIME:
            return 1
        if name in _MONOTONE:
            return _same([_trend(arg) for arg in node.args])
        if name == "_default":  # the series' value (time() does not reach it) or the fallback
            return _trend(node.args[1])
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        right = _trend(node.right)
        if right is not None and isinstance(node.op, ast.Sub):
            right = -right
        return _same([_trend(node.left), right])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        trend = _trend(node.operand)
        return trend if trend is None or isinstance(node.op, ast.UAdd) else -trend
    return None  # products, quotients, abs(), conditionals, comparisons...


def _same(trends: list[int | None]) -> int | None:
    """The trend of a sum or a monotone function of numbers with these trends."""
    moving = {t for t in trends if t != 0}
    if None in moving or len(moving) > 1:
        return None
    return moving.pop() if moving else 0


def _reads_time(node: ast.AST) -> bool:
    return any(_is_time(n) for n in ast.walk(node))


def _is_time(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == TIME
