"""Where a run's files live. One place, so the supervisor, the entry point and the light commands agree.

    <run_dir>/job.json                 the resolved job (written by `resilient run`; read by status, gc)
    <run_dir>/checkpoints/             the checkpoint root (default; `checkpoint.dir` moves it)
    <node_dir>/state.json              the supervisor's state, rewritten after every event
    <node_dir>/supervisor.lock         flock-ed by the live supervisor
    <node_dir>/logs/attempt_<k>/       torchrun.log, and rank_<r>/ (a link to torchrun's folder for rank r:
                                       stdout.log, stderr.log, error.json) under ranks/
    <node_dir>/heartbeats/attempt_<k>/ rank_<r>.json, rewritten by every rank at most once per interval
    <node_dir>/steps/attempt_<k>.jsonl rank 0's step log (step, wall time), for lost-work accounting

`node_dir` is the run dir itself for a single-node job, and `<run_dir>/nodes/<node>` when several nodes
share the run dir (each node's supervisor owns its own state, lock, logs and heartbeats).

A run dir belongs to the user, who may copy, move or archive it: every path a run records that lies inside
its run dir (job.json, state.json) is written relative to the run dir and resolved against the folder it is
found in, so a copy acts on itself only. A path outside it (an absolute `checkpoint.dir`) is kept as it is.
Files written before this rule hold absolute paths; a path inside the run dir they were written in is
rebased onto the folder the run dir is found in now, never followed back to the old place.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import UsageError
from supervisor.fsutil import read_json, unreadable_fix

JOB_FILE = "job.json"
STATE_FILE = "state.json"
NODES_DIR = "nodes"
CHECKPOINTS_DIR = "checkpoints"  # checkpoint.dir's default
LOGS_DIR = "logs"
HEARTBEATS_DIR = "heartbeats"
STEPS_DIR = "steps"
RDZV_DIR = "rdzv"
CONTROL_FILE = "control.json"
LOCK_FILE = "supervisor.lock"  # lock.RunLock's, in the run dir and in each node's folder
# What a run dir holds (before its job.json is written too: a run that stopped at a refusal, a first node's folder),
# and lost+found, which a run dir that is a filesystem's root has.
RUN_DIR_NAMES = frozenset({JOB_FILE, STATE_FILE, NODES_DIR, LOCK_FILE, CHECKPOINTS_DIR, LOGS_DIR, HEARTBEATS_DIR,
                           STEPS_DIR, RDZV_DIR, CONTROL_FILE, "lost+found"})


@dataclass(frozen=True)
class RunLayout:
    run_dir: Path
    node: str | None = None  # None: single node, files directly in run_dir

    @property
    def node_name(self) -> str:
        """This node's name in what it writes elsewhere (its local tier, its durable parts): `--node`, else the
        host name. The ranks name it the same way (train_entry.session)."""
        return self.node or socket.gethostname()

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
        return self.node_dir / LOGS_DIR / f"attempt_{attempt}"

    def heartbeat_dir(self, attempt: int) -> Path:
        return self.node_dir / HEARTBEATS_DIR / f"attempt_{attempt}"

    def step_log(self, attempt: int) -> Path:
        return self.node_dir / STEPS_DIR / f"attempt_{attempt}.jsonl"


def state_files(run_dir: Path) -> list[Path]:
    """Every node's state file under a run dir (the single-node one first)."""
    found = [run_dir / STATE_FILE] if (run_dir / STATE_FILE).is_file() else []
    nodes = run_dir / NODES_DIR
    if nodes.is_dir() and not nodes.is_symlink():  # a link to another run dir is not a node of this one (audit 6)
        found += sorted(p for p in nodes.glob(f"*/{STATE_FILE}") if p.is_file() and not p.parent.is_symlink())
    return found


def node_dirs(run_dir: Path) -> list[Path]:
    return [p.parent for p in state_files(run_dir)]


