"""The goodput benchmark: the same tiny training job under several fault-tolerance systems, one fault schedule.

    python bench/goodput/run.py --label "quiet machine"       # systems a-e: ≈ 20 min, 25 at most
    python bench/goodput/run.py --systems a,c --steps 400 --mtbf 20 --cap-s 150 --out /tmp/gp   # a short one

Systems (2 CPU ranks, gloo, the tiny GPT of jobs/tiny-cpu.yaml, FSDP2 everywhere):
    a  resilient, a fixed checkpoint interval (--interval)
    b  resilient, `checkpoint.interval_steps: auto` (Young/Daly from measured save cost and failure rate)
    c  torchrun --max-restarts + the tutorial's torch.save snapshot every --interval steps (baseline_train.py)
    d  NVIDIA nvidia-resiliency-ext 0.4.1 ft_launcher + its rank heartbeats (the same baseline trainer)
    e  (c) as the tutorial is written: gloo's 30-minute process-group timeout
    f  (b) with `heartbeat.stall_factor` (--stall-factor): the hang limit follows the measured step time,
       so it is not held to the shared --hang-timeout budget (which stays its ceiling)

Faults, the same for every system, at offsets from the system's first training step: SIGKILL of a random
worker rank at exponential inter-failure times (mean --mtbf), and one SIGSTOP of a worker (a hang) at
--hang-at; the fault clock stands still from the SIGSTOP until the first step after it (see Injector).
Every system gets the same hang-detection budget (--hang-timeout; for f only as the ceiling): resilient's
heartbeat timeout, ft_launcher's rank heartbeat timeout, the baseline's process-group timeout.

Phases: `ideal` (the bare trainer, no checkpoints: with --steps 0 it sets the run length), `ideal-ft`
(train_entry under resilient, no checkpoints: its own step time), then the systems, one at a time, each
between `ideal-before-X` and `ideal-after-X` (the bare trainer again, undisturbed): X's reference step time is
the mean of those two medians, so that this VM's drift over the benchmark (10-20 %) is not charged to it.
Each completed phase leaves <out>/<phase>/result.json; a rerun with the same settings skips those (an
interrupted benchmark resumes; a system run again is bracketed again), --redo names phases to run again.
Every process a phase started is killed when it ends, however it ends. The summary goes to --json (default
bench/results/goodput.json, or <--out>.json when --out is given).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import analyze
import psutil
from faults import (
    HANG,
    KILL,
    Fault,
    ProcessTree,
    StepLogs,
    make_schedule,
    read_all,
    schedule_from_json,
    schedule_to_json,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NVRX_VENV = HERE / ".venv-nvrx"
NVRX_INSTALL = ["torch==2.13.0", "numpy", "nvidia-resiliency-ext==0.4.1"]
SYSTEMS = {"a": "resilient, fixed", "b": "resilient, auto", "c": "torchrun + torch.save", "d": "NVRx ft_launcher",
           "e": "torchrun + torch.save, gloo defaults", "f": "resilient, auto + stall_factor"}
POLL_S = 0.1
TREE_EVERY_S = 1.0
FINISH_GRACE_S = 60.0  # after the final step: the launcher's own orderly exit (final save, state)
MAX_RESTARTS = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="a,b,c,d,e", help="comma-separated, from a,b,c,d,e,f")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps per run; 0: as many as --train-s of undisturbed training")
    p.add_argument("--train-s", type=float, default=180.0,
                   help="with --steps 0: size the run from the measured ideal step time")
    p.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between SIGKILLs")
    p.add_argument("--seed", type=int, default=1,
                   help="the fault schedule's seed (1: 6 kills in 330 s at --mtbf 60, near the nominal 5.5)")
    p.add_argument("--cap-s", type=float, default=360.0, help="wall-clock cap per system run (launch → give up)")
    p.add_argument("--interval", type=int, default=50, help="checkpoint interval in steps for a and c (and d)")
    p.add_argument("--hang-timeout", type=float, default=10.0, help="every system's hang-detection budget, s")
    p.add_argument("--stall-factor", type=float, default=10.0, help="(f): heartbeat.stall_factor")
    p.add_argument("--hang-at", type=float, default=None,
                   help="seconds after the first step for the SIGSTOP; default: 40%% of the ideal run")
    p.add_argument("--auto-mtbf-prior", action="store_true",
                   help="give (b) checkpoint.expected_mtbf_s = --mtbf (default: it must measure the rate)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step in every trainer")
    p.add_argument("--ideal-steps", type=int, default=300, help="steps of the undisturbed reference runs")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "goodput",
                   help="working folder: one sub-folder per phase")
    p.add_argument("--json", type=Path, default=None,
                   help="the summary (default: bench/results/goodput.json, or <--out>.json with --out)")
    p.add_argument("--label", default="", help="a note stored with the results (machine, conditions)")
    p.add_argument("--redo", default="", help="phases to run again although complete, e.g. b,ideal")
    p.add_argument("--fresh", action="store_true", help="discard everything under --out first")
    p.add_argument("--analyze-only", action="store_true", help="only recompute the summary from --out")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if not set(args.systems) <= set(SYSTEMS) or not args.systems:
        p.error(f"--systems takes letters from {','.join(SYSTEMS)}")
    for name in ("train_s", "mtbf", "cap_s", "hang_timeout", "stall_factor"):  # -5 waited forever, 0 divided by it
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.steps < 0:
        p.error("--steps must be ≥ 0 (0: as many as --train-s of undisturbed training)")
    for name in ("interval", "ideal_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1")
    args.redo = {s for s in args.redo.split(",") if s}
    args.out = args.out.resolve()
    if args.json is None:  # a quick look with its own --out must not overwrite the full run's summary
        args.json = args.out.parent / (args.out.name + ".json")
    args.json = args.json.resolve()  # the launchers run in other folders
    return args


SETTINGS = ("steps", "train_s", "mtbf", "seed", "cap_s", "interval", "hang_timeout", "hang_at", "auto_mtbf_prior",
            "step_sleep", "ideal_steps")
SYSTEM_SETTINGS = {"f": ("stall_factor",)}  # settings only one system depends on
IDEAL_SETTINGS = ("ideal_steps", "step_sleep", "hang_timeout")


def settings(args: argparse.Namespace, phase: str | None = None, schedule: list[Fault] | None = None) -> dict:
    """What a phase's result depends on: a completed phase is reused only under the same settings (the
    undisturbed phases do not depend on the fault settings; the systems also depend on the schedule)."""
    keys = IDEAL_SETTINGS if phase and phase.startswith("ideal") else SETTINGS + SYSTEM_SETTINGS.get(phase or "", ())
    out: dict[str, Any] = {k: getattr(args, k) for k in keys}
    if schedule is not None:
        out["schedule"] = schedule_to_json(schedule)
    return out


# ---- the systems ------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """How to start one phase, and where its step logs appear."""

    argv: list[str]
    step_glob: str
    marker: str  # in every worker's command line
    env: dict[str, str] = field(default_factory=dict)
    resilient: bool = False


def resilient_launch(args: argparse.Namespace, run_dir: Path, steps: int, interval: str,
                     prior: float | None = None, stall_factor: float | None = None) -> Launch:
    trainer = ["--steps", str(steps), "--device", "cpu", "--log-every", "100"]
    if args.step_sleep:
        trainer += ["--test-sleep-per-step", str(args.step_sleep)]
    sets = [f"entrypoint.args=[{', '.join(json.dumps(a) for a in trainer)}]",
            f"checkpoint.interval_steps={interval}", f"heartbeat.timeout_s={args.hang_timeout}"]
    if prior is not None:
        sets.append(f"checkpoint.expected_mtbf_s={prior}")
    if stall_factor is not None:
        sets.append(f"heartbeat.stall_factor={stall_factor}")
    argv = [sys.executable, "-m", "supervisor", "run", str(HERE / "job.yaml"), "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return Launch(argv, "steps/attempt_*.jsonl", "train_entry", resilient=True)


def baseline_args(args: argparse.Namespace, run_dir: Path, steps: int, every: int, pg_timeout: float) -> list[str]:
    out = [str(HERE / "baseline_train.py"), "--steps", str(steps), "--snapshot-every", str(every),
           "--snapshot-path", str(run_dir / "snapshot.pt"), "--step-log", str(run_dir / "steps.jsonl"),
           "--pg-timeout-s", str(pg_timeout)]
    return out + (["--sleep-per-step", str(args.step_sleep)] if args.step_sleep else [])


def torchrun_launch(args: argparse.Namespace, run_dir: Path, steps: int, every: int,
                    pg_timeout: float | None = None) -> Launch:
    """(c) gets the same hang budget as the others through its process-group timeout; (e) keeps the
    tutorial's (gloo's 30-minute default, under which a stopped rank is never noticed)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(MAX_RESTARTS if every else 0)]
    # Stale keys in torchrun's shared rendezvous store hung in-place restarts (FACTS.md, pytorch#135712).
    trainer = baseline_args(args, run_dir, steps, every, args.hang_timeout if pg_timeout is None else pg_timeout)
    return Launch(argv + trainer, "steps.jsonl", "baseline_train.py", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def nvrx_launch(args: argparse.Namespace, run_dir: Path, steps: int) -> Launch:
    argv = [str(NVRX_VENV / "bin" / "ft_launcher"), "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(MAX_RESTARTS), "--ft-initial-rank-heartbeat-timeout", "120",
            "--ft-rank-heartbeat-timeout", str(args.hang_timeout), "--ft-workload-check-interval", "1",
            "--ft-enable-nic-monitor", "false"]
    # Hangs are its rank heartbeats' to find: the process-group timeout stays at gloo's default.
    trainer = [*baseline_args(args, run_dir, steps, args.interval, 1800.0), "--nvrx-heartbeat"]
    return Launch(argv + trainer, "steps.jsonl", "baseline_train.py",
                  {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(REPO)})


def reference_phases(key: str) -> tuple[str, str]:
    """The bare trainer's undisturbed runs just before and just after system `key`: its reference step time."""
    return f"ideal-before-{key}", f"ideal-after-{key}"


def phase_launch(phase: str, args: argparse.Namespace, run_dir: Path) -> Launch:
    if phase == "ideal" or phase.startswith(("ideal-before-", "ideal-after-")):
        return torchrun_launch(args, run_dir, args.ideal_steps, every=0)
    if phase == "ideal-ft":
        return resilient_launch(args, run_dir, args.ideal_steps, interval="1000000000")
    if phase == "a":
        return resilient_launch(args, run_dir, args.steps, interval=str(args.interval))
    if phase == "b":
        return resilient_launch(args, run_dir, args.steps, "auto", args.mtbf if args.auto_mtbf_prior else None)
    if phase == "f":
        return resilient_launch(args, run_dir, args.steps, "auto", args.mtbf if args.auto_mtbf_prior else None,
                                stall_factor=args.stall_factor)
    if phase == "c":
        return torchrun_launch(args, run_dir, args.steps, every=args.interval)
    if phase == "e":
        return torchrun_launch(args, run_dir, args.steps, every=args.interval, pg_timeout=1800.0)
    return nvrx_launch(args, run_dir, args.steps)


def ensure_nvrx(log_path: Path) -> str | None:
    """Create bench/goodput/.venv-nvrx if missing; None when ft_launcher is there, else why not."""
    if (NVRX_VENV / "bin" / "ft_launcher").exists():
        return None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        for cmd in ([sys.executable, "-m", "venv", str(NVRX_VENV)],
                    [str(NVRX_VENV / "bin" / "pip"), "install", *NVRX_INSTALL]):
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                tail = log_path.read_text().strip().splitlines()[-5:]
                return f"`{' '.join(cmd)}` failed: " + " / ".join(tail)
    return None if (NVRX_VENV / "bin" / "ft_launcher").exists() else "installed, but no ft_launcher"


# ---- running one phase ------------------------------------------------------------------------------------


class Progress:
    """The step logs as they grow: the first step, the final step, and when a hang was recovered from (the
    first step of a worker group that began after the SIGSTOP)."""

    def __init__(self, run_dir: Path, pattern: str, steps: int):
        self.logs, self.steps = StepLogs(run_dir, pattern), steps
        self.first_t: float | None = None
        self.final_t: float | None = None
        self.last_step = 0
        self._file: str | None = None
        self.group_t: float | None = None  # when the current worker group's first record came
        self.group_steps = 0  # steps it has logged

    def poll(self, hang_t: float | None) -> float | None:
        """Read new lines; return the time of the first step after recovering from a hang at `hang_t`."""
        recovered = None
        for r in self.logs.poll():
            if r["file"] != self._file or "start" in r:
                self._file, self.group_t, self.group_steps = r["file"], r["t"], 0
            if "step" in r:
                self.group_steps += 1
                self.first_t = self.first_t or r["t"]
                self.last_step = r["step"]
                if r["step"] >= self.steps:
                    self.final_t = r["t"]
                if hang_t is not None and recovered is None and self.group_t is not None and self.group_t > hang_t:
                    recovered = r["t"]
        return recovered


class Injector:
    """Delivers the schedule to one run.

    A fault waits until its rank has a worker process that did not exist at the previous fault (it must hit
    the group that replaced the last one, not one already dying); the hang also waits until that group has
    trained a step, so that every system meets it in training, not at startup. The fault clock stops from
    the SIGSTOP until the first step after it: the hang is measured alone, and a system slow to notice a
    hang neither dodges the kills scheduled meanwhile nor gets them all at once afterwards.
    """

    def __init__(self, phase: str, schedule: list[Fault]):
        self.phase = phase
        self.pending = list(schedule)
        self.injected: list[dict[str, Any]] = []
        self.hang_t: float | None = None  # while a hang is not recovered from
        self.paused_s = 0.0  # how long the fault clock stood still
        self.old: set[psutil.Process] = set()  # workers that existed at the previous fault

    def recovered(self, t: float) -> None:
        if self.hang_t is not None:
            self.paused_s += t - self.hang_t
            self.hang_t = None

    def tick(self, now: float, progress: Progress, tree: ProcessTree, t_launch: float) -> None:
        if not self.pending or progress.first_t is None or self.hang_t is not None:
            return
        fault = self.pending[0]
        if now < progress.first_t + self.paused_s + fault.at_s:
            return
        last_t = self.injected[-1]["t"] if self.injected else 0.0
        if fault.kind == HANG and not (progress.group_steps and (progress.group_t or 0.0) > last_t):
            return
        target = tree.workers().get(fault.rank)
        if target is None or target in self.old:
            return
        try:
            target.send_signal(signal.SIGKILL if fault.kind == KILL else signal.SIGSTOP)
        except psutil.Error:  # it ended in between: try its successor on the next tick
            return
        self.old = set(tree.known.values())
        t = time.time()
        self.injected.append({"kind": fault.kind, "rank": fault.rank, "pid": target.pid, "scheduled_s": fault.at_s,
                              "t": t, "delay_s": round(t - progress.first_t - self.paused_s - fault.at_s, 3)})
        self.pending.pop(0)
        if fault.kind == HANG:
            self.hang_t = t
        print(f"  [{self.phase}] {t - t_launch:6.1f}s  {fault.kind} rank {fault.rank} (pid {target.pid}) "
              f"after step {progress.last_step}", flush=True)


def run_phase(phase: str, launch: Launch, run_dir: Path, schedule: list[Fault], steps: int,
              cap_s: float) -> dict[str, Any]:
    """Start the phase, inject its faults, stop at the final step or the cap; end every process it started."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # TMPDIR: plain torchrun leaves a /tmp/torchelastic_* folder per launch; this one stays in the phase's folder,
    # a dot folder, which `resilient run` allows beside a new run (audit 14: `tmp` made it refuse every resilient
    # phase's run dir as holding things that are not a run's)
    tmp = run_dir / ".tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), **launch.env}
    faults = Injector(phase, schedule)
    progress = Progress(run_dir, launch.step_glob, steps)
    timed_out, rc = False, None
    load_at_launch = os.getloadavg()  # the machine's other work skews every timing: record it
    with open(run_dir / "launcher.log", "wb") as log:
        t_launch = time.time()
        proc = subprocess.Popen(launch.argv, env=env, cwd=run_dir, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_term_with_parent)
        tree = ProcessTree(proc.pid, launch.marker, run_dir / "heartbeats" if launch.resilient else None)
        tree_at = time.monotonic()
        try:
            while True:
                time.sleep(POLL_S)
                if time.monotonic() - tree_at >= TREE_EVERY_S:  # cheap enough at 1 Hz on 2 busy cores
                    tree.refresh()
                    tree_at = time.monotonic()
                back = progress.poll(faults.hang_t)
                if back is not None:
                    faults.recovered(back)
                if progress.final_t is not None:
                    rc = _wait(proc, FINISH_GRACE_S)
                    break
                rc = proc.poll()
                if rc is not None:
                    break
                now = time.time()
                if now - t_launch >= cap_s:
                    timed_out = True
                    break
                faults.tick(now, progress, tree, t_launch)
        finally:
            t_end = time.time()
            survivors = tree.kill_all()
            _wait(proc, 10)
    observed = {"phase": phase, "argv": launch.argv, "t_launch": t_launch, "t_end": t_end,
                "loadavg_at_launch": load_at_launch, "loadavg_at_end": os.getloadavg(),
                "exit_code": rc, "timed_out": timed_out, "finished": progress.final_t is not None,
                "faults": faults.injected, "fault_clock_paused_s": round(faults.paused_s, 3),
                "not_due": schedule_to_json(faults.pending),
                "survivors": survivors, "self_report": self_report(launch, run_dir)}
    (run_dir / "observed.json").write_text(json.dumps(observed, indent=1) + "\n")
    return observed


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the harness dies, even by SIGKILL (no finally runs then)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def self_report(launch: Launch, run_dir: Path) -> dict[str, Any]:
    """What the system says about itself: resilient's `status --json` (restarts, its own goodput accounting,
    the checkpoint interval it chose); for torchrun and ft_launcher, the highest TORCHELASTIC_RESTART_COUNT."""
    if launch.resilient:
        out = subprocess.run([sys.executable, "-m", "supervisor", "status", str(run_dir), "--json"],
                             capture_output=True, text=True)
        try:
            doc = json.loads(out.stdout)
        except ValueError:
            return {"restarts": None, "error": out.stderr.strip()[-500:]}
        return {"restarts": doc.get("restarts"), "goodput": doc.get("goodput"),
                "checkpoint_interval": doc.get("checkpoint_interval")}
    starts = [r["start"] for r in read_all(run_dir, launch.step_glob) if "start" in r]
    return {"restarts": max(starts) if starts else None}


# ---- the benchmark ------------------------------------------------------------------------------------------


def load_result(phase_dir: Path, want: dict[str, Any]) -> dict[str, Any] | None:
    path = phase_dir / "result.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return doc if doc.get("settings") == want else None


def phase_settings(phase: str, args: argparse.Namespace, schedule: list[Fault]) -> dict[str, Any]:
    """What `phase`'s result depends on: the undisturbed reference runs do not depend on the schedule."""
    return settings(args, phase, None if phase.startswith("ideal") else schedule)


