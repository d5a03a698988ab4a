"""`resilient gc --keep N`: keep the N newest valid checkpoints, delete the rest and abandoned saves.

It says which checkpoint root it acts on before deleting anything, reports only folders that are really
gone, lists separately what it could not remove and why, and exits 1 if anything resisted. A root it cannot
write is a usage error (exit 2) before anything is touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import layout, lock, render, retention, state, store, targets
from supervisor.errors import ExitCode, ResilientError, UsageError
from supervisor.fsutil import file_identity, how_to_make_writable, write_problem
from supervisor.replicate import ROOT_LOCK, root_lock, split_unreplicated

LOCK_WAIT_S = 10.0  # how long gc waits for the nodes' supervisors to leave a durable root's replication lock

UNREPLICATED = "no durable copy yet: the supervisor is still copying it, or the durable tier failed"
# No supervisor runs (audit 13); a rerun copies the newest and drops the older ones as superseded (review 11)
UNREPLICATED_STOPPED = "no durable copy yet: `resilient run` again copies the newest such step"


@dataclass
class GcResult:
    root: Path
    plan: retention.Plan
    dry_run: bool
    applied: retention.Applied | None  # None for a dry run
    local: list[tuple[str, GcResult]] = field(default_factory=list)  # each node-local tier's own result
    verified: bool = False  # --verify: the kept ones were read to the last byte; otherwise their sizes checked

    @property
    def removed(self) -> list[retention.Removal]:
        return self.plan.remove if self.applied is None else self.applied.removed

    @property
    def failed(self) -> list[tuple[retention.Removal, str]]:
        return [] if self.applied is None else self.applied.failed

    @property
    def freed_bytes(self) -> int:  # a dry run: what it would free
        return sum(r.size_bytes for r in self.removed)

    @property
    def exit_code(self) -> ExitCode:
        failed = self.failed or any(r.failed for _, r in self.local or [])
        return ExitCode.FAILED if failed else ExitCode.OK

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "root": str(self.root),
            "kept": [c.step for c in self.plan.kept],
            "removed": [r.to_dict() for r in self.removed],
            "spared": [{"step": c.step, "path": str(c.path), "why": why} for c, why in self.plan.spared],
            "freed_bytes": self.freed_bytes,
            "dry_run": self.dry_run,
            "verified": self.verified,
        }
        if self.failed:
            doc["failed"] = [{**r.to_dict(), "why": why} for r, why in self.failed]
        if self.local:
            doc["local_tiers"] = [{"node": node, **r.to_json()} for node, r in self.local]
        return doc

    def render(self) -> None:
        verb = "would remove" if self.dry_run else "removed"
        for r in self.removed:
            render.out.print(f"{verb} {_name(r)} ({render.human_bytes(r.size_bytes)}): {r.why}", markup=False)
        for r, why in self.failed:
            render.out.print(f"could not remove {_name(r)} ({render.human_bytes(r.size_bytes)}): {why}",
                             markup=False)
        for c, why in self.plan.spared:
            render.out.print(f"kept {c.path.name}: {why}", markup=False)
        kept = ", ".join(str(c.step) for c in self.plan.kept) or "none"
        how = "" if self.verified or not self.plan.kept else " (sizes checked; --verify reads every byte)"
        line = (f"kept valid steps: {kept}{how}; {'would free' if self.dry_run else 'freed'} "
                f"{render.human_bytes(self.freed_bytes)}")
        if self.failed:
            line += f"; {len(self.failed)} folder(s) could not be removed"
        render.out.print(line, markup=False)


def _name(r: retention.Removal) -> str:
    return f"step {r.step}" if r.step is not None else r.path.name


def owner_alive(run_dir: Path | None) -> bool:
    return run_dir is not None and any(lock.holder(d) for d in [run_dir, *layout.node_dirs(run_dir)])


def handed_over(run_dir: Path | None) -> tuple[set[int], bool]:
    """The steps the live supervisors of the run have handed their current attempts' ranks to load, from either
    tier: a rollback's older step, which the ranks may not have read yet (deleting it made them start afresh); and
    whether some attempt's ranks have not begun training yet (they may be loading an older step every node holds)."""
    steps, loading = set(), False
    for n in state.read_nodes(layout.state_files(run_dir) if run_dir is not None else []):
        last = n.record.history[-1] if n.alive and n.record is not None and n.record.history else None
        if last is not None and last.ended_at is None:
            steps.update(s for s in (last.resumed_from_step, last.offered_local_step) if s is not None)
            loading = loading or last.first_step_at is None
    return steps, loading


