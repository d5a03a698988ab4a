"""`resilient run jobs/tiny-cpu.yaml` for real: torchrun, 2 gloo ranks, real signals, real DCP files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from supervisor import prewarm, store
from supervisor.protocol import CommitRecord, SaveRecord, pid_running, read_step_log
from tests.ckpt_helpers import assert_same_training_state
from tests.proc import REPO, Proc, child_env, started, wait_for
from tests.runs import JOB, RUN_TIMEOUT, live_ranks, rank_log, resilient, run_job, state, status

pytestmark = pytest.mark.slow

def test_sigkill_of_a_random_worker_at_a_random_moment(tmp_path, rng):
    run_dir = tmp_path / "run"
    kill_at = rng.randint(5, 45)  # the random moment, within training (the run ends at 100)
    with started(run_job(run_dir, steps=100), tmp_path, log=tmp_path / "sup.log") as sup:
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=kill_at), 90, f"both ranks past step {kill_at}")
        victim = rng.choice(ranks)
        before = store.latest_valid(run_dir / "checkpoints")
        os.kill(victim["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        console = sup.output()
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and doc["restarts"] == 1
    first, second = doc["history"][0], doc["history"][1]
    assert first["reason"] == "worker_signal" and first["failed_rank"] == victim["rank"], first
    assert "SIGKILL" in first["detail"]
    # The resume step is the newest valid checkpoint when the attempt failed (a save in flight at the
    # kill may still have committed, if the victim had already written its share); the ranks say what
    # they loaded in their own log.
    resumed = second["resumed_from_step"]
    loaded = rank_log(run_dir, 2, 0)
    assert (f"resumed from step {resumed} " if resumed is not None else "no checkpoint to resume from") in loaded
    floor = before.step if before else None
    assert resumed == floor or (resumed is not None and resumed == (floor or 0) + 20), (resumed, floor)
    assert (f"resuming from step {resumed}" if resumed is not None else "starting fresh") in console
    assert "worker_signal" in console and "finished at step 100" in console
    assert store.latest_valid(run_dir / "checkpoints").step == 100


@pytest.mark.parametrize("timeout_s, stall_factor, detect_within_s", [(6.0, None, 8.0), (60.0, 10, 15.0)],
                         ids=["fixed-timeout", "stall-factor"])
def test_sigstop_is_a_hang_detected_within_the_timeout_with_a_stack_dump(tmp_path, timeout_s, stall_factor,
                                                                         detect_within_s):
    """With `stall_factor`, the limit comes from the measured step time: seconds, well inside `timeout_s`."""
    run_dir = tmp_path / "run"
    sets = [f"heartbeat.timeout_s={timeout_s}", "heartbeat.interval_s=0.5"]
    if stall_factor is not None:
        sets.append(f"heartbeat.stall_factor={stall_factor}")
    with started(run_job(run_dir, *sets, steps=100), tmp_path, log=tmp_path / "sup.log") as sup:
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=25), 90, "training past step 25")
        victim = ranks[1]
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: "hang —" in sup.output(), timeout_s + 30, "the hang to be reported")
        detected_in = time.monotonic() - stopped_at
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    assert detected_in <= detect_within_s, f"hang detected after {detected_in:.1f}s"
    limits = {r["hang_limit_s"] for r in ranks}
    if stall_factor is None:
        assert limits == {timeout_s}
    else:
        assert all(1.5 <= v < detect_within_s for v in limits), limits  # floor: 3 beats of 0.5 s
    doc = status(run_dir)
    hang = doc["history"][0]
    assert hang["reason"] == "hang" and hang["failed_rank"] == victim["rank"], hang
    evidence = json.loads((Path(hang["log_dir"]) / "hang_evidence.json").read_text())
    victim_facts = next(r for r in evidence["ranks"] if r["rank"] == victim["rank"])
    assert victim_facts["status"] == "stopped" and victim_facts.get("stack_dump"), victim_facts
    stderr = (run_dir / victim_facts["stderr"]).read_text()  # recorded relative to the run dir
    assert "most recent call first" in stderr and "train_entry" in stderr
    assert doc["state"] == "succeeded"
    # The stall is no useful training: it is `stalled_s` where the continued ranks stepped on and saved, else
    # in attempt 1's tail or its lost steps.
    acct = state(run_dir)["accounting"]
    a1 = acct["ledger"]["attempts"][0]
    not_useful = acct["summary"]["stalled_s"] + (a1["ended_at"] - a1["last_step_at"]) + a1["lost_s"]
    assert not_useful >= detected_in - 2.0, (acct["summary"], a1, detected_in)


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous(tmp_path):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, steps=60, extra_args=("--test-save-pause", "mid_data:5@40", "--test-attempts", "1"))
    partial = run_dir / "checkpoints" / store.partial_dirname(40)
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        # The paused save holds the ranks in phase `save` from step 60 on: alive in any phase will do.
        ranks = wait_for(lambda: (partial / "__1_0.distcp").exists() and live_ranks(run_dir, phase=None), 90,
                         "the save of step 40")
        os.kill(ranks[0]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        console = sup.output()
    doc = status(run_dir)
    assert doc["history"][1]["resumed_from_step"] == 20
    assert doc["history"][1]["resumed_tier"] is None  # one tier: nothing to choose, nothing to say
    assert "resuming from step 20" in console
    assert "skipping step_000000040.partial: incomplete: partial save, never committed" in console
    assert store.inspect(run_dir / "checkpoints" / store.step_dirname(40)).valid


def prewarm_server(sup_pid: int) -> psutil.Process | None:
    """The supervisor's prewarm server once it listens (it binds its socket when its imports are done)."""
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(sup_pid).children():
            if "supervisor.prewarm" in " ".join(p.cmdline()) and any(
                    "resilient-prewarm" in str(c.laddr) for c in p.net_connections("unix")):
                return p
    return None


