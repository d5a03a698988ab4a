"""`resilient run` and `resilient status` as the tests drive them: the tiny job with its knobs, what the state
file says about the ranks, and a fake torchrun for fast tests of the real supervisor."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import psutil

from supervisor.protocol import ENV_RUN_DIR, Heartbeat, write_heartbeat
from tests.ckpt_helpers import write_checkpoint
from tests.proc import REPO, child_env

JOB = REPO / "jobs" / "tiny-cpu.yaml"
RUN_TIMEOUT = 240


def resilient(*args: object) -> list[str]:
    return [sys.executable, "-m", "supervisor", *map(str, args)]


def run_job(run_dir: Path, *sets: str, steps: int = 120, sleep: float = 0.03, extra_args: tuple = (),
            device: str = "cpu") -> list[str]:
    """`resilient run` of the tiny job: 2 ranks, a checkpoint every 20 steps, the device always explicit."""
    entry = ["--steps", str(steps), "--device", device, "--test-sleep-per-step", str(sleep), *extra_args]
    argv = resilient("run", JOB, "--run-dir", run_dir, "--set", "checkpoint.interval_steps=20",
                     "--set", "restart.backoff_s=0.2", "--set", f"entrypoint.args={json.dumps(entry)}")
    for s in sets:
        argv += ["--set", s]
    return argv


def status(run_dir: Path) -> dict:
    out = subprocess.run(resilient("status", run_dir, "--json"), capture_output=True, text=True, env=child_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def live_ranks(run_dir: Path, min_step: int = 0, nproc: int = 2, phase: str | None = "train") -> list[dict]:
    """The `nproc` ranks of a running attempt once all are alive in `phase` (None: any phase, as a rank blocked
    in a save shows `save`) at `min_step` or later; else []."""
    s = state(run_dir)
    ranks = [r for r in s.get("ranks", []) if r.get("alive") and (phase is None or r.get("phase") == phase)]
    if s.get("state") == "running" and len(ranks) == nproc and min(r["step"] for r in ranks) >= min_step:
        return ranks
    return []


def rank_log(run_dir: Path, attempt: int, rank: int, stream: str = "stderr") -> str:
    """What rank `rank` (on a single node: its local rank) of attempt `attempt` wrote to `stream`."""
    found = sorted((run_dir / "logs" / f"attempt_{attempt}").rglob(f"{rank}/{stream}.log"))
    return "".join(p.read_text(errors="replace") for p in found)


def torchrun_of(run_dir: Path) -> psutil.Process | None:
    """The running attempt's torchrun, found from its ranks: their parent, or, for ranks forked by the prewarm
    server, the parent of their client proxies (`python -m supervisor.prewarm_client`)."""
    for r in state(run_dir).get("ranks", []):
        with contextlib.suppress(psutil.Error, KeyError):
            rank = psutil.Process(r["pid"])
            parent = rank.parent()
            if parent is not None and "supervisor.prewarm" in " ".join(parent.cmdline()) and \
                    "prewarm_client" not in " ".join(parent.cmdline()):
                # This run's clients only: another test's run may have its own beside it (the suite runs two at
                # a time), and its torchrun is not ours to kill.
                for p in psutil.process_iter(["cmdline"]):
                    with contextlib.suppress(psutil.Error):
                        if "supervisor.prewarm_client" in " ".join(p.info["cmdline"] or []) and \
                                p.ppid() != parent.pid and of_run(p, run_dir):
                            return p.parent()
                return None
            return parent
    return None


def of_run(proc: psutil.Process, run_dir: Path) -> bool:
    """The process was started for `run_dir`'s attempt (the supervisor hands each worker the run dir)."""
    given = proc.environ().get(ENV_RUN_DIR)
    return given is not None and Path(given).resolve() == Path(run_dir).resolve()


class FakeHandle:
    """A launched attempt that has already ended with `rc` (the supervisor's AttemptHandle)."""

    def __init__(self, log_path: Path, rc: int = 0):
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        self.rc = rc
        self.pid = 2**22 - 1  # no such process

    def wait(self, timeout):
        return self.rc

    def workers(self):
        return []

    def alive(self):
        return []

    def track(self, extra_pids=()):
        list(extra_pids)

    def signal_group(self, sig):
        pass

    def signal_ranks(self, sig):
        pass

    def stop(self, grace_s):
        return []

    def close(self):
        pass


def finished_attempt(steps: tuple[int, ...] = (20, 40, 60), world: int = 2, first_rank: int = 0):
    """A fake torchrun launcher for `supervisor.commands.run.make_launcher`: each attempt leaves what a finished
    2-rank attempt leaves (checkpoints written through the store, torchrun's per-rank log folders with a line
    on each stream, heartbeats) and ends with 0. `first_rank`: the global rank of local rank 0 (a second node).
    No process is started."""

    def launch(cfg, spec, handover):
        for step in steps:
            write_checkpoint(cfg.checkpoint.dir, step)
        for local in range(world):
            rank = first_rank + local
            folder = spec.logs_dir / "ranks" / "fake-run_x1" / "attempt_0" / str(local)
            folder.mkdir(parents=True)
            (folder / "stdout.log").write_text(f"attempt {spec.attempt} hello from rank {rank}\n")
            (folder / "stderr.log").write_text(f"attempt {spec.attempt} warning from rank {rank}\n")
            write_heartbeat(spec.heartbeat_dir, Heartbeat(rank=rank, pid=2**22 + rank, local_rank=local,
                                                          world_size=first_rank + world, phase="train", step=steps[-1],
                                                          log_dir=str(folder)))
        return FakeHandle(spec.logs_dir / "torchrun.log", rc=0)

    return launch
