"""Docs that are generated from the code must stay equal to it."""

from pathlib import Path

from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.sim.scenario import builtin_scenarios

ROOT = Path(__file__).resolve().parent.parent


def test_metrics_md_is_current():
    result = CliRunner().invoke(main, ["metrics"])
    assert result.exit_code == 0
    assert (ROOT / "docs" / "metrics.md").read_text() == result.output, (
        "docs/metrics.md is stale: run `gpuwatchd metrics > docs/metrics.md`"
    )


def test_readme_names_every_builtin_scenario_and_command():
    readme = (ROOT / "README.md").read_text()
    for name in builtin_scenarios():
        assert f"`{name}`" in readme, name
    for command in main.commands:
        assert f"gpuwatchd {command}" in readme, command
