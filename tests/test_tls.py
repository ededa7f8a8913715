"""TLS and basic auth from an exporter-toolkit web config, with real TLS clients and Prometheus.

Certificates are made here (trustme); nothing is fetched or trusted from outside.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import logging
import os
import pwd
import socket
import ssl
import time
import urllib.parse
from pathlib import Path

import pytest
import trustme
from daemon_process import running_daemon
from servers import running_prometheus, wait_until
from webfront import HASH, PASSWORD, closed_by_peer, serving

from gpuwatchd.web import Limits
from gpuwatchd.webconfig import WebConfigError

PAST = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def pem(where: Path, name: str, blob: trustme.Blob) -> str:
    blob.write_to_path(str(where / name))
    return str(where / name)


def server_files(where: Path, ca: trustme.CA, **cert_options) -> dict[str, str]:
    cert = ca.issue_cert("127.0.0.1", "localhost", **cert_options)
    return {
        "cert_file": pem(where, "server.pem", cert.cert_chain_pems[0]),
        "key_file": pem(where, "server.key", cert.private_key_pem),
    }


def client(ca: trustme.CA, identity: trustme.LeafCert | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if identity is not None:
        identity.configure_cert(context)
    return context


def get(server, context, path="/metrics", headers=None) -> int:
    connection = http.client.HTTPSConnection(*server.address, context=context, timeout=5)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture(autouse=True)
def no_tracebacks(caplog):
    yield
    assert not [r for r in caplog.records if r.exc_info], "a client's failure logged a traceback"


def test_a_trusted_certificate_serves_and_others_are_refused(tmp_path, ca):
    config = {"tls_server_config": server_files(tmp_path, ca)}
    with serving(config, where=tmp_path) as (server, _):
        assert server.scheme == "https"
        assert get(server, client(ca)) == 200
        with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
            get(server, client(trustme.CA()))  # a client trusting another CA
        with pytest.raises(http.client.RemoteDisconnected):  # plain HTTP on the TLS port
            connection = http.client.HTTPConnection(*server.address, timeout=5)
            connection.request("GET", "/metrics")
            connection.getresponse()
        assert get(server, client(ca)) == 200


def test_an_expired_server_certificate_is_refused_by_the_client(tmp_path, ca):
    config = {"tls_server_config": server_files(tmp_path, ca, not_after=PAST)}
    with (
        serving(config, where=tmp_path) as (server, _),
        pytest.raises(ssl.SSLCertVerificationError, match="expired"),
    ):
        get(server, client(ca))


def test_client_certificates_required_and_verified(tmp_path, ca):
    clients = trustme.CA()  # the CA that issues the scrapers' certificates
    tls = {
        **server_files(tmp_path, ca),
        "client_auth_type": "RequireAndVerifyClientCert",
        "client_ca_file": pem(tmp_path, "clients.pem", clients.cert_pem),
    }
    with serving({"tls_server_config": tls}, where=tmp_path) as (server, _):
        assert get(server, client(ca, clients.issue_cert("prometheus.example"))) == 200
        refused = (ssl.SSLError, ConnectionError)
        with pytest.raises(refused):
            get(server, client(ca))  # no certificate
        with pytest.raises(refused):
            get(server, client(ca, trustme.CA().issue_cert("prometheus.example")))  # other CA
        with pytest.raises(refused):
            expired = clients.issue_cert("prometheus.example", not_after=PAST)
            get(server, client(ca, expired))
        assert get(server, client(ca, clients.issue_cert("prometheus.example"))) == 200


def test_client_allowed_sans(tmp_path, ca):
    clients = trustme.CA()
    tls = {
        **server_files(tmp_path, ca),
        "client_auth_type": "RequireAndVerifyClientCert",
        "client_ca_file": pem(tmp_path, "clients.pem", clients.cert_pem),
        "client_allowed_sans": ["prometheus.example"],
    }
    with serving({"tls_server_config": tls}, where=tmp_path) as (server, _):
        assert get(server, client(ca, clients.issue_cert("prometheus.example"))) == 200
        assert get(server, client(ca, clients.issue_cert("laptop.example"))) == 403


def test_basic_auth_over_tls(tmp_path, ca):
    config = {"tls_server_config": server_files(tmp_path, ca), "basic_auth_users": {"alice": HASH}}
    with serving(config, where=tmp_path) as (server, _):
        assert get(server, client(ca)) == 401  # no password
        assert get(server, client(ca), headers=basic("alice", "wrong")) == 401
        assert get(server, client(ca), headers=basic("alice", PASSWORD)) == 200


def test_stalled_handshakes_neither_block_others_nor_stay_open(tmp_path, ca):
    config = {"tls_server_config": server_files(tmp_path, ca)}
    limits = Limits(handshake_timeout=0.5, max_connections=16)
    with serving(config, limits, where=tmp_path) as (server, _):
        stalled = [socket.create_connection(server.address, timeout=5) for _ in range(50)]
        try:
            started = time.monotonic()
            assert get(server, client(ca)) == 200
            assert time.monotonic() - started < 1
            wait_until(
                "stalled handshakes to be dropped", lambda: all(map(closed_by_peer, stalled)), 10
            )
        finally:
            for sock in stalled:
                sock.close()


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path, ca, caplog):
    caplog.set_level(logging.WARNING)
    web = tmp_path / "web.yml"
    tls = server_files(tmp_path, ca)
    web.write_text(
        f"tls_server_config:\n  cert_file: {tls['cert_file']}\n  key_file: {tls['key_file']}\n"
        f"basic_auth_users:\n  prometheus: '{HASH}'\n"
    )
    scrape = {
        "scheme": "https",
        "tls_config": {"ca_file": pem(tmp_path, "ca.pem", ca.cert_pem)},
        "basic_auth": {"username": "prometheus", "password": PASSWORD},
    }
    with running_daemon("healthy-8gpu", "--web.config.file", str(web)) as url:
        assert url.startswith("https://")
        target = urllib.parse.urlparse(url).netloc
        with running_prometheus(tmp_path, {"gpuwatchd": [target]}, scrape_options=scrape) as prom:
            wait_until(
                "Prometheus to ingest all 8 GPUs over TLS",
                lambda: len(prom.query("gpuwatchd_gpu_utilization_ratio")) == 8,
                60,
            )
            assert prom.query('up{job="gpuwatchd"}')[0]["value"][1] == "1"


def test_the_dcgm_pause_verb_over_tls(tmp_path, ca):
    from click.testing import CliRunner

    from gpuwatchd.cli import main

    config = {
        "tls_server_config": server_files(tmp_path, ca),
        "basic_auth_users": {"alice": HASH},
        "api_users": ["alice"],
    }
    with serving(config, where=tmp_path) as (server, source):
        secret = tmp_path / "password"
        secret.write_text(PASSWORD)
        url = "https://{}:{}".format(*server.address)
        verb = [
            "dcgm",
            "pause",
            "5",
            "--url",
            url,
            "--user",
            "alice",
            "--password-file",
            str(secret),
        ]
        untrusted = CliRunner().invoke(main, verb)
        assert untrusted.exit_code == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.output
        done = CliRunner().invoke(main, [*verb, "--ca-file", pem(tmp_path, "ca.pem", ca.cert_pem)])
        assert done.exit_code == 0, done.output
        assert source.pauses == [5]


# -- who may change the TLS files (issue 41's file trust) -----------------------------------

EXPECTED = "expected only root or the daemon's user to be able to write it"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users (root)")


def secret_volume(where: Path, files: dict[str, trustme.Blob]) -> None:
    """A Kubernetes Secret volume's layout: each file a link into `..data`, itself a link
    to the timestamped directory the kubelet swaps on an update."""
    stamped = where / "..2026_12_06_11_00_00.1"
    stamped.mkdir(parents=True)
    for name, blob in files.items():
        blob.write_to_path(str(stamped / name))
        (where / name).symlink_to(Path("..data") / name)
    (where / "..data").symlink_to(stamped.name)


def key_anyone_may_write(tls: dict[str, str]):
    Path(tls["key_file"]).chmod(0o666)
    return (
        "key_file",
        f"writable by anyone (mode 0666): {EXPECTED}",
        lambda: Path(tls["key_file"]).chmod(0o600),
    )


def client_ca_owned_by_nobody(tls: dict[str, str]):
    os.chown(tls["client_ca_file"], 65534, -1)
    nobody = pwd.getpwuid(65534).pw_name
    return (
        "client_ca_file",
        f"owned by {nobody} (uid 65534), who may change it: expected root",
        lambda: os.chown(tls["client_ca_file"], 0, -1),
    )


def cert_in_a_directory_anyone_may_write(tls: dict[str, str]):
    directory = Path(tls["cert_file"]).resolve().parent
    directory.chmod(0o777)  # anyone could put another certificate in its place
    return (
        "cert_file",
        f"its directory {directory} is writable by anyone (mode 0777): {EXPECTED}",
        lambda: directory.chmod(0o755),
    )


@pytest.mark.parametrize(
    "spoil",
    [
        key_anyone_may_write,
        pytest.param(client_ca_owned_by_nobody, marks=as_root),
        cert_in_a_directory_anyone_may_write,
    ],
)
def test_tls_files_others_could_change_are_refused(tmp_path, ca, spoil):
    """Whoever can write the client CA mints certificates the daemon accepts; whoever can
    write the key or the certificate replaces the daemon's identity. The files here are
    a Secret volume's links: judged where they lead."""
    clients = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    secret = tmp_path / "tls"
    secret_volume(
        secret,
        {"tls.crt": server.cert_chain_pems[0], "tls.key": server.private_key_pem},
    )
    secret_volume(tmp_path / "ca", {"ca.crt": clients.cert_pem})
    tls = {
        "cert_file": str(secret / "tls.crt"),
        "key_file": str(secret / "tls.key"),
        "client_auth_type": "RequireAndVerifyClientCert",
        "client_ca_file": str(tmp_path / "ca" / "ca.crt"),
    }
    key, why, fix = spoil(tls)
    with (
        pytest.raises(WebConfigError) as refused,
        serving({"tls_server_config": tls}, where=tmp_path),
    ):
        pass
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'web.yml'}: tls_server_config.{key}: {tls[key]}: ")
    assert f"refused: {why}" in message
    assert "PRIVATE KEY" not in message
    fix()
    with serving({"tls_server_config": tls}, where=tmp_path) as (served, _):
        assert get(served, client(ca, clients.issue_cert("prometheus.example"))) == 200
