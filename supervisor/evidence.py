"""Hang evidence, captured before a hung rank is killed.

For every rank: what the kernel says of the process (state — `T` for stopped, `D` for stuck in I/O —
wait channel, threads, CPU time), what its heartbeat last said, and every thread's Python stack: SIGUSR1
makes the rank's faulthandler write them to its stderr log (a stopped rank is sent SIGCONT so it can).
If `py-spy` is installed, its dump (native frames too) is kept beside. A worker that never wrote a heartbeat
(stuck before its rank joined: an import on a hung filesystem, the script's own code before `Session.start`)
is found among torchrun's children and kept under `workers_without_heartbeat`, with its command line: a
prewarmed one dumps its stack as a rank does, one started cold only once its entry point installed the
handler. All of it lands in
`<logs>/attempt_<k>/hang_evidence.json` (its paths relative to the run dir) and the stack dumps stay in
the ranks' logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from supervisor import prewarm
from supervisor.layout import recorded
from supervisor.protocol import Heartbeat
from supervisor.watch import Hang

DUMP_MARKERS = (b"most recent call first", b"Current thread", b"Thread 0x")


def _proc_facts(pid: int) -> dict[str, Any]:
    facts: dict[str, Any] = {"pid": pid}
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            facts.update(status=p.status(), threads=p.num_threads(), cpu_s=round(sum(p.cpu_times()[:2]), 2),
                         rss_mb=round(p.memory_info().rss / 1e6, 1))
    except psutil.Error as e:
        facts["status"] = f"gone ({e.__class__.__name__})"
    with contextlib.suppress(OSError):
        facts["wchan"] = Path(f"/proc/{pid}/wchan").read_text().strip() or None
    return facts


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


def _dumped_since(path: Path, offset: int) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return any(m in f.read() for m in DUMP_MARKERS)
    except OSError:
        return False


def _unheard(pid: int) -> dict[str, Any]:
    """A worker with no heartbeat: its process, command line, and the ranks torchrun gave it. A prewarmed rank's
    worker is its proxy (`supervisor.prewarm_client`): the facts are then the rank's own, a fork of the prewarm
    server, found as the process that writes to the same log."""
    facts: dict[str, Any] = {}
    proxy = False
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        facts["cmdline"] = " ".join(p.cmdline())[:2000]
        env = p.environ()
        facts.update({k.lower(): int(env[k]) for k in ("RANK", "LOCAL_RANK") if env.get(k, "").isdigit()})
        proxy = prewarm.is_proxy(p)
    fork = _fork_of(pid) if proxy else None
    if fork is not None:
        facts["prewarm_proxy_pid"] = pid
    return {**_proc_facts(fork if fork is not None else pid), **facts}


def _fork_of(proxy: int) -> int | None:
    """The prewarmed rank behind a proxy: it took on the proxy's stderr (torchrun's log of that rank), and its
    parent, the prewarm server, does not hold that log (a rank's own children, which do, are left out so)."""
    log = _stderr_of(proxy)
    if log is None:
        return None
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info["ppid"]
        if p.pid != proxy and ppid != proxy and _stderr_of(p.pid) == log and _stderr_of(ppid) != log:
            return p.pid
    return None


def _stderr_of(pid: int | None) -> str | None:
    """Where a process's stderr leads, or None (gone, or not ours to read)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/2") if pid is not None else None
    except OSError:
        return None


def _py_spy(facts: dict[str, Any]) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        res = subprocess.run(["py-spy", "dump", "--native", "--pid", str(facts["pid"])],
                             capture_output=True, text=True, timeout=10)
        facts["py_spy"] = res.stdout[-20_000:] or res.stderr[-2000:]


def capture(hangs: list[Hang], heartbeats: dict[int, Heartbeat], rank_stderr: dict[int, Path],
            out: Path, wait_s: float = 3.0, run_dir: Path | None = None,
            unheard: Sequence[int] = (), local_stderr: dict[int, Path] | None = None,
            launcher: int | None = None) -> dict[str, Any]:
    """Collect evidence from every rank of the attempt, write it to `out`, and return it. Paths inside
    `run_dir` are written relative to it (layout.recorded), like every path a run records.

    `unheard`: the pids of torchrun's workers that never wrote a heartbeat, and `local_stderr` each local
    rank's stderr log. They are asked for a dump too: torchrun's workers start with SIGUSR1 ignored (see
    launch.py), and a prewarmed rank dumps from its birth (prewarm.py), so the signal harms none of them.
    `launcher`: torchrun's pid when it has no worker at all, to record its own state (it gets no signal)."""

    def shown(path: Path) -> str:
        return recorded(path, run_dir) if run_dir is not None else str(path)

    ranks: dict[int, dict[str, Any]] = {}
    for rank, hb in sorted(heartbeats.items()):
        facts = _proc_facts(hb.pid)
        facts.update(rank=rank, phase=hb.phase, step=hb.step, heartbeat_seq=hb.seq)
        ranks[rank] = facts
    # A prewarmed rank's proxy is torchrun's child, not the rank: the ranks that beat are known by number.
    strangers = [f for f in map(_unheard, unheard) if f.get("rank") not in heartbeats]
    logs = {id(f): rank_stderr.get(r) for r, f in ranks.items()}
    logs.update({id(f): (local_stderr or {}).get(f.get("local_rank", -1)) for f in strangers})
    everyone = [*ranks.values(), *strangers]
    offsets = {id(f): _size(logs[id(f)]) for f in everyone}
    for facts in everyone:
        facts["stderr"] = shown(logs[id(facts)]) if logs[id(facts)] else None
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(facts["pid"])
            proc.send_signal(signal.SIGUSR1)
            if facts.get("status") == psutil.STATUS_STOPPED:
                proc.send_signal(signal.SIGCONT)  # a stopped process handles SIGUSR1 once continued
    pending = [f for f in everyone if logs[id(f)] and not str(f.get("status")).startswith("gone")]
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:  # bounded wait for the dumps to reach the logs
        for f in [f for f in pending if _dumped_since(logs[id(f)], offsets[id(f)])]:
            f["stack_dump"] = f"{shown(logs[id(f)])} (from byte {offsets[id(f)]})"
            pending.remove(f)
        time.sleep(0.05)
    torchrun = _proc_facts(launcher) if launcher is not None else None  # no worker: where it is stuck
    if shutil.which("py-spy"):
        for facts in [*everyone, *([torchrun] if torchrun else [])]:
            _py_spy(facts)
    doc = {"detected_at": time.time(),
           "hangs": [{"rank": h.rank, "kind": h.kind, "for_s": round(h.for_s, 2), "step": h.step,
                      "phase": h.phase, "describe": h.describe()} for h in hangs],
           "ranks": [ranks[r] for r in sorted(ranks)]}
    if strangers:
        doc["workers_without_heartbeat"] = sorted(strangers, key=lambda f: (f.get("local_rank", -1), f["pid"]))
    if torchrun is not None:
        doc["torchrun"] = torchrun
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc
