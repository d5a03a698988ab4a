"""A user's own torchrun training script made resumable with resilient's library: the five calls.

    torchrun --nproc-per-node 2 examples/my_train.py            # plain torchrun: resumes from runs/my_train/checkpoints
    resilient run jobs/my-script.yaml                           # supervised: hangs, crashes, preemption

The model (a small MLP learning y = sin(x)) is the user's; everything resilient needs is marked ◀.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from train_entry import Session, TrainState  # ◀


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    args = p.parse_args()

    # ◀ process group, heartbeats; under `resilient run` the job's checkpoint root replaces ckpt_dir. runs/ is
    # git-ignored: plain torchrun from a clone leaves nothing untracked.
    session = Session.start(ckpt_dir="runs/my_train/checkpoints", ckpt_interval=50, seed=0)
    torch.manual_seed(0)
    device = session.device  # ◀ cuda:LOCAL_RANK on a GPU node, else the CPU: the model and the data go there
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=session.ctx.mesh)
    fully_shard(model, mesh=session.ctx.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, optimizer)  # ◀ what a checkpoint holds (plus RNG and position)

    step = session.resume(state)  # ◀ the handed-over checkpoint (resharded if the world changed), or 0
    while step < args.steps:
        # Data as a pure function of the global position: resume and resharding repeat and skip nothing. Every
        # sample of the global batch goes to one rank, on any world size (3 ranks: 22, 21 and 21 of 64).
        g = torch.Generator().manual_seed(1000 + step)
        x = (torch.rand(args.batch, 1, generator=g).tensor_split(session.world_size)[session.rank] * 6 - 3).to(device)
        loss = nn.functional.mse_loss(model(x), torch.sin(x))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        state.step, state.samples_seen = step, state.samples_seen + args.batch
        mean = session.beat(step, loss.item())  # ◀ agree on stop/NaN across ranks; heartbeat
        if session.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {mean:.5f}", flush=True)
        if session.should_save(step):  # ◀ every interval, and at once when preempted
            session.save(step, state)
        if session.stop_requested:
            break
    return session.finish(step, state)  # ◀ final checkpoint; exit 0, or 75 when preempted


if __name__ == "__main__":
    sys.exit(main())
