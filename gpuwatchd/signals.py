"""Signals for `gpuwatchd run`, caught from the first instant.

Importing this module (cli.py does, before anything slow) makes SIGHUP remembered rather
than fatal: a reload asked for while the daemon starts (imports, sources, the rule file:
a second or more) must not kill it, as SIGHUP's default action would. `run` then catches
SIGTERM and SIGINT too and acts on `RECEIVED` in order; every other command gives SIGHUP
back what it was given at exec (`release`): its default action, or ignored under nohup.
"""

from __future__ import annotations

import os
import queue
import signal
import threading

RECEIVED: queue.SimpleQueue[int] = queue.SimpleQueue()  # signal numbers, in arrival order
INHERITED = signal.getsignal(signal.SIGHUP)  # SIGHUP's disposition at exec (nohup: ignored)


def _remember(signum: int, frame: object) -> None:
    RECEIVED.put(signum)  # SimpleQueue.put may be called from a signal handler


def catch(*signums: int) -> None:
    for signum in signums:
        signal.signal(signum, _remember)


def release() -> None:
    """SIGHUP's disposition at exec back; one that came meanwhile is delivered again."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL if INHERITED is None else INHERITED)
    hup = False
    while not RECEIVED.empty():
        hup |= RECEIVED.get_nowait() == signal.SIGHUP
    if hup:
        os.kill(os.getpid(), signal.SIGHUP)


if threading.current_thread() is threading.main_thread():  # signal.signal's requirement
    catch(signal.SIGHUP)
