"""What `status` says of a run that ends unfinished, through the real supervisor (torchrun replaced by a fake
that leaves what a failed attempt leaves: a step log, a checkpoint, a non-zero exit)."""

from __future__ import annotations

import os
import signal
import threading
import time

from supervisor.protocol import SaveRecord, save_line, step_line
from tests.ckpt_helpers import write_checkpoint
from tests.runs import FakeHandle, state

JOB = "name: demo\nentrypoint:\n  module: train_entry\nnproc_per_node: 2\nrestart: {backoff_s: 60}\n"


def failed_at_27(cfg, spec, handover):
    """Steps 1..27 logged, step 20 checkpointed, then torchrun exits 1: steps 21..27 are not in any checkpoint."""
    t = time.time()
    lines = []
    for s in range(1, 28):
        lines.append(step_line(s, t + 0.01 * s))
        if s == 20:
            lines.append(save_line(SaveRecord(20, t + 0.2, 0.001)))
    spec.step_log.write_text("".join(lines))
    write_checkpoint(cfg.checkpoint.dir, 20)
    return FakeHandle(spec.logs_dir / "torchrun.log", rc=1)


def test_a_stop_during_the_backoff_counts_no_restart_and_charges_the_unsaved_steps(tmp_path, cli, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    run_dir = tmp_path / "run"
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: failed_at_27)

    def stop_in_backoff():  # SIGTERM to ourselves once the supervisor waits out its backoff (its handler is ours)
        deadline = time.monotonic() + 60
        while state(run_dir).get("state") != "restarting" and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=stop_in_backoff, daemon=True)
    killer.start()
    r = cli("run", job, "--run-dir", run_dir)
    killer.join(10)
    assert r.exit_code == 143, r.output
    assert "restart 1/" in r.output  # announced, then stopped before it happened
    doc = state(run_dir)
    assert doc["state"] == "stopped" and doc["attempt"] == 1 and doc["restarts"] == 0, doc
    assert doc["history"][0]["lost_steps"] == 7
    assert doc["accounting"]["summary"]["lost_steps"] == 7


def test_status_parts_add_up_to_the_wall_time(tmp_path):
    from supervisor.goodput import Accounting

    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 1.0, None)
    for s in range(1, 101):  # steps 1..100 at 0.1 s from t=5; saves block 0.05 at 50, 100
        acc.step(s, 5.0 + 0.1 * s)
        if s in (50, 100):
            acc.save(s, 0.05)
    acc.stalled(8.0, 9.0)  # a hang detected at 9.0; the ranks then ran to 100 and saved it
    acc.end(16.0)
    acc.launch(2, 17.0, 100)
    for s in range(101, 131):
        acc.step(s, 20.0 + 0.1 * (s - 100))
        if s == 120:
            acc.save(s, 0.05)
    acc.end(24.0)  # failed at 130: 121..130 unsaved
    acc.settle(120)
    acc.end_session(25.0)
    s = acc.summary(25.0)
    assert s["stalled_s"] == 1.0 and s["lost_steps"] == 10
    a1 = acc.attempts[0]
    assert a1.useful_s == pytest_approx(9.9 - 1.0 - 0.05)  # the stop save of step 100 is in the tail
    parts = sum(s[k] for k in ("startup_s", "useful_s", "checkpoint_blocking_s", "stalled_s", "lost_s", "tail_s",
                               "down_s"))
    assert parts == pytest_approx(24.0 - 1.0)  # the supervisor's own start (0 → 1) and finish (24 → 25) aside


def pytest_approx(v):
    import pytest

    return pytest.approx(v, abs=1e-6)


