"""DCP's storage layer, ours: tensors as raw bytes, written and read with the GIL released.

DCP (`torch.distributed.checkpoint`) plans every save and load (which rank writes which shard, how a load
reshards onto another world size) and hands the bytes to a StorageWriter / StorageReader. Its own
FileSystemWriter serializes each tensor with torch.save, item by item, in Python: measured on an H100, a
background save persisted 1.95 GB in 12.7 s while the training thread ran (0.15 GB/s), because both threads
fought over one interpreter. This layer keeps DCP's planning and metadata (driven, on a save, by
train_entry/planned_save.py: planned once per layout) and changes only the bytes:

- each rank writes one file, `__<rank>_0.distcp`: the tensors' raw bytes, each at a 64-byte-aligned offset,
  then the small non-tensor items (pickled by DCP). A save staged into the host arena
  (train_entry/staging.py) writes the arena's used bytes as one region, in 64 MiB chunks: each chunk is
  checksummed (xxhash releases the GIL) and written (`os.write` releases it), so the persist thread asks for
  the interpreter a few dozen times per gigabyte, not per item. The file is fsynced; its digest goes to the
  store's manifest (supervisor/store.py) without a second read. Each item is also checksummed per PIECE from its
  start, from the same bytes while they are in the cache, and the file ends with the table of those checksums
  (store.sums_trailer): a load checks every piece it reads, so a flipped bit that the sizes-only check before a
  relaunch passed fails the load (the supervisor then sets the checkpoint aside) rather than the weights.
- rank 0 writes `.metadata` (DCP's Metadata, pickled, with a `RawItem` per item: file, offset, length,
  dtype, shape), fsynced, checksummed too.
- loading reads each item straight into its destination tensor when the saved shard and the destination
  match (same world size), READERS chunks at a time from as many threads (`os.preadv` releases the GIL): one
  thread reading tmpfs or an NVMe disk at queue depth one leaves most of either idle. A destination on a GPU
  is filled through as many pinned host buffers, each chunk copied to the device once read while the next
  ones are read (measured on an H100: reading into pageable memory and copying each tensor synchronously
  loaded 2 GB at 0.44 of the disk's sequential read speed); otherwise (a resharded load) it reads the
  needed ranges, coalesced, and copies the slices DCP asks for. Items written by torch's FileSystemWriter
  (checkpoints from before this layer) are read by it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import operator
import os
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, StorageReader, StorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from supervisor import store
from supervisor.fsutil import CHUNK, PAGE, HashedFile
from supervisor.torchcompat import release_cached_pinned_memory

METADATA = ".metadata"
ALIGN = 64
READ_GAP = 1 << 20  # ranges closer than this are read as one
READERS = 4  # a same-size load's reads in flight at once; a load to a GPU reads through as many pinned buffers
PIECE = 32 << 20  # bytes per read of a same-size load (and per pinned buffer)
SMALL = 1 << 20  # a value rank 0 offers with others, up to this size, is written from rank 0 (Rank0Planner)


class Rank0Planner(DefaultSavePlanner):
    """DCP's planner, but a small value that rank 0 offers along with other ranks is always written by rank 0.

    DCP writes a value several ranks offer under one key once, from whichever rank balances the writes best; one
    that is per rank all the same (DDP's BatchNorm buffers, a per-rank count) then comes back as that rank's, a
    different one from save to save. Here the small ones (up to SMALL bytes; not DTensor shards) come back as
    rank 0's; the big ones (a DDP model's parameters, the same on every rank) are still spread over the ranks, and
    a value rank 0 does not offer (a pipeline stage's) stays with the ranks that do. Decided on the coordinator,
    which sees every rank's plan: so DCP's plan cache, which sends only the plans that changed, is off (plans are
    made once per layout one level up, by train_entry/planned_save.py).
    """

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=False)
        self.shards_written_by: dict[int, list[int]] = {}  # the coordinator's, of its last global plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        first = {item.index for item in all_plans[0].items}

        def kept(item: WriteItem) -> bool:
            small = item.type != WriteItemType.SHARD and (item.tensor_storage_size() or 0) <= SMALL
            return not (small and item.index in first)

        trimmed = [all_plans[0], *(dataclasses.replace(p, items=[i for i in p.items if kept(i)])
                                   for p in all_plans[1:])]
        plans, metadata = super().create_global_plan(trimmed)
        self.shards_written_by = shards_written_by(all_plans, plans)
        return plans, metadata


def shards_written_by(offered: list[SavePlan], planned: list[SavePlan]) -> dict[int, list[int]]:
    """For each rank (of the plans' group) holding a shard that another rank writes, those ranks. DCP writes a shard
    that several ranks hold (a tensor replicated across HSDP's replicas, or a `Replicate()` placement) once, from one
    of them: a node-local folder holds only its own ranks' files, so a node whose shard another node wrote cannot
    restore from it."""
    writer = {item.index: rank for rank, plan in enumerate(planned) for item in plan.items
              if item.type == WriteItemType.SHARD}
    out = {}
    for rank, plan in enumerate(offered):
        others = {writer[i.index] for i in plan.items
                  if i.type == WriteItemType.SHARD and writer.get(i.index, rank) != rank}
        if others:
            out[rank] = sorted(others)
    return out


def plan_layout(sd: dict[str, Any], coordinator: bool) -> tuple[Any, ...] | None:
    """All that this rank's part of DCP's save plans (its local plan, and so its share of the global one) depends
    on in the flattened `sd`: each name's kind, dtype, shapes, strides, placement on its mesh and the properties
    DCP records; None where a value plans itself some other way."""
    out: list[Any] = [coordinator]
    for fqn, obj in sd.items():
        if isinstance(obj, DTensor):
            local, mesh = obj._local_tensor, obj.device_mesh
            # The mesh itself: the same object compares by identity (`mesh.mesh` builds a tensor on some releases)
            out.append((fqn, obj.shape, obj.dtype, obj.placements, mesh, mesh.get_coordinate(), local.shape,
                        local.stride(), obj.requires_grad, local.is_pinned()))
        elif hasattr(obj, "__create_write_items__"):  # another tensor subclass that plans its own writes
            return None
        elif isinstance(obj, torch.Tensor):
            out.append((fqn, obj.shape, obj.stride(), obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned()))
        else:
            out.append((fqn, type(obj)))
    return tuple(out)


class Pickled:
    """A value pickled once and then put, again and again, into something pickled whole: DCP's metadata, written
    on every save of one layout, whose ~420 items' metadata and locations took 6 ms of the interpreter to pickle
    each time. It pickles as those bytes, and unpickles with a plain `pickle.load` as the value itself (through
    `pickle.loads`): a checkpoint's metadata reads back as if pickled in one go."""

    __slots__ = ("data",)

    def __init__(self, value: Any):
        self.data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self) -> tuple[Any, ...]:
        return pickle.loads, (self.data,)


@dataclass(frozen=True)
class Updated:
    """A dict pickled once (`base`) with some of its values replaced: unpickles as the plain dict `base | changes`
    (through `operator.or_`)."""

    base: Pickled
    changes: dict[Any, Any]

    def __reduce__(self) -> tuple[Any, ...]:
        return operator.or_, (self.base, self.changes)


@dataclass(frozen=True)
class RawItem:
    """Where one item's bytes are in its rank's file (DCP keeps it in Metadata.storage_data)."""

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None  # e.g. "float32"; None for a pickled non-tensor item
    shape: tuple[int, ...] | None = None
    # Its checksums, per PIECE from its start, are in the table at the end of its file (store.sums_trailer); False
    # in checkpoints from before those were kept. A constant, unlike the sums: the locations a save sends its
    # coordinator stay those of the save that planned (train_entry/planned_save.py).
    summed: bool = False


@dataclass(frozen=True)
class WrittenFile:
    """A file a rank wrote for a save: what the store's manifest records."""

    name: str
    size: int
    digest: str


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class _Sink(HashedFile):
    """One rank's file of a save (supervisor/fsutil.py's HashedFile): the store's hash, padding between items."""

    def __init__(self, path: Path, *, direct: bool = False, reuse: bool = False):
        super().__init__(path, store.hasher(), direct=direct, reuse=reuse)

    def pad_to(self, offset: int) -> None:
        if offset > self.size:
            self.write(memoryview(bytes(offset - self.size)))

    def close(self) -> WrittenFile:  # type: ignore[override]
        return WrittenFile(self.path.name, self.size, super().close())


def _page_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % PAGE == 0


class RawWriter(StorageWriter):
    """Writes this rank's items raw into `<path>/__<rank>_0.distcp` (and, on the coordinator, `.metadata`).

    Args:
        path: the (partial) checkpoint folder; it exists.
        arena: the uint8 host arena the state was staged into, if it was: its used bytes go out as one region.
        after_data: called once this rank's data file is durable (a test hook pauses or fills the disk there).
        spares: a local tier's root: the data file is written over one of its spare files when there is one
            (store.claim_spare), reusing the pages of a deleted checkpoint instead of taking new ones.
    """

    def __init__(self, path: str | os.PathLike, *, arena: torch.Tensor | None = None,
                 after_data: Callable[[], None] | None = None, spares: Path | None = None):
        super().__init__()
        self.path = Path(path)
        self.arena = arena
        self.spares = spares
        self.reused = 0  # files written over a spare
        self.after_data = after_data
        self.written: list[WrittenFile] = []
        self.save_id = uuid.uuid4().hex

    # ---- the StorageWriter protocol --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        shards, others = [], []
        for item in plan.items:
            (shards if item.type == WriteItemType.SHARD else others).append((item, planner.resolve_data(item)))
        results = self._write_file(f"{prefix}0.distcp", shards, direct=True)
        results += self._write_file(f"{prefix}1.distcp", others, direct=False)
        if self.after_data is not None:
            self.after_data()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator writes DCP's metadata, with every rank's item locations."""
        self.write_metadata(metadata, {wr.index: wr.storage_data for rank_results in results for wr in rank_results})

    def write_metadata(self, metadata: Metadata, storage_data: Any) -> None:
        """`finish`, with the item locations given as they are to be pickled (a dict, or an `Updated` one)."""
        metadata = dataclasses.replace(metadata, storage_data=storage_data, storage_meta=self.storage_meta())
        sink = _Sink(self.path / METADATA)
        try:
            sink.write(memoryview(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)))
            self.written.append(sink.close())
        except BaseException:
            sink.abort()
            raise

    # ---- the bytes ------------------------------------------------------------------------------------

    def _write_file(self, name: str, items: list[tuple[WriteItem, Any]], *, direct: bool) -> list[WriteResult]:
        """One file: tensors that sit in the arena as one region of it (page-aligned: O_DIRECT), then the rest,
        each at a 64-byte-aligned offset."""
        reuse = direct and self.spares is not None and store.claim_spare(self.spares, self.path / name)
        sink = _Sink(self.path / name, direct=direct, reuse=reuse)
        self.reused += sink.reuse
        try:
            sums: list[tuple[int, int, store.PieceSums]] = []
            results = self._write_items(sink, name, items, sums)
            sink.write(memoryview(store.sums_trailer(sums)))
            self.written.append(sink.close())
        except BaseException:
            sink.abort()
            raise
        return results

    def _write_items(self, sink: _Sink, name: str, items: list[tuple[WriteItem, Any]],
                     sums: list[tuple[int, int, store.PieceSums]]) -> list[WriteResult]:
        """Writes the items, appending each one's (offset, length, checksums) to `sums`."""
        in_arena: list[tuple[WriteItem, int, torch.Tensor]] = []
        others: list[tuple[WriteItem, Any]] = []
        base = self.arena.data_ptr() if self.arena is not None else 0
        end = self.arena.numel() if self.arena is not None else 0
        for item, data in items:
            if item.type == WriteItemType.BYTE_IO:
                others.append((item, data))
                continue
            t = data.detach()
            offset = t.data_ptr() - base
            if self.arena is not None and t.device.type == "cpu" and t.is_contiguous() and \
                    offset >= 0 and offset + t.numel() * t.element_size() <= end:
                in_arena.append((item, offset, t))
            else:
                others.append((item, t))
        results = []
        if in_arena:  # one region of the arena, [lowest slot, highest slot's end), where the tensors already are
            assert self.arena is not None
            lo = min(off for _, off, _ in in_arena) // PAGE * PAGE
            hi = min(end, -(-max(off + t.numel() * t.element_size() for _, off, t in in_arena) // PAGE) * PAGE)
            region = self.arena[lo:hi]
            at = sink.size
            ranges = [(at + off - lo, t.numel() * t.element_size()) for _, off, t in in_arena]
            summer = store.PieceSummer(ranges, PIECE)
            sink.write(as_bytes(region), aligned=_page_aligned(region) and (hi - lo) % PAGE == 0, tap=summer.feed)
            sums += [(offset, length, s) for (offset, length), s in zip(ranges, summer.sums(), strict=True)]
            results += [self._result(item, name, offset, t) for (item, _, t), (offset, _) in
                        zip(in_arena, ranges, strict=True)]
        for item, data in others:
            offset = _align(sink.size)
            sink.pad_to(offset)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
                sums.append(_write_summed(sink, raw))
                results.append(WriteResult(item.index, len(raw), RawItem(name, offset, len(raw), summed=True)))
            else:
                t = data if data.device.type == "cpu" else data.cpu()
                t = t.contiguous()
                sums.append(_write_summed(sink, as_bytes(t)))
                results.append(self._result(item, name, offset, t))
        return results

    @staticmethod
    def _result(item: WriteItem, name: str, offset: int, t: torch.Tensor) -> WriteResult:
        length = t.numel() * t.element_size()
        dtype = str(t.dtype).removeprefix("torch.")
        return WriteResult(item.index, length, RawItem(name, offset, length, dtype, tuple(t.shape), summed=True))


def _write_summed(sink: _Sink, data: memoryview) -> tuple[int, int, store.PieceSums]:
    """Appends one item's bytes to `sink`; its (offset, length, checksums) for the file's table."""
    offset = sink.size
    summer = store.PieceSummer([(offset, len(data))], PIECE)
    sink.write(data, tap=summer.feed)
    return offset, len(data), summer.sums()[0]


class RawReader(StorageReader):
    """Reads checkpoints written by RawWriter, and (through torch's FileSystemReader) older ones."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = Path(path)
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._metadata: Metadata | None = None
        self._legacy: FileSystemReader | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.storage_data, self._metadata, self._legacy = {}, None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            with open(self.path / METADATA, "rb") as f:
                self._metadata = pickle.load(f)
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if any(not isinstance(v, RawItem) for v in self.storage_data.values()):
            self._legacy = FileSystemReader(self.path)
            self._legacy.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw = [r for r in plan.items if isinstance(self.storage_data[r.storage_index], RawItem)]
        legacy = [r for r in plan.items if not isinstance(self.storage_data[r.storage_index], RawItem)]
        if legacy:
            assert self._legacy is not None
            self._legacy.read_data(dataclasses.replace(plan, items=legacy), planner).wait()
        per_file: dict[str, list[ReadItem]] = {}
        for req in raw:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        reads = _Reads()
        try:
            for name, reqs in per_file.items():
                with open(self.path / name, "rb", buffering=0) as f:
                    try:
                        landed = self._read_file(f, sorted(reqs, key=lambda r: self.storage_data[r.storage_index]
                                                           .offset), planner, reads)
                    finally:
                        reads.wait()  # every read into this file's destinations is over before it closes
                for req, target in landed:
                    planner.commit_tensor(req, target)
        finally:
            reads.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, f: Any, reqs: list[ReadItem], planner: LoadPlanner,
                   reads: _Reads) -> list[tuple[ReadItem, torch.Tensor]]:
        """Reads `reqs` from `f`; the same-size ones are left in flight in `reads` and returned, to be committed
        once `reads` has waited for them."""
        slow: list[ReadItem] = []
        landed: list[tuple[ReadItem, torch.Tensor]] = []
        table = store.read_sums_trailer(f.fileno(), Path(f.name).name) if any(
            self.storage_data[r.storage_index].summed for r in reqs) else {}

        def sums_of(req: ReadItem, info: RawItem) -> store.PieceSums | None:
            if not info.summed:
                return None  # saved before checksums were kept per item
            found = table.get((info.offset, info.length))
            if found is None:
                raise store.PieceMismatch(f"{_what(f, req, info)}: its file's table of checksums has no entry for "
                                          "it (the table was damaged)")
            return found

        for req in reqs:  # the common case, a same-size relaunch: straight into the destination
            info: RawItem = self.storage_data[req.storage_index]
            target = planner.resolve_tensor(req).detach() if req.type == LoadItemType.TENSOR else None
            if target is not None and _whole(req, info, target):
                reads.read(f, info.offset, target, sums_of(req, info), _what(f, req, info))
                landed.append((req, target))
            else:
                slow.append(req)
        # the items verified, by (offset, length): a resharded load may read one item twice, and an empty item
        # shares its offset with the next one (review 13: keyed by offset alone, that one could go unchecked)
        checked: set[tuple[int, int]] = set()
        for lo, hi, group in _ranges(slow, self.storage_data):
            buf = bytearray(hi - lo)
            _pread_at(f, lo, memoryview(buf))
            for req in group:
                info = self.storage_data[req.storage_index]
                piece = memoryview(buf)[info.offset - lo:info.offset - lo + info.length]
                sums = sums_of(req, info) if (info.offset, info.length) not in checked else None
                if sums is not None:
                    sums.check_all(piece, _what(f, req, info))
                    checked.add((info.offset, info.length))
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(bytes(piece)))
                    continue
                saved = torch.frombuffer(piece, dtype=getattr(torch, info.dtype)) if info.length else \
                    torch.empty(0, dtype=getattr(torch, info.dtype))
                saved = saved.reshape(info.shape)
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    saved = saved.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.shape != saved.shape:
                    raise ValueError(f"{req.storage_index.fqn}: the checkpoint holds {tuple(saved.shape)}, "
                                     f"this run wants {tuple(target.shape)}")
                target.copy_(saved)
                planner.commit_tensor(req, target)
        return landed


def _what(f: Any, req: ReadItem, info: RawItem) -> str:
    """Names an item for a message: its file, its name, where it starts in the file."""
    return f"{Path(f.name).name} ({req.storage_index.fqn}, from byte {info.offset} of the file)"


def _whole(req: ReadItem, info: RawItem, target: torch.Tensor) -> bool:
    """The request is the saved shard entire, and the destination can take its bytes as they are."""
    return (target.device.type in ("cpu", "cuda") and target.is_contiguous() and info.shape is not None and
            tuple(req.lengths) == tuple(info.shape) and not any(req.storage_offsets) and
            str(target.dtype).removeprefix("torch.") == info.dtype and
            target.numel() * target.element_size() == info.length)


class _Reads:
    """A same-size load's reads, READERS of PIECE bytes in flight at once, each from a thread of its own. A CPU
    destination is read into directly. A GPU one goes through READERS pinned host buffers (allocated at the
    first GPU destination, kept for the load): each piece is copied to the device, asynchronously, once read,
    and its buffer is read into again only after that copy has left it."""

    def __init__(self) -> None:
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.flight: collections.deque[tuple[concurrent.futures.Future[None], Any]] = collections.deque()
        self.buffers: list[torch.Tensor] = []
        self.copied: list[Any] = [None] * READERS  # the CUDA event after each buffer's last copy
        self.turn = 0

    def read(self, f: Any, offset: int, target: torch.Tensor, sums: store.PieceSums | None, what: str) -> None:
        """Starts reading `target`'s bytes from `f` at `offset`, each piece checked against `sums` by the thread
        that read it (all cores hash, each piece while it is in that core's cache); they are there after wait()."""
        self.pool = self.pool or concurrent.futures.ThreadPoolExecutor(READERS, "resilient-read")
        gpu = target.device.type != "cpu"
        if gpu and not self.buffers:
            pinned = torch.empty(READERS * PIECE, dtype=torch.uint8, pin_memory=True)  # one allocation
            self.buffers = list(pinned.split(PIECE))
        dst = target.reshape(-1).view(torch.uint8) if gpu else as_bytes(target)
        size = len(dst)
        step = sums.piece if sums is not None else PIECE
        if step > PIECE:
            raise store.PieceMismatch(f"{what}: its checksums are kept per {step} bytes, more than this reader's "
                                      f"{PIECE}: its file's table was damaged, or written by a newer resilient")
        for k, done in enumerate(range(0, size, step)):
            n = min(step, size - done)
            if len(self.flight) == READERS:
                self._land(self.flight.popleft())
            if not gpu:
                job = self.pool.submit(_read_piece, f, offset + done, dst[done:done + n], sums, k, what)
                self.flight.append((job, None))
                continue
            i, self.turn = self.turn, (self.turn + 1) % READERS
            if self.copied[i] is not None:
                self.copied[i].synchronize()  # this buffer's last piece has left it
            buf = self.buffers[i][:n]
            job = self.pool.submit(_read_piece, f, offset + done, as_bytes(buf), sums, k, what)
            self.flight.append((job, (i, buf, dst[done:done + n])))

    def _land(self, entry: tuple[concurrent.futures.Future[None], Any]) -> None:
        job, to_device = entry
        job.result()
        if to_device is not None:
            i, buf, dst = to_device
            dst.copy_(buf, non_blocking=True)
            self.copied[i] = torch.cuda.Event()
            self.copied[i].record(torch.cuda.current_stream(dst.device))

    def wait(self) -> None:
        """Every read started is in its destination; raises the first read's error, after the rest are over."""
        try:
            while self.flight:
                self._land(self.flight.popleft())
        finally:
            concurrent.futures.wait([job for job, _ in self.flight])
            self.flight.clear()
            for event in self.copied:
                if event is not None:
                    event.synchronize()

    def close(self) -> None:
        """Nothing reads or copies any more: the threads and the pinned buffers go."""
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            if self.buffers:  # torch's caching host allocator would keep their 128 MiB pinned for the whole run
                self.buffers = []
                release_cached_pinned_memory()


def _ranges(reqs: list[ReadItem], storage: dict[MetadataIndex, Any]) -> list[tuple[int, int, list[ReadItem]]]:
    """Byte ranges covering `reqs` (sorted by offset), neighbours closer than READ_GAP merged."""
    out: list[tuple[int, int, list[ReadItem]]] = []
    for req in reqs:
        info = storage[req.storage_index]
        if out and info.offset - out[-1][1] <= READ_GAP:
            lo, hi, group = out[-1]
            out[-1] = (lo, max(hi, info.offset + info.length), [*group, req])
        else:
            out.append((info.offset, info.offset + info.length, [req]))
    return out


def _read_piece(f: Any, offset: int, view: memoryview, sums: store.PieceSums | None, index: int, what: str) -> None:
    _pread_at(f, offset, view)
    if sums is not None:
        sums.check(index, view, what)


def _pread_at(f: Any, offset: int, view: memoryview) -> None:
    """`view` filled from `f` at `offset` without its file position (several threads read one file)."""
    while view:
        n = os.preadv(f.fileno(), [view[:CHUNK]], offset)
        if not n:
            raise EOFError(f"{f.name}: ends before byte {offset} + {len(view)}")
        view = view[n:]
        offset += n