def relaunch_on_a_forked_torchrun(sup: Proc, run_dir: Path) -> psutil.Process:
    """Kill a rank once the prewarm server is ready and a checkpoint committed; return attempt 2's torchrun, a
    fork of that server."""
    wait_for(lambda: live_ranks(run_dir, min_step=5) and store.latest_valid(run_dir / "checkpoints"), 90,
             "training past the first checkpoint")
    server = wait_for(lambda: prewarm_server(sup.pid), 90, "the prewarm server")
    os.kill(live_ranks(run_dir)[1]["pid"], signal.SIGKILL)
    wait_for(lambda: state(run_dir).get("attempt") == 2 and live_ranks(run_dir), 90, "attempt 2 training")
    return forked_torchrun(server)


def forked_torchrun(server: psutil.Process) -> psutil.Process:
    """The one torchrun the prewarm server forked (the parent of the ranks' proxies), in a session of its own."""
    torchruns = [p for p in server.children()
                 if any("supervisor.prewarm_client" in " ".join(c.cmdline()) for c in p.children())]
    assert len(torchruns) == 1 and os.getpgid(torchruns[0].pid) == torchruns[0].pid, torchruns
    return torchruns[0]


@pytest.mark.matrix
def test_a_hangup_of_the_supervisor_checkpoints_exits_143_and_a_rerun_resumes(tmp_path):
    """SIGHUP (the terminal of `resilient run` closed) stops like SIGTERM, whose own tests are the stopped rank's
    below and Slurm's scancel. On a relaunched attempt, whose torchrun is a fork of the prewarm server (attempt 1's
    stop is in test_checkpoint_faults_e2e's damaged-checkpoints test)."""
    run_dir = tmp_path / "run"
    with started(run_job(run_dir, steps=120), tmp_path, log=tmp_path / "sup1.log") as sup:
        relaunch_on_a_forked_torchrun(sup, run_dir)
        wait_for(lambda: live_ranks(run_dir, min_step=state(run_dir)["history"][-1]["resumed_from_step"] + 5), 90,
                 "attempt 2 past its resume step")
        signalled_at = time.time()
        sup.signal(signal.SIGHUP)
        assert sup.wait(60) == 143, sup.output()[-3000:]
        took = time.time() - signalled_at
        assert sup.alive_descendants() == []
    doc = status(run_dir)
    assert doc["state"] == "stopped"
    stop_step = doc["step"]
    attempt = state(run_dir)["attempt"]
    # A plain string: pytest prints it whole (a tuple's repr is cut in the middle, which hid all of this once).
    torchrun_log = (run_dir / "logs" / f"attempt_{attempt}" / "torchrun.log").read_text(errors="replace")
    why = "\n".join([f"the stop took {took:.1f}s; {doc['history'][-1].get('detail')}",
                     f"ranks: {[(r['rank'], r['step'], r['phase'], r['pid']) for r in doc['ranks']]}",
                     f"checkpoints: {sorted(p.name for p in (run_dir / 'checkpoints').iterdir())}",
                     "torchrun's log (its own lines):",
                     *[line for line in torchrun_log.splitlines() if (line[:1] in "EWI" and line[1:5].isdigit())
                       or "exitcode" in line][:16],
                     *(f"rank {r}'s {stream}:\n{rank_log(run_dir, attempt, r, stream)[-1200:]}"
                       for r in (0, 1) for stream in ("stderr", "stdout")),
                     "the supervisor's console:", sup.output()[-2000:]])
    # The ranks table holds their last word (it showed the last poll's step, in phase train).
    assert {(r["step"], r["phase"], r["alive"]) for r in doc["ranks"]} == {(stop_step, "exited", False)}, why
    # The ranks agree on a stop only at their next agreement, which may fall on an interval step: what
    # shows the stop's own checkpoint is that it was committed after the signal, at the stop step.
    latest = store.latest_valid(run_dir / "checkpoints", deep=True)
    assert latest.step == stop_step and latest.created_at > signalled_at, f"{latest.step} != {stop_step}\n{why}"
    with started(run_job(run_dir, steps=120, sleep=0.0), tmp_path, log=tmp_path / "sup2.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        assert f"resuming from step {stop_step}" in sup.output()


def test_ranks_still_running_when_the_stop_grace_runs_out_have_their_stacks_taken_before_the_kill(tmp_path):
    """A stop whose checkpoint cannot finish within the grace (here a save paused for two minutes): the ranks are
    SIGKILLed, but first their stacks go to their logs and the evidence file, as for a hang. Twice in CI the ranks
    hung or died silently in a stop (most likely a handler that took a lock, fixed since) and nothing said where."""
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, "stop_timeout_s=6", "checkpoint.interval_steps=100000", steps=400,
                   extra_args=("--test-save-pause", "mid_data:120"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        wait_for(lambda: live_ranks(run_dir, min_step=5), 90, "training")
        sup.signal(signal.SIGTERM)
        assert sup.wait(60) == 143, sup.output()[-3000:]
        assert sup.alive_descendants() == []
        console = sup.output()
    doc = status(run_dir)
    last = doc["history"][-1]
    assert "the grace period ran out" in last["detail"] and "stacks of the ranks that did not stop" in last["detail"]
    assert "SIGTERM: rank(s) [0, 1] still running after the grace; capturing stacks" in console, console
    evidence = json.loads((Path(last["log_dir"]) / "hang_evidence.json").read_text())
    assert {(h["rank"], h["kind"], h["phase"]) for h in evidence["hangs"]} == {(0, "stop_ignored", "save"),
                                                                               (1, "stop_ignored", "save")}, evidence
    for facts in evidence["ranks"]:
        assert facts.get("stack_dump"), facts
        dump = (run_dir / facts["stderr"]).read_text()
        assert "most recent call first" in dump and "in maybe" in dump, dump[-2000:]  # the test pause's frame


@pytest.mark.parametrize("forked", [False, True], ids=["cold-ranks", "prewarmed-ranks"])
def test_sigterm_with_a_stopped_rank_continues_it_and_checkpoints_within_the_grace(tmp_path, forked):
    """A rank stopped by SIGSTOP (or a debugger) when the supervisor is asked to stop: it is continued with the
    SIGTERM, so the group checkpoints at its stop step within the grace (it once stayed stopped through the whole
    grace, then got a second one, and the console named an older checkpoint than the one the ranks committed).
    A prewarmed rank (the default, from the first attempt on) is a fork of the prewarm server, which both signals
    reach only through its proxy; RESILIENT_PREWARM=0 starts the ranks as torchrun's own children."""
    run_dir = tmp_path / "run"
    env = child_env() if forked else child_env(RESILIENT_PREWARM="0")
    with started(run_job(run_dir, steps=400), tmp_path, env=env, log=tmp_path / "sup.log") as sup:
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=25), 90, "training past the first checkpoint")
        assert prewarm.forked_by_server(psutil.Process(ranks[1]["pid"])) == forked
        os.kill(ranks[1]["pid"], signal.SIGSTOP)
        signalled_at = time.monotonic()
        sup.signal(signal.SIGTERM)
        assert sup.wait(60) == 143, sup.output()[-3000:]
        took = time.monotonic() - signalled_at
        assert sup.alive_descendants() == []
    doc = status(run_dir)
    detail = doc["history"][-1]["detail"]
    assert doc["state"] == "stopped" and "torchrun exited" in detail and "none at the stop step" not in detail, detail
    assert store.latest_valid(run_dir / "checkpoints").step == doc["step"]
    assert took < 20, f"the stop took {took:.1f}s, the job's stop_timeout_s is 20"


