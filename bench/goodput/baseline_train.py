"""The baseline trainer: PyTorch's "fault-tolerant training with torchrun" tutorial, on resilient's model and data.

    torchrun --standalone --nproc-per-node 2 --max-restarts 100 baseline_train.py --steps 400 \\
        --snapshot-path DIR/snapshot.pt --snapshot-every 50 --step-log DIR/steps.jsonl

As in the tutorial's `Trainer`: every rank loads `snapshot.pt` at start if it exists, and the snapshot is
overwritten in place with `torch.save` by rank 0 every K steps; torchrun's `--max-restarts` does the restarts.
Under NVIDIA's `ft_launcher`, `--nvrx-heartbeat` adds its rank heartbeat after every step.

Where it differs from the tutorial, and why:
- FSDP2 (`fully_shard` per block, then the root) instead of DDP, so the training step is train_entry's step
  (same model, data, sharding, loss scaling, optimizer and LR schedule). The snapshot therefore gathers a
  full state dict (a collective) before rank 0 saves it, and holds the optimizer and scheduler too (the
  tutorial saves only the model, which would not resume the same run).
- The process-group timeout is a flag (the tutorial keeps gloo's 30 min default, under which a stopped rank
  is never noticed).
- Rank 0 appends one JSON line per completed step, save and (re)start to `--step-log`, in the same format as
  resilient's step log, so the goodput benchmark measures every system the same way from outside.

Run under torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the shared rendezvous store, in-place
restarts hung in init_process_group in 5 of 13 trials here (pytorch/pytorch#135712).
Flag names avoid prefixes of ft_launcher's own options, which it would otherwise take as its own.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from train_entry.data import CorpusConfig, TokenStream, rank_slice
from train_entry.model import GPT, GPTConfig

PROCESS_STARTED = time.time()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-sequences", type=int, default=4096)
    p.add_argument("--snapshot-path", default="snapshot.pt")
    p.add_argument("--snapshot-every", type=int, default=50, help="K: rank 0 saves every K steps; 0: never")
    p.add_argument("--step-log", default=None, help="rank 0 appends {step, t} lines here")
    p.add_argument("--pg-timeout-s", type=float, default=1800.0, help="init_process_group timeout")
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="like train_entry's --test-sleep-per-step")
    p.add_argument("--nvrx-heartbeat", action="store_true", help="send ft_launcher rank heartbeats")
    return p.parse_args()


class StepLog:
    """Rank 0's append-only JSON lines: the benchmark's view of progress (one write per line, no fsync)."""

    def __init__(self, path: str | None):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, **record: object) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(record) + "\n").encode())


class Trainer:
    def __init__(self, args: argparse.Namespace, log: StepLog):
        self.args, self.log = args, log
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                        n_embd=args.n_embd, dropout=args.dropout)
        torch.manual_seed(args.seed)  # identical initial weights on every rank, before sharding
        self.model = GPT(cfg)
        mesh = init_device_mesh("cpu", (self.world,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                           betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_at)
        self.data = TokenStream(CorpusConfig(vocab_size=args.vocab, seq_len=args.seq_len,
                                             n_sequences=args.corpus_sequences, seed=args.seed + 1234))
        self.step = 0
        if os.path.exists(args.snapshot_path):
            self._load_snapshot(args.snapshot_path)
        torch.manual_seed(args.seed * 1_000_003 + self.rank * 10_007 + self.step)  # dropout, per rank

    def lr_at(self, step: int) -> float:
        a = self.args
        if step < a.warmup:
            return (step + 1) / a.warmup
        progress = (step - a.warmup) / max(1, a.steps - a.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location="cpu")
        set_state_dict(self.model, self.optimizer, model_state_dict=snapshot["MODEL_STATE"],
                       optim_state_dict=snapshot["OPTIM_STATE"], options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
        self.step = snapshot["STEPS_RUN"]
        if self.rank == 0:
            print(f"Resuming training from snapshot at step {self.step}", flush=True)

    def _save_snapshot(self) -> None:
        t0 = time.monotonic()
        # Every rank takes part in gathering the full state; with cpu_offload only rank 0 receives it.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            snapshot = {"MODEL_STATE": model_sd, "OPTIM_STATE": optim_sd,
                        "SCHEDULER_STATE": self.scheduler.state_dict(), "STEPS_RUN": self.step}
            torch.save(snapshot, self.args.snapshot_path)  # in place, as in the tutorial
            self.log.write(save=self.step, t=round(time.time(), 4), blocking_s=round(time.monotonic() - t0, 5))

    def train(self, heartbeat) -> None:
        a = self.args
        tokens_per_step = a.batch * a.seq_len
        self.model.train()
        while self.step < a.steps:
            ids = rank_slice(self.step * a.batch, a.batch, self.rank, self.world)
            x, y = self.data.batch(ids, torch.device("cpu"))
            loss_sum = self.model(x, y)
            (loss_sum * (self.world / tokens_per_step)).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            loss = loss_sum.item() / (len(ids) * a.seq_len)
            if self.rank == 0:
                self.log.write(step=self.step, t=round(time.time(), 4))
                if self.step % 100 == 0 or self.step == a.steps:
                    print(f"step {self.step}/{a.steps} loss {loss:.4f}", flush=True)
            if heartbeat is not None:
                heartbeat.send_heartbeat()
            if a.sleep_per_step:
                time.sleep(a.sleep_per_step)
            if a.snapshot_every and self.step % a.snapshot_every == 0:
                self._save_snapshot()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=args.pg_timeout_s))
    log = StepLog(args.step_log if dist.get_rank() == 0 else None)
    heartbeat = None
    if args.nvrx_heartbeat:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        heartbeat = RankMonitorClient()
        heartbeat.init_workload_monitoring()
    trainer = Trainer(args, log)
    log.write(start=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), t=round(time.time(), 4),
              process_started=round(PROCESS_STARTED, 4), resume=trainer.step)
    trainer.train(heartbeat)
    if heartbeat is not None:
        heartbeat.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
