"""Scenario files: the built-in scenarios (package data) and `load_scenario`, which
reads one by name or path and validates it, as one-line `ConfigError`s."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from gpuwatchd.config import ConfigError
from gpuwatchd.sim.scenario.schema import Scenario

SCENARIO_PACKAGE = "gpuwatchd.sim.scenarios"


def builtin_scenarios() -> list[str]:
    files = resources.files(SCENARIO_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or a scenario file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        where = str(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read scenario: {e.strerror}") from e
    else:
        resource = resources.files(SCENARIO_PACKAGE) / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise ConfigError(
                f"unknown scenario {str(name_or_path)!r}: not a file, and not one of the "
                f"built-in scenarios ({', '.join(builtin_scenarios())})"
            )
        where, text = f"built-in scenario {name_or_path}", resource.read_text()
    try:
        data = yaml.safe_load(text)
        return Scenario.model_validate(data)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    except ValidationError as e:
        raise ConfigError("\n".join(_problem(where, err) for err in e.errors())) from e


def _problem(where: str, error: ErrorDetails) -> str:
    """`where: field.path: message`; no path for the scenario as a whole."""
    path = ".".join(str(p) for p in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {path}: {message}" if path else f"{where}: {message}"
