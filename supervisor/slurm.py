"""What `resilient run` reads of the Slurm cluster it runs under: the KillWait a stop's checkpoint must fit in.

`scancel` (and a preemption) sends SIGTERM to every process of the job, then SIGKILL after the cluster's KillWait.
A job whose `stop_timeout_s` is longer is told so at start: its stop checkpoint may be cut short by Slurm's
SIGKILL (never resumed from, but the steps since the previous checkpoint are lost).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

QUERY_TIMEOUT_S = 3.0  # a controller that does not answer costs the start no more than this
_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.MULTILINE)


def kill_wait_s(env: Mapping[str, str] = os.environ) -> int | None:
    """The cluster's KillWait in seconds, when this process runs inside a Slurm job and `scontrol` answers in
    time; None otherwise (not under Slurm, no scontrol, a controller down or slow, an output we cannot read)."""
    if not env.get("SLURM_JOB_ID"):
        return None
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        return None
    try:
        out = subprocess.run([scontrol, "show", "config"], capture_output=True, text=True, env=dict(env),
                             timeout=QUERY_TIMEOUT_S, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = _KILL_WAIT.search(out)
    return int(found.group(1)) if found else None


def stop_outlasts_kill_wait(stop_timeout_s: float, kill_wait: int | None) -> str | None:
    """The warning for a stop grace longer than Slurm's KillWait, or None when it fits (or nothing is known)."""
    if kill_wait is None or stop_timeout_s <= kill_wait:
        return None
    return (f"stop_timeout_s is {stop_timeout_s:.0f}s but this Slurm cluster's KillWait is {kill_wait}s: after "
            f"`scancel` or a preemption Slurm SIGKILLs every process {kill_wait}s after its SIGTERM, so a stop "
            f"checkpoint that needs longer is cut short and the next run resumes from the one before; stop with the "
            "sbatch script's USR1 warning (`--signal=B:USR1@...`, not bound by KillWait) or lower stop_timeout_s "
            f"to {kill_wait}s or less")
