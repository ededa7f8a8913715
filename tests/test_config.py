from pathlib import Path

import pytest

from gpuwatchd.config import Config, ConfigError, load_config, parse_duration
from gpuwatchd.sources import BUILTIN


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuwatchd.yaml"
    path.write_text(text)
    return path


def test_no_file_gives_all_defaults():
    config = load_config(None)
    assert config == Config()
    assert config.listen_address() == ("0.0.0.0", 9766)
    assert set(config.sources.enabled()) == set(BUILTIN)


def test_file_values_and_durations(tmp_path):
    config = load_config(
        write(
            tmp_path,
            """
listen: "[::1]:9100"
history: 5m
sources:
  nvml: {interval: 500ms, timeout: 1s}
  pcie: {enabled: false}
""",
        )
    )
    assert config.listen_address() == ("::1", 9100)
    assert config.history == 300
    assert config.sources.nvml.interval == 0.5
    assert set(config.sources.enabled()) == set(BUILTIN) - {"pcie"}


def test_errors_name_file_key_path_and_expectation(tmp_path):
    path = write(
        tmp_path,
        """
listen: nonsense
sources:
  nvml:
    interval: soon
    colour: blue
""",
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    lines = str(e.value).splitlines()
    assert (
        f"{path}: listen: expected HOST:PORT, e.g. 0.0.0.0:9766 or [::1]:9766, got 'nonsense'"
        in lines
    )
    assert any(
        line.startswith(f"{path}: sources.nvml.interval: expected a duration") and "'soon'" in line
        for line in lines
    )
    assert f"{path}: sources.nvml.colour: unknown key" in lines


def test_unknown_top_level_key_and_unknown_source(tmp_path):
    with pytest.raises(ConfigError, match=r"sources\.dcgmm: unknown key"):
        load_config(write(tmp_path, "sources:\n  dcgmm: {}\n"))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("- a\n- b\n", "expected a mapping at the top level"),
        ("listen: [\n", "not valid YAML"),
        ("history: -5s\n", "history: expected a duration"),
        ("history: 0\n", "history: Input should be greater than 0"),
    ],
)
def test_malformed_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, text))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_overrides_win_over_file(tmp_path):
    config = load_config(write(tmp_path, "listen: 0.0.0.0:1\n"), listen="127.0.0.1:2")
    assert config.listen == "127.0.0.1:2"


@pytest.mark.parametrize(
    "value, seconds", [(3, 3.0), (0.5, 0.5), ("250ms", 0.25), ("1m30s", 90.0), ("2h", 7200.0)]
)
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "5", "5 s", "1d", True, None, "m"])
def test_parse_duration_rejects(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_source_options_are_validated_with_their_key_path(tmp_path):
    path = write(
        tmp_path,
        "sources:\n  disks: {exclude: '(loop'}\n  infiniband: {expected_rates: {mlx5_0/1: -1}}\n",
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert f"{path}: sources.disks.exclude: expected a regular expression" in message
    assert (
        f"{path}: sources.infiniband.expected_rates.mlx5_0/1: Input should be greater than 0"
        in message
    )
