"""Goodput accounting on scripted event streams with known answers."""

from __future__ import annotations

import pytest

from supervisor.goodput import Accounting


def run_steps(acc: Accounting, first: int, last: int, t0: float, dt: float, saves: dict[int, float]) -> None:
    for s in range(first, last + 1):
        acc.step(s, t0 + dt * (s - first + 1))
        if s in saves:
            acc.save(s, saves[s])


def test_one_failure_then_finish():
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    run_steps(acc, 1, 30, 5.0, 0.1, {10: 0.05, 20: 0.05})  # step 1 at 5.1 ... step 30 at 8.0
    acc.end(8.5)  # failed: 0.5 s to notice and stop
    acc.launch(2, 9.5, 20)  # resumes from 20: steps 21..30 were lost
    run_steps(acc, 21, 50, 13.0, 0.1, {30: 0.05, 40: 0.05, 50: 0.05})  # step 21 at 13.1 ... step 50 at 16.0
    acc.end(16.2)
    acc.end_session(16.5)
    a1, a2 = acc.attempts
    assert a1.lost_steps == 10 and a1.lost_s == pytest.approx(1.0)
    assert a1.startup_s == pytest.approx(5.1) and a1.train_s == pytest.approx(2.9)
    assert a1.useful_s == pytest.approx(2.9 - 1.0 - 0.1)
    assert a1.tail_s == pytest.approx(0.5)
    # The final save (step 50) blocks after the last step: it is part of the tail, not of training.
    assert a2.startup_s == pytest.approx(3.6) and a2.useful_s == pytest.approx(2.9 - 0.10)
    s = acc.summary(100.0)  # the session ended: `now` no longer counts
    assert s["wall_s"] == pytest.approx(16.5) and s["down_s"] == pytest.approx(1.0)
    assert s["lost_steps"] == 10 and s["useful_s"] == pytest.approx(4.60)
    assert s["goodput"] == pytest.approx(4.60 / 16.5, abs=1e-3)
    parts = s["startup_s"] + s["train_s"] + s["tail_s"] + s["down_s"]
    assert parts == pytest.approx(16.2)  # the rest is the supervisor's own start and finish


def test_loss_counts_only_steps_beyond_the_resume_point_and_survives_a_reload():
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, 40)
    run_steps(acc, 41, 55, 2.0, 1.0, {50: 0.2})
    acc.end(20.0)
    # The supervisor was killed (its session never ended; it last wrote its state at t=21), then rerun.
    restored = Accounting.from_dict(acc.to_dict(), last_seen=21.0)
    restored.start_session(30.0)
    restored.launch(2, 30.0, 50)
    a1 = restored.attempts[0]
    assert a1.lost_steps == 5 and a1.lost_s == pytest.approx(5.0) and a1.lost_blocking_s == 0.0
    assert restored.summary(35.0)["wall_s"] == pytest.approx(21.0 + 5.0)


def test_steps_the_ranks_trained_after_their_supervisor_died_are_charged_when_lost():
    """Audit 13: killed at step 348 (its last word), its ranks logged 350 before torchrun's SIGTERM reached them;
    the rerun resumed from 260 and charged 88 steps, not 90. The times stay the dead supervisor's."""
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, 200)
    run_steps(acc, 201, 348, 1.0, 0.1, {220: 0.0, 240: 0.0, 260: 0.0})
    restored = Accounting.from_dict(acc.to_dict(), last_seen=16.0)
    restored.ranks_went_on(2, 350)  # another attempt's: nothing
    restored.ranks_went_on(1, 340)  # below what it saw: nothing
    assert restored.attempts[0].last_step == 348
    restored.ranks_went_on(1, 350)
    restored.start_session(30.0)
    restored.launch(2, 30.0, 260)
    a1 = restored.attempts[0]
    assert a1.lost_steps == 90 and a1.last_step_at == pytest.approx(1.0 + 0.1 * 148)


def test_rollback_below_the_attempts_start_loses_all_of_it():
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, 40)
    run_steps(acc, 41, 60, 2.0, 1.0, {50: 0.1, 60: 0.1})
    acc.end(25.0)
    acc.launch(2, 26.0, 20)  # a NaN rollback to step 20
    a1 = acc.attempts[0]
    assert a1.lost_steps == 20 and a1.lost_s == pytest.approx(a1.train_s)
    assert a1.lost_blocking_s == pytest.approx(0.2) and a1.useful_s == 0.0


def test_a_slow_stop_save_after_the_last_step_does_not_eat_training_time():
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    run_steps(acc, 1, 100, 5.0, 0.1, {50: 0.05, 100: 12.0})  # 9.9 s of training, then a 12 s stop save
    acc.end(20.0)
    a = acc.attempts[0]
    assert a.useful_s == pytest.approx(9.9 - 0.05)


def test_a_stop_that_checkpoints_loses_nothing():
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    run_steps(acc, 1, 33, 1.0, 0.5, {10: 0.1, 20: 0.1, 30: 0.1, 33: 1.0})
    acc.end(20.0)
    acc.end_session(20.5)
    acc.start_session(100.0)
    acc.launch(2, 100.0, 33)
    assert acc.attempts[0].lost_steps == 0
    s = acc.summary(100.0)
    assert s["wall_s"] == pytest.approx(20.5) and s["down_s"] == 0.0


