#!/usr/bin/env python3
"""How much of the interpreter a background persist takes from a launch-bound training thread.

    python bench/persist_interpreter.py                 # 0.02 GB, 8 layers (418 items), 16 async saves
    python bench/persist_interpreter.py --gb 0.5 --saves 10
    python bench/persist_interpreter.py --device cuda --gb 2      # one GPU: staged through the pinned arena

On a GPU a training step is mostly its thread launching kernels: each launch lets go of the interpreter and
takes it back. While the persist thread runs Python (planning, pickling, the per-item loop), every take-back
waits, up to the 5 ms switch interval. This measures that wait directly, in one process (a world of one,
gloo, the same FSDP2 GPT and `Checkpointer` as bench/checkpoint_save.py): the main thread runs a loop that lets
go of the interpreter every iteration (`time.sleep(0)`), its rate measured alone just before every other save;
the time it loses while each async save persists, `persist seconds − iterations ÷ rate`, is the time the
persist took from it. A small state (the default) leaves the Python part alone; with a large one the writes'
memory copies compete for the cores too (on a 2-core VM that noise swamps it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from argtypes import positive_float, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def loop_until(done: Callable[[], bool]) -> tuple[int, float]:
    n, t = 0, time.perf_counter()
    while not done():
        for _ in range(20):
            time.sleep(0)  # lets go of the interpreter and takes it back, as a kernel launch does
            n += 1
    return n, time.perf_counter() - t


def alone_rate(seconds: float = 0.25) -> float:
    end = time.perf_counter() + seconds
    n, took = loop_until(lambda: time.perf_counter() > end)
    return n / took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=positive_float, default=0.02, help="params + AdamW state, GB")
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--saves", type=positive_int, default=16)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--port", type=int, default=29571)
    args = p.parse_args()
    import checkpoint_save

    checkpoint_save.require_device(p, args.device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    import torch

    torch.set_num_threads(1)

    from train_entry.checkpoint import Checkpointer

    rank = checkpoint_save.setup_rank(argparse.Namespace(gb=args.gb, layers=args.layers, device=args.device, batch=1,
                                                         collective_timeout_s=60))
    for _ in range(3):
        rank.train_step()
    with tempfile.TemporaryDirectory() as root:
        ckpt = Checkpointer(root, rank.ctx, async_save=True)
        state = lambda: rank.state.state_dict(0, rank.ctx.device)  # noqa: E731
        taken, persist = [], []
        rate = alone_rate()
        for i in range(args.saves):
            if i % 2 == 0:
                rate = alone_rate()
            rank.state.step += 1
            ckpt.save(rank.state.step, state, sync=False)
            thread = ckpt._thread
            assert thread is not None
            n, took = loop_until(lambda t=thread: not t.is_alive())
            ckpt.wait()
            taken.append(took - n / rate)
            persist.append(took)
        items = len(ckpt._planner.plan.items)  # what this rank wrote, each save
    print(f"{args.gb} GB on {args.device}, {items} items, {args.saves} async saves: a persist took "
          f"{statistics.median(persist) * 1e3:.1f} ms (median), and {statistics.median(taken) * 1e3:.1f} ms "
          f"(median; quartiles {statistics.quantiles(taken)[0] * 1e3:.1f} / "
          f"{statistics.quantiles(taken)[2] * 1e3:.1f}) of the loop's time beside it")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
