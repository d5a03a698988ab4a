"""`resilient run` and `resilient status` as the tests drive them: the tiny job with its knobs, and what the
state file says about the ranks."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import psutil

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


def live_ranks(run_dir: Path, min_step: int = 0, nproc: int = 2) -> list[dict]:
    """The `nproc` ranks of a running attempt once all train at `min_step` or later; else []."""
    s = state(run_dir)
    ranks = [r for r in s.get("ranks", []) if r.get("alive") and r.get("phase") == "train"]
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
                for p in psutil.process_iter(["cmdline"]):
                    if "supervisor.prewarm_client" in " ".join(p.info["cmdline"] or []) and p.ppid() != parent.pid:
                        return p.parent()
                return None
            return parent
    return None
