"""Signals: SIGTERM/SIGINT/SIGHUP ask for a graceful stop at the next step boundary; SIGUSR1 dumps stacks."""

from __future__ import annotations

import faulthandler
import signal
import sys
import time


class StopRequest:
    """Set from a signal handler or a watchdog thread; read by the training loop once per step.

    Plain attributes, no lock. A handler runs between any two bytecodes of the main thread, its own included, and
    a rank can get a SIGTERM twice within microseconds (Slurm signals every process of a step; a prewarmed rank
    got one from the supervisor and one through its proxy until 2026-11-27). With a `threading.Event` here, the
    second run could start inside the first's `Event.set` and block for good on the lock the first held: the
    rank hung mid-step and was SIGKILLed when the stop's grace ran out, without its stop checkpoint (reproduced
    outside the suite; the likely cause of two CI failures of the hangup test).
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
    """SIGTERM/SIGINT/SIGHUP → `stop`; SIGUSR1 → every thread's Python stack to stderr (the rank's log), and on.

    SIGHUP: torchrun passes the signal it got on to its workers, so a torchrun hung up (its terminal closed, or
    `kill -HUP`) used to end the ranks outright, without the checkpoint a SIGTERM gets. A rank started with it
    ignored (`nohup torchrun …`) keeps it ignored, as `resilient run` does.

    faulthandler's handler runs in C at delivery, so it dumps even when the main thread is stuck inside a
    collective that never returns to the interpreter.
    """

    def on_signal(signum: int, _frame: object) -> None:
        stop.set(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_signal)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
