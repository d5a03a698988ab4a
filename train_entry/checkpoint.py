"""Saving and loading through DCP, following the store's protocol (supervisor.store).

A save, on every rank: rank 0 opens the partial folder; all ranks write their shards through DCP on the
dedicated gloo checkpoint group, raw and checksummed as they are written (train_entry/storage.py); rank 0
gathers the records and commits (marker last, folder renamed). With `async_save`, the training thread blocks
only while the state is copied into the host arena (train_entry/staging.py); the rest runs in one background
thread whose heavy work (writing, fsync, checksums) runs with the GIL released, at most one save in flight,
so host memory holds one staging copy of this rank's shard. A synchronous save on CUDA stages too (the
fastest way off the device); on the CPU it writes the live tensors.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from supervisor import store
from supervisor.protocol import CommitRecord
from train_entry.dist import DistContext
from train_entry.planned_save import PlannedSave
from train_entry.staging import HostStager
from train_entry.storage import Rank0Planner, RawReader, RawWriter

log = logging.getLogger("train_entry")

PAUSE_POINTS = ("mid_data", "before_marker")


class CheckpointError(RuntimeError):
    """A save failed (disk full, a rank died mid-save, ...). Raised in the training thread."""


@dataclass(frozen=True)
class SavePause:
    """Test hook at `point` of the save of `step` (any step if None): sleep `seconds`, to be killed there; or,
    with `fill_disk`, fill the checkpoint filesystem (a real ENOSPC for what the save writes next)."""

    point: str
    seconds: float
    step: int | None = None
    fill_disk: bool = False

    @classmethod
    def parse(cls, text: str) -> SavePause:
        """`mid_data:30`, `before_marker:30@20` or `before_marker:enospc@40`."""
        body, _, step = text.partition("@")
        point, _, action = body.partition(":")
        if point not in PAUSE_POINTS or not action:
            raise ValueError(f"--test-save-pause {text!r}: expected POINT:SECONDS[@STEP] or POINT:enospc[@STEP], "
                             "POINT one of " + ", ".join(PAUSE_POINTS))
        fill = action == "enospc"
        return cls(point, 0.0 if fill else float(action), int(step) if step else None, fill)

    def maybe(self, point: str, step: int, folder: Path | None = None) -> None:
        if point != self.point or (self.step is not None and self.step != step):
            return
        if self.fill_disk and folder is not None:
            filler = folder.parent / "test-filler.bin"
            log.warning("test hook: filling the checkpoint filesystem (%s) at %s of the save of step %d", filler,
                        point, step)
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                chunk = bytes(1 << 16)
                while os.write(fd, chunk):
                    pass
            except OSError:  # ENOSPC: full
                pass
            finally:
                os.close(fd)
            return
        log.warning("test hook: pausing %.1fs at %s of the save of step %d", self.seconds, point, step)
        time.sleep(self.seconds)


class Checkpointer:
    """Saves and loads one rank's share of the checkpoints.

    Args:
        root: where saves go: the durable tier, or with `durable_root` given, this node's local tier.
        durable_root: the durable tier when saves go to a node-local tier (`checkpoint.local_dir`): each node's
            first rank then commits its node's folder (its ranks' shards, every rank's small file, DCP's
            metadata) and the node's supervisor replicates it (supervisor/replicate.py).
        node: this rank's node, as the local tier's markers name it.
    """

    def __init__(self, root: str | Path, ctx: DistContext, *, async_save: bool,
                 on_committed: Callable[[CommitRecord], None] | None = None, pause: SavePause | None = None,
                 durable_root: str | Path | None = None, node: str = "node"):
        self.root = Path(root)
        self.durable_root = Path(durable_root) if durable_root is not None else self.root
        self.local = self.durable_root != self.root
        self.node = node
        self.ctx = ctx
        self.async_save = async_save
        self.on_committed = on_committed
        self.pause = pause
        self.last_save_s: float | None = None  # wall time of the last whole save, blocking + persist
        self._stager = HostStager(pin_memory=ctx.device.type == "cuda", device=ctx.device)
        self._announced = 0  # the stager's allocations the log has told of
        # Small values several ranks offer come back as rank 0's (DDP's BatchNorm buffers): train_entry/storage.py.
        self._planner = Rank0Planner()
        self._saver = PlannedSave(self._planner)  # DCP's save, its plans made once per layout
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.in_flight: int | None = None

    # ---- saving -------------------------------------------------------------------------------------

    def save(self, step: int, state_dict: Callable[[], dict[str, Any]], *, sync: bool,
             extra: dict[str, Any] | None = None) -> float:
        """Save `state_dict()` as step `step`; returns the seconds the caller was blocked.

        Waits first for a save still in flight (that wait counts as blocking: it is what the caller pays).
        """
        t0 = time.monotonic()
        self.wait()
        with _collection_paused():  # counted: a persist still in flight keeps its own pause
            sd = state_dict()
            if sync or not self.async_save:
                on_device = self.ctx.device.type != "cpu"
                try:
                    if on_device:
                        sd = self._stage(sd)
                    self._persist(step, sd, extra or {}, t0, blocking_s=None,
                                  arena=self._stager.arena if on_device else None)
                except (Exception, CheckpointException) as e:  # the news of a failed background save (DCP's
                    # CheckpointException, each rank's error in it, is a BaseException): the supervisor classifies it
                    raise CheckpointError(f"checkpoint save failed: {e}") from e
                return time.monotonic() - t0
            staged = self._stage(sd)
        blocking = time.monotonic() - t0
        self.in_flight = step
        self._thread = threading.Thread(target=self._persist_in_background, name=f"resilient-save-{step}",
                                        args=(step, staged, extra or {}, t0, blocking, self._stager.arena),
                                        daemon=True)
        self._thread.start()
        return blocking

    def prepare(self, state_dict: Callable[[], dict[str, Any]]) -> None:
        """Have the staging arena for `state_dict()` allocated in the background, so that the first async save
        does not pay for pinning it (on CUDA, about half a second per GB)."""
        if self.async_save and self._stager.pin_memory and self._stager.arena is None:
            self._stager.prepare(state_dict())

    def _stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        staged = self._stager.stage(sd)
        if self._stager.allocations != self._announced:  # here, or by prepare() in the background
            self._announced = self._stager.allocations
            log.info("staging arena allocated: %.1f MB of %s host memory, reused by the next saves while the "
                     "state keeps its layout", self._stager.nbytes / 1e6,
                     "pinned" if self._stager.pin_memory else "pageable")
        return staged

    def raise_if_failed(self) -> None:
        """Raise CheckpointError at once if the background save has failed (a check of one attribute)."""
        if self._error is not None:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.in_flight = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint save failed: {err}") from err

    def _persist_in_background(self, *args: Any) -> None:
        try:
            with _collection_paused():
                self._persist(*args)
        except BaseException as e:  # surfaced in the training thread by the next wait()
            self._error = e

    def _persist(self, step: int, sd: dict[str, Any], extra: dict[str, Any], t0: float,
                 blocking_s: float | None, arena: Any = None) -> None:
        ctx, group = self.ctx, self.ctx.ckpt_group
        committer = ctx.local_rank == 0 if self.local else ctx.is_main  # each node's folder, or the one
        partial = store.begin(self.root, step) if committer else None
        path = store.partial_path(self.root, step)
        try:
            dist.barrier(group=group)  # the folders exist before anyone writes into them
            pause = self.pause
            writer = RawWriter(path, arena=arena,
                               after_data=(lambda: pause.maybe("mid_data", step, path)) if pause else None,
                               spares=self.root if self.local else None)
            try:
                self._saver.save(sd, writer, group)
            finally:  # the planner keeps the state it planned (views of the staging arena) until the next save:
                self._planner.state_dict = {}  # a new layout's arena would be allocated beside the old one
            # The files this rank wrote, checksummed as they were written. With a local tier every node's folder
            # needs every rank's small file and the metadata, so those travel too (their bytes: small).
            mine = [store.FileRecord(f.name, f.size, f.digest) for f in writer.written]
            shared = {r.name: (path / r.name).read_bytes() for r in mine
                      if self.local and not r.name.endswith("_0.distcp")}
            everyone: list[Any] = [None] * ctx.world_size
            given = self._saver.shards_written_by if self.local else {}  # the coordinator's; {} elsewhere
            dist.all_gather_object(everyone, (self.node, ctx.rank, mine, shared, given), group=group)
            if partial is not None:
                if self.pause is not None:
                    self.pause.maybe("before_marker", step, path)
                records, extra = self._folder_records(path, everyone, extra)
                final = partial.commit(ctx.world_size, records, extra=extra)
                total = time.monotonic() - t0
                size = sum(r.size for r in records)
                log.info("checkpoint step %d committed%s: %s, %.1f MB, blocked %.3fs, total %.2fs%s",
                         step, " to the local tier" if self.local else "", final.name, size / 1e6,
                         blocking_s if blocking_s is not None else total, total,
                         ", its data written over a deleted checkpoint's file" if writer.reused else "")
                if self.on_committed is not None:
                    self.on_committed(CommitRecord(step, time.time(), total, size))
            dist.barrier(group=group)  # on every rank, a finished save (or wait()) means committed
            self.last_save_s = time.monotonic() - t0
        finally:
            if partial is not None:
                partial.close()  # uncommitted: an abandoned partial folder, never a checkpoint

    def _folder_records(self, path: Path, everyone: list[Any],
                        extra: dict[str, Any]) -> tuple[list[store.FileRecord], dict[str, Any]]:
        """What this committer's folder holds: every rank's files (one durable folder), or this node's ranks'
        files plus the other ranks' small files and the metadata, written here now (a local tier)."""
        if not self.local:
            return [r for _, _, recs, _, _ in everyone for r in recs], extra
        records = []
        for node, rank, recs, shared, _ in everyone:
            if node == self.node:
                records += recs
                continue
            sent = {r.name: r for r in recs}
            for name, data in shared.items():
                got = _write_durably(path / name, data)
                if (got.size, got.checksum) != (sent[name].size, sent[name].checksum):  # read back from its disk
                    raise RuntimeError(f"rank {rank}'s {name} read back from its disk differs from what it wrote "
                                       "(checksummed as written): not committed")
                records.append(got)
        ranks: dict[str, list[int]] = {}
        for node, rank, *_ in everyone:
            ranks.setdefault(node, []).append(rank)
        # A node whose ranks hold a shard a rank of another node wrote (replicated across nodes, as HSDP's): its
        # folder lacks that file, and its ranks restore from the durable tier (review 16: they failed to load it)
        node_of = [node for node, *_ in everyone]  # by rank in the checkpoint group, as the plans are
        given = next((g for *_, g in everyone if g), {})
        lacking = sorted({node_of[r] for r, writers in given.items() for w in writers if node_of[w] != node_of[r]})
        return records, {**extra, "tier": "local", "node": self.node, "nodes": sorted(ranks), "ranks": ranks,
                         **({"lacks_shards_of_other_nodes": lacking} if lacking else {})}

    # ---- loading ------------------------------------------------------------------------------------

    def load(self, path: Path, template: Callable[[set[str]], dict[str, Any]]) -> dict[str, Any]:
        """Read the checkpoint at `path` into `template(keys in the checkpoint)`; DCP reshards as needed."""
        with _collection_paused():
            reader = RawReader(path)
            keys = set(reader.read_metadata().state_dict_metadata)
            sd = template(keys)
            dcp.load(sd, storage_reader=reader, process_group=self.ctx.ckpt_group)
        return sd


