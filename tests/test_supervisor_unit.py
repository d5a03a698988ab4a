"""The supervisor's logic without processes: classification, policy, hang rules (injected time), the argv."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest

from supervisor import api, classify, state
from supervisor.config import RestartConfig
from supervisor.launch import torchrun_argv
from supervisor.policy import LoadFailure, RestartPolicy
from supervisor.protocol import EXIT_CHECKPOINT_LOAD, EXIT_NAN, EXIT_PREEMPTED, Handover, Heartbeat, write_heartbeat
from supervisor.state import RunState
from supervisor.watch import NO_HEARTBEAT, NO_PROGRESS, SAVE_TOO_LONG, SILENT, STARTUP, RankWatch, verdict
from tests.proc import child_env
from tests.runs import FakeHandle

SUMMARY = """\
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:44741: Connection reset by peer.
============================================================
train_entry FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_00:44:08
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 15575)
  error_file: {error_file}
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_00:44:08
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 15576){sig}
  error_file: {root_error}
  traceback : {traceback}
============================================================
"""


def summary(rank=1, code=-9, sig="  (SIGKILL)", traceback="Signal 9 (SIGKILL) received by PID 15576",
            error_file="<N/A>", root_error="<N/A>") -> str:
    return SUMMARY.format(rank=rank, code=code, sig=sig, traceback=traceback, error_file=error_file,
                          root_error=root_error)


def hb(rank=0, **kw) -> Heartbeat:
    if kw.get("phase") == "train":
        kw.setdefault("first_step_at", 1.0)  # a training rank has done a step, unless a test says otherwise
    return Heartbeat(rank=rank, pid=1000 + rank, **kw)


def error_json(tmp_path: Path, message: str) -> str:
    p = tmp_path / "error.json"
    p.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "..."}}}))
    return str(p)


def test_parse_summary_finds_the_root_cause():
    root, failures = classify.parse_summary(summary())
    assert (root.rank, root.exit_code, root.pid, root.error_file) == (1, -9, 15576, None)
    assert [f.rank for f in failures] == [0, 1]


def test_a_long_last_log_line_is_cut_at_a_word_and_says_so():
    """A refusal's sentence was cut at 300 characters in the middle of a word ("... as a para")."""
    sentence = "cannot train: " + " ".join(f"word{i}" for i in range(150)) + " (exit 78)"
    detail = classify._last_line("earlier line\n" + sentence + "\n")
    assert detail.endswith(" …") and len(detail) <= classify.DETAIL_CHARS + 2
    assert sentence.startswith(detail[:-2]) and sentence[len(detail) - 2] == " "  # ends at a whole word
    assert classify._last_line("short\n") == "short"
    # the library's log prefix: the detail names the rank already (audit 12: a timestamp and the rank twice)
    assert classify._last_line("23:30:42 [rank 1] ERROR cannot run session.beat(): x\n") == \
        "cannot run session.beat(): x"


def test_torchrun_finding_no_gpu_for_nproc_gpu_is_a_configuration_error_not_retried():
    """Audit 6: `nproc_per_node: gpu` on a node without CUDA was relaunched until the restart budget ran out."""
    text = "Traceback (most recent call last):\n  ...\nValueError: Cuda is not available.\n"
    out = classify.classify(1, text, {})
    assert out.reason == api.CONFIG and not out.retryable and "set nproc_per_node to a number" in out.detail


@pytest.mark.parametrize("case, expect_reason, expect_rank", [
    ("peer", api.NODE_LOST, 1),
    ("sigkill", api.WORKER_SIGNAL, 1),
    ("preempted", api.PREEMPTED, 1),
    ("nan", api.NAN, 1),
    ("collective", api.COLLECTIVE_TIMEOUT, 1),
    ("oom", api.OOM, 1),
    ("import", api.CONFIG, 1),
    ("indent", api.CONFIG, 1),  # SyntaxError's subclasses print their own names (audit 12: retried 3 times)
    ("exception", api.WORKER_EXIT, 1),
    ("disk", api.CHECKPOINT_FAILED, 1),
])
def test_classify(tmp_path, case, expect_reason, expect_rank):
    hbs = {0: hb(0, step=57, first_step_at=1.0), 1: hb(1, step=57, first_step_at=1.0)}
    err = {
        "collective": "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv",
        "oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "exception": "ValueError: shapes do not match",
        "disk": "CheckpointError: checkpoint save failed: [Errno 28] No space left on device",
        "import": "ModuleNotFoundError: No module named 'flash_attn'",
        "indent": "IndentationError: expected an indented block after 'if' statement on line 2",
        "peer": "RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:2951",
    }
    if case in ("import", "indent"):
        hbs = {0: hb(0), 1: hb(1)}  # never trained
    text = {
        "sigkill": summary(),
        "preempted": summary(code=EXIT_PREEMPTED, sig="", traceback="..."),
        "nan": summary(code=EXIT_NAN, sig="", traceback="..."),
    }.get(case) or summary(code=1, sig="", traceback="...", root_error=error_json(tmp_path, err[case]))
    out = classify.classify(1, text, hbs)
    assert (out.reason, out.failed_rank) == (expect_reason, expect_rank), out
    assert out.step == 57 or case in ("import", "indent")


def test_a_rank_that_dies_in_teardown_after_its_exit_keeps_its_own_word():
    """gloo can abort a process in the interpreter's teardown (SIGABRT, "terminate called without an active
    exception") after the rank's exit call: a rank whose last heartbeat gives its exit code is judged by it (it was
    a failed attempt, relaunched, when rank 1 died so after finishing; tests saw it after exit 78 too)."""
    text = summary(code=-6, sig="  (SIGABRT)", traceback="Signal 6 (SIGABRT) received by PID 15576")
    text = text.replace("exitcode  : 1 (pid: 15575)", "exitcode  : 0 (pid: 15575)")
    finished = {r: hb(r, step=60, phase="exited", exit_code=0, exit_reason="finished") for r in (0, 1)}
    out = classify.classify(1, text, finished)
    assert (out.reason, out.exit_code, out.step) == (api.FINISHED, 0, 60), out
    assert "rank 1 (SIGABRT) then died in Python's teardown" in out.detail
    config = {0: hb(0, step=3, phase="exited", exit_code=78, exit_reason="config"),
              1: hb(1, step=3, phase="exited", exit_code=78, exit_reason="config")}
    assert classify.classify(1, text, config).reason == api.CONFIG
    # A rank killed while it still ran (no exit code in its last heartbeat) is the failure it always was.
    running = {0: hb(0, step=60, phase="exited", exit_code=0), 1: hb(1, step=57, phase="train")}
    assert classify.classify(1, text, running).reason == api.WORKER_SIGNAL
    # One that finished and died so is not the cause of another's real failure (rank 0 exited 1)...
    failed = text.replace("exitcode  : 0 (pid: 15575)", "exitcode  : 1 (pid: 15575)")
    out = classify.classify(1, failed, {**finished, 0: hb(0, step=60, phase="exited", exit_code=1)})
    assert (out.reason, out.failed_rank, out.exit_code) == (api.WORKER_EXIT, 0, 1), out
    # ...and an attempt is not finished while a rank torchrun did not list (it killed it) had not finished.
    alone = text.replace("  rank      : 0 (local_rank: 0)\n  exitcode  : 0 (pid: 15575)",
                         "  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 15576)")
    out = classify.classify(1, alone, {1: finished[1], 0: hb(0, step=60, phase="save")})
    assert out.reason != api.FINISHED, out


def test_classify_prefers_the_killed_rank_over_its_collateral(tmp_path):
    # torchrun saw rank 0's "connection reset" first; the SIGKILLed rank 1 is the real cause.
    text = summary(rank=0, code=1, sig="", traceback="...",
                   root_error=error_json(tmp_path, "RuntimeError: Connection reset by peer"))
    text = text.replace("rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 15575)",
                        "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 15576)")
    out = classify.classify(1, text, {0: hb(0), 1: hb(1)})
    assert (out.reason, out.failed_rank) == (api.WORKER_SIGNAL, 1)


