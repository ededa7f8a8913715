"""Suite-wide setup: the scenario corpus starts playing as soon as it is collected.

test_detection.py and test_scenario_corpus.py read the replays of every built-in scenario
(`gpuwatchd.sim.detection`), played in worker processes, one per CPU: started at
collection, they play while the rest of the suite mostly waits on real servers and
processes (at the lowest priority, so as not to hold those up), and those tests, run
last, take the results. So do the real-time tests marked `ahead` (tests/ahead.py: in a
child pytest) and the hardware script's dry run (tests/hardware_dry_run.py): started at
collection, their tests run at the end.
"""

from __future__ import annotations

import importlib.util

import ahead
import hardware_dry_run
import pytest

from gpuwatchd.sim.detection import EVERYTHING, play_pairs_ahead
from gpuwatchd.sim.detection import corpus as corpus_pairs

CORPUS_FILES = {"test_detection.py", "test_scenario_corpus.py"}


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect have taken their tests out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return  # nothing runs: nothing to start ahead
    hardware = any(item.path.name == "test_hardware_script.py" for item in items)
    if hardware and importlib.util.find_spec("torch"):  # else its tests skip
        hardware_dry_run.start()  # ~30 s of real time, beside the tests before its own
    # real-time tests (tests/ahead.py): started now in a child pytest; their stand-ins
    # here run last and take its verdicts
    ahead.run_ahead(config, items)
    corpus = [item for item in items if item.path.name in CORPUS_FILES]
    if corpus:
        # the CPU the real-time tests leave; both privileges (test_scenario_corpus.py);
        # only the pairs of the scenario tests selected, unless a test of the whole
        # corpus (the detection table) is
        pairs = corpus_pairs(EVERYTHING)
        if all("name" in getattr(item, "callspec", _NONE).params for item in corpus):
            pairs = [(i.callspec.params["name"], i.callspec.params["privileges"]) for i in corpus]
        play_pairs_ahead(pairs, nice=19)
        items[:] = [item for item in items if item.path.name not in CORPUS_FILES] + corpus


class _NONE:
    params: dict[str, object] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    ahead.record(report)  # in the child pytest of tests/ahead.py


def pytest_sessionfinish() -> None:
    hardware_dry_run.clean()
    ahead.clean()
