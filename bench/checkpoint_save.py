"""Checkpoint saves and loads through the project's own `Checkpointer`, each beside its hardware floor.

    python bench/checkpoint_save.py                       # CPU: 1 GB of state over 2 gloo ranks
    python bench/checkpoint_save.py --device cuda --ranks 1 --gb 2   # one GPU (NCCL), pinned staging

One torchrun job that this script launches itself. Each rank builds an FSDP2 GPT (`train_entry.model`) whose
fp32 parameters + AdamW moments come to `--gb` GB over all ranks, takes a step, then measures, all on the
same bytes (this rank's shard) and in the same run:

- floors: the copy of the rank's tensors into host buffers allocated beforehand (one synchronize on CUDA);
  a raw write of the rank's file's size + fdatasync; a plain sequential read of the rank's checkpoint files
  after evicting them from the page cache (posix_fadvise DONTNEED);
- sync saves (`Checkpointer.save(sync=True)`): seconds and GB/s, ÷ the raw write;
- async saves, training steps running until each commits: the blocking part (the first async save, which
  allocates the arena on CPU — on a device the sync saves before it already did —, and the later ones) ÷ the
  copy floor; call → commit and persist GB/s ÷ the raw write; the
  steps that ran while a save persisted ÷ steady steps;
- loads (`Checkpointer.load` of the same checkpoint, evicted first): GB/s ÷ the plain read;
- host memory: the staging arena, and the RSS after the async saves over the RSS before, against the shard.

Prints a markdown table and writes bench/results/checkpoint_save.json. Timings on a shared machine are
noisy: compare figures from the same run only.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argtypes import folder, positive_float, positive_int

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 64 << 20


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (a process may do this to itself)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache, so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[Path]) -> int:
    buf = bytearray(CHUNK)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def raw_write(path: Path, source: memoryview) -> None:
    with open(path, "wb", buffering=0) as f:
        for start in range(0, len(source), CHUNK):
            f.write(source[start:start + CHUNK])
        os.fdatasync(f.fileno())


def model_config(gb: float, layers: int) -> Any:
    """A GPT whose fp32 params + AdamW moments (12 bytes a parameter) come to about `gb` GB."""
    from train_entry.model import GPTConfig

    vocab, seq = 256, 32
    params = gb * 1e9 / 12
    a, b = 12 * layers, 13 * layers + 2 * vocab + seq + 2  # params ≈ layers·(12 d² + 13 d) + (2 vocab + seq + 2) d
    d = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
    return GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=8, n_embd=max(8, round(d / 8) * 8),
                     dropout=0.0)


@dataclass
class Rank:
    """One rank of a benchmark job: its process group, an FSDP2 GPT of `--gb` with AdamW, a timed step."""

    ctx: Any
    cfg: Any
    model: Any
    state: Any
    train_step: Callable[[], float]
    sync_device: Callable[[], None]


def setup_rank(args: argparse.Namespace) -> Rank:
    import torch
    from torch.distributed.fsdp import fully_shard

    from train_entry import dist as dist_util
    from train_entry.model import GPT
    from train_entry.state import TrainState

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    dist_util.die_with_parent()
    ctx = dist_util.init(args.collective_timeout_s, args.device)
    cfg = model_config(args.gb, args.layers)
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = TrainState(model, optimizer)
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    sync_device = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def train_step() -> float:
        t = time.monotonic()
        x = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen).to(ctx.device)
        (model(x, x) / x.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync_device()
        state.step += 1
        return time.monotonic() - t

    return Rank(ctx, cfg, model, state, train_step, sync_device)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from supervisor import store
    from train_entry.checkpoint import Checkpointer
    from train_entry.staging import _local

    r = setup_rank(args)
    ctx, cfg, model, state, train_step, sync_device = r.ctx, r.cfg, r.model, r.state, r.train_step, r.sync_device
    group, rank, root = ctx.ckpt_group, ctx.rank, Path(args.root)

    for _ in range(3):  # AdamW state exists from the first; the allocator settles over the next
        train_step()
    steady = [train_step() for _ in range(args.steps)]
    sd_fn = lambda: state.state_dict(rank, ctx.device)  # noqa: E731
    tensors = [_local(t) for t in _tensors(sd_fn())]
    shard_bytes = sum(t.numel() * t.element_size() for t in tensors)

    # ---- the copy floor: into host buffers that already exist (pinned on CUDA), one synchronize
    pinned = ctx.device.type == "cuda"
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    copies = []
    for _ in range(3):
        t0 = time.monotonic()
        for h, t in zip(host, tensors, strict=True):
            h.copy_(t.detach(), non_blocking=pinned)
        sync_device()
        copies.append(time.monotonic() - t0)
    del host

    ckpt = Checkpointer(root / "ckpt", ctx, async_save=True)
    step_dir = lambda s: root / "ckpt" / store.step_dirname(s)  # noqa: E731
    my_file = f"__{rank}_0.distcp"

    def barrier() -> None:
        dist.barrier(group=group)

    def someone_persists() -> bool:
        """Agreed on the training group: a rank that saw its save commit a moment before another must not stop
        training while the other takes one more step (each waiting in another collective: a hang)."""
        t = torch.tensor([1 if ckpt._thread is not None and ckpt._thread.is_alive() else 0], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    # ---- sync saves, and the raw write of the same bytes
    syncs, raws = [], []
    for i in range(args.saves):
        state.step += 1
        barrier()
        t0 = time.monotonic()
        ckpt.save(state.step, sd_fn, sync=True)
        barrier()
        syncs.append(time.monotonic() - t0)
        my_bytes = (step_dir(state.step) / my_file).stat().st_size
        source = memoryview(bytearray(os.urandom(1 << 20)) * ((my_bytes >> 20) + 1))[:my_bytes]
        barrier()
        t0 = time.monotonic()
        raw_write(root / f"raw_{rank}_{i}.bin", source)
        barrier()
        raws.append(time.monotonic() - t0)
        (root / f"raw_{rank}_{i}.bin").unlink()
        del source
    ckpt_bytes = store.inspect(step_dir(state.step)).manifest.total_bytes if rank == 0 else 0
    files = sorted(step_dir(state.step).glob("__*_0.distcp"))

    # ---- loads, and the plain read of the same files; both from the disk (evicted first)
    loads, reads, load_parts = [], [], []
    for _ in range(args.saves):
        if rank == 0:
            evict(files)
        barrier()
        t0 = time.monotonic()
        marks: list[float] = []

        def template(keys: set[str], marks: list[float] = marks) -> dict[str, Any]:
            marks.append(time.monotonic())
            out = state.template(rank, keys, world_size=ctx.world_size)
            marks.append(time.monotonic())
            return out

        sd = ckpt.load(step_dir(state.step), template)
        t_read = time.monotonic()
        state.load(sd, rank, ctx.device, 0, world_size=ctx.world_size)
        sync_device()
        barrier()
        loads.append(time.monotonic() - t0)
        load_parts.append({"metadata_s": marks[0] - t0, "template_s": marks[1] - marks[0],
                           "dcp_load_s": t_read - marks[1], "hand_over_s": loads[-1] - (t_read - t0)})
        if rank == 0:
            evict(files)
        barrier()
        t0 = time.monotonic()
        plain_read([f for f in files if f.name == my_file] if args.ranks > 1 else files)
        barrier()
        reads.append(time.monotonic() - t0)

    # ---- async saves: training goes on until each commits
    rss_before = _status_mb("VmRSS")
    asyncs = []
    for _ in range(args.saves):
        state.step += 1
        barrier()
        saved = state.step
        t_call = time.monotonic()
        blocking = ckpt.save(saved, sd_fn, sync=False)
        sampler = _PersistSampler(ckpt._thread, args.sample_ms / 1e3, t_call) if args.sample_ms else None
        during, starts = [], []
        while someone_persists():
            starts.append(round(time.monotonic() - t_call, 4))
            during.append(train_step())
        ckpt.wait()
        asyncs.append({"blocking_s": blocking, "to_commit_s": ckpt.last_save_s, "steps_s": during,
                       "step_starts_s": starts, "persist_samples": sampler.stop() if sampler else {}})
        barrier()
    steady += [train_step() for _ in range(args.steps)]  # steady again: the machine drifts
    mine = {"rank": rank, "params": sum(p.numel() for p in model.parameters()), "config": vars(cfg),
            "shard_bytes": shard_bytes, "ckpt_bytes": ckpt_bytes, "file_bytes": sum(f.stat().st_size for f in files),
            "copy_floor_s": copies, "sync_s": syncs, "raw_write_s": raws, "load_s": loads, "plain_read_s": reads,
            "load_parts": load_parts,
            "asyncs": asyncs, "steady_steps_s": steady, "arena_bytes": ckpt._stager.nbytes,
            "arena_allocations": ckpt._stager.allocations,
            "async_rss_increase_mb": _status_mb("VmRSS") - rss_before}
    everyone: list[Any] | None = [None] * ctx.world_size if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=group)
    if rank == 0:
        Path(args.result).write_text(json.dumps(everyone))
    dist.destroy_process_group()


class _PersistSampler:
    """Where the persist thread is, every `every` seconds: (seconds since the save call, its innermost frames
    of our code and torch's), and each garbage collection meanwhile (its start, generation, seconds, thread).
    With the steps' start times it shows which part of a persist slows which steps."""

    def __init__(self, thread: threading.Thread | None, every: float, t0: float):
        self.samples: list[tuple[float, str]] = []
        self.collections: list[tuple[float, int, float, str]] = []
        self._started: dict[int, float] = {}

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            now = time.monotonic()
            if phase == "start":
                self._started[threading.get_ident()] = now
            elif (began := self._started.pop(threading.get_ident(), None)) is not None:
                self.collections.append((round(began - t0, 4), info["generation"], round(now - began, 4),
                                         threading.current_thread().name))

        self._on_gc = on_gc
        gc.callbacks.append(on_gc)
        self.done = threading.Event()
        self.runner = threading.Thread(target=self._run, args=(thread, every, t0), daemon=True)
        self.runner.start()

    def _run(self, thread: threading.Thread | None, every: float, t0: float) -> None:
        while thread is not None and thread.is_alive() and not self.done.wait(every):
            frame = sys._current_frames().get(thread.ident or -1)
            names = []
            while frame is not None and len(names) < 3:
                names.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            self.samples.append((round(time.monotonic() - t0, 4), " < ".join(names)))

    def stop(self) -> dict[str, list[Any]]:
        self.done.set()
        self.runner.join()
        gc.callbacks.remove(self._on_gc)
        return {"frames": self.samples, "collections": self.collections}


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def summarise(ranks: list[dict[str, Any]], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    med = statistics.median
    slowest = lambda key: [max(vals) for vals in zip(*(r[key] for r in ranks), strict=True)]  # noqa: E731
    state = sum(r["shard_bytes"] for r in ranks)
    ckpt = ranks[0]["ckpt_bytes"]
    copy_s, sync_s, raw_s = slowest("copy_floor_s"), slowest("sync_s"), slowest("raw_write_s")
    load_s, read_s = slowest("load_s"), slowest("plain_read_s")
    blocking = [max(r["asyncs"][i]["blocking_s"] for r in ranks) for i in range(len(ranks[0]["asyncs"]))]
    commit = [max(r["asyncs"][i]["to_commit_s"] for r in ranks) for i in range(len(ranks[0]["asyncs"]))]
    during = [s for r in ranks for a in r["asyncs"] for s in a["steps_s"]]
    # The first step after each save call runs beside the persist's start (planning, on the coordinator the
    # metadata), the others beside its writes: on an H100 the first carried what was slow (0.07-0.29 s against 0.04)
    first = [a["steps_s"][0] for r in ranks for a in r["asyncs"] if a["steps_s"]]
    rest = [s for r in ranks for a in r["asyncs"] for s in a["steps_s"][1:]]
    steady = [s for r in ranks for s in r["steady_steps_s"]]
    later = blocking[1:] or blocking
    return {
        "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(wall_s, 1), "params": ranks[0]["params"],
        "config": ranks[0]["config"], "state_bytes": state, "checkpoint_bytes": ckpt,
        "copy_floor_s": med(copy_s), "raw_write_s": med(raw_s), "raw_write_gb_per_s": ckpt / 1e9 / med(raw_s),
        "sync_save_s": med(sync_s), "sync_gb_per_s": ckpt / 1e9 / med(sync_s), "sync_vs_raw": med(raw_s) / med(sync_s),
        "async_blocking_first_s": blocking[0], "async_blocking_later_s": med(later),
        "async_blocking_vs_copy_floor": med(later) / med(copy_s), "async_to_commit_s": med(commit),
        "persist_gb_per_s": ckpt / 1e9 / med(commit), "persist_vs_raw": med(raw_s) / med(commit),
        "step_s_steady": med(steady), "step_s_while_persisting": med(during) if during else None,
        "steps_while_persisting": len(during) // max(1, len(ranks) * len(commit)),  # per save, per rank
        "step_slowdown_while_persisting": (med(during) / med(steady) - 1) if during else None,
        "step_s_first_after_call": med(first) if first else None, "step_s_later_while_persisting":
            med(rest) if rest else None,
        "load_s": med(load_s), "plain_read_s": med(read_s), "load_vs_plain_read": med(read_s) / med(load_s),
        "load_parts_s": {k: med(max(r["load_parts"][i][k] for r in ranks) for i in range(len(load_s)))
                         for k in ranks[0]["load_parts"][0]},
        "arena_bytes": [r["arena_bytes"] for r in ranks], "arena_allocations": [r["arena_allocations"] for r in ranks],
        "shard_bytes": [r["shard_bytes"] for r in ranks],
        "async_rss_increase_mb": [round(r["async_rss_increase_mb"]) for r in ranks],  # after the saves, at rest
        "raw": {"copy_floor_s": copy_s, "sync_s": sync_s, "raw_write_s": raw_s, "load_s": load_s,
                "plain_read_s": read_s, "async_blocking_s": blocking, "async_to_commit_s": commit,
                # rank 0's: each async save's steps (start since the call, duration) and, with --sample-ms,
                # where its persist thread was
                "rank0_steady_steps_s": ranks[0]["steady_steps_s"],
                "rank0_asyncs": [{k: a[k] for k in ("steps_s", "step_starts_s", "persist_samples")}
                                 for a in ranks[0]["asyncs"]]},
    }


def report(o: dict[str, Any], args: argparse.Namespace) -> None:
    gb = o["checkpoint_bytes"] / 1e9
    c = o["config"]
    print(f"\n### Checkpoints: {o['params'] / 1e6:.1f}M params (GPT {c['n_layer']}×{c['n_embd']}), checkpoint "
          f"{gb:.2f} GB, {args.ranks} rank(s) on {args.device}\n")
    print("| measure | ours | floor (same bytes, same run) | ratio | goal |")
    print("|---|---:|---:|---:|---|")
    print(f"| async save, training blocked: first / later | {o['async_blocking_first_s']:.3f} / "
          f"{o['async_blocking_later_s']:.3f} s | copy into host buffers {o['copy_floor_s']:.3f} s | "
          f"{o['async_blocking_vs_copy_floor']:.2f}× | ≤ 2× |")
    print(f"| async save, call → committed, training meanwhile | {o['async_to_commit_s']:.2f} s "
          f"({o['persist_gb_per_s']:.2f} GB/s) | raw write + fdatasync {o['raw_write_s']:.2f} s "
          f"({o['raw_write_gb_per_s']:.2f} GB/s) | {o['persist_vs_raw']:.2f} | ≥ 0.7 with cores to spare |")
    print(f"| sync save | {o['sync_save_s']:.2f} s ({o['sync_gb_per_s']:.2f} GB/s) | raw write {o['raw_write_s']:.2f}"
          f" s | {o['sync_vs_raw']:.2f} | ≥ 0.7 |")
    slow = o["step_slowdown_while_persisting"]
    print(f"| training step while a save persists / steady | "
          f"{o['step_s_while_persisting'] or 0:.3f} / {o['step_s_steady']:.3f} s ({o['steps_while_persisting']} "
          f"steps per save) | | {'-' if slow is None else f'{slow:+.0%}'} | ≤ +5% |")
    first, later = o["step_s_first_after_call"], o["step_s_later_while_persisting"]
    print(f"| of those, the first after each save call / the later ones (medians) | "
          f"{'-' if first is None else f'{first:.3f}'} / {'-' if later is None else f'{later:.3f}'} s | | | |")
    print(f"| load from disk (page cache evicted) | {o['load_s']:.2f} s | plain sequential read {o['plain_read_s']:.2f}"
          f" s | {o['load_vs_plain_read']:.2f} | ≥ 0.7 |")
    parts = o["load_parts_s"]
    print(f"| load, its parts (slowest rank, median): metadata / template / DCP's read / hand-over | "
          f"{parts['metadata_s']:.3f} / {parts['template_s']:.3f} / {parts['dcp_load_s']:.3f} / "
          f"{parts['hand_over_s']:.3f} s | | | |")
    arena = ", ".join(f"{a / 1e6:.0f}" for a in o["arena_bytes"])
    shard = ", ".join(f"{s / 1e6:.0f}" for s in o["shard_bytes"])
    print(f"| host memory: staging arena per rank (allocations) | {arena} MB ({o['arena_allocations']}) | "
          f"shard {shard} MB | | one copy |")
    print(f"| host memory: RSS after the async saves over before them, per rank | "
          f"{', '.join(str(m) for m in o['async_rss_increase_mb'])} MB | | | |")


def start_job(script: str, args: argparse.Namespace, argv: list[str], tmp: Path,
              extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`script --worker` on `--ranks` ranks under torchrun, writing its result to tmp/result.json."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           "--max-restarts", "0", str(Path(script).resolve()), *argv, "--worker", "--root", str(tmp), *extra,
           "--result", str(tmp / "result.json")]
    # TMPDIR: torchrun without --log-dir leaves a /tmp/torchelastic_* folder per launch; tmp is removed after
    return subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, TMPDIR=str(tmp)))