def test_classify_prefers_a_ranks_own_error_over_the_peer_it_took_down(tmp_path):
    """Audit 8: rank 1 raised a RuntimeError; rank 0 failed 46 ms later with "Connection closed by peer", and torchrun
    named rank 0 as the root cause: every attempt was reported as node_lost on one node, with rank 0's log."""
    text = summary(rank=0, code=1, sig="", traceback="...",
                   root_error=error_json(tmp_path, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:2951"))
    text = text.replace("rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 15575)",
                        "rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 15575)")
    hbs = {0: hb(0, step=30, phase="exited", exit_code=1, time=10.046,
                 exit_reason="RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:2951"),
           1: hb(1, step=30, phase="exited", exit_code=1, time=10.0,
                 exit_reason="RuntimeError: crash 30 steps after resume, at step 30")}
    out = classify.classify(1, text, hbs, rank_log={1: "RuntimeError: crash 30 steps after resume, at step 30\n"})
    assert (out.reason, out.failed_rank) == (api.WORKER_EXIT, 1), out
    assert "crash 30 steps after resume" in out.detail, out.detail
    # Every rank here lost a peer: another node went away, as before.
    lost = {r: hb(r, step=30, phase="exited", exit_code=1, exit_reason="RuntimeError: Connection closed by peer")
            for r in (0, 1)}
    assert classify.classify(1, text, lost).reason == api.NODE_LOST


def test_classify_without_a_summary():
    assert classify.classify(0, "", {}).reason == api.FINISHED
    assert classify.classify(-9, "", {}).reason == api.LAUNCHER_DIED
    said = {0: hb(0, exit_code=EXIT_NAN, exit_reason="nan", time=5.0, step=119)}
    assert classify.classify(1, "", said).reason == api.NAN
    said = {0: hb(0, exit_code=EXIT_NAN, exit_reason="nan at step 120", time=5.0, step=119)}
    assert "non-finite loss at step 120" in classify.classify(1, "", said).detail  # it said "near step 119"
    said = {0: hb(0, exit_code=EXIT_PREEMPTED, exit_reason="preempted", time=5.0)}
    out = classify.classify(1, "", said)  # perhaps another node's SIGTERM: it said "was preempted (SIGTERM)"
    assert out.reason == api.PREEMPTED and "a stop that reached the group (a SIGTERM, to this node or another)" \
        in out.detail
    assert classify.classify(1, "torch.distributed.DistStoreError: wait timeout", {}).reason == api.RENDEZVOUS
    closed = "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
    assert classify.classify(1, closed, {0: hb(0)}).reason == api.RENDEZVOUS
    trained = {0: hb(0, first_step_at=1.0, step=9)}
    assert classify.classify(1, "RendezvousConnectionError: failed to recv", trained).reason == api.NODE_LOST
    assert classify.classify(1, "/usr/bin/python: can't open file 'x.py'", {}).reason == api.CONFIG
    assert classify.classify(-9, "", {}, oom_killed=True).reason == api.LAUNCHER_DIED
    oom = classify.classify(1, summary(), {1: hb(1)}, oom_killed=True)
    assert oom.reason == api.OOM


def outcome(reason=api.WORKER_SIGNAL, step=30):
    return api.AttemptOutcome(reason, "detail", 1, -9, step)


def test_policy_backoff_doubles_without_progress_and_budget_ends():
    p = RestartPolicy(RestartConfig(max_restarts=4, backoff_s=1, max_backoff_s=3, crash_loop_attempts=10))
    waits = [p.decide(outcome(), progressed=False, newest_valid=10, older_valid=None).wait_s for _ in range(4)]
    assert waits == [1, 2, 3, 3]
    last = p.decide(outcome(), progressed=False, newest_valid=10, older_valid=None)
    assert not last.relaunch and last.final_state is RunState.FAILED and "budget is spent (4/4" in last.message
    p = RestartPolicy(RestartConfig(max_restarts=9, backoff_s=1, max_backoff_s=60))
    p.decide(outcome(), progressed=False, newest_valid=10, older_valid=None)
    assert p.decide(outcome(), progressed=True, newest_valid=20, older_valid=10).wait_s == 1


def test_policy_crash_loop_names_the_step():
    p = RestartPolicy(RestartConfig(crash_loop_attempts=3, backoff_s=0))
    assert p.decide(outcome(step=30), progressed=True, newest_valid=20, older_valid=None).relaunch
    assert p.decide(outcome(step=30), progressed=False, newest_valid=20, older_valid=None).relaunch
    assert p.decide(outcome(step=30), progressed=False, newest_valid=20, older_valid=None).relaunch
    d = p.decide(outcome(step=30), progressed=False, newest_valid=20, older_valid=None)
    assert not d.relaunch and "crash loop: 3 consecutive attempts" in d.message and "at step 30" in d.message
    p = RestartPolicy(RestartConfig(crash_loop_attempts=1, backoff_s=0))  # no step at all: said, not an empty list
    d = p.decide(outcome(step=None), progressed=False, newest_valid=None, older_valid=None)
    assert "failing before their first step (" in d.message, d.message


def test_policy_a_stop_from_elsewhere_relaunches_without_spending_the_budget_but_not_forever():
    """Another node's stop (its ranks told the group, every rank here exited 75) is a change of membership, as
    torchrun counts it: a healthy node that hears of ten preemptions over a week must not spend ten restarts."""
    p = RestartPolicy(RestartConfig(max_restarts=1, backoff_s=1, crash_loop_attempts=3))
    for _ in range(5):
        d = p.decide(outcome(api.PREEMPTED), progressed=True, newest_valid=40, older_valid=20)
        assert d.relaunch and not d.counts_as_restart and d.wait_s == 1, d
        assert "not counted (0/1 restarts used)" in d.message, d.message
    assert p.restarts == 0
    assert p.decide(outcome(), progressed=True, newest_valid=60, older_valid=40).message.startswith("restart 1/1")
    # Stops that keep coming before any new checkpoint are still a crash loop.
    assert p.decide(outcome(api.PREEMPTED), progressed=False, newest_valid=60, older_valid=40).relaunch
    assert p.decide(outcome(api.PREEMPTED), progressed=False, newest_valid=60, older_valid=40).relaunch
    d = p.decide(outcome(api.PREEMPTED), progressed=False, newest_valid=60, older_valid=40)
    assert not d.relaunch and "crash loop: 3 consecutive attempts" in d.message, d.message


def test_policy_rendezvous_failures_retry_without_spending_the_budget():
    p = RestartPolicy(RestartConfig(max_restarts=1, backoff_s=5), rendezvous_s=30)
    rdzv = api.AttemptOutcome(api.RENDEZVOUS, "store closed")
    for now in (0.0, 10.0, 29.0):
        d = p.decide_rendezvous(rdzv, now)
        assert d.relaunch and not d.counts_as_restart and d.wait_s == 2.0
    assert p.restarts == 0
    assert not p.decide_rendezvous(rdzv, 31.0).relaunch
    p.decide(outcome(), progressed=True, newest_valid=10, older_valid=None)  # a real attempt resets the window
    assert p.rendezvous_since is None and p.decide_rendezvous(rdzv, 100.0).relaunch


def test_policy_a_launch_that_waited_out_the_join_timeout_has_used_the_rendezvous_window():
    """A node that never arrives: the first torchrun waits join_timeout in its rendezvous and fails. The window
    began at that launch, so the others give up after about join_timeout (a reviewer's Slurm job: 60 s held the
    survivor about 2 minutes when the window began at the failure)."""
    rdzv = api.AttemptOutcome(api.RENDEZVOUS, "RendezvousTimeoutError")
    p = RestartPolicy(RestartConfig(), rendezvous_s=60)
    d = p.decide_rendezvous(rdzv, 1061.0, began=1000.0)
    assert not d.relaunch and "formed in 61s since the first launch that failed (join_timeout 60s)" in d.message, \
        d.message
    p = RestartPolicy(RestartConfig(), rendezvous_s=60)  # a store that vanished fails fast: retried within the window
    assert p.decide_rendezvous(rdzv, 1002.0, began=1000.0).relaunch
    assert p.decide_rendezvous(rdzv, 1050.0, began=1045.0).relaunch
    assert not p.decide_rendezvous(rdzv, 1062.0, began=1055.0).relaunch  # counted from the first launch, at 1000


def test_policy_nan_rolls_back_once_and_config_stops_at_once():
    p = RestartPolicy(RestartConfig(backoff_s=0))
    d = p.decide(outcome(api.NAN), progressed=True, newest_valid=40, older_valid=20)
    assert d.relaunch and d.resume_below == 40 and d.message.endswith(", rolling back below step 40")
    # Review 13: the rollback held for one relaunch; any later one chose step 40 again by its number. It is set
    # aside once an older one loads, as a checkpoint that failed to load twice is.
    assert (d.quarantine_step, d.quarantine_once_older_loads) == (40, True) and "non-finite" in d.quarantine
    d = p.decide(outcome(api.NAN), progressed=False, newest_valid=40, older_valid=20)
    assert not d.relaunch and "again after a rollback" in d.message
    p = RestartPolicy(RestartConfig(backoff_s=0))
    d = p.decide(outcome(api.NAN), progressed=False, newest_valid=40, older_valid=None)
    assert not d.relaunch and "no earlier valid checkpoint" in d.message
    d = RestartPolicy(RestartConfig()).decide(outcome(api.CONFIG), progressed=False, newest_valid=None,
                                              older_valid=None)
    assert not d.relaunch and "configuration or import error" in d.message


def test_hang_rules_with_injected_time():
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100, expected_ranks=2)
    assert w.hangs(50) == []
    w.observe({0: hb(0, phase="load", seq=1), 1: hb(1, phase="load", seq=1)}, now=50)
    assert w.hangs(59) == []
    w.observe({0: hb(0, phase="load", seq=2), 1: hb(1, phase="load", seq=2)}, now=59)
    assert w.hangs(68.9) == []  # loading is allowed up to the startup timeout, beating all along...
    assert [(h.rank, h.kind) for h in w.hangs(69.5)] == [(0, SILENT), (1, SILENT)]  # ...but not silence
    # Training: rank 0 keeps beating and stepping; rank 1 beats (its thread lives) but stays at step 3.
    for t in range(60, 75):
        w.observe({0: hb(0, phase="train", seq=t, step=t), 1: hb(1, phase="train", seq=t, step=3)}, now=t)
    assert w.hangs(70) == []
    hangs = w.hangs(74.5)
    assert [(h.rank, h.kind) for h in hangs] == [(1, NO_PROGRESS)]
    # Rank 0 goes silent (SIGSTOP): it is named first.
    hangs = w.hangs(74 + 10.5)
    assert hangs[0].rank == 0 and hangs[0].kind == SILENT
    # A long save is not a hang as long as the rank beats.
    w2 = RankWatch(0.0, 10, 100)
    for t in range(0, 60):
        w2.observe({0: hb(0, phase="save", seq=t, step=5)}, now=t)
    assert w2.hangs(59.5) == []
    # Back to training after a 20 s save, with the step not yet moved: not a hang.
    for t in range(60, 80):
        w2.observe({0: hb(0, phase="save", seq=t, step=5)}, now=t)
    w2.observe({0: hb(0, phase="train", seq=81, step=5)}, now=81)
    assert w2.hangs(82) == []
    # ...but not forever (a save stuck on a hung NFS mount, beating all along): the startup's allowance.
    w4 = RankWatch(0.0, 10, 100)
    w4.observe({0: hb(0, phase="train", seq=1, step=5)}, now=1)
    for t in range(2, 104):
        w4.observe({0: hb(0, phase="save", seq=t, step=5)}, now=t)
    assert w4.hangs(101.5) == []
    # (kind "save_too_long" in hang_evidence.json: it said "startup", for a hang in a save; audit)
    assert [(h.kind, h.describe()) for h in w4.hangs(103.5)] == [(SAVE_TOO_LONG, "rank 0 still in save after 102s")]
    # heartbeat.save_timeout_s: a state that takes longer to write than to load is given its own allowance.
    w5 = RankWatch(0.0, 10, 100, save_timeout_s=300)
    w5.observe({0: hb(0, phase="train", seq=1, step=5)}, now=1)
    for t in range(2, 304):
        w5.observe({0: hb(0, phase="save", seq=t, step=5)}, now=t)
    assert w5.hangs(200) == [] and w5.hangs(301.5) == []
    assert [h.kind for h in w5.hangs(303.5)] == [SAVE_TOO_LONG]
    w3 = RankWatch(0.0, 10, 30, expected_ranks=1)
    assert [h.kind for h in w3.hangs(31)] == [NO_HEARTBEAT]
    w3.observe({0: hb(0, phase="startup", seq=1)}, now=25)
    w3.observe({0: hb(0, phase="startup", seq=2)}, now=30)
    assert [h.kind for h in w3.hangs(31)] == [STARTUP]


def test_after_a_gap_in_the_looking_a_beat_is_dated_by_its_own_clock():
    """Audit 8: the supervisor stopped for 21 s, and a rank stopped 2 s after it: on its return the rank's last beat
    (new to it) was stamped with the time of the look, and the hang was caught a whole timeout later."""
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
    for t in range(1, 11):  # wall clock = t + 1000
        w.observe({0: hb(0, phase="train", seq=t, step=t, time=t + 1000.0, progress_at=t + 1000.0),
                   1: hb(1, phase="train", seq=t, step=t, time=t + 1000.0, progress_at=t + 1000.0)},
                  now=t, wall=t + 1000)
    # The supervisor looks again at 31: rank 0 beat until 30, rank 1 stopped at 12.
    w.observe({0: hb(0, phase="train", seq=40, step=30, time=1030.0, progress_at=1030.0),
               1: hb(1, phase="train", seq=12, step=12, time=1012.0, progress_at=1012.0)}, now=31, wall=1031)
    hangs = w.hangs(31)
    assert [(h.rank, h.kind) for h in hangs] == [(1, SILENT)] and hangs[0].for_s == pytest.approx(19), hangs
    # Without a gap a beat is dated by the look, whatever its clock says (another host's, a skewed one).
    w.observe({0: hb(0, phase="train", seq=41, step=31, time=900.0, progress_at=900.0),
               1: hb(1, phase="train", seq=13, step=13, time=900.0, progress_at=900.0)}, now=31.5, wall=1031.5)
    assert w.hangs(32) == []
    # Review 10: leaving a save longer than the limit, seen after a gap, is progress dated by the beat, not by the
    # last step before the save (progress_at), which made a healthy run a hang.
    w = RankWatch(launched_at=0.0, timeout_s=60, startup_timeout_s=100, stall_factor=2, stall_floor_s=3)
    w.observe({0: hb(0, phase="train", seq=1, step=5, time=1001.0, progress_at=1001.0, slowest_step_s=20)},
              now=1, wall=1001)
    for t in range(2, 52):  # a 50 s sync save, beating throughout
        w.observe({0: hb(0, phase="save", seq=t, step=5, time=1000.0 + t, progress_at=1001.0,
                         slowest_step_s=20)}, now=t, wall=1000 + t)
    w.observe({0: hb(0, phase="train", seq=70, step=5, time=1059.0, progress_at=1001.0, slowest_step_s=20)},
              now=60, wall=1060)  # an 8 s gap in the looking, just as the save ended
    assert w.hangs(60) == []


def test_of_two_ranks_without_progress_the_one_not_waiting_at_the_step_end_agreement_is_named():
    """Rank 0 waits in the step-end all-reduce, rank 1 is held up in its own code; both beat. Rank 0 was named
    (the tie fell to rank order), and the stop message sent the user to the wrong rank's log."""
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
    for t in range(1, 20):
        w.observe({0: hb(0, phase="train", seq=t, step=1, in_sync=t > 2), 1: hb(1, phase="train", seq=t, step=1)},
                  now=t)
    hangs = w.hangs(19.5)
    assert [(h.rank, h.kind) for h in hangs] == [(1, NO_PROGRESS), (0, NO_PROGRESS)]
    assert hangs[1].describe().endswith("(waiting for the others at the step-end agreement)")


def test_a_rank_that_has_not_entered_the_save_the_others_wait_in_is_named_with_why():
    """`if rank == 0: session.save(...)`: rank 0 waits in save(4)'s first collective, rank 1 trains on (or waits at
    the next agreement). Rank 0 was named, then still in `train`; rank 1 is, with what save() needs. An async save
    in flight while the ranks train (saving_step set, phase `train`) is no such wait."""
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
    for t in range(1, 20):
        w.observe({0: hb(0, phase="save", seq=t, step=4, saving_step=4),
                   1: hb(1, phase="train", seq=t, step=4, in_sync=True)}, now=t)
    hangs = w.hangs(19.5)
    assert [(h.rank, h.kind, h.saving) for h in hangs] == [(1, NO_PROGRESS, (0,))]
    assert hangs[0].describe() == ("rank 1 made no progress for 18s at step 4 (waiting for the others at the step-end "
                                   "agreement) and has not entered save(4), where rank 0 waits for it: save() is "
                                   "collective, call it on every rank at the same steps")
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
    for t in range(1, 20):
        w.observe({r: hb(r, phase="train", seq=t, step=4, saving_step=4) for r in (0, 1)}, now=t)
    assert [(h.rank, h.saving) for h in w.hangs(19.5)] == [(0, ()), (1, ())]
    assert "save" not in w.hangs(19.5)[0].describe()
    # Review 14: rank 1 has been through save(4) (its async save in flight, or its last save that step), rank 0 is
    # stuck staging in it: rank 1 was told it never called save(). Review 15: and it was named, rank 0 spared until
    # its save_timeout_s; rank 0, still in save, is named first.
    for been in ({"saving_step": 4}, {"last_save": {"step": 4, "blocking_s": 0.1, "committed": False}}):
        for stuck, waits in ((0, 1), (1, 0)):
            w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
            for t in range(1, 20):
                w.observe({stuck: hb(stuck, phase="save", seq=t, step=4, saving_step=4),
                           waits: hb(waits, phase="train", seq=t, step=4, **been)}, now=t)
            hangs = w.hangs(19.5)
            assert [(h.rank, h.kind, h.saving) for h in hangs] == [(stuck, SAVE_TOO_LONG, ()),
                                                                   (waits, NO_PROGRESS, ())], (been, hangs)
            assert verdict(hangs).startswith(f"rank {stuck} still in save after 18s"), verdict(hangs)


def test_every_silent_rank_is_named_not_only_the_first():
    """Both ranks of a node stopped (SIGSTOP of the group, a frozen host): the verdict named rank 0 alone."""
    from supervisor.watch import verdict

    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
    w.observe({r: hb(r, phase="train", seq=1, step=7) for r in range(3)}, now=1)
    for now in (2, 12.5):  # rank 2 beat once more, then stopped too
        w.observe({0: hb(0, phase="train", seq=1, step=7), 1: hb(1, phase="train", seq=1, step=7),
                   2: hb(2, phase="train", seq=2, step=7)}, now=now)
    hangs = w.hangs(12.5)
    assert verdict(hangs) == "rank 0 silent for 12s in phase train at step 7; ranks 1, 2 silent too"
    assert verdict(hangs[1:]) == "rank 1 silent for 12s in phase train at step 7; rank 2 silent too"
    assert verdict(hangs[:1]) == hangs[0].describe()


def test_a_rank_that_never_beats_is_named_before_the_ones_that_wait_for_it():
    """Rank 1 hangs before its first heartbeat; rank 0 waits for it in the rendezvous, in `startup`. The supervisor
    (which now tells the watch how many ranks one node runs) names rank 1, not rank 0."""
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=30, expected_ranks=2)
    for t in range(1, 32):
        w.observe({0: hb(0, phase="startup", seq=t)}, now=t)
    hangs = w.hangs(31.5)
    assert [(h.rank, h.kind) for h in hangs] == [(1, NO_HEARTBEAT), (0, STARTUP)]
    assert hangs[0].describe() == "rank 1 wrote no heartbeat in 32s (the other ranks did)"


