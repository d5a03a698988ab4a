"""train_entry.dist: let_collective_threads_settle leaves the GIL free until the process's other threads are idle,
and never longer than its limit (a thread that stays busy must not hold up a rank's exit); pick_device refuses a
local rank with no GPU of its own in one sentence."""

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


def test_more_local_ranks_than_visible_gpus_is_a_sentence_before_any_cuda_call(monkeypatch):
    """Review 10: torch.cuda.set_device raised a CUDA RuntimeError first, which the supervisor retried as a crash
    (exit 1, three attempts); a ValueError here is one sentence and exit 78, before any GPU is touched."""
    import pytest
    import torch

    from train_entry.dist import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert pick_device("cuda", 0) == torch.device("cuda", 0) and pick_device("auto", 0) == torch.device("cuda", 0)
    for preference in ("cuda", "auto"):  # auto too: a CPU rank beside GPU ranks would mix backends in one group
        with pytest.raises(ValueError, match=r"local rank 1 needs GPU 1, but this node shows 1 "
                                             r"\(CUDA_VISIBLE_DEVICES=3\): set the job's nproc_per_node to at most 1"):
            pick_device(preference, 1)
    assert pick_device("cpu", 5) == torch.device("cpu")
