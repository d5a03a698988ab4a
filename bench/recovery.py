"""Recovery side by side, in one run: resilient vs plain `torchrun --max-restarts` on the same entry point.

    python bench/recovery.py [--trials 5] [--hang-timeout 10] [--hang-cap 120]

Measured, on 2 CPU ranks (gloo), the reference entry point (`-m train_entry`), steps timed from the ranks' own
per-step sample log so both systems are measured by the same clock:
- recovery: SIGKILL of a random rank → the first completed step of the new worker group, twice per run:
  30 steps into a fresh run (the supervisor's helpers may still be importing), and 30 steps after the
  relaunched group resumed;
  resilient with `restart.backoff_s: 0` vs torchrun with `--max-restarts` (its in-place restart, with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which FACTS.md saw restarts hang);
- hang: SIGSTOP of a rank → detected (resilient: its console's "hang" line) and → first step after it;
  torchrun with its defaults (no hang detection; gloo's 30-minute timeout) is given `--hang-cap` seconds;
- the supervisor's own CPU and memory while it watches a healthy run, and its idle helpers' memory.
Writes bench/results/recovery.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
ENTRY = ["--steps", "100000", "--device", "cpu", "--ckpt-interval", "20", "--test-sleep-per-step", "0.02"]


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return {k: v for k, v in e.items() if not k.startswith("RESILIENT_")}


class Group:
    """A launched command in its own session; killed with everything under it on exit."""

    def __init__(self, argv: list[str], cwd: Path, log: Path):
        self.log = log
        self._f = open(log, "wb")  # noqa: SIM115
        # TMPDIR: plain torchrun leaves a /tmp/torchelastic_* folder per launch; this one goes with the trial's
        self.p = subprocess.Popen(argv, cwd=cwd, env={**env(), "TMPDIR": str(cwd)}, stdout=self._f,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def close(self) -> None:
        seen = []
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.p.pid)
            seen = [root, *root.children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        for p in seen:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(seen, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)
        self._f.close()


def samples(folder: Path) -> list[dict]:
    rows = []
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def wait(pred, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(what)


def live_workers(samples_dir: Path, min_step: int) -> dict[int, int] | None:
    """rank → pid of the current workers once both have passed `min_step`."""
    rows = samples(samples_dir)
    newest: dict[int, dict] = {}
    for r in rows:
        if r["rank"] not in newest or r["t"] > newest[r["rank"]]["t"]:
            newest[r["rank"]] = r
    if len(newest) == 2 and min(r["step"] for r in newest.values()) >= min_step:
        pids = {}
        for f in samples_dir.glob("rank*.pid*.jsonl"):
            rank, pid = int(f.name.split(".")[0][4:]), int(f.name.split(".")[1][3:])
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                pids[rank] = pid
        return pids if len(pids) == 2 else None
    return None


def new_workers(samples_dir: Path, min_step: int, old_pids: frozenset[int]) -> dict[int, int] | None:
    """rank → pid of a worker group none of whose pids is in `old_pids`, once both have passed `min_step`."""
    pids = live_workers(samples_dir, min_step)
    return pids if pids and not set(pids.values()) & old_pids else None


def first_step_after(samples_dir: Path, t0: float, old_pids: set[int]) -> float | None:
    ts = [r["t"] for f in samples_dir.glob("*.jsonl") if int(f.name.split(".")[1][3:]) not in old_pids
          for r in map(json.loads, f.read_text().splitlines()) if r["t"] > t0]
    return min(ts) if ts else None


def job_yaml(work: Path, samples_dir: Path, hang_timeout: float) -> Path:
    args = json.dumps([*ENTRY, "--test-log-samples", str(samples_dir)])
    job = work / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        name: bench
        run_dir: run
        entrypoint: {{module: train_entry, args: {args}}}
        nproc_per_node: 2
        restart: {{backoff_s: 0, max_restarts: 50, crash_loop_attempts: 50}}
        heartbeat: {{interval_s: 0.5, timeout_s: {hang_timeout}, startup_timeout_s: 120}}
        checkpoint: {{interval_steps: 20}}
        stop_timeout_s: 10
    """))
    return job


def launch(system: str, work: Path, samples_dir: Path, hang_timeout: float, max_restarts: int = 50) -> Group:
    if system == "resilient":
        job = job_yaml(work, samples_dir, hang_timeout)
        argv = [sys.executable, "-m", "supervisor", "run", str(job)]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", str(max_restarts), "-m", "train_entry", *ENTRY, "--test-log-samples",
                str(samples_dir)]
    return Group(argv, work, work / f"{system}.log")


def recovery_trial(system: str, rng: random.Random) -> tuple[float, float]:
    """Two SIGKILLs in one run: the first 30 steps into it (the supervisor's helpers may still be importing),
    the second 30 steps after the relaunched group resumed. Returns both recovery times."""
    with tempfile.TemporaryDirectory(prefix=f"rec-{system}-") as d:
        work, samples_dir = Path(d), Path(d) / "samples"
        g = launch(system, work, samples_dir, hang_timeout=30)
        try:
            out: list[float] = []
            min_step, dead = 30, frozenset()
            for _ in range(2):
                pids = wait(lambda s=min_step, d=dead: new_workers(samples_dir, s, d), 180, "training")
                time.sleep(rng.uniform(0, 1))
                min_step = max(r["step"] for r in samples(samples_dir)) + 30
                dead = dead | set(pids.values())
                t0 = time.time()
                os.kill(pids[rng.choice([0, 1])], signal.SIGKILL)
                t1 = wait(lambda t=t0, d=dead: first_step_after(samples_dir, t, d), 120, "the first new step")
                out.append(t1 - t0)
            return out[0], out[1]
        finally:
            g.close()