def test_a_first_step_has_the_startups_allowance():
    """A compile or autotuning in the first step: beating, in `train`, no step yet. Held to startup_timeout_s
    since launch, not to timeout_s (it was killed as a hang at every attempt)."""
    w = RankWatch(launched_at=0.0, timeout_s=10, startup_timeout_s=100)
    for t in range(5, 96):
        w.observe({0: hb(0, phase="train", seq=t, step=0, first_step_at=None)}, now=t)
    assert w.hangs(95.5) == []
    for t in range(96, 112):
        w.observe({0: hb(0, phase="train", seq=t, step=0, first_step_at=None)}, now=t)
    assert [(h.rank, h.kind) for h in w.hangs(111.5)] == [(0, NO_PROGRESS)]
    # A script that never calls beat() looks just so: the verdict says what to check.
    assert "must call session.beat(step, loss) every step" in w.hangs(111.5)[0].describe()


def test_stall_rule_scales_with_the_slowest_recent_step():
    # Steps of 0.2 s (slowest 0.4 s), factor 10: a training rank is hung after 4 s without a step, not 60.
    w = RankWatch(0.0, timeout_s=60, startup_timeout_s=100, stall_factor=10, stall_floor_s=3)
    for t in range(10, 21):
        w.observe({r: hb(r, phase="train", seq=t, step=5 * t, slowest_step_s=0.4) for r in (0, 1)}, now=t)
    assert w.limit_s(0) == 4.0
    # Rank 1 is SIGSTOPped after its beat at t=20; rank 0 keeps beating, blocked in a collective.
    for t in range(21, 25):
        w.observe({0: hb(0, phase="train", seq=t, step=100, slowest_step_s=0.4),
                   1: hb(1, phase="train", seq=20, step=100, slowest_step_s=0.4)}, now=t)
    assert w.hangs(23.9) == []
    hangs = w.hangs(24.1)
    assert [(h.rank, h.kind) for h in hangs] == [(1, SILENT), (0, NO_PROGRESS)]  # the stopped rank first
    # The floor: tiny steps still get three heartbeat intervals; the ceiling: slow steps never exceed timeout_s.
    w.observe({0: hb(0, phase="train", seq=30, step=101, slowest_step_s=0.01)}, now=30)
    assert w.limit_s(0) == 3.0
    w.observe({0: hb(0, phase="train", seq=31, step=102, slowest_step_s=20.0)}, now=31)
    assert w.limit_s(0) == 60
    # Before a rank has measured a step (fresh start, resume), and outside `train`, the fixed rules apply.
    w2 = RankWatch(0.0, 60, 100, stall_factor=10, stall_floor_s=3)
    w2.observe({0: hb(0, phase="train", seq=1, step=1), 1: hb(1, phase="save", seq=1, step=1, slowest_step_s=0.1)},
               now=1)
    assert set(w2.seen) == {0, 1} and w2.limit_s(0) == 60 and w2.limit_s(1) == 60
    assert w2.hangs(30) == [] and [h.rank for h in w2.hangs(61.5)] == [0, 1]
    # Off (the default): the fixed timeout only.
    w3 = RankWatch(0.0, 60, 100)
    w3.observe({0: hb(0, phase="train", seq=1, step=1, slowest_step_s=0.1)}, now=1)
    assert w3.limit_s(0) == 60 and w3.hangs(30) == []


def test_stragglers_compare_own_rates():
    w = RankWatch(0.0, 10, 10)
    w.observe({r: hb(r, phase="train", steps_per_s=5.0, own_steps_per_s=v) for r, v in
               enumerate([20.0, 19.0, 21.0, 5.0])}, now=1)
    assert list(w.stragglers()) == [3]
    w2 = RankWatch(0.0, 10, 10)  # two ranks: the straggler must not hide by pulling the median down
    w2.observe({0: hb(0, phase="train", own_steps_per_s=18.2), 1: hb(1, phase="train", own_steps_per_s=6.4)}, now=1)
    assert list(w2.stragglers()) == [1]


# ---- the CLI builds the exact torchrun argv -------------------------------------------------------


class Recorded:
    """Stands in for TorchrunProcess: what the real launcher would have started, and a clean exit."""

    started: ClassVar[list[Recorded]] = []

    def __init__(self, argv, env, log_path, cwd=None, zygote=None, forked=None):
        self.argv, self.env, self.log_path, self.forked = argv, env, log_path, forked
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        Recorded.started.append(self)

    wait = FakeHandle.wait
    track, signal_group, signal_ranks, stop, close = (FakeHandle.track, FakeHandle.signal_group,
                                                      FakeHandle.signal_ranks, FakeHandle.stop, FakeHandle.close)
    rc = 0


class ReadyServer:
    """A prewarm server that is ready: the launcher forks torchrun from it and routes workers through it."""

    socket = "@resilient-prewarm-test"

    def __init__(self):
        self.launched: list[list[str]] = []

    def ready(self, wait_s=0.0):
        return True

    def alive(self):
        return True

    def launch(self, argv, env, cwd, fds):
        self.launched.append(argv)
        return object()

    def close(self):
        pass


def test_run_builds_the_exact_torchrun_argv_cold_and_prewarmed(tmp_path, cli, monkeypatch):
    """The real TorchrunLauncher builds the argv; only the process start is recorded instead of made."""
    from supervisor.launch import TorchrunLauncher

    monkeypatch.setenv("RESILIENT_ZYGOTE", "0")
    monkeypatch.setenv("RESILIENT_PREWARM", "0")
    monkeypatch.setattr("supervisor.launch.TorchrunProcess", Recorded)
    monkeypatch.setattr(Recorded, "started", [])
    launcher = TorchrunLauncher()
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry, args: [--steps, 10]}\nnproc_per_node: 2\n"
                   "stop_timeout_s: 15\n")
    result = cli("run", job, "--set", "checkpoint.interval_steps=5")
    assert result.exit_code == 0, result.output
    cold = Recorded.started[0]
    logs = tmp_path / "runs/demo/logs/attempt_1"
    assert cold.argv == [sys.executable, "-m", "supervisor.torchrun", "--nnodes", "1", "--nproc-per-node", "2",
                         "--standalone", "--max-restarts", "0", "--monitor-interval", "0.1", "--shutdown-timeout",
                         "15", "--log-dir", str(logs / "ranks"), "--redirects", "3", "-m", "--", "train_entry",
                         "--steps", "10"]
    handover = Handover.from_env(cold.env)
    assert handover.ckpt_interval == 5 and handover.attempt == 1 and handover.resume_step is None
    assert handover.heartbeat_dir == str(tmp_path / "runs/demo/heartbeats/attempt_1")
    assert cold.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and cold.forked is None
    assert json.loads((tmp_path / "runs/demo/state.json").read_text())["state"] == "succeeded"

    # Once the prewarm server is ready: torchrun is its fork, and each worker starts through its client.
    server = launcher._prewarm = ReadyServer()
    assert cli("run", job, "--set", "entrypoint.args=[--steps, 20]").exit_code == 0
    warm = Recorded.started[1]
    assert server.launched == [warm.argv[1:]] and warm.forked is not None
    assert warm.argv[warm.argv.index("--redirects") + 2:] == ["-m", "--", "supervisor.prewarm_client", "-m",
                                                              "train_entry", "--steps", "20"]
    assert warm.env["RESILIENT_PREWARM_SOCKET"] == server.socket


