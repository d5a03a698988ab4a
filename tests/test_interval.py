"""The auto checkpoint interval: Young/Daly, the MTBF estimate, and the tuner fed by a step log."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from supervisor.interval import COLD_START_STEPS, IntervalTuner, expected_waste, mtbf_estimate, young_daly


def test_young_daly_matches_the_formula_and_minimises_waste():
    c, f, r = 2.0, 3600.0, 30.0
    t = young_daly(c, f, r)
    assert t == pytest.approx(math.sqrt(2 * c * (f + r)) - c)
    around = [expected_waste(t * k, c, f, r) for k in (0.5, 0.8, 1.0, 1.25, 2.0)]
    assert min(around) == around[2]
    assert young_daly(0.0, f) == 0.0 and young_daly(f, f) == f


def test_mtbf_estimate_moves_from_the_prior_with_failures():
    assert mtbf_estimate(600.0, 0.0, 0) == 600.0
    assert mtbf_estimate(600.0, 1800.0, 3) == pytest.approx(600.0)
    assert mtbf_estimate(600.0, 5400.0, 0) == pytest.approx(6000.0)
    # Without a prior: the failure-free time seen so far, as if a failure were due now.
    assert mtbf_estimate(None, 0.0, 0) == 10.0
    assert mtbf_estimate(None, 7200.0, 0) == 7200.0
    assert mtbf_estimate(None, 120.0, 2) == pytest.approx(40.0)


def feed(tuner: IntervalTuner, steps: range, dt: float, t0: float = 0.0) -> float:
    t = t0
    for s in steps:
        t += dt
        tuner.on_step(s, t)
    return t


def test_tuner_cold_start_then_young_daly_with_bounds():
    tuner = IntervalTuner(prior_mtbf_s=200.0, min_steps=5, max_steps=10_000)
    assert tuner.choose(0.0, 0, None).steps == COLD_START_STEPS
    t = feed(tuner, range(1, 51), 0.1)
    tuner.on_save(50, 0.5)
    t = feed(tuner, range(51, 56), 0.1, t + 0.5)  # the save persisted while 5 normal-speed steps ran
    tuner.on_commit(50, 0.4)
    assert tuner.save_cost_s is None  # until the step in progress is logged
    t = feed(tuner, range(56, 57), 0.1, t)
    choice = tuner.choose(observed_s=0.0, failures=0, restart_s=None)
    expected = math.sqrt(2 * 0.5 * 200.0) - 0.5
    assert choice.seconds == pytest.approx(expected) and choice.steps == round(expected / 0.1)
    assert "Young/Daly" in choice.why and choice.mtbf_s == 200.0
    # More failures observed → shorter interval; the lower bound holds.
    assert tuner.choose(observed_s=100.0, failures=10, restart_s=5.0).steps < choice.steps
    tight = IntervalTuner(prior_mtbf_s=1.0, min_steps=40, max_steps=100)
    tight.step_dts.extend([0.1] * 10)
    tight.costs.append(0.01)
    assert tight.choose(0.0, 0, None).steps == 40


def test_slow_steps_during_a_background_save_count_as_save_cost():
    tuner = IntervalTuner(3600.0, 1, 10_000)
    t = feed(tuner, range(1, 21), 0.1)
    tuner.on_save(20, 0.01)
    t = feed(tuner, range(21, 26), 0.3, t + 0.01)  # five steps ran 0.2 s slower while the save persisted
    tuner.on_commit(20, 1.5)
    feed(tuner, range(26, 27), 0.3, t)  # and so did the step in progress when it committed
    assert tuner.save_cost_s == pytest.approx(0.01 + 6 * 0.2) and tuner.measured == 1
    # A save that takes 1.5 s to persist means at least 15 steps between saves.
    assert tuner.choose(0.0, 0, None).steps >= 15


def test_a_save_that_commits_inside_the_next_step_is_charged_that_steps_slowdown():
    """A persist shorter than a step commits while the step after the save runs, and its commit line comes before
    that step's: the save was charged its blocking time alone. On the goodput benchmark (2 CPU ranks, a save
    every 12 steps) that step took 88 ms against 53, and `auto` saw 9 ms of cost a save."""
    tuner = IntervalTuner(3600.0, 1, 10_000)
    t = feed(tuner, range(1, 21), 0.05)
    for step in (20, 32, 44):
        tuner.on_save(step, 0.009)
        tuner.on_commit(step, 0.04)  # committed 40 ms into the next step...
        t = feed(tuner, range(step + 1, step + 2), 0.085, t + 0.009)  # ...which took 35 ms more than a step
        t = feed(tuner, range(step + 2, step + 13), 0.05, t)
    assert tuner.save_cost_s == pytest.approx(0.009 + 0.035) and tuner.measured == 3
    assert tuner.step_s == pytest.approx(0.05)  # the slow steps are the saves', not the pace's


def test_a_moving_interval_counts_from_the_last_save_not_from_multiples():
    """`auto`: when the supervisor moves the interval from 28 to 31 just after a save at 560, the next save is
    at 591, not at 589 (the next multiple of 31, a save 29 steps later) nor, worse, 2 steps after the last.
    A fixed interval keeps the multiples users expect (step_000000050, …)."""
    from train_entry.session import Session

    def session(moves: bool, interval: int, last: int) -> Session:
        s = Session.__new__(Session)
        s.interval, s.interval_moves, s.last_saved_step, s.stop_requested = interval, moves, last, False
        return s

    def saves(s: Session, steps: range) -> list[int]:
        out = []
        for step in steps:
            if s.should_save(step):
                out.append(step)
                s.last_saved_step = step
        return out

    assert saves(session(True, 31, 560), range(561, 700)) == [591, 622, 653, 684]
    assert saves(session(False, 31, 560), range(561, 700)) == [589, 620, 651, 682]
    assert saves(session(True, 50, 4480), range(4481, 4600)) == [4530, 4580]  # from the resume step
    stopping = session(True, 50, 100)
    stopping.stop_requested = True
    assert stopping.should_save(101) and not stopping.should_save(100)  # an agreed stop saves at once


def test_the_jobs_max_interval_wins_and_one_stalled_save_does_not_hold_the_interval_up():
    """One save that persisted for 4 s (a stall) put a floor of 4 s of steps under the interval for the next ten
    saves, above max_interval_steps."""
    tuner = IntervalTuner(3600.0, 1, 30)
    t = feed(tuner, range(1, 21), 0.1)
    tuner.on_save(20, 0.01)
    t = feed(tuner, range(21, 26), 0.1, t)
    tuner.on_commit(20, 4.0)  # 40 steps' worth
    t = feed(tuner, range(26, 27), 0.1, t)
    assert tuner.choose(0.0, 0, None).steps == 30  # the job's max, not 40
    tuner = IntervalTuner(3600.0, 1, 10_000)
    t = feed(tuner, range(1, 21), 0.1)
    for step, persist_s in ((20, 20.0), (30, 0.2), (40, 0.2), (50, 0.2)):  # one stall of 200 steps' worth
        tuner.on_save(step, 0.01)
        t = feed(tuner, range(step + 1, step + 6), 0.1, t)
        tuner.on_commit(step, persist_s)
    assert tuner.choose(0.0, 0, None).steps < 200  # the median persist, not the one stall


def test_a_negative_restart_cost_is_no_cost():
    assert young_daly(0.01, 10.0, -60.0) == young_daly(0.01, 10.0, 0.0)


def test_a_rerun_starts_from_what_the_run_measured_and_ignores_a_damaged_memory():
    """A supervisor restart started the tuner from nothing: the interval went back to the cold start, then flapped
    on the median of one or two saves."""
    tuner = IntervalTuner(prior_mtbf_s=200.0, min_steps=5, max_steps=10_000)
    t = feed(tuner, range(1, 51), 0.1)
    for step in (50, 100, 150):
        tuner.on_save(step, 0.5)
        tuner.on_commit(step, 0.6)
        t = feed(tuner, range(step + 1, step + 51), 0.1, t + 0.5)
    again = IntervalTuner(prior_mtbf_s=200.0, min_steps=5, max_steps=10_000)
    again.restore(json.loads(json.dumps(tuner.memory())))  # through state.json
    assert again.settled and again.save_cost_s == tuner.save_cost_s and again.step_s == pytest.approx(0.1)
    assert again.choose(600.0, 0, None).steps == tuner.choose(600.0, 0, None).steps
    damaged = IntervalTuner(prior_mtbf_s=200.0, min_steps=5, max_steps=10_000)
    damaged.restore({"step_dts": ["x", -1.0, True], "costs": [float("nan")], "persist": 3})
    assert not damaged.step_dts and not damaged.costs and not damaged.persist


def test_the_interval_rises_with_the_save_cost_and_never_divides_by_a_zero_step_time():
    """A cut-off at C = M/2 made a dearer save give a shorter interval; steps faster than the step log's 0.1 ms
    resolution read as 0 s and the choice divided by them (the supervisor would have died)."""
    costs = [i / 1000 for i in range(1, 3000)]
    for restart in (0.0, 100.0):
        t = [young_daly(c, 1.0, restart) for c in costs]
        assert all(b >= a for a, b in itertools.pairwise(t)), restart
        assert all(c <= x <= 1.0 for c, x in zip(costs, t, strict=True) if c <= 1.0)
    tuner = IntervalTuner(3600.0, 1, 10_000)
    tuner.step_dts.extend([0.0] * 10)
    tuner.costs.append(0.01)
    assert tuner.choose(100.0, 0, None).steps == 10_000  # bounded by max_steps, not a ZeroDivisionError


def test_beat_counts_optimizer_steps_and_refuses_a_count_that_goes_back_or_outruns_save(monkeypatch):
    """A repeated step (one beat per micro-batch) adds its loss and marks nothing; a step that goes back, or a save
    below the last step beaten (a micro-batch count in beat()), ends every rank with exit 78 and one sentence (audit 5:
    lost steps and the `auto` interval were skewed without a word). The exit itself, under real torchrun, is
    test_library_e2e's misuse test."""
    from types import SimpleNamespace

    from train_entry import session as session_mod
    from train_entry.session import Session

    said: list[str] = []

    def ended(beater, doing, problem, *, destroy_group):
        said.append(f"cannot {doing}: {problem}")
        raise SystemExit(78)

    monkeypatch.setattr(session_mod, "end_as_config", ended)
    s = Session.__new__(Session)
    s.__init__(SimpleNamespace(), SimpleNamespace(world_size=2, rank=0, is_main=True), SimpleNamespace(),
               SimpleNamespace(raise_if_failed=lambda: None), SimpleNamespace(), interval=10, seed=0, grace_s=1.0)
    s._resumed, s._beat_step, s._mean = True, 4, 0.5
    assert s.beat(4, 1.0) == 0.5 and s.beat(4, 3.0) == 0.5  # micro-batches of step 4: losses added, no new step
    assert s._window_loss == 4.0 and s._window_steps == 0 and s._beat_step == 4
    with pytest.raises(SystemExit):
        s.beat(3, 1.0)
    assert said[-1] == ("cannot run session.beat(): beat(3) came after beat(4): give it the training step, one more "
                        "each optimizer step, the count save() gets")
    with pytest.raises(SystemExit):
        s.save(2, SimpleNamespace())
    assert said[-1].startswith("cannot save step 2: save(2) came after beat(4): beat() and save() must count the same "
                               "steps, the optimizer's")
    s.last_saved_step = 2  # already saved: still refused (audit 19: skipped in silence)
    with pytest.raises(SystemExit):
        s.save(2, SimpleNamespace())
    assert said[-1].startswith("cannot save step 2: save(2) came after beat(4)")
    # Review 9: a float step failed every save in a traceback (retried as a checkpoint failure) and a numpy one
    # every heartbeat write (the rank killed as hung); both are the training step given in the wrong type.
    import numpy as np

    for bad, what in ((5.0, "a float"), (True, "a bool"), (-1, "outside 0..999999999")):
        with pytest.raises(SystemExit):
            s.save(bad, SimpleNamespace())
        assert said[-1] == (f"cannot run session.save(): save({bad!r}): the step is {what}; give it the training step "
                            "as an int (the optimizer steps done)"), said[-1]
    assert s.beat(np.int64(4), 1.0) == 0.5 and type(s._beat_step) is int


