"""Signals: SIGTERM/SIGINT ask for a graceful stop at the next step boundary; SIGUSR1 dumps stacks."""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time


class StopRequest:
    """Set from a signal handler or a watchdog thread; read by the training loop once per step."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self.at: float | None = None

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason, self.at = reason, time.monotonic()
            self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


def install(stop: StopRequest) -> None:
    """SIGTERM/SIGINT → `stop`; SIGUSR1 → every thread's Python stack to stderr (the rank's log), and on.

    faulthandler's handler runs in C at delivery, so it dumps even when the main thread is stuck inside a
    collective that never returns to the interpreter.
    """

    def on_signal(signum: int, _frame: object) -> None:
        stop.set(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