def test_kill_9_of_the_supervisor_leaves_no_worker_and_a_rerun_finishes(tmp_path):
    """On a relaunched attempt, whose torchrun is a fork of the prewarm server (attempt 1's, a zygote, is
    killed with its supervisor in test_checkpoint_faults_e2e, mid-save)."""
    run_dir = tmp_path / "run"
    attempt = 2
    sup = Proc(run_job(run_dir, steps=80), tmp_path, log=tmp_path / "sup1.log")
    try:
        torchrun = relaunch_on_a_forked_torchrun(sup, run_dir)
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=10), 90, "training")
        workers = [psutil.Process(r["pid"]) for r in ranks] + [torchrun]
        os.kill(sup.pid, signal.SIGKILL)
        _gone, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == [], f"workers alive 10 s after kill -9 of the supervisor: {alive}"
        wait_for(lambda: not [p for p in sup.alive_descendants() if p.pid != sup.pid], 10, "torchrun to exit")
    finally:
        sup.kill_all()
    # Before any rerun, status tells where the ranks left the run, not the dead supervisor's last snapshot (it
    # showed the ranks training steps back, an older checkpoint, and the attempt as still running).
    doc = status(run_dir)
    newest = store.latest_valid(run_dir / "checkpoints")
    assert doc["state"] == "stopped" and doc["history"][-1]["reason"] == "supervisor_lost", doc
    assert doc["last_checkpoint_step"] == newest.step, (doc["last_checkpoint_step"], newest.step)
    assert doc["step"] == max(r["step"] for r in doc["ranks"]) >= newest.step, doc["ranks"]
    assert {r["phase"] for r in doc["ranks"]} == {"exited"}, doc["ranks"]
    with started(run_job(run_dir, steps=80, sleep=0.0), tmp_path, log=tmp_path / "sup2.log") as sup2:
        assert sup2.wait(RUN_TIMEOUT) == 0, sup2.output()[-3000:]
        console = sup2.output()
    doc = status(run_dir)
    assert doc["state"] == "succeeded"
    assert f"goodput {doc['goodput']:.1%}" in console, (doc["goodput"], console[-500:])  # the same books, closed
    assert [h["reason"] for h in doc["history"][attempt - 1:]] == ["supervisor_lost", "finished"], doc["history"]
    # The lost attempt's step is the last its step log records, and its ledger entry is closed.
    lost = doc["history"][attempt - 1]
    assert lost["step_at_failure"] is not None and lost["step_at_failure"] >= 10, lost
    assert state(run_dir)["accounting"]["ledger"]["attempts"][attempt - 1]["ended_at"] is not None


