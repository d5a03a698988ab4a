"""jobs/slurm/resilient.sbatch on a real Slurm: the single-host cluster that .ci/setup-slurm.sh starts.

A preemption warning (SIGUSR1 to the batch shell, as `--signal=B:USR1@120` sends before the time limit)
must make the ranks checkpoint at the step they are on, requeue the job once, and the requeued job must
resume from that checkpoint and finish. A plain `scancel` must checkpoint too, and not requeue. With two
Slurm nodes emulated on this host (`SLURM_NODES=2 .ci/setup-slurm.sh`), the same warning is tried on a
two-node job: one supervisor per node, one rendezvous, one requeue.

Skipped, with the reason, where sbatch/sinfo are missing or the cluster does not answer.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor import store
from tests.proc import REPO, child_env, free_port, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]

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


@pytest.fixture(scope="module")
def two_local_nodes(slurm) -> list[tuple[str, str]]:
    """Two idle Slurm nodes on this very host (so they share tmp_path), as [(name, address)]; else skip. A node the
    previous test's job left still completing (its epilog, slower on a loaded machine) is waited for, 60 s."""
    here = {socket.gethostname(), socket.gethostname().split(".")[0]}

    def idle_here() -> list[tuple[str, str]]:
        out = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], capture_output=True, text=True,
                             timeout=15)
        local = []
        for name in sorted(set(out.stdout.split())):
            node = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True,
                                  timeout=15).stdout
            fields = dict(re.findall(r"\b(NodeHostName|NodeAddr)=(\S+)", node))
            if fields.get("NodeHostName") in here:
                local.append((name, fields.get("NodeAddr", name)))
        return local

    deadline = time.monotonic() + 60
    while len(local := idle_here()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    if len(local) < 2:
        pytest.skip(f"needs two idle Slurm nodes on this host (found {[n for n, _ in local]}); "
                    "start them with SLURM_NODES=2 .ci/setup-slurm.sh")
    return local[:2]


def slurm_env(**extra: str) -> dict[str, str]:
    """The environment sbatch passes on (--export=ALL): the supervisor as `python -m supervisor` from this
    interpreter, and none of an enclosing Slurm job's variables."""
    env = child_env(RESILIENT=f"{sys.executable} -m supervisor", **extra)
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[key]
    return env


def submit(tmp_path: Path, run_dir: Path, steps: int, *sets: str, sbatch_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> str:
    entry = ["--steps", str(steps), "--device", "cpu", "--test-sleep-per-step", "0.05"]
    argv = ["sbatch", "--parsable", "--job-name", "resilient-test", "--output", str(tmp_path / "slurm-%j.out"),
            *sbatch_args, str(SBATCH), str(JOB), "--run-dir", str(run_dir), "--set", "checkpoint.interval_steps=40",
            "--set", "restart.backoff_s=0.2", "--set", f"entrypoint.args={json.dumps(entry)}"]
    for item in sets:
        argv += ["--set", item]
    out = subprocess.run(argv, cwd=tmp_path, env=env or slurm_env(), capture_output=True, text=True, timeout=30)
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


def run_state(run_dir: Path, node: str | None = None) -> dict:
    """One supervisor's state file: the run dir's own (one node), or nodes/NODE/state.json (several)."""
    try:
        return json.loads((run_dir / ("nodes/" + node if node else "") / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def training(run_dir: Path, min_step: int, node: str | None = None, nproc: int = 2) -> dict:
    s = run_state(run_dir, node)
    ranks = [r for r in s.get("ranks", []) if r.get("alive") and r.get("phase") == "train"]
    if s.get("state") == "running" and len(ranks) == nproc and min(r["step"] for r in ranks) >= min_step:
        return s
    return {}


def status(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "supervisor", "status", str(run_dir), "--json"],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_job(job_id: str, tmp_path: Path, predicate, timeout: float, what: str):
    """wait_for, with the job's Slurm state, the run's state and the job's output when it times out."""
    try:
        return wait_for(predicate, timeout, what, interval=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}; job {job_id}: {job_info(job_id)}, run state: "
                             f"{run_state(tmp_path / 'run').get('state')}; output:\n"
                             f"{slurm_output(tmp_path, job_id)[-4000:]}") from None


def cancel(job_id: str) -> None:
    """scancel, then wait (bounded) until the job has ended, so no rank outlives the test."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    wait_for(lambda: job_info(job_id).get("JobState", "COMPLETED") in ENDED, 60, f"job {job_id} to end",
             interval=0.5)


def test_preemption_warning_checkpoints_requeues_once_and_the_requeued_job_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(tmp_path, run_dir, steps=150)
    try:
        wait_job(job_id, tmp_path, lambda: training(run_dir, min_step=5), 120, "training on both ranks")
        # What `--signal=B:USR1@120` sends before the time limit: USR1 to the batch shell only.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)

        # Between the two runs: requeued (pending, Restarts=1), the first supervisor stopped.
        wait_job(job_id, tmp_path,
                 lambda: job_info(job_id).get("Restarts") == "1" and run_state(run_dir).get("state") == "stopped",
                 60, "the requeue, with the first supervisor stopped")
        stopped = run_state(run_dir)
        stop_step = stopped["step"]
        latest = store.latest_valid(run_dir / "checkpoints", deep=True)
        assert latest is not None and latest.step == stop_step, (latest, stop_step)

        wait_job(job_id, tmp_path, lambda: job_info(job_id).get("JobState") in ENDED, 180,
                 "the requeued job to finish")
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
    """Also: a stop_timeout_s longer than the cluster's KillWait (30 s here) is warned of at start, naming both."""
    run_dir = tmp_path / "run"
    job_id = submit(tmp_path, run_dir, 400, "stop_timeout_s=45")
    try:
        wait_job(job_id, tmp_path, lambda: training(run_dir, min_step=5), 120, "training on both ranks")
        subprocess.run(["scancel", job_id], check=True, timeout=30)  # SIGTERM to every process, then KillWait
        wait_job(job_id, tmp_path, lambda: job_info(job_id).get("JobState") in ENDED, 90, "the job to end")
        info, output = job_info(job_id), slurm_output(tmp_path, job_id)
    finally:
        cancel(job_id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, output)
    assert "SIGTERM: not requeueing" in output and "requeueing job" not in output, output
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=15).stdout
    kill_wait = int(re.search(r"^KillWait\s*=\s*(\d+)", config, re.M).group(1))
    warned = f"stop_timeout_s is 45s but this Slurm cluster's KillWait is {kill_wait}s" in output
    assert warned == (kill_wait < 45), output
    doc = status(run_dir)
    assert doc["state"] == "stopped", doc
    latest = store.latest_valid(run_dir / "checkpoints", deep=True)
    assert latest is not None and latest.step == doc["step"] == doc["history"][0]["step_at_failure"], (latest, doc)


def test_two_nodes_one_supervisor_each_requeue_once_and_resume_together(two_local_nodes, tmp_path):
    """The multi-node path of the script: --set nnodes=2, the rendezvous on the first node, --node per task."""
    (first, first_addr), (second, _) = two_local_nodes
    names = [first, second]
    run_dir = tmp_path / "run"
    # The emulated nodes' names do not resolve: the rendezvous host is the first node's address.
    env = slurm_env(RESILIENT_RDZV_HOST=first_addr, RESILIENT_RDZV_PORT=str(free_port()))
    job_id = submit(tmp_path, run_dir, 150, "nproc_per_node=1", env=env,
                    sbatch_args=("--nodes=2", f"--nodelist={first},{second}"))
    try:
        wait_job(job_id, tmp_path, lambda: all(training(run_dir, 5, n, nproc=1) for n in names), 150,
                 "training on both nodes")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        wait_job(job_id, tmp_path, lambda: job_info(job_id).get("Restarts") == "1"
                 and all(run_state(run_dir, n).get("state") == "stopped" for n in names),
                 60, "the requeue, with both supervisors stopped")
        stop_steps = {run_state(run_dir, n)["step"] for n in names}
        latest = store.latest_valid(run_dir / "checkpoints", deep=True)
        assert len(stop_steps) == 1 and latest is not None and latest.step in stop_steps, (stop_steps, latest)
        stop_step = latest.step
        wait_job(job_id, tmp_path, lambda: job_info(job_id).get("JobState") in ENDED, 180,
                 "the requeued job to finish")
        info, output = job_info(job_id), slurm_output(tmp_path, job_id)
        assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), (info, output)
    finally:
        cancel(job_id)

    assert output.count("requeueing job") == 1, output
    assert f"--set nnodes=2 --set rdzv.endpoint={first_addr}:" in output, output
    assert output.count(f"resuming from step {stop_step}") == 2 and output.count("finished at step 150") == 2, output
    doc = status(run_dir)
    assert doc["state"] == "succeeded", doc
    per_node = {n["node"]: n for n in doc["nodes"]}
    assert sorted(per_node) == sorted(names), per_node.keys()
    for node in per_node.values():
        first_run, second_run = node["history"]
        assert first_run["reason"] == "stopped" and first_run["step_at_failure"] == stop_step, first_run
        assert second_run["resumed_from_step"] == stop_step and second_run["reason"] == "finished", second_run
