"""jobs/slurm/resilient.sbatch on a real Slurm: the single-host cluster that .ci/setup-slurm.sh starts.

A preemption warning (SIGUSR1 to the batch shell, as `--signal=B:USR1@120` sends before the time limit)
must make the ranks checkpoint at the step they are on, requeue the job once, and the requeued job must
resume from that checkpoint and finish. A plain `scancel` must checkpoint too, and not requeue.

Skipped, with the reason, where sbatch/sinfo are missing or the cluster does not answer.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import store
from tests.proc import REPO, child_env, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = REPO / "jobs" / "slurm" / "resilient.sbatch"
JOB = REPO / "jobs" / "tiny-cpu.yaml"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


@pytest.fixture(scope="module")
def slurm() -> None:
    """Skip unless a Slurm cluster answers and has a node that can run a job now."""
    for tool in ("sbatch", "sinfo", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not on PATH: no Slurm here (CI starts one with .ci/setup-slurm.sh, as root)")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.skip("the Slurm cluster does not answer: sinfo took more than 15 s")
    if out.returncode != 0:
        pytest.skip(f"the Slurm cluster does not answer: sinfo: {out.stderr.strip()[:200]}")
    states = out.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mixed") for s in states):
        pytest.skip(f"no Slurm node can take a job now (node states: {states or 'none'})")


def slurm_env() -> dict[str, str]:
    """The environment sbatch passes on (--export=ALL): the supervisor as `python -m supervisor` from this
    interpreter, and none of an enclosing Slurm job's variables."""
    env = child_env(RESILIENT=f"{sys.executable} -m supervisor")
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[key]
    return env


def submit(tmp_path: Path, run_dir: Path, steps: int) -> str:
    entry = ["--steps", str(steps), "--device", "cpu", "--test-sleep-per-step", "0.05"]
    argv = ["sbatch", "--parsable", "--job-name", "resilient-test", "--output", str(tmp_path / "slurm-%j.out"),
            str(SBATCH), str(JOB), "--run-dir", str(run_dir), "--set", "checkpoint.interval_steps=40",
            "--set", "restart.backoff_s=0.2", "--set", f"entrypoint.args={json.dumps(entry)}"]
    out = subprocess.run(argv, cwd=tmp_path, env=slurm_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    """JobState, Restarts, ExitCode, Reason of a job still known to slurmctld ({} once it is forgotten)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=15)
    if out.returncode != 0:
        return {}
    return dict(re.findall(r"\b(JobState|Restarts|ExitCode|Reason)=(\S+)", out.stdout))


def slurm_output(tmp_path: Path, job_id: str) -> str:
    path = tmp_path / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file yet)"


def run_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def training(run_dir: Path, min_step: int) -> dict:
    s = run_state(run_dir)
    ranks = [r for r in s.get("ranks", []) if r.get("alive") and r.get("phase") == "train"]
    if s.get("state") == "running" and len(ranks) == 2 and min(r["step"] for r in ranks) >= min_step:
        return s
    return {}


def status(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "supervisor", "status", str(run_dir), "--json"],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def cancel(job_id: str) -> None:
    """scancel, then wait (bounded) until the job has ended, so no rank outlives the test."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    wait_for(lambda: job_info(job_id).get("JobState", "COMPLETED") in ENDED, 60, f"job {job_id} to end",
             interval=0.5)


def test_preemption_warning_checkpoints_requeues_once_and_the_requeued_job_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(tmp_path, run_dir, steps=150)
    try:
        wait_for(lambda: training(run_dir, min_step=5), 120,
                 f"training on both ranks (job {job_id}: {job_info(job_id)})", interval=0.2)
        # What `--signal=B:USR1@120` sends before the time limit: USR1 to the batch shell only.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)

        # Between the two runs: requeued (pending, Restarts=1), the first supervisor stopped.
        wait_for(lambda: job_info(job_id).get("Restarts") == "1" and run_state(run_dir).get("state") == "stopped",
                 60, f"the requeue ({job_info(job_id)}); output:\n{slurm_output(tmp_path, job_id)}", interval=0.2)
        stopped = run_state(run_dir)
        stop_step = stopped["step"]
        latest = store.latest_valid(run_dir / "checkpoints", deep=True)
        assert latest is not None and latest.step == stop_step, (latest, stop_step)

        wait_for(lambda: job_info(job_id).get("JobState") in ENDED, 180,
                 f"the requeued job to finish ({job_info(job_id)})", interval=0.5)
        info, output = job_info(job_id), slurm_output(tmp_path, job_id)
        assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), (info, output)
    finally:
        cancel(job_id)

    assert output.count("requeueing job") == 1, output
    assert "SIGUSR1: asking the supervisors to checkpoint and stop" in output
    assert f"resuming from step {stop_step}" in output and "finished at step 150" in output, output
    doc = status(run_dir)
    assert doc["state"] == "succeeded", doc
    first, second = doc["history"]
    assert first["reason"] == "stopped" and first["step_at_failure"] == stop_step, first
    assert first["last_checkpoint_step"] == stop_step, first
    assert second["resumed_from_step"] == stop_step and second["reason"] == "finished", second
    assert store.latest_valid(run_dir / "checkpoints").step == 150


def test_scancel_checkpoints_and_does_not_requeue(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(tmp_path, run_dir, steps=400)
    try:
        wait_for(lambda: training(run_dir, min_step=5), 120,
                 f"training on both ranks (job {job_id}: {job_info(job_id)})", interval=0.2)
        subprocess.run(["scancel", job_id], check=True, timeout=30)  # SIGTERM to every process, then KillWait
        wait_for(lambda: job_info(job_id).get("JobState") in ENDED, 90,
                 f"the job to end ({job_info(job_id)})", interval=0.5)
        info, output = job_info(job_id), slurm_output(tmp_path, job_id)
    finally:
        cancel(job_id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, output)
    assert "SIGTERM: not requeueing" in output and "requeueing job" not in output, output
    doc = status(run_dir)
    assert doc["state"] == "stopped", doc
    latest = store.latest_valid(run_dir / "checkpoints", deep=True)
    assert latest is not None and latest.step == doc["step"] == doc["history"][0]["step_at_failure"], (latest, doc)
