"""What the harness does to a running system: the fault schedule, the process tree, and the step logs.

The schedule is a pure function of (seed, mtbf, horizon, world size, hang time): every system gets the same
faults at the same offsets from its own first training step. Processes are found by walking the launched
process's descendants (psutil, which guards against pid reuse) and are all remembered, because launchers
start workers in sessions of their own and a killed launcher orphans them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

KILL, HANG = "kill", "hang"


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Seconds after the system's first completed training step."""
    kind: str
    """KILL (SIGKILL of a worker) or HANG (SIGSTOP of a worker, never continued by the harness)."""
    rank: int
    """The global rank whose worker process gets the signal."""


def make_schedule(seed: int, mtbf_s: float, horizon_s: float, world_size: int, hang_at_s: float) -> list[Fault]:
    """Exponential inter-failure times with mean `mtbf_s` up to `horizon_s`, each killing a random rank, plus
    one hang at `hang_at_s`. Kills and the hang draw from separate generators, so changing the horizon or the
    hang time leaves the other faults where they were."""
    kills = random.Random(seed)
    faults, t = [], 0.0
    while True:
        t += kills.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            break
        faults.append(Fault(round(t, 3), KILL, kills.randrange(world_size)))
    hang_rank = random.Random(seed + 1).randrange(world_size)
    faults.append(Fault(round(hang_at_s, 3), HANG, hang_rank))
    return sorted(faults, key=lambda f: f.at_s)


def schedule_to_json(faults: list[Fault]) -> list[dict[str, Any]]:
    return [asdict(f) for f in faults]


def schedule_from_json(items: list[dict[str, Any]]) -> list[Fault]:
    return [Fault(**d) for d in items]


class ProcessTree:
    """Every process ever seen under one launched root, so that all of them can be ended at the end."""

    def __init__(self, root_pid: int, worker_marker: str, heartbeats: Path | None = None):
        self.root_pid = root_pid
        self.marker = worker_marker  # a string in every worker's command line (the trainer's name)
        # resilient's prewarmed ranks are forks of its prewarm server: their command line and /proc environ are
        # the server's, so their rank comes from the heartbeats they write (pid, rank); torchrun's child for
        # such a rank is only a proxy (supervisor.prewarm_client) and is never the one to SIGKILL or SIGSTOP.
        self.heartbeats = heartbeats
        self.known: dict[int, psutil.Process] = {}
        self._ranks: dict[int, int | None] = {}  # pid → RANK from its environment (None: not a worker)
        self.refresh()

    def refresh(self) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.root_pid)
            for p in [root, *root.children(recursive=True)]:
                self.known.setdefault(p.pid, p)

    def _rank_of(self, p: psutil.Process) -> int | None:
        if p.pid not in self._ranks:
            rank = None
            with contextlib.suppress(psutil.Error, ValueError):
                cmd = p.cmdline()
                if "supervisor.prewarm_client" in cmd:
                    pass  # a proxy: never the one to signal
                elif any("supervisor.prewarm" in a for a in cmd):  # the server, or a fork of it
                    rank = self._heartbeat_rank(p.pid)
                    if rank is None:
                        return None  # the server, or a fork that has not beaten yet: asked again next time
                else:
                    env = p.environ()
                    if "RANK" in env and "LOCAL_RANK" in env and any(self.marker in a for a in cmd):
                        rank = int(env["RANK"])
            self._ranks[p.pid] = rank
        return self._ranks[p.pid]

    def _heartbeat_rank(self, pid: int) -> int | None:
        """The rank whose heartbeat names `pid`; None until the fork has written one."""
        if self.heartbeats is None:
            return None
        for f in self.heartbeats.glob("attempt_*/rank_*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                hb = json.loads(f.read_text())
                if hb["pid"] == pid:
                    return int(hb["rank"])
        return None

    def workers(self) -> dict[int, psutil.Process]:
        """rank → its newest running (not stopped, not zombie) worker process."""
        self.refresh()
        found: dict[int, psutil.Process] = {}
        for p in self.known.values():
            with contextlib.suppress(psutil.Error):
                if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED, psutil.STATUS_DEAD):
                    continue
                rank = self._rank_of(p)
                if rank is not None and (rank not in found or p.create_time() > found[rank].create_time()):
                    found[rank] = p
        return found

    def alive(self) -> list[psutil.Process]:
        out = []
        for p in self.known.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def kill_all(self) -> list[int]:
        """SIGKILL the root's process group and every remembered process; return the pids that survived."""
        self.refresh()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.root_pid, signal.SIGKILL)
        procs = self.alive()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the pid still names the process we saw
        _, survivors = psutil.wait_procs(procs, timeout=10)
        return [p.pid for p in survivors]


class StepLogs:
    """Follows the JSON-lines step logs matching a glob under a folder, returning new complete lines."""

    def __init__(self, folder: Path, pattern: str):
        self.folder, self.pattern = folder, pattern
        self.offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in sorted(self.folder.glob(self.pattern), key=_natural):
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
                end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
                self.offsets[path] = self.offsets.get(path, 0) + end
                for line in data[:end].splitlines():
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        rec["file"] = path.name
                        out.append(rec)
        return out


def _natural(path: Path) -> list[Any]:
    """attempt_2 before attempt_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def read_all(folder: Path, pattern: str) -> list[dict[str, Any]]:
    """Every record of the step logs, in file order then line order."""
    return StepLogs(folder, pattern).poll()
