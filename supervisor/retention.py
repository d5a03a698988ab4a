"""Retention: which checkpoint folders `gc` and the supervisor may delete, and deleting them.

Rules: keep the N newest valid checkpoints and never the newest valid one; remove older valid ones and
invalid folders (committed ones only while a valid checkpoint remains), never a quarantined one (evidence the
supervisor set aside) nor one that could not be read (a permission or an I/O error says nothing about its
bytes); remove a partial save only when no live writer can own it (its writer lock is free, and either no
supervisor holds the run dir or the partial is older than the newest valid checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from supervisor import store
from supervisor.fsutil import fsync_dir
from supervisor.store import CheckpointInfo


@dataclass(frozen=True)
class Removal:
    """One folder to delete, and why."""

    path: Path
    step: int | None
    size_bytes: int
    why: str

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"path": str(self.path), "size_bytes": self.size_bytes, "why": self.why}
        if self.step is not None:
            d["step"] = self.step
        return d


@dataclass(frozen=True)
class Plan:
    kept: list[CheckpointInfo]
    remove: list[Removal]
    spared: list[tuple[CheckpointInfo, str]]  # invalid folders left alone, with the reason

    @property
    def freed_bytes(self) -> int:
        return sum(r.size_bytes for r in self.remove)


def _folder_size(path: Path) -> int:
    """The bytes of the plain files under `path`, links not followed."""
    total = 0
    for folder, _subdirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def plan(root: Path, infos: Sequence[CheckpointInfo], keep: int, *, owner_alive: bool,
         handed_over: Collection[int] = ()) -> Plan:
    """Decide what to delete under `root`.

    Args:
        root: the checkpoint root (for leftover trash folders).
        infos: `store.scan(root)`, oldest first.
        keep: how many of the newest valid checkpoints survive; at least 1.
        owner_alive: a supervisor holds the run dir, so its newest partial save may be live.
        handed_over: steps a live supervisor has handed its relaunched ranks to load (a rollback's older step).
    """
    if keep < 1:
        raise ValueError("keep must be at least 1: the newest valid checkpoint is never deleted")
    valid = [i for i in infos if i.valid]
    kept = valid[-keep:]
    newest_valid = kept[-1].step if kept else None
    kept_paths = {i.path for i in kept}
    remove: list[Removal] = []
    spared: list[tuple[CheckpointInfo, str]] = []
    for info in infos:
        if info.path in kept_paths:
            continue
        older = newest_valid is not None and info.step < newest_valid
        if info.quarantined:
            spared.append((info, "quarantined: resilient never deletes it; remove it by hand once understood"))
        elif info.valid and info.step in handed_over:
            spared.append((info, "a live supervisor's relaunched ranks may be loading it"))
        elif info.valid:
            remove.append(Removal(info.path, info.step, info.size_bytes, f"older than the {keep} newest valid"))
        elif info.status is store.Status.UNREADABLE and not info.partial:
            spared.append((info, f"{info.reason}: nothing is known about its bytes, so it is not deleted; "
                                 "make it readable, or remove it by hand"))
        elif info.partial:
            pid = store.writer_alive(info.path)
            if pid is not None:
                spared.append((info, store.writer_text(pid)))
            elif owner_alive and not older:
                spared.append((info, "a live supervisor may still own this save"))
            else:
                remove.append(Removal(info.path, info.step, info.size_bytes, "abandoned partial save"))
        elif info.manifest is None and not store.holds_checkpoint_files(info.path):  # (before the branches below: a
            spared.append((info, f"{store.NOT_A_CHECKPOINT}: remove it by hand"))  # any step's (review 14)
        elif owner_alive and not older:
            spared.append((info, "newer than the newest valid and the run is live (kept as evidence)"))
        elif not older and newest_valid is not None:  # audit 15: one stray file, and gc deleted an intact newest save
            spared.append((info, f"{info.status.value} ({info.reason}), newer than the newest valid: kept for you "
                                 "to look at; the next `resilient run` sets it aside, or remove it by hand"))
        elif newest_valid is None:
            spared.append((info, f"{info.status.value} ({info.reason}), but no valid checkpoint is left here: kept as "
                                 "all that remains of the run's progress; remove it by hand once understood"))
        else:
            remove.append(Removal(info.path, info.step, info.size_bytes, f"{info.status.value}: {info.reason}"))
    if root.is_dir():
        for trash in store.trash_dirs(root):
            remove.append(Removal(trash, None, _folder_size(trash),
                                  "leftover of a superseded or partly deleted checkpoint"))
        spares = {} if owner_alive else store.spare_sizes(root)  # while a run goes on, its saves write over them
        if spares:
            remove.append(Removal(root / store.SPARE_DIR, None, sum(spares.values()),
                                  "data files of deleted checkpoints that a run kept for its next saves"))
    return Plan(kept, remove, spared)


def may_be_loading(infos: Sequence[CheckpointInfo], handed: Collection[int]) -> set[int]:
    """The steps relaunched ranks may be loading when their supervisor(s) handed over `handed`: each valid one up to
    the newest handed. The ranks take the smallest step the nodes handed over, and with a local tier the newest
    one every node holds, which may be older than this node's (review 16: retention deleted that older common step
    under the ranks reading it, when a publish moved it out of `keep_local`)."""
    if not handed:
        return set()
    newest = max(handed)
    return {*handed, *(i.step for i in infos if i.valid and i.step <= newest)}


def named(removals: Sequence[Removal]) -> str:
    """The folders removed, each invalid one with its reason (a valid one went for `keep`, as the line says)."""
    return ", ".join(r.path.name if r.why.startswith("older than") else f"{r.path.name} ({r.why})"
                     for r in sorted(removals, key=lambda r: r.path.name))


@dataclass(frozen=True)
class Applied:
    """What deleting a plan really did: only folders that are gone count as removed."""

    removed: list[Removal]
    failed: list[tuple[Removal, str]]  # with the reason, e.g. "Read-only file system"

    @property
    def freed_bytes(self) -> int:
        return sum(r.size_bytes for r in self.removed)


GONE = "gone already"  # _remove: someone else removed it first (another gc, another node's retention)


def _remove(r: Removal, spare_bytes: int = 0) -> str | None:
    """Delete one folder; None when this call deleted it, GONE when it was gone already, else why not. A
    checkpoint is first renamed aside in one atomic step, so a deletion that fails half-way never leaves a
    half-deleted `step_<N>` folder behind. With `spare_bytes`, its data files go to the root's spare pool first
    (store.keep_spare), up to that many bytes."""
    path = r.path
    if not path.name.startswith(store.TRASH_PREFIX):
        aside = store.aside_path(path)
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return GONE
        except OSError as e:
            return e.strerror or str(e)  # nothing was touched
        path = aside
    if spare_bytes:
        with contextlib.suppress(OSError):
            # The rename aside durable first: a crash must never bring back step_<N> over a file that a new save
            # has since written over (a persistent local tier; its inspect checks sizes, not every byte).
            fsync_dir(path.parent)
            store.keep_spare(path, path.parent, spare_bytes)
    errors: list[str] = []

    def record(_func: object, failed: str, exc: object) -> None:
        e = exc[1] if isinstance(exc, tuple) else exc  # onerror passes exc_info, onexc the exception
        errors.append(f"{Path(failed).name}: {getattr(e, 'strerror', None) or e}")

    shutil.rmtree(path, **({"onexc": record} if sys.version_info >= (3, 12) else {"onerror": record}))
    if not path.exists():
        return None
    first = errors[0] if errors else "it is still there"
    where = f"moved aside to {path.name}, " if path != r.path else ""
    return f"{where}{len(errors) or 1} entr{'y' if len(errors) <= 1 else 'ies'} could not be deleted ({first})"


def set_aside(p: Plan) -> Plan:
    """Rename each folder of the plan aside (the first step of its deletion, atomic and quick); the plan returned
    names them there, for `apply` to delete later. One that cannot be renamed is left out: the next retention
    tries again (deleting it later, outside the caller's lock, could take a folder someone has entered since)."""
    moved = []
    for r in p.remove:
        if r.path.name.startswith(store.TRASH_PREFIX):
            moved.append(r)
            continue
        aside = store.aside_path(r.path)
        try:
            os.rename(r.path, aside)
        except OSError:  # gone already, or not renamable now
            continue
        else:
            moved.append(replace(r, path=aside))
    return Plan(p.kept, moved, p.spared)


def apply(p: Plan, *, spare_bytes: int = 0) -> Applied:
    """Delete what the plan says (invalid folders first, oldest valid last) and report what really happened.
    `spare_bytes`: keep up to that many bytes of the deleted folders' data files for the next saves to write
    over (a local tier, while its run goes on: store.keep_spare)."""
    removed: list[Removal] = []
    failed: list[tuple[Removal, str]] = []
    for r in sorted(p.remove, key=lambda r: r.why.startswith("older than")):
        why = _remove(r, spare_bytes)
        if why is None:
            removed.append(r)
        elif why is not GONE:  # gone already: someone else's removal, not reported as ours
            failed.append((r, why))
    return Applied(removed, failed)
