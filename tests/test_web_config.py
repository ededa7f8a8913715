"""The web config file: exporter-toolkit's own test files, and errors that say where and what."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatchd.webconfig import WebConfigError, load_web_config, ssl_context

TOOLKIT = Path(__file__).parent / "fixtures" / "web_config"  # its web/testdata, unchanged
REFUSED_BY_DESIGN = {  # Python's ssl cannot require a client certificate without verifying it
    "tls_config_noAuth.requireanyclientcert.good.yml",
    "tls_config_noAuth.requireanyclientcertkeyinline.good.yml",
}
BAD_ONLY_AT_RUNTIME = {  # the toolkit loads these; its tests fail them on a handshake
    "web_config_auth_clientCAs_missing.bad.yml",  # a client whose certificate is not trusted
    "web_config_auth_client_san.bad.yaml",  # a client whose SANs are not allowed
    "web_config_noAuth_noHTTP2Cipher.bad.yml",  # an HTTP/2 client without its cipher
}


def load(path: Path):
    config = load_web_config(path)
    if config.tls:
        ssl_context(config.tls, path)
    return config


@pytest.mark.parametrize(
    "name",
    sorted(
        p.name
        for p in TOOLKIT.glob("*.y*ml")
        if ".good." in p.name
        or p.name in BAD_ONLY_AT_RUNTIME | {"web_config_empty.yml"}
        or "rate_limiter" in p.name
    ),
)
def test_every_file_the_toolkit_accepts_loads(name):
    if name in REFUSED_BY_DESIGN:
        with pytest.raises(WebConfigError, match="RequireAnyClientCert is not supported"):
            load(TOOLKIT / name)
    else:
        load(TOOLKIT / name)


@pytest.mark.parametrize(
    "name",
    sorted(
        p.name
        for p in TOOLKIT.glob("*.y*ml")
        if (".bad." in p.name and p.name not in BAD_ONLY_AT_RUNTIME) or "junk" in p.name
    ),
)
def test_every_file_the_toolkit_refuses_at_load_is_refused_naming_the_file(name):
    with pytest.raises(WebConfigError) as refused:
        load(TOOLKIT / name)
    assert str(refused.value).startswith(str(TOOLKIT / name) + ": ")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "tls_server_config: {cert_file: server.crt, key_file: server.key, min_version: TLS14}",
            "min_version: expected one of TLS10, TLS11, TLS12, TLS13, got 'TLS14'",
        ),
        (
            "tls_server_config: {cert_file: server.crt}",
            "tls_server_config: expected one of key or key_file",
        ),
        ("basic_auth_users: {alice: hunter2}", "basic_auth_users.alice: expected a bcrypt hash"),
        (  # no password matches a cost bcrypt does not run: the user could never log in
            "basic_auth_users: {alice: $2y$03$" + "a" * 53 + "}",
            "basic_auth_users.alice: expected a bcrypt cost of 4 to 31, got cost 03",
        ),
        (
            "http_server_config: {headers: {X-Powered-By: me}}",
            "header 'X-Powered-By' cannot be configured",
        ),
        (
            'http_server_config: {headers: {Content-Security-Policy: "a\\r\\nSet-Cookie: x"}}',
            "Content-Security-Policy: expected printable ASCII on one line",
        ),
        ("rate_limit: {interval: soon}", "rate_limit.interval: expected a duration"),
        ("tls_server_config: {cert_filse: x}", "tls_server_config.cert_filse: unknown key"),
        ("- a list", "expected a mapping at the top level"),
        (
            "tls_server_config: {cert_file: server.crt, key_file: server.key, client_ca: x}",
            "a client CA is set but client_auth_type is NoClientCert",
        ),
        (
            "tls_server_config: {cert_file: missing.crt, key_file: server.key}",
            "tls_server_config.cert_file/key_file: expected a readable PEM",
        ),
    ],
)
def test_errors_name_the_file_the_key_and_what_was_expected(tmp_path, text, message):
    for name in ("server.crt", "server.key"):
        (tmp_path / name).write_bytes((TOOLKIT / name).read_bytes())
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(WebConfigError) as refused:
        load(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)


def test_paths_are_relative_to_the_file_and_private_keys_are_never_echoed(tmp_path):
    config = load_web_config(TOOLKIT / "web_config_noAuth.good.yml")
    assert config.tls and config.tls.cert_file == TOOLKIT / "server.crt"
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config: {cert: 'x', key: 'SECRET-KEY-TEXT'}\n")
    with pytest.raises(WebConfigError) as refused:
        load(path)
    assert "SECRET-KEY-TEXT" not in str(refused.value)


def test_a_fifo_as_the_web_config_is_refused_at_once(tmp_path):
    """Issue 23, item 8: reading a FIFO blocked the start until someone wrote to it."""
    fifo = tmp_path / "web.yml"
    os.mkfifo(fifo)
    refused = refusal_of(lambda: load_web_config(fifo), fifo)
    assert str(refused) == f"{fifo}: cannot read: not a regular file"


def refusal_of(load: Callable[[], object], fifo: Path) -> WebConfigError:
    """What `load` raised, on a thread: the fixed code returns at once; the old one
    blocked on `fifo` until someone opened it for writing (done here if it does)."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            load()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    loader = threading.Thread(target=run, daemon=True)
    loader.start()
    loader.join(30)
    if loader.is_alive():  # unblock the old code's reader so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert len(outcome) == 1 and isinstance(outcome[0], WebConfigError), outcome
    return outcome[0]


def test_deeply_nested_yaml_as_the_web_config_is_a_clean_error(tmp_path):
    deep = tmp_path / "web.yml"
    deep.write_text("[" * 50_000)
    with pytest.raises(WebConfigError, match="nested too deeply"):
        load_web_config(deep)


def test_a_fifo_as_a_tls_file_is_refused_at_once(tmp_path):
    """ssl reading a FIFO would block the start until someone wrote to it, as the web
    config file itself did (issue 23, item 8)."""
    (tmp_path / "server.crt").write_bytes((TOOLKIT / "server.crt").read_bytes())
    os.mkfifo(tmp_path / "server.key")
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config: {cert_file: server.crt, key_file: server.key}\n")
    refused = refusal_of(lambda: load(path), tmp_path / "server.key")
    assert str(refused) == (
        f"{path}: tls_server_config.key_file: {tmp_path / 'server.key'}: cannot read: "
        "not a regular file"
    )
