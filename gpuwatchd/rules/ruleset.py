"""Rule files: YAML, validated with pydantic, every expression compiled at load.

Every problem names the file, the rule and the field, with the line and column inside
an expression, e.g. `rules.yaml: rule 'nccl_stall': expr: line 1, column 5: unknown
series 'gpu_sm_activ_ratio' (did you mean 'gpu_sm_active_ratio'?)`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from gpuwatchd.config import FileError, brief, parse_duration, read_text_file
from gpuwatchd.rules.language import (
    MAX_FILE_COST,
    Catalog,
    Compiled,
    CompileError,
    compile_expression,
)

DEFAULT_RULES = "default.yaml"  # in the gpuwatchd.rules package
MAX_RULES = 1000  # the default file has 28
MAX_TEXT_CHARS = 4096  # a summary or remedy (they become label values of starvation_info)

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.S)
_CLAUSE = re.compile(r"\[\[(.*?)\]\]", re.S)

Dimension = Literal["pcie", "input", "compute", "communication", "driver", "system"]
Severity = Literal["info", "warning", "critical"]
Duration0 = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


class RulesError(Exception):
    """A rule file that cannot be used; `problems` has one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class RuleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: Annotated[str, Field(pattern=_NAME.pattern, max_length=64)]
    dimension: Dimension
    severity: Severity
    expr: str
    for_: Duration0 = Field(0.0, alias="for")
    keep_firing_for: Duration0 = 0.0
    summary: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
    remedy: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
    # on a MIG GPU, what the rule judges: each GPU instance (the default for a rule that
    # reads a family GPU instances have their own series of: a workload's physics), or
    # the whole GPU (the default otherwise: its link, clocks, memory, driver)
    mig: Literal["gpu", "instance"] | None = None


class RuleFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_RULES)


@dataclass(frozen=True)
class Clause:
    """A run of a summary: literal text, each followed by an evidence value (or None).
    An optional clause (`[[ ... ]]` in the file) is left out where one of its values has
    none; a missing value elsewhere reads "unknown"."""

    parts: list[tuple[str, Compiled | None]]
    optional: bool

    def values(self) -> list[Compiled]:
        return [c for _, c in self.parts if c is not None]


@dataclass(frozen=True)
class Rule:
    spec: RuleSpec
    expr: Compiled
    summary: list[Clause]

    def summary_values(self) -> list[Compiled]:
        return [c for clause in self.summary for c in clause.values()]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def per_instance(self) -> bool:
        """Judged on each GPU instance of a MIG GPU (RuleSpec.mig)."""
        if self.spec.mig is not None:
            return self.spec.mig == "instance"
        compiled = (self.expr, *self.summary_values())
        return any(s.family.per_instance for c in compiled for s in c.selectors)

    @property
    def remedy(self) -> str:
        """The remedy on one line, as alerts, pages and doctor show it."""
        return " ".join(self.spec.remedy.split())

    @property
    def cost(self) -> float:
        """Evaluation steps per GPU, at most: the expression and the summary's values."""
        return self.expr.cost + sum(c.cost for c in self.summary_values())


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]
    origin: str  # the file, or "built-in default rules"

    @property
    def max_window(self) -> float:
        return max((r.expr.max_window for r in self.rules), default=0.0)

    @property
    def cost(self) -> float:
        """Evaluation steps per GPU and cycle, at most (see language.MAX_FILE_COST)."""
        return sum(r.cost for r in self.rules)


def _summary(text: str, catalog: Catalog) -> list[Clause]:
    """Split a summary into its clauses: the text between `[[ optional ]]` ones, and
    those; CompileError with every placeholder's problems."""
    clauses, problems, position = [], [], 0
    for match in [*_CLAUSE.finditer(text), None]:
        end = match.start() if match else len(text)
        runs = [(text[position:end], False)] + ([(match.group(1), True)] if match else [])
        for run, optional in runs:
            try:
                clauses.append(Clause(_parts(run, catalog), optional))
            except CompileError as e:
                problems += e.problems
        position = match.end() if match else end
    if problems:
        raise CompileError(problems)
    return clauses


