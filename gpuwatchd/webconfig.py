"""The web configuration file (`--web.config.file`), in Prometheus exporter-toolkit's format.

The same file node_exporter reads (exporter-toolkit's docs/web-configuration.md):
`tls_server_config` (TLS, client certificates), `basic_auth_users` (bcrypt hashes),
`http_server_config.headers` and `rate_limit`. Relative paths are relative to the file,
as in the toolkit. Differences, each refused or noted rather than silently changed:
- `client_auth_type: RequireAnyClientCert` is refused: Python's ssl module cannot require
  a certificate without verifying it (use RequireAndVerifyClientCert).
- `RequestClientCert` does not ask for a certificate: the toolkit never checks one in
  that mode, so access is the same.
- `curve_preferences` and `http_server_config.http2` are accepted and ignored (OpenSSL's
  groups; HTTP/1.1 only).
- `rate_limit` is a bucket per client address, spent only by authenticated requests.
- `api_users` is gpuwatchd's own key: the users who may change state (issue 23).
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuwatchd.config import FileError, parse_duration, read_text_file
from gpuwatchd.filetrust import refusal


def __getattr__(name: str) -> Any:
    """`bcrypt`, loaded on first use: a node without basic auth never holds it (issue 46)."""
    if name == "bcrypt":
        import bcrypt

        return bcrypt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WebConfigError(Exception):
    """A problem with the web configuration file, phrased for the operator."""


TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
TlsVersion = Literal["TLS10", "TLS11", "TLS12", "TLS13"]

# Go's names (crypto/tls CipherSuites) -> OpenSSL's; TLS 1.3 suites are not configurable
# in Go either (accepted, no effect).
CIPHERS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
ClientAuth = Literal[
    "NoClientCert",
    "RequestClientCert",
    "RequireAnyClientCert",
    "RequireClientCert",  # the toolkit's old name for RequireAnyClientCert
    "VerifyClientCertIfGiven",
    "RequireAndVerifyClientCert",
]
# the toolkit allows only these headers, some with a closed set of values
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
_HEADER_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e\t]*[\x21-\x7e])?")  # RFC 9110's, ASCII
_BCRYPT = re.compile(r"^\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{53}$")
BCRYPT_COSTS = range(4, 32)  # bcrypt's; a hash outside it matches no password


def _one_of(allowed: Any) -> Any:
    names = ", ".join(allowed)
    return BeforeValidator(lambda v: v if v in allowed else _fail(f"expected one of {names}"))


def _fail(message: str) -> Any:
    raise ValueError(message)


def _bcrypt_hash(value: Any) -> Any:
    match = _BCRYPT.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            "expected a bcrypt hash such as $2y$10$... (htpasswd -nBC 10 '' | tr -d ':\\n')"
        )
    if int(match[1]) not in BCRYPT_COSTS:  # no password could ever match it
        raise ValueError(f"expected a bcrypt cost of 4 to 31, got cost {match[1]}")
    return value


def _go_duration(value: Any) -> float:
    if value == 0:
        return 0.0
    if isinstance(value, str):
        return parse_duration(value)
    raise ValueError("expected a duration such as 1s, 500ms or 1m")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)  # as Go


class TLSServerConfig(_Strict):
    cert: str | None = None
    key: str | None = Field(None, repr=False)
    client_ca: str | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    client_auth_type: Annotated[str, _one_of(ClientAuth.__args__)] = "NoClientCert"
    client_ca_file: Path | None = None
    client_allowed_sans: list[str] | None = None
    min_version: Annotated[str, _one_of(TLS_VERSIONS)] = "TLS12"
    max_version: Annotated[str, _one_of(TLS_VERSIONS)] = "TLS13"
    cipher_suites: list[Annotated[str, _one_of(CIPHERS)]] = []
    prefer_server_cipher_suites: bool = True
    curve_preferences: list[
        Annotated[str, _one_of(("CurveP256", "CurveP384", "CurveP521", "X25519"))]
    ] = []

    @property
    def enabled(self) -> bool:
        """As the toolkit's IsEnabled: any certificate, key, CA or client auth set."""
        return bool(
            self.cert
            or self.key
            or self.cert_file
            or self.key_file
            or self.client_ca
            or self.client_ca_file
            or "client_auth_type" in self.model_fields_set
        )

    @property
    def verifies_clients(self) -> bool:
        return self.client_auth_type in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")

    @model_validator(mode="after")
    def _consistent(self) -> TLSServerConfig:
        if not self.enabled:
            return self
        for what in ("cert", "key"):
            inline, file = getattr(self, what), getattr(self, f"{what}_file")
            if not inline and not file:
                raise ValueError(f"expected one of {what} or {what}_file")
            if inline and file:
                raise ValueError(f"expected one of {what} or {what}_file, not both")
        auth = self.client_auth_type
        if auth in ("RequireAnyClientCert", "RequireClientCert"):
            raise ValueError(
                f"client_auth_type {auth} is not supported (Python's ssl cannot require a "
                "certificate without verifying it): expected RequireAndVerifyClientCert "
                "with client_ca_file"
            )
        if (self.client_ca or self.client_ca_file) and auth in (
            "NoClientCert",
            "RequestClientCert",
        ):
            raise ValueError(
                f"a client CA is set but client_auth_type is {auth}: expected "
                "VerifyClientCertIfGiven or RequireAndVerifyClientCert"
            )
        if self.client_allowed_sans is not None and auth != "RequireAndVerifyClientCert":
            raise ValueError(
                "client_allowed_sans expects client_auth_type RequireAndVerifyClientCert"
            )
        if TLS_VERSIONS[self.min_version] > TLS_VERSIONS[self.max_version]:
            raise ValueError(
                f"min_version {self.min_version} is above max_version {self.max_version}"
            )
        return self