def test_the_agreement_is_read_inside_its_window_so_a_wait_there_is_blamed_on_the_others(monkeypatch):
    """Review 10: on NCCL all_reduce only queues the reduction on the GPU's stream, and the wait for the other
    ranks is the first read of its result. That read came after `in_sync=False`: on a GPU no rank was ever seen
    waiting for a hung one, and the wait was counted as the rank's own time. Gloo waits in the call, so this
    pins the order down with a reduction that returns at once."""
    from types import SimpleNamespace

    import torch

    from train_entry import session as session_mod
    from train_entry.session import Session
    from train_entry.signals import StopRequest

    class Beater:
        control_interval, in_sync = None, False

        def update(self, **fields):
            self.in_sync = fields.get("in_sync", self.in_sync)

        def progress(self, step, own_s=None):
            pass

        def note(self, text):
            raise AssertionError(text)

    beater, reads = Beater(), []
    real = torch.Tensor.tolist

    def tolist(t):
        reads.append(beater.in_sync)
        return real(t)

    monkeypatch.setattr(session_mod.dist, "all_reduce", lambda t, **kw: None)  # queued, as NCCL's returns
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: pytest.fail("a read of the result one value at a time"))
    s = Session.__new__(Session)
    s.__init__(SimpleNamespace(), SimpleNamespace(world_size=2, rank=0, is_main=True, device=torch.device("cpu")),
               beater, SimpleNamespace(raise_if_failed=lambda: None), StopRequest(),
               interval=10, seed=0, grace_s=1.0, sync_every=1)
    s._resumed = True
    assert s.beat(1, 2.0) == 2.0 and reads == [True]
    # weight 0 on every rank (a token-weighted loss over padding only): no mean, as the tensor's 0/0 gave, no raise
    assert math.isnan(s.beat(2, 2.0, weight=0.0)) and reads == [True, True]
