"""Signals: SIGTERM/SIGINT ask for a graceful stop at the next step boundary; SIGUSR1 dumps stacks."""

from __future__ import annotations

import faulthandler
import signal
import sys
import time


class StopRequest:
    """Set from a signal handler or a watchdog thread; read by the training loop once per step.

    Plain attributes, no lock. A handler runs between any two bytecodes of the main thread, its own included, and
    a forked rank gets each SIGTERM twice (from the supervisor, and forwarded by its proxy). A `threading.Event`
    here let the second run inside the first's `Event.set`, where it blocked for good on the lock that the first
    held: the rank hung mid-step, the stop's grace ran out, and both ranks were SIGKILLed without their stop
    checkpoint (twice in CI).
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.at: float | None = None

    def set(self, reason: str) -> None:
        if self.at is None:  # the first reason is kept (a re-entered call may overwrite it with its own: harmless)
            self.reason = reason
            self.at = time.monotonic()

    def __bool__(self) -> bool:
        return self.at is not None


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
