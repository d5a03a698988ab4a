"""Bad checkpoints and the disks and supervisors around them, under `resilient run` for real: a flipped byte
and a truncated shard (in a long non-ASCII run dir), a whole checkpoint the ranks cannot load, a full disk at
the marker, the supervisor killed mid-save, two runs aimed at one checkpoint root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import psutil
import pytest

from supervisor import store
from tests.ckpt_helpers import flip_byte, truncate
from tests.proc import Proc, child_env, started, wait_for
from tests.runs import RUN_TIMEOUT, live_ranks, rank_log, resilient, run_job, state, status

pytestmark = pytest.mark.slow


def finish(argv: list[str], cwd, log_name: str, expect: int = 0) -> str:
    with started(argv, cwd, log=cwd / log_name) as sup:
        code = sup.wait(RUN_TIMEOUT)
        out = sup.output()
    assert code == expect, out[-3000:]
    return out


def inspect_json(target) -> dict:
    out = subprocess.run(resilient("inspect-checkpoint", target, "--json"), capture_output=True, text=True,
                         env=child_env(), timeout=60)
    return json.loads(out.stdout)


def test_damaged_checkpoints_are_set_aside_and_the_run_resumes_from_the_newest_whole_one(tmp_path):
    """The issue's scenario (one byte of the newest .metadata flipped, sizes unchanged, `verify: size`: before,
    every rank died loading it, three times) and a truncated shard in the one before, in a long non-ASCII run
    dir. The first run is stopped by SIGTERM on attempt 1 (a zygote's torchrun); the rerun loses a rank once."""
    run_dir = tmp_path / ("rün ☃ " + "ü" * 60) / ("日本語-" + "x" * 80)
    name = "tiny-" + "n" * 90
    with started(run_job(run_dir, f"name={name}", steps=150), tmp_path, log=tmp_path / "first.log") as sup:
        wait_for(lambda: live_ranks(run_dir, min_step=45), 90, "step 45")
        sup.signal(signal.SIGTERM)
        assert sup.wait(60) == 143, sup.output()[-3000:]
    root = run_dir / "checkpoints"
    newest = store.latest_valid(root)
    before = store.latest_valid(root, below=newest.step)
    oldest = store.latest_valid(root, below=before.step)
    flip_byte(newest.path / ".metadata", offset=(newest.path / ".metadata").stat().st_size // 2)
    truncate(before.path / "__1_0.distcp", by=1000)
    with started(run_job(run_dir, f"name={name}", steps=150), tmp_path, log=tmp_path / "second.log") as sup:
        ranks = wait_for(lambda: live_ranks(run_dir, min_step=oldest.step + 25), 90, "training past a checkpoint")
        os.kill(ranks[0]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        console = sup.output()
    assert f"skipping {newest.path.name}: corrupt: .metadata checksum mismatch" in console
    assert f"skipping {before.path.name}: corrupt: __1_0.distcp is" in console and "(truncated)" in console
    assert f"set aside as {newest.path.name}.quarantined" in console and f"resuming from step {oldest.step}" in console
    assert "finished at step 150" in console
    doc = status(run_dir)
    assert doc["name"] == name and [h["reason"] for h in doc["history"]] == ["stopped", "worker_signal", "finished"]
    assert doc["history"][1]["resumed_from_step"] == oldest.step
    assert {q["step"] for q in doc["quarantined"]} == {newest.step, before.step}
    listed = {c["step"]: c for c in inspect_json(run_dir)["checkpoints"] if c["quarantined"]}
    assert ".metadata checksum mismatch" in listed[newest.step]["reason"]
    assert "truncated" in listed[before.step]["reason"]
    text = subprocess.run(resilient("status", run_dir), capture_output=True, text=True, env=child_env(), timeout=60)
    assert f"set aside step {newest.step} as {newest.path.name}.quarantined: .metadata checksum mismatch" in text.stdout


def test_a_bit_flipped_inside_a_large_shard_passes_the_size_check_and_is_caught_by_the_load(tmp_path):
    """`verify: size` (the default) knows a shard past SMALL_FILE_BYTES by its size alone, which a flipped bit
    leaves as it was: the ranks catch it as they load (each piece of each item against the checksum kept at the
    end of its file), exit 74, and the supervisor checks that checkpoint in full, sets it aside and resumes from
    the one before. Before, the run went on from slightly wrong weights without a word."""
    from train_entry import storage

    run_dir, wide, every_10 = tmp_path / "run", ("--n-embd", "128"), "checkpoint.interval_steps=10"
    finish(run_job(run_dir, every_10, steps=20, sleep=0.0, extra_args=wide), tmp_path, "first.log")
    newest = store.latest_valid(run_dir / "checkpoints")
    assert newest.step == 20
    items = storage.RawReader(newest.path).read_metadata().storage_data
    index, info = max(((i, v) for i, v in items.items() if v.relative_path == "__1_0.distcp"),
                      key=lambda kv: kv[1].length)
    assert (newest.path / info.relative_path).stat().st_size > store.SMALL_FILE_BYTES
    flip_byte(newest.path / info.relative_path, offset=info.offset + info.length // 2)
    assert store.inspect(newest.path).valid  # what the check before a relaunch sees
    console = finish(run_job(run_dir, every_10, steps=30, sleep=0.0, extra_args=wide), tmp_path, "second.log")
    history = status(run_dir)["history"][1:]
    assert [(h["reason"], h["resumed_from_step"]) for h in history] == [("checkpoint_load", 20), ("finished", 10)]
    assert f"__1_0.distcp ({index.fqn}, from byte {info.offset} of the file): its bytes" in history[0]["detail"]
    assert "do not match the checksum recorded when they were saved" in history[0]["detail"]
    assert f"set {newest.path.name} aside as {newest.path.name}.quarantined: __1_0.distcp checksum mismatch" \
           in console, console[-3000:]
    assert "finished at step 30" in console


def test_a_whole_checkpoint_the_ranks_cannot_load_is_passed_over_then_set_aside_once_an_older_one_loads(tmp_path):
    """Step 40 is replaced by a whole checkpoint of another model (every byte matches its manifest): the ranks
    fail to load it, a size mismatch, which is not tried twice (a retry is for errors that may pass); it is passed
    over, and set aside once step 20 has loaded."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    finish(run_job(run_dir, "restart.crash_loop_attempts=3", steps=40, sleep=0.0), tmp_path, "first.log")
    finish(run_job(other, "checkpoint.interval_steps=40", steps=40, sleep=0.0, extra_args=("--n-embd", "32")),
           tmp_path, "other.log")
    ours = run_dir / "checkpoints" / store.step_dirname(40)
    shutil.rmtree(ours)
    shutil.copytree(other / "checkpoints" / store.step_dirname(40), ours)
    assert store.inspect(ours, deep=True).valid
    console = finish(run_job(run_dir, "restart.crash_loop_attempts=3", steps=60, sleep=0.0), tmp_path,
                     "second.log")
    history = status(run_dir)["history"][1:]
    # A size mismatch is not tried twice: no retry of the same bytes changes it (audit).
    assert [h["reason"] for h in history] == ["checkpoint_load", "finished"], history
    assert [h["resumed_from_step"] for h in history] == [40, 20]
    assert "could not load the checkpoint: step 40" in history[0]["detail"]
    assert "set step_000000040 aside as step_000000040.quarantined: every byte checks, but the ranks failed to " \
           "load it (its names or shapes are not this run's)" in console
    q = [c for c in inspect_json(run_dir)["checkpoints"] if c["quarantined"]]
    assert [c["step"] for c in q] == [40] and "its names or shapes are not this run's" in q[0]["reason"]


def test_checkpoints_that_no_longer_match_the_training_code_are_left_where_they_are(tmp_path):
    """The model changed between runs (a wider embedding): every checkpoint is whole and none loads. The run
    stops naming the cause, and no checkpoint is set aside: with the code changed back, the newest resumes (the
    first whole one failing twice was once quarantined at once, losing it for good)."""
    run_dir = tmp_path / "run"
    finish(run_job(run_dir, steps=40, sleep=0.0), tmp_path, "first.log")
    console = finish(run_job(run_dir, "restart.crash_loop_attempts=9", steps=60, sleep=0.0,
                             extra_args=("--n-embd", "32")), tmp_path, "second.log", expect=1)
    doc = status(run_dir)
    assert [h["resumed_from_step"] for h in doc["history"][1:]] == [40, 20], doc["history"]
    assert "passing over step 40" in console and "as step 40 did before it" in doc["message"]
    assert "both are left where they are" in doc["message"] and doc["quarantined"] == []
    assert [c["step"] for c in inspect_json(run_dir)["checkpoints"] if c["status"] == "valid"] == [20, 40]
    console = finish(run_job(run_dir, steps=60, sleep=0.0), tmp_path, "third.log")  # the code as it was
    assert status(run_dir)["history"][-1]["resumed_from_step"] == 40, console


def test_a_full_disk_at_the_marker_leaves_nothing_valid_and_a_rerun_with_room_resumes(tmp_path, small_disk):
    """A real ENOSPC for the completion marker itself: rank 0's data is durable, the marker cannot be written."""
    run_dir = tmp_path / "run"
    sets = (f"checkpoint.dir={small_disk}", "restart.crash_loop_attempts=2", "checkpoint.keep=1")
    argv = run_job(run_dir, *sets, steps=60, sleep=0.0, extra_args=("--test-save-pause", "before_marker:enospc@40",
                                                                     "--test-attempts", "1"))
    finish(argv, tmp_path, "first.log", expect=1)
    doc = status(run_dir)
    assert doc["history"][0]["reason"] == "checkpoint_failed" and "No space left on device" in str(doc["history"])
    assert "crash loop" in doc["message"]
    infos = store.scan(small_disk)
    assert [i.step for i in infos if i.valid] == [20], [(i.step, i.reason) for i in infos]
    partial = small_disk / store.partial_dirname(40)
    assert not (partial / store.MARKER).exists() and not store.inspect(partial).valid
    (small_disk / "test-filler.bin").unlink()
    console = finish(run_job(run_dir, *sets, steps=60, sleep=0.0), tmp_path, "second.log")
    assert "resuming from step 20" in console and store.latest_valid(small_disk).step == 60


def test_kill_9_of_the_supervisor_in_the_middle_of_a_save_leaves_nothing_half_valid(tmp_path):
    """On attempt 1, whose torchrun is a zygote's. The ranks go within seconds (torchrun's parent-death signal
    becomes their SIGTERM: they may checkpoint their step first); the save they were in either never commits or
    commits whole, never in between."""
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, steps=60, extra_args=("--test-save-pause", "before_marker:3@40", "--test-attempts", "1"))
    partial = run_dir / "checkpoints" / store.partial_dirname(40)
    sup = Proc(argv, tmp_path, log=tmp_path / "first.log")
    try:
        wait_for(lambda: "pausing" in rank_log(run_dir, 1, 0) and (partial / ".metadata").exists(), 90,
                 "the save paused before its marker")
        ranks = [psutil.Process(r["pid"]) for r in state(run_dir)["ranks"]]
        os.kill(sup.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert alive == [], f"ranks alive 30 s after the supervisor died mid-save: {alive}"
    finally:
        sup.kill_all()
    for info in store.scan(run_dir / "checkpoints"):
        assert not info.valid or store.inspect(info.path, deep=True).valid, info  # nothing half valid
    newest = store.latest_valid(run_dir / "checkpoints").step
    assert newest >= 20  # 40 if the paused save committed, or the stop's own save: the ranks got SIGTERM
    console = finish(run_job(run_dir, steps=60, sleep=0.0), tmp_path, "second.log")
    assert f"resuming from step {newest}" in console
    assert [h["reason"] for h in status(run_dir)["history"]] == ["supervisor_lost", "finished"]
    assert store.inspect(run_dir / "checkpoints" / store.step_dirname(60), deep=True).valid


def test_supervisors_started_at_the_same_instant_on_one_run_dir_or_one_checkpoint_root_leave_one_running(tmp_path):
    root = tmp_path / "shared-checkpoints"
    argvs = [run_job(tmp_path / "run-a", f"checkpoint.dir={root}", steps=400),
             run_job(tmp_path / "run-a", f"checkpoint.dir={root}", steps=400),
             run_job(tmp_path / "run-b", f"checkpoint.dir={root}", steps=400)]
    procs = [Proc(argv, tmp_path, log=tmp_path / f"sup{i}.log") for i, argv in enumerate(argvs)]
    try:
        refused = wait_for(lambda: [p for p in procs if p.poll() is not None] if sum(
            p.poll() is not None for p in procs) == 2 else None, 60, "two of three supervisors to exit")
        for p in refused:
            out = p.output().strip()
            assert p.poll() == 3 and len(out.splitlines()) == 1 and "another live" in out, out
        winner = next(p for p in procs if p not in refused)
        run_dir = tmp_path / ("run-b" if winner is procs[2] else "run-a")
        wait_for(lambda: live_ranks(run_dir), 90, "the one supervisor left to train")
        assert winner.poll() is None
        if winner is not procs[2]:
            assert "checkpoint root of another live run" in procs[2].output()
    finally:
        for p in procs:
            p.kill_all()