def reusable(phase: str, args: argparse.Namespace, schedule: list[Fault]) -> dict[str, Any] | None:
    """The result of `phase` if it completed earlier under the same settings (and schedule) and is not to be
    redone."""
    return None if phase in args.redo else load_result(args.out / phase, phase_settings(phase, args, schedule))


def run_or_reuse(phase: str, args: argparse.Namespace, schedule: list[Fault]) -> dict[str, Any]:
    """Run `phase`, unless it completed earlier under the same settings (and schedule)."""
    phase_dir = args.out / phase
    ideal = phase.startswith("ideal")
    want = phase_settings(phase, args, schedule)
    done = reusable(phase, args, schedule)
    if done is not None or args.analyze_only:
        print(f"{phase}: " + (f"complete in {phase_dir}, reused" if done else "no result"), flush=True)
        return done or {}
    if phase == "d":
        why = ensure_nvrx(args.out / "nvrx-install.log")
        if why:
            print(f"d: skipped: {why}", flush=True)
            return {"settings": want, "skipped": why}
    shutil.rmtree(phase_dir, ignore_errors=True)
    print(f"{phase}: {SYSTEMS.get(phase, 'undisturbed, no checkpoints')} → {phase_dir}", flush=True)
    launch = phase_launch(phase, args, phase_dir)
    observed = run_phase(phase, launch, phase_dir, [] if ideal else schedule,
                         args.ideal_steps if ideal else args.steps, args.cap_s)
    doc = {"settings": want, "observed": observed}
    if ideal and not observed["finished"]:  # a reference that did not run to the end is no reference
        raise SystemExit(f"{phase}: the undisturbed run did not finish: see {phase_dir / 'launcher.log'}")
    (phase_dir / "result.json").write_text(json.dumps(doc, indent=1) + "\n")
    return {**doc, "ran_now": True}


