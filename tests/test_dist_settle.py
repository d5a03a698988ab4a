"""train_entry.dist.let_collective_threads_settle: the GIL is left free until the process's other threads are idle,
and never longer than its limit (a thread that stays busy must not hold up a rank's exit)."""

from __future__ import annotations

import threading
import time

from train_entry.dist import let_collective_threads_settle


def spinning(seconds: float, stop: threading.Event | None = None) -> threading.Thread:
    """A thread that keeps a CPU busy (state R) for `seconds` or until `stop`, in Python, so it needs the GIL too."""
    def spin() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (stop and stop.is_set()):
            pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    return t


def timed(**kwargs: float) -> float:
    started = time.monotonic()
    let_collective_threads_settle(**kwargs)
    return time.monotonic() - started


def test_it_waits_for_a_busy_thread_to_go_idle_and_no_longer():
    started = time.monotonic()  # before the thread, whose 0.3 s may begin before a clock read after its start
    t = spinning(0.3)
    let_collective_threads_settle(limit_s=5.0)
    took = time.monotonic() - started
    assert not t.is_alive(), "it returned while the thread still ran"
    assert 0.3 <= took < 4.0, took


def test_a_thread_that_stays_busy_holds_it_up_only_to_its_limit():
    stop = threading.Event()
    t = spinning(60.0, stop)
    took = timed(limit_s=0.3)
    alive = t.is_alive()
    stop.set()
    t.join()
    assert alive and 0.3 <= took < 5.0, took


def test_with_nothing_running_it_returns_after_two_quiet_looks():
    assert timed(limit_s=5.0, poll_s=0.01) < 1.0
