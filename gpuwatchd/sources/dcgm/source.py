"""The DCGM source: finding DCGM, connecting, its states and back-off, pausing profiling.

What one connection holds and reads is a `Session` (session.py); this module decides
when to connect, what state the source is in, and what a poll returns.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from gpuwatchd.config import DcgmConfig, SourceConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sources import register
from gpuwatchd.sources.base import Context, Source, SourceError, settings_of
from gpuwatchd.sources.dcgm.bindings import (
    Bindings,
    UntrustedBindings,
    find_bindings,
    load_bindings,
)
from gpuwatchd.sources.dcgm.fields import (
    COMPAT_DEFAULT_FIELDS,
    FIELD_MAPS,
    GENERIC,
    INFO,
    INSTANCE_SPECS,
    INSTANCE_UTILIZATION,
    LOSSES,
    PAUSE_REMAINING,
    PROFILING_STATE,
    STATE,
    STATES,
    FieldPlan,
    compat_specs,
    not_numbers,
    profiling_ids,
)
from gpuwatchd.sources.dcgm.latest import LatestValues
from gpuwatchd.sources.dcgm.session import Session, ranges

log = logging.getLogger(__package__)


class DcgmUnavailable(SourceError):
    """The source cannot read DCGM this poll; `samples` say why (the state gauges)."""

    def __init__(self, message: str, samples: list[Sample]) -> None:
        super().__init__(message)
        self.samples = samples


def exporter_hostname(environ: Mapping[str, str], hostname: str) -> str:
    """dcgm-exporter's `Hostname` label (4.0 and later): $NODE_NAME, which its DaemonSet
    sets from the downward API (spec.nodeName), else the host name (in a pod without
    hostNetwork, the pod's)."""
    return environ.get("NODE_NAME") or hostname


def _parse_hostengine(address: str) -> dict[str, Any]:
    if address == "embedded":
        return {}
    if address.startswith("unix://"):
        return {"unixSocketPath": address.removeprefix("unix://")}
    return {"ipAddress": address}


@register
class DcgmSource(Source):
    name = "dcgm"
    metrics = (
        STATE,
        INFO,
        LOSSES,
        PAUSE_REMAINING,
        PROFILING_STATE,
        GENERIC,
        *dict.fromkeys(m.spec for m in FIELD_MAPS.values() if m.spec is not None),
        *INSTANCE_SPECS.values(),  # per MIG GPU instance (mig.py)
        INSTANCE_UTILIZATION,
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        config = settings_of(config, DcgmConfig)
        super().__init__(config, context)
        self.config: DcgmConfig = config
        extras = context.extras
        self._clock: Callable[[], float] = extras.get("clock", time.monotonic)
        self._rootfs = Path(extras.get("rootfs", "/"))
        self._hostengine: str = extras.get("dcgm_hostengine") or config.hostengine
        self._hostname = exporter_hostname(
            extras.get("environ", os.environ), extras.get("hostname") or socket.gethostname()
        )
        self._pid = os.getpid()
        compat = COMPAT_DEFAULT_FIELDS if config.exporter_compat else ()
        self._plan = FieldPlan.of(config.fields, compat)
        self._checked = False  # the fields, against DCGM's own metadata (once connected)
        if config.exporter_compat:
            # a gpuwatchd source's metrics are a class attribute; compat adds families
            self.metrics = (  # type: ignore[misc]
                *type(self).metrics,
                *compat_specs(config.compat_hostname_label),
            )
        self._lock = threading.Lock()  # one DCGM conversation at a time
        self._bindings: Bindings | None = None
        self._latest: LatestValues | None = None  # how sessions read values (the bindings')
        self._session: Session | None = None
        self._state = "not_installed"
        self._reason = "not started"
        self._logged: tuple[str, str] | None = None
        self._failures = 0
        self._retry_at: float | None = None
        self._losses = 0
        self._pause_until: float | None = None
        self._state_samples = {
            s: [Sample(STATE.name, (t,), float(s == t)) for t in STATES] for s in STATES
        }

    # -- public API -----------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    def pause_profiling(self, seconds: float) -> dict[str, Any]:
        """Pause DCGM profiling for `seconds` (capped), resumed automatically after.

        Applied at once when DCGM is connected and no poll is running, else by the next
        poll. Returns {"paused", "seconds", "applied", "state"}.
        """
        if not math.isfinite(seconds):
            raise ValueError(f"pause_profiling: expected a number of seconds, got {seconds!r}")
        seconds = min(float(seconds), self.config.max_profiling_pause)
        if seconds <= 0:
            return self.resume_profiling()
        self._pause_until = self._clock() + seconds
        log.info("dcgm: profiling pause requested for %gs", seconds)
        applied = self._apply_now()
        return {"paused": True, "seconds": seconds, "applied": applied, "state": self._state}

    def resume_profiling(self) -> dict[str, Any]:
        self._pause_until = None
        applied = self._apply_now()
        return {"paused": False, "seconds": 0.0, "applied": applied, "state": self._state}

    def pause_remaining(self) -> float:
        until = self._pause_until
        return max(0.0, until - self._clock()) if until is not None else 0.0

    def _apply_now(self) -> bool:
        if not self._lock.acquire(timeout=min(1.0, self.config.timeout)):
            return False  # a poll holds DCGM (or is stuck in it): the next poll applies it
        try:
            session = self._session
            if session is None:
                return False
            try:
                session.apply_pause(self._pause_wanted(self._clock()))
            except Exception as e:  # the poll will find out and handle it
                log.debug("dcgm: applying the profiling pause failed: %s", e)
                return False
            return True
        finally:
            self._lock.release()

    def _pause_wanted(self, now: float) -> bool:
        if self._pause_until is not None and now >= self._pause_until:
            self._pause_until = None  # the time is up
        return self._pause_until is not None

    # -- polling --------------------------------------------------------------------------

    def collect(self) -> list[Sample]:
        with self._lock:
            now = self._clock()
            session = self._session or self._start(now)
            structs = session.bindings.structs
            try:
                session.apply_pause(self._pause_wanted(now))
                session.retry_profiling(now)
                out = session.read()
            except structs.DCGMError as e:
                self._session = None
                session.close(tidy=False)
                why = session.bindings.describe(e)
                if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                    self._losses += 1
                    self._fail(
                        now,
                        "connection_lost",
                        f"lost the connection to nv-hostengine at {self._hostengine} "
                        f"({why}); reconnecting",
                    )
                self._fail(now, "error", f"reading DCGM failed: {why}")
            out.extend(self._status(session))
            return out

    def _status(self, session: Session) -> list[Sample]:
        out = list(self._state_samples["connected"])
        out.append(Sample(LOSSES.name, (), float(self._losses)))
        if session.version:
            out.append(Sample(INFO.name, (session.version,), 1.0))
        out.append(Sample(PAUSE_REMAINING.name, (), self.pause_remaining()))
        if self._plan.profiling:
            for gpu in session.gpus.values():
                out.extend(gpu.state_samples[gpu.profiling])
        return out

    def close(self) -> None:
        """Give the counters back (resume a pause of ours), remove our groups, disconnect."""
        if not self._lock.acquire(timeout=self.config.timeout):
            log.warning("dcgm: a poll is stuck in DCGM; closing without cleaning up")
            return
        try:
            session, self._session = self._session, None
            if session is not None:
                session.close(tidy=True)
        finally:
            self._lock.release()

    # -- states ---------------------------------------------------------------------------

    def _set_state(self, state: str, reason: str) -> None:
        """Enter `state`; log it once per change (the scheduler warns that the source is
        down, with this reason, so this line is INFO)."""
        self._state, self._reason = state, reason
        if self._logged is None or self._logged[0] != state:
            log.info("dcgm: %s: %s", state.replace("_", " "), reason)
        elif self._logged[1] != reason:
            log.debug("dcgm: %s: %s", state, reason)
        self._logged = (state, reason)

    def _unavailable(self) -> DcgmUnavailable:
        samples = [*self._state_samples[self._state], Sample(LOSSES.name, (), self._losses)]
        return DcgmUnavailable(f"{self._state}: {self._reason}", samples)

    def _fail(self, now: float, state: str, reason: str) -> NoReturn:
        """Record a failed attempt, schedule the next one, raise DcgmUnavailable."""
        self._failures += 1
        if state == "connection_lost":
            delay = 0.0  # reconnect on the next poll; back off if that fails
        else:
            base = max(self.config.interval, 1.0)
            delay = min(self.config.reconnect_backoff_max, base * 2 ** (self._failures - 1))
        self._retry_at = now + delay
        self._set_state(state, reason)
        log.debug("dcgm: next attempt in %gs", delay)
        raise self._unavailable()

    # -- connecting -----------------------------------------------------------------------

    def _start(self, now: float) -> Session:
        if self._retry_at is not None and now < self._retry_at:
            raise self._unavailable()
        bindings = self._load(now)
        handle = self._connect(bindings, now)
        if self._latest is None:  # once the library is loaded: what it lacks stays known
            self._latest = LatestValues(bindings)
        session = Session(
            bindings, handle, self.config, self._hostname, self._prefix(), self._latest
        )
        try:
            self._check_fields(bindings)
            session.setup(self._plan, now)
        except Exception as e:
            session.close(tidy=False)  # our groups go with the connection
            self._setup_failed(bindings, now, e)
        self._session = session
        session.log_profiling_changes()
        self._failures = 0
        self._retry_at = None
        profiling = [g.label for g in session.gpus.values() if g.profiling == "active"]
        self._set_state(
            "connected",
            f"DCGM {session.version} at {self._hostengine}: {len(session.gpus)} GPUs, "
            f"{len(self._plan.watched) - len(self._plan.profiling)} device fields, "
            f"profiling on GPUs [{ranges(profiling)}]",
        )
        return session

    def _prefix(self) -> str:
        return f"gpuwatchd_{self._pid}"

    def _load(self, now: float) -> Bindings:
        if self._bindings is not None:
            return self._bindings
        directory, looked = find_bindings(self.config.bindings_path, self._rootfs)
        if directory is None:
            where = ", ".join(str(p) for p in looked)
            self._fail(
                now,
                "not_installed",
                f"DCGM's Python bindings not found (looked in "
                f"{where}); install datacenter-gpu-manager-4 or set "
                "sources.dcgm.bindings_path",
            )
        try:
            self._bindings = load_bindings(directory)
        except UntrustedBindings as e:  # whoever can change them would run code as us
            self._fail(now, "not_installed", f"DCGM's Python bindings refused: {e}")
        except Exception as e:
            self._fail(
                now,
                "not_installed",
                f"cannot load DCGM's Python bindings from {directory}: {type(e).__name__}: {e}",
            )
        return self._bindings

    def _connect(self, bindings: Bindings, now: float) -> Any:
        """A pydcgm.DcgmHandle connected to the host engine (or an embedded one)."""
        structs = bindings.structs
        where = {"ipAddress": None, "unixSocketPath": None, **_parse_hostengine(self._hostengine)}
        try:
            return bindings.pydcgm.DcgmHandle(
                timeoutMs=int(self.config.connect_timeout * 1000),
                persistAfterDisconnect=False,
                **where,
            )
        except structs.DCGMError as e:
            why = bindings.describe(e)
            if e.value == structs.DCGM_ST_LIBRARY_NOT_FOUND:
                self._fail(
                    now,
                    "not_installed",
                    f"DCGM's Python bindings are at {bindings.directory} but libdcgm is "
                    f"not installed ({why})",
                )
            if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                self._fail(
                    now,
                    "hostengine_down",
                    f"cannot connect to nv-hostengine at {self._hostengine} ({why}); is it "
                    "running (systemctl status nvidia-dcgm)?",
                )
            self._fail(now, "error", f"starting DCGM failed: {why}")

    def _check_fields(self, bindings: Bindings) -> None:
        """Leave out fields DCGM cannot give as numbers, by its own metadata (in libdcgm,
        so only once connected): the config knows DCGM 4.6's text fields, not a newer's."""
        if self._checked:
            return
        # which fields the profiling module serves, as these bindings name them: a refused
        # profiling watch must never share a field group with device fields
        self._plan = self._plan.classified(profiling_ids(bindings.fields))
        problems = not_numbers(bindings.fields, self._plan.watched)
        if problems:
            log.warning(
                "dcgm: not watching %s: gpuwatchd exports numeric fields only",
                "; ".join(problems.values()),
            )
            self._plan = self._plan.without(problems)
        self._checked = True

    def _setup_failed(self, bindings: Bindings, now: float, error: Exception) -> NoReturn:
        structs = bindings.structs
        if not isinstance(error, structs.DCGMError):  # bindings of another DCGM version?
            self._fail(now, "error", f"setting up DCGM failed: {type(error).__name__}: {error}")
        why = bindings.describe(error)
        if error.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
            self._fail(
                now,
                "hostengine_down",
                f"nv-hostengine at {self._hostengine} went away while setting up ({why})",
            )
        self._fail(now, "error", f"setting up DCGM watches failed: {why}")
