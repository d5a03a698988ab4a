"""Benchmark of checkpoint saves through the project's own `Checkpointer` (FSDP2 + DCP, CPU/gloo, 2 ranks).

What it measures, in one torchrun job that this script launches itself:

1. An FSDP2 model (`train_entry.model.GPT`, `fully_shard` per block then the root) sized so that fp32
   parameters + AdamW state (two moments) come to `--gb` GB (1e9 bytes), one optimizer step taken so the
   AdamW state exists.
2. Saves with `train_entry.checkpoint.Checkpointer` and `train_entry.state.TrainState` (the store's protocol:
   DCP write + fsync, per-rank checksums, marker, rename): one first sync save (cold start), then `--saves`
   rounds of [Checkpointer sync save, plain `dcp.save` of the same state (no store protocol), raw write of
   the same bytes] in rotating order, then `--saves` async saves with `--steps-between` training steps
   between each save call and its `wait()`.
   * blocking time = what `Checkpointer.save` returns (the training thread's stall), the slowest rank;
   * async time to commit = `Checkpointer.last_save_s` (call → marker written and folder renamed);
   * raw write = each rank writes the size of its own DCP file from a Python loop of 8 MiB writes of
     random bytes, then `os.fdatasync`, both ranks at once (DCP's one file per rank); GB/s = both files'
     bytes / the slower rank's wall time. Sync save GB/s = checkpoint bytes / sync save wall time.
3. Host memory per rank (VmRSS, and VmHWM reset before each phase through /proc/self/clear_refs): at start,
   after the model build, the steady training peak, and the peak during sync and async saves; the async
   increase over the steady peak is compared with the size of this rank's shard of the state (the async
   snapshot is one extra host copy of it).

Prints markdown tables and writes bench/results/checkpoint_save.json; the temp checkpoints are removed.

    python bench/checkpoint_save.py                  # 1 GB of state, 3 saves of each kind (≈ 1-2 min)
    python bench/checkpoint_save.py --gb 0.1 --saves 2   # a quick look

Timings on a shared machine are noisy: compare numbers from the same run only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 8 << 20


# --------------------------------------------------------------------------------------------------
# Host memory, from /proc/self/status


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def rss_mb() -> float:
    return _status_mb("VmRSS")


def peak_mb() -> float:
    return _status_mb("VmHWM")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0; a process may do this to itself without root)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# --------------------------------------------------------------------------------------------------
# The worker: one rank of the torchrun job


def model_config(gb: float, layers: int) -> Any:
    """A GPT whose fp32 params + AdamW moments (12 bytes a parameter) come to about `gb` GB."""
    from train_entry.model import GPTConfig

    vocab, seq = 256, 32
    params = gb * 1e9 / 12
    # params ≈ layers·(12 d² + 13 d) + (2 vocab + seq + 2) d: solve for d, a multiple of the 8 heads.
    a, b = 12 * layers, 13 * layers + 2 * vocab + seq + 2
    d = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
    return GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=8, n_embd=max(8, round(d / 8) * 8),
                     dropout=0.0)


def local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def raw_write(path: Path, nbytes: int, pool: bytes) -> None:
    """What DCP does per rank, minus serialisation: sequential writes, then fdatasync."""
    view = memoryview(pool)
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < nbytes:
            n = min(CHUNK, nbytes - done)
            start = (done // CHUNK * 4099) % (len(pool) - CHUNK)  # no repeated 4 KiB blocks
            f.write(view[start:start + n])
            done += n
        os.fdatasync(f.fileno())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.fsdp import fully_shard
    from torch.utils.serialization import config as serialization_config

    from supervisor import store
    from train_entry import dist as dist_util
    from train_entry.checkpoint import Checkpointer
    from train_entry.model import GPT
    from train_entry.state import TrainState

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    dist_util.die_with_parent()  # a killed torchrun (the launcher's cleanup) takes this rank with it
    ctx = dist_util.init(args.collective_timeout_s, "cpu")
    group, rank, root = ctx.ckpt_group, ctx.rank, Path(args.root)
    mem: dict[str, float] = {"start_rss": rss_mb()}

    cfg = model_config(args.gb, args.layers)
    t0 = time.monotonic()
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = TrainState(model, optimizer)
    gen = torch.Generator().manual_seed(1 + rank)

    def train_step() -> float:
        t = time.monotonic()
        x = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
        (model(x, x) / x.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        return time.monotonic() - t

    train_step()  # AdamW state exists from here on
    build_s = time.monotonic() - t0
    opt_tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    shard = {"params": local_bytes(model.parameters()), "optim": local_bytes(opt_tensors)}
    mem["after_build_rss"] = rss_mb()

    train_step()  # the first steps are slower (the allocator grows): not steady
    pool = os.urandom(64 << 20)  # for the raw writes; allocated before any baseline memory reading
    reset_peak()
    steady_steps = [train_step() for _ in range(args.steps_between)]
    mem["steady_peak"], mem["steady_rss"] = peak_mb(), rss_mb()

    ckpt = Checkpointer(root / "ckpt", ctx, async_save=True)
    sd_fn = lambda: state.state_dict(rank, ctx.device)  # noqa: E731
    step_dir = lambda s: root / "ckpt" / store.step_dirname(s)  # noqa: E731
    my_file = f"__{rank}_0.distcp"

    def drop(*paths: Path) -> None:  # rank 0 deletes between measurements, outside the timed parts
        dist.barrier(group=group)
        if rank == 0:
            for p in paths:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        dist.barrier(group=group)

    # ---- sync: the first save, then rounds of [Checkpointer, plain DCP, raw write] in rotating order
    mem["before_sync_rss"] = rss_mb()
    reset_peak()
    first_sync_s = ckpt.save(state.step, sd_fn, sync=True)
    dist.barrier(group=group)  # ranks other than 0 return before rank 0 has committed
    ckpt_bytes = store.inspect(step_dir(state.step)).manifest.total_bytes if rank == 0 else 0
    my_bytes = (step_dir(state.step) / my_file).stat().st_size
    drop(step_dir(state.step))

    def checkpointer(r: dict[str, float], i: int) -> None:
        with PhaseTimer() as timer:
            r["sync_s"] = ckpt.save(state.step, sd_fn, sync=True)
        r.update(timer.seconds)
        dist.barrier(group=group)
        r["state_dict_s"] = timed(sd_fn)  # parts of the save, timed again alone, warm cache
        r["checksum_own_file_s"] = timed(lambda: store.describe_files(step_dir(state.step), [my_file]))
        drop(step_dir(state.step))

    def plain_dcp(r: dict[str, float], i: int) -> None:
        before = serialization_config.save.compute_crc32  # the Checkpointer turned it off: put that back
        for crc32 in (True, False):  # torch.save's zip CRC32 is a full pass over the data
            path = root / f"dcp_only_{i}"
            writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1,
                                      overwrite=True)
            dist.barrier(group=group)
            serialization_config.save.compute_crc32 = crc32
            try:
                r["dcp_only_s" if crc32 else "dcp_no_crc32_s"] = timed(
                    lambda: dcp.save(sd_fn(), storage_writer=writer, process_group=group))  # noqa: B023
            finally:
                serialization_config.save.compute_crc32 = before
            drop(path)

    def raw(r: dict[str, float], i: int) -> None:
        path = root / f"raw_{rank}.bin"
        dist.barrier(group=group)
        r["raw_s"] = timed(lambda: raw_write(path, my_bytes, pool))
        drop(path)

    rounds: list[dict[str, float]] = []
    kinds = [checkpointer, plain_dcp, raw]
    for i in range(args.saves):
        state.step += 1  # a new folder name; the state itself need not change between sync saves
        rounds.append({})
        for measure in kinds[i % 3:] + kinds[:i % 3]:  # rotate the order: no kind always runs first
            measure(rounds[-1], i)
    mem["sync_peak"] = peak_mb()

    # ---- async: save, train, wait
    asyncs: list[dict[str, Any]] = []
    async_peak = 0.0
    for _ in range(args.saves):
        saved = state.step
        reset_peak()
        a: dict[str, Any] = {"blocking_s": ckpt.save(saved, sd_fn, sync=False), "rss_staged": rss_mb()}
        a["steps_s"] = [train_step() for _ in range(args.steps_between)]
        a["wait_s"] = timed(ckpt.wait)
        a["to_commit_s"] = ckpt.last_save_s
        a["peak"] = peak_mb()
        async_peak = max(async_peak, a["peak"])
        drop(step_dir(saved))
        asyncs.append(a)
    mem["async_peak"], mem["after_async_rss"] = async_peak, rss_mb()
    steady_steps += [train_step() for _ in range(args.steps_between)]  # steady again: the load drifts

    mine = {"rank": rank, "params": sum(p.numel() for p in model.parameters()), "config": vars(cfg),
            "shard_bytes": shard, "my_file_bytes": my_bytes, "ckpt_bytes": ckpt_bytes, "build_s": build_s,
            "first_sync_s": first_sync_s, "rounds": rounds, "asyncs": asyncs, "steady_steps_s": steady_steps,
            "mem_mb": mem}
    everyone: list[Any] | None = [None] * ctx.world_size if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=group)
    if rank == 0:
        Path(args.result).write_text(json.dumps(everyone))
    dist.destroy_process_group()


class PhaseTimer:
    """Seconds spent in the calls `Checkpointer._persist` makes, by wrapping them while a sync save runs.

    The top-level calls (begin, barrier, save, describe_files, gather_object, commit) are counted only when
    not nested in another (dcp.save makes its own barriers and gathers); `write_data` (serialise, write,
    fsync) is part of `save`, and `fsync` counts every os.fsync (DCP's, and the store's of marker and folders).
    """

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from supervisor import store
        from train_entry import checkpoint

        top = [(store, "begin"), (dist, "barrier"), (dcp, "save"), (store, "describe_files"),
               (dist, "gather_object"), (store.PartialCheckpoint, "commit")]
        nested = [(checkpoint._Writer, "write_data"), (os, "fsync")]
        self.targets = [(o, n, True) for o, n in top] + [(o, n, False) for o, n in nested]
        self.seconds: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def _wrap(self, owner: Any, name: str, top: bool) -> None:
        fn = owner.__dict__[name]
        key = f"in_{name}_s"

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            counted = not top or self._depth == 0
            self._depth += top
            t = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= top
                if counted:
                    self.seconds[key] = self.seconds.get(key, 0.0) + time.monotonic() - t

        self._saved.append((owner, name, fn))
        setattr(owner, name, timed_call)

    def __enter__(self) -> PhaseTimer:
        for owner, name, top in self.targets:
            self._wrap(owner, name, top)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def timed(fn: Any) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


# --------------------------------------------------------------------------------------------------
# The launcher: runs torchrun, cleans up, reports


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="resilient-bench-ckpt-", dir=args.tmp))
    result = tmp / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "--max-restarts", "0", str(Path(__file__).resolve()), *argv,
           "--worker", "--root", str(tmp), "--result", str(result)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"stopping the job: still running after --timeout {args.timeout:.0f}s", file=sys.stderr)
            return 124
        if rc != 0:
            print(f"torchrun exited {rc}", file=sys.stderr)
            return rc
        ranks = json.loads(result.read_text())
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    out = summarise(ranks, args, time.monotonic() - t0)
    report(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun (it forwards to the ranks), then SIGKILL after a deadline; ranks die with it."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def summarise(ranks: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    r0 = ranks[0]
    med = statistics.median
    # Per save, the slowest rank is what training waits for.
    slowest = lambda rows, key: [max(r[key] for r in per) for per in zip(*rows, strict=True)]  # noqa: E731
    sync_s = slowest([r["rounds"] for r in ranks], "sync_s")
    dcp_s = slowest([r["rounds"] for r in ranks], "dcp_only_s")
    dcp_nocrc_s = slowest([r["rounds"] for r in ranks], "dcp_no_crc32_s")
    raw_s = slowest([r["rounds"] for r in ranks], "raw_s")
    block_s = slowest([r["asyncs"] for r in ranks], "blocking_s")
    commit_s = slowest([r["asyncs"] for r in ranks], "to_commit_s")
    wait_s = slowest([r["asyncs"] for r in ranks], "wait_s")
    ckpt, raw_bytes = r0["ckpt_bytes"], sum(r["my_file_bytes"] for r in ranks)
    state_bytes = sum(sum(r["shard_bytes"].values()) for r in ranks)
    step_steady = med([s for r in ranks for s in r["steady_steps_s"]])
    step_during = med([s for r in ranks for a in r["asyncs"] for s in a["steps_s"]])
    memory = []
    for r in ranks:
        m, shard = r["mem_mb"], sum(r["shard_bytes"].values()) / 2**20
        memory.append({"rank": r["rank"], **{k: round(v) for k, v in m.items()}, "shard_mb": round(shard),
                       "async_increase_mb": round(m["async_peak"] - m["steady_peak"]),
                       "async_increase_over_shard": (m["async_peak"] - m["steady_peak"]) / shard,
                       "sync_increase_mb": round(m["sync_peak"] - m["before_sync_rss"])})
    # What an async save costs the training: its stall, plus the slowdown of the steps that ran beside it
    # (wait() found every save committed when the steps ended, so the whole save overlapped them).
    lost_async = med(block_s) + args.steps_between * (step_during - step_steady) + med(wait_s)
    return {
        "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": wall_s, "params": r0["params"],
        "config": r0["config"], "state_bytes": state_bytes, "checkpoint_bytes": ckpt, "build_s": r0["build_s"],
        "first_sync_s": max(r["first_sync_s"] for r in ranks),
        "sync_s": sync_s, "dcp_only_s": dcp_s, "dcp_no_crc32_s": dcp_nocrc_s, "raw_write_s": raw_s,
        "raw_write_bytes": raw_bytes, "dcp_no_crc32_gb_per_s": ckpt / 1e9 / med(dcp_nocrc_s),
        "async_blocking_s": block_s, "async_to_commit_s": commit_s, "async_wait_after_steps_s": wait_s,
        "sync_gb_per_s": ckpt / 1e9 / med(sync_s), "dcp_only_gb_per_s": ckpt / 1e9 / med(dcp_s),
        "raw_gb_per_s": raw_bytes / 1e9 / med(raw_s),
        "sync_vs_raw": (ckpt / med(sync_s)) / (raw_bytes / med(raw_s)),
        "async_blocking_vs_sync": med(block_s) / med(sync_s),
        "state_dict_s": med(x["state_dict_s"] for r in ranks for x in r["rounds"]),
        "checksum_own_file_s": med(x["checksum_own_file_s"] for r in ranks for x in r["rounds"]),
        "step_s_steady": step_steady, "step_s_during_async": step_during, "memory": memory,
        "training_lost_per_save_s": {"sync": med(sync_s), "async": lost_async},
        "sync_breakdown_s": breakdown(ranks),
    }


PARTS = {"in_begin_s": "store.begin (rank 0: partial folder + lock)", "in_barrier_s": "barrier (folder exists)",
         "in_save_s": "dcp.save", "in_write_data_s": "  of which write_data (serialise + write + fsync)",
         "in_fsync_s": "  fsync calls (DCP's and the store's)", "in_describe_files_s": "checksum own files",
         "in_gather_object_s": "gather records to rank 0", "in_commit_s": "commit (marker, renames, fsyncs)"}
TOP = ("in_begin_s", "in_barrier_s", "in_save_s", "in_describe_files_s", "in_gather_object_s", "in_commit_s")


def breakdown(ranks: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per part of a sync save, each rank's median seconds over the rounds; `other` = total − parts."""
    med = statistics.median
    out = {k: [med(x.get(k, 0.0) for x in r["rounds"]) for r in ranks] for k in PARTS}
    out["total"] = [med(x["sync_s"] for x in r["rounds"]) for r in ranks]
    out["other"] = [med(x["sync_s"] - sum(x.get(k, 0.0) for k in TOP) for x in r["rounds"]) for r in ranks]
    return out


