"""The two checkpoint tiers measured against each other in one run: a node-local tier on tmpfs, replicated by the
supervisor's `Replicator`, against saving straight to the durable tier (`checkpoint.dir` on this machine's disk).

    python bench/tiers.py                       # CPU: 1 GB of state over 2 gloo ranks, local tier in /dev/shm
    python bench/tiers.py --gb 2 --saves 6 --local-tier /mnt/nvme --tmp /shared/fs   # a cluster node
    sudo python bench/tiers.py --every 2 --durable-mbps 200     # the durable tier slower than the interval

One torchrun job that this script launches itself, and a `Replicator` in this (torch-free) process, as the
supervisor runs it: it copies each checkpoint the ranks commit to the local tier into the durable tier, verified
against the manifest. Each rank builds an FSDP2 GPT (`train_entry.model`) whose fp32 parameters + AdamW moments
come to `--gb` GB over all ranks, then alternates saves to the two tiers, training all the while:

- training-visible cost of one save (the local tier's from its third save on, when every save writes over the
  files of one that retention deleted; its first saves, into fresh pages, on a line of their own): the blocking
  part plus the extra time of the steps that ran beside it (their time over the steady step's mean, each step
  taken at its slowest rank), counted twice: until the ranks' commit (the issue's measure: the steps beside the
  persist), and until the save's work is over, i.e. for a save to the local tier until its durable copy is
  committed too (the replication's share of the machine counted against it);
- replication lag: local commit → durable commit, seconds and the steps trained meanwhile. A replaced node loses
  at most one interval plus these steps (tests/test_tiers_e2e.py shows it with a real node loss);
- relaunch load of the same checkpoint from each tier, with the page cache dropped before the durable read
  (`/proc/sys/vm/drop_caches` as root; else posix_fadvise DONTNEED on the files, and the report says so);
- replication throughput: the `Replicator` copying one checkpoint (idle machine) against a plain copy of the same
  files (read, write, fsync each), and the bytes/second it achieved beside training;
- sustained saves (`--sustained N --every K`): N saves per tier, one every K steps, training throughout; the
  window's time over its steps' steady time, per save, is what the saves cost training, whatever waited for what.
  With `--durable-mbps M` (root, cgroup v1 blkio) the durable tier's disk takes writes at M MB/s during this
  phase, as a shared filesystem slower than this machine's disk would: a direct save then waits for its
  predecessor's persist whenever the interval is shorter than the persist; a local save does not, and the
  replicator copies the newest local checkpoint, skipping those it supersedes (the report counts how many of the
  window's saves reached the durable tier).

Prints a markdown table and writes bench/results/tiers.json. Timings on a shared machine are noisy: compare
figures from the same run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from argtypes import count, folder, positive_int
from checkpoint_save import (
    add_job_args,
    end_job,
    evict,
    require_device,
    setup_rank,
    start_job,
    wait_job,
    write_result,
)

from supervisor import store

RESULTS = Path(__file__).resolve().parent / "results"
NODE = "bench"


def drop_page_cache(files: list[Path]) -> str:
    """Drop the page cache: the whole of it when this process may (root), else these files' pages."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        evict(files)
        return "fadvise"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from train_entry.checkpoint import Checkpointer

    r = setup_rank(args)
    ctx, model, state, train_step, sync_device = r.ctx, r.model, r.state, r.train_step, r.sync_device
    group, rank = ctx.ckpt_group, ctx.rank
    direct_root, durable, local = Path(args.root) / "direct", Path(args.root) / "durable", Path(args.local_root)

    def everyone_agrees(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the training group: the save's thread uses the checkpoint one
        return bool(t.item())

    def durable_copy(step: int) -> bool:
        final = durable / store.step_dirname(step)
        return final.is_dir() and store.inspect(final).valid

    direct = Checkpointer(direct_root, ctx, async_save=True)
    tiered = Checkpointer(local, ctx, async_save=True, durable_root=durable, node=NODE)
    sd_fn = lambda: state.state_dict(rank, ctx.device)  # noqa: E731

    def one_save(ckpt: Checkpointer, replicated: bool) -> dict[str, Any]:
        """One async save, training until its work is over (committed; and copied to durable, if tiered)."""
        state.step += 1
        dist.barrier(group=group)
        saved = state.step
        t0 = time.monotonic()
        blocking = ckpt.save(saved, sd_fn, sync=False)
        during, committed_at = [], None
        while True:  # every rank takes the same branches: each decision is agreed
            if committed_at is None and everyone_agrees(ckpt._thread is None or not ckpt._thread.is_alive()):
                committed_at, steps_at_commit = time.monotonic(), len(during)
            if committed_at is not None and everyone_agrees(not replicated or durable_copy(saved)):
                break
            during.append(train_step())
        ckpt.wait()
        done = time.monotonic()
        return {"step": saved, "blocking_s": blocking, "steps_s": during, "to_commit_s": committed_at - t0,
                "lag_s": done - committed_at, "lag_steps": len(during) - steps_at_commit,
                "marker_lag_s": marker_lag(saved) if replicated else 0.0}

    def marker_lag(step: int) -> float:
        """Local commit → durable commit by the two markers' times: the loop above sees both only between steps."""
        made = [store.inspect(root / store.step_dirname(step)).created_at for root in (local, durable)]
        return made[1] - made[0] if None not in made else float("nan")

    for _ in range(3):  # AdamW state exists from the first; the allocator settles over the next
        train_step()
    steady = [train_step() for _ in range(args.steps)]
    one_save(direct, False)  # each checkpointer allocates its staging arena on its first save: not counted
    # The local tier's first saves take fresh pages; once retention deletes one (keep_local 2: after the third
    # save), every later save writes over its files (store.keep_spare). Those first saves are reported apart.
    first = [one_save(tiered, True) for _ in range(3)][1:]
    saves: dict[str, list[dict[str, Any]]] = {"direct": [], "tiered": [], "tiered_first": first}
    for _ in range(args.saves):  # alternated, so both see the same drift of a shared machine
        saves["direct"].append(one_save(direct, False))
        saves["tiered"].append(one_save(tiered, True))
    steady += [train_step() for _ in range(args.steps)]

    # ---- loads of the same checkpoint (the last tiered save) from each tier, the durable one from a cold cache
    step = saves["tiered"][-1]["step"]
    paths = {"local": local / store.step_dirname(step), "durable": durable / store.step_dirname(step)}
    loads: dict[str, list[float]] = {"local": [], "durable": []}
    how = None
    for _ in range(args.loads):
        for tier, path in paths.items():
            if tier == "durable" and ctx.local_rank == 0:
                how = drop_page_cache(sorted(path.glob("*")))
            dist.barrier(group=group)
            t0 = time.monotonic()
            sd = tiered.load(path, lambda keys: state.template(rank, keys, world_size=ctx.world_size))
            state.load(sd, rank, ctx.device, 0, world_size=ctx.world_size)
            sync_device()
            dist.barrier(group=group)
            loads[tier].append(time.monotonic() - t0)
    # ---- sustained saves, one every `--every` steps, the durable tier's writes throttled to `--durable-mbps`
    def throttle(bps: int) -> None:
        if rank == 0 and args.throttle:
            limits, dev = args.throttle.split("|")
            Path(limits).write_text(f"{dev} {bps}\n")
        dist.barrier(group=group)

    def sustained(ckpt: Checkpointer) -> dict[str, Any]:
        """`--sustained` saves at a fixed interval, training throughout: the window's time over its steps' steady
        time is what the saves cost training, whatever waited for what (a direct save waits for its predecessor's
        persist when the durable tier is slower than the interval). The last save's persist is left out."""
        dist.barrier(group=group)
        first, blocking, steps = state.step + 1, [], []
        t0 = time.monotonic()
        for _ in range(args.sustained):
            state.step += 1
            blocking.append(ckpt.save(state.step, sd_fn, sync=False))
            steps += [train_step() for _ in range(args.every)]
        wall = time.monotonic() - t0
        ckpt.wait()
        return {"wall_s": wall, "blocking_s": blocking, "steps_s": steps, "first_step": first}

    phases: dict[str, Any] = {}
    if args.sustained:
        throttle(args.durable_bps)
        try:
            phases["direct"] = sustained(direct)
            phases["tiered"] = sustained(tiered)
            last = state.step - args.every
            # What reached the durable tier from the tiered window, when its last save's copy is in (or 600 s).
            since = time.monotonic()
            while not everyone_agrees(durable_copy(last) or time.monotonic() > since + 600):
                time.sleep(0.5)
            first = phases["tiered"]["first_step"]
            phases["tiered"]["durable_steps"] = [i.step for i in store.scan(durable) if i.valid and i.step >= first]
            phases["tiered"]["drained_s"] = time.monotonic() - since
        finally:
            throttle(0)
    mine = {"rank": rank, "params": sum(p.numel() for p in model.parameters()), "config": vars(r.cfg),
            "steady_steps_s": steady, "saves": saves, "loads": loads, "cache_drop": how, "sustained": phases,
            "checkpoint_bytes": store.inspect(paths["durable"]).manifest.total_bytes}
    gathered: list[Any] | None = [None] * ctx.world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


# ---- this process: the replicator beside the job, then the idle copy comparison ------------------------------


def replicate_beside(local: Path, durable: Path, stop: threading.Event, keep: int) -> Any:
    """The supervisor's part: a Replicator told of every checkpoint the ranks commit to the local tier."""
    from supervisor.replicate import Replicator

    rep = Replicator(local, durable, NODE, keep_local=2, keep=keep, outage_s=3600,
                     announce=lambda text, style: None)
    rep.start()

    def watch() -> None:
        told: set[int] = set()
        while not stop.wait(0.05):
            for path in store.checkpoint_dirs(local) if local.is_dir() else []:
                info = store.inspect(path)
                if info.valid and info.step not in told:
                    told.add(info.step)
                    rep.notify(info.step)

    threading.Thread(target=watch, daemon=True).start()
    return rep


def plain_copy(src: Path, dest: Path) -> int:
    dest.mkdir(parents=True)
    total = 0
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        with open(f, "rb") as fin, open(dest / f.name, "wb") as fout:
            shutil.copyfileobj(fin, fout, 8 << 20)
            fout.flush()
            os.fsync(fout.fileno())
            total += fout.tell()
    return total


def replication_vs_copy(local: Path, scratch: Path, trials: int) -> dict[str, Any]:
    """The Replicator's copy of the newest local checkpoint into an empty durable tier, against a plain copy."""
    from supervisor.replicate import Replicator

    newest = store.latest_valid(local)
    assert newest is not None, f"no valid checkpoint in {local}"
    nbytes = newest.manifest.total_bytes
    rep_s, copy_s = [], []
    def replicate(i: int) -> None:
        dest = scratch / f"durable-{i}"
        dest.mkdir(parents=True)
        rep = Replicator(local, dest, NODE, keep_local=99, keep=99, outage_s=3600, announce=lambda t, s: None)
        os.sync()
        t0 = time.monotonic()
        rep._replicate(newest.step)  # what the replication thread runs for one step: copy, verify, commit
        rep_s.append(time.monotonic() - t0)
        assert store.inspect(dest / store.step_dirname(newest.step), deep=True).valid
        shutil.rmtree(dest)

    def copy(i: int) -> None:
        os.sync()
        t0 = time.monotonic()
        plain_copy(local / store.step_dirname(newest.step), scratch / f"copy-{i}")
        copy_s.append(time.monotonic() - t0)
        shutil.rmtree(scratch / f"copy-{i}")

    for i in range(trials):  # alternating which goes first: the VM's disk is cached by its host, and drifts
        for run in (replicate, copy) if i % 2 == 0 else (copy, replicate):
            run(i)
    return {"bytes": nbytes, "replicate_s": rep_s, "plain_copy_s": copy_s}


def summarise(ranks: list[dict[str, Any]], rep: dict[str, Any], beside: dict[str, Any], wall_s: float,
              args: argparse.Namespace) -> dict[str, Any]:
    med = statistics.median
    # The baseline a window of steps is compared with: the same statistic (each step's slowest rank), averaged.
    # A median would sit below the mean of any right-skewed step time, and charge every window that bias once
    # per step: the local tier's longer windows (persist, then replication) the most.
    steady = statistics.fmean(max(v) for v in zip(*(r["steady_steps_s"] for r in ranks), strict=True))

    def arm(name: str) -> dict[str, Any]:
        per = []
        for i in range(len(ranks[0]["saves"][name])):
            each = [r["saves"][name][i] for r in ranks]
            slowest_steps = [max(v) for v in zip(*(e["steps_s"] for e in each), strict=True)]
            extra = sum(slowest_steps) - steady * len(slowest_steps)
            persisting = slowest_steps[:len(slowest_steps) - each[0]["lag_steps"]]  # until the rank's commit
            persist_extra = sum(persisting) - steady * len(persisting)
            blocking = max(e["blocking_s"] for e in each)
            per.append({"blocking_s": blocking, "steps_extra_s": extra, "cost_s": blocking + extra,
                        "persist_extra_s": persist_extra, "persist_cost_s": blocking + persist_extra,
                        "steps": len(slowest_steps), "to_commit_s": max(e["to_commit_s"] for e in each),
                        "lag_s": max(e["lag_s"] for e in each), "lag_steps": max(e["lag_steps"] for e in each),
                        "marker_lag_s": each[0]["marker_lag_s"]})
        return {k: med(p[k] for p in per) for k in per[0]} | {"each": per}

    def window(name: str) -> dict[str, Any] | None:
        if not ranks[0]["sustained"]:
            return None
        each = [r["sustained"][name] for r in ranks]
        n = len(each[0]["blocking_s"])
        wall = max(e["wall_s"] for e in each)
        steps = len(each[0]["steps_s"])
        blocking = [max(v) for v in zip(*(e["blocking_s"] for e in each), strict=True)]
        return {"saves": n, "steps": steps, "wall_s": wall, "cost_s": (wall - steady * steps) / n,
                "blocking_s": med(blocking), "blocking_each_s": blocking,
                "durable_steps": each[0].get("durable_steps"), "drained_s": each[0].get("drained_s")}

    sustained = {"direct": window("direct"), "tiered": window("tiered")}
    if sustained["direct"]:  # a cost at or below 0 is lost in the steps' own spread: no ratio to take of it
        d_cost = sustained["direct"]["cost_s"]
        sustained["cost_ratio"] = sustained["tiered"]["cost_s"] / d_cost if d_cost > 0 else None
    direct, tiered, first = arm("direct"), arm("tiered"), arm("tiered_first")
    loads = {t: [max(v) for v in zip(*(r["loads"][t] for r in ranks), strict=True)] for t in ("local", "durable")}
    gb = rep["bytes"] / 1e9
    return {
        "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(wall_s, 1), "params": ranks[0]["params"],
        "config": ranks[0]["config"], "checkpoint_bytes": ranks[0]["checkpoint_bytes"], "step_s_steady": steady,
        "direct": direct, "tiered": tiered, "tiered_first": first, "cost_ratio": tiered["cost_s"] / direct["cost_s"],
        "first_cost_ratio": first["persist_cost_s"] / direct["persist_cost_s"],
        "persist_cost_ratio": tiered["persist_cost_s"] / direct["persist_cost_s"],
        "load_local_s": med(loads["local"]), "load_durable_s": med(loads["durable"]),
        "load_speedup": med(loads["durable"]) / med(loads["local"]), "cache_drop": ranks[0]["cache_drop"],
        "replicate_s": med(rep["replicate_s"]), "plain_copy_s": med(rep["plain_copy_s"]),
        "replicate_gb_per_s": gb / med(rep["replicate_s"]), "plain_copy_gb_per_s": gb / med(rep["plain_copy_s"]),
        "replicate_vs_copy": med(rep["plain_copy_s"]) / med(rep["replicate_s"]),
        "beside_training_gb_per_s": beside["bytes_copied"] / 1e9 / max(1e-9, beside["seconds_copying"]),
        "sustained": sustained,
        "raw": {"loads": loads, "replication": rep, "replicator_beside_training": beside},
    }


def _cost(seconds: float) -> str:
    """A window's cost per save; below 0 the saves cost less than the steps' own spread (a tiny model)."""
    return f"{seconds:.3f} s" if seconds >= 0 else f"≈0 s (within the steps' spread: {seconds:.3f} s)"


def report(o: dict[str, Any], args: argparse.Namespace) -> None:
    c, d, t = o["config"], o["direct"], o["tiered"]
    print(f"\n### Tiers: {o['params'] / 1e6:.1f}M params (GPT {c['n_layer']}×{c['n_embd']}), checkpoint "
          f"{o['checkpoint_bytes'] / 1e9:.2f} GB, {args.ranks} rank(s) on {args.device}; local tier {args.local_tier}, "
          f"durable tier {args.tmp or tempfile.gettempdir()}\n")
    print("| measure | local tier (then replicated) | straight to durable | ratio | goal |")
    print("|---|---:|---:|---:|---|")
    print(f"| training-visible cost of a save: blocking + extra step time beside its persist (the issue's measure)"
          f" | {t['persist_cost_s']:.3f} s ({t['blocking_s']:.3f} + {t['persist_extra_s']:.3f}) | "
          f"{d['persist_cost_s']:.3f} s ({d['blocking_s']:.3f} + {d['persist_extra_s']:.3f}) | "
          f"{o['persist_cost_ratio']:.2f} | ≤ 0.33 |")
    print(f"| the same, counted until the durable copy is committed (the replication's share too) | "
          f"{t['cost_s']:.3f} s ({t['blocking_s']:.3f} + {t['steps_extra_s']:.3f}) | {d['cost_s']:.3f} s "
          f"({d['blocking_s']:.3f} + {d['steps_extra_s']:.3f}) | {o['cost_ratio']:.2f} | ≤ 0.33 |")
    f = o["tiered_first"]
    print(f"| the same for the local tier's first saves, into fresh pages (before retention frees files to write "
          f"over) | {f['persist_cost_s']:.3f} s ({f['blocking_s']:.3f} + {f['persist_extra_s']:.3f}) | "
          f"{d['persist_cost_s']:.3f} s | {o['first_cost_ratio']:.2f} | |")
    print(f"| steps beside a save (persist, + replication for the local tier) | {t['steps']:.0f} | {d['steps']:.0f}"
          f" | | steady step {o['step_s_steady']:.3f} s |")
    print(f"| save call → committed (local / durable) | {t['to_commit_s']:.2f} s | {d['to_commit_s']:.2f} s | "
          f"{t['to_commit_s'] / d['to_commit_s']:.2f} | |")
    print(f"| replication lag: local commit → durable commit (markers' times; the steps trained meanwhile) | "
          f"{t['marker_lag_s']:.2f} s, {t['lag_steps']:.0f} steps | | |"
          " a replaced node loses ≤ interval + lag |")
    cold = "page cache dropped" if o["cache_drop"] == "drop_caches" else "files evicted with fadvise"
    print(f"| relaunch load of the same checkpoint | {o['load_local_s']:.2f} s (tmpfs) | {o['load_durable_s']:.2f} s "
          f"({cold}) | {o['load_speedup']:.1f}× faster | ≥ 3× |")
    print(f"| replication of one checkpoint, idle machine / plain copy (read, write, fsync) | "
          f"{o['replicate_s']:.2f} s ({o['replicate_gb_per_s']:.2f} GB/s) | {o['plain_copy_s']:.2f} s "
          f"({o['plain_copy_gb_per_s']:.2f} GB/s) | {o['replicate_vs_copy']:.2f} | ≥ 0.7 |")
    throttled = " (the throttled sustained phase included)" if args.durable_mbps and args.sustained else ""
    print(f"| replication beside training{throttled} | {o['beside_training_gb_per_s']:.2f} GB/s | | | |")
    sd, st = o["sustained"]["direct"], o["sustained"]["tiered"]
    if sd:
        disk = f"durable tier's writes throttled to {args.durable_mbps:g} MB/s" if args.durable_mbps else \
            "durable tier unthrottled"
        ratio = o["sustained"]["cost_ratio"]
        print(f"| sustained: {sd['saves']} saves per tier, one every {args.every} step(s), {disk}: training-visible "
              f"cost per save (the window over its steps' steady time) | {_cost(st['cost_s'])} | "
              f"{_cost(sd['cost_s'])} | {'-' if ratio is None else f'{ratio:.2f}'} | ≤ 0.33 |")
        print(f"| sustained: training blocked per save, median (a direct save waits for its predecessor's persist) |"
              f" {st['blocking_s']:.3f} s | {sd['blocking_s']:.3f} s | | |")
        durable = st["durable_steps"] or []
        print(f"| sustained: the window's saves that reached the durable tier (newest first; the rest superseded) | "
              f"{len(durable)} of {st['saves']}, the last {st['drained_s']:.1f} s after its local commit | "
              f"{sd['saves']} of {sd['saves']} | | |")


BLKIO = Path("/sys/fs/cgroup/blkio")


def join_throttle_group(tmp: Path) -> tuple[Path, str]:
    """A cgroup (v1 blkio) that this process joins before it starts the job and the replicator, so that their
    O_DIRECT writes to `tmp`'s disk can be throttled (the workers set the limit for the sustained phase: a durable
    tier slower than this machine's disk, as a shared filesystem is). Returns (its limits file, the device)."""
    limits = BLKIO / "blkio.throttle.write_bps_device"
    if not limits.exists():
        raise SystemExit(f"--durable-mbps needs cgroup v1's blkio controller ({limits} is missing)")
    st = os.stat(tmp)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    group = BLKIO / f"resilient-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / "blkio.throttle.write_bps_device").write_text(f"{dev} 0\n")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        leave_throttle_group(group)
        raise SystemExit(f"--durable-mbps: cannot throttle writes to {tmp} (device {dev}) in {group}: {e.strerror} "
                         "(it needs root, and a whole disk, not a partition)") from None
    return group / "blkio.throttle.write_bps_device", dev


def leave_throttle_group(group: Path) -> None:
    with contextlib.suppress(OSError):
        (BLKIO / "cgroup.procs").write_text(str(os.getpid()))
    deadline = time.monotonic() + 30
    while group.exists():  # empty once the job's processes are gone (the killed ranks may take a moment)
        try:
            group.rmdir()
        except OSError as e:
            if time.monotonic() > deadline:
                print(f"could not remove the cgroup {group}: {e.strerror}; remove it by hand", file=sys.stderr)
                return
            time.sleep(0.2)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="resilient-bench-tiers-", dir=args.tmp))
    local = Path(tempfile.mkdtemp(prefix="resilient-bench-local-", dir=args.local_tier))
    stop = threading.Event()
    t0 = time.monotonic()
    extra = ("--local-root", str(local / "local"))
    group, proc = None, None
    try:
        if args.durable_mbps:
            if os.stat(tmp).st_dev == os.stat(local).st_dev:
                raise SystemExit(f"--durable-mbps: the local tier ({args.local_tier}) is on the durable tier's "
                                 "device: the throttle would slow both")
            limits, dev = join_throttle_group(tmp)
            group = limits.parent
            extra += ("--throttle", f"{limits}|{dev}")
        proc = start_job(__file__, args, argv, tmp, extra)
        rep = replicate_beside(local / "local", tmp / "durable", stop, keep=2 * (args.saves + args.sustained) + 8)
        try:
            rc = wait_job(proc, args.timeout)
        finally:
            stop.set()
            rep.drain(30)
            rep.stop()
        if rc != 0:
            return rc
        wall = time.monotonic() - t0
        ranks = json.loads((tmp / "result.json").read_text())
        beside = rep.snapshot()
        idle = replication_vs_copy(local / "local", tmp / "scratch", args.copies)
    finally:
        if proc is not None:
            end_job(proc)
        if group is not None:
            leave_throttle_group(group)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    out = summarise(ranks, idle, beside, wall, args)
    report(out, args)
    write_result(out, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(p, timeout=1200)
    p.add_argument("--saves", type=positive_int, default=4, help="timed saves per tier (after one untimed each)")
    p.add_argument("--loads", type=positive_int, default=3, help="timed loads per tier")
    p.add_argument("--copies", type=positive_int, default=6,
                   help="replications and plain copies of one checkpoint, idle")
    # Not `--local`: torchrun (2.11) reads an abbreviation of its own --local-addr in the worker's arguments
    p.add_argument("--local-tier", type=folder, default="/dev/shm",
                   help="parent of the local tier (default: /dev/shm, tmpfs)")
    p.add_argument("--tmp", type=folder, default=None,
                   help="parent of the durable tier (default: the system's temp folder)")
    p.add_argument("--sustained", type=count, default=6,
                   help="saves per tier at a fixed interval, training throughout (0: none)")
    p.add_argument("--every", type=positive_int, default=1, help="training steps between the sustained saves")
    p.add_argument("--durable-mbps", type=float, default=0.0,
                   help="during the sustained saves, throttle writes to the durable tier's disk to this many MB/s "
                        "(cgroup v1 blkio, as root): a shared filesystem slower than this machine's disk")
    p.add_argument("--out", type=Path, default=RESULTS / "tiers.json")
    p.add_argument("--local-root", help=argparse.SUPPRESS)
    p.add_argument("--throttle", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.durable_bps = int(args.durable_mbps * 1e6)
    if args.worker:
        worker(args)
        return 0
    require_device(p, args.device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: launch's finally ends the job
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