def test_a_rerun_stops_a_forked_rank_that_outlived_a_killed_supervisor_before_relaunching(tmp_path):
    """A stopped rank (SIGSTOP) cannot end itself when its supervisor dies. On a relaunched attempt it is a fork
    of the prewarm server, whose command line names no training script: the rerun knows it by its pid and its
    start time, continues and stops it, and only then launches."""
    run_dir = tmp_path / "run"
    sup = Proc(run_job(run_dir, steps=80), tmp_path, log=tmp_path / "sup1.log")
    stopped = None
    try:
        relaunch_on_a_forked_torchrun(sup, run_dir)
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=10), 90, "attempt 2 training")
        stopped = psutil.Process(ranks[1]["pid"])
        assert "supervisor.prewarm" in " ".join(stopped.cmdline())
        stopped.suspend()
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(30)
        with started(run_job(run_dir, steps=80, sleep=0.0), tmp_path, log=tmp_path / "sup2.log") as sup2:
            assert sup2.wait(RUN_TIMEOUT) == 0, sup2.output()[-3000:]
            out = sup2.output()
        assert f"rank(s) left by a previous supervisor: [{ranks[0]['pid']}, {stopped.pid}]" in out or \
            f"rank(s) left by a previous supervisor: [{stopped.pid}]" in out, out[-3000:]
        assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE
        assert out.index("left by a previous supervisor") < out.index("attempt 3")
    finally:
        if stopped is not None:
            with contextlib.suppress(psutil.Error):
                stopped.kill()
        sup.kill_all()