def report(o: dict[str, Any]) -> None:
    gb, med = o["checkpoint_bytes"] / 1e9, statistics.median
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    c = o["config"]
    print(f"\n### Checkpoint saves: {o['params'] / 1e6:.1f}M params (GPT {c['n_layer']}×{c['n_embd']}), "
          f"state {o['state_bytes'] / 1e9:.2f} GB, checkpoint {gb:.2f} GB, 2 ranks CPU/gloo\n")
    print("| measure | median | each save (s) | goal |")
    print("|---|---:|---|---|")
    print(f"| first sync save (cold start) | {o['first_sync_s']:.2f} s | | |")
    print(f"| sync save, blocking | {med(o['sync_s']):.2f} s | {fmt(o['sync_s'])} | |")
    print(f"| async save, blocking | {med(o['async_blocking_s']):.2f} s | {fmt(o['async_blocking_s'])} | |")
    print(f"| async ÷ sync blocking | {o['async_blocking_vs_sync']:.0%} | | ≤ 15% |")
    print(f"| async save, call → commit | {med(o['async_to_commit_s']):.2f} s | {fmt(o['async_to_commit_s'])} | |")
    print(f"| async, wait() left after the steps | {med(o['async_wait_after_steps_s']):.2f} s | "
          f"{fmt(o['async_wait_after_steps_s'])} | |")
    print(f"| sync save throughput | {o['sync_gb_per_s']:.2f} GB/s | | |")
    print(f"| plain dcp.save, same state (no store protocol) | {o['dcp_only_gb_per_s']:.2f} GB/s | "
          f"{fmt(o['dcp_only_s'])} | |")
    print(f"| plain dcp.save, torch.save's CRC32 off | {o['dcp_no_crc32_gb_per_s']:.2f} GB/s | "
          f"{fmt(o['dcp_no_crc32_s'])} | |")
    print(f"| raw write + fdatasync, 2 ranks at once | {o['raw_gb_per_s']:.2f} GB/s | {fmt(o['raw_write_s'])} | |")
    print(f"| sync save ÷ raw write | {o['sync_vs_raw']:.0%} | | ≥ 70% |")
    print(f"| in a sync save: state_dict() | {o['state_dict_s']:.3f} s | | |")
    print(f"| in a sync save: checksum of own file (warm) | {o['checksum_own_file_s']:.3f} s | | |")
    print(f"| training step: steady / during async saves | {o['step_s_steady']:.2f} / "
          f"{o['step_s_during_async']:.2f} s | | |")
    lost = o["training_lost_per_save_s"]
    print(f"| training time lost per save: sync / async (stall + slower steps) | {lost['sync']:.2f} / "
          f"{lost['async']:.2f} s | | |")
    b = o["sync_breakdown_s"]
    print("\n### Where a sync save's time goes (median s per rank, timed by wrapping the calls it makes)\n")
    print("| part | " + " | ".join(f"rank {i}" for i in range(len(b["total"]))) + " |")
    print("|---|" + "---:|" * len(b["total"]))
    for key, label in [*PARTS.items(), ("other", "other (state_dict, Python)"), ("total", "total")]:
        print(f"| {label} | " + " | ".join(f"{x:.2f}" for x in b[key]) + " |")
    print("\n### Host memory per rank (MB; peaks are VmHWM, reset before each phase)\n")
    print("| rank | start RSS | after build | training peak | sync saves: peak (over RSS before) | "
          "async saves + training: peak | RSS after async | shard (params+optim) | async peak − training peak "
          "| ÷ shard |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in o["memory"]:
        print(f"| {m['rank']} | {m['start_rss']} | {m['after_build_rss']} | {m['steady_peak']} | {m['sync_peak']} "
              f"(+{m['sync_increase_mb']}) | {m['async_peak']} | {m['after_async_rss']} | {m['shard_mb']} | "
              f"+{m['async_increase_mb']} | {m['async_increase_over_shard']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="params + AdamW state, GB (1e9 bytes)")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (the width follows from --gb)")
    p.add_argument("--saves", type=int, default=3, help="sync saves, and async saves, to time")
    p.add_argument("--steps-between", type=int, default=2,
                   help="training steps while an async save runs (and steady steps timed before the saves)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per training step")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the job is stopped")
    p.add_argument("--collective-timeout-s", type=float, default=300)
    p.add_argument("--tmp", default=None, help="parent of the temp checkpoint folder (default: the system's)")
    p.add_argument("--out", type=Path, default=RESULTS / "checkpoint_save.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
