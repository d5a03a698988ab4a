"""`resilient gc --keep N`: keep the N newest valid checkpoints, delete the rest and abandoned saves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor import layout, lock, render, retention, store, targets
from supervisor.errors import ExitCode, UsageError


@dataclass
class GcResult:
    plan: retention.Plan
    dry_run: bool
    freed_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "kept": [c.step for c in self.plan.kept],
            "removed": [r.to_dict() for r in self.plan.remove],
            "spared": [{"step": c.step, "path": str(c.path), "why": why} for c, why in self.plan.spared],
            "freed_bytes": self.freed_bytes,
            "dry_run": self.dry_run,
        }

    def render(self) -> None:
        verb = "would remove" if self.dry_run else "removed"
        for r in self.plan.remove:
            what = f"step {r.step}" if r.step is not None else r.path.name
            render.out.print(f"{verb} {what} ({render.human_bytes(r.size_bytes)}): {r.why}")
        for c, why in self.plan.spared:
            render.out.print(f"kept {c.path.name}: {why}")
        kept = ", ".join(str(c.step) for c in self.plan.kept) or "none"
        render.out.print(f"kept valid steps: {kept}; {'would free' if self.dry_run else 'freed'} "
                         f"{render.human_bytes(self.freed_bytes)}")


def owner_alive(run_dir) -> bool:
    return run_dir is not None and any(lock.holder(d) for d in [run_dir, *layout.node_dirs(run_dir)])


def main(target: str | None, keep: int, dry_run: bool, as_json: bool) -> int:
    if keep < 1:
        raise UsageError(f"--keep {keep}: keep at least 1 (the newest valid checkpoint is never deleted).")
    t = targets.resolve(target)
    if not t.checkpoint_root.is_dir():
        raise UsageError(f"{t.checkpoint_root}: no checkpoint root here (the folder does not exist).")
    infos = store.scan(t.checkpoint_root, quarantined=True)
    plan = retention.plan(t.checkpoint_root, infos, keep, owner_alive=owner_alive(t.run_dir))
    freed = plan.freed_bytes if dry_run else retention.apply(plan)  # dry run: what it would free
    render.emit(GcResult(plan, dry_run, freed), as_json)
    return ExitCode.OK
