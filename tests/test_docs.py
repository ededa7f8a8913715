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


def test_readme_shows_the_status_page_and_every_option_of_run():
    """Command 1 names the status page beside /metrics; the command table's `gpuwatchd run`
    row names each of its options (--at was missing; --log-level, every command's, is not
    listed)."""
    readme = (ROOT / "README.md").read_text()
    command_1 = readme.split("# 1. ")[1].split("\n# 2. ")[0]
    assert "status page at http://127.0.0.1:9766/," in command_1
    (row,) = [line for line in readme.splitlines() if line.startswith("| `gpuwatchd run ")]
    options = [
        max(p.opts, key=len) for p in main.commands["run"].params if p.opts[0] != "--log-level"
    ]
    assert [o for o in options if o not in row] == []
