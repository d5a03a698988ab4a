"""TARGET resolution for the light commands: a job file, a run dir, a checkpoint root, or one checkpoint.

A run dir is resolved where it is found: the checkpoint root it records is read relative to it (a copy
acts on itself), and only a root recorded outside it is used as recorded, and named by every command.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from supervisor import layout, store
from supervisor.errors import NotYetError, UsageError


@dataclass(frozen=True)
class Target:
    given: str
    run_dir: Path | None  # None when the checkpoint root has no run dir we know of
    checkpoint_root: Path
    step: int | None = None  # set when TARGET was one checkpoint folder

    @property
    def root_outside(self) -> bool:
        """The checkpoint root lies outside the run dir (an absolute `checkpoint.dir`): shared by copies."""
        return self.run_dir is not None and not layout.inside(self.checkpoint_root, self.run_dir)

    @property
    def root_link(self) -> Path | None:
        """Where the checkpoint root really is, when a link (it or a folder above it) leads elsewhere."""
        real = Path(os.path.realpath(self.checkpoint_root))
        return real if real != Path(os.path.normpath(self.checkpoint_root)) else None

    def root_note(self) -> str | None:
        """The sentence that names a checkpoint root outside the run dir or reached through a link, or None."""
        real = self.root_link
        link = f" (a link to {real})" if real is not None and self.checkpoint_root.is_symlink() else ""
        if not self.root_outside:
            return f"checkpoint root {self.checkpoint_root}{link}" if link else None
        return f"checkpoint root {self.checkpoint_root}{link} (outside the run dir {self.run_dir}, as its job " \
               "records it)"

    def existing_root(self) -> Path | None:
        """The checkpoint root if it exists; None if the run has written no checkpoint yet. A root recorded
        outside the run dir that is gone is a usage error: a copy may have outlived it."""
        root = self.checkpoint_root
        if root.is_dir():
            return root
        if not self.root_outside and (root.exists() or root.is_symlink()):  # audit 6: "no checkpoints yet", gc 0
            raise UsageError(f"{root} is not a folder, yet it is where {self.run_dir or 'this run'} keeps its "
                             "checkpoints; move that file away (or restore the folder) and run the command again.")
        if self.root_outside:
            what = "is not a folder" if root.exists() else "does not exist"
            raise UsageError(f"{self.run_dir} records its checkpoint root as {root}, which {what}; "
                             "restore or mount that folder, or pass the checkpoint root you mean as TARGET.")
        return None


def nothing_here(path: Path | str) -> UsageError:
    """The one sentence every light command gives for a folder that holds neither a run nor checkpoints."""
    return NotYetError(f"{path}: no run and no checkpoints here (no job.json, state.json or step_* folders); "
                       "pass a run dir, a job file or a checkpoint root.")


def once_there(read: Callable[[], T], poll_s: float) -> T:
    """`read()`, waiting out what is not there yet (a run dir still to be made, no state file yet), for --watch and
    --follow started beside a `resilient run` that has not written its run dir yet; said once on stderr. Every
    other error (a bad job file, a damaged record) is said at once."""
    said = False
    while True:
        try:
            return read()
        except NotYetError as e:
            if not said:
                from supervisor import render

                render.err.print(f"{str(e).rstrip('.')}; waiting for it (Ctrl-C to leave)", highlight=False,
                                 soft_wrap=True, markup=False)
                said = True
        time.sleep(poll_s)


def _run_dir_of_root(root: Path) -> Path | None:
    parent = root.parent
    try:
        if layout.looks_like_run_dir(parent) and layout.recorded_checkpoint_root(parent) == root:
            return parent
    except UsageError:  # its job.json records another root, one it may not: the root was named, not that run dir
        pass
    return None


def _holds_checkpoints(path: Path) -> bool:
    try:
        return bool(store.checkpoint_dirs(path, quarantined=True) or store.trash_dirs(path))
    except (FileNotFoundError, NotADirectoryError):
        return False  # a folder that cannot be read says so (the CLI names it), not "nothing here"


def _in_checkpoint(path: Path) -> bool:
    name = path.parent.name
    return bool(store.STEP_RE.match(name) or store.PARTIAL_RE.match(name) or store.QUARANTINE_RE.match(name))


T = TypeVar("T")
_said: set[Path] = set()  # run dirs whose unreadable job.json this process has told of


def resolve(target: str | None, *, allow_checkpoint: bool = False, reads_only: bool = False) -> Target:
    """Work out what TARGET names. Raises UsageError (exit 2) for a path that does not exist, and for a
    folder with no run and no checkpoints (the same sentence from every command). `reads_only` (status, logs):
    a run dir whose job.json cannot be read is still read, its checkpoint root taken from its state file (said on
    stderr); commands that act on checkpoints refuse it, since acting on the wrong root would delete."""
    given = target or "."
    path = Path(os.path.abspath(os.path.expanduser(given)))
    if not path.exists():
        raise NotYetError(f"{given}: no such file or folder; pass a job file, a run dir or a checkpoint root.")
    if path.is_file() and _in_checkpoint(path):
        raise UsageError(f"{given} is a file of checkpoint {path.parent.name}; pass its checkpoint root "
                         f"({path.parent.parent}).")
    if path.is_file():
        from supervisor.config import load_job  # only job-file targets pay for YAML validation

        job = load_job(path, to_launch=False)
        if not layout.looks_like_run_dir(job.run_dir) and not _holds_checkpoints(job.checkpoint.dir):
            raise NotYetError(f"{given}: no run of this job yet (nothing in {job.run_dir}); start it with "
                              f"`resilient run {given}`.")
        return Target(given, job.run_dir, job.checkpoint.dir)
    name = path.name
    if store.STEP_RE.match(name) or store.PARTIAL_RE.match(name) or store.QUARANTINE_RE.match(name):
        if not allow_checkpoint:
            raise UsageError(f"{given} is one checkpoint; pass its checkpoint root ({path.parent}).")
        step = int(name[5:14])
        return Target(given, _run_dir_of_root(path.parent), path.parent, step)
    if layout.looks_like_run_dir(path):
        if not (path / layout.JOB_FILE).exists() and layout.state_files(path):  # no job record: the state's root
            root = _root_from_state(path)
            if not reads_only and not layout.inside(root, path):
                # Audit 15: gc deleted in the folder a state file alone named, as if the job had recorded it.
                raise UsageError(f"{path} has no job.json, and its state file names the checkpoint root {root}, "
                                 "outside the run dir: nothing is done to a root only a state file names. Pass "
                                 "that root as TARGET if it is this run's.")
            return Target(given, path, root)
        try:
            return Target(given, path, layout.recorded_checkpoint_root(path))
        except UsageError as e:
            if not reads_only:
                raise
            root = _root_from_state(path)
            if path not in _said:  # once, not at every refresh of --watch or poll of --wait-ranks
                _said.add(path)
                from supervisor import render

                why = f" ({e.why})" if isinstance(e, layout.JobRecordError) else f": {str(e).rstrip('.')}"
                render.err.print(f"{path / layout.JOB_FILE} cannot be read{why}; the run is read with the checkpoint "
                                 f"root its state file records, {root}", highlight=False, soft_wrap=True, markup=False)
            return Target(given, path, root)
    run_dir = _run_dir_of_root(path)
    if run_dir is None and not _holds_checkpoints(path):
        raise nothing_here(given)
    return Target(given, run_dir, path)


def _root_from_state(run_dir: Path) -> Path:
    """The checkpoint root the run dir's (first readable) state file records, resolved inside it; the default
    <run_dir>/checkpoints when none says."""
    from supervisor import state

    for path in layout.state_files(run_dir):
        try:
            recorded = state.read(path).checkpoint_dir
            return layout.resolved(recorded, run_dir, what=f"{path} (checkpoint_dir)")
        except (state.StateFileError, UsageError, TypeError):
            continue
    return run_dir / layout.CHECKPOINTS_DIR


def local_tiers(t: Target) -> list[tuple[str, Path]]:
    """(node, root) of each node-local tier the run's supervisors report (`checkpoint.local_dir`), that this
    machine can see. Inside the run dir it is recorded relative to it (a copied run dir acts on its own copy);
    outside, as with an outside checkpoint root, it is used as recorded and always named."""
    found: list[tuple[str, Path]] = []
    for node, root in _recorded_local_tiers(t):
        # The durable root itself, or a folder another node already named, is not a second local tier: acting on
        # it twice would delete by one tier's rule what the other keeps, and report each deletion twice.
        if root.is_dir() and not any(_same(root, r) for r in [t.checkpoint_root, *(r for _, r in found)]):
            found.append((node, root))
    return found


def missing_local_tiers(t: Target) -> list[tuple[str, Path]]:
    """(node, root) of each node-local tier a state file records that this machine does not see (a replaced
    node's, another machine's, or removed): said by name, never silently left out; each folder once."""
    missing: list[tuple[str, Path]] = []
    for node, root in _recorded_local_tiers(t):
        if not root.is_dir() and root not in (r for _, r in missing):
            missing.append((node, root))
    return missing


def _recorded_local_tiers(t: Target) -> Iterator[tuple[str, Path]]:
    if t.run_dir is None:
        return
    from supervisor import state

    for path in layout.state_files(t.run_dir):
        try:
            rec = state.read(path)
        except state.StateFileError:
            continue
        recorded = rec.replication.get("local_root")
        if not isinstance(recorded, str) or not recorded:
            continue
        root = layout.resolved(recorded, t.run_dir, what=f"{path} (replication.local_root)")
        yield rec.node or rec.supervisor.get("host") or "node", root


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def keep_local_of(t: Target) -> int:
    """The job's `checkpoint.keep_local` (2 when the run dir does not say)."""
    from supervisor.fsutil import read_json

    if t.run_dir is None:
        return 2
    path = t.run_dir / layout.JOB_FILE
    try:
        value = read_json(path)["job"]["checkpoint"]["keep_local"]
    except (OSError, ValueError, KeyError, TypeError):
        return 2
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{path} records checkpoint.keep_local as {value!r}, which keeps no whole number of "
                         "checkpoints; pass --keep-local N (at least 1).")
    return value


def state_files(t: Target) -> list[Path]:
    """The run's state files (every node's); the "no run here" usage error when there is none."""
    files = layout.state_files(t.run_dir) if t.run_dir is not None else []
    if not files:
        raise NotYetError(f"{t.run_dir or t.checkpoint_root}: no run here (no state file); start one with "
                          "`resilient run JOB.yaml`.")
    return files
