"""TLS and basic auth from an exporter-toolkit web config, with real TLS clients and Prometheus.

Certificates are made here (trustme); nothing is fetched or trusted from outside.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import logging
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
