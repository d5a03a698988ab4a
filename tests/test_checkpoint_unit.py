"""The checkpointer's pieces in one process (a world of one, gloo): raw storage written and checksummed as it
goes, read back bitwise, older torch-format checkpoints still readable, the staging arena reused, the
save-pause hook."""

from __future__ import annotations

import pytest

from supervisor import store


@pytest.fixture(scope="module")
def ctx():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from train_entry.dist import DistContext

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        import torch

        yield DistContext(0, 1, 0, torch.device("cpu"), "gloo", mesh, dist.new_group(backend="gloo"))
    finally:
        dist.destroy_process_group()


def state(ctx) -> dict:
    """Every kind of leaf a training state holds: sharded and plain tensors of several dtypes and shapes
    (0-dim, empty), nested containers, bytes and strings."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": distribute_tensor(torch.randn(64, 33, generator=g), ctx.mesh, [Shard(0)]),
                  "half": torch.randn(7, 5, generator=g).to(torch.bfloat16)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 33, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "ids": torch.arange(10, dtype=torch.int64), "empty": torch.empty(0, 4), "rng.rank0": b"\x00\x01\x02",
        "train": '{"step": 5}',
    }


def flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def assert_equal(a: dict, b: dict) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            x = x.full_tensor() if isinstance(x, DTensor) else x
            y = y.full_tensor() if isinstance(y, DTensor) else y
            assert x.dtype == y.dtype and torch.equal(x, y), k
        else:
            assert x == y, k


def test_an_async_save_is_the_state_at_the_call_checksummed_as_written_and_loads_back_bitwise(ctx, tmp_path):
    import copy

    from train_entry.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, ctx, async_save=True)
    live = state(ctx)
    expected = copy.deepcopy(live)
    ckpt.save(10, lambda: live, sync=False)
    live["model"]["w"].to_local().add_(1.0)  # training goes on while the save persists
    live["ids"].zero_()
    ckpt.wait()
    info = store.inspect(tmp_path / store.step_dirname(10), deep=True)  # every digest was computed while writing
    assert info.valid, info.reason
    assert sorted(f.name for f in info.manifest.files) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    template = state(ctx)
    for t in (template["model"]["w"].to_local(), template["ids"], template["optim"]["state"]["w"]["exp_avg"]):
        t.zero_()
    loaded = ckpt.load(info.path, lambda keys: template)
    assert_equal(loaded, expected)


def test_the_arena_is_allocated_once_and_reused_until_the_layout_changes(ctx, tmp_path):
    from train_entry.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, ctx, async_save=True)
    live = state(ctx)
    for step in (1, 2, 3):
        ckpt.save(step, lambda: live, sync=False)
        arena = ckpt._stager.arena
    ckpt.wait()
    assert ckpt._stager.allocations == 1 and arena.data_ptr() == ckpt._stager.arena.data_ptr()
    assert [i.step for i in store.scan(tmp_path) if i.valid] == [1, 2, 3]
    import weakref

    import torch

    from train_entry.staging import _layout

    old_arena = weakref.ref(ckpt._stager.arena.untyped_storage())
    del arena
    live["ids"] = torch.arange(11)  # the state's layout changed: a new arena, and nothing holds the old one
    ckpt._stager._allocate(_layout(live))
    assert old_arena() is None, "the old arena is still held (the planner kept the last save's staged state)"
    ckpt.save(4, lambda: live, sync=True)
    ckpt.save(5, lambda: live, sync=False)
    ckpt.wait()
    assert ckpt._stager.allocations == 2


def test_an_arena_prepared_in_the_background_is_the_one_the_first_save_uses(ctx, tmp_path):
    """What the session does once training runs on CUDA (there pinned; here the same path, unpinned)."""
    import threading

    from train_entry.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, ctx, async_save=True)
    live = state(ctx)
    ckpt._stager.prepare(live)
    assert any(t.name == "resilient-staging-alloc" for t in threading.enumerate()) or ckpt._stager.arena is not None
    ckpt.save(1, lambda: live, sync=False)
    ckpt.wait()
    assert ckpt._stager.allocations == 1
    expected = state(ctx)
    loaded = ckpt.load(tmp_path / store.step_dirname(1), lambda keys: state(ctx))
    assert_equal(loaded, expected)
    ckpt._stager.prepare(live)  # the same layout: nothing to do
    assert ckpt._stager._preparing is None and ckpt._stager.allocations == 1


def test_a_registered_arena_is_unregistered_once_when_the_layout_changes(monkeypatch):
    """The CUDA registration's bookkeeping, with a stand-in for the CUDA runtime (the real one runs in
    tests/test_gpu.py on a GPU machine): each arena registered once, unregistered before its successor is
    taken; a refused registration falls back to torch's pinned allocator and is never unregistered."""
    import torch

    from train_entry import staging

    calls: list[tuple[str, int]] = []

    class Runtime:
        refuse = False

        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr))
            return 1 if self.refuse else 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    runtime = Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    stager = staging.HostStager(pin_memory=True)
    stager.stage({"w": torch.ones(100)})
    first = stager.arena.data_ptr()
    stager.stage({"w": torch.ones(100)})  # the same layout: nothing registered again
    assert calls == [("register", first)]
    runtime.refuse = True
    pinned = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pinned.append(k) or torch.zeros(*a, dtype=k["dtype"]))
    stager.stage({"w": torch.ones(200)})
    assert calls[1:] == [("unregister", first), ("register", calls[2][1])] and pinned[0]["pin_memory"]
    stager.stage({"w": torch.ones(300)})  # the fallback arena was never registered: nothing to unregister
    assert [c for c, _ in calls].count("unregister") == 1


