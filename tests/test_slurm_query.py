"""supervisor/slurm.py against stand-in `scontrol` programs (real processes): KillWait is read when the run is
inside a Slurm job, nothing is asked outside one, and a controller that does not answer costs the start a bounded
wait and leaves no process behind. The real cluster's answer is checked in tests/test_slurm.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from supervisor import slurm

CONFIG = """Configuration data as of 2026-11-27T10:00:00
AccountingStorageBackupHost = (null)
JobAcctGatherType       = jobacct_gather/none
KillOnBadExit           = 0
KillWait                = 45 sec
MessageTimeout          = 10 sec
"""


def fake_scontrol(folder: Path, body: str) -> dict[str, str]:
    """An environment inside a Slurm job whose only `scontrol` is a shell script with `body`."""
    folder.mkdir(exist_ok=True)
    script = folder / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return {"SLURM_JOB_ID": "42", "PATH": f"{folder}:/usr/bin:/bin"}


def test_kill_wait_is_read_from_scontrol_show_config(tmp_path):
    asked = tmp_path / "argv"
    env = fake_scontrol(tmp_path / "bin", f'echo "$@" > {asked}\ncat <<EOF\n{CONFIG}EOF')
    assert slurm.kill_wait_s(env) == 45
    assert asked.read_text().split() == ["show", "config"]


def test_outside_a_slurm_job_scontrol_is_not_asked(tmp_path):
    asked = tmp_path / "asked"
    env = fake_scontrol(tmp_path / "bin", f"touch {asked}\necho 'KillWait = 45 sec'")
    del env["SLURM_JOB_ID"]
    assert slurm.kill_wait_s(env) is None
    assert not asked.exists()


def test_a_failing_or_unreadable_answer_is_no_answer(tmp_path):
    assert slurm.kill_wait_s(fake_scontrol(tmp_path / "a", "echo 'slurm_load_ctl_conf error' >&2; exit 1")) is None
    assert slurm.kill_wait_s(fake_scontrol(tmp_path / "b", "echo 'KillWait = UNLIMITED'")) is None
    assert slurm.kill_wait_s({"SLURM_JOB_ID": "42", "PATH": str(tmp_path / "empty")}) is None


def test_a_controller_that_does_not_answer_costs_a_bounded_wait_and_leaves_no_process(tmp_path):
    pids = tmp_path / "pid"
    env = fake_scontrol(tmp_path / "bin", f"echo $$ > {pids}\nexec sleep 60")
    started = time.monotonic()
    assert slurm.kill_wait_s(env) is None
    took = time.monotonic() - started
    assert took < slurm.QUERY_TIMEOUT_S + 2, took
    pid = int(pids.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert pid not in [c.pid for c in psutil.Process(os.getpid()).children(recursive=True)]


def test_the_warning_names_both_figures_and_only_when_the_grace_is_longer():
    assert slurm.stop_outlasts_kill_wait(30, 30) is None
    assert slurm.stop_outlasts_kill_wait(120, None) is None
    said = slurm.stop_outlasts_kill_wait(120, 30)
    assert said is not None and "stop_timeout_s is 120s" in said and "KillWait is 30s" in said
    assert "USR1" in said and "30s or less" in said
