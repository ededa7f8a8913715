"""The few calls of Prometheus's HTTP API that `gpuwatchd report` needs (Thanos and Mimir
serve the same API). Plain GET requests through urllib: no Prometheus client on PyPI is
both maintained and light (prometheus-api-client pulls pandas and matplotlib)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class PrometheusError(Exception):
    """Prometheus could not be reached or refused a query; the message says which."""


def string(value: str) -> str:
    """`value` as a PromQL double-quoted string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def regex_of(values: list[str]) -> str:
    """A PromQL `=~` literal matching exactly `values` (RE2 metacharacters escaped)."""
    escaped = ["".join("\\" + c if c in r"\.+*?()|[]{}^$" else c for c in v) for v in values]
    return string("|".join(sorted(set(escaped))))


class Prometheus:
    """GET /api/v1/query of the server at `base` (a path prefix, e.g. Mimir's
    /prometheus, is kept), all queries together within `timeout` seconds."""

    def __init__(self, base: str, timeout: float = 60) -> None:
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        if "://" not in base:
            raise PrometheusError(
                f"{base!r}: expected a URL with its scheme, e.g. http://{base.lstrip('/')}"
            )

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return self._get("query", {"query": expr, "time": f"{at:.3f}"})

    def _get(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(f"{self.base} did not answer within --timeout {self.timeout:g} s")
        # Prometheus stops evaluating a query past its own `timeout` parameter too
        query = urllib.parse.urlencode({**params, "timeout": f"{max(1, int(left * 1000))}ms"})
        url = f"{self.base}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=left) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # 400/422/503 carry Prometheus's error JSON
            raise PrometheusError(f"{self.base}: {e.code}: {_error(e)}") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                raise PrometheusError(
                    f"{self.base} did not answer within --timeout {self.timeout:g} s"
                ) from e
            raise PrometheusError(f"cannot query Prometheus at {self.base}: {e}") from e
        if body.get("status") != "success":
            raise PrometheusError(f"{self.base}: {body.get('error', body)}")
        return body["data"]["result"]


def _error(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("error"))
    except (ValueError, OSError):
        return str(e.reason)
