"""Which tier a relaunch reads, on real local-tier folders: the newest step every node holds whole *as the same
save*, not only each node's newest (train_entry.session: what each rank offers, and rank 0's choice)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from supervisor import store
from tests.ckpt_helpers import flip_byte
from tests.test_replicate import NODES, local_checkpoint
from train_entry.session import Session

RANK_OF = {"a": 0, "b": 2}  # a rank each node holds (NODES: a has 0 and 1, b has 2 and 3)


def offer(tmp_path: Path, node: str, handed: int | None) -> tuple[dict[int, str], str]:
    me = SimpleNamespace(handover=SimpleNamespace(local_resume_step=handed), world_size=4, rank=RANK_OF[node],
                         ckpt=SimpleNamespace(local=True, root=tmp_path / f"local-{node}", node=node))
    return Session._local_offer(me)  # type: ignore[arg-type]


def choose(durable: int | None, offers: list[tuple[dict[int, str], str]]) -> tuple[int | None, str, str]:
    return Session._tier(SimpleNamespace(ckpt=SimpleNamespace(local=True)), durable, offers)  # type: ignore[arg-type]


def test_a_node_whose_newest_local_step_is_damaged_still_resumes_both_from_an_older_common_one(tmp_path):
    """Node b's step 80 is damaged (its supervisor set it aside and handed over 60); both hold 60 whole. Comparing
    the nodes' newest steps only, the relaunch went back to the durable step 20: 40 steps lost for nothing."""
    for node in NODES:
        for step in (60, 80):
            local_checkpoint(tmp_path / f"local-{node}", step, node)
    flip_byte(tmp_path / "local-b" / store.step_dirname(80) / ".metadata", 2)
    offers = [offer(tmp_path, "a", 80), offer(tmp_path, "b", 60)]
    assert sorted(offers[0][0]) == [60, 80] and sorted(offers[1][0]) == [60]
    step, tier, why = choose(20, offers)
    assert (step, tier) == (60, "local") and why == "every node holds step 60 whole (the nodes' newest local " \
                                                   "steps: [60, 80])"
    assert choose(70, offers)[:2] == (70, "durable")  # a newer durable step wins, as before


def test_two_saves_of_one_step_number_on_two_nodes_are_never_mixed(tmp_path):
    """Node a kept the first save of step 40; node b holds a second one (its job resumed from 20 and saved 40
    again, while a's new save of 40 never committed). Loading 'step 40' would take each node's shards from
    another training state: the nodes agree on step 20, the newest they hold as one save."""
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 20, node)
        local_checkpoint(tmp_path / f"local-{node}", 40, node)
    shutil.rmtree(tmp_path / "local-b" / store.step_dirname(40))
    local_checkpoint(tmp_path / "local-b", 40, "b", salt="-again")
    offers = [offer(tmp_path, "a", 40), offer(tmp_path, "b", 40)]
    assert offers[0][0][20] == offers[1][0][20] and offers[0][0][40] != offers[1][0][40]
    assert choose(None, offers)[:2] == (20, "local")
    shutil.rmtree(tmp_path / "local-a" / store.step_dirname(20))
    shutil.rmtree(tmp_path / "local-b" / store.step_dirname(20))
    step, tier, why = choose(10, [offer(tmp_path, "a", 40), offer(tmp_path, "b", 40)])
    assert (step, tier) == (10, "durable") and why == "the nodes hold no local step in common (their newest: [40])"


def test_a_node_with_no_local_checkpoint_sends_every_rank_to_the_durable_tier(tmp_path):
    local_checkpoint(tmp_path / "local-a", 20, "a")
    offers = [offer(tmp_path, "a", 20), offer(tmp_path, "b", None)]
    assert choose(10, offers) == (10, "durable", "node b has no local checkpoint")


