"""docs/detection.md is generated from the corpus and must stay equal to it.

The replays are cached per scenario (`gpuwatchd.sim.detection.replay`), shared with
tests/test_scenario_corpus.py, so the corpus is played once per test session.
"""

import logging
from pathlib import Path

from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.sim.detection import detection_table, replay
from gpuwatchd.sim.scenario import builtin_scenarios

ROOT = Path(__file__).resolve().parent.parent


def test_detection_md_is_current_and_the_command_says_how_far_it_is():
    result = CliRunner().invoke(main, ["rules", "detection"])
    logging.disable(logging.NOTSET)  # the command quietens logging, for this process too
    assert result.exit_code == 0, result.output
    assert (ROOT / "docs" / "detection.md").read_text() == result.stdout, (
        "docs/detection.md is stale: run `gpuwatchd rules detection > docs/detection.md`"
    )
    # minutes of play are not silent: stderr (not a terminal here) has a line a scenario
    n = len(builtin_scenarios())
    progress = [line for line in result.stderr.splitlines() if line.startswith("rules detection")]
    assert progress[0] == f"rules detection: playing {n} scenarios, one process per CPU"
    assert len(progress) == n + 1 and progress[-1].startswith(f"rules detection: {n}/{n} ")


def test_detection_table_has_no_false_firings():
    table = detection_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-2:] == ["none", "none"], row
        assert "did not fire" not in cells[2], row
        assert "still firing" not in cells[3] and "did not fire" not in cells[3], row


def test_replay_is_cached():
    assert replay("idle-8gpu") is replay("idle-8gpu")