def test_a_saves_plans_are_made_once_per_layout_and_every_save_still_holds_its_own_values(
        ctx, tmp_path, monkeypatch):
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from train_entry import planned_save
    from train_entry.checkpoint import Checkpointer, CheckpointError

    made, sent = [], []
    plan = DefaultSavePlanner.create_local_plan
    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", lambda self: made.append(1) or plan(self))
    gather = planned_save.dist.gather_object  # what each save's write step sends the coordinator (not its plan)
    monkeypatch.setattr(planned_save.dist, "gather_object", lambda obj, *a, **k: (
        isinstance(obj, tuple) and isinstance(obj[0], list) and sent.append(obj[0])) or gather(obj, *a, **k))
    ckpt = Checkpointer(tmp_path, ctx, async_save=True)
    live = state(ctx)
    saved = {}
    for step in (1, 2, 3):  # one layout, new values each time (the bytes and the text of new lengths too)
        live["model"]["w"].to_local().add_(1.0)
        live["ids"].add_(step)
        live["rng.rank0"], live["train"] = bytes(range(step * 7)), f'{{"step": {10 ** step}}}'
        saved[step] = flat(copy_of(live))
        ckpt.save(step, lambda: live, sync=False)
    ckpt.wait()
    assert len(made) == 1 and ckpt._saver.planned == 1
    # The first save sends every item's location; the next two only those that moved: the bytes and the text,
    # longer each time (in the file of small items, each after the other).
    assert [len(s) for s in sent[1:3]] == [2, 2] and len(sent[0]) == 10
    assert {s.index.fqn for s in sent[2]} == {"rng.rank0", "train"}
    live["ids"] = torch.arange(12, dtype=torch.int64)  # a new shape: a new plan
    ckpt.save(4, lambda: live, sync=False)
    live["extra"] = torch.ones(3)  # a new name: a new plan
    ckpt.save(5, lambda: live, sync=False)
    ckpt.wait()
    assert len(made) == 3 and ckpt._saver.planned == 3
    saved[5] = flat(copy_of(live))
    from train_entry import storage  # a save that fails forgets its plans: the next one plans again

    write = storage.RawWriter.write_data
    monkeypatch.setattr(storage.RawWriter, "write_data", lambda *a: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(CheckpointError, match="full"):
        ckpt.save(6, lambda: live, sync=True)
    assert not (tmp_path / store.step_dirname(6)).exists()
    monkeypatch.setattr(storage.RawWriter, "write_data", write)
    live["ids"].add_(100)
    saved[7] = flat(copy_of(live))
    ckpt.save(7, lambda: live, sync=True)
    assert ckpt._saver.planned == 4
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    for step in (1, 2, 3, 5, 7):
        # DCP's metadata, parts of it pickled once per layout, reads back with a plain pickle.load as one piece
        metadata = pickle.loads((tmp_path / store.step_dirname(step) / ".metadata").read_bytes())
        assert type(metadata) is Metadata and type(metadata.state_dict_metadata) is dict
        assert type(metadata.storage_data) is dict
        assert sorted(i.fqn for i in metadata.storage_data) == sorted(metadata.state_dict_metadata)  # one chunk each
        if step == 1:
            assert len(metadata.storage_data) == len(sent[0])
        template = state(ctx)
        if step >= 5:
            template["ids"], template["extra"] = torch.zeros(12, dtype=torch.int64), torch.zeros(3)
        loaded = ckpt.load(tmp_path / store.step_dirname(step), lambda keys, t=template: t)
        assert_equal(flat(loaded), saved[step])


def copy_of(sd: dict) -> dict:
    import copy

    return copy.deepcopy(sd)


def test_a_load_read_in_many_small_pieces_at_once_is_bitwise_and_a_short_file_stops_it_with_no_reader_left(
        ctx, tmp_path, monkeypatch):
    """Pieces of 40 bytes, three in flight: every tensor spans many pieces, read out of order by the threads."""
    import os
    import threading

    from torch.distributed.checkpoint.api import CheckpointException

    from train_entry import storage
    from train_entry.checkpoint import Checkpointer

    monkeypatch.setattr(storage, "PIECE", 40)
    monkeypatch.setattr(storage, "READERS", 3)
    ckpt = Checkpointer(tmp_path, ctx, async_save=False)
    ckpt.save(7, lambda: state(ctx), sync=True)
    path = tmp_path / store.step_dirname(7)

    def blank() -> dict:
        template = state(ctx)
        for t in (template["model"]["w"].to_local(), template["ids"], template["optim"]["state"]["w"]["exp_avg"]):
            t.zero_()
        return template

    assert_equal(ckpt.load(path, lambda keys: blank()), state(ctx))
    shard = max(path.glob("__*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    # DCP wraps the error; a cut file has lost the table of checksums at its end
    with pytest.raises(CheckpointException, match=f"{shard.name}: its table of checksums is not at its end"):
        ckpt.load(path, lambda keys: blank())
    assert not [t for t in threading.enumerate() if t.name.startswith("resilient-read")]


@pytest.mark.parametrize("async_save", [False, True], ids=["item by item", "from the arena"])
def test_a_byte_flipped_in_any_saved_item_stops_the_load_naming_the_file_and_the_item(ctx, tmp_path, monkeypatch,
                                                                                     async_save):
    """Sizes alone pass such a checkpoint (the default check before a relaunch): the load itself checks each
    piece of every item it reads against the checksums kept in `.metadata`, on the straight path (each item into
    its destination, pieces read by several threads) and the resharding one (a destination of another layout)."""
    import shutil

    from torch.distributed.checkpoint.api import CheckpointException

    from train_entry import storage
    from train_entry.checkpoint import Checkpointer

    monkeypatch.setattr(storage, "PIECE", 40)  # every tensor spans several checksummed pieces
    ckpt = Checkpointer(tmp_path / "root", ctx, async_save=async_save)
    ckpt.save(7, lambda: state(ctx), sync=not async_save)
    ckpt.wait()
    saved = tmp_path / "root" / store.step_dirname(7)
    items = storage.RawReader(saved).read_metadata().storage_data
    assert all(info.summed for info in items.values())

    def transposed() -> dict:  # exp_avg's destination is another layout: read through the resharding path
        import torch

        template = state(ctx)
        template["optim"]["state"]["w"]["exp_avg"] = torch.zeros(33, 64).t()
        return template

    for index, info in items.items():
        if not info.length:
            continue
        for template in (lambda keys: state(ctx), lambda keys: transposed()):
            damaged = tmp_path / "copy" / store.step_dirname(7)
            shutil.rmtree(damaged, ignore_errors=True)
            shutil.copytree(saved, damaged)
            with open(damaged / info.relative_path, "r+b") as f:
                at = info.offset + info.length * 2 // 3
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x10]))
            with pytest.raises(CheckpointException, match=f"{info.relative_path} \\({index.fqn}, from byte "
                               f"{info.offset} of the file\\): its bytes \\d+-\\d+ do not match the checksum "
                               "recorded when they were saved"):
                ckpt.load(damaged, template)
    assert_equal(ckpt.load(saved, lambda keys: transposed()), state(ctx))