def test_a_local_copy_the_ranks_could_not_load_is_checked_in_full_before_it_is_judged(tmp_path):
    """The load failed on the local tier: that copy is read to its last byte. Damaged, it is set aside and the durable
    tier serves; whole (the code changed, say), it is judged like a durable checkpoint, never set aside as damaged
    (audit: byte-perfect local copies were quarantined at once, and inspect listed them as corrupt)."""
    from supervisor import api
    from supervisor.config import CheckpointConfig
    from supervisor.console import EventConsole
    from supervisor.resume import ResumeChooser
    from tests.ckpt_helpers import write_checkpoint

    durable, local = tmp_path / "durable", tmp_path / "local"
    for step in (20, 40):
        write_checkpoint(durable, step)
        write_checkpoint(local, step, size=store.SMALL_FILE_BYTES + 1)
    chooser = ResumeChooser(CheckpointConfig(dir=durable), local, EventConsole("demo"), lambda q: None, lambda: 3)
    failed = api.AttemptOutcome(api.CHECKPOINT_LOAD, "rank 0 could not load the checkpoint: step 40: boom", 0, 74,
                                None, checkpoint_step=40, checkpoint_tier="local")
    whole = chooser.load_failure(failed, chooser.choose(None))
    assert (whole.step, whole.corrupt, whole.older_valid, whole.local) == (40, None, 20, True)
    flip_byte(local / store.step_dirname(40) / "__0_0.distcp")  # past SMALL_FILE_BYTES: only a full read sees it
    assert store.inspect(local / store.step_dirname(40)).valid
    damaged = chooser.load_failure(failed, chooser.choose(None))
    assert damaged.local and damaged.corrupt is not None and "__0_0.distcp checksum mismatch" in damaged.corrupt


def test_a_whole_step_that_failed_to_load_twice_is_set_aside_in_both_tiers_once_an_older_one_loads(tmp_path):
    from supervisor.api import Decision
    from supervisor.config import CheckpointConfig
    from supervisor.console import EventConsole
    from supervisor.resume import ResumeChooser
    from tests.ckpt_helpers import write_checkpoint

    durable, local = tmp_path / "durable", tmp_path / "local"
    for step in (20, 40):
        write_checkpoint(durable, step)
        write_checkpoint(local, step)
    chooser = ResumeChooser(CheckpointConfig(dir=durable), local, EventConsole("demo"), lambda q: None, lambda: 3)
    chooser.set_aside(Decision(True, quarantine_step=40, quarantine="failed to load it twice",
                               quarantine_once_older_loads=True, resume_below=40))
    assert chooser.choose(None).step == 20 and chooser.local_step == 20  # passed over in both tiers
    chooser.resumed(20)
    assert not (durable / store.step_dirname(40)).exists() and not (local / store.step_dirname(40)).exists()
    assert (durable / "step_000000040.quarantined").is_dir() and (local / "step_000000040.quarantined").is_dir()
    assert chooser.choose(None).step == 20 and chooser.local_step == 20  # and it stays passed over


def test_a_nan_rolls_back_from_the_newest_step_in_either_tier_and_sets_that_one_aside(tmp_path):
    """The local tier ahead of the durable one by the replication lag: the loss went non-finite after local step 60,
    so the rollback resumes below 60 (from 40), not below the newest durable step (review of this session: rolled
    back to 20, set the good durable 40 aside, and left local 60 for a later relaunch to hand to the ranks)."""
    from supervisor import api
    from supervisor.config import CheckpointConfig, RestartConfig
    from supervisor.console import EventConsole
    from supervisor.policy import RestartPolicy
    from supervisor.resume import ResumeChooser
    from tests.ckpt_helpers import write_checkpoint

    durable, local = tmp_path / "durable", tmp_path / "local"
    for step in (20, 40):
        write_checkpoint(durable, step)
    for step in (40, 60):
        write_checkpoint(local, step)
    chooser = ResumeChooser(CheckpointConfig(dir=durable), local, EventConsole("demo"), lambda q: None, lambda: 3)
    started = chooser.choose(None)
    assert (started.step, chooser.local_step) == (40, 60)
    nan = api.AttemptOutcome(api.NAN, "rank 0: the loss is nan at step 70", 70, 76, None)
    progressed, newest, older = chooser.progress(started)
    assert (progressed, newest, older) == (False, 60, 40)
    decision = RestartPolicy(RestartConfig()).decide(nan, progressed=progressed, newest_valid=newest,
                                                     older_valid=older)
    assert decision.relaunch and decision.resume_below == 60 and decision.quarantine_step == 60
    chooser.set_aside(decision)
    again = chooser.choose(decision.resume_below)
    assert (again.step, chooser.local_step) == (40, 40)
    chooser.resumed(40)  # the older one loads: the step the loss went non-finite after is set aside, locally
    assert (local / "step_000000060.quarantined").is_dir() and (durable / store.step_dirname(40)).is_dir()
    assert chooser.choose(None).step == 40 and chooser.local_step == 40


HSDP_SCRIPT = r'''
import json, os, sys
from pathlib import Path

import pytest

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from supervisor import store
from train_entry.checkpoint import Checkpointer
from train_entry.dist import DistContext

dist.init_process_group("gloo")
rank = dist.get_rank()
node = "ab"[rank]  # one rank per node: each its node's first
mesh = init_device_mesh("cpu", (2,))
ctx = DistContext(rank, 2, 0, torch.device("cpu"), "gloo", mesh, dist.new_group(backend="gloo"))
tmp = Path(sys.argv[1])
results = {}
for step, replicated in ((1, True), (2, False)):
    ckpt = Checkpointer(tmp / "local" / node, ctx, async_save=False, durable_root=tmp / "durable", node=node)
    sd = {"w": distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)])}
    if replicated:  # the same shard on both nodes' ranks, as a tensor across HSDP's replicas
        sd["r"] = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Replicate()])
    ckpt.save(step, lambda: sd, sync=True)
    template = {k: distribute_tensor(torch.zeros(v.shape), mesh, v.placements) for k, v in sd.items()}
    try:
        got = ckpt.load(tmp / "local" / node / store.step_dirname(step), lambda keys: template)
        results[step] = all(torch.equal(got[k].full_tensor(), sd[k].full_tensor()) for k in sd)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        results[step] = str(e)
    dist.barrier()
(tmp / f"loaded_{node}.json").write_text(json.dumps(results))
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # tests/test_planned_save.py: gloo's teardown can abort a rank
'''


@pytest.mark.slow
@pytest.mark.matrix  # DCP's dedup of a shard several ranks hold, on every torch of the range
def test_a_node_whose_replicated_shard_another_node_wrote_restores_from_the_durable_tier(tmp_path):
    """Review 16: DCP writes a shard several ranks hold (a tensor replicated across nodes, as HSDP's) once, from one
    rank; the other node's local folder then lacks it, yet it inspected valid and its ranks were offered it, failed
    to load it twice, and the run stopped or set good checkpoints aside. Such a save now names that node, whose
    ranks read the durable tier. Two real gloo ranks under torchrun, each as its own node."""
    import json
    import sys

    from tests.proc import child_env, free_port, started

    script = tmp_path / "hsdp.py"
    script.write_text(HSDP_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0",
            str(script), str(tmp_path)]
    with started(argv, tmp_path, env=child_env(), log=tmp_path / "run.log") as p:
        rc = p.wait(120)
        out = p.output()
    assert rc == 0, out[-3000:]
    loaded = {node: json.loads((tmp_path / f"loaded_{node}.json").read_text()) for node in "ab"}
    lacking = {node: store.inspect(tmp_path / "local" / node / store.step_dirname(1)).manifest.extra.get(
        "lacks_shards_of_other_nodes") for node in "ab"}
    assert lacking["a"] == lacking["b"] and len(lacking["a"]) == 1, lacking
    short = lacking["a"][0]
    # the premise: read from the local folders, the load of step 1 fails (on every rank: the read is collective)
    failed = loaded[short]["1"]
    assert isinstance(failed, str) and f"local/{short}/step_000000001/__" in failed and "No such file" in failed, \
        loaded
    assert all(loaded[n]["2"] is True for n in "ab"), loaded  # sharded only: each node holds its own
    assert all("lacks_shards_of_other_nodes" not in store.inspect(
        tmp_path / "local" / n / store.step_dirname(2)).manifest.extra for n in "ab")
    for node, rank in (("a", 0), ("b", 1)):
        me = SimpleNamespace(handover=SimpleNamespace(local_resume_step=2), world_size=2, rank=rank,
                             ckpt=SimpleNamespace(local=True, root=tmp_path / "local" / node, node=node))
        offered, why = Session._local_offer(me)  # type: ignore[arg-type]
        assert sorted(offered) == ([2] if node == short else [1, 2]), (node, offered, why)
        if node == short:
            assert "local step 1 lacks shards that ranks on other nodes wrote" in why, why
