"""More real faults under `resilient run`: a full disk, a collective that times out, a long synchronous
save that must not count as a hang, and a straggler that is reported but not killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from supervisor import store
from tests.proc import started, wait_for
from tests.runs import RUN_TIMEOUT, live_ranks, run_job, state, status

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB tmpfs: room for two checkpoints of the tiny model, not three."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {out.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_fails_the_save_never_validates_it_and_stops_as_a_crash_loop(tmp_path, small_disk):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, f"checkpoint.dir={small_disk}", "checkpoint.keep=3", "restart.crash_loop_attempts=2",
                   steps=200, sleep=0.0)
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


def test_a_collective_timeout_is_classified_and_recovered(tmp_path):
    run_dir = tmp_path / "run"
    # The heartbeat timeout is long, so gloo's own 5 s timeout is what notices the stopped rank.
    argv = run_job(run_dir, "collective_timeout_s=5", "heartbeat.timeout_s=120", "stop_timeout_s=5", steps=100)
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


def test_a_long_synchronous_save_is_not_a_hang(tmp_path):
    run_dir = tmp_path / "run"
    argv = run_job(run_dir, "checkpoint.async=false", "heartbeat.timeout_s=4", "heartbeat.interval_s=0.5",
                   steps=60, extra_args=("--test-save-pause", "before_marker:10@20"))
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
    assert store.inspect(run_dir / "checkpoints" / store.step_dirname(60)).valid


def test_a_straggler_is_reported_not_killed(tmp_path):
    run_dir = tmp_path / "run"
    # Attribution needs an agreement every step (the default for steps of half a second or more): between
    # agreements the others wait for the straggler inside FSDP's own collectives, where nobody measures.
    argv = run_job(run_dir, steps=150, sleep=0.0, extra_args=("--test-slow-rank", "1:0.1", "--sync-every", "1"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        def noted() -> dict | None:
            return next((r for r in state(run_dir).get("ranks", []) if r.get("note")), None)
        rank = wait_for(noted, 120, "a straggler note")
        assert rank["rank"] == 1 and "straggler" in rank["note"]
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    assert [h["reason"] for h in status(run_dir)["history"]] == ["finished"]
    assert json.loads(Path(run_dir / "state.json").read_text())["state"] == "succeeded"
