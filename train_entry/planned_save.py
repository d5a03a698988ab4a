"""DCP's save, planned once per layout.

`dcp.save` plans every save from scratch: each rank's plan (a WriteItem per tensor, ~420 for an 8-layer FSDP2
GPT with AdamW) is pickled to the coordinator, which builds and validates the global plan and scatters it back;
after the writes, every rank's results are gathered and the whole metadata is broadcast back to every rank. In
a background persist all of that holds the interpreter, a few milliseconds at a time, while the training thread
waits for it: measured on a 2-core VM (one rank, 418 items), the persist took 130 ms of a Python loop's time
per save, half of it in those exchanges.

`PlannedSave` drives the same planner and storage writer through the same steps of the SavePlanner /
StorageWriter protocol, with three differences:
- when every rank's state has the layout of the last save that planned (`storage.plan_layout`: names, kinds,
  dtypes, shapes, strides, placements), that save's plans and the coordinator's metadata are used again: one
  all-reduce of one integer replaces the plan exchange. A save that fails on any rank forgets the plans on
  every rank; the next one plans again.
- with reused plans, a rank sends the coordinator only the write results (item locations) that differ from
  those of the save that made the plans, and the coordinator pickles only those anew into the metadata: the
  items' metadata and the other locations were pickled once, at that save (`storage.Pickled`; the file still
  loads with a plain `pickle.load`). Both grow with the world size: the coordinator unpickled and pickled
  every rank's ~420 results on every save.
- after the coordinator has written the metadata, only its outcome goes back to the ranks, not the metadata.
Errors travel as in DCP: each rank's exception, gathered on the coordinator, raised on every rank as one
CheckpointException that names the ranks.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from train_entry.storage import Pickled, Rank0Planner, RawWriter, Updated, plan_layout


@dataclass(frozen=True)
class _Plans:
    layout: tuple[Any, ...]
    plan: SavePlan  # this rank's final plan
    results: list[WriteResult]  # this rank's write results in the save that made the plans
    metadata: Metadata | None  # the coordinator's, with that save's item locations: pickled once (`Pickled`)
    shards_written_by: dict[int, list[int]]  # the coordinator's: Rank0Planner.shards_written_by


class PlannedSave:
    """Saves through `planner` (one per checkpointer) on `group`; `planned` counts the saves that made plans."""

    def __init__(self, planner: Rank0Planner):
        self.planner = planner
        self.planned = 0
        self._last: _Plans | None = None
        # On the coordinator, the last save's ranks whose shards another rank wrote (storage.shards_written_by)
        self.shards_written_by: dict[int, list[int]] = {}

    def save(self, state_dict: dict[str, Any], writer: RawWriter, group: dist.ProcessGroup) -> None:
        try:
            # No autograd in a save: a DTensor's to_local() is then its local tensor, not a node made for it in
            # Python for each shard (a persist took 27-32 ms of a launch-bound loop's time beside it, 22-25 without).
            with torch.no_grad():
                self._save(state_dict, writer, group)
        except BaseException:
            self._last = None  # on every rank: the failure reached them all (or the group is gone)
            raise

    def _save(self, state_dict: dict[str, Any], writer: RawWriter, group: dist.ProcessGroup) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        coordinator = dist.get_global_rank(group, 0)
        is_coordinator = rank == 0
        planner = self.planner
        sd = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}  # as dcp.save
        planner.set_up_planner(sd, storage_meta=writer.storage_meta(), is_coordinator=is_coordinator)
        writer.set_up_storage_writer(is_coordinator)
        layout = plan_layout(planner.state_dict, is_coordinator)
        last, self._last = self._last, None  # kept again only by a save that succeeds
        same = torch.tensor([int(layout is not None and last is not None and last.layout == layout)])
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
        reused = last if same.item() else None
        if reused is not None:
            plan, metadata = reused.plan, reused.metadata
            if planner.flatten_state_dict:  # this save's own mappings (the same names)
                plan = dataclasses.replace(plan, planner_data=planner.mappings)
            planner.plan = plan
        else:
            planner.shards_written_by = {}
            plan, metadata = self._plan(planner, writer, group, rank, world, coordinator)
            if metadata is not None:
                metadata = dataclasses.replace(metadata, state_dict_metadata=Pickled(metadata.state_dict_metadata))
            self.planned += 1

        results, error = _attempt(lambda: writer.write_data(plan, planner).wait())
        # With reused plans a rank sends only the results (item locations) that differ from those of the save that
        # made them (the non-tensor items whose size changed), and the coordinator pickles only those anew: the
        # rest went into the metadata once.
        sent = _changed(reused.results, results) if reused is not None and results is not None else results
        gathered: list[Any] | None = [None] * world if is_coordinator else None
        dist.gather_object((sent, error), gathered, dst=coordinator, group=group)
        outcome: list[Any] = [None]
        if gathered is not None:
            failures = _failures(gathered)
            if failures:
                outcome[0] = CheckpointException("write", failures)
            else:
                assert metadata is not None
                located = {wr.index: wr.storage_data for part, _ in gathered for wr in part}
                if reused is not None:
                    storage = Updated(metadata.storage_data, located)
                else:
                    storage = Pickled(located)
                    metadata = dataclasses.replace(metadata, storage_data=storage)
                done = _attempt(lambda: writer.write_metadata(metadata, storage))
                if done[1] is not None:
                    outcome[0] = CheckpointException("finish", {rank: done[1]})
        dist.broadcast_object_list(outcome, src=coordinator, group=group)
        if outcome[0] is not None:
            raise outcome[0]
        self.shards_written_by = reused.shards_written_by if reused is not None else planner.shards_written_by
        if layout is not None:
            self._last = reused or _Plans(layout, plan, results, metadata, self.shards_written_by)

    @staticmethod
    def _plan(planner: Rank0Planner, writer: RawWriter, group: dist.ProcessGroup, rank: int, world: int,
              coordinator: int) -> tuple[SavePlan, Metadata | None]:
        """DCP's planning: local plans to the coordinator, the global plan back to each rank."""
        local = _attempt(lambda: writer.prepare_local_plan(planner.create_local_plan()))
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(local, gathered, dst=coordinator, group=group)
        scattered: list[Any] | None = None
        metadata = None
        if gathered is not None:
            failures = _failures(gathered)
            if not failures:
                planned, error = _attempt(lambda: planner.create_global_plan([p for p, _ in gathered]))
                if error is None:
                    plans, metadata = planned
                    scattered, error = _attempt(lambda: list(writer.prepare_global_plan(plans)))
                if error is not None:
                    failures = {0: error}
            if failures:
                scattered = [CheckpointException("plan", failures)] * world
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, scattered, src=coordinator, group=group)
        if isinstance(mine[0], CheckpointException):
            raise mine[0]
        return planner.finish_plan(mine[0]), metadata


def _attempt(fn: Callable[[], Any]) -> tuple[Any, tuple[BaseException, traceback.StackSummary] | None]:
    """`fn()`'s value, or its exception as DCP's CheckpointException holds each rank's: with its stack, which
    pickles (sent to the coordinator, raised on every rank)."""
    try:
        return fn(), None
    except Exception as e:
        return None, (e, traceback.extract_tb(e.__traceback__))


def _failures(gathered: list[Any]) -> dict[int, Any]:
    return {rank: error for rank, (_, error) in enumerate(gathered) if error is not None}


def _changed(base: list[WriteResult], results: list[WriteResult]) -> list[WriteResult]:
    """The results that differ from `base`'s (the same plan's, item for item)."""
    if len(base) != len(results):
        return results
    return [r for r, b in zip(results, base, strict=True) if r != b]