def test_multinode_argv_uses_the_rendezvous(tmp_path):
    from supervisor.api import AttemptSpec
    from supervisor.config import load_job

    job = tmp_path / "job.yaml"
    job.write_text("name: mn\nentrypoint: {script: t.py}\nnnodes: 1:4\nnproc_per_node: 8\n"
                   "rdzv: {endpoint: 'head:29400', conf: {last_call_timeout: 5}}\n")
    (tmp_path / "t.py").write_text("")
    cfg = load_job(job)
    spec = AttemptSpec(1, None, None, tmp_path / "l", tmp_path / "h", tmp_path / "s", tmp_path / "c")
    argv = torchrun_argv(cfg, spec, python="py", max_restarts=7)
    assert argv[:16] == ["py", "-m", "supervisor.torchrun", "--nnodes", "1:4", "--nproc-per-node", "8",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "mn",
                         "--rdzv-conf", "last_call_timeout=5", "--max-restarts"]
    assert argv[16] == "7" and argv[-1] == str(tmp_path / "t.py")
    # Prewarmed workers: torchrun starts the client, which takes the entry point and its args as they were.
    warm = torchrun_argv(cfg, spec, python="py", max_restarts=7, prewarmed=True)
    assert argv[-2:] == ["--", str(tmp_path / "t.py")]  # `--`: whatever the script's args, they are its own
    assert warm[:-4] == argv[:-2] and warm[-4:] == ["-m", "--", "supervisor.prewarm_client", str(tmp_path / "t.py")]
    # A node's own rendezvous address (several nodes on one host, or a multi-homed host) reaches torchrun.
    pinned = torchrun_argv(load_job(job, ["rdzv.local_addr=127.0.0.2"]), spec, python="py", max_restarts=7)
    assert pinned[15:17] == ["--local-addr", "127.0.0.2"] and pinned[17:19] == ["--max-restarts", "7"]


def test_the_rendezvous_window_counts_a_launch_that_only_waited_not_one_whose_ranks_began(tmp_path, cli,
                                                                                           monkeypatch):
    """Attempt 1's ranks were loading when the store went (RendezvousClosedError): the time they spent is not the
    rendezvous's, and the window starts at that failure. Attempt 2 waited out join_timeout in the rendezvous and
    started no rank: that wait counts, and the run stops without a third launch."""
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nnnodes: 2\n"
                   "rdzv: {endpoint: '127.0.0.1:1', conf: {join_timeout: 1}}\n"
                   "restart: {backoff_s: 0, max_backoff_s: 0.1}\n")
    launches = []

    def launcher(cfg, spec, handover):
        launches.append(spec.attempt)
        if spec.attempt == 1:
            write_heartbeat(spec.heartbeat_dir, Heartbeat(rank=0, pid=2**22 - 2, world_size=2, phase="load"))
        time.sleep(1.2)  # the attempt's time in torchrun: loading (1), or the rendezvous's join_timeout (2)
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1)
        error = "RendezvousClosedError" if spec.attempt == 1 else "RendezvousTimeoutError"
        h.log_path.write_text(f"torch.distributed.elastic.rendezvous.api.{error}\n")
        return h

    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job, "--node", "a")
    assert result.exit_code == 1 and launches == [1, 2], (launches, result.stderr)
    assert re.search(r"could not be formed in \d+s since the first launch that failed \(join_timeout 1s\)",
                     result.stderr), result.stderr
    doc = json.loads((tmp_path / "runs/demo/nodes/a/state.json").read_text())
    assert [h["reason"] for h in doc["history"]] == ["rendezvous"] * 2 and doc["restarts"] == 0, doc["history"]


def test_failing_attempts_spend_the_budget_and_exit_1(tmp_path, cli, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {max_restarts: 2, backoff_s: 0, "
                   "crash_loop_attempts: 9}\n")
    launches = []

    def launcher(cfg, spec, handover):
        launches.append(spec.attempt)
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1)
        h.log_path.write_text(summary())
        return h

    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 1 and launches == [1, 2, 3]
    assert "restart budget is spent (2/2 restarts)" in result.stderr
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert [h["reason"] for h in doc["history"]] == ["worker_signal"] * 3 and doc["state"] == "failed"


def test_the_step_at_failure_is_the_last_step_the_group_logged(tmp_path, cli, monkeypatch):
    # Rank 0 was SIGKILLed inside step 59 before logging it; rank 1 finished 59 and beat. The group's step
    # is 58: the step log's, not the highest heartbeat's (that was CI's flaky e2e failure: 59 vs 58).
    from supervisor.protocol import step_line, write_heartbeat

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {max_restarts: 0}\n")

    def launcher(cfg, spec, handover):
        spec.step_log.parent.mkdir(parents=True, exist_ok=True)
        spec.step_log.write_text("".join(step_line(s, 1000.0 + s) for s in range(1, 59)))
        spec.heartbeat_dir.mkdir(parents=True, exist_ok=True)
        for rank, step in ((0, 58), (1, 59)):
            write_heartbeat(spec.heartbeat_dir, hb(rank, step=step, first_step_at=1001.0, started_at=1000.0))
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1)
        h.log_path.write_text(summary(rank=0))
        return h

    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 1, result.output
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert doc["history"][0]["step_at_failure"] == 58 and doc["step"] == 58, doc["history"]
    assert "attempt 1 failed at step 58" in result.stderr


def load_failed(step=40):
    return api.AttemptOutcome(api.CHECKPOINT_LOAD, "rank 0 could not load the checkpoint: boom", 0, 74, None,
                              checkpoint_step=step)


def test_a_corrupt_checkpoint_that_fails_to_load_is_set_aside_at_once_and_not_counted_as_no_progress():
    p = RestartPolicy(RestartConfig(backoff_s=0, crash_loop_attempts=2))
    for step in (60, 40):  # one after another, each found corrupt by the full check
        d = p.decide(load_failed(step), progressed=False, newest_valid=step, older_valid=step - 20,
                     load=LoadFailure(step, ".metadata checksum mismatch", older_valid=step - 20))
        assert d.relaunch and d.quarantine_step == step and ".metadata checksum mismatch" in d.quarantine
    assert p.no_progress == 0


def test_a_whole_checkpoint_is_retried_once_set_aside_after_two_failures_and_only_once_per_run():
    p = RestartPolicy(RestartConfig(backoff_s=0, crash_loop_attempts=9))
    whole = LoadFailure(40, None, older_valid=20)
    first = p.decide(load_failed(), progressed=False, newest_valid=40, older_valid=20, load=whole)
    assert first.relaunch and first.quarantine_step is None  # a passing fault gets one more try
    second = p.decide(load_failed(), progressed=False, newest_valid=40, older_valid=20, load=whole)
    assert second.relaunch and second.quarantine_step == 40 and "failed to load it twice" in second.quarantine
    assert second.quarantine_once_older_loads and second.resume_below == 40  # passed over; set aside only later
    # The older one fails the same way: the checkpoints no longer match the code; stop, set nothing aside.
    older = LoadFailure(20, None, older_valid=10)
    assert p.decide(load_failed(20), progressed=False, newest_valid=20, older_valid=10, load=older).relaunch
    stop = p.decide(load_failed(20), progressed=False, newest_valid=20, older_valid=10, load=older)
    assert not stop.relaunch and stop.quarantine_step is None and "no longer match" in stop.message
    assert "as step 40 did before it" in stop.message and "both are left where they are" in stop.message
    assert stop.message.endswith("change the code back and `resilient run` again resumes from the newest, or train "
                                 "the new model in a new run dir")  # audit 12: the fix was not named


def test_a_bad_checkpoint_stops_the_run_only_when_nothing_older_is_valid_and_is_set_aside_all_the_same():
    p = RestartPolicy(RestartConfig(backoff_s=0))
    d = p.decide(load_failed(20), progressed=False, newest_valid=20, older_valid=None,
                 load=LoadFailure(20, "__0_0.distcp checksum mismatch", older_valid=None))
    assert not d.relaunch and d.quarantine_step == 20 and "no older valid checkpoint" in d.message
    assert "starts from step 0" in d.message and "checksum mismatch" in d.quarantine


def test_a_checkpoint_found_corrupt_is_set_aside_even_when_the_restart_budget_stops_the_run():
    """Audit: with the budget spent, the corrupt checkpoint stayed in place, 'the newest valid' to status and to
    every rerun, which failed on it again and never reached the good older ones."""
    p = RestartPolicy(RestartConfig(backoff_s=0, max_restarts=0))
    d = p.decide(load_failed(30), progressed=False, newest_valid=30, older_valid=20,
                 load=LoadFailure(30, "__0_0.distcp checksum mismatch", older_valid=20))
    assert not d.relaunch and "restart budget is spent" in d.message
    assert d.quarantine_step == 30 and not d.quarantine_once_older_loads and not d.quarantine_local


def test_a_whole_local_copy_that_fails_to_load_is_tried_again_then_passed_over_never_set_aside_as_damaged():
    """Audit: after a model change, byte-perfect local copies were set aside (and listed as corrupt) at once."""
    p = RestartPolicy(RestartConfig(backoff_s=0))
    whole = LoadFailure(30, None, older_valid=20, local=True)
    first = p.decide(load_failed(30), progressed=False, newest_valid=30, older_valid=20, load=whole)
    assert first.relaunch and first.quarantine_step is None
    second = p.decide(load_failed(30), progressed=False, newest_valid=30, older_valid=20, load=whole)
    assert second.relaunch and second.quarantine_step == 30 and second.quarantine_once_older_loads
    damaged = p.decide(load_failed(20), progressed=False, newest_valid=20, older_valid=10,
                       load=LoadFailure(20, "__0_0.distcp checksum mismatch", older_valid=None, local=True))
    assert damaged.relaunch and damaged.quarantine_step == 20 and damaged.quarantine_local


def test_classify_a_rank_that_could_not_load_its_checkpoint():
    beat = hb(1, exit_code=EXIT_CHECKPOINT_LOAD, loading_step=40,
              exit_reason="checkpoint_load: step 40: UnpicklingError: invalid load key")
    out = classify.classify(1, summary(rank=1, code=EXIT_CHECKPOINT_LOAD, sig=""), {1: beat})
    assert out.reason == api.CHECKPOINT_LOAD and out.checkpoint_step == 40 and out.failed_rank == 1
    assert "could not load the checkpoint: step 40: UnpicklingError" in out.detail


def test_a_load_failure_names_the_rank_that_read_the_bad_bytes_not_the_first_to_relay_it():
    """Audit: DCP raises one rank's read error on every rank; the first to exit (here rank 1) was named, with its
    log, for bytes rank 0 read."""
    why = "checkpoint_load: step 30: rank 0: PieceMismatch: __0_0.distcp (w, from byte 0 of the file): its bytes"
    beats = {r: hb(r, exit_code=EXIT_CHECKPOINT_LOAD, loading_step=30, exit_reason=why) for r in (0, 1)}
    out = classify.classify(1, summary(rank=1, code=EXIT_CHECKPOINT_LOAD, sig=""), beats)
    assert out.failed_rank == 0 and out.detail.startswith("rank 0 could not load the checkpoint: step 30: "
                                                          "PieceMismatch: __0_0.distcp"), out.detail
    beats = {1: beats[1]}  # the reader is another node's rank: this node's relay is named, the reader's number kept
    out = classify.classify(1, summary(rank=1, code=EXIT_CHECKPOINT_LOAD, sig=""), beats)
    assert out.failed_rank == 1 and "step 30: rank 0: PieceMismatch" in out.detail


