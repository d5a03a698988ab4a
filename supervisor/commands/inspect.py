"""`resilient inspect-checkpoint`: list checkpoints with their status and reason; `--verify` reads every byte."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from supervisor import render, store, targets
from supervisor.errors import ExitCode, ResilientError, UsageError
from supervisor.store import CheckpointInfo


@dataclass
class InspectResult:
    root: Path
    checkpoints: list[CheckpointInfo]  # every folder under the root, oldest first
    selected: CheckpointInfo | None
    verified: bool
    step: int | None = None  # --step: only that step's folders are listed
    note: str | None = None  # names a checkpoint root outside the run dir
    local: list[tuple[str, Path, list[CheckpointInfo]]] | None = None  # each node-local tier: node, root, folders
    passed_over: list[tuple[str, str]] | None = None  # names like checkpoints under the root that no scan takes
    missing_local: list[tuple[str, Path]] | None = None  # local tiers a state file records that are not there

    @property
    def latest_valid(self) -> CheckpointInfo | None:
        """The newest valid checkpoint under the root, whatever --step selected."""
        return next((c for c in reversed(self.checkpoints) if c.valid), None)

    @property
    def listed(self) -> list[CheckpointInfo]:
        return self.checkpoints if self.step is None else [c for c in self.checkpoints if c.step == self.step]

    @property
    def _local_steps(self) -> set[int]:
        """The steps valid in every node's local tier as the same save (a node whose tier is not there holds none;
        two saves of one step number are never mixed; a node whose copy lacks shards another node wrote has none):
        the ones a relaunch can take from there."""
        tiers = [{(c.step, store.save_identity(c.manifest.files)) for c in infos if c.valid and c.manifest
                  and node not in (c.manifest.extra.get("lacks_shards_of_other_nodes") or [])}
                 for node, _, infos in self.local or []]
        tiers += [set() for _ in self.missing_local or []]
        return {step for step, _ in set.intersection(*tiers)} if tiers else set()

    @property
    def newest_local(self) -> int | None:
        """The newest step valid in every node's local tier: the one a relaunch takes from there."""
        return max(self._local_steps, default=None)

    @property
    def exit_code(self) -> ExitCode:
        """0 when the selected step (--step), else the newest, is valid where a run would resume from it: the
        durable tier, or every node's local tier."""
        if self.step is not None:
            ok = (self.selected is not None and self.selected.valid) or self.step in self._local_steps
        else:
            ok = self.latest_valid is not None or self.newest_local is not None
        return ExitCode.OK if ok else ExitCode.FAILED

    def to_json(self) -> dict[str, Any]:
        latest = self.latest_valid
        return {
            "root": str(self.root),
            "latest_valid_step": latest.step if latest else None,
            "verified": self.verified,
            "selected_step": self.selected.step if self.selected else None,
            "checkpoints": [{**c.to_dict(), "tier": "durable"} for c in self.listed],
            "passed_over": [{"name": name, "why": why} for name, why in self.passed_over or []],
        } | ({"local_tiers": [
            {"node": node, "root": str(root),
             "latest_valid_step": next((c.step for c in reversed(infos) if c.valid), None),
             "checkpoints": [{**c.to_dict(), "tier": "local", "node": node} for c in infos
                             if self.step is None or c.step == self.step], "missing": False}
            for node, root, infos in self.local or []] + [
            {"node": node, "root": str(root), "latest_valid_step": None, "checkpoints": [], "missing": True}
            for node, root in self.missing_local or []]} if self.local or self.missing_local else {})

    def render(self) -> None:
        if self.note:
            render.out.print(self.note, markup=False, soft_wrap=True)
        self._render_checkpoints()
        for name, why in self.passed_over or []:
            render.out.print(f"passed over: {self.root / name} ({why})", markup=False, soft_wrap=True)

    def _render_checkpoints(self) -> None:
        if not self.checkpoints and not any(infos for _, _, infos in self.local or []):
            render.out.print(f"{self.root}: no checkpoints yet.", markup=False)
            return
        latest, local = self.latest_valid, self.newest_local
        if latest is not None:
            head = Text(f"latest valid: step {latest.step}")
        elif local is not None:
            head = Text(f"no valid checkpoint yet; local tier: step {local}")
        else:
            head = Text("no valid checkpoint", style="red")
        if self.selected is not None:
            head = Text.assemble(f"step {self.selected.step}: ", render.styled(self.selected.status.value), "; ", head)
        elif self.step is not None:  # only a local tier holds it
            everywhere = self.step in self._local_steps
            head = Text.assemble(f"step {self.step}: ", ("" if everywhere else "not ") + "valid in every node's "
                                 "local tier", " (no durable copy); ", head)
        how = "checksums verified" if self.verified else "sizes checked; --verify reads every byte"
        if self.verified and self.selected is not None:
            how = f"step {self.selected.step}'s checksums verified, the others' sizes checked"
        # The head is its own line: a table's title wraps at the table's width, however wide the output.
        render.out.print(Text.assemble(f"{self.root} — ", head, f" ({how})"), soft_wrap=True)
        for node, root, infos in self.local or []:
            newest = next((c.step for c in reversed(infos) if c.valid), None)
            render.out.print(f"local tier of node {node}: {root} — latest valid: "
                             f"{'none' if newest is None else f'step {newest}'}", soft_wrap=True)
        for node, root in self.missing_local or []:
            render.out.print(f"local tier of node {node}: {root} — not on this machine (another machine's, or "
                             "removed): not listed", soft_wrap=True)
        table = self._tiers_table() if self.local else self._table()
        render.out.print(table)

    def _name(self, c: store.CheckpointInfo) -> str:
        mark = " ◀" if self.selected is not None and c.path == self.selected.path else ""
        return f"{c.step}" + (" (partial)" if c.partial else " (quarantined)" if c.quarantined else "") + mark

    def _table(self) -> Table:
        table = Table(box=None, pad_edge=False)
        for col, justify in (("STEP", "right"), ("STATUS", "left"), ("SIZE", "right"), ("FILES", "right"),
                             ("WORLD", "right"), ("CREATED", "left"), ("REASON", "left")):
            table.add_column(col, justify=justify)
        for c in self.listed:
            table.add_row(self._name(c), render.styled(c.status.value), render.human_bytes(c.size_bytes), str(c.files),
                          str(c.world_size or "-"), render.local_time(c.created_at), c.reason)
        return table

    def _tiers_table(self) -> Table:
        """One row per step, a status column per tier: the durable one, then each node's local one. A tier that
        holds two folders of one step (a quarantined one beside a new save) gives the step a second row."""
        tiers: list[tuple[str, list[store.CheckpointInfo]]] = [("DURABLE", self.listed)] + [
            (f"LOCAL:{node}", [c for c in infos if self.step is None or c.step == self.step])
            for node, _, infos in self.local or []]
        by_step: dict[int, list[dict[str, store.CheckpointInfo]]] = {}
        for tier, infos in tiers:
            for c in infos:
                rows = by_step.setdefault(c.step, [])
                row = next((r for r in rows if tier not in r), None)
                if row is None:
                    rows.append(row := {})
                row[tier] = c
        table = Table(box=None, pad_edge=False)
        table.add_column("STEP", justify="right")
        for tier, _ in tiers:
            table.add_column(tier)
        for col, justify in (("SIZE", "right"), ("WORLD", "right"), ("CREATED", "left"), ("REASON", "left")):
            table.add_column(col, justify=justify)
        for step in sorted(by_step):
            for row in by_step[step]:
                first = row.get("DURABLE") or next(iter(row.values()))
                marks = [c for c in row.values() if self.selected is not None and c.path == self.selected.path]
                cells = [f"{step}" + (" ◀" if marks else "")]
                for tier, _ in tiers:
                    c = row.get(tier)
                    kind = " (partial)" if c is not None and c.partial else \
                        " (quarantined)" if c is not None and c.quarantined else ""
                    cells.append("-" if c is None else render.styled(c.status.value) + kind)
                # What is wrong where; when nothing is, one tier's word for it (the others say the same).
                reasons = [f"{tier.lower()}: {c.reason}" for tier, c in row.items() if c.reason and not c.valid] \
                    or [first.reason]
                cells += [render.human_bytes(first.size_bytes), str(first.world_size or "-"),
                          render.local_time(first.created_at), "; ".join(reasons)]
                table.add_row(*cells)
        return table


