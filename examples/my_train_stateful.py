"""A user's own training loop with what real loops hold: mixed precision with a GradScaler, an EMA of the
weights, and a torchdata StatefulDataLoader. resilient saves each with the checkpoint and restores it exactly.

    torchrun --nproc-per-node 2 examples/my_train_stateful.py     # plain torchrun: resumes from ./checkpoints
    resilient run jobs/my-script-stateful.yaml                      # supervised

The model and data are the user's (an MLP fitting y = sin(x) from noisy samples); everything resilient needs is
marked ◀. Needs torchdata (`pip install 'resilient[data]'`).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Subset, TensorDataset

from train_entry import EMA, PerRank, Replicated, Session, Sharded, TrainState  # ◀

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler
except ImportError:
    sys.exit("examples/my_train_stateful.py needs torchdata's StatefulDataLoader: pip install 'resilient[data]'")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--samples", type=int, default=1024, help="dataset size (an epoch is samples / batch steps)")
    p.add_argument("--ckpt-interval", type=int, default=50)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = p.parse_args()

    session = Session.start(ckpt_dir="checkpoints", ckpt_interval=args.ckpt_interval, seed=0,  # ◀
                            device=args.device)
    device = session.device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Dropout(0.05), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 1)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=session.ctx.mesh)
    fully_shard(model, mesh=session.ctx.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, growth_interval=20)  # fp16 needs loss scaling
    ema = EMA(model, decay=0.95)  # one DTensor per FSDP2 parameter, sharded like it

    # This rank's shard of the data, reshuffled every epoch by the rank's own generator: the loader's position
    # and generator differ between ranks.
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(args.samples, 1, generator=g) * 6 - 3
    data = TensorDataset(x, torch.sin(x) + 0.05 * torch.randn(args.samples, 1, generator=g))
    shard = Subset(data, range(session.rank, args.samples, session.world_size))
    # The sampler gets a generator of its own, the loader another: a loader draws a base seed from its generator
    # each epoch, which torchdata (0.11) does not replay on restore, so with one shared generator (shuffle=True)
    # the epoch after a resume is shuffled differently (measured). Without any generator, both would draw from
    # the global RNG, which resilient restores for dropout: the resumed run would draw where the other did not.
    sampler = RandomSampler(shard, generator=torch.Generator().manual_seed(1000 + session.rank))
    loader = StatefulDataLoader(shard, batch_size=args.batch // session.world_size, sampler=sampler, drop_last=True,
                                generator=torch.Generator().manual_seed(2000 + session.rank))

    state = TrainState(model, optimizer, stateful={  # ◀ what a checkpoint holds, and how it is spread
        "scaler": Replicated(scaler),  # ◀ the same on every rank
        "ema": Sharded(ema),           # ◀ DTensors: resharded like the model
        "loader": PerRank(loader),     # ◀ each rank's own position (no reshard hook: same world size only)
    })
    step = session.resume(state)  # ◀ everything above restored, or step 0
    batches = iter(loader)  # after the resume: a restored loader continues mid-epoch
    while step < args.steps:
        try:
            xb, yb = next(batches)
        except StopIteration:  # the end of an epoch
            batches = iter(loader)
            xb, yb = next(batches)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(xb.to(device)).float(), yb.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        ema.update(model)
        step += 1
        state.step, state.samples_seen = step, state.samples_seen + args.batch
        mean = session.beat(step, loss.item())  # ◀ agree on stop/NaN across ranks; heartbeat
        if session.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {mean:.5f} scale {scaler.get_scale():.0f}", flush=True)
        if session.should_save(step):  # ◀ every interval, and at once when preempted
            session.save(step, state)
        if session.stop_requested:
            break
    return session.finish(step, state)  # ◀ final checkpoint; exit 0, or 75 when preempted


if __name__ == "__main__":
    sys.exit(main())