def test_a_checkpoint_written_by_torchs_own_writer_still_loads(ctx, tmp_path):
    import torch.distributed.checkpoint as dcp

    from train_entry.checkpoint import Checkpointer

    sd = state(ctx)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "old"), process_group=ctx.ckpt_group)
    template = state(ctx)
    template["model"]["w"].to_local().zero_()
    loaded = Checkpointer(tmp_path, ctx, async_save=False).load(tmp_path / "old", lambda keys: template)
    assert_equal(loaded, state(ctx))


def test_save_pause_parsing():
    from train_entry.checkpoint import SavePause

    assert SavePause.parse("mid_data:30") == SavePause("mid_data", 30.0, None)
    assert SavePause.parse("before_marker:2.5@20") == SavePause("before_marker", 2.5, 20)
    assert SavePause.parse("before_marker:enospc@40") == SavePause("before_marker", 0.0, 40, fill_disk=True)
    with pytest.raises(ValueError):
        SavePause.parse("sometime:3")


def test_saves_and_loads_run_without_automatic_garbage_collection_and_restore_it_after_even_on_failure(ctx,
                                                                                                      tmp_path):
    """A full collection on one rank inside a save or a load stalls every rank at DCP's next collective
    (0.14-0.2 s; in 2 of 6 loads and 2 of 6 sync saves of the checkpoint benchmark before this); inside a
    background persist it holds the interpreter while the training thread steps."""
    import gc

    from train_entry.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, ctx, async_save=True)
    during_saves, persisting = [], []

    def state_dict():
        during_saves.append(gc.isenabled())
        return state(ctx)

    persist = ckpt._persist

    def watched(*args, **kwargs):
        persisting.append(gc.isenabled())
        return persist(*args, **kwargs)

    ckpt._persist = watched
    ckpt.save(1, state_dict, sync=True)
    ckpt.save(2, state_dict, sync=False)  # its staging, in the caller's thread; its persist, in the background
    ckpt.save(3, state_dict, sync=False)  # opens its pause while the last persist may still hold one
    ckpt.wait()
    assert during_saves == [False, False, False] and persisting == [False, False, False] and gc.isenabled()
    seen = []

    def template(keys):
        seen.append(gc.isenabled())
        return state(ctx)

    assert gc.isenabled()
    ckpt.load(tmp_path / store.step_dirname(1), template)
    assert seen == [False] and gc.isenabled()

    def refusing(keys):
        raise RuntimeError("this run cannot take that checkpoint")

    with pytest.raises(RuntimeError, match="cannot take"):
        ckpt.load(tmp_path / store.step_dirname(1), refusing)
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        ckpt.load(tmp_path / store.step_dirname(1), template)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_staging_keeps_containers_as_they_were_namedtuples_included():
    """An optimizer or a user's Sharded state may hold a namedtuple: staging rebuilt every tuple from one list,
    which a namedtuple's constructor refuses (every async save then failed, and every relaunch again)."""
    import collections

    import torch

    from train_entry import staging

    Pair = collections.namedtuple("Pair", "weight count")
    sd = {"a": Pair(torch.arange(4.0), 3), "b": (torch.ones(2), [torch.zeros(1), "x"])}
    staged = staging.HostStager(pin_memory=False).stage(sd)
    assert type(staged["a"]) is Pair and staged["a"].count == 3 and torch.equal(staged["a"].weight, sd["a"].weight)
    assert staged["a"].weight.data_ptr() != sd["a"].weight.data_ptr()  # a copy in the arena
    assert type(staged["b"]) is tuple and type(staged["b"][1]) is list and staged["b"][1][1] == "x"