class HTTPServerConfig(_Strict):
    http2: bool = True  # accepted for the toolkit's format; this server speaks HTTP/1.1
    headers: dict[str, str] = {}

    @field_validator("headers")
    @classmethod
    def _allowed(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if name not in HEADERS:
                raise ValueError(
                    f"header {name!r} cannot be configured: expected one of " + ", ".join(HEADERS)
                )
            if HEADERS[name] and value not in HEADERS[name]:
                raise ValueError(
                    f"{name}: expected one of {', '.join(HEADERS[name])}, got {value!r}"
                )
            if not _HEADER_VALUE.fullmatch(value):  # else every reply would fail to frame
                raise ValueError(f"{name}: expected printable ASCII on one line, got {value!r}")
        return headers


class RateLimit(_Strict):
    interval: Annotated[float, BeforeValidator(_go_duration), Field(ge=0)] = 0.0  # 0: off
    burst: int = Field(0, ge=0)


class WebConfig(_Strict):
    tls_server_config: TLSServerConfig = TLSServerConfig()
    http_server_config: HTTPServerConfig = HTTPServerConfig()
    basic_auth_users: dict[str, Annotated[str, BeforeValidator(_bcrypt_hash)]] | None = None
    rate_limit: RateLimit = RateLimit()
    # gpuwatchd's own key (the toolkit has no roles): the users of basic_auth_users who
    # may call /api/ (change state); every other user only reads. Absent: nobody may.
    api_users: list[str] = []

    @model_validator(mode="after")
    def _api_users_known(self) -> WebConfig:
        unknown = [user for user in self.api_users if user not in self.users]
        if unknown:
            raise ValueError(
                f"api_users: expected names of basic_auth_users, got {', '.join(unknown)}"
            )
        return self

    @property
    def tls(self) -> TLSServerConfig | None:
        return self.tls_server_config if self.tls_server_config.enabled else None

    @property
    def users(self) -> dict[str, str]:
        return self.basic_auth_users or {}


def load_web_config(path: Path) -> WebConfig:
    """Read and validate `path`; file paths inside become relative to its directory."""
    try:  # a regular file only (a FIFO would hang the start), 1 MiB, UTF-8
        data = yaml.safe_load(read_text_file(Path(path))) or {}
    except FileError as e:
        raise WebConfigError(f"{path}: {e}") from e
    except yaml.YAMLError as e:
        raise WebConfigError(f"{path}: not valid YAML: {e}") from e
    except RecursionError as e:  # PyYAML's composer recurses per nesting level
        raise WebConfigError(f"{path}: not valid YAML: nested too deeply") from e
    if not isinstance(data, dict):
        raise WebConfigError(f"{path}: expected a mapping at the top level")
    try:
        config = WebConfig.model_validate(data)
    except ValidationError as e:
        raise WebConfigError("\n".join(f"{path}: {_describe(err)}" for err in e.errors())) from e
    tls = config.tls_server_config
    files = {
        k: Path(path).parent / v
        for k in ("cert_file", "key_file", "client_ca_file")
        if (v := getattr(tls, k)) is not None
    }
    return config.model_copy(update={"tls_server_config": tls.model_copy(update=files)})


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    message = error["msg"].removeprefix("Value error, ")
    shown = error.get("input")
    if error["loc"] and error["loc"][-1] == "key" or isinstance(shown, dict):
        return f"{where}: {message}"  # never echo a private key; mappings are long
    return f"{where}: {message}, got {shown!r}"


def ssl_context(tls: TLSServerConfig, where: Path) -> ssl.SSLContext:
    """The server-side SSLContext for `tls`; errors name the file and the key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.maximum_version = TLS_VERSIONS[tls.max_version]
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    ciphers = [name for c in tls.cipher_suites if (name := CIPHERS[c])]
    if ciphers:
        _checked(where, "cipher_suites", lambda: context.set_ciphers(":".join(ciphers)))
    with _pem_files(tls, where) as (cert, key):
        key_name = "key_file" if tls.key_file else "key"
        _checked(where, f"cert_file/{key_name}", lambda: context.load_cert_chain(cert, key))
    if tls.verifies_clients:
        context.verify_mode = (
            ssl.CERT_REQUIRED
            if tls.client_auth_type == "RequireAndVerifyClientCert"
            else ssl.CERT_OPTIONAL
        )
        if tls.client_ca_file:
            cafile = _trusted_file(where, "client_ca_file", tls.client_ca_file)
            _checked(where, "client_ca_file", lambda: context.load_verify_locations(cafile=cafile))
        elif tls.client_ca:
            _checked(
                where, "client_ca", lambda: context.load_verify_locations(cadata=tls.client_ca)
            )
        else:  # as Go: no client CA means the system's roots
            context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    return context


def _checked(where: Path, key: str, load: Any) -> None:
    try:
        load()
    except (OSError, ssl.SSLError, ValueError) as e:
        detail = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
        raise WebConfigError(
            f"{where}: tls_server_config.{key}: expected a readable PEM that OpenSSL "
            f"accepts, got an error: {detail}"
        ) from e


def _trusted_file(where: Path, key: str, file: Path) -> str:
    """The real path of the TLS file `file` (`tls_server_config.<key>` of the web config
    at `where`), for ssl to read, if only root and the daemon's user can change it
    (filetrust.py): whoever can write the client CA mints client certificates the daemon
    accepts, whoever can write its key or certificate replaces its identity. Read through
    the real path, so that no link can be swapped after the check. A file that cannot be
    read is left to ssl to report."""
    real = os.path.realpath(file)
    try:
        st = os.stat(real)
    except OSError:
        return real
    if (problem := refusal(real, st)) is not None:
        raise WebConfigError(f"{where}: tls_server_config.{key}: {file}: {problem}")
    return real


@contextmanager
def _pem_files(tls: TLSServerConfig, where: Path) -> Iterator[tuple[str, str]]:
    """Paths of the certificate and key, files checked by `_trusted_file`; inline PEMs go
    through a private temporary file."""
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-tls-") as tmp:  # mode 0700

        def path(inline: str | None, file: Path | None, name: str) -> str:
            if file is not None:
                return _trusted_file(where, f"{name}_file", file)
            written = os.path.join(tmp, f"{name}.pem")
            fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(inline or "")
            return written

        yield path(tls.cert, tls.cert_file, "cert"), path(tls.key, tls.key_file, "key")


def peer_sans(certificate: dict[str, Any] | None) -> set[str]:
    """A verified peer certificate's subject alternative names, as the toolkit compares them."""
    return {value for _, value in (certificate or {}).get("subjectAltName", ())}


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes, as exporter-toolkit does.

    A success is cached per (user, hash, password) so a scrape does not pay bcrypt (~70 ms
    at cost 10) each time; failures are not cached, so guessing cannot evict them.

    Every check costs what one at the file's highest cost does, so the time of an answer
    tells nothing of whether the user exists (issue 41): an unknown user is checked
    against a hash of that cost, and a user whose hash is cheaper (files may mix costs,
    as exporter-toolkit's own test data does) is checked against dummies of costs c,
    c+1, ..., highest-1 after its own: 2^c + 2^c + ... + 2^(highest-1) = 2^highest rounds.
    """

    CACHE_SIZE = 100

    def __init__(self, users: dict[str, str]) -> None:
        self.users = users
        self.cost = max(map(_cost, users.values()), default=10)
        self.unknown = _dummy(self.cost)
        self._padding = {
            cost: [_dummy(k) for k in range(cost, self.cost)] for cost in map(_cost, users.values())
        }
        self._ok: dict[bytes, None] = {}
        self._lock = threading.Lock()

    def key(self, user: str, password: str) -> bytes:
        hashed = self.users.get(user, self.unknown)
        return hashlib.sha256("\0".join((user, hashed, password)).encode()).digest()

    def cached(self, user: str, password: str) -> bool:
        with self._lock:
            return self.key(user, password) in self._ok

    def check(self, user: str, password: str) -> bool:
        """bcrypt's verdict (slow: run it off the event loop), remembered if it is yes."""
        hashed = self.users.get(user)
        ok = _verify(password, hashed or self.unknown)
        for dummy in self._padding[_cost(hashed)] if hashed else ():
            _verify(password, dummy)  # the rounds up to the file's highest cost
        if ok and hashed is not None:
            with self._lock:
                self._ok[self.key(user, password)] = None
                while len(self._ok) > self.CACHE_SIZE:
                    del self._ok[next(iter(self._ok))]
        return ok and hashed is not None


def _cost(hashed: str) -> int:
    return int(hashed.split("$")[2])


def _dummy(cost: int) -> str:
    """A hash of `cost` that no password matches (a fresh salt, a zero digest): checking
    a password against it costs what a real hash of that cost does, making it nothing."""
    import bcrypt

    return bcrypt.gensalt(cost).decode() + "." * 31


def _verify(password: str, hashed: str) -> bool:
    import bcrypt

    try:
        return bcrypt.checkpw(password.encode(), hashed.encode())
    except ValueError:  # over bcrypt's 72 bytes: no hash can match it (as in Go)
        return False
