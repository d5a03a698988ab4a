"""`resilient inspect-checkpoint`: list checkpoints with their status and reason; `--verify` reads every byte."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from supervisor import render, store, targets
from supervisor.errors import ExitCode, UsageError
from supervisor.store import CheckpointInfo


@dataclass
class InspectResult:
    root: Path
    checkpoints: list[CheckpointInfo]
    selected: CheckpointInfo | None
    verified: bool

    @property
    def latest_valid(self) -> CheckpointInfo | None:
        return next((c for c in reversed(self.checkpoints) if c.valid), None)

    @property
    def exit_code(self) -> ExitCode:
        chosen = self.selected if self.selected is not None else self.latest_valid
        return ExitCode.OK if chosen is not None and chosen.valid else ExitCode.FAILED

    def to_json(self) -> dict[str, Any]:
        latest = self.latest_valid
        return {
            "root": str(self.root),
            "latest_valid_step": latest.step if latest else None,
            "verified": self.verified,
            "selected_step": self.selected.step if self.selected else None,
            "checkpoints": [c.to_dict() for c in self.checkpoints],
        }

    def render(self) -> None:
        latest = self.latest_valid
        head = f"latest valid: step {latest.step}" if latest else "[red]no valid checkpoint[/]"
        how = "checksums verified" if self.verified else "sizes checked; --verify reads every byte"
        table = Table(title=f"{self.root} — {head} ({how})", title_justify="left", box=None, pad_edge=False)
        for col, justify in (("STEP", "right"), ("STATUS", "left"), ("SIZE", "right"), ("FILES", "right"),
                             ("WORLD", "right"), ("CREATED", "left"), ("REASON", "left")):
            table.add_column(col, justify=justify)
        for c in self.checkpoints:
            name = f"{c.step}" + (" (partial)" if c.partial else " (quarantined)" if c.quarantined else "")
            mark = " ◀" if self.selected is not None and c.path == self.selected.path else ""
            table.add_row(name, render.styled(c.status.value), render.human_bytes(c.size_bytes),
                          str(c.files), str(c.world_size or "-"), render.local_time(c.created_at),
                          c.reason + mark)
        if not self.checkpoints:
            render.out.print(f"{self.root}: no checkpoints here.")
        else:
            render.out.print(table)


def _verify_progress(paths: list[Path]) -> Progress | None:
    if not render.err.is_terminal:
        return None
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=render.err, transient=True)


def collect(target: str | None, step: int | None, verify: bool) -> InspectResult:
    t = targets.resolve(target, allow_checkpoint=True)
    if step is None:
        step = t.step
    root = t.checkpoint_root
    if not root.is_dir():
        raise UsageError(f"{root}: no checkpoint root here (the folder does not exist).")
    dirs = store.checkpoint_dirs(root, quarantined=True)
    if step is not None:
        dirs = [d for d in dirs if int(d.name[5:14]) == step]
        if not dirs:
            raise UsageError(f"{root}: no checkpoint for step {step}; `resilient inspect-checkpoint "
                             f"{root}` lists them.")
    progress = _verify_progress(dirs) if verify else None
    if progress is None:
        infos = [store.inspect(d, deep=verify) for d in dirs]
    else:
        todo = sum(store.inspect(d).size_bytes for d in dirs)
        with progress:
            task = progress.add_task("verifying", total=todo)
            infos = [store.inspect(d, deep=True, progress=lambda n: progress.advance(task, n)) for d in dirs]
    selected = None
    if step is not None:
        committed = [i for i in infos if not i.partial and not i.quarantined]
        selected = (committed or infos)[-1]
    return InspectResult(root, infos, selected, verify)


def main(target: str | None, step: int | None, verify: bool, as_json: bool) -> int:
    result = collect(target, step, verify)
    render.emit(result, as_json)
    return result.exit_code