def test_a_prewarm_server_killed_mid_attempt_costs_no_restart(tmp_path):
    """An OOM kill of the server while its forks train (the relaunched torchrun and both ranks): they ran on, but
    each was reported exit 1, its status lost with the server, so an attempt whose ranks finished failed and a
    restart was spent resuming at the final step."""
    run_dir = tmp_path / "run"
    with started(run_job(run_dir, steps=120, sleep=0.05), tmp_path, log=tmp_path / "sup.log") as sup:
        torchrun = relaunch_on_a_forked_torchrun(sup, run_dir)
        server = torchrun.parent()
        ranks = live_ranks(run_dir)
        assert all(psutil.Process(r["pid"]).ppid() == server.pid for r in ranks), ranks
        server.kill()
        wait_for(lambda: not pid_running(server.pid), 10, "the server gone")
        assert all(psutil.Process(r["pid"]).is_running() for r in ranks)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and doc["restarts"] == 1 and doc["step"] == 120, doc["history"]
    assert [h["reason"] for h in doc["history"]] == ["worker_signal", "finished"], doc["history"]


@pytest.mark.matrix
def test_relaunches_on_prewarmed_workers_resume_bitwise_exact(tmp_path):
    """Two SIGKILLs: attempt 3's ranks are forks of the prewarm server, and the final model and optimizer
    equal those of an uninterrupted run, tensor by tensor; every checkpoint written verifies byte for byte."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with started(run_job(straight, steps=80, sleep=0.0), tmp_path, log=tmp_path / "straight.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    # One worker group made every save of the uninterrupted run, async: a stager reused across saves.
    records = read_step_log(straight / "steps" / "attempt_1.jsonl")
    saves = [r.step for r in records if isinstance(r, SaveRecord)]
    commits = [r.step for r in records if isinstance(r, CommitRecord)]
    assert saves == commits == list(range(20, 81, 20)) and len(status(straight)["history"]) == 1

    def attempt_ranks(attempt: int, min_step: int = 0) -> list[dict]:
        return live_ranks(killed, min_step) if state(killed).get("attempt") == attempt else []

    # Slower steps than the default (the same training): attempt 3's 20-40 steps once ran out before its ranks
    # were seen training, on a loaded machine.
    with started(run_job(killed, steps=80, sleep=0.08), tmp_path, log=tmp_path / "killed.log") as sup:
        for attempt, at_step in ((1, 30), (2, 50)):
            ranks = wait_for(lambda a=attempt, s=at_step: attempt_ranks(a, s), 90, f"attempt {attempt} training")
            os.kill(ranks[1]["pid"], signal.SIGKILL)
        ranks = wait_for(lambda: attempt_ranks(3), 90, "attempt 3 training")
        cmdlines = [" ".join(psutil.Process(r["pid"]).cmdline()) for r in ranks]
        assert all("supervisor.prewarm" in c for c in cmdlines), cmdlines
        # Its torchrun is a fork of the server too, in a session of its own (the parent of the ranks'
        # proxies); once the server is ready the supervisor holds no zygote, whose import would cost CPU.
        server = psutil.Process(ranks[0]["pid"]).parent()
        forked_torchrun(server)
        assert server.parent().pid == sup.pid
        wait_for(lambda: not any("supervisor.zygote" in " ".join(c.cmdline())
                                 for c in psutil.Process(sup.pid).children()), 30, "the spare zygote to be let go")
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    assert [h["reason"] for h in status(killed)["history"]] == ["worker_signal", "worker_signal", "finished"]
    a, b = store.latest_valid(straight / "checkpoints"), store.latest_valid(killed / "checkpoints")
    assert a.step == b.step == 80
    assert_same_training_state(a.path, b.path)
    verify = subprocess.run(resilient("inspect-checkpoint", killed, "--verify", "--json"), capture_output=True,
                            text=True, env=child_env(), timeout=60)
    doc = json.loads(verify.stdout)
    assert verify.returncode == 0 and doc["verified"] and doc["latest_valid_step"] == 80, verify.stderr
    assert {c["status"] for c in doc["checkpoints"]} == {"valid"} and len(doc["checkpoints"]) == 3  # keep: 3


def test_an_entry_that_always_dies_at_the_same_step_is_a_crash_loop(tmp_path):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, "restart.crash_loop_attempts=2", steps=100, sleep=0.0,
                   extra_args=("--test-die-at-step", "30"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1
        console = sup.output()
    assert "crash loop: 2 consecutive attempts made no new valid checkpoint, failing at step 30" in console
    assert "injected failure at step 30" in console
    doc = status(run_dir)
    assert doc["state"] == "failed" and len(doc["history"]) == 3
    assert [h["reason"] for h in doc["history"]] == ["worker_exit"] * 3
    assert "crash loop" in doc["message"]


def test_a_second_supervisor_on_the_same_run_dir_exits_3(tmp_path):
    run_dir = tmp_path / "run"
    with started(run_job(run_dir, steps=100), tmp_path, log=tmp_path / "sup1.log") as sup:
        wait_for(lambda: state(run_dir).get("state") == "running", 60, "the first supervisor")
        second = subprocess.run(run_job(run_dir, steps=100), capture_output=True, text=True, env=child_env(),
                                timeout=60)
        assert second.returncode == 3, second.stderr
        assert f"held by another live supervisor (pid {sup.pid}" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1


def test_nan_rolls_back_once_then_stops(tmp_path):
    run_dir = tmp_path / "run"
    # NaN at step 50 on every attempt: roll back from the newest (40) to 20 once, then NaN again -> stop.
    argv = run_job(run_dir, steps=100, sleep=0.0, extra_args=("--test-nan-at-step", "50"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1
        console = sup.output()
    doc = status(run_dir)
    assert [h["reason"] for h in doc["history"]] == ["nan", "nan"]
    assert doc["history"][1]["resumed_from_step"] == 20
    assert "rolling back" in console and "non-finite again after a rollback" in doc["message"]
    assert console.count("checkpoint step 40 committed") == 2, console  # the rollback's commit was not said
    # the step rolled back past is set aside once step 20 loads: no later relaunch takes it by its number (review 13)
    assert [(q["step"], "non-finite" in q["reason"]) for q in doc["quarantined"]] == [(40, True)], doc["quarantined"]
    # ... and the record's last valid checkpoint is never the one set aside (audit 17); the new training's 40 is
    assert doc["last_checkpoint_step"] == 40 and store.inspect(run_dir / "checkpoints" / "step_000000040").valid


def test_a_module_that_cannot_be_imported_is_a_config_error(tmp_path):
    out = subprocess.run(resilient("run", JOB, "--run-dir", tmp_path / "run", "--set", "entrypoint.module=no_such_mod"),
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("resilient: --set entrypoint.module=no_such_mod: entrypoint.module 'no_such_mod'")
    assert not (tmp_path / "run").exists()


def test_a_users_own_script_with_the_library_survives_a_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    argv = resilient("run", REPO / "jobs" / "my-script.yaml", "--run-dir", run_dir, "--set",
                     'entrypoint.args=["--steps", "300"]', "--set", "checkpoint.interval_steps=50")
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=60), 90, "step 60")
        os.kill(ranks[0]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    doc = status(run_dir)
    assert [h["reason"] for h in doc["history"]] == ["worker_signal", "finished"]
    assert doc["history"][1]["resumed_from_step"] >= 50
    assert store.latest_valid(run_dir / "checkpoints").step == 300


def test_a_console_reader_that_goes_away_does_not_stop_the_training(tmp_path):
    """`resilient run job.yaml 2>&1 | grep -m1 committed`: grep exits, the supervisor's next line met a broken pipe,
    and the supervisor died of it, stopping the ranks (a reviewer's). It now goes on talking to /dev/null."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen(run_job(run_dir, steps=80), cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            if "committed" in line or not line:
                break
        assert "committed" in line, line
        p.stderr.close()  # the reader goes away; the supervisor writes on
        assert p.wait(RUN_TIMEOUT) == 0
    finally:
        with contextlib.suppress(psutil.Error):
            family = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
            for q in family:
                with contextlib.suppress(psutil.Error):
                    q.kill()
            psutil.wait_procs(family, timeout=10)
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and doc["step"] == 80, (doc["state"], doc["step"])


def test_ctrl_z_suspends_the_supervisor_says_the_ranks_train_on_and_fg_watches_again(tmp_path):
    """In a terminal, as the foreground job (a pty is its controlling terminal); without one, SIGTSTP is ignored
    (tests/test_supervisor_unit.py): no shell could continue it."""
    import fcntl
    import pty
    import termios

    run_dir = tmp_path / "run"
    master, slave = pty.openpty()

    def own_terminal():  # a session of its own, with the pty as its controlling terminal: its job is foreground
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    log = open(tmp_path / "sup.log", "wb")  # noqa: SIM115 (closed below)
    sup = subprocess.Popen(run_job(run_dir, steps=80), cwd=tmp_path, env=child_env(), stdin=slave, stdout=log,
                           stderr=subprocess.STDOUT, preexec_fn=own_terminal)
    me = psutil.Process(sup.pid)
    seen = {me.pid: me}
    try:
        wait_for(lambda: live_ranks(run_dir, min_step=5), 90, "training")
        seen.update({p.pid: p for p in me.children(recursive=True)})
        sup.send_signal(signal.SIGTSTP)
        wait_for(lambda: me.status() == psutil.STATUS_STOPPED, 30, "the supervisor to stop")
        assert "the ranks train on unwatched" in (tmp_path / "sup.log").read_text(), "no word before stopping"
        rank = live_ranks(run_dir)[0]
        log_file = run_dir / "steps" / f"attempt_{state(run_dir)['attempt']}.jsonl"
        steps_then = len(read_step_log(log_file))
        wait_for(lambda: len(read_step_log(log_file)) > steps_then + 5, 60, "the ranks training while it is stopped")
        assert psutil.Process(rank["pid"]).status() != psutil.STATUS_STOPPED
        sup.send_signal(signal.SIGCONT)
        assert sup.wait(RUN_TIMEOUT) == 0, (tmp_path / "sup.log").read_text()[-3000:]
        assert "continued: watching the ranks again" in (tmp_path / "sup.log").read_text()
    finally:
        for p in [me, *seen.values()]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            sup.wait(10)
        log.close()
        os.close(master)
        os.close(slave)
    assert [h["reason"] for h in status(run_dir)["history"]] == ["finished"]