def test_a_hang_is_booked_as_hung_wherever_it_fell_and_the_parts_still_add_up():
    """Audit 16: the same 20 s hang was `hung` when the continued ranks stepped on and saved, `tail` when they did
    not, and part of the lost steps' time when the stop that followed was outlasted."""
    from supervisor.goodput import Accounting

    def run(stall: tuple[float, float], end: float, resumed: int) -> dict:
        acc = Accounting()
        acc.start_session(0.0)
        acc.launch(1, 0.0, None)
        for s in range(1, 101):  # steps 1..100 at 0.1 s from t=1; step 50 saved
            acc.step(s, 1.0 + 0.1 * s)
            if s == 50:
                acc.save(s, 0.0)
        acc.stalled(*stall)
        acc.end(end)
        acc.settle(resumed)
        acc.end_session(end)
        s = acc.summary(end)
        assert parts(s) == pytest_approx(end), s
        return s

    # silent from the last step (11.0) until caught at 31.0, ended at 33.0 with no stop checkpoint: was all tail
    s = run((11.0, 31.0), 33.0, resumed=50)
    assert s["stalled_s"] == pytest_approx(20.0) and s["tail_s"] == pytest_approx(2.0) and s["lost_steps"] == 50
    assert s["lost_s"] == pytest_approx(5.0)  # steps 51..100, their own time
    # a hang inside the lost steps (between 8.0 and 9.0, the stop outlasted after): out of the lost steps' time
    s = run((8.0, 9.0), 12.0, resumed=50)
    assert s["stalled_s"] == pytest_approx(1.0) and s["lost_s"] == pytest_approx(4.0) and s["tail_s"] == \
        pytest_approx(1.0)


def test_the_running_attempts_time_since_its_last_step_is_shown_so_the_parts_add_up_at_every_moment():
    """Audit 16: while a hang was not yet detected the parts fell up to 20 s short of the wall time."""
    from supervisor.timeline import summary_line

    acc = ten_steps()
    s = acc.summary(20.0)  # silent since 2.0
    assert s["open_s"] == pytest_approx(18.0)
    assert s["startup_s"] + s["useful_s"] + s["open_s"] == pytest_approx(20.0)
    assert summary_line(s).endswith(", since the last step 18.0s")
    acc.end(21.0)
    assert acc.summary(21.0)["open_s"] == 0.0 and "since the last step" not in summary_line(acc.summary(21.0))


def test_a_backoff_under_way_is_down_time_as_it_grows():
    """Audit 17: the backoff was booked only at the next launch; until then the parts fell short by it."""
    acc = ten_steps()
    acc.end(2.5)
    acc.settle(None)
    acc.in_backoff = True
    s = acc.summary(12.5)
    assert s["down_s"] == pytest_approx(10.0) and parts(s) == pytest_approx(12.5), s
    acc.launch(2, 14.0, None)  # booked for good once, not twice
    assert not acc.in_backoff and acc.summary(14.0)["down_s"] == pytest_approx(11.5)


def test_lost_steps_past_a_save_no_step_log_showed_are_charged_at_the_attempts_pace():
    """Audit 17: the ranks of a killed supervisor committed step 200 after it died; the 1 step past it was charged
    the whole attempt's training (15 s, goodput 18.8%)."""
    from supervisor.goodput import Accounting

    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, 150)
    for s in range(151, 191):  # 0.1 s a step; the supervisor saw up to 190 and no save of 200
        acc.step(s, 1.0 + 0.1 * (s - 150))
    acc.ranks_went_on(1, 201)
    acc.end(6.0)
    acc.settle(200)
    s = acc.summary(6.0)
    assert s["lost_steps"] == 1 and s["lost_s"] == pytest_approx(0.1), s


def ten_steps():
    """A session from 0.0 whose attempt 1 (launched at 0.0) ran steps 1..10, one each 0.1 s from 1.1."""
    from supervisor.goodput import Accounting

    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    for s in range(1, 11):
        acc.step(s, 1.0 + 0.1 * s)
    return acc


def parts(summary: dict) -> float:
    """The goodput parts, which add up to the wall time but for the supervisor's own start and finish."""
    return sum(summary[k] for k in ("startup_s", "useful_s", "checkpoint_blocking_s", "stalled_s", "lost_s", "tail_s",
                                    "down_s", "open_s"))


def test_a_backoff_is_down_time_also_when_the_supervisor_dies_in_it_or_the_run_ends_there():
    """Review 15: booked only at the launch, a backoff the supervisor died in, or one the run ended in, was lost."""
    from supervisor.goodput import Accounting

    acc = ten_steps()
    acc.end(2.5)
    acc.settle(None)
    acc.in_backoff = True
    died = Accounting.from_dict(acc.to_dict(), last_seen=12.5)  # killed at 12.5, in the backoff
    assert died.summary(12.5)["down_s"] == pytest_approx(10.0) and parts(died.summary(12.5)) == pytest_approx(12.5)
    acc.end_session(13.0)  # the run ends there (nothing left to choose)
    assert acc.summary(13.0)["down_s"] == pytest_approx(10.5) and parts(acc.summary(13.0)) == pytest_approx(13.0)