_pauses = 0  # how many _collection_paused() are open, in any thread
_pauses_lock = threading.Lock()
_was_enabled = False  # automatic collection's state when the first of them opened
_lifter: threading.Timer | None = None  # ends a pause that has lasted PAUSE_LIMIT_S
PAUSE_LIMIT_S = 30.0  # a persist to a slow disk must not keep the training thread's cyclic garbage for minutes


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside: a load or a save allocates enough objects to set off a full
    collection, which in a process whose objects nobody froze (the prewarm server freezes its imports, so a
    relaunched rank's walk is short) walks ~250k of them: 0.14-0.2 s measured, on one rank at a time, while
    the others wait in DCP's next collective. A background persist runs inside one too: its ~60 collections
    a save (a full one of 0.24 s among them, measured on a 2-core VM) ran holding the interpreter while the
    training thread stepped; paused, the persist's short-lived objects are freed by reference counting before
    any collection promotes them. (On an H100 the step beside a persist's start took 0.07-0.29 s against 0.04;
    whether this pause removes that was not measured there.) Pausing is process-wide, so
    the pauses are counted: the last one to close restores what the first one found. And bounded: the
    training thread's cyclic garbage waits for the pause's end, so a pause still open after PAUSE_LIMIT_S
    (a persist to a slow disk) lets collection run again."""
    global _pauses, _was_enabled, _lifter
    with _pauses_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
            if _was_enabled:
                _lifter = threading.Timer(PAUSE_LIMIT_S, _lift_pause)
                _lifter.daemon = True
                _lifter.start()
        _pauses += 1
    try:
        yield
    finally:
        with _pauses_lock:
            _pauses -= 1
            if _pauses == 0:
                if _lifter is not None:
                    _lifter.cancel()
                    _lifter = None
                if _was_enabled:
                    gc.enable()


def _lift_pause() -> None:
    with _pauses_lock:
        if _pauses > 0 and _was_enabled and not gc.isenabled():
            log.info("garbage collection paused for a save for %.0fs: collecting again", PAUSE_LIMIT_S)
            gc.enable()


def _write_durably(path: Path, data: bytes) -> store.FileRecord:
    """A small file another rank wrote, copied into this node's folder: fsynced, checksummed."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    h = store.hasher()
    h.update(data)
    return store.FileRecord(path.name, len(data), h.hexdigest())