def test_small_values_rank_0_shares_are_written_by_rank_0_and_the_others_by_whoever_holds_them():
    """Rank0Planner on two ranks' plans: a small value both offer (a BatchNorm buffer, the position) is rank 0's; a
    big one is still spread; a value only rank 1 holds (a pipeline stage's) stays rank 1's: a name-based filter
    once dropped it from every plan, and the save committed without it."""
    import torch

    from train_entry.storage import Rank0Planner

    def plan(rank: int, own: str):
        sd = {"train": "{}", "model": {"bn": torch.ones(4), "big": torch.zeros(1 << 19), own: torch.ones(3)}}
        p = Rank0Planner()
        p.set_up_planner(sd, is_coordinator=rank == 0)
        return p.create_local_plan()

    plans, metadata = Rank0Planner().create_global_plan([plan(0, "stage0"), plan(1, "stage1")])
    held = [{i.index.fqn for i in p.items} for p in plans]
    assert {"train", "model.bn", "model.stage0"} <= held[0] and "model.stage1" in held[1]
    assert not {"train", "model.bn"} & held[1] and len([h for h in held if "model.big" in h]) == 1
    assert set(metadata.state_dict_metadata) == {"train", "model.bn", "model.big", "model.stage0", "model.stage1"}


def test_a_collection_pause_ends_after_its_limit_even_while_a_save_still_holds_it(monkeypatch):
    """A persist to a slow disk kept collection off for as long as it ran (minutes), holding every cycle the
    training thread made meanwhile."""
    import gc

    from tests.proc import wait_for
    from train_entry import checkpoint

    assert gc.isenabled()
    monkeypatch.setattr(checkpoint, "PAUSE_LIMIT_S", 0.3)
    with checkpoint._collection_paused():
        assert not gc.isenabled()
        with checkpoint._collection_paused():  # a second save's pause opens inside the first
            wait_for(gc.isenabled, 10, "collection to run again after the pause's limit")
        assert gc.isenabled()
    assert gc.isenabled() and checkpoint._lifter is None
    monkeypatch.setattr(checkpoint, "PAUSE_LIMIT_S", 60.0)
    with checkpoint._collection_paused():  # a short one is not cut short, and leaves no timer behind
        assert not gc.isenabled()
        lifter = checkpoint._lifter
        assert lifter is not None and lifter.is_alive()
    lifter.join(5)
    assert gc.isenabled() and not lifter.is_alive() and checkpoint._lifter is None