def _verify_progress(paths: list[Path]) -> Progress | None:
    if not render.err.is_terminal:
        return None
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=render.err, transient=True)


def collect(target: str | None, step: int | None, verify: bool) -> InspectResult:
    if step is not None and not 0 <= step <= store.MAX_STEP:  # a usage error, not "no checkpoint for step -1"
        raise UsageError(f"--step {step}: a checkpoint's step is 0 to {store.MAX_STEP} (its folder is step_ and 9 "
                         "digits); pass one of those `resilient inspect-checkpoint` lists.")
    t = targets.resolve(target, allow_checkpoint=True)
    if t.step is not None and step is not None and step != t.step:
        raise UsageError(f"{target} is the checkpoint of step {t.step}, not {step}: drop --step, or give the "
                         f"checkpoint root, `resilient inspect-checkpoint {t.checkpoint_root} --step {step}`.")
    if step is None:
        step = t.step
    root = t.existing_root()
    dirs = store.checkpoint_dirs(root, quarantined=True) if root is not None else []
    chosen = [d for d in dirs if int(d.name[5:14]) == step] if step is not None else dirs
    if t.step is not None:  # one folder named: that one, not another folder of its step (a quarantined one's twin)
        named = Path(os.path.abspath(os.path.expanduser(t.given)))
        chosen = [d for d in chosen if d == named] or chosen
    local_dirs = [(node, lroot, store.checkpoint_dirs(lroot, quarantined=True))
                  for node, lroot in targets.local_tiers(t)]
    if step is not None and not chosen and not any(int(d.name[5:14]) == step for *_, ds in local_dirs for d in ds):
        # The contract's exit 1: the selected checkpoint is not valid (here: not there at all).
        where = t.run_dir if local_dirs and t.run_dir is not None else t.checkpoint_root
        raise ResilientError(f"{where}: no checkpoint for step {step}"
                             f"{' in any tier' if local_dirs else ''}; `resilient inspect-checkpoint {where}` lists "
                             "them.")
    deep = set(chosen) if verify else set()  # with --step, only that step is read byte by byte
    progress = _verify_progress(chosen) if verify else None
    if progress is None:
        infos = [store.inspect(d, deep=d in deep) for d in dirs]
    else:
        todo = sum(store.inspect(d).size_bytes for d in chosen)
        with progress:
            task = progress.add_task("verifying", total=todo)
            infos = [store.inspect(d, deep=d in deep, progress=lambda n: progress.advance(task, n))
                     for d in dirs]
    selected = None
    if step is not None and chosen:
        mine = [i for i in infos if i.step == step]
        committed = [i for i in mine if not i.partial and not i.quarantined]
        selected = next((i for i in mine if i.path in chosen), None) if len(chosen) == 1 else None
        selected = selected or (committed or mine)[-1]
    local = [(node, lroot, [store.inspect(d, deep=verify and (step is None or int(d.name[5:14]) == step))
                            for d in dirs_there])
             for node, lroot, dirs_there in local_dirs]
    return InspectResult(t.checkpoint_root, infos, selected, verify, step, t.root_note(), local,
                         store.passed_over(root) if root is not None else [], targets.missing_local_tiers(t))


def main(target: str | None, step: int | None, verify: bool, as_json: bool) -> int:
    result = collect(target, step, verify)
    render.emit(result, as_json)
    return result.exit_code
