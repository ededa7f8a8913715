"""systemd's notification protocol (sd_notify(3)): readiness, stopping and the watchdog.

`gpuwatchd.service` is `Type=notify` with `WatchdogSec=`: the daemon says READY=1 once
it serves, and its evaluation loop says WATCHDOG=1 after each cycle that completed, so a
wedged loop stops the pings and systemd restarts the daemon. Outside systemd
($NOTIFY_SOCKET unset) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

import sdnotify

log = logging.getLogger(__name__)


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """$WATCHDOG_USEC in seconds, if the watchdog is meant for this process (like
    sd_watchdog_enabled(3)); None if it is off."""
    usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID")
    if not usec.isdigit() or int(usec) == 0 or pid not in (None, str(os.getpid())):
        return None
    return int(usec) / 1e6


class Notifier:
    """Tells systemd about the daemon; pings the watchdog at half its interval."""

    def __init__(
        self,
        cycle: float,
        environ: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._systemd = sdnotify.SystemdNotifier()  # connects to $NOTIFY_SOCKET, if any
        self._clock = clock
        self.watchdog = watchdog_interval(environ)
        self._next_ping = 0.0
        if self.watchdog is not None and cycle >= self.watchdog / 2:
            log.warning(
                "evaluation_interval (%gs) is not shorter than half the watchdog's %gs "
                "(WatchdogSec=): systemd will restart the daemon",
                cycle,
                self.watchdog,
            )

    def ready(self) -> None:
        self._systemd.notify("READY=1")

    def stopping(self) -> None:
        self._systemd.notify("STOPPING=1")

    def alive(self) -> None:
        """A cycle completed: ping the watchdog if half its interval has passed."""
        if self.watchdog is None:
            return
        now = self._clock()
        if now >= self._next_ping:
            self._systemd.notify("WATCHDOG=1")
            self._next_ping = now + self.watchdog / 2
