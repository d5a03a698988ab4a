"""The supervisor's vocabulary: what one attempt is asked to do, what it turned out to be, and what comes
next (spec → outcome → decision), as plain dataclasses shared by the loop, the launcher and the policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.state import RunState

# Reasons an attempt ends (status --json "reason"). The text form adds the detail.
FINISHED = "finished"
WORKER_EXIT = "worker_exit"
WORKER_SIGNAL = "worker_signal"
HANG = "hang"
COLLECTIVE_TIMEOUT = "collective_timeout"
OOM = "oom"
NAN = "nan"
PREEMPTED = "preempted"
NODE_LOST = "node_lost"
CONFIG = "config"
CHECKPOINT_FAILED = "checkpoint_failed"
CHECKPOINT_LOAD = "checkpoint_load"  # the ranks could not load the handed-over checkpoint (exit 74)
LAUNCHER_DIED = "launcher_died"
RENDEZVOUS = "rendezvous"  # torchrun could not form the group (store gone or closed) before any rank ran
STOPPED = "stopped"  # the supervisor itself was asked to stop (SIGTERM/SIGINT)
SUPERVISOR_LOST = "supervisor_lost"  # the supervisor died during the attempt (found by the next one)

RETRYABLE = frozenset({WORKER_EXIT, WORKER_SIGNAL, HANG, COLLECTIVE_TIMEOUT, OOM, PREEMPTED, NODE_LOST,
                       CHECKPOINT_FAILED, CHECKPOINT_LOAD, LAUNCHER_DIED, RENDEZVOUS})


@dataclass(frozen=True)
class AttemptSpec:
    """One launch: which attempt, where its files go, what it resumes from."""

    attempt: int
    resume_step: int | None
    resume_path: Path | None
    logs_dir: Path
    heartbeat_dir: Path
    step_log: Path
    control_file: Path
    rdzv_id: str | None = None  # this attempt's rendezvous run id (several nodes); None: the job's rdzv.id


@dataclass
class AttemptOutcome:
    """How an attempt ended: who failed first, why, at which step."""

    reason: str
    detail: str
    failed_rank: int | None = None
    exit_code: int | None = None
    step: int | None = None  # the step training had reached (newest heartbeat) when it ended
    log_hint: str | None = None  # the file to look at first
    checkpoint_step: int | None = None  # CHECKPOINT_LOAD: the checkpoint the ranks failed to load
    checkpoint_tier: str | None = None  # ... and from which tier ("local" or "durable")
    stalled: tuple[float, float] | None = None  # HANG: (last sign of progress, detection), wall clock
    unsaved_end: bool = False  # FINISHED without session.finish(): the steps after the last checkpoint unsaved

    @property
    def retryable(self) -> bool:
        return self.reason in RETRYABLE


@dataclass(frozen=True)
class Decision:
    """What the policy says after a failed attempt."""

    relaunch: bool
    wait_s: float = 0.0
    resume_below: int | None = None  # resume from the newest valid checkpoint strictly below this step
    quarantine_step: int | None = None  # set this checkpoint aside before relaunching (the ranks failed to load it)
    quarantine: str = ""  # why
    quarantine_local: bool = False  # the copy in this node's local tier
    # Whole but failing to load: passed over now (resume_below), set aside only once an older checkpoint loads (if
    # the older one fails the same way, the code changed, not the checkpoints, and neither is touched).
    quarantine_once_older_loads: bool = False
    final_state: RunState | None = None
    message: str = ""
    counts_as_restart: bool = True


@dataclass
class ResumeChoice:
    """The checkpoint handed to the next attempt, and the newer folders passed over (with reasons)."""

    step: int | None
    path: Path | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder name, why)
    corrupt: list[Any] = field(default_factory=list)  # committed folders found corrupt (store.CheckpointInfo)
