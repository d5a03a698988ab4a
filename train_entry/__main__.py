"""The reference training entry point: `torchrun --nproc-per-node 2 -m train_entry --steps 200`.

Reads top to bottom: parse → build → train. Everything needed to resume comes from the environment the
supervisor sets (or, under plain torchrun, from the newest valid checkpoint) and from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from supervisor.protocol import EXIT_CONFIG
from train_entry.checkpoint import SavePause
from train_entry.data import CorpusConfig, TokenStream
from train_entry.ema import EMA
from train_entry.loader import StatefulLoader, stream_batches
from train_entry.model import GPT, GPTConfig
from train_entry.precision import DTYPES, Precision
from train_entry.session import Session
from train_entry.state import TrainState
from train_entry.stateful import PerRank, Replicated, Sharded

log = logging.getLogger("train_entry")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train_entry", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step, all ranks)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps, then cosine to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-sequences", type=int, default=4096)
    p.add_argument("--precision", choices=tuple(DTYPES), default="fp32",
                   help="bf16/fp16: FSDP2 MixedPrecisionPolicy on CUDA, autocast on CPU; fp16 adds a GradScaler")
    p.add_argument("--scaler-growth-interval", type=int, default=2000, help="fp16's GradScaler: steps per growth")
    p.add_argument("--ema", type=float, default=None, metavar="DECAY",
                   help="keep an exponential moving average of the weights (sharded like them), e.g. 0.999")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms: on CUDA, bf16/fp16 attention's backward is otherwise not "
                        "bitwise reproducible, even between two uninterrupted runs")
    p.add_argument("--loader", choices=("stream", "stateful"), default="stream",
                   help="stateful: read batches through torchdata's StatefulDataLoader, its position saved per rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--sync-every", type=int, default=0,
                   help="steps between the ranks' agreements on stop/loss/interval; 0: about every second")
    # Plain-torchrun settings; under `resilient run` the supervisor's handover wins.
    p.add_argument("--ckpt-dir", default="checkpoints")
    p.add_argument("--ckpt-interval", type=int, default=50)
    p.add_argument("--sync-save", action="store_true", help="block for whole saves (no async)")
    p.add_argument("--heartbeat-dir", default=None)
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    p.add_argument("--collective-timeout-s", type=float, default=600.0)
    # Fault injection for tests and benchmarks.
    t = p.add_argument_group("test hooks")
    t.add_argument("--test-nan-at-step", type=int, help="force a NaN loss at this step")
    t.add_argument("--test-die-at-step", type=int, help="raise at the end of this step")
    t.add_argument("--test-attempts", default=None,
                   help="comma-separated attempts (RESILIENT_ATTEMPT) the nan/die hooks fire on; default all")
    t.add_argument("--test-sleep-per-step", type=float, default=0.0)
    t.add_argument("--test-slow-rank", default=None, help="RANK:SECONDS extra sleep per step (a straggler)")
    t.add_argument("--test-save-pause", type=SavePause.parse, default=None,
                   help="POINT:SECONDS[@STEP] (sleep there) or POINT:enospc[@STEP] (fill the checkpoint filesystem)")
    t.add_argument("--test-oom-at-step", type=int, help="ask the allocator for far more memory than exists")
    t.add_argument("--test-log-samples", default=None, help="folder: each rank logs the sample ids it trains on")
    t.add_argument("--test-stateful-load-raises", action="store_true",
                   help="checkpoint one more stateful object, whose load_state_dict raises on resume")
    t.add_argument("--test-replicated-drift", action="store_true",
                   help="checkpoint a stateful object declared Replicated whose state drifts apart between ranks")
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 0 or args.n_embd % args.n_head:
        p.error("need --batch ≥ 1, --steps ≥ 0, and --n-embd divisible by --n-head")
    return args


def build(args: argparse.Namespace, session: Session, precision: Precision, data: TokenStream,
          hooks: TestHooks | None = None) -> tuple[TrainState, EMA | None, StatefulLoader | None]:
    """The model (FSDP2: each block, then the root), AdamW, warmup + cosine LR; the EMA, the loss scaler and
    the stateful loader where asked for, each checkpointed through `stateful=` as its state is spread."""
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, dropout=args.dropout)
    torch.manual_seed(args.seed)  # identical initial weights on every rank, before sharding
    model = GPT(cfg).to(session.device)
    for block in model.blocks:
        fully_shard(block, mesh=session.ctx.mesh, **precision.shard_kwargs())
    fully_shard(model, mesh=session.ctx.mesh, **precision.shard_kwargs())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    stateful: dict = {}
    ema = EMA(model, args.ema) if args.ema is not None else None
    if ema is not None:
        stateful["ema"] = Sharded(ema)  # DTensor shards like the weights: resharded like them
    if precision.scaler is not None:
        stateful["scaler"] = Replicated(precision.scaler)  # every rank agrees on inf/NaN, so on the scale
    loader = None
    if args.loader == "stateful":
        loader = StatefulLoader(data, args.batch, session.rank, session.world_size, seed=args.seed)
        stateful["loader"] = PerRank(loader)  # each rank's own position; reshard_state_dict follows a new world
    if args.test_stateful_load_raises:
        stateful["test_refuses_load"] = Replicated(RefusesToLoad())
    if hooks is not None and hooks.drifts is not None:
        stateful["test_drifts"] = Replicated(hooks.drifts)
    if session.ctx.is_main and (stateful or precision.name != "fp32"):
        log.info("precision %s (%s); stateful objects: %s", precision.name, precision.how,
                 ", ".join(f"{name} ({type(d).__name__})" for name, d in stateful.items()) or "none")
    return TrainState(model, optimizer, scheduler, stateful=stateful), ema, loader


class TestHooks:
    """Faults on request, so tests and benchmarks can break a real run at a known place."""

    def __init__(self, args: argparse.Namespace, session: Session):
        self.args, self.session = args, session
        self.armed = hooks_armed(args)
        slow = (args.test_slow_rank or "").partition(":")
        self.extra_sleep = float(slow[2]) if slow[2] and int(slow[0]) == session.rank else 0.0
        self.samples = None
        self.drifts = Drifts() if args.test_replicated_drift else None
        if args.test_log_samples:
            os.makedirs(args.test_log_samples, exist_ok=True)
            name = f"rank{session.rank}.pid{os.getpid()}.jsonl"
            self.samples = open(os.path.join(args.test_log_samples, name), "a", buffering=1)  # noqa: SIM115

    def loss_factor(self, step: int) -> float:
        return float("nan") if self.armed and step == self.args.test_nan_at_step else 1.0

    def after_step(self, step: int, ids: range, loss: float | None) -> None:
        if self.samples is not None:
            self.samples.write(json.dumps({"step": step, "rank": self.session.rank, "world": self.session.world_size,
                                           "attempt": self.session.handover.attempt, "t": time.time(),
                                           "loss": loss, "ids": [ids.start, ids.stop]}) + "\n")
        if self.armed and step == self.args.test_oom_at_step:
            # 1 PiB from the training device's allocator: its own out-of-memory error (CUDA's on a GPU)
            torch.empty(1 << 50, dtype=torch.uint8, device=self.session.device)
        if self.armed and step == self.args.test_die_at_step:
            raise RuntimeError(f"test hook: injected failure at step {step}")
        if self.drifts is not None:
            self.drifts.count += 1 + self.session.rank
        if self.args.test_sleep_per_step:
            time.sleep(self.args.test_sleep_per_step)

    def before_beat(self) -> None:
        if self.extra_sleep:  # after the step's last collective: the other ranks wait at the step-end sync
            time.sleep(self.extra_sleep)


class Drifts:
    """Test hook: declared Replicated, yet each rank counts its own way (a user's mistake the save must catch)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class RefusesToLoad:
    """Test hook: a stateful object whose load_state_dict raises, as a user's object with a bug would."""

    def state_dict(self) -> dict:
        return {"saved": True}

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("test hook: this object refuses its saved state")


def hooks_armed(args: argparse.Namespace) -> bool:
    """Test hooks fire on every attempt unless --test-attempts names some (RESILIENT_ATTEMPT)."""
    return args.test_attempts is None or os.environ.get("RESILIENT_ATTEMPT", "0") in args.test_attempts.split(",")


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reads it at its first use
        torch.use_deterministic_algorithms(True)
    session = Session.start(ckpt_dir=args.ckpt_dir, ckpt_interval=args.ckpt_interval,
                            async_save=not args.sync_save, heartbeat_dir=args.heartbeat_dir,
                            heartbeat_interval_s=args.heartbeat_interval_s,
                            collective_timeout_s=args.collective_timeout_s, device=args.device, seed=args.seed,
                            save_pause=args.test_save_pause if hooks_armed(args) else None,
                            sync_every=args.sync_every)
    precision = Precision(args.precision, session.device, scaler_growth_interval=args.scaler_growth_interval)
    data = TokenStream(CorpusConfig(vocab_size=args.vocab, seq_len=args.seq_len,
                                    n_sequences=args.corpus_sequences, seed=args.seed + 1234))
    hooks = TestHooks(args, session)
    state, ema, loader = build(args, session, precision, data, hooks)
    step = session.resume(state)
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    model.train()
    tokens_per_step = args.batch * args.seq_len
    batches = loader.batches(session.device) if loader is not None else stream_batches(
        data, lambda: state.samples_seen, args.batch, session.rank, session.world_size, session.device)
    t_log, step_log = time.monotonic(), step
    while step < args.steps:
        ids, x, y = next(batches)
        with precision.autocast():
            loss_sum = model(x, y) * hooks.loss_factor(step + 1)
        # Gradients are averaged over ranks; scaling by world/global tokens makes that the exact global
        # mean even when ranks hold uneven shares of the batch.
        precision.backward(loss_sum * (session.world_size / tokens_per_step))
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if ema is not None:
            ema.update(model)
        step += 1
        state.step, state.samples_seen, state.tokens_seen = (step, state.samples_seen + args.batch,
                                                             state.tokens_seen + tokens_per_step)
        hooks.before_beat()
        loss = session.beat(step, loss_sum.item() / max(1, len(ids) * args.seq_len), weight=len(ids))
        if session.rank == 0 and loss is not None and (step % args.log_every == 0 or step == args.steps):
            rate = (step - step_log) / max(1e-9, time.monotonic() - t_log)
            print(f"step {step}/{args.steps} loss {loss:.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                  f"{rate:.1f} steps/s", flush=True)
            t_log, step_log = time.monotonic(), step
        hooks.after_step(step, ids, loss)
        if session.should_save(step):
            session.save(step, state)
        if session.stop_requested:
            break
    return session.finish(step, state)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # bad arguments or environment: retrying cannot help
        print(f"train_entry: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