def hang_trial(system: str, hang_timeout: float, cap: float) -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix=f"hang-{system}-") as d:
        work, samples_dir = Path(d), Path(d) / "samples"
        g = launch(system, work, samples_dir, hang_timeout)
        pids: dict[int, int] = {}
        try:
            pids = wait(lambda: live_workers(samples_dir, 30), 180, "training")
            t0 = time.time()
            os.kill(pids[1], signal.SIGSTOP)
            detected = step = None
            deadline = time.time() + cap
            while time.time() < deadline and step is None:
                if detected is None and system == "resilient" and "hang —" in g.log.read_text(errors="replace"):
                    detected = time.time() - t0
                s = first_step_after(samples_dir, t0, set(pids.values()))
                step = None if s is None else s - t0
                time.sleep(0.05)
            return {"detected_s": detected, "first_step_s": step}
        finally:
            with contextlib.suppress(ProcessLookupError, KeyError):  # a Ctrl-C before training has no pids
                os.kill(pids[1], signal.SIGCONT)
            g.close()


def supervisor_cost(seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="cost-") as d:
        work, samples_dir = Path(d), Path(d) / "samples"
        g = launch("resilient", work, samples_dir, hang_timeout=30)
        try:
            wait(lambda: live_workers(samples_dir, 10), 180, "training")
            sup = psutil.Process(g.p.pid)
            c0, t0 = sum(sup.cpu_times()[:2]), time.monotonic()
            rss = []
            while time.monotonic() - t0 < seconds:
                rss.append(sup.memory_info().rss)
                time.sleep(0.5)
            cpu = (sum(sup.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
            return {"cpu_percent": round(100 * cpu, 2), "rss_mb": round(max(rss) / 1e6, 1), "seconds": seconds,
                    "helpers": helpers(sup)}
        finally:
            g.close()


def helpers(sup: psutil.Process) -> dict[str, dict[str, float]]:
    """The idle processes the supervisor keeps for the next relaunch (the prewarm server; a torchrun zygote
    where one is kept): resident and unique (not shared with any other process) memory. A zygote that became
    the running torchrun (it has workers) is not idle."""
    out = {}
    for child in sup.children():
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(child.cmdline())
            if "supervisor.zygote" in cmd and child.children():
                continue
            for name in ("zygote", "prewarm"):
                if f"supervisor.{name}" in cmd:
                    mem = child.memory_full_info()
                    out[name] = {"rss_mb": round(mem.rss / 1e6, 1), "uss_mb": round(mem.uss / 1e6, 1)}
    return out


def stats(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--hang-timeout", type=float, default=10.0, help="resilient's heartbeat.timeout_s")
    p.add_argument("--hang-cap", type=float, default=120.0, help="give up waiting for a hang to be handled")
    p.add_argument("--cost-seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    p.add_argument("--cost-only", action="store_true", help="only the supervisor's own cost")
    args = p.parse_args()
    for name in ("trials", "hang_timeout", "hang_cap", "cost_seconds"):  # 0 trials failed after 35 s; -1 waited
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: each trial's finally ends its processes
    if args.cost_only:
        print(json.dumps(supervisor_cost(args.cost_seconds), indent=2))
        return
    rng = random.Random(args.seed)
    rec: dict[str, list[float]] = {"resilient": [], "torchrun": []}  # the first failure of a run
    later: dict[str, list[float]] = {"resilient": [], "torchrun": []}  # a failure of the relaunched group
    for i in range(args.trials):  # interleaved, so a change in machine load hits both
        for system in ("resilient", "torchrun"):
            first, second = recovery_trial(system, rng)
            rec[system].append(first)
            later[system].append(second)
            print(f"trial {i + 1}: {system} recovered in {first:.2f}s, then {second:.2f}s", flush=True)
    hang = {s: hang_trial(s, args.hang_timeout, args.hang_cap) for s in ("resilient", "torchrun")}
    cost = supervisor_cost(args.cost_seconds)
    ratio = statistics.median(rec["resilient"]) / statistics.median(rec["torchrun"])
    ratio_later = statistics.median(later["resilient"]) / statistics.median(later["torchrun"])
    print(f"\n| SIGKILL → first new step (s), min / median / max of {args.trials}, interleaved | resilient "
          "| torchrun --max-restarts |")
    print("| --- | --- | --- |")
    print(f"| the run's first failure, 30 steps in | {stats(rec['resilient'])} | {stats(rec['torchrun'])} |")
    print(f"| a later failure, 30 steps after the relaunch | {stats(later['resilient'])} "
          f"| {stats(later['torchrun'])} |")
    print(f"\nratio of medians resilient / torchrun: first {ratio:.2f}, later {ratio_later:.2f}")
    print(f"\n| SIGSTOP of a rank | resilient (heartbeat.timeout_s={args.hang_timeout:g}) | torchrun defaults |")
    print("| --- | --- | --- |")

    def fmt(v: float | None) -> str:
        return f"{v:.1f}s" if v is not None else f"not within {args.hang_cap:.0f}s"

    print(f"| detected | {fmt(hang['resilient']['detected_s'])} | never (no hang detection) |")
    first = {s: fmt(hang[s]["first_step_s"]) for s in hang}
    print(f"| first step after it | {first['resilient']} | {first['torchrun']} |")
    print(f"\nsupervisor while watching: {cost['cpu_percent']}% of one core, {cost['rss_mb']} MB RSS "
          f"(over {cost['seconds']:.0f}s); idle helpers: " +
          ", ".join(f"{k} {v['rss_mb']} MB RSS ({v['uss_mb']} MB unique)" for k, v in cost["helpers"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"recovery_s": rec, "ratio_of_medians": ratio, "later_recovery_s": later,
                               "later_ratio_of_medians": ratio_later, "hang": hang, "supervisor": cost,
                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