def test_a_restart_cost_is_measured_only_where_one_supervisor_saw_the_failure_and_the_relaunch():
    """A stop, then a rerun an hour later: that hour is no restart cost (it set the interval tuner's R to it for
    the rest of the run). A clock stepped back gives no negative cost."""
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    acc.step(1, 2.0)
    acc.step(50, 10.0)
    acc.end(11.0)
    acc.launch(2, 11.5, None)  # relaunched by the same supervisor: 10 → 13 is the restart
    acc.step(1, 13.0)
    acc.step(30, 20.0)
    acc.end(21.0)
    acc.end_session(21.0)
    acc.start_session(3621.0)  # `resilient run` again, an hour later
    acc.launch(3, 3621.0, None)
    acc.step(1, 3624.0)
    assert acc.restart_costs() == [pytest.approx(3.0)]
    acc.end(3630.0)
    acc.launch(4, 3630.5, None)
    acc.step(1, 3620.0)  # the clock stepped back
    assert acc.restart_costs() == [pytest.approx(3.0), 0.0]
    restored = Accounting.from_dict(acc.to_dict())
    assert restored.restart_costs() == acc.restart_costs()


def test_a_rollback_past_the_last_attempts_start_charges_the_older_attempts_too():
    """Attempt 1 ran to 127 (saves at 50 and 100) and was killed; attempt 2 resumed from 100 and hit a NaN at 139;
    attempt 3 rolled back to 50. Steps 51-100 of attempt 1 are redone too: 77 + 39 lost, not 27 + 39."""
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    run_steps(acc, 1, 127, 1.0, 0.1, {50: 0.0, 100: 0.0})
    acc.end(15.0)
    acc.launch(2, 16.0, 100)
    assert acc.summary(16.0)["lost_steps"] == 27
    run_steps(acc, 101, 139, 17.0, 0.1, {120: 0.0})
    acc.end(22.0)
    acc.launch(3, 23.0, 50)
    assert [a.lost_steps for a in acc.attempts[:2]] == [77, 39] and acc.summary(23.0)["lost_steps"] == 116
    acc.resumed(120)  # the ranks found a newer copy after all: attempt 1 keeps up to 100, attempt 2 up to 120
    assert [a.lost_steps for a in acc.attempts[:2]] == [27, 19]


def test_the_benchmarks_save_cost_counts_the_step_in_progress_at_the_commit():
    """bench/goodput/analyze.py charges a background save the slowdown of the steps beside its persist; one that
    commits inside the next step (its commit line before that step's) was charged its blocking time alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "goodput"))
    try:
        import analyze
    finally:
        sys.path.pop(0)
    seg, t = [], 0.0
    for step in range(1, 40):
        t += 0.05 + (0.009 + 0.035 if step in (13, 25) else 0.0)  # the step after each save: blocking + 35 ms
        seg.append({"step": step, "t": t})
        if step in (12, 24, 36):
            seg += [{"save": step, "blocking_s": 0.009}, {"commit": step, "t": t + 0.04}]
    blocking, effective = analyze.save_costs([seg], final_step=39, base_s=0.05)
    assert blocking == [0.009] * 3
    assert effective == pytest.approx([0.009 + 0.035, 0.009 + 0.035, 0.009])


def test_a_stop_in_the_backoff_books_the_backoff_as_down_time():
    """Audit 8: a stop 7 s into a 10 s backoff left those 7 s in no part: the parts no longer added up to the wall."""
    acc = Accounting()
    acc.start_session(0.0)
    acc.launch(1, 0.0, None)
    run_steps(acc, 1, 29, 2.5, 0.1, {20: 0.0})
    acc.end(5.5)  # a rank killed at step 29
    acc.settle(20)  # what status shows during the backoff
    assert acc.summary(6.0)["lost_steps"] == 9
    acc.down_until(12.5)  # the stop, 7 s into the backoff
    acc.end_session(12.6)
    s = acc.summary(13.0)
    assert s["down_s"] == pytest.approx(7.0) and s["lost_steps"] == 9
    parts = s["startup_s"] + s["train_s"] + s["tail_s"] + s["down_s"]
    assert parts == pytest.approx(12.5)  # the rest (0.1 s) is the supervisor's own finish
    acc.start_session(100.0)  # a rerun: the backoff was booked already, the hours between sessions are not down
    acc.down_until(101.0)
    acc.launch(2, 101.0, 20)
    assert acc.down_s == pytest.approx(7.0)


@pytest.mark.slow
def test_the_goodput_benchmark_runs_a_resilient_phase_to_its_end(tmp_path):
    """Audit 14: every README goodput command failed at once: the benchmark made a `tmp` folder in each phase's
    run dir, and `resilient run` refuses a run dir holding things that are not a run's. One phase, for real."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench" / "goodput"
    before = set(sys.modules)
    sys.path.insert(0, str(bench))
    try:
        import run as goodput_run
    finally:
        sys.path.pop(0)
        for name in set(sys.modules) - before:  # `run`, `faults`, `analyze`: names too plain to leave behind
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(bench)):
                del sys.modules[name]
    args = goodput_run.parse_args(["--systems", "a", "--ideal-steps", "20", "--out", str(tmp_path / "gp")])
    run_dir = args.out / "ideal-ft"
    observed = goodput_run.run_phase("ideal-ft", goodput_run.phase_launch("ideal-ft", args, run_dir), run_dir, [],
                                     args.ideal_steps, cap_s=120.0)
    said = (run_dir / "launcher.log").read_text()
    assert observed["finished"] and observed["exit_code"] == 0 and not observed["timed_out"], said[-3000:]
    assert observed["self_report"]["restarts"] == 0 and observed["survivors"] == [], observed
