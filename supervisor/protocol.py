"""What the supervisor and the ranks say to each other, without importing torch on either side.

The supervisor hands over through environment variables (`Handover`); the ranks answer through files:
a heartbeat per rank (rewritten at most once per interval) and rank 0's step log (appended). Exit codes
tell the supervisor how a rank ended when it ended on its own.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.fsutil import atomic_write_json, open_regular, parse_json, read_json

# ---------------------------------------------------------------------------------------------------
# Exit codes of a rank (documented in the README). torchrun itself exits 1 for any worker failure, so
# the supervisor reads these from the ranks' last heartbeat and torchrun's failure summary.

EXIT_CHECKPOINT_LOAD = 74  # the handed-over checkpoint could not be loaded (EX_IOERR): the supervisor decides
EXIT_PREEMPTED = 75  # SIGTERM: stopped at a step boundary, checkpointed if the grace allowed (EX_TEMPFAIL)
EXIT_NAN = 76  # a non-finite loss: nothing of that step was saved
EXIT_CONFIG = 78  # bad arguments or environment: retrying cannot help (EX_CONFIG)

# ---------------------------------------------------------------------------------------------------
# The handover: environment variables the supervisor sets for every rank.

ENV_RUN_DIR = "RESILIENT_RUN_DIR"
ENV_NODE = "RESILIENT_NODE"
ENV_ATTEMPT = "RESILIENT_ATTEMPT"
ENV_CKPT_DIR = "RESILIENT_CKPT_DIR"  # the durable tier
ENV_CKPT_LOCAL_DIR = "RESILIENT_CKPT_LOCAL_DIR"  # this node's local tier (checkpoint.local_dir), if any
ENV_LOCAL_RESUME_STEP = "RESILIENT_LOCAL_RESUME_STEP"  # the newest valid checkpoint in it
ENV_CKPT_INTERVAL = "RESILIENT_CKPT_INTERVAL"  # steps, or "auto"
ENV_CKPT_ASYNC = "RESILIENT_CKPT_ASYNC"  # 1 or 0
ENV_RESUME_STEP = "RESILIENT_RESUME_STEP"  # empty: start fresh
ENV_RESUME_PATH = "RESILIENT_RESUME_PATH"
ENV_HEARTBEAT_DIR = "RESILIENT_HEARTBEAT_DIR"
ENV_HEARTBEAT_INTERVAL_S = "RESILIENT_HEARTBEAT_INTERVAL_S"
ENV_STEP_LOG = "RESILIENT_STEP_LOG"
ENV_CONTROL_FILE = "RESILIENT_CONTROL_FILE"
ENV_COLLECTIVE_TIMEOUT_S = "RESILIENT_COLLECTIVE_TIMEOUT_S"
ENV_STOP_GRACE_S = "RESILIENT_STOP_GRACE_S"
ENV_SUPERVISOR_PID = "RESILIENT_SUPERVISOR_PID"
ENV_LAUNCHED_AT = "RESILIENT_LAUNCHED_AT"  # wall time of the launch: checkpoints newer than it are this attempt's

PHASES = ("startup", "load", "train", "save", "exited")


@dataclass(frozen=True)
class Handover:
    """Everything a rank needs from the supervisor. Empty fields mean "not supervised: use defaults"."""

    run_dir: str | None = None
    node: str | None = None
    attempt: int = 0
    ckpt_dir: str | None = None
    ckpt_local_dir: str | None = None
    local_resume_step: int | None = None
    ckpt_interval: int | None = None  # None: auto
    ckpt_async: bool | None = None
    resume_step: int | None = None
    resume_path: str | None = None
    heartbeat_dir: str | None = None
    heartbeat_interval_s: float | None = None
    step_log: str | None = None
    control_file: str | None = None
    collective_timeout_s: float | None = None
    stop_grace_s: float | None = None
    supervisor_pid: int | None = None
    launched_at: float | None = None

    @property
    def supervised(self) -> bool:
        return self.supervisor_pid is not None

    def to_env(self) -> dict[str, str]:
        pairs = {
            ENV_RUN_DIR: self.run_dir, ENV_NODE: self.node, ENV_ATTEMPT: self.attempt,
            ENV_CKPT_DIR: self.ckpt_dir, ENV_CKPT_LOCAL_DIR: self.ckpt_local_dir,
            ENV_LOCAL_RESUME_STEP: self.local_resume_step,
            ENV_CKPT_INTERVAL: "auto" if self.ckpt_interval is None else self.ckpt_interval,
            ENV_CKPT_ASYNC: None if self.ckpt_async is None else int(self.ckpt_async),
            ENV_RESUME_STEP: self.resume_step, ENV_RESUME_PATH: self.resume_path,
            ENV_HEARTBEAT_DIR: self.heartbeat_dir, ENV_HEARTBEAT_INTERVAL_S: self.heartbeat_interval_s,
            ENV_STEP_LOG: self.step_log, ENV_CONTROL_FILE: self.control_file,
            ENV_COLLECTIVE_TIMEOUT_S: self.collective_timeout_s, ENV_STOP_GRACE_S: self.stop_grace_s,
            ENV_SUPERVISOR_PID: self.supervisor_pid, ENV_LAUNCHED_AT: self.launched_at,
        }
        return {k: "" if v is None else str(v) for k, v in pairs.items()}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Handover:
        env = dict(os.environ if env is None else env)

        def get(name: str) -> str | None:
            return env.get(name) or None

        def num(name: str, kind: type) -> Any:
            v = get(name)
            if v is None:
                return None
            try:
                return kind(v)
            except ValueError:
                raise ValueError(f"{name}={v!r} is not a {kind.__name__}") from None

        interval = get(ENV_CKPT_INTERVAL)
        return cls(
            run_dir=get(ENV_RUN_DIR), node=get(ENV_NODE), attempt=num(ENV_ATTEMPT, int) or 0,
            ckpt_dir=get(ENV_CKPT_DIR), ckpt_local_dir=get(ENV_CKPT_LOCAL_DIR),
            local_resume_step=num(ENV_LOCAL_RESUME_STEP, int),
            ckpt_interval=None if interval in (None, "auto") else num(ENV_CKPT_INTERVAL, int),
            ckpt_async=None if get(ENV_CKPT_ASYNC) is None else get(ENV_CKPT_ASYNC) == "1",
            resume_step=num(ENV_RESUME_STEP, int), resume_path=get(ENV_RESUME_PATH),
            heartbeat_dir=get(ENV_HEARTBEAT_DIR), heartbeat_interval_s=num(ENV_HEARTBEAT_INTERVAL_S, float),
            step_log=get(ENV_STEP_LOG), control_file=get(ENV_CONTROL_FILE),
            collective_timeout_s=num(ENV_COLLECTIVE_TIMEOUT_S, float),
            stop_grace_s=num(ENV_STOP_GRACE_S, float), supervisor_pid=num(ENV_SUPERVISOR_PID, int),
            launched_at=num(ENV_LAUNCHED_AT, float),
        )


# ---------------------------------------------------------------------------------------------------
# Heartbeats: one JSON file per rank, rewritten whole (temp + rename) at most once per interval.

HEARTBEAT_SCHEMA = 1


def heartbeat_path(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank_{rank}.json"


NO_FINISH = "exited without finish()"  # a rank's last exit_reason: its script ended without Session.finish


def fits(value: Any, hint: Any) -> bool:
    """`value`, read from JSON, holds what the annotation `hint` says (a float: finite, and a date can hold it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(fits(value, a) for a in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is float:  # a time or a fraction: finite, and a date can hold it
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and abs(value) < 1e12
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, origin or hint)


def described(hint: Any) -> str:
    """What the annotation `hint` asks for, in words, for a sentence on a damaged file (audit 15: "is not <class
    'int'>", "is not list[dict[str, Any]]")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(described(a) for a in args)
    words = {int: "an integer", float: "a number (finite, below 1e12)", str: "text", bool: "true or false",
             type(None): "null", Any: "anything"}
    if hint in words:
        return words[hint]
    if origin is list:
        return f"a list, each {described(args[0])}" if args else "a list"
    if origin is dict or hint is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))


@dataclass
class Heartbeat:
    """One rank's latest word. `seq` grows with every write, so a reader can tell a fresh beat from an old
    one without comparing clocks; `progress_at` moves only when `step` does."""

    rank: int
    pid: int
    attempt: int = 0
    local_rank: int = 0
    world_size: int = 1
    node: str = ""
    phase: str = "startup"
    step: int = 0
    seq: int = 0
    time: float = 0.0
    started_at: float = 0.0
    progress_at: float | None = None
    first_step_at: float | None = None
    steps_per_s: float | None = None
    own_steps_per_s: float | None = None  # steps/s counting only time not spent waiting at the step-end sync
    slowest_step_s: float | None = None  # the longest of this rank's last 100 steps (not its first), by its clock
    saving_step: int | None = None  # an async save in flight
    in_sync: bool = False  # waiting for the other ranks in the step-end agreement (not the one they wait for)
    last_save: dict[str, Any] | None = None
    log_dir: str | None = None
    restart_count: int = 0
    resumed_from: int | None = None  # the step this worker group loaded (None: fresh start)
    loading_step: int | None = None  # the checkpoint this rank is loading (or failed to load)
    loading_tier: str | None = None  # from which tier: "local" or "durable"
    resumed_tier: str | None = None  # the tier the group loaded from, and why (rank 0's words)
    resumed_why: str | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    schema_version: int = HEARTBEAT_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Heartbeat:
        """ValueError for a field that does not hold what it should: a damaged or foreign beat is skipped, where
        a step given as a string once stopped `status` and the supervisor in a TypeError (review 9)."""
        hints = _heartbeat_hints()
        for k, v in d.items():
            if k in hints and not fits(v, hints[k]):
                raise ValueError(f"heartbeat {k}: {v!r:.40} is not {hints[k]}")
        return cls(**{k: v for k, v in d.items() if k in hints})


def write_heartbeat(folder: str | os.PathLike, hb: Heartbeat) -> None:
    atomic_write_json(heartbeat_path(folder, hb.rank), hb.to_dict(), durable=False)


def pid_alive(pid: int) -> bool:
    """Whether a heartbeat's writer still runs (a process of another user counts as running)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def pid_running(pid: int) -> bool:
    """Whether a process of this machine still runs, a zombie not counted: a rank forked by a server that is not
    reaping it (stopped) stays a zombie, which pid_alive counts as alive."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


START_SLACK_S = 2.0  # psutil's creation time is whole-second coarse


def rank_process(pid: Any, started_at: Any) -> psutil.Process | None:
    """The running process a rank record names (its pid and the time the rank started), or None: gone, a zombie, or
    a pid another process took since (created after the rank started). `run` stops such ranks left by a dead
    supervisor, and `status` shows them alive (review 14: the two judged it each their own way)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        if isinstance(started_at, (int, float)) and p.create_time() > float(started_at) + START_SLACK_S:
            return None
        return p
    except psutil.Error:
        return None


@functools.cache
def _heartbeat_hints() -> dict[str, Any]:
    return typing.get_type_hints(Heartbeat)


def read_heartbeats(folder: str | os.PathLike) -> dict[int, Heartbeat]:
    """Every rank's heartbeat in `folder`; unreadable or foreign files are skipped."""
    out: dict[int, Heartbeat] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        try:
            d = read_json(Path(folder) / name)
            if d.get("schema_version") == HEARTBEAT_SCHEMA:
                hb = Heartbeat.from_dict(d)
                out[hb.rank] = hb
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return out


# ---------------------------------------------------------------------------------------------------
# The step log: each node's local rank 0 appends one JSON line per step as it completes, one per save
# (when training is unblocked), and global rank 0 one per commit. The supervisor tails it.


@dataclass(frozen=True)
class StepRecord:
    step: int
    t: float


@dataclass(frozen=True)
class SaveRecord:
    """The blocking part of a save of `step` ended at `t`, after `blocking_s`."""

    step: int
    t: float
    blocking_s: float


@dataclass(frozen=True)
class CommitRecord:
    """Checkpoint `step` was committed (marker written) at `t`, `persist_s` after the save began."""

    step: int
    t: float
    persist_s: float
    bytes: int


@dataclass(frozen=True)
class NoteRecord:
    """Something rank 0 warned of that the user should see without reading a rank's log (a stateful object the
    checkpoint holds and the run no longer declares: restarted, not restored)."""

    text: str
    t: float


LogRecord = StepRecord | SaveRecord | CommitRecord | NoteRecord


def step_line(step: int, t: float) -> str:
    return f'{{"step": {step}, "t": {t:.4f}}}\n'


def save_line(rec: SaveRecord) -> str:
    return json.dumps({"save": rec.step, "t": round(rec.t, 4), "blocking_s": round(rec.blocking_s, 5)}) + "\n"


def commit_line(rec: CommitRecord) -> str:
    return json.dumps({"commit": rec.step, "t": round(rec.t, 4), "persist_s": round(rec.persist_s, 4),
                       "bytes": rec.bytes}) + "\n"


def note_line(rec: NoteRecord) -> str:
    return json.dumps({"note": rec.text, "t": round(rec.t, 4)}) + "\n"


def parse_step_line(line: bytes | str) -> LogRecord | None:
    try:
        d = parse_json(line)
        if "step" in d:
            return StepRecord(int(d["step"]), float(d["t"]))
        if "save" in d:
            return SaveRecord(int(d["save"]), float(d["t"]), float(d["blocking_s"]))
        if "commit" in d:
            return CommitRecord(int(d["commit"]), float(d["t"]), float(d["persist_s"]), int(d.get("bytes") or 0))
        if "note" in d:
            return NoteRecord(str(d["note"]), float(d["t"]))
    except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: a step of 1e999
        pass
    return None


class StepLogReader:
    """Incremental reader of a step log: `poll()` returns the records appended since the last call."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[LogRecord]:
        try:
            with os.fdopen(open_regular(self.path), "rb") as f:  # a FIFO put there would hang the reader
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unterminated last line waits for the rest
        return [rec for rec in map(parse_step_line, lines) if rec is not None]


def read_step_log(path: str | os.PathLike) -> list[LogRecord]:
    return StepLogReader(path).poll()


# ---------------------------------------------------------------------------------------------------
# The control file: the supervisor's running instructions to rank 0 (for now: the checkpoint interval
# chosen by "auto"). Rank 0 reads it at most once per heartbeat interval and broadcasts the value.


def last_logged_step(path: str | os.PathLike, window: int = 65536) -> int | None:
    """The last step a step log records, from its tail (a long run's log holds millions of lines)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - window))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        rec = parse_step_line(line)
        if isinstance(rec, StepRecord):
            return rec.step
    return None


@dataclass(frozen=True)
class Control:
    ckpt_interval: int | None = None
    why: str = ""
    written_at: float = field(default_factory=time.time)


def write_control(path: str | os.PathLike, control: Control) -> None:
    atomic_write_json(path, asdict(control), durable=False)


def read_control(path: str | os.PathLike) -> Control | None:
    try:
        d = read_json(path)
        return Control(d.get("ckpt_interval"), d.get("why", ""), d.get("written_at", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