def wait_job(proc: subprocess.Popen, timeout: float) -> int:
    """The job's exit code, said when it is not 0; 124 when it ran past `timeout` (end_job then stops it)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"stopping the job: still running after --timeout {timeout:.0f}s", file=sys.stderr)
        return 124
    if rc != 0:
        print(f"torchrun exited {rc}", file=sys.stderr)
    return rc


def end_job(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def write_result(out: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="resilient-bench-ckpt-", dir=args.tmp))
    t0 = time.monotonic()
    proc = start_job(__file__, args, argv, tmp)
    try:
        rc = wait_job(proc, args.timeout)
        if rc != 0:
            return rc
        ranks = json.loads((tmp / "result.json").read_text())
    finally:
        end_job(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    out = summarise(ranks, time.monotonic() - t0, args)
    report(out, args)
    write_result(out, args.out)
    return 0


def add_job_args(p: argparse.ArgumentParser, *, timeout: float) -> None:
    """The arguments both benchmarks take: the model, the job, and the worker's hidden ones."""
    p.add_argument("--gb", type=positive_float, default=1.0, help="params + AdamW state over all ranks, GB (1e9 bytes)")
    p.add_argument("--layers", type=positive_int, default=8, help="transformer blocks (the width follows from --gb)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=positive_int, default=5, help="steady training steps timed before and after")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per rank per training step")
    p.add_argument("--ranks", type=positive_int, default=2, help="ranks (one per GPU with --device cuda)")
    p.add_argument("--timeout", type=positive_float, default=timeout, help="seconds before the job is stopped")
    p.add_argument("--collective-timeout-s", type=positive_float, default=300)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)


def require_device(p: argparse.ArgumentParser, device: str) -> None:
    """`--device cuda` where torch sees no GPU: one sentence (the workers' tracebacks buried it)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device here (a CPU build of torch, or no GPU); use --device cpu")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(p, timeout=900)
    p.add_argument("--saves", type=positive_int, default=4, help="sync saves, loads and async saves to time")
    p.add_argument("--tmp", type=folder, default=None,
                   help="parent of the temp checkpoint folder (default: the system's)")
    p.add_argument("--out", type=Path, default=RESULTS / "checkpoint_save.json")
    p.add_argument("--sample-ms", type=float, default=0.0,
                   help="sample where each async save's persist thread is every this many ms (raw JSON: "
                        "persist_samples beside step_starts_s), to see which part of a persist slows the steps")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    require_device(p, args.device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: launch's finally ends the job
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