def test_a_handed_over_step_that_is_gone_is_no_fresh_start_while_a_valid_checkpoint_is_there(tmp_path, caplog):
    """Review 13: a rollback's older step deleted before the ranks read it (by a gc that could not see the run) left
    nothing valid below it, and the ranks started from step 0 over the newer checkpoints. Below it first, then newer;
    a fresh start only where nothing is valid."""
    from types import SimpleNamespace

    from tests.ckpt_helpers import write_checkpoint
    from train_entry.session import Session

    root = tmp_path / "ckpt"
    for step in (10, 30):
        write_checkpoint(root, step)
    me = SimpleNamespace(ckpt=SimpleNamespace(durable_root=root))
    assert Session._decide(me, [(True, 20, None)]) == 10  # below the one handed over, as before
    assert Session._decide(me, [(True, 5, None)]) == 30  # nothing below: the newest, not a fresh start
    assert "handed-over step 5 is not valid here (missing); using 30" in caplog.text
    assert Session._decide(SimpleNamespace(ckpt=SimpleNamespace(durable_root=tmp_path / "none")),
                           [(True, 5, None)]) is None


def test_a_durable_copy_published_after_the_launch_of_a_save_from_before_it_is_not_this_attempts(tmp_path):
    """Review 13: after a rollback the replicator went on copying the local step rolled back past; its durable copy,
    published after the relaunch, counted as "committed by this attempt after its launch" and the ranks resumed from
    the state the rollback discarded. A copy is dated by its local save (`saved_at`); a save of this attempt wins."""
    import time
    from types import SimpleNamespace

    from supervisor import store
    from tests.ckpt_helpers import write_checkpoint
    from train_entry.session import Session

    root = tmp_path / "ckpt"
    write_checkpoint(root, 10)
    launched = time.time()
    partial = write_checkpoint(root, 40, commit=False, close=False)  # the durable copy of a save from before
    records = store.describe_files(partial.path, ["__0_0.distcp", "__1_0.distcp", ".metadata"])
    partial.commit(2, records, extra={"tier": "durable", "saved_at": launched - 60})
    me = SimpleNamespace(ckpt=SimpleNamespace(durable_root=root))
    assert Session._decide(me, [(True, 10, launched)]) == 10
    write_checkpoint(root, 20)  # saved by this attempt (an earlier worker group of it) after the launch
    assert Session._decide(me, [(True, 10, launched)]) == 20


