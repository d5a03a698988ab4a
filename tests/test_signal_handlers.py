"""What our signal handlers do must be safe to run again in the middle of itself.

Python runs a handler in the main thread between any two bytecodes, the handler's own included, and signals come
in pairs in real stops: a prewarmed rank gets each SIGTERM from the supervisor and again through its proxy, Slurm
signals every process of a step, a user presses Ctrl-C twice. A handler that takes a plain lock can then block
for good on the lock that it interrupted. `threading.Event.set` in the ranks' handler did: a rank hung mid-step
in a SIGHUP stop, the grace ran out, and both ranks were killed without their stop checkpoint (twice in CI).

These tests run the handler's work once for every bytecode it passes through, with a second run injected at that
point as the interpreter would inject it, and require every one to finish.
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable
from types import CodeType

import pytest
from rich.console import Console

from supervisor.console import EventConsole
from train_entry.signals import StopRequest


def blocking_points(make: Callable[[], tuple[Callable[[], None], Callable[[], None]]],
                    only: CodeType | None = None, limit: int = 2000) -> list[int]:
    """For k = 0, 1, …: build a fresh (call, nested) pair, run `call()` and run `nested()` at its k-th bytecode
    (within `only`'s frames, if given), as a signal handler would run there. Returns the k at which that blocked;
    stops when `call` has fewer than k bytecodes."""
    blocked = []
    for k in range(limit):
        finished, bytecodes = _run_nested_at(*make(), k, only)
        if not finished:
            blocked.append(k)
        elif bytecodes <= k:
            return blocked
    raise AssertionError(f"more than {limit} bytecodes")


def _run_nested_at(call: Callable[[], None], nested: Callable[[], None], k: int,
                   only: CodeType | None) -> tuple[bool, int]:
    """Whether `call()` finished within 2 s with `nested()` run at its k-th bytecode; how many it went through."""
    seen = [0]

    def tracer(frame, event, _arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and (only is None or frame.f_code is only):
            if seen[0] == k:
                nested()  # tracing is off inside a trace function: this run is not traced
            seen[0] += 1
        return tracer

    def traced() -> None:
        sys.settrace(tracer)
        try:
            call()
        finally:
            sys.settrace(None)

    t = threading.Thread(target=traced, daemon=True)  # one that blocks is left behind, blocked for good
    t.start()
    t.join(2)
    return not t.is_alive(), seen[0]


def test_the_ranks_stop_request_can_be_set_again_at_any_point_of_its_own_setting():
    def make():
        stop = StopRequest()
        return (lambda: stop.set("SIGTERM")), (lambda: stop.set("SIGTERM"))

    assert blocking_points(make) == []
    stop = StopRequest()
    stop.set("SIGTERM")
    first = stop.at
    stop.set("supervisor gone")
    assert stop and stop.reason == "SIGTERM" and stop.at == first  # the first reason is the one kept


def test_the_supervisors_console_can_speak_from_a_handler_in_the_middle_of_a_line():
    """Ctrl-Z's handler prints an event; the main thread may be printing one, holding the console's lock."""
    def make():
        console = EventConsole("job", Console(file=io.StringIO(), width=200))
        return (lambda: console.event("a line")), (lambda: console.event("suspended"))

    assert blocking_points(make, only=EventConsole._print.__code__) == []


HANGUP = """
import os, signal, sys
from train_entry import signals
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
stop = signals.StopRequest()
signals.install(stop)
os.kill(os.getpid(), signal.SIGHUP)
print(stop.reason)
"""


@pytest.mark.parametrize("start", ["default", "ignored"])
def test_a_hangup_asks_a_rank_to_stop_unless_it_was_started_ignoring_it(start):
    """torchrun passes the signal it got on to its workers: a hung-up torchrun's ranks checkpoint and stop, as
    for SIGTERM, instead of dying of it; under `nohup` the hangup stays ignored."""
    import subprocess

    from tests.proc import child_env

    out = subprocess.run([sys.executable, "-c", HANGUP, start], capture_output=True, text=True, env=child_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("SIGHUP" if start == "default" else "None")