def _parts(text: str, catalog: Catalog) -> list[tuple[str, Compiled | None]]:
    """Split text into literal text and compiled {{ expression }} placeholders."""
    parts: list[tuple[str, Compiled | None]] = []
    position = 0
    problems = []
    for match in _PLACEHOLDER.finditer(text):
        try:
            compiled = compile_expression(match.group(1), catalog, "summary")
        except CompileError as e:
            inner = " ".join(match.group(1).split())
            problems += [
                replace(p, message=f"in {{{{ {inner} }}}}: {p.message}") for p in e.problems
            ]
            continue
        parts.append((text[position : match.start()], compiled))
        position = match.end()
    if problems:
        raise CompileError(problems)
    parts.append((text[position:], None))
    return parts


def _describe(err: Any) -> tuple[str, str]:
    loc = [str(p) for p in err["loc"]]
    field = "for" if loc == ["for_"] else ".".join(loc) or "(rule)"
    if err["type"] == "extra_forbidden":
        return field, "unknown key"
    if err["type"] == "missing":
        return field, "required"
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "string_pattern_mismatch":
        message = "expected lower_snake_case (a-z, 0-9, _)"
    return field, f"{message}, got {brief(err.get('input'))}"


@functools.lru_cache(maxsize=4)
def _parsed_yaml(text: str) -> Any:
    """A rule file's YAML, parsed once per text: every pipeline (each replayed scenario,
    each reload of an unchanged file) loads the same rules. Only read, never changed."""
    return yaml.safe_load(text)


def parse_rules(text: str, where: str, catalog: Catalog | None = None) -> RuleSet:
    """Validate and compile a rule file's text; RulesError lists every problem."""
    catalog = catalog or Catalog.builtin()
    try:
        data = _parsed_yaml(text)
    except yaml.YAMLError as e:
        raise RulesError([f"{where}: not valid YAML: {' '.join(str(e).split())}"]) from e
    except RecursionError as e:
        raise RulesError([f"{where}: not valid YAML: nested too deeply"]) from e
    try:
        document = RuleFile.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field, message = _describe(err)
            lines.append(f"{where}: {field}: {message}")
        raise RulesError(lines) from e
    problems: list[str] = []
    rules: list[Rule] = []
    seen: set[str] = set()
    for index, raw in enumerate(document.rules):
        label = (
            f"rule {raw.get('name')!r}" if isinstance(raw.get("name"), str) else (f"rules[{index}]")
        )
        try:
            spec = RuleSpec.model_validate(raw)
        except ValidationError as e:
            for err in e.errors():
                field, message = _describe(err)
                problems.append(f"{where}: {label}: {field}: {message}")
            expr = raw.get("expr")
            if isinstance(expr, str):  # report its problems too, in the same pass
                try:
                    compile_expression(expr, catalog, "expr")
                except CompileError as ce:
                    problems += [f"{where}: {label}: {p}" for p in ce.problems]
            continue
        if spec.name in seen:
            problems.append(f"{where}: {label}: name: a rule of this name is already defined")
            continue
        seen.add(spec.name)
        compiled: Compiled | None = None
        try:
            compiled = compile_expression(spec.expr, catalog, "expr")
        except CompileError as e:
            problems += [f"{where}: {label}: {p}" for p in e.problems]
        try:
            summary = _summary(spec.summary, catalog)
        except CompileError as e:
            problems += [f"{where}: {label}: {p}" for p in e.problems]
            continue
        if compiled is not None:
            rules.append(Rule(spec, compiled, summary))
    ruleset = RuleSet(tuple(rules), where)
    if not problems and ruleset.cost > MAX_FILE_COST:
        problems.append(
            f"{where}: the rules cost {ruleset.cost:.0f} steps per GPU and cycle, more than "
            f"the {MAX_FILE_COST} allowed: fewer rules, or shorter windows"
        )
    if problems:
        raise RulesError(problems)
    return ruleset


def load_rules(path: Path | None, catalog: Catalog | None = None) -> RuleSet:
    """The rules in `path`, or the built-in default rules when `path` is None."""
    if path is None:
        text = (resources.files("gpuwatchd.rules") / DEFAULT_RULES).read_text()
        return parse_rules(text, "built-in default rules", catalog)
    try:
        text = read_text_file(Path(path))
    except FileError as e:
        raise RulesError([f"{path}: {e}"]) from e
    return parse_rules(text, str(path), catalog)
