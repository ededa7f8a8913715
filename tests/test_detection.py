"""docs/detection.md is generated from the corpus and must stay equal to it.

The replays are cached per scenario (`gpuwatchd.sim.detection.replay`), shared with
tests/test_scenario_corpus.py, so the corpus is played once per test session.
"""

from pathlib import Path

from gpuwatchd.sim.detection import detection_table, replay

ROOT = Path(__file__).resolve().parent.parent


def test_detection_md_is_current():
    assert (ROOT / "docs" / "detection.md").read_text() == detection_table(), (
        "docs/detection.md is stale: run `gpuwatchd rules detection > docs/detection.md`"
    )


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