def main(target: str | None, keep: int, dry_run: bool, as_json: bool, keep_local: int | None = None,
         verify: bool = False) -> int:
    if keep < 1:
        raise UsageError(f"--keep {keep}: keep at least 1 (the newest valid checkpoint is never deleted).")
    t = targets.resolve(target)
    root = t.existing_root()
    if root is not None and _local_tier(root):
        raise UsageError(f"{root} is a node's local checkpoint tier; nothing was removed. gc it through its run "
                         "dir, `resilient gc RUN_DIR --keep N --keep-local M`, which never deletes a local "
                         "checkpoint the durable tier has no copy of.")
    if t.run_dir is None or not owner_alive(t.run_dir):  # a live run's own run dir, by any path, knows its steps
        for held in [r for r in (root,) if r is not None] + [lroot for _, lroot in targets.local_tiers(t)]:
            if (who := lock.live_holder(held)) is not None:
                # Review 13: named by its root (review 14: or through a copy of the run dir that shares it; review
                # 15: and its local tiers), a live run's was judged as a dead one's: the older step a rollback
                # handed its ranks, its saves in progress and the evidence kept while it runs were deleted.
                by = f"supervisor pid {who.get('pid', '?')} on {who.get('host', '?')}"
                raise UsageError(f"{held} is a checkpoint root of the live run {who.get('run_dir', '?')} ({by}); "
                                 "nothing was removed. gc it through that run dir, `resilient gc RUN_DIR --keep N`, "
                                 "which knows the step its ranks are loading, or once the run has ended.")
    # The folder comes first, before anything is deleted: a copied run dir may share an outside root.
    named = t.root_note()  # outside the run dir, or reached through a link: said under --json too
    note = named or f"checkpoint root {t.checkpoint_root}"
    if as_json:
        if named is not None:
            render.err.print(f"resilient: {note}", markup=False, soft_wrap=True)
    else:
        render.out.print(note, markup=False, soft_wrap=True)
    keep_local = keep_local or targets.keep_local_of(t)
    deep = None
    if verify:  # read before the replication lock, which the nodes' supervisors wait on while gc holds it
        deep = DeepReads()
        if root is not None:
            deep.read(store.scan(root), keep)
        for _node, lroot in targets.local_tiers(t):
            deep.read(store.scan(lroot), keep_local)
    with _replication_paused(root) if root is not None and not dry_run else contextlib.nullcontext():
        return _collect(t, root, keep, dry_run, as_json, keep_local, deep)


def _local_tier(root: Path) -> bool:
    """`root` holds a node's local tier (its checkpoints say so): only its run dir knows which have a durable copy."""
    return any(i.valid and i.manifest is not None and i.manifest.extra.get("tier") == "local"
               for i in store.scan(root))