def test_this_attempts_saves_are_known_by_torchruns_group_id_not_by_clocks(tmp_path, monkeypatch):
    """Review 16: "saved after the launch" compared the saving node's clock with the supervisors': a node's clock
    ahead made a step saved before a NaN's relaunch "this attempt's", and the ranks were handed the step the rollback
    passed over. A save records torchrun's group id (new at every launch); by the time only without one."""
    import time
    from types import SimpleNamespace

    from supervisor import store
    from tests.ckpt_helpers import write_checkpoint
    from train_entry.session import GROUP_ENV, Session

    root = tmp_path / "ckpt"
    write_checkpoint(root, 10)
    launched = time.time() - 60
    for step, group in ((40, "the previous attempt's group"), (30, "this group")):
        partial = write_checkpoint(root, step, commit=False, close=False)
        records = store.describe_files(partial.path, ["__0_0.distcp", "__1_0.distcp", ".metadata"])
        partial.commit(2, records, extra={"torchelastic_run_id": group})  # both dated after the launch
    me = SimpleNamespace(ckpt=SimpleNamespace(durable_root=root))
    monkeypatch.setenv(GROUP_ENV, "this group")
    assert Session._decide(me, [(True, 10, launched)]) == 30
    monkeypatch.setenv(GROUP_ENV, "the next group")
    assert Session._decide(me, [(True, 10, launched)]) == 10


def test_a_small_file_another_node_sends_for_the_local_tier_must_be_the_bytes_its_rank_wrote(tmp_path):
    """Review 13: the bytes, read back from the sender's disk, were checksummed only as received: a bad read-back
    made a local checkpoint that holds other bytes than the rank wrote, and valid by its own manifest."""
    from types import SimpleNamespace

    from supervisor import store
    from train_entry.checkpoint import Checkpointer

    def record(name: str, data: bytes) -> store.FileRecord:
        h = store.hasher()
        h.update(data)
        return store.FileRecord(name, len(data), h.hexdigest())

    me = SimpleNamespace(local=True, node="a")
    wrote = b"rank 1's small file"
    sent = [("a", 0, [record("__0_0.distcp", b"x")], {}, {}),
            ("b", 1, [record("__1_0.distcp", b"y"), record("__1_1.distcp", wrote)], {"__1_1.distcp": wrote}, {})]
    records, extra = Checkpointer._folder_records(me, tmp_path, sent, {})
    assert [r.name for r in records] == ["__0_0.distcp", "__1_1.distcp"] and extra["ranks"] == {"a": [0], "b": [1]}
    bad = [sent[0], ("b", 1, sent[1][2], {"__1_1.distcp": b"rank 1's small fiLe"}, {})]
    with pytest.raises(RuntimeError, match=r"rank 1's __1_1\.distcp read back from its disk differs"):
        Checkpointer._folder_records(me, tmp_path, bad, {})