def the_schedule(args: argparse.Namespace, ideal_s: float) -> list[Fault]:
    """The fault schedule of this benchmark: kept in <out>/schedule.json, made again only when settings change."""
    path = args.out / "schedule.json"
    if path.is_file():
        doc = json.loads(path.read_text())
        if doc.get("settings") == settings(args):
            return schedule_from_json(doc["faults"])
    hang_at = args.hang_at if args.hang_at is not None else 0.4 * args.steps * ideal_s
    schedule = make_schedule(args.seed, args.mtbf, args.cap_s, 2, hang_at)
    path.write_text(json.dumps({"settings": settings(args), "ideal_step_s": ideal_s,
                                "faults": schedule_to_json(schedule)}, indent=1) + "\n")
    return schedule


def reference_step_s(args: argparse.Namespace, key: str) -> tuple[float | None, list[float | None]]:
    """System `key`'s ideal step time: the mean of the bare trainer's median step just before and just after
    it (this VM drifts by 10-20 % over a benchmark; a reference taken once would charge that to the systems)."""
    medians = [analyze.ideal_step_s(read_all(args.out / phase, "steps.jsonl")) for phase in reference_phases(key)]
    known = [m for m in medians if m]
    return (sum(known) / len(known) if known else None), medians


def summarize(args: argparse.Namespace, docs: dict[str, dict[str, Any]], schedule: list[Fault]) -> dict[str, Any]:
    first = analyze.ideal_step_s(read_all(args.out / "ideal", "steps.jsonl"))
    ideal_ft = analyze.ideal_step_s(read_all(args.out / "ideal-ft", "steps/attempt_*.jsonl")) \
        if "ideal-ft" in docs else None
    rows: dict[str, dict[str, Any]] = {}
    references: dict[str, list[float | None]] = {}
    for key in args.systems:
        doc = docs.get(key, {})
        if "observed" not in doc:
            rows[key] = {"name": SYSTEMS[key], "skipped": doc.get("skipped", "not run")}
            continue
        ideal_s, references[key] = reference_step_s(args, key)
        launch = phase_launch(key, args, args.out / key)
        records = read_all(args.out / key, launch.step_glob)
        rows[key] = {"name": SYSTEMS[key], "ideal_step_s": round(ideal_s or first, 5),
                     **analyze.measure(doc["observed"], records, steps=args.steps, ideal_s=ideal_s or first,
                                       mtbf_s=args.mtbf)}
    return {
        "label": args.label,
        "settings": settings(args),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                    "python": platform.python_version()},
        "ideal_step_s": round(first, 5) if first else None,
        "ideal_step_s_around_each_system": {k: [round(v, 5) if v else None for v in r] for k, r in references.items()},
        "ideal_step_s_train_entry_under_resilient": round(ideal_ft, 5) if ideal_ft else None,
        "formula": "goodput = unique steps × ideal step / (final step − launch); Y/D bound = 1 − (sqrt(2C/F) + R/F), "
                   "T* = sqrt(2CF); bound: C = median effective s per save (blocking + slowdown while persisting), "
                   "F = wall / faults met, R = mean fault → first new step over all faults (the hang included); "
                   "bound_nominal: C = median blocking s per save, F = --mtbf, R = median SIGKILL → first new step",
        "schedule": schedule_to_json(schedule),
        "systems": rows,
        "goals": analyze.goals(rows),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every phase's finally ends its processes
    if args.fresh and not args.analyze_only:
        shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    phases = ["ideal"] + (["ideal-ft"] if {"a", "b", "f"} & set(args.systems) else [])
    docs = {phase: run_or_reuse(phase, args, []) for phase in phases}
    ideal_s = analyze.ideal_step_s(read_all(args.out / "ideal", "steps.jsonl"))
    if ideal_s is None:
        print(f"no ideal step time: see {args.out / 'ideal' / 'launcher.log'}", file=sys.stderr)
        return 1
    if not args.steps:
        args.steps = max(100, round(args.train_s / ideal_s))
    schedule = the_schedule(args, ideal_s)
    print(f"ideal step {ideal_s * 1000:.1f} ms; {args.steps} steps; schedule: " +
          ", ".join(f"{f.kind}@{f.at_s:.0f}s/r{f.rank}" for f in schedule), flush=True)
    for key in args.systems:
        # Each system between two runs of the bare trainer, redone whenever the system is: its reference.
        if reusable(key, args, schedule) is None and not args.analyze_only:
            args.redo.update(reference_phases(key))
        before, after = reference_phases(key)
        docs[before] = run_or_reuse(before, args, [])
        docs[key] = run_or_reuse(key, args, schedule)
        docs[after] = run_or_reuse(after, args, [])
    summary = summarize(args, docs, schedule)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print()
    if args.label:
        print(f"_{args.label}_\n")
    around = ", ".join(f"{k} {' / '.join(f'{v * 1000:.1f}' for v in r if v)}"
                       for k, r in summary["ideal_step_s_around_each_system"].items())
    print(f"ideal step (bare trainer, median, ms) just before / after each system: {around}; "
          f"MTBF {args.mtbf:g} s; {args.steps} steps; cap {args.cap_s:g} s\n")
    ran = {k: v for k, v in summary["systems"].items() if "skipped" not in v}
    print(analyze.table(ran))
    print("\nWhere the wall time went (s):\n")
    print(analyze.breakdown_table(ran))
    for key, row in summary["systems"].items():
        if "skipped" in row:
            print(f"\n{key}: skipped — {row['skipped']}")
    for line in summary["goals"]:
        print("\n" + line)
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
