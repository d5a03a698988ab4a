"""jobs/slurm/resilient.sbatch's decisions after srun, without a cluster: srun and scontrol are small stand-ins
on PATH that end as a lost node's srun does (the highest code of all nodes), and `resilient status` is the real one
reading a real run dir. The real Slurm runs of the script are tests/test_slurm.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import state
from tests.proc import REPO, child_env

SBATCH = REPO / "jobs" / "slurm" / "resilient.sbatch"
JOB = REPO / "jobs" / "tiny-cpu.yaml"


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _node(run_dir: Path, name: str, st: state.RunState, updated: float, launched: float, min_nodes: int) -> None:
    rec = state.RunRecord(name="tiny-cpu", run_dir=".", checkpoint_dir="checkpoints", node=name, state=st,
                          attempt=1, min_nodes=min_nodes)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=launched, resumed_from_step=None))
    path = run_dir / "nodes" / name / "state.json"
    state.write(path, rec)
    doc = json.loads(path.read_text())
    doc["updated_at"] = updated
    path.write_text(json.dumps(doc))


def _sbatch(tmp_path: Path, srun_rc: int, *args: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _tool(bin_dir, "srun", f"echo \"srun $*\" >> {tmp_path / 'srun.log'}; exit {srun_rc}")
    _tool(bin_dir, "scontrol", 'echo n1; echo n2')
    _tool(bin_dir, "scancel", "exit 0")
    env = child_env(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="n[1-2]",
                    RESILIENT=f"{sys.executable} -m supervisor", RESILIENT_NNODES="1:")
    return subprocess.run(["bash", str(SBATCH), str(JOB), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("how", ["--run-dir", "--set"])
def test_an_elastic_job_that_finished_without_a_lost_node_ends_0_not_with_the_lost_nodes_code(tmp_path, how):
    """nnodes 1:2: node b's supervisor was killed (srun: 137), node a went on alone and finished. The job ended
    FAILED 137 although `resilient status` said succeeded (a reviewer's Slurm job)."""
    run_dir = tmp_path / "run"
    _node(run_dir, "b", state.RunState.RUNNING, 100.0, 10.0, 1)  # killed: never wrote its end
    _node(run_dir, "a", state.RunState.SUCCEEDED, 300.0, 200.0, 1)
    given = ["--run-dir", str(run_dir)] if how == "--run-dir" else ["--set", f"run_dir={run_dir}"]
    out = _sbatch(tmp_path, 137, *given, "--set", "checkpoint.keep=2")
    assert out.returncode == 0, out.stderr
    assert "the run succeeded (resilient status) though a node's supervisor ended with code 137" in out.stderr
    srun = (tmp_path / "srun.log").read_text()
    assert "--set nnodes=1:2" in srun and f"run_dir={run_dir}" in srun.replace("--run-dir ", "run_dir="), srun


def test_a_failed_run_keeps_srun_s_code_and_so_does_a_run_the_script_cannot_find(tmp_path):
    run_dir = tmp_path / "run"
    _node(run_dir, "b", state.RunState.RUNNING, 100.0, 10.0, 2)
    _node(run_dir, "a", state.RunState.FAILED, 300.0, 200.0, 2)  # it waited for b in vain
    out = _sbatch(tmp_path, 1, "--run-dir", str(run_dir))
    assert out.returncode == 1, out.stderr
    assert "the run succeeded" not in out.stderr
    out = _sbatch(tmp_path, 137, "--run-dir", str(tmp_path / "elsewhere"))  # status answers nothing: as srun said
    assert out.returncode == 137, out.stderr
