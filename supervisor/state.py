"""The run's lifecycle and the state file the supervisor writes after every event.

Lifecycle (`RunState`), as the supervisor moves through it:

    pending ──launch──▶ running ──attempt failed, retryable──▶ restarting ──relaunch──▶ running
       │                  │  └──job finished──▶ succeeded
       │                  └──budget spent / crash loop / non-retryable──▶ failed
       └──(any) SIGTERM / SIGINT to the supervisor──▶ stopped

`succeeded`, `failed` and `stopped` are final for one `resilient run`; running it again on the same run
dir starts a new supervisor at `pending` and resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import layout, lock
from supervisor.fsutil import atomic_write_json, read_json, unreadable_fix
from supervisor.protocol import Heartbeat, described, fits, last_logged_step

SCHEMA_VERSION = 1


class RunState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        return not TRANSITIONS[self]


TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.PENDING: frozenset({RunState.RUNNING, RunState.FAILED, RunState.STOPPED}),
    RunState.RUNNING: frozenset({RunState.RESTARTING, RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED}),
    RunState.RESTARTING: frozenset({RunState.RUNNING, RunState.FAILED, RunState.STOPPED}),
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class AttemptRecord:
    """One launch of torchrun and how it ended."""

    attempt: int
    started_at: float
    resumed_from_step: int | None
    world_size: int | None = None
    first_step_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None  # machine word: worker_exit, worker_signal, hang, ..., or "finished"
    detail: str | None = None  # the human sentence
    failed_rank: int | None = None
    exit_code: int | None = None
    step_at_failure: int | None = None
    last_checkpoint_step: int | None = None
    log_dir: str | None = None
    skipped: list[str] | None = None  # newer checkpoint folders passed over at launch, with the reason
    lost_steps: int | None = None  # steps of this attempt the next one re-executed
    resumed_tier: str | None = None  # "local" or "durable" (with a local tier), and why, in the ranks' words
    resumed_why: str | None = None
    offered_local_step: int | None = None  # the local tier's step offered beside resumed_from_step (a local tier)
    regroups: list[dict] | None = None  # torchrun re-formed the group in place (a node joined): when, how big

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttemptRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class ReplicationState:
    """What `status` shows about the two tiers (kept in the node's state file)."""

    local_root: str
    durable_root: str
    newest_local: int | None = None
    newest_local_at: float | None = None
    newest_durable: int | None = None
    newest_durable_at: float | None = None
    pending: list[int] = field(default_factory=list)
    failing_since: float | None = None
    last_error: str | None = None
    replicated: int = 0
    bytes_copied: int = 0
    seconds_copying: float = 0.0
    deleted_unreplicated: list[int] = field(default_factory=list)
    superseded: int = 0  # local checkpoints never copied: a newer one reached the durable tier first

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        behind = self.newest_local is not None and (self.newest_durable is None or
                                                     self.newest_local > self.newest_durable)
        d["lag_steps"] = (None if self.newest_local is None else
                          self.newest_local - (self.newest_durable or 0) if behind else 0)
        d["lag_s"] = (round(max(0.0, self.newest_local_at - self.newest_durable_at), 2)
                      if self.newest_local_at and self.newest_durable_at else None)
        return d


@dataclass
class RunRecord:
    """Everything `status` shows about one node's supervisor; serialised to state.json."""

    name: str
    run_dir: str  # "." : the paths below are relative to the run dir (layout.recorded) unless outside it
    checkpoint_dir: str
    node: str | None = None
    min_nodes: int | None = None  # the job's nnodes (its MIN in MIN:MAX): fewer nodes cannot form the group
    state: RunState = RunState.PENDING
    supervisor: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    restarts: int = 0
    max_restarts: int = 0
    step: int | None = None
    last_checkpoint_step: int | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    history: list[AttemptRecord] = field(default_factory=list)
    goodput: float | None = None
    accounting: dict[str, Any] = field(default_factory=dict)
    checkpoint_interval: dict[str, Any] = field(default_factory=dict)
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # checkpoints set aside: step, path, reason
    replication: dict[str, Any] = field(default_factory=dict)  # the local tier → durable tier (replicate.py)
    notes: list[dict[str, Any]] = field(default_factory=list)  # rank 0's warnings, once each: attempt, step, text
    message: str | None = None
    next_launch_at: float | None = None  # restarting: when the backoff ends and the next attempt launches
    stopping: str | None = None  # a graceful stop under way: what was asked, when, and its grace
    updated_at: float = 0.0

    def transition(self, new: RunState) -> None:
        """Move along the lifecycle; an edge not in TRANSITIONS is a bug."""
        if new is not self.state and new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {new.value}")
        self.state = new

    def take_last_beats(self, beats: dict[int, Heartbeat]) -> None:
        """The ranks table from the ranks' last heartbeats once they have ended (the stop step, exited), not from
        the last poll's."""
        for r in self.ranks:
            hb = beats.get(r.get("rank"))
            if hb is not None:
                r.update(step=hb.step, phase=hb.phase, heartbeat_at=hb.time)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        d["state"] = self.state.value
        d["history"] = [h.to_dict() for h in self.history]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["state"] = RunState(kw.get("state", "pending"))
        kw["history"] = [AttemptRecord.from_dict(h) for h in kw.get("history", [])]
        return cls(**kw)


@dataclass
class NodeRead:
    """One node's state file as read now: its record (or why it could not be read) and whether its supervisor
    holds the node's lock."""

    node_dir: Path
    record: RunRecord | None
    error: StateFileError | None
    alive: bool


def close_lost_attempt(rec: RunRecord, node_dir: Path) -> None:
    """The record of a supervisor that died (kill -9, a lost node) ends its last attempt open: close it at the
    supervisor's last word, at the last step the ranks logged (they train on until torchrun's SIGTERM)."""
    from supervisor import api  # api imports this module

    last = rec.history[-1] if rec.history else None
    if last is None or last.ended_at is not None:
        return
    last.ended_at = rec.updated_at
    last.step_at_failure = last_logged_step(layout.RunLayout(node_dir).step_log(last.attempt))
    last.reason = api.SUPERVISOR_LOST
    last.detail = f"the supervisor (pid {rec.supervisor.get('pid')}) died during this attempt"


def read_nodes(files: list[Path]) -> list[NodeRead]:
    """Every state file in `files` (layout.state_files), read once, with its supervisor's liveness."""
    out = []
    for f in files:
        try:
            rec, err = read(f), None
        except StateFileError as e:
            rec, err = None, e
        out.append(NodeRead(f.parent, rec, err, lock.holder(f.parent) is not None))
    return out


def missing_nodes(run_dir: Path, me: Path) -> str:
    """The other nodes of this run whose supervisor is not running and that did not finish, for a rendezvous that
    did not form: "; node b's supervisor is not running (last heard 12:00:01)", or "" when none is known."""
    out = []
    for n in read_nodes(layout.state_files(run_dir)):
        if n.node_dir == me or n.alive or n.record is None or n.record.state is RunState.SUCCEEDED:
            continue
        heard = time.strftime("%H:%M:%S", time.localtime(n.record.updated_at))
        out.append(f"node {n.record.node or n.node_dir.name}'s supervisor is not running (last heard {heard})")
    return "".join(f"; {line}" for line in out)


def retired(records: list[tuple[RunRecord, bool]]) -> list[bool]:
    """For each node's (record, supervisor alive): whether the run has gone on without it. A node is retired when
    its supervisor is gone and another node launched an attempt after its record's last word: a Slurm requeue onto
    other hosts, a node lost for good while the others finished. Its state, ranks and history are the past.

    A gone node the run still needs is not retired: where fewer nodes than the job's nnodes (its MIN) would be
    left, the newest gone ones are kept, so that a fixed-size run waiting for a lost node shows that node."""
    launched = [max((h.started_at for h in rec.history), default=0.0) for rec, _ in records]
    out = [not alive and any(j != i and t > rec.updated_at for j, t in enumerate(launched))
           for i, (rec, alive) in enumerate(records)]
    newest = max(records, key=lambda ra: ra[0].updated_at, default=None)
    need = (newest[0].min_nodes or 1) if newest is not None else 1
    short = need - out.count(False)
    for i in sorted((i for i, gone in enumerate(out) if gone), key=lambda i: -records[i][0].updated_at)[:max(0, short)]:
        out[i] = False
    return out


class StateFileError(ValueError):
    """A state file this version cannot read; `damaged` when its bytes are no state file of any version (a machine
    that crashed mid-write), as against another version's file or one the filesystem would not give."""

    def __init__(self, message: str, *, damaged: bool = False, fix: str | None = None):
        super().__init__(message)
        self.damaged = damaged
        self.fix = fix  # what to do, where the filesystem would not give the file (a link, no read access)


def write(path: Path, record: RunRecord) -> None:
    record.updated_at = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Rewritten on every event; losing the newest copy in a power cut costs nothing that the
    # checkpoints do not hold, so skip the fsyncs.
    atomic_write_json(path, record.to_dict(), durable=False)


def read(path: Path) -> RunRecord:
    """Read a state file; StateFileError for a file this version cannot read."""
    try:
        d = read_json(path)
    except OSError as e:
        raise StateFileError(f"{path}: cannot be read ({e.strerror or e})", fix=unreadable_fix(e)) from None
    except ValueError as e:
        raise StateFileError(f"{path}: not JSON ({e})", damaged=True) from None
    if not isinstance(d, dict):  # audit 15: "schema_version None" for a file that holds a list
        raise StateFileError(f"{path}: not a state record (a JSON object), but {type(d).__name__} JSON",
                             damaged=True)
    if d.get("schema_version") != SCHEMA_VERSION:
        version = d.get("schema_version") if isinstance(d, dict) else None
        written = isinstance(version, int) and not isinstance(version, bool)  # by another version: not damage
        raise StateFileError(f"{path}: schema_version {version!r}, this resilient reads {SCHEMA_VERSION}",
                             damaged=not written)
    try:
        history = d.get("history", [])
        if not isinstance(history, list):
            raise ValueError(f"history: {history!r:.60} is not a list")
        for i, h in enumerate(history):  # before the records are built: "'int' object has no attribute 'items'"
            if not isinstance(h, dict):
                raise ValueError(f"history[{i}]: {h!r:.60} is not an object")
            if missing := [k for k in ("attempt", "started_at", "resumed_from_step") if k not in h]:
                raise ValueError(f"history[{i}]: {', '.join(missing)} missing")
        rec = RunRecord.from_dict(d)
        _check_types(rec)
        for h in rec.history:
            _check_types(h)
        _check_fields("accounting.summary", rec.accounting.get("summary") or {}, SUMMARY_FIELDS, SUMMARY_SHOWN)
        for i, r in enumerate(rec.ranks):
            _check_fields(f"ranks[{i}]", r, RANK_FIELDS)
        _check_fields("replication", rec.replication, REPLICATION_FIELDS)
        for i, q in enumerate(rec.quarantined):
            _check_fields(f"quarantined[{i}]", q, QUARANTINE_FIELDS)
        for i, n in enumerate(rec.notes):
            _check_fields(f"notes[{i}]", n, NOTE_FIELDS)
        _relative_paths(rec)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        raise StateFileError(f"{path}: malformed ({e})", damaged=True) from None
    return rec


# The fields `status` reads from the free-form parts of a record, and what each holds (or null).
RANK_FIELDS: dict[str, Any] = {
    "rank": int, "pid": int, "step": int, "world_size": int, "started_at": float, "heartbeat_at": float,
    "heartbeat_age_s": float, "steps_per_s": float, "own_steps_per_s": float, "hang_limit_s": float, "alive": bool,
    "phase": str, "node": str, "note": str,
}
SUMMARY_FIELDS: dict[str, Any] = {
    key: float for key in ("wall_s", "useful_s", "startup_s", "train_s", "checkpoint_blocking_s", "stalled_s",
                           "lost_steps", "lost_s", "tail_s", "down_s", "open_s", "attempts", "goodput")
}
QUARANTINE_FIELDS: dict[str, Any] = {"step": int, "path": str, "reason": str, "at": float}
NOTE_FIELDS: dict[str, Any] = {"attempt": int, "step": int, "text": str}
# ReplicationState's fields, and the lag its to_dict() adds
REPLICATION_FIELDS: dict[str, Any] = {**typing.get_type_hints(ReplicationState), "lag_steps": int, "lag_s": float}
SUMMARY_SHOWN = ("wall_s", "useful_s", "startup_s", "checkpoint_blocking_s", "lost_steps", "lost_s", "tail_s",
                 "down_s")  # status's goodput line (timeline.summary_line) needs each of them


def _check_fields(where: str, d: Any, fields: dict[str, Any], required: tuple[str, ...] = ()) -> None:
    """The known fields of a free-form part (a rank's entry, the goodput summary) hold what they should (or
    null), and a non-empty part holds the `required` ones."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: not an object")
    for key, hint in fields.items():
        if key not in d:
            if d and key in required:
                raise ValueError(f"{where}.{key}: missing")
        elif d[key] is not None and not fits(d[key], hint):
            raise ValueError(f"{where}.{key}: {d[key]!r:.60} is not {described(hint)}")


def _check_types(obj: Any) -> None:
    """Every field of a record read back holds what its annotation says: a damaged or hand-edited file is said
    to be one, not met later as a traceback in whatever reads the field."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not fits(value, hints[f.name]):
            raise ValueError(f"{f.name}: {value!r:.60} is not {described(hints[f.name])}")


def _relative_paths(rec: RunRecord) -> None:
    """Older supervisors recorded absolute paths: those inside the run dir they were written in become
    relative to it, so a copied or moved run dir never points back at the original."""
    written_in = Path(rec.run_dir)
    if not written_in.is_absolute():
        return

    def rel(p: str | None) -> str | None:
        return None if p is None else layout.recorded(layout.resolved(p, written_in), written_in)

    rec.checkpoint_dir = rel(rec.checkpoint_dir) or rec.checkpoint_dir
    for key in ("local_root", "durable_root"):
        if rec.replication.get(key):
            rec.replication[key] = rel(rec.replication[key])
    for h in rec.history:
        h.log_dir = rel(h.log_dir)
    rec.run_dir = "."