def test_run_restores_the_callers_signal_handlers(tmp_path, cli, monkeypatch):
    import signal

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    monkeypatch.setattr("supervisor.commands.run.make_launcher",
                        lambda: lambda cfg, spec, handover: FakeHandle(spec.logs_dir / "torchrun.log"))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)}
    assert cli("run", job).exit_code == 0
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_hangup_stops_the_run_unless_it_was_started_to_ignore_one(monkeypatch):
    """SIGHUP (a closed terminal) is a graceful stop; under `nohup`, which starts it ignored, it stays ignored."""
    import signal

    from supervisor.commands.run import stop_signals

    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_DFL)
    assert signal.SIGHUP in stop_signals() and signal.SIGTERM in stop_signals()
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_IGN if s == signal.SIGHUP else signal.SIG_DFL)
    assert signal.SIGHUP not in stop_signals() and signal.SIGTERM in stop_signals()


def test_the_resume_tier_is_taken_from_a_rank_that_has_loaded(tmp_path):
    """Rank 1 trains after loading step 212 from the local tier while rank 0's beat on disk still predates its
    load (no tier in it): the attempt records rank 1's words, not a tierless 'agreed across nodes' (the kill
    campaign caught it so, 1 relaunch in ~50)."""
    from types import SimpleNamespace

    from supervisor.api import AttemptSpec
    from supervisor.attempt import Attempt
    from supervisor.protocol import Handover, Heartbeat

    events: list[str] = []
    console = SimpleNamespace(event=lambda text, style=None: events.append(text))
    rec = state.AttemptRecord(attempt=2, started_at=0.0, resumed_from_step=208)
    spec = AttemptSpec(2, 208, None, tmp_path / "l", tmp_path / "h", tmp_path / "s", tmp_path / "c")
    resumed: list[tuple] = []
    listener = SimpleNamespace(on_resumed=lambda *a: resumed.append(a))
    attempt = Attempt(None, spec, Handover(ckpt_local_dir=str(tmp_path / "local")), None, console, rec, None,
                      listener)
    why = "every node holds step 212 whole"
    attempt._follow_resume({0: Heartbeat(rank=0, pid=10, phase="load", loading_step=212),
                            1: Heartbeat(rank=1, pid=11, phase="train", resumed_from=212, resumed_tier="local",
                                         resumed_why=why)})
    assert (rec.resumed_from_step, rec.resumed_tier, rec.resumed_why) == (212, "local", why)
    assert events == [f"attempt 2: the ranks resumed from step 212 from the local tier ({why})"]
    assert resumed == [(212, "local", 0.0)]  # the supervisor hears it too (its replicator acts on "durable")


@pytest.mark.parametrize(("code", "reason"), [(EXIT_PREEMPTED, "stopped"), (1, "worker_exit")])
def test_ranks_that_stopped_on_the_same_signal_as_the_supervisor_are_a_stop_not_a_preemption(tmp_path, cli,
                                                                                              monkeypatch, code,
                                                                                              reason):
    """Slurm signals every process of a job step at once: the ranks checkpoint and exit 75, and torchrun can end
    within the poll in which the supervisor's own SIGTERM arrived (CI saw it recorded as 'preempted'). A rank that
    failed for another reason in that poll keeps its reason; the run stops all the same."""
    import os
    import signal

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {backoff_s: 0}\n")
    launches = []

    def launcher(cfg, spec, handover):
        launches.append(spec.attempt)
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's handler runs before torchrun's exit is seen
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1)
        h.log_path.write_text(summary(rank=1, code=code, sig="", traceback="<N/A>"))
        return h

    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 143 and launches == [1], result.output
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert doc["state"] == "stopped" and [h["reason"] for h in doc["history"]] == [reason], doc["history"]
    if reason == "stopped":
        assert "the ranks had it too and have already stopped" in result.stderr
        assert "attempt 1 failed" not in result.stderr
    else:
        assert "attempt 1 failed" in result.stderr and doc["history"][0]["failed_rank"] == 1
        assert "restart 1/" not in result.stderr and doc["restarts"] == 0  # none announced that never came


def test_a_state_file_that_cannot_be_written_does_not_end_the_supervision(tmp_path, cli, monkeypatch):
    """A full disk under the run dir: the supervisor says so once, supervises on, and writes the state again once
    it can (it once ended in a traceback, exit 1, with the run's state left 'running')."""
    import errno

    from supervisor import state as state_mod

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {backoff_s: 0}\n")
    real_write, full = state_mod.write, {"on": False}

    def write(path, rec):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, rec)

    def launcher(cfg, spec, handover):
        full["on"] = spec.attempt == 1  # the disk fills during attempt 1 and has room again for attempt 2
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1 if spec.attempt == 1 else 0)
        h.log_path.write_text(summary() if spec.attempt == 1 else "")
        return h

    monkeypatch.setattr(state_mod, "write", write)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("No space left on device") == 1 and "state.json is written again" in result.stderr
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert doc["state"] == "succeeded" and [h["reason"] for h in doc["history"]] == ["worker_signal", "finished"]


def test_a_state_file_this_version_cannot_read_stops_the_run_before_launching(tmp_path, cli, monkeypatch):
    """Read as if absent, it once restarted the attempt numbers at 1 over the old logs and step logs, and lost
    the history and the goodput ledger."""
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "state.json").write_text(json.dumps({"schema_version": 0, "history": []}))
    launches = []
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: lambda *a: launches.append(a))
    result = cli("run", job)
    assert result.exit_code == 2 and launches == [], result.output
    assert "schema_version 0" in result.stderr and "nothing was launched" in result.stderr
    assert json.loads((run_dir / "state.json").read_text())["schema_version"] == 0


def test_a_damaged_state_file_is_kept_aside_and_attempts_number_past_the_old_logs(tmp_path, cli, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    run_dir = tmp_path / "runs" / "demo"
    (run_dir / "logs" / "attempt_4").mkdir(parents=True)
    (run_dir / "state.json").write_bytes(b'{"schema_version": 1, "hist')  # a machine crash mid-write
    launches = []

    def launcher(cfg, spec, handover):
        launches.append(spec.attempt)
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=0)
        h.log_path.write_text("")
        return h

    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 0 and launches == [5], result.output
    kept = list(run_dir.glob("state.json.unreadable.*"))
    assert len(kept) == 1 and kept[0].read_bytes().endswith(b'"hist') and "history starts afresh" in result.stderr


def test_a_state_file_is_called_damaged_only_for_bytes_no_version_wrote(tmp_path):
    """A damaged file is kept aside and the run goes on; another version's, or one the filesystem would not give
    (EIO, a stale NFS handle; here a folder in its place), stops the run instead of losing a healthy history."""
    import pytest

    from supervisor import state as state_mod

    path = tmp_path / "state.json"
    for content, damaged in ((b'{"schema_version": 1, "hist', True), (b"[1, 2]", True), (b'{"a": 1}', True),
                             (b'{"schema_version": 99}', False), (b'{"schema_version": 0}', False),
                             (b'{"schema_version": NaN}', True), (b'{"schema_version": "1"}', True)):
        path.write_bytes(content)
        with pytest.raises(state_mod.StateFileError) as e:
            state_mod.read(path)
        assert e.value.damaged is damaged, content
    path.unlink()
    path.mkdir()
    with pytest.raises(state_mod.StateFileError) as e:
        state_mod.read(path)
    assert not e.value.damaged and "cannot be read" in str(e.value)


def test_a_checkpoint_unreadable_after_a_failed_load_is_not_called_corrupt(tmp_path, monkeypatch):
    """Deep-read after the ranks failed to load it, a checkpoint this machine cannot read is no evidence of
    damage: it is set aside only as one that fails to load twice, not at once as corrupt."""
    import sys
    from types import SimpleNamespace

    from supervisor import api, store
    from supervisor.api import AttemptOutcome
    from supervisor.resume import ResumeChooser
    from tests.ckpt_helpers import write_checkpoint

    root = tmp_path / "ckpt"
    for step in (10, 20):
        write_checkpoint(root, step)
    marker = root / store.step_dirname(20) / store.MARKER
    doc = json.loads(marker.read_bytes())
    doc["checksum_algorithm"] = "crc32c"
    marker.write_text(json.dumps(doc))
    monkeypatch.setitem(sys.modules, "crc32c", None)
    chooser = ResumeChooser(SimpleNamespace(dir=root, verify="size"), None, SimpleNamespace(event=lambda *a, **k: None),
                            quarantined=lambda entry: None, next_attempt=lambda: 2)
    failure = chooser.load_failure(AttemptOutcome(api.CHECKPOINT_LOAD, "could not load", checkpoint_step=20),
                                   SimpleNamespace(step=20))
    assert failure.step == 20 and failure.corrupt is None and failure.older_valid == 10


def test_a_run_dir_with_no_room_for_the_next_attempt_stops_the_run_with_one_sentence(tmp_path, cli, monkeypatch):
    """After a failure, the relaunch's logs cannot be written (the run dir's disk is full): it once ended in a
    traceback with the run left 'running'."""
    import errno

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {backoff_s: 0}\n")

    def launcher(cfg, spec, handover):
        if spec.attempt == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(spec.logs_dir / "torchrun.log"))
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1)
        h.log_path.write_text(summary())
        return h

    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "the run dir cannot be written" in result.stderr and "No space left on device" in result.stderr
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert doc["state"] == "failed" and [h["reason"] for h in doc["history"]] == ["worker_signal", "launcher_died"]
    assert all(h["ended_at"] for h in doc["history"])


def test_an_interpreter_that_cannot_be_executed_stops_the_run_with_one_sentence(tmp_path, cli, monkeypatch):
    """The real launcher, with an interpreter this user may not execute: the prewarm server's spawn and then
    torchrun's failed with PermissionError, which ended in a traceback with the run left 'running'."""
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    python = tmp_path / "python"
    python.write_text("")
    python.chmod(0o600)
    monkeypatch.setattr("sys.executable", str(python))
    result = cli("run", job)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"resilient stopped the run: {python}: Permission denied. Fix that;" in " ".join(result.stderr.split())
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert doc["state"] == "failed" and [h["reason"] for h in doc["history"]] == ["launcher_died"], doc["history"]


def test_a_checkpoint_root_that_cannot_be_listed_between_attempts_stops_the_run_failed(tmp_path, cli, monkeypatch):
    """Review 9 and 10: an EIO from the root's scan before a relaunch (a flaky shared filesystem) was a traceback
    with the run left 'restarting'; then the failure's own settling scanned the root again and escaped the same
    way."""
    import errno

    from supervisor.resume import ResumeChooser

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {backoff_s: 0}\n")
    calls = []
    real_choose = ResumeChooser.choose

    def choose(self, below):
        calls.append(below)
        if len(calls) > 1:
            raise OSError(errno.EIO, "Input/output error", str(tmp_path / "runs/demo/checkpoints"))
        return real_choose(self, below)

    def unlistable(self):
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / "runs/demo/checkpoints"))

    def launcher(cfg, spec, handover):
        h = FakeHandle(spec.logs_dir / "torchrun.log", rc=1)
        h.log_path.write_text(summary())
        monkeypatch.setattr(ResumeChooser, "newest_step", unlistable)
        return h

    monkeypatch.setattr(ResumeChooser, "choose", choose)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launcher)
    result = cli("run", job)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "resilient stopped the run: " in result.stderr and "Input/output error. Fix that;" in result.stderr
    doc = json.loads((tmp_path / "runs/demo/state.json").read_text())
    assert doc["state"] == "failed", doc["state"]


