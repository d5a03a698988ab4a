"""Hang evidence, captured before a hung rank is killed.

For every rank: what the kernel says of the process (state — `T` for stopped, `D` for stuck in I/O —
wait channel, threads, CPU time), what its heartbeat last said, and every thread's Python stack: SIGUSR1
makes the rank's faulthandler write them to its stderr log (a stopped rank is sent SIGCONT so it can).
If `py-spy` is installed, its dump (native frames too) is kept beside. All of it lands in
`<logs>/attempt_<k>/hang_evidence.json` (its paths relative to the run dir) and the stack dumps stay in
the ranks' logs.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

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


def capture(hangs: list[Hang], heartbeats: dict[int, Heartbeat], rank_stderr: dict[int, Path],
            out: Path, wait_s: float = 3.0, run_dir: Path | None = None) -> dict[str, Any]:
    """Collect evidence from every rank of the attempt, write it to `out`, and return it. Paths inside
    `run_dir` are written relative to it (layout.recorded), like every path a run records."""

    def shown(path: Path) -> str:
        return recorded(path, run_dir) if run_dir is not None else str(path)

    ranks: dict[int, dict[str, Any]] = {}
    offsets = {r: _size(rank_stderr.get(r)) for r in heartbeats}
    for rank, hb in sorted(heartbeats.items()):
        facts = _proc_facts(hb.pid)
        facts.update(rank=rank, phase=hb.phase, step=hb.step, heartbeat_seq=hb.seq,
                     stderr=shown(rank_stderr[rank]) if rank in rank_stderr else None)
        ranks[rank] = facts
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(hb.pid)
            proc.send_signal(signal.SIGUSR1)
            if facts.get("status") == psutil.STATUS_STOPPED:
                proc.send_signal(signal.SIGCONT)  # a stopped process handles SIGUSR1 once continued
    pending = {r for r in ranks if r in rank_stderr and not str(ranks[r].get("status")).startswith("gone")}
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:  # bounded wait for the dumps to reach the logs
        for r in [r for r in pending if _dumped_since(rank_stderr[r], offsets[r])]:
            ranks[r]["stack_dump"] = f"{shown(rank_stderr[r])} (from byte {offsets[r]})"
            pending.discard(r)
        time.sleep(0.05)
    if shutil.which("py-spy"):
        for facts in ranks.values():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                res = subprocess.run(["py-spy", "dump", "--native", "--pid", str(facts["pid"])],
                                     capture_output=True, text=True, timeout=10)
                facts["py_spy"] = res.stdout[-20_000:] or res.stderr[-2000:]
    doc = {"detected_at": time.time(),
           "hangs": [{"rank": h.rank, "kind": h.kind, "for_s": round(h.for_s, 2), "step": h.step,
                      "phase": h.phase, "describe": h.describe()} for h in hangs],
           "ranks": [ranks[r] for r in sorted(ranks)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc
