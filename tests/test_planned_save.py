"""Saves plan once per layout across ranks (train_entry/planned_save.py), on two real gloo ranks under torchrun:
when one rank's state changes its layout, every rank plans again (a rank that reused its plans while another
made new ones would wait in a different collective: a hang), and every save loads back its own values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.proc import child_env, free_port, started

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from supervisor import store
from train_entry.checkpoint import Checkpointer
from train_entry.dist import DistContext

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo", mesh, dist.new_group(backend="gloo"))
root = sys.argv[1]
ckpt = Checkpointer(root, ctx, async_save=True)
w = distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)])
sd = {"w": w, "note": f"rank {rank}"}
planned, saved = [], {}
for step in (1, 2, 3, 4, 5):
    if step == 3 and rank == 1:
        sd["extra"] = torch.full((3,), 7.0)  # one rank's layout changes
    w.to_local().add_(1.0)
    sd["note"] = "x" * step  # a non-tensor value of a new length each save
    saved[step] = w.to_local().clone()
    ckpt.save(step, lambda: sd, sync=step == 4)
    ckpt.wait()
    planned.append(ckpt._saver.planned)
for step in (2, 5):
    template = {"w": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "note": ""}
    if rank == 1 and step == 5:
        template["extra"] = torch.zeros(3)
    got = ckpt.load(Path(root) / store.step_dirname(step), lambda keys, t=template: t)
    assert torch.equal(got["w"].to_local(), saved[step]), step
    assert got["note"] == "x" * step, got["note"]
    if rank == 1 and step == 5:
        assert torch.equal(got["extra"], torch.full((3,), 7.0))
Path(root).with_name(f"planned_{rank}.json").write_text(json.dumps(planned))
dist.destroy_process_group()
# What is tested is above. The interpreter's teardown can abort a rank that has used gloo ("terminate called without
# an active exception", SIGABRT; the cause: README, the library's section): this script hit it once in a full suite
# on 2026-11-27, after its plans were written, and 2 of 64 times in a loop. Leave without that teardown.
sys.stdout.flush()
sys.stderr.flush()
import os
os._exit(0)
'''


def test_one_ranks_new_layout_makes_every_rank_plan_again_and_each_save_loads_back(tmp_path):
    script = tmp_path / "plans.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0",
            str(script), str(tmp_path / "ckpt")]
    with started(argv, tmp_path, env=child_env(), log=tmp_path / "run.log") as p:
        rc = p.wait(120)
        out = p.output()
    assert rc == 0, out[-3000:]
    results = {rank: json.loads((tmp_path / f"planned_{rank}.json").read_text()) for rank in (0, 1)}
    # Planned at the first save, again at the third (rank 1's new key) on both ranks, reused at the others.
    assert results == {0: [1, 1, 2, 2, 2], 1: [1, 1, 2, 2, 2]}, out[-3000:]
    assert sorted(p.name for p in Path(tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == [
        f"step_{s:09d}" for s in (1, 2, 3, 4, 5)]