@contextlib.contextmanager
def _replication_paused(root: Path) -> Iterator[None]:
    """A durable tier the nodes' supervisors replicate into: hold their lock while gc judges and deletes, so
    that no node enters a partial gc found unheld, and no publish is under way (a node's copy writes its part
    and publishes under it). Brief for them: a node holds it to enter a partial or to publish one."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        with root_lock(root, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False) as free:
            if free:
                yield
                return
        if time.monotonic() >= deadline:
            raise ResilientError(f"{root}: the nodes' supervisors kept its replication lock "
                                 f"({root / ROOT_LOCK}) for {LOCK_WAIT_S:.0f}s; nothing was removed. "
                                 "Run gc again in a moment.")
        time.sleep(0.1)


class DeepReads:
    """`--verify`: the newest valid checkpoints read to the last byte until `keep` of them match their checksums
    (one that does not takes its real status, corrupt, and the next older one is read in its place). Read once
    before the replication lock; under it, a folder whose marker is still the one read is not read again."""

    def __init__(self) -> None:
        self._read: dict[Path, tuple[list[int] | None, store.CheckpointInfo]] = {}

    def read(self, infos: list[store.CheckpointInfo], keep: int) -> list[store.CheckpointInfo]:
        out, whole = list(infos), 0
        for i in range(len(out) - 1, -1, -1):
            if whole >= keep:
                break
            if out[i].valid:
                path = out[i].path
                marker = file_identity(path / store.MARKER)
                seen = self._read.get(path)
                if seen is None or seen[0] != marker:
                    seen = self._read[path] = (marker, store.inspect(path, deep=True))
                out[i] = seen[1]
                whole += out[i].valid
        return out


def _collect(t: targets.Target, root: Path | None, keep: int, dry_run: bool, as_json: bool,
             keep_local: int, deep: DeepReads | None = None) -> int:
    infos = store.scan(root, quarantined=True) if root is not None else []
    if deep is not None:  # before anything is judged: a checkpoint kept in place of older ones is whole to its bytes
        infos = deep.read(infos, keep)
    handed, still_loading = handed_over(t.run_dir)

    def spare(found: list[store.CheckpointInfo]) -> set[int]:
        return retention.may_be_loading(found, handed) if still_loading else handed

    alive = owner_alive(t.run_dir)
    plan = retention.plan(t.checkpoint_root, infos, keep, owner_alive=alive, handed_over=spare(infos))
    local = []
    durable = {i.step for i in infos if i.valid}
    for node, lroot in targets.local_tiers(t):  # planned before anything is deleted anywhere
        linfos = store.scan(lroot, quarantined=True)
        if deep is not None:
            linfos = deep.read(linfos, keep_local)
        lplan, held = split_unreplicated(retention.plan(lroot, linfos, keep_local, owner_alive=alive,
                                                        handed_over=spare(linfos)), linfos, durable)
        by_path = {i.path: i for i in linfos}
        spared = [*lplan.spared, *((by_path[r.path], UNREPLICATED if alive else UNREPLICATED_STOPPED) for r in held)]
        local.append((node, lroot, retention.Plan(lplan.kept, lplan.remove, spared)))
    applied = None
    if not dry_run:
        for folder, p in [(t.checkpoint_root, plan), *((lroot, lplan) for _, lroot, lplan in local)]:
            problem = write_problem(folder) if p.remove else None
            if problem is not None:
                raise UsageError(f"{folder}: cannot delete there ({problem}); nothing was removed. "
                                 f"{how_to_make_writable(problem)} and run gc again.")
        applied = retention.apply(plan)
    result = GcResult(t.checkpoint_root, plan, dry_run, applied, verified=deep is not None)
    if not as_json:
        result.render()
    for node, lroot, lplan in local:  # each tier named before anything in it is deleted
        header = f"local tier of node {node}: {lroot}"
        if not as_json:
            render.out.print(header, markup=False, soft_wrap=True)
        elif not layout.inside(lroot, t.run_dir):  # type: ignore[arg-type]  # local tiers come from a run dir
            render.err.print(f"resilient: {header} (outside the run dir, as its state records it)", markup=False,
                             soft_wrap=True)
        lresult = GcResult(lroot, lplan, dry_run, None if dry_run else retention.apply(lplan),
                           verified=deep is not None)
        result.local.append((node, lresult))
        if not as_json:
            lresult.render()
    for node, lroot in targets.missing_local_tiers(t):
        (render.err if as_json else render.out).print(
            f"{'resilient: ' if as_json else ''}local tier of node {node}: {lroot} — not on this machine (another "
            "machine's, or removed): nothing removed there", soft_wrap=True)
    if as_json:
        render.print_json(result.to_json())
    return result.exit_code

