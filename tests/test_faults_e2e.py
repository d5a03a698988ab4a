"""More real faults under `resilient run`: a full disk, a collective that times out, a long synchronous
save that must not count as a hang, a straggler that is reported but not killed, a real out-of-memory error,
a rank preempted by someone else, torchrun itself killed, an import error in a worker, entry-point arguments
that torchrun would take for its own, a spent restart budget, and the `auto` interval."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from supervisor import store
from supervisor.protocol import CommitRecord, read_step_log
from tests.proc import started, wait_for
from tests.runs import RUN_TIMEOUT, live_ranks, rank_log, resilient, run_job, state, status, torchrun_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_full_disk_fails_the_save_never_validates_it_and_stops_as_a_crash_loop(tmp_path, small_disk, async_save):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, f"checkpoint.dir={small_disk}", "checkpoint.keep=3", "restart.crash_loop_attempts=2",
                   f"checkpoint.async={str(async_save).lower()}", steps=200, sleep=0.0)
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1, sup.output()[-3000:]
        console = sup.output()
    doc = status(run_dir)
    assert doc["history"][0]["reason"] == "checkpoint_failed", doc["history"][0]
    # torch's own message depends on where the short write lands ("No space left on device", or "unexpected
    # pos" from its zip writer); the supervisor says what the filesystem looks like either way.
    assert "the checkpoint filesystem has" in doc["history"][0]["detail"]
    assert "crash loop" in doc["message"] and "MB free of" in console
    infos = store.scan(small_disk)
    assert [i.step for i in infos if i.valid] == [20, 40]
    assert all(not i.valid for i in infos if i.step > 40)
    # Step 60's save failed: the ranks stopped there (async: within steps of it), not at the next save.
    assert 60 <= doc["history"][0]["step_at_failure"] < 70, doc["history"][0]


def test_a_long_first_step_and_a_long_last_save_are_not_hangs(tmp_path):
    """The first step (a compile, autotuning) has the startup's allowance, not timeout_s; the wait at the end for
    the last interval's save to persist is a save, not a train step without progress. Both were killed as hangs,
    every attempt again, until the restart budget ran out."""
    cases = {"last save": ("--test-save-pause", "mid_data:7@40"), "first step": ("--test-slow-rank", "0:7")}
    # The two runs are independent (each its own run dir and rendezvous port): they run side by side, each
    # sleeping through its own 7 s, and each is judged on its own.
    with contextlib.ExitStack() as stack:
        sups = {}
        for name, extra in cases.items():
            run_dir = tmp_path / name.replace(" ", "-")
            argv = run_job(run_dir, "heartbeat.timeout_s=4s", "heartbeat.startup_timeout_s=60s",
                           steps=40 if name == "last save" else 1, sleep=0.0, extra_args=extra)
            sups[name] = (run_dir, stack.enter_context(started(argv, tmp_path, log=tmp_path / f"{run_dir.name}.log")))
        for name, (run_dir, sup) in sups.items():
            assert sup.wait(RUN_TIMEOUT) == 0, (name, sup.output()[-3000:])
            assert [h["reason"] for h in status(run_dir)["history"]] == ["finished"], name


def test_a_collective_timeout_is_classified_and_recovered(tmp_path):
    run_dir = tmp_path / "run"
    # The heartbeat timeout is long, so gloo's own 5 s timeout is what notices the stopped rank.
    argv = run_job(run_dir, "collective_timeout_s=5", "heartbeat.timeout_s=120", "stop_timeout_s=5", steps=60)
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=15), 90, "training")
        victim = next(r for r in ranks if r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)
    first = status(run_dir)["history"][0]
    assert first["reason"] == "collective_timeout", first
    assert "Timed out waiting 5000ms" in first["detail"]
    assert "rank 1 had been silent" in first["detail"]
    # torchrun waits 30 s for a stopped peer whatever its --shutdown-timeout; the supervisor does not: it took
    # the stopped rank's stacks, then stopped the attempt 5 s after rank 0 failed.
    evidence = json.loads((Path(first["log_dir"]) / "hang_evidence.json").read_text())
    assert next(r for r in evidence["ranks"] if r["rank"] == 1).get("stack_dump")
    assert first["ended_at"] - first["started_at"] < 60


def test_a_long_synchronous_save_is_not_a_hang(tmp_path):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, "checkpoint.async=false", "heartbeat.timeout_s=4", "heartbeat.interval_s=0.5",
                   steps=40, sleep=0.0, extra_args=("--test-save-pause", "before_marker:6@20"))
    seen_phases = set()
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        def saving() -> bool:
            seen_phases.update(r.get("phase") for r in state(run_dir).get("ranks", []))
            return "save" in seen_phases
        wait_for(saving, 90, "the ranks in phase save")
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        assert "hang" not in sup.output()
    doc = status(run_dir)
    assert len(doc["history"]) == 1 and doc["history"][0]["reason"] == "finished"
    assert store.inspect(run_dir / "checkpoints" / store.step_dirname(40)).valid


def test_a_straggler_is_reported_not_killed(tmp_path):
    run_dir = tmp_path / "run"
    # Attribution needs an agreement every step (the default for steps of half a second or more): between
    # agreements the others wait for the straggler inside FSDP's own collectives, where nobody measures.
    # Rank 1 sleeps 0.3 s a step, so its own rate is below half the other's while a step's own work takes under
    # 0.3 s: with 0.1 s the two full suites of 2026-11-27 (two workers) saw 4.75 against 9.20 steps/s, and no note.
    # Not left to finish (60 steps of 0.3 s): once noted, the straggler is seen training on, then the run stopped.
    argv = run_job(run_dir, steps=400, sleep=0.0, extra_args=("--test-slow-rank", "1:0.3", "--sync-every", "1"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        def noted() -> dict | None:
            return next((r for r in state(run_dir).get("ranks", []) if r.get("note")), None)
        rank = wait_for(noted, 120, "a straggler note")
        assert rank["rank"] == 1 and "straggler" in rank["note"]
        wait_for(lambda: live_ranks(run_dir, min_step=rank["step"] + 3), 60, "the straggler training on")
        assert state(run_dir)["attempt"] == 1
        sup.signal(signal.SIGTERM)
        assert sup.wait(60) == 143, sup.output()[-3000:]
    assert [h["reason"] for h in status(run_dir)["history"]] == ["stopped"]
    assert "straggler" in sup.output()


def test_a_real_oom_a_preempted_rank_and_a_killed_torchrun_are_each_classified_and_recovered(tmp_path):
    """Three real faults in one run, one per attempt: the allocator's own out-of-memory error, a rank that
    gets SIGTERM from someone else (it checkpoints and exits 75), and torchrun itself SIGKILLed."""
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, steps=170, extra_args=("--test-oom-at-step", "25", "--test-attempts", "1"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        def attempt_ranks(attempt: int, min_step: int) -> list[dict]:
            return live_ranks(run_dir, min_step) if state(run_dir).get("attempt") == attempt else []

        ranks = wait_for(lambda: attempt_ranks(2, 45), 120, "attempt 2 training past step 45")
        signalled_at = time.time()
        os.kill(next(r["pid"] for r in ranks if r["rank"] == 1), signal.SIGTERM)
        wait_for(lambda: attempt_ranks(3, 0), 120, "attempt 3 training")
        launcher = wait_for(lambda: torchrun_of(run_dir), 30, "attempt 3's torchrun")
        launcher.kill()
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    doc = status(run_dir)
    history = doc["history"]
    assert [h["reason"] for h in history] == ["oom", "preempted", "launcher_died", "finished"], history
    assert doc["restarts"] == 2, "a stop the supervisor did not ask for spends no restart"
    assert "ran out of memory" in history[0]["detail"] and "Cannot allocate memory" in history[0]["detail"]
    assert history[1]["failed_rank"] is not None and history[1]["exit_code"] == 75
    stop = history[1]["step_at_failure"]  # the preempted ranks checkpointed their stop step (retention took it since)
    last_commit = [r for r in read_step_log(run_dir / "steps" / "attempt_2.jsonl") if isinstance(r, CommitRecord)][-1]
    assert last_commit.step == stop and last_commit.t > signalled_at and history[2]["resumed_from_step"] == stop
    assert "torchrun itself was killed" in history[2]["detail"]


def test_an_import_error_in_a_workers_script_is_a_config_error_and_is_not_retried(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import no_such_module_for_resilient  # noqa\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: broken\nentrypoint: {{script: {script}}}\nnproc_per_node: 2\n")
    with started(resilient("run", job), tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1
        console = sup.output()
    history = status(tmp_path / "runs" / "broken")["history"]
    assert [h["reason"] for h in history] == ["config"] and "no_such_module_for_resilient" in history[0]["detail"]
    assert "a configuration or import error, which a restart cannot fix" in console


def test_the_entry_points_own_arguments_reach_it_even_where_they_abbreviate_torchruns_options(tmp_path):
    """torchrun's argparse classifies every token and refuses `--local` (its --local-addr or --local-ranks-filter?)
    even after the script: resilient hands torchrun a `--` before the entry point, so the run starts and the
    script gets its arguments as the job file wrote them."""
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys\n"
                      "open(os.path.join(os.path.dirname(__file__), 'argv_' + os.environ['RANK']), 'w')"
                      ".write(json.dumps(sys.argv[1:]))\n")
    args = ["--local", "x", "--node=1", "--rdzv", "--", "--max"]
    job = tmp_path / "job.yaml"
    job.write_text(f"name: args\nentrypoint: {{script: {script}, args: {json.dumps(args)}}}\nnproc_per_node: 2\n")
    with started(resilient("run", job), tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    assert [json.loads((tmp_path / f"argv_{r}").read_text()) for r in (0, 1)] == [args, args]
    assert [h["reason"] for h in status(tmp_path / "runs" / "args")["history"]] == ["finished"]


def test_the_restart_budget_runs_out_and_the_run_stops_with_exit_1(tmp_path):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, "restart.max_restarts=1", "restart.crash_loop_attempts=9", steps=100, sleep=0.0,
                   extra_args=("--test-die-at-step", "5"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1
    doc = status(run_dir)
    assert [h["reason"] for h in doc["history"]] == ["worker_exit", "worker_exit"]
    assert doc["state"] == "failed" and "the restart budget is spent (1/1 restarts)" in doc["message"]


def test_an_auto_interval_is_chosen_by_the_supervisor_and_followed_by_the_ranks_across_a_relaunch(tmp_path):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, "checkpoint.interval_steps=auto", "checkpoint.expected_mtbf_s=20",
                   "checkpoint.min_interval_steps=5", "checkpoint.max_interval_steps=40", steps=160, sleep=0.01)
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        wait_for(lambda: "(from the supervisor)" in rank_log(run_dir, 1, 0), 120, "rank 0 to take the interval")
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=60), 120, "step 60")
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        console = sup.output()
    doc = status(run_dir)
    interval = doc["checkpoint_interval"]
    assert interval["mode"] == "auto" and "Young/Daly" in interval["why"] and 5 <= interval["steps"] <= 40
    assert "checkpoint interval" in console and (run_dir / "control.json").is_file()
    for attempt in (1, 2):
        commits = [r.step for r in read_step_log(run_dir / "steps" / f"attempt_{attempt}.jsonl")
                   if isinstance(r, CommitRecord) and r.step != 160]  # the final save comes when training ends
        start = doc["history"][attempt - 1]["resumed_from_step"] or 0
        # Counted from the last save (or the resume step), never the ranks' default of 50 (or its multiples):
        # resumed from 40, a first save at 50 is the supervisor's 10 (the test once read it as the default).
        gaps = {b - a for a, b in itertools.pairwise([start, *commits])}
        assert commits and all(5 <= g <= 40 for g in gaps), (attempt, start, commits)
        assert "(from the supervisor)" in rank_log(run_dir, attempt, 0), attempt
    assert [h["reason"] for h in doc["history"]] == ["worker_signal", "finished"]
    # What was measured is kept for the run's next supervisor (a rerun started the tuner from nothing).
    memory = state(run_dir)["accounting"]["tuner"]
    assert memory["costs"] and len(memory["step_dts"]) >= 5, memory


def test_a_worker_stuck_before_its_first_heartbeat_is_in_the_hang_evidence(tmp_path):
    """Rank 1 blocks in its script's own code before it joins (as an import on a hung filesystem would): it has no
    heartbeat and no stack-dump handler yet, so it gets no signal; its process and command line are recorded."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(3600)  # stuck before joining
        from train_entry.__main__ import main
        sys.exit(main(sys.argv[1:]))
    """))
    job = tmp_path / "job.yaml"
    job.write_text("name: stuck\nentrypoint: {script: train.py, args: [--steps, '20', --device, cpu]}\n"
                   "nproc_per_node: 2\nrestart: {max_restarts: 0}\nheartbeat: {startup_timeout_s: 6s}\n")
    with started(resilient("run", job), tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1, sup.output()[-3000:]
        console = sup.output()
    first = status(tmp_path / "runs" / "stuck")["history"][0]
    assert first["reason"] == "hang" and "rank 1 wrote no heartbeat" in first["detail"], first
    assert "the state of 1 worker(s) that never beat" in console, console
    evidence = json.loads((Path(first["log_dir"]) / "hang_evidence.json").read_text())
    [stuck] = evidence["workers_without_heartbeat"]
    assert stuck["rank"] == 1 and "train.py" in stuck["cmdline"], stuck
    assert ("stack dumps from rank 1" in console) == bool(stuck.get("stack_dump")), console  # it said none
    # A prewarmed rank's worker is its proxy; the facts are the rank's own: asleep in its script, not in the proxy's
    # socket read.
    assert stuck["status"] == "sleeping" and stuck["wchan"] in ("hrtimer_nanosleep", "do_nanosleep", None), stuck
    assert "prewarm_client" not in stuck["cmdline"] or stuck["prewarm_proxy_pid"] != stuck["pid"], stuck
    assert [r["rank"] for r in evidence["ranks"]] == [0]
    # Its stack, dumped into its own log: the line it is stuck on.
    log, offset = stuck["stack_dump"].split(" (from byte ")
    dump = (tmp_path / "runs" / "stuck" / log).read_bytes()[int(offset.rstrip(")")):].decode()
    assert "train.py\", line 3" in dump, dump


def test_a_changed_model_is_named_in_one_line_and_stops_the_run_with_its_checkpoints_kept(tmp_path):
    """DCP wraps each rank's error in a CheckpointException whose text is a traceback wall: the supervisor showed
    'CheckpointException ranks:dict_keys([0, 1]) Traceback ...', cut off before the cause, and called the passed
    over checkpoint 'rolled back past it (a non-finite loss ...)'."""
    run_dir = tmp_path / "run"
    first = run_job(run_dir, steps=40, sleep=0.0, extra_args=("--n-embd", "32"))
    with started(first, tmp_path, log=tmp_path / "a.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    changed = run_job(run_dir, steps=80, sleep=0.0, extra_args=("--n-embd", "48"))
    with started(changed, tmp_path, log=tmp_path / "b.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1, sup.output()[-3000:]
        out = sup.output()
    assert "no longer match the training code or model" in out, out[-3000:]
    assert re.search(r"rank [01] could not load the checkpoint: step \d+: ValueError: Size mismatch", out), out[-3000:]
    assert "non-finite" not in out and "CheckpointException" not in out, out[-3000:]
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} >= {"step_000000020", "step_000000040"}