def test_a_run_dir_with_no_room_for_the_job_file_stops_with_one_sentence_and_closes_the_launcher(tmp_path, cli,
                                                                                                  monkeypatch):
    """The job file is written after the launcher's helpers were started: a full disk there once left a traceback
    and the helpers (the prewarm server) to the interpreter's exit."""
    import errno

    from supervisor import supervise

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    calls: list[str] = []

    class Launcher:
        def prepare(self, cfg):
            calls.append("prepare")

        def close(self):
            calls.append("close")

        def __call__(self, cfg, spec, handover):
            calls.append("launch")

    def full(path, doc, **_):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("supervisor.commands.run.make_launcher", Launcher)
    monkeypatch.setattr(supervise, "atomic_write_json", full)
    result = cli("run", job)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "the run dir cannot be written" in result.stderr and "job.json" in result.stderr
    assert calls == ["prepare", "close"]


def test_a_passed_over_checkpoint_is_no_progress_and_set_aside_only_once_an_older_one_loads(tmp_path):
    """While step 40 is passed over (it failed to load twice), attempts from step 20 that die make no progress (the
    crash-loop rule slept: 40 counted as newer than the start); a fresh start clears it without setting it aside."""
    from supervisor import store
    from supervisor.config import load_job
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor
    from tests.ckpt_helpers import write_checkpoint

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrestart: {backoff_s: 0, crash_loop_attempts: 2}\n")
    cfg = load_job(job)
    for step in (20, 40):
        write_checkpoint(cfg.checkpoint.dir, step)
    sup = Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None)
    sup.resume.suspect = (40, "every byte checks, but the ranks failed to load it twice")
    choice = api.ResumeChoice(20, cfg.checkpoint.dir / store.step_dirname(20), [], [])
    assert sup.resume.choose(None).step == 20
    assert sup._decide(outcome(step=25), choice).relaunch and sup.policy.no_progress == 1
    stop = sup._decide(outcome(step=25), choice)
    assert not stop.relaunch and "crash loop" in stop.message
    sup.on_resumed(None, None, 0.0)  # a fresh start: nothing learnt about step 40, nothing set aside
    assert sup.resume.suspect is None and (cfg.checkpoint.dir / store.step_dirname(40)).is_dir()
    sup.resume.suspect = (40, "why")
    sup.on_resumed(20, "durable", 0.0)
    assert not (cfg.checkpoint.dir / store.step_dirname(40)).exists() and sup.record.quarantined[0]["step"] == 40


def test_ranks_that_resume_newer_than_handed_and_end_at_once_charge_no_lost_steps(tmp_path):
    """A rerun launched with durable step 100 whose ranks took local step 300, the last, and ended before any
    step: the ledger kept the launch's charge, 200 steps lost that never were, in every later status (audit)."""
    from supervisor.config import load_job
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    cfg = load_job(job)
    sup = Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None)
    ledger = sup.accounting
    ledger.launch(1, 0.0, None)
    for step in range(1, 301):
        ledger.step(step, step * 0.1)
        if step % 50 == 0:
            ledger.save(step, 0.01)
    ledger.end(31.0)
    ledger.launch(2, 40.0, 100)
    assert ledger.summary(41.0)["lost_steps"] == 200  # what the launch's step charges, until the ranks say
    sup.on_resumed(300, "local", 40.0)
    assert ledger.summary(41.0)["lost_steps"] == 0 and ledger.attempts[-1].resume_step == 300


def supervisor_over(tmp_path, keep: int, steps: tuple[int, ...]):
    """A Supervisor of a job with `keep`, its checkpoint root holding `steps` (nothing launched)."""
    from supervisor.config import load_job
    from supervisor.console import EventConsole
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor
    from tests.ckpt_helpers import write_checkpoint

    job = tmp_path / "job.yaml"
    job.write_text(f"name: demo\nentrypoint: {{module: train_entry}}\ncheckpoint: {{keep: {keep}}}\n")
    cfg = load_job(job)
    for step in steps:
        write_checkpoint(cfg.checkpoint.dir, step)
    return Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None, console=EventConsole("demo")), cfg


def test_a_root_lost_to_another_run_is_said_once_on_the_console_and_in_status(tmp_path, capsys):
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor

    _, cfg = supervisor_over(tmp_path, keep=2, steps=())
    said = ["/ckpt (checkpoint.dir) was emptied while this run used it and is now held by job 'beta': ..."]
    sup = Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None, keep_claims=lambda: [None, *said])
    sup.save_state()
    sup.save_state()
    assert capsys.readouterr().err.count("is now held by job 'beta'") == 1
    doc = json.loads((cfg.run_dir / "state.json").read_text())
    assert [n["text"] for n in doc["notes"]] == said, doc["notes"]


def test_retention_at_a_commit_judges_the_checkpoints_up_to_that_commit(tmp_path, capsys):
    """With fast steps step 125 was on disk when the supervisor read step 100's commit: "checkpoint step 100
    committed; removed step_000000050, step_000000075" read as if only step 100 was left (audit)."""
    from supervisor.protocol import CommitRecord

    sup, cfg = supervisor_over(tmp_path, keep=2, steps=(50, 75, 100, 125))
    sup.on_checkpoint(CommitRecord(100, 0.0, 1.0, 1000), mine=True)
    assert "checkpoint step 100 committed" in capsys.readouterr().err
    assert sorted(p.name for p in cfg.checkpoint.dir.glob("step_*")) == [
        "step_000000075", "step_000000100", "step_000000125"]
    sup.on_checkpoint(CommitRecord(125, 0.0, 1.0, 1000), mine=True)
    assert "checkpoint step 125 committed" in (err := capsys.readouterr().err) and "removed step_000000075" in err
    assert sorted(p.name for p in cfg.checkpoint.dir.glob("step_*")) == ["step_000000100", "step_000000125"]


def test_retention_still_runs_when_the_disk_scan_announced_the_commit_before_rank_0_logged_it(tmp_path, capsys):
    """Under load the supervisor's scan of the root saw step 80 before rank 0's commit record arrived: the record
    was then taken as already announced, and retention never ran (a run kept 20, 40, 60 and 80 with keep 3)."""
    from supervisor.protocol import CommitRecord

    sup, cfg = supervisor_over(tmp_path, keep=3, steps=(20, 40, 60, 80))
    sup.on_checkpoint(CommitRecord(80, 0.0, 0.0, 1000), mine=False)  # the scan
    assert "checkpoint step 80 committed" in capsys.readouterr().err
    assert len(list(cfg.checkpoint.dir.glob("step_*"))) == 4
    sup.on_checkpoint(CommitRecord(80, 0.0, 1.0, 1000), mine=True)  # rank 0's record
    err = capsys.readouterr().err
    assert "committed" not in err and "after checkpoint step 80: removed step_000000020" in err, err
    assert sorted(p.name for p in cfg.checkpoint.dir.glob("step_*")) == [f"step_0000000{s}" for s in (40, 60, 80)]
    sup.on_checkpoint(CommitRecord(80, 0.0, 1.0, 1000), mine=True)  # once only
    assert capsys.readouterr().err == ""


def test_rank_0s_warnings_reach_the_console_and_status_once_per_run(tmp_path, capsys):
    """A loader dropped between runs was restarted with one warning in rank 0's log, which nobody reads (audit)."""
    from supervisor.protocol import NoteRecord, StepLogReader, note_line
    from supervisor.state import AttemptRecord
    from supervisor.supervise import MAX_NOTES

    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 1, "t": 1.0}\n' + note_line(NoteRecord("the checkpoint holds stateful 'loader'", 2.0)))
    records = StepLogReader(log).poll()
    assert records[1] == NoteRecord("the checkpoint holds stateful 'loader'", 2.0)
    sup, cfg = supervisor_over(tmp_path, keep=2, steps=())
    sup.record.step = 7
    for attempt in (1, 2):  # a relaunch repeats it: said once
        sup.on_records(records[1:], AttemptRecord(attempt, 0.0, None))
    err = capsys.readouterr().err
    assert err.count("attempt 1: rank 0 warns: the checkpoint holds stateful 'loader'") == 1 and "attempt 2" not in err
    assert sup.record.notes == [{"attempt": 1, "step": 7, "text": "the checkpoint holds stateful 'loader'"}]
    for i in range(2 * MAX_NOTES):
        sup.on_records([NoteRecord(f"note {i}", 3.0)], AttemptRecord(3, 0.0, None))
    assert [n["text"] for n in sup.record.notes] == [f"note {i}" for i in range(MAX_NOTES, 2 * MAX_NOTES)]
    from tests.runs import resilient, status

    out = subprocess.run(resilient("status", cfg.run_dir), capture_output=True, text=True, env=child_env(), timeout=60)
    assert f"warning   attempt 3: note {2 * MAX_NOTES - 1}" in out.stdout, out.stdout + out.stderr
    assert status(cfg.run_dir)["notes"][-1]["text"] == f"note {2 * MAX_NOTES - 1}"


def test_sigtstp_without_a_terminal_to_continue_the_supervisor_is_ignored_with_a_word(monkeypatch, capsys):
    """Under nohup &, setsid or systemd no shell could `fg` it: stopping would leave the run unwatched for good."""
    from supervisor.commands import run as run_cmd
    from supervisor.console import EventConsole

    monkeypatch.setattr(run_cmd, "foreground", lambda: False)
    stopped = []
    monkeypatch.setattr(run_cmd.os, "kill", lambda pid, sig: stopped.append(sig))
    run_cmd.on_suspend(EventConsole("job"))(signal.SIGTSTP, None)
    assert stopped == [] and "SIGTSTP ignored" in capsys.readouterr().err
    monkeypatch.setattr(run_cmd, "foreground", lambda: True)
    run_cmd.on_suspend(EventConsole("job"))(signal.SIGTSTP, None)
    assert stopped == [signal.SIGSTOP]


def test_the_librarys_warnings_reach_the_console_stamped_like_its_other_lines(capsys):
    """The replicator's warnings went through Python's last-resort handler: bare lines without the time and the
    job's name that every other console line has."""
    import logging

    from supervisor.console import EventConsole

    seen: list[str] = []

    class Caller(logging.Handler):  # the caller's own logging, on the root logger: it must see them too
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log, caller = logging.getLogger("resilient"), Caller(logging.WARNING)
    logging.getLogger().addHandler(caller)
    try:
        with EventConsole("job").library_warnings():
            log.warning("not replicating %s: %s", "step_000000040", "its marker is gone")
            log.info("a detail nobody asked for")
    finally:
        logging.getLogger().removeHandler(caller)
    err = capsys.readouterr().err
    assert re.fullmatch(r"\d\d:\d\d:\d\d job not replicating step_000000040: its marker is gone\n", err), err
    assert seen == ["not replicating step_000000040: its marker is gone"]
    assert log.handlers == [] and log.propagate, "the caller's logging is as it was"


def fake_attempt(tmp_path, job_text, handle, *, attempt=1, resumed_from=None, handover=None, stop_signal=None,
                 on_resumed=lambda *a: None, clock=None):
    """An Attempt of the job `job_text` over a fake torchrun `handle` (files under tmp_path, heartbeats in
    tmp_path/hb); returns it with its attempt record and run record."""
    from types import SimpleNamespace

    from supervisor.api import AttemptSpec
    from supervisor.attempt import Attempt
    from supervisor.config import load_job

    job = tmp_path / "job.yaml"
    job.write_text(job_text)
    cfg = load_job(str(job), [])
    logs, hb_dir = tmp_path / "logs" / f"attempt_{attempt}", tmp_path / "hb"
    hb_dir.mkdir(exist_ok=True)
    spec = AttemptSpec(attempt, resumed_from, None, logs, hb_dir, tmp_path / "steps.jsonl", tmp_path / "control.json")
    listener = SimpleNamespace(on_records=lambda *a: None, on_checkpoint=lambda *a, **k: None, on_tick=lambda: None,
                               on_resumed=on_resumed, stop_signal=lambda: stop_signal,
                               stop_signals_since=lambda: 0)
    console = SimpleNamespace(event=lambda text, style=None: None)
    rec = state.AttemptRecord(attempt=attempt, started_at=0.0, resumed_from_step=resumed_from)
    run = state.RunRecord(name="demo", run_dir=".", checkpoint_dir=str(cfg.checkpoint.dir))
    extra = {} if clock is None else {"clock": clock}
    return Attempt(cfg, spec, handover or Handover(), lambda *a: handle, console, rec, run, listener, **extra), rec, run