def looks_like_run_dir(path: Path) -> bool:
    return (path / JOB_FILE).is_file() or bool(state_files(path))


def recorded(path: str | os.PathLike, run_dir: Path) -> str:
    """How a run records `path`: relative to `run_dir` when it lies inside it ("." for the run dir itself),
    else absolute."""
    try:
        return Path(os.path.normpath(path)).relative_to(os.path.normpath(run_dir)).as_posix()
    except ValueError:
        return str(path)


def resolved(path: str | os.PathLike, run_dir: Path, written_in: str | os.PathLike | None = None, *,
             what: str = "a file of the run dir") -> Path:
    """A recorded path, resolved against the run dir as it is found now.

    Args:
        path: as recorded (relative to the run dir, or absolute).
        run_dir: where the run dir is now.
        written_in: the run dir's own path as an older file recorded it (absolute); a path inside it is
            rebased onto `run_dir`.
        what: the file and key it was read from, for the error.

    Raises:
        UsageError: a relative path that climbs out of the run dir (`..`): a run never records one (it writes
            paths outside it absolute), and following it would act on another folder as if it were the run's;
            or one holding a NUL character, which no system call takes.
    """
    if "\x00" in os.fspath(path):  # no system call takes it (a ValueError from the first one)
        raise UsageError(f"{what} records the path {str(path)!r}, which holds a NUL character: the file is damaged; "
                         "pass the checkpoint root you mean as TARGET (`resilient run` writes the run's files anew).")
    p = Path(os.path.normpath(path))
    if not p.is_absolute():
        if p.parts[:1] == (os.pardir,):
            raise UsageError(f"{what} records the path {str(path)!r}, which leads out of the run dir {run_dir}; "
                             "a run records paths inside it relative to it and others absolute: write it "
                             "as an absolute path, or pass the checkpoint root you mean as TARGET.")
        return run_dir / p
    if written_in is not None and Path(written_in).is_absolute():
        try:
            return run_dir / p.relative_to(os.path.normpath(written_in))
        except ValueError:
            pass
    return p


def recorded_checkpoint_root(run_dir: Path) -> Path:
    """The checkpoint root job.json records, resolved against `run_dir`; the default <run_dir>/checkpoints when
    there is no job.json. A job.json that cannot be read is a UsageError: the root it names may be elsewhere, and
    acting on the default in its place would show or delete the wrong folder."""
    path = run_dir / JOB_FILE
    try:
        doc = read_json(path)
        job = doc.get("job") if isinstance(doc, dict) else None
        checkpoint = job.get("checkpoint") if isinstance(job, dict) else None
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("dir"), str):
            raise KeyError("it has no job.checkpoint.dir")  # audit 15: "TypeError 'NoneType' object is not ..."
        written_in = job.get("run_dir")  # type: ignore[union-attr]  # a dict: checkpoint came from it
        return resolved(checkpoint["dir"], run_dir, written_in if isinstance(written_in, str) else None,
                        what=f"{path} (checkpoint.dir)")
    except FileNotFoundError:
        return run_dir / CHECKPOINTS_DIR
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not a job record: {e.args[0]}" if isinstance(e, KeyError) \
            else "not a job record: not valid JSON" if isinstance(e, json.JSONDecodeError) \
            else f"not a job record: {e}"
        fix = unreadable_fix(e) if isinstance(e, OSError) else None
        fix = f"{fix}, or " if fix else ""
        raise JobRecordError(f"{path} cannot be read ({why}); it records where this run's checkpoints are: {fix}pass "
                             "the checkpoint root you mean as TARGET (`resilient run` on the run dir writes it "
                             "anew).", why) from None


class JobRecordError(UsageError):
    """A run dir's job.json that cannot be read, and why."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies under it, by name (`..` taken into account; links are not followed)."""
    path, folder = Path(os.path.normpath(path)), Path(os.path.normpath(folder))
    return path == folder or folder in path.parents
