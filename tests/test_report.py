"""gpuwatchd/report.py without a server: Prometheus unreachable, times and literals. The
accounting, verdict, formats and MIG on a real Prometheus holding a known timeline:
tests/test_report_accounting.py; beside real daemons: tests/test_report_e2e.py."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpuwatchd.cli import main
from gpuwatchd.report import ReportError, first_sentence, parse_time
from gpuwatchd.report_prometheus import regex_of, string


def test_the_command_reports_an_unreachable_prometheus():
    result = CliRunner().invoke(main, ["report", "42", "--prometheus", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot query Prometheus at http://127.0.0.1:9" in result.output


def test_times_and_literals():
    assert parse_time("1700000000", 0) == 1700000000
    assert parse_time("6h", 0, now=100000) == 100000 - 6 * 3600
    assert parse_time("2026-01-02T03:04:05Z", 0) == parse_time("2026-01-02 03:04:05", 0)
    assert parse_time(None, 7) == 7
    with pytest.raises(ReportError, match="ISO 8601"):
        parse_time("yesterday", 0)
    assert string('a"b\\c') == '"a\\"b\\\\c"'
    assert regex_of(["n1.x:9766", "n2"]) == '"n1\\\\.x:9766|n2"'
    assert first_sentence("Raise num_workers; then pin memory.") == "Raise num_workers"
    assert first_sentence("Check cooling. Then more.") == "Check cooling"
