"""What supervision costs each training step: the reference entry point under `resilient run` against the bare
trainer, on the goodput benchmark's model, in one run.

    python bench/step_tax.py [--steps 1000] [--trials 3]

Three ways to train the same tiny GPT (2 CPU ranks, gloo, FSDP2, same data, optimizer and LR schedule), run
in turns (A B C C B A ...: this VM drifts by 10-35 % within minutes), each for --steps steps, no checkpoint:
    bare       bench/goodput/baseline_train.py under plain torchrun (no heartbeats, no agreement, no hooks)
    entry      `-m train_entry` under plain torchrun, beating and logging steps as under the supervisor
    resilient  `resilient run` of `-m train_entry` (heartbeats, the ranks' agreement, the step log, the
               supervisor watching; the first attempt's ranks start as torchrun starts them)
    relaunched the same, its first attempt failing at step 5: the second attempt's ranks and launcher are
               forks of the prewarm server, as after every failure
    saving     the same as resilient with an async save every 13 steps (`--systems` picks some of these)
Both log every completed step from rank 0 in the same format; the step time of a trial is its steady mean:
(t of its last step - t of step 100) / (steps - 100), so the start-up and the first steps are left out, and
pauses (garbage collection, the heartbeat thread) are counted. The tax is resilient's mean over bare's,
and each trial's figures are printed so the spread can be seen. Writes bench/results/step_tax.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from argtypes import positive_int

REPO = Path(__file__).resolve().parent.parent
WARMUP = 100


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return {k: v for k, v in e.items() if not k.startswith("RESILIENT_")}


def run(argv: list[str], cwd: Path, timeout: float, extra_env: dict[str, str] | None = None) -> None:
    with open(cwd / "out.log", "wb") as log:
        # TMPDIR: plain torchrun leaves a /tmp/torchelastic_* folder per launch; this one goes with the trial's
        proc = subprocess.Popen(argv, cwd=cwd, env={**env(), "TMPDIR": str(cwd), **(extra_env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            seen = []
            with contextlib.suppress(psutil.Error):
                seen = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            psutil.wait_procs(seen, timeout=10)
    if rc != 0:
        raise SystemExit(f"{argv[:4]}... exited {rc}; see {cwd / 'out.log'}")


def steady_mean(log: Path, steps: int) -> tuple[float, float]:
    t = {}
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            d = json.loads(line)
            if "step" in d:
                t[int(d["step"])] = float(d["t"])
    gaps = [t[s + 1] - t[s] for s in range(WARMUP, steps) if s in t and s + 1 in t]
    return (t[steps] - t[WARMUP]) / (steps - WARMUP), statistics.median(gaps)


def bare(folder: Path, steps: int) -> tuple[float, float]:
    log = folder / "steps.jsonl"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "bench" / "goodput" / "baseline_train.py"), "--steps", str(steps), "--snapshot-every", "0",
         "--step-log", str(log)], folder, timeout=steps * 0.5 + 120)
    return steady_mean(log, steps)


def entry(folder: Path, steps: int) -> tuple[float, float]:
    """train_entry under plain torchrun, beating and logging steps as under the supervisor, with no supervisor,
    no prewarm server and no forks: what the entry point costs apart from the supervision around it."""
    log = folder / "steps.jsonl"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "train_entry", "--steps", str(steps), "--device", "cpu", "--ckpt-interval", "1000000000",
         "--ckpt-dir", str(folder / "ckpt")], folder, timeout=steps * 0.5 + 120,
        extra_env={"RESILIENT_STEP_LOG": str(log), "RESILIENT_HEARTBEAT_DIR": str(folder / "hb")})
    return steady_mean(log, steps)


def resilient(folder: Path, steps: int, *, relaunch: bool = False, every: int = 1000000000) -> tuple[float, float]:
    run_dir = folder / "run"
    fault = ', "--test-die-at-step", "5", "--test-attempts", "1"' if relaunch else ""
    run([sys.executable, "-m", "supervisor", "run", str(REPO / "jobs" / "tiny-cpu.yaml"), "--run-dir", str(run_dir),
         "--set", f'entrypoint.args=["--steps", "{steps}", "--device", "cpu"{fault}]',
         "--set", f"checkpoint.interval_steps={every}"], folder, timeout=steps * 0.5 + 120)
    return steady_mean(run_dir / "steps" / f"attempt_{2 if relaunch else 1}.jsonl", steps)


def relaunched(folder: Path, steps: int) -> tuple[float, float]:
    """As `resilient`, but its first attempt fails at step 5 and the steps are those of the second: ranks forked
    from the prewarm server by a launcher forked from it, as every attempt after a failure is."""
    return resilient(folder, steps, relaunch=True)


def saving(folder: Path, steps: int) -> tuple[float, float]:
    """As `resilient`, with an async save every 13 steps (what `auto` chose in the goodput benchmark): the steady
    mean then holds the saves' blocking and the slowdown of the steps beside their persists."""
    return resilient(folder, steps, every=13)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--trials", type=positive_int, default=3)
    p.add_argument("--systems", default="bare,entry,resilient,relaunched")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "step_tax.json")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps the steady mean leaves out")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: run()'s finally ends the trial's processes
    known = {"bare": bare, "entry": entry, "resilient": resilient, "relaunched": relaunched, "saving": saving}
    chosen = args.systems.split(",")
    if "bare" not in chosen or not set(chosen) <= set(known):
        p.error(f"--systems: some of {', '.join(known)}, bare among them (the tax is measured against it)")
    systems = tuple((name, known[name]) for name in chosen)
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="resilient-step-tax-") as tmp:
        for trial in range(args.trials):
            for name, fn in systems[:: 1 if trial % 2 == 0 else -1]:
                folder = Path(tmp) / f"{name}-{trial}"
                folder.mkdir()
                t0 = time.monotonic()
                rows[name].append(fn(folder, args.steps))
                mean, med = rows[name][-1]
                print(f"trial {trial} {name:9s} steady mean {mean * 1e3:.2f} ms/step, median {med * 1e3:.2f} ms "
                      f"({time.monotonic() - t0:.0f}s)", flush=True)
    means = {k: statistics.mean(m for m, _ in v) for k, v in rows.items()}
    out: dict = {"steps": args.steps, "trials": rows, "mean_step_s": means}
    print()
    for name in (n for n in chosen if n != "bare"):
        pairs = [r / b - 1 for (b, _), (r, _) in zip(rows["bare"], rows[name], strict=True)]
        out[name] = {"tax_ms": (means[name] - means["bare"]) * 1e3, "tax": means[name] / means["bare"] - 1,
                     "tax_per_trial": pairs}
        print(f"{name}: {means[name] * 1e3:.2f} ms/step against bare {means['bare'] * 1e3:.2f}: tax "
              f"{out[name]['tax_ms']:+.2f} ms ({out[name]['tax']:+.1%}); per trial "
              f"{', '.join(f'{x:+.1%}' for x in pairs)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
