"""TARGET resolution for the light commands: a job file, a run dir, a checkpoint root, or one checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from supervisor import layout, store
from supervisor.errors import UsageError
from supervisor.fsutil import read_json


@dataclass(frozen=True)
class Target:
    given: str
    run_dir: Path | None  # None when the checkpoint root has no run dir we know of
    checkpoint_root: Path
    step: int | None = None  # set when TARGET was one checkpoint folder


def checkpoint_root_of_run(run_dir: Path) -> Path:
    """The checkpoint root recorded in the run dir's job.json, else the default <run_dir>/checkpoints."""
    try:
        return Path(read_json(run_dir / layout.JOB_FILE)["job"]["checkpoint"]["dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir / "checkpoints"


def _run_dir_of_root(root: Path) -> Path | None:
    parent = root.parent
    if layout.looks_like_run_dir(parent) and checkpoint_root_of_run(parent) == root:
        return parent
    return None


def resolve(target: str | None, *, allow_checkpoint: bool = False) -> Target:
    """Work out what TARGET names. Raises UsageError (exit 2) for a path that does not exist."""
    given = target or "."
    path = Path(os.path.abspath(os.path.expanduser(given)))
    if not path.exists():
        raise UsageError(f"{given}: no such file or folder; pass a job file, a run dir or a checkpoint root.")
    if path.is_file():
        from supervisor.config import load_job  # only job-file targets pay for YAML validation

        job = load_job(path)
        return Target(given, job.run_dir, job.checkpoint.dir)
    name = path.name
    if store.STEP_RE.match(name) or store.PARTIAL_RE.match(name):
        if not allow_checkpoint:
            raise UsageError(f"{given} is one checkpoint; pass its checkpoint root ({path.parent}).")
        step = int(name[5:14])
        return Target(given, _run_dir_of_root(path.parent), path.parent, step)
    if layout.looks_like_run_dir(path):
        return Target(given, path, checkpoint_root_of_run(path))
    return Target(given, _run_dir_of_root(path), path)
