"""The GPT-2-small job (jobs/gpu-small.yaml: 12 layers, width 768, vocab 50304, batch 32 x 512, one GPU, async
saves every 100 steps, `verify: checksum`) under `resilient run`, SIGKILLed twice, to the end.

    python bench/gpu_small.py [--out DIR] [--kill-at 150,380] [--set KEY=VALUE ...] [--entry-args '--precision bf16']

Prints and writes (DIR/gpu_small.json): the step time, each save's blocking time and persist time, each kill's
recovery (SIGKILL -> first step of the relaunched rank, and -> first step past the one it died at), the run's
history and exit code, and `inspect-checkpoint --verify` over what it wrote. `--set` goes to `resilient run`
(e.g. a CPU smoke test: --set 'entrypoint.args=[--steps, "60", --device, cpu, --test-sleep-per-step, "0.2"]'
--kill-at 15,40). The run dir is removed at the end unless `--keep` (its path is printed then).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from argtypes import positive_float  # noqa: E402

from supervisor.protocol import CommitRecord, SaveRecord, StepRecord, read_step_log  # noqa: E402


def state(run_dir: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / "state.json").read_text())
    return {}


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def training_rank(run_dir: Path, attempt: int, min_step: int) -> dict | None:
    s = state(run_dir)
    ranks = [r for r in s.get("ranks", []) if r.get("alive") and r.get("phase") in ("train", "save")]
    if s.get("attempt") == attempt and ranks and min(r["step"] for r in ranks) >= min_step:
        return ranks[0]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default=str(REPO / "jobs" / "gpu-small.yaml"))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu"))
    p.add_argument("--kill-at", default="150,380", help="the steps (attempt 1, attempt 2) to SIGKILL rank 0 at")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--entry-args", default="",
                   help="appended to the job's entry-point args, e.g. '--precision bf16 --ema 0.999'")
    p.add_argument("--timeout", type=positive_float, default=560.0, help="give up after this many seconds")
    p.add_argument("--keep", action="store_true", help="keep the run dir (its checkpoints: GBs on a GPU)")
    args = p.parse_args()
    if not Path(args.job).is_file():
        p.error(f"--job {args.job}: no such file")
    try:
        kill_at = [int(s) for s in args.kill_at.split(",")]
    except ValueError:
        p.error(f"--kill-at {args.kill_at}: give steps as whole numbers separated by commas, e.g. 150,380")
    if any(k <= 0 for k in kill_at):
        p.error(f"--kill-at {args.kill_at}: steps must be > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally below ends the run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-small-")) / "run"
    argv = [sys.executable, "-m", "supervisor", "run", args.job, "--run-dir", str(run_dir)]
    for s in args.sets:
        argv += ["--set", s]
    if args.entry_args:
        import yaml

        job_args = yaml.safe_load(Path(args.job).read_text())["entrypoint"].get("args", [])
        argv += ["--set", f"entrypoint.args={json.dumps([*map(str, job_args), *args.entry_args.split()])}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    console = out / "gpu_small_console.log"
    started = time.monotonic()
    kills: list[dict] = []
    with open(console, "wb") as log:
        sup = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def at(attempt: int, step: int) -> dict | None:
            if sup.poll() is not None:  # finished or failed before the kill it waits for: no use waiting on
                raise SystemExit(f"the supervisor exited ({sup.returncode}) before attempt {attempt} reached step "
                                 f"{step}; see {console}")
            return training_rank(run_dir, attempt, step)

        try:
            for attempt, step in enumerate(kill_at, start=1):
                rank = wait_for(lambda a=attempt, s=step: at(a, s),
                                args.timeout - (time.monotonic() - started), f"attempt {attempt} at step {step}")
                # `step` is what status showed just before the kill: the rank may finish one more step before
                # the signal lands (the run's history then says one more: `step_at_failure`, added below)
                kills.append({"attempt": attempt, "pid": rank["pid"], "step": rank["step"], "t": time.time()})
                os.kill(rank["pid"], signal.SIGKILL)
                print(f"SIGKILL rank 0 (pid {rank['pid']}) of attempt {attempt}, seen at step {rank['step']}",
                      flush=True)
            code = sup.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
        except (subprocess.TimeoutExpired, SystemExit) as e:
            if isinstance(e, SystemExit) and e.code == 143:  # SIGTERM to this script: stop now, nothing verified
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(sup.pid, signal.SIGKILL)
                sup.wait(30)
                if not args.keep:
                    shutil.rmtree(run_dir.parent, ignore_errors=True)
                raise
            print(f"giving up: {e}", flush=True)
            code = sup.poll()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sup.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                psutil.wait_procs([psutil.Process(sup.pid)], timeout=10)
    s = state(run_dir)
    report: dict = {"exit_code": code, "wall_s": round(time.monotonic() - started, 1),
                    "history": [{k: h.get(k) for k in ("attempt", "reason", "resumed_from_step", "step_at_failure")}
                                for h in s.get("history", [])]}
    logs = {h["attempt"]: read_step_log(run_dir / "steps" / f"attempt_{h['attempt']}.jsonl")
            for h in s.get("history", [])}
    steps = [r for recs in logs.values() for r in recs if isinstance(r, StepRecord)]
    gaps = [b.t - a.t for a, b in itertools.pairwise(steps) if b.step == a.step + 1]
    report["step_s_median"] = round(statistics.median(gaps), 4) if gaps else None
    report["saves"] = [{"step": r.step, "blocking_s": r.blocking_s} for recs in logs.values() for r in recs
                       if isinstance(r, SaveRecord)]
    report["commits"] = [{"step": r.step, "persist_s": r.persist_s, "gb": round(r.bytes / 1e9, 3)}
                         for recs in logs.values() for r in recs if isinstance(r, CommitRecord)]
    failed_at = {h.get("attempt"): h.get("step_at_failure") for h in s.get("history", [])}
    for k in kills:
        k["step_at_failure"] = failed_at.get(k["attempt"])  # the run's own record of where the kill landed
        nxt = [r for r in logs.get(k["attempt"] + 1, []) if isinstance(r, StepRecord)]
        if nxt:
            k["to_first_step_s"] = round(nxt[0].t - k["t"], 2)
            past = [r for r in nxt if r.step > k["step"]]
            k["to_step_past_the_kill_s"] = round(past[0].t - k["t"], 2) if past else None
    report["kills"] = kills
    t0 = time.monotonic()
    verify = subprocess.run([sys.executable, "-m", "supervisor", "inspect-checkpoint", str(run_dir), "--verify",
                             "--json"], capture_output=True, text=True, env=env)
    with contextlib.suppress(ValueError, KeyError, TypeError):  # no run (a refused job): no checkpoints to list
        doc = json.loads(verify.stdout)
        report["verify"] = {"exit_code": verify.returncode, "seconds": round(time.monotonic() - t0, 2),
                            "checkpoints": {c["step"]: c["status"] for c in doc["checkpoints"]}}
    (out / "gpu_small.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if args.keep:
        print(f"run dir kept: {run_dir}")
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    ok = code == 0 and len(kills) == len(kill_at) and report.get("verify", {}).get("exit_code") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
