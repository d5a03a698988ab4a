"""Where a run's files live. One place, so the supervisor, the entry point and the light commands agree.

    <run_dir>/job.json                 the resolved job (written by `resilient run`; read by status, gc)
    <run_dir>/checkpoints/             the checkpoint root (default; `checkpoint.dir` moves it)
    <node_dir>/state.json              the supervisor's state, rewritten after every event
    <node_dir>/supervisor.lock         flock-ed by the live supervisor
    <node_dir>/logs/attempt_<k>/       torchrun's output and each rank's stdout/stderr/error.json
    <node_dir>/heartbeats/attempt_<k>/ rank_<r>.json, rewritten by every rank at most once per interval
    <node_dir>/steps/attempt_<k>.jsonl rank 0's step log (step, wall time), for lost-work accounting

`node_dir` is the run dir itself for a single-node job, and `<run_dir>/nodes/<node>` when several nodes
share the run dir (each node's supervisor owns its own state, lock, logs and heartbeats).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

JOB_FILE = "job.json"
STATE_FILE = "state.json"
NODES_DIR = "nodes"


@dataclass(frozen=True)
class RunLayout:
    run_dir: Path
    node: str | None = None  # None: single node, files directly in run_dir

    @property
    def node_dir(self) -> Path:
        return self.run_dir if self.node is None else self.run_dir / NODES_DIR / self.node

    @property
    def job_file(self) -> Path:
        return self.run_dir / JOB_FILE

    @property
    def state_file(self) -> Path:
        return self.node_dir / STATE_FILE

    def logs_dir(self, attempt: int) -> Path:
        return self.node_dir / "logs" / f"attempt_{attempt}"

    def heartbeat_dir(self, attempt: int) -> Path:
        return self.node_dir / "heartbeats" / f"attempt_{attempt}"

    def step_log(self, attempt: int) -> Path:
        return self.node_dir / "steps" / f"attempt_{attempt}.jsonl"


def state_files(run_dir: Path) -> list[Path]:
    """Every node's state file under a run dir (the single-node one first)."""
    found = [run_dir / STATE_FILE] if (run_dir / STATE_FILE).is_file() else []
    nodes = run_dir / NODES_DIR
    if nodes.is_dir():
        found += sorted(p for p in nodes.glob(f"*/{STATE_FILE}") if p.is_file())
    return found


def node_dirs(run_dir: Path) -> list[Path]:
    return [p.parent for p in state_files(run_dir)]


def looks_like_run_dir(path: Path) -> bool:
    return (path / JOB_FILE).is_file() or bool(state_files(path))
