"""The kill campaign: SIGKILL a rank at random moments inside saves, again and again, and check after every
relaunch that no partial checkpoint was ever accepted, no committed one was lost, and the relaunch resumed
from the newest whole one.

    python bench/kill_campaign.py [--kills 100] [--mode async|sync|local|both|all]

One `resilient run` per mode (a GPT of ~3M parameters on 2 CPU ranks, a checkpoint every 4 steps, async or
sync saves, `keep: 3`; `local`: async saves into a node-local tier that the supervisor replicates to the
durable one, `keep_local: 3`), with the restart budget and crash-loop guard out of the way. A kill: wait for a new
save to begin (its `.partial` folder appears), wait a random fraction of a save's duration, SIGKILL a random
rank (saves in the training thread and in the background thread both run inside the rank: the writer is
the rank). Then, once the supervisor's next attempt trains:
- accepted but not whole: a folder that passes the supervisor's own check (`verify: size`, small files
  checksummed) but fails a full checksum read, in either tier — must be 0;
- committed then lost: a checkpoint whose commit the step log recorded, among the `keep` newest, that is
  not valid now — must be 0;
- wrong resume: the relaunch did not resume from the newest checkpoint that is whole (full check) when it
  started — must be 0.
Writes bench/results/kill_campaign.json and prints the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor import store  # noqa: E402
from supervisor.protocol import CommitRecord, read_step_log  # noqa: E402

KEEP = 3


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return {k: v for k, v in e.items() if not k.startswith("RESILIENT_")}


def state(run_dir: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / "state.json").read_text())
    return {}


def wait_for(pred, timeout: float, what: str, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(interval)
    raise TimeoutError(f"waiting for {what}")


def resumed_said(s: dict) -> bool:
    """The ranks of the newest attempt said what they resumed from (a tier), or train having found nothing."""
    last = s["history"][-1]
    training = any(r.get("alive") and r.get("phase") == "train" for r in s.get("ranks", []))
    return bool(last.get("resumed_tier")) or (last.get("resumed_from_step") is None and training)


def committed(run_dir: Path) -> set[int]:
    steps = set()
    for log in (run_dir / "steps").glob("attempt_*.jsonl"):
        steps |= {r.step for r in read_step_log(log) if isinstance(r, CommitRecord)}
    return steps


def campaign(mode: str, kills: int, rng: random.Random, tmp: Path) -> dict:
    run_dir, durable = tmp / f"run-{mode}", tmp / f"run-{mode}" / "checkpoints"
    root = tmp / f"local-{mode}" if mode == "local" else durable  # where the ranks save
    entry = ["--steps", "1000000", "--device", "cpu", "--n-layer", "4", "--n-embd", "256", "--n-head", "4",
             "--batch", "8"]
    argv = [sys.executable, "-m", "supervisor", "run", str(REPO / "jobs" / "tiny-cpu.yaml"), "--run-dir", str(run_dir),
            "--set", f"entrypoint.args={json.dumps(entry)}", "--set", "checkpoint.interval_steps=4",
            "--set", f"checkpoint.keep={KEEP}", "--set", f"checkpoint.async={'true' if mode == 'async' else 'false'}",
            "--set", "restart.max_restarts=100000", "--set", "restart.crash_loop_attempts=100000",
            "--set", "restart.backoff_s=0", "--set", "heartbeat.interval_s=0.2"]
    if mode == "local":
        argv += ["--set", f"checkpoint.local_dir={root}", "--set", f"checkpoint.keep_local={KEEP}"]
    out = {"mode": mode, "kills": 0, "inside_a_save": 0, "accepted_not_whole": 0, "committed_lost": 0,
           "wrong_resume": 0, "relaunches_checked": 0, "save_s": None, "problems": []}
    log = open(tmp / f"supervisor-{mode}.log", "wb")  # noqa: SIM115
    sup = subprocess.Popen(argv, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    save_s = 0.3
    try:
        try:
            for _ in range(kills):
                attempt = wait_for(lambda: (s := state(run_dir)).get("state") == "running" and len(
                    [r for r in s.get("ranks", []) if r.get("alive")]) == 2 and s.get("attempt"), 120, "training")
                ranks = [r for r in state(run_dir).get("ranks", []) if r.get("alive")]
                before = {p.name for p in root.iterdir()} if root.is_dir() else set()
                partial = wait_for(lambda b=before: next((p for p in root.iterdir() if p.name.endswith(".partial")
                                                          and p.name not in b), None) if root.is_dir() else None,
                                   120, "a save to begin")
                t_begin = time.monotonic()
                time.sleep(rng.uniform(0, save_s))
                victim = rng.choice(ranks)
                inside = partial.exists()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim["pid"], signal.SIGKILL)
                out["kills"] += 1
                out["inside_a_save"] += inside
                if not inside:  # the save committed before the kill landed: how long saves take, roughly
                    save_s = max(0.05, 0.8 * save_s + 0.2 * (time.monotonic() - t_begin))
                commits_before = committed(run_dir)
                # The next attempt: wait until it trains, then judge what it resumed from.
                # With a local tier the launch records the durable choice; the ranks' own (either tier) replaces it
                # once they report, with the tier they read: wait for that.
                wait_for(lambda a=attempt: (s := state(run_dir)).get("attempt", 0) > a and s.get("state") == "running"
                         and len(s["history"]) > a and (mode != "local" or resumed_said(s)), 120, "the relaunch")
                launched = state(run_dir)["history"][-1]
                infos = {i.step: i for i in store.scan(root)}
                deep = {step: store.inspect(i.path, deep=True) for step, i in infos.items() if i.valid}
                bad = [s for s, d in deep.items() if not d.valid]
                if root != durable:  # the durable copies: each was verified as it was copied, and must read whole
                    bad += [i.step for i in store.scan(durable)
                            if i.valid and not store.inspect(i.path, deep=True).valid]
                out["accepted_not_whole"] += len(bad)
                out["problems"] += [f"step {s} passes the size check but not a full read" for s in bad]
                newest = max(commits_before, default=None)  # retention keeps it until KEEP newer ones exist
                if newest is not None and not (newest in infos and infos[newest].valid) and \
                        sum(1 for st, i in infos.items() if i.valid and st > newest) < KEEP:
                    out["committed_lost"] += 1
                    out["problems"].append(f"committed step {newest} is gone or invalid")
                resumed = launched["resumed_from_step"]
                started = launched["started_at"]
                whole_then = [st for st, d in deep.items() if d.valid and d.created_at and d.created_at < started]
                expected = max(whole_then, default=None)
                if resumed != expected and (resumed is None or resumed in infos):  # else retention took it since
                    out["wrong_resume"] += 1
                    out["problems"].append(f"attempt {launched['attempt']} resumed from {resumed}, newest whole was "
                                           f"{expected}")
                out["relaunches_checked"] += 1
                if out["kills"] % 20 == 0:
                    print(f"{mode}: {out['kills']} kills, {out['inside_a_save']} inside a save, problems "
                          f"{len(out['problems'])}", flush=True)
        except TimeoutError as e:  # a campaign that stalls is a finding: say where, with the supervisor's last words
            log.flush()
            tail = (tmp / f"supervisor-{mode}.log").read_text(errors="replace")[-5000:]
            out["problems"].append(f"after {out['kills']} kills: {e}")
            print(f"{mode}: {e} after {out['kills']} kills; the supervisor's log ends:\n{tail}", flush=True)
            s = state(run_dir)
            print(json.dumps({k: s.get(k) for k in ("state", "attempt", "ranks", "last_failure")}, default=str)[:3000],
                  json.dumps(s.get("history", [])[-2:], default=str)[:3000], flush=True)
    finally:
        seen = []
        with contextlib.suppress(psutil.Error):
            seen = [psutil.Process(sup.pid), *psutil.Process(sup.pid).children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sup.pid, signal.SIGKILL)
        for p in seen:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(seen, timeout=10)
        log.close()
    out["save_s"] = round(save_s, 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=100, help="kills per mode")
    p.add_argument("--mode", choices=("async", "sync", "local", "both", "all"), default="both")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep the run dirs and logs (printed) for a post-mortem")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kill_campaign.json")
    args = p.parse_args()
    if args.kills < 1:  # 0 kills printed all-zero counts, which read as a pass
        p.error("--kills must be ≥ 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: each mode's finally ends its supervisor
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}", flush=True)
    results = []
    keep = contextlib.nullcontext(tempfile.mkdtemp(prefix="resilient-kills-")) if args.keep else None
    with keep or tempfile.TemporaryDirectory(prefix="resilient-kills-") as tmp:
        modes = {"both": ("async", "sync"), "all": ("async", "sync", "local")}.get(args.mode, (args.mode,))
        if args.keep:
            print(f"run dirs and logs kept in {tmp}", flush=True)
        for mode in modes:
            t0 = time.monotonic()
            results.append(campaign(mode, args.kills, rng, Path(tmp)))
            results[-1]["wall_s"] = round(time.monotonic() - t0)
            print(f"{mode}: {results[-1]['kills']} kills in {results[-1]['wall_s']} s", flush=True)
    doc = {"seed": seed, "results": results,
           "total": {k: sum(r[k] for r in results) for k in ("kills", "inside_a_save", "accepted_not_whole",
                                                             "committed_lost", "wrong_resume", "relaunches_checked")}}
    print(json.dumps(doc["total"], indent=1))
    for r in results:
        for problem in r["problems"][:10]:
            print(f"{r['mode']}: {problem}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if not any(r["problems"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