class SilentTorchrun(FakeHandle):
    """A torchrun that never exits and never starts a worker (the fake clock runs its startup allowance out)."""

    def wait(self, timeout):
        return None


@pytest.mark.parametrize(("endpoint", "reason"), [(None, api.HANG), ("127.0.0.1:1", api.RENDEZVOUS)])
def test_a_torchrun_with_no_workers_is_a_rendezvous_only_where_it_has_one(tmp_path, endpoint, reason):
    """A standalone torchrun has no rendezvous to wait in: no workers by startup_timeout_s is a hang, with its own
    state in the evidence. With an endpoint it is still in the rendezvous: no hang, no budget spent."""
    rdzv = f"rdzv: {{endpoint: '{endpoint}'}}\nnnodes: '1:2'\n" if endpoint else ""
    handle = SilentTorchrun(tmp_path / "logs" / "attempt_1" / "torchrun.log")
    handle.pid = __import__("os").getpid()  # a live process for the evidence's facts
    ticks = iter(range(10_000))
    attempt, _, _ = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\nheartbeat: "
                                 f"{{startup_timeout_s: 5}}\n{rdzv}", handle, clock=lambda: float(next(ticks)))
    outcome = attempt.run()
    logs = attempt.spec.logs_dir
    assert outcome.reason == reason, outcome
    evidence = logs / "hang_evidence.json"
    if reason == api.HANG:
        assert json.loads(evidence.read_text())["torchrun"]["pid"] == handle.pid
    else:
        assert not evidence.exists() and "torchrun started no workers in" in outcome.detail


def test_ranks_that_all_finished_under_a_torchrun_that_does_not_exit_end_the_attempt_as_finished(tmp_path):
    """Audit 8: a SIGSTOPped torchrun (or a frozen rank proxy it waits on) outlived ranks that had all finished: the
    run stayed `running` for good, and the user's SIGTERM then recorded it `stopped`, exit 143."""
    from supervisor.attempt import FINISHED_LINGER_S

    handle = SilentTorchrun(tmp_path / "logs" / "attempt_1" / "torchrun.log")
    handle.stops = []
    handle.stop = lambda grace_s: handle.stops.append(grace_s) or []
    hb_dir = tmp_path / "hb"
    hb_dir.mkdir()
    for rank in (0, 1):  # their processes are gone (no such pid)
        write_heartbeat(hb_dir, Heartbeat(rank, 2**22 - 2 - rank, attempt=1, world_size=2, step=120, phase="exited",
                                          exit_code=0, exit_reason="finished", first_step_at=1.0))
    ticks = iter(range(10_000))
    attempt, _, _ = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\nnproc_per_node: 2\n",
                                 handle, clock=lambda: float(next(ticks)))
    outcome = attempt.run()
    assert (outcome.reason, outcome.exit_code, outcome.step) == (api.FINISHED, 0, 120), outcome
    assert "torchrun did not exit after them" in outcome.detail and handle.stops
    assert FINISHED_LINGER_S <= next(ticks) <= FINISHED_LINGER_S + 10  # ended once the linger ran out, not before


class TorchrunGoneBeforeItsRanks(FakeHandle):
    """A stop in which torchrun has exited while its ranks still write their stop checkpoint: they end (their last
    heartbeat says so) only on the third look."""

    def __init__(self, log_path, heartbeat_dir):
        super().__init__(log_path, rc=None)
        self.heartbeat_dir, self.looks, self.signalled, self.lingering, self.graces = heartbeat_dir, 0, [], False, []

    def stop(self, grace_s):
        self.graces.append(grace_s)
        return []

    def wait(self, timeout):
        return 75 if self.signalled else None

    def signal_ranks(self, sig):
        self.signalled.append(sig)

    def alive(self):
        self.looks += 1
        if self.looks < 3 or self.lingering:
            return [object()]
        for rank in (0, 1):
            write_heartbeat(self.heartbeat_dir, Heartbeat(rank, 100 + rank, attempt=1, world_size=2, step=55,
                                                          phase="exited", exit_code=75, exit_reason="preempted"))
        return []


@pytest.mark.parametrize("tier", [None, "local"])
def test_a_stop_accounts_for_ranks_that_outlive_torchrun(tmp_path, tier):
    """The stop's ranks table and checkpoint note are from the ranks' last word once they have ended, not from
    the last poll: CI once showed both ranks 'train' at the stop step when torchrun left before them. With a local
    tier the stop's checkpoint is there (the note named an older durable one)."""
    from tests.ckpt_helpers import write_checkpoint

    hb_dir = tmp_path / "hb"
    hb_dir.mkdir()
    for rank in (0, 1):
        write_heartbeat(hb_dir, Heartbeat(rank, 100 + rank, attempt=1, world_size=2, step=49, phase="train",
                                          time=time.time(), progress_at=time.time()))
    handle = TorchrunGoneBeforeItsRanks(tmp_path / "logs" / "attempt_1" / "torchrun.log", hb_dir)
    local = tmp_path / "local"
    attempt, _, run = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\nnproc_per_node: 2\n",
                                   handle, handover=Handover(ckpt_local_dir=str(local) if tier else None),
                                   stop_signal=signal.SIGHUP)
    write_checkpoint(attempt.cfg.checkpoint.dir, 40)
    if tier:
        write_checkpoint(local, 55)
    outcome = attempt.run()
    logs = attempt.spec.logs_dir
    assert outcome.reason == api.STOPPED and outcome.step == 55, outcome
    assert outcome.detail.endswith("newest valid checkpoint: 55 (in the local tier)" if tier else
                                   "newest valid checkpoint: 40 (none at the stop step 55: see the ranks' logs in "
                                   f"{logs})"), outcome.detail
    assert handle.signalled[0] == signal.SIGTERM
    assert {(r["rank"], r["step"], r["phase"]) for r in run.ranks} == {(0, 55, "exited"), (1, 55, "exited")}


def test_ranks_that_resume_at_the_last_step_and_end_at_once_are_followed_to_the_step_they_loaded(tmp_path):
    """Handed the durable step 280 and local step 400, the ranks took 400 from the local tier and finished there
    before any poll saw them train: the history said resumed from 280 and goodput charged 120 steps as lost."""
    hb_dir = tmp_path / "hb"
    hb_dir.mkdir()
    for rank in (0, 1):
        write_heartbeat(hb_dir, Heartbeat(rank, 100 + rank, attempt=2, world_size=2, step=400, phase="exited",
                                          started_at=time.time(), exit_code=0, exit_reason="finished",
                                          resumed_from=400, resumed_tier="local",
                                          resumed_why="every node holds step 400 whole"))
    resumed = []
    handover = Handover(ckpt_local_dir=str(tmp_path / "local"), resume_step=280, local_resume_step=400)
    attempt, rec, _ = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\nnproc_per_node: 2\n",
                                   FakeHandle(tmp_path / "logs" / "attempt_2" / "torchrun.log"), attempt=2,
                                   resumed_from=280, handover=handover, on_resumed=lambda *a: resumed.append(a[:2]))
    outcome = attempt.run()
    assert outcome.reason == api.FINISHED, outcome
    assert (rec.resumed_from_step, rec.resumed_tier) == (400, "local") and resumed == [(400, "local")]


def test_run_refuses_a_run_dir_that_holds_another_jobs_run(tmp_path, cli, monkeypatch):
    """Another job in a run dir resumed from checkpoints of another model: every attempt failed to load them and
    the restart budget went (a reviewer's run). A renamed job is let in with --set name=..."""
    launched = []
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launched.append(1))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text(json.dumps({"schema_version": 1, "job": {"name": "tiny-cpu"}}))
    job = tmp_path / "job.yaml"
    job.write_text("name: my-script\nentrypoint: {module: train_entry}\n")
    result = cli("run", job, "--run-dir", run_dir)
    assert result.exit_code == 2 and launched == [], result.output
    assert result.stderr == (f"resilient: {run_dir} holds the run of job 'tiny-cpu' (its job.json), not 'my-script'; "
                             "nothing was launched. Give this job a run dir of its own (--run-dir), or, if it is the "
                             "same job renamed, run it with --set name=tiny-cpu.\n")
    assert sorted(p.name for p in run_dir.iterdir()) == ["job.json"]


def test_run_says_a_run_dir_that_is_a_file_is_not_a_folder_without_asking_to_remount_it(tmp_path, cli):
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\n")
    (tmp_path / "file").write_text("")
    result = cli("run", job, "--run-dir", tmp_path / "file")
    assert result.exit_code == 2 and "not a folder" in result.stderr and "remount" not in result.stderr, result.output
    assert result.stderr.rstrip().endswith("nothing was launched. Pick another --run-dir."), result.stderr


def test_run_says_a_rendezvous_backend_one_node_does_not_use(tmp_path, cli, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\nrdzv: {backend: etcd}\n")
    monkeypatch.setattr("supervisor.commands.run.make_launcher",
                        lambda: lambda cfg, spec, handover: FakeHandle(spec.logs_dir / "torchrun.log"))
    r = cli("run", job)
    assert r.exit_code == 0 and "rdzv.backend etcd is not used: one node without rdzv.endpoint runs torchrun " \
        "--standalone" in r.output, r.output


class TorchrunOutlivesTheGrace(TorchrunGoneBeforeItsRanks):
    def wait(self, timeout):
        time.sleep(min(timeout, 0.1))
        return None


def test_a_second_stop_signal_is_acknowledged_and_the_first_keeps_the_exit_code(tmp_path):
    """Audit 8: a second Ctrl-C during a long stop met silence, and the exit code followed the last signal (130 after
    a SIGTERM then a SIGINT, where a wrapper maps 143 to a requeue)."""
    from types import SimpleNamespace

    from supervisor.supervise import Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup._stop_signal, sup._stops_since = None, 0
    sup.request_stop(signal.SIGTERM)
    sup.request_stop(signal.SIGINT)
    assert sup.stop_signal() == signal.SIGTERM and sup.stop_signals_since() == 1
    handle = TorchrunGoneBeforeItsRanks(tmp_path / "logs" / "attempt_1" / "torchrun.log", tmp_path / "hb")
    waits = iter([None, None, None, 75])
    handle.wait = lambda timeout: next(waits, 75)
    attempt, _, _ = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\nnproc_per_node: 2\n",
                                 handle, stop_signal=signal.SIGTERM)
    said: list[str] = []
    attempt.console = SimpleNamespace(event=lambda text, style=None: said.append(text))
    repeats = iter([0, 0, 1, 1, 1])
    attempt.listener.stop_signals_since = lambda: next(repeats, 1)
    assert attempt.run().reason == api.STOPPED
    assert [t for t in said if t.startswith("already stopping: the ranks have up to")] == [said[1]], said


@pytest.mark.parametrize("handle_type", [TorchrunGoneBeforeItsRanks, TorchrunOutlivesTheGrace])
def test_a_rank_that_outlives_the_stops_grace_gets_no_second_grace(tmp_path, handle_type):
    """The stop waits for the ranks up to its grace; the SIGKILL of what lingers comes then, not after another
    whole stop_timeout_s (twice the grace overran a scheduler's kill wait), nor after a hang's 5 s when torchrun
    itself is still there."""
    handle = handle_type(tmp_path / "logs" / "attempt_1" / "torchrun.log", tmp_path / "hb")
    handle.lingering = True
    attempt, _, _ = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\nnproc_per_node: 2\n"
                                 "stop_timeout_s: 1\n", handle, stop_signal=signal.SIGTERM)
    started = time.monotonic()
    outcome = attempt.run()
    assert outcome.reason == api.STOPPED and time.monotonic() - started < 6 + 1
    assert handle.graces == [0.0] or handle.graces[0] < 0.5, handle.graces


def test_a_full_disk_note_advises_a_lower_keep_only_where_there_is_more_than_one_checkpoint(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from supervisor import attempt
    from tests.ckpt_helpers import write_checkpoint

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _root: usage(30_000_000, 29_999_000, 1000))
    write_checkpoint(tmp_path, 10)
    assert attempt.disk_note(tmp_path).endswith("(free space there)")  # keep cannot go below the one there is
    write_checkpoint(tmp_path, 20)
    assert attempt.disk_note(tmp_path).endswith("(free space there, or lower checkpoint.keep)")


def test_a_process_that_ends_while_the_group_is_signalled_does_not_end_the_stop(tmp_path, monkeypatch):
    """Between listing the live processes and asking each for its group, one may exit: the stop goes on and
    still kills the rest (CI once ended a supervisor here with a ProcessLookupError traceback and exit 1)."""
    from supervisor.launch import TorchrunProcess

    # a process that left torchrun's group, as a prewarmed rank does, and so is signalled one by one
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], " \
           "start_new_session=True); time.sleep(60)"
    proc = TorchrunProcess([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, tmp_path / "log")
    try:
        deadline = time.monotonic() + 20
        while len(proc.alive()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            proc.track()
        assert len(proc.alive()) == 2, "the stand-in and its child never both started"
        real = os.getpgid

        def gone_unless_torchrun(pid):  # the child exits just after alive() listed it
            if pid != proc.pid:
                raise ProcessLookupError(3, "No such process")
            return real(pid)

        monkeypatch.setattr("supervisor.launch.os.getpgid", gone_unless_torchrun)
        assert proc.stop(grace_s=0.5) == []
        assert proc.alive() == []
    finally:
        monkeypatch.undo()
        for p in proc.alive():
            p.kill()
        proc.close()


def test_a_whole_checkpoint_whose_names_or_shapes_differ_is_passed_over_at_once_not_retried():
    """A size mismatch is the code's or the model's, never a passing fault: its retry cost an attempt per
    checkpoint (audit: a changed model took four attempts to stop)."""
    p = RestartPolicy(RestartConfig(backoff_s=0))
    mismatch = api.AttemptOutcome(api.CHECKPOINT_LOAD, "rank 0 could not load the checkpoint: step 40: ValueError: "
                                  "Size mismatch between saved torch.Size([64]) and current: torch.Size([32]) for w",
                                  0, 74, None, checkpoint_step=40)
    d = p.decide(mismatch, progressed=False, newest_valid=40, older_valid=20,
                 load=LoadFailure(40, None, older_valid=20))
    assert d.relaunch and d.quarantine_step == 40 and d.quarantine_once_older_loads and d.resume_below == 40
    assert "its names or shapes are not this run's" in d.quarantine
    d = RestartPolicy(RestartConfig(backoff_s=0)).decide(load_failed(40), progressed=False, newest_valid=40,
                                                         older_valid=20, load=LoadFailure(40, None, older_valid=20))
    assert d.relaunch and d.quarantine_step is None  # another error: one more try, as before


def test_ranks_that_stopped_for_a_preemption_in_a_script_that_exits_0_are_relaunched_not_finished():
    """Audit: a script that dropped finish()'s return code turned a stop that reached its ranks into 'finished at
    step 30' of 60, exit 0; the ranks' own last heartbeats said 75."""
    beats = {r: hb(r, phase="exited", step=30, exit_code=EXIT_PREEMPTED, exit_reason="preempted") for r in (0, 1)}
    out = classify.classify(0, "", beats)
    assert out.reason == api.PREEMPTED and out.step == 30, out
    assert "end it with sys.exit(session.finish(step, state))" in out.detail
    done = {r: hb(r, phase="exited", step=60, exit_code=0) for r in (0, 1)}
    assert classify.classify(0, "", done).reason == api.FINISHED


def test_the_records_step_never_falls_back_to_a_lagging_beat_but_does_after_an_in_place_regroup(tmp_path):
    """Audit 13: status showed progress below the checkpoint just committed (a beat lags the step log); review 11:
    a group torchrun re-formed in place resumes below the old group's step, and the record must follow it."""
    from supervisor.watch import RankWatch

    handle = FakeHandle(tmp_path / "logs" / "attempt_1" / "torchrun.log")
    attempt, _, run = fake_attempt(tmp_path, "name: demo\nentrypoint: {module: train_entry}\n", handle)
    watch = RankWatch(0.0, 60.0, 60.0)

    def seen(step: int, pids: tuple[int, ...] = (11, 12)) -> int | None:
        beats = {r: Heartbeat(rank=r, pid=pid, phase="train", step=step, first_step_at=1.0)
                 for r, pid in enumerate(pids)}
        attempt._follow_group(beats)
        attempt._update_ranks(beats, watch, 1.0)
        return run.step

    assert seen(200) == 200
    run.step = 220  # the step log's newer word
    assert seen(214) == 220 and seen(230) == 230
    assert seen(180, pids=(21, 22)) == 180  # a new group (other pids) resumed from step 180


def test_a_restarted_supervisor_takes_up_its_nodes_durable_outage(tmp_path):
    """Review 12: the outage's length was to carry over to the node's next supervisor, but the record it read from
    was the new one, which never held the tiers: a supervisor restarted within the hour never reached
    durable_outage_s. Through the real Supervisor and state file."""
    import json
    import time

    from supervisor.config import load_job
    from supervisor.console import EventConsole
    from supervisor.layout import RunLayout
    from supervisor.state import ReplicationState
    from supervisor.supervise import Supervisor

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\ncheckpoint: {local_dir: local}\n")
    cfg = load_job(job)
    layout = RunLayout(cfg.run_dir, None)
    layout.node_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    rec = state.RunRecord(name="demo", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.STOPPED)
    rec.replication = ReplicationState("local", "checkpoints", failing_since=now - 7200, last_error="step 10: full") \
        .to_dict()
    state.write(layout.state_file, rec)
    doc = json.loads(layout.state_file.read_text())
    doc["updated_at"] = now - 60  # its supervisor's last word
    layout.state_file.write_text(json.dumps(doc))
    sup = Supervisor(cfg, layout, launcher=lambda *a: None, console=EventConsole("demo"))
    assert sup.replicator is not None and 7100 < sup.replicator._outage_before < 7180
    assert sup.replicator.state.failing_since is None  # nothing in force until a copy fails here too


def test_the_records_step_is_not_a_rank_starting_up_or_loading():
    """Audit 16: "step 0" while a resumed run's ranks loaded, their beats in `startup` and `load` saying step 0."""
    from types import SimpleNamespace

    from supervisor.attempt import Attempt

    me = SimpleNamespace(run_record=SimpleNamespace(step=253), _step_shown=False)
    Attempt._show_step(me, {0: hb(0, phase="startup", step=0), 1: hb(1, phase="load", step=0)})
    assert me.run_record.step == 253 and not me._step_shown
    Attempt._show_step(me, {0: hb(0, phase="train", step=254), 1: hb(1, phase="load", step=0)})
    assert me.run_record.step == 254


def test_a_checkpoint_set_aside_is_no_longer_the_records_last_valid_one(tmp_path):
    """Audit 17: after a NaN's rollback set step 100 aside, status went on saying "last valid checkpoint 100 (not
    valid on disk now: gone)"."""
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor

    _, cfg = supervisor_over(tmp_path, keep=3, steps=(50, 100))
    sup = Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None)
    sup.record.last_checkpoint_step = 100
    sup.resume.quarantine(cfg.checkpoint.dir / "step_000000100", "the loss became non-finite after it")
    assert sup.record.last_checkpoint_step == 50 and sup.record.quarantined[0]["step"] == 100
    # another node's supervisor set it aside first: nothing to say, nothing recorded here (review 15: "could not set
    # it aside; it stays where it is")
    assert sup.resume.quarantine(cfg.checkpoint.dir / "step_000000100", "again") is None
    assert len(sup.record.quarantined) == 1


def test_the_records_last_checkpoint_counts_the_local_tier_when_a_supervisor_died_or_a_step_is_set_aside(tmp_path):
    """With a local tier ahead of the durable one: a killed supervisor's open attempt is settled at the newest step
    in either tier (status said the durable one, behind by the replication lag), and a step set aside leaves the
    newest in either tier as the record's last valid checkpoint."""
    import time

    from supervisor.config import load_job
    from supervisor.console import EventConsole
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor
    from tests.ckpt_helpers import write_checkpoint

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\ncheckpoint: {local_dir: local}\n")
    cfg = load_job(job)
    layout = RunLayout(cfg.run_dir, None)
    layout.node_dir.mkdir(parents=True, exist_ok=True)
    local = cfg.checkpoint.local_root(layout.node_name)
    assert local is not None
    write_checkpoint(cfg.checkpoint.dir, 20)
    for step in (20, 40, 60):
        write_checkpoint(local, step)
    rec = state.RunRecord(name="demo", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING)
    rec.history = [state.AttemptRecord(attempt=1, started_at=time.time() - 60, resumed_from_step=None)]
    rec.attempt, rec.step, rec.last_checkpoint_step = 1, 45, 20  # its supervisor's last word, then kill -9
    state.write(layout.state_file, rec)
    sup = Supervisor(cfg, layout, launcher=lambda *a: None, console=EventConsole("demo"))
    assert sup.record.last_checkpoint_step == 60
    sup.resume.quarantine(local / "step_000000060", "the loss became non-finite after it")
    assert sup.record.last_checkpoint_step == 40


def test_a_resume_from_an_older_local_step_passes_over_this_nodes_newer_ones(tmp_path):
    """Review 16: after the ranks resumed from local step 10 (the newest every node held), this node's 20 and 30 of
    the training left were still copied to the durable tier, ahead of the new training's own saves."""
    import time

    from supervisor.config import load_job
    from supervisor.console import EventConsole
    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor
    from tests.ckpt_helpers import write_checkpoint

    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nentrypoint: {module: train_entry}\ncheckpoint: {local_dir: local}\n")
    cfg = load_job(job)
    sup = Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None, console=EventConsole("demo"))
    assert sup.replicator is not None and sup.local_root is not None
    for step in (10, 20, 30):
        write_checkpoint(sup.local_root, step)
    sup.replicator.notify(20)
    sup.replicator.notify(30)
    sup.on_resumed(10, "local", launched_at=time.time() + 1)
    assert {20, 30} <= sup.replicator._unusable and not sup.replicator.snapshot()["pending"]


def test_a_stop_before_any_checkpoint_says_a_rerun_starts_afresh(tmp_path, capsys):
    """Audit 19: "stopped by SIGTERM ...; `resilient run` again resumes", with no checkpoint to resume from."""
    import signal

    from supervisor.layout import RunLayout
    from supervisor.supervise import Supervisor
    from tests.ckpt_helpers import write_checkpoint

    _, cfg = supervisor_over(tmp_path, keep=3, steps=())
    sup = Supervisor(cfg, RunLayout(cfg.run_dir, None), launcher=lambda *a: None)
    sup.request_stop(signal.SIGTERM)
    sup._stopped(None)
    assert "stopped by SIGTERM; `resilient run` again starts afresh (no valid checkpoint)" in capsys.readouterr().err
    write_checkpoint(cfg.checkpoint.dir, 20)
    sup._stopped(None)
    assert "stopped by SIGTERM; `resilient run` again resumes" in capsys.readouterr().err
