"""The beat thread: writes this rank's heartbeat and (rank 0) the step log, and watches the supervisor.

The training loop only updates fields in memory (`progress`, `set_phase`); file I/O happens here, at
most once per interval, so beating costs the loop nothing measurable. Because the thread keeps writing
while the main thread is inside a long save or load, a rank is "alive" as long as its process runs; a
rank stuck in a collective is still caught, because its `progress_at` stops moving.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from supervisor.protocol import (
    NO_FINISH,
    CommitRecord,
    Heartbeat,
    NoteRecord,
    SaveRecord,
    commit_line,
    note_line,
    read_control,
    save_line,
    step_line,
    write_heartbeat,
)

log = logging.getLogger("train_entry")

RECENT_STEPS = 100  # the window of step times the supervisor's stall rule scales from


class Beater:
    def __init__(self, hb: Heartbeat, folder: str | None, interval_s: float, *, step_log: str | None = None,
                 control_file: str | None = None, supervisor_pid: int | None = None,
                 on_orphaned: Callable[[], None] | None = None):
        self.hb = hb
        self.folder = folder
        self.interval_s = interval_s
        self.step_log = Path(step_log) if step_log else None
        self.control_file = control_file
        self.supervisor_pid = supervisor_pid
        self.on_orphaned = on_orphaned
        self.control_interval: int | None = None  # the supervisor's latest checkpoint interval, if any
        self._log_fd: int | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilient-heartbeat", daemon=True)
        self._rate_t: float | None = None
        self._rate_step = 0
        self._own_s = 0.0
        self._step_t: float | None = None
        self._durations: deque[float] = deque(maxlen=RECENT_STEPS)

    # ---- called from the training loop -------------------------------------------------------------

    def start(self) -> None:
        if self.folder:
            Path(self.folder).mkdir(parents=True, exist_ok=True)
        if self.step_log:
            self.step_log.parent.mkdir(parents=True, exist_ok=True)
            self._log_fd = os.open(self.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self._write()
        self._thread.start()
        # A rank that dies of an exception still leaves its last step and the error in its heartbeat.
        previous_hook = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: object) -> None:
            self.update(exit_code=1, exit_reason=f"{kind.__name__}: {value}"[:500])  # what Python exits with
            previous_hook(kind, value, tb)  # type: ignore[arg-type]

        sys.excepthook = excepthook
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if not self._stopped.is_set():
            self.stop(phase="exited", exit_reason=self.hb.exit_reason or NO_FINISH)

    def set_phase(self, phase: str, *, now: bool = False) -> None:
        with self._lock:
            self.hb.phase = phase
        if now:
            self._wake.set()

    def progress(self, step: int, own_s: float | None = None) -> None:
        """`step` is done; `own_s` is the part of its time this rank did not spend waiting for the others
        at the step-end sync (a straggler has a high one: the others wait for it)."""
        t = time.time()
        with self._lock:
            hb = self.hb
            if hb.first_step_at is None:
                hb.first_step_at = t
            hb.step, hb.progress_at, hb.phase = step, t, "train" if hb.phase != "save" else hb.phase
            if self._step_t is not None:  # the first step after (re)start carries warm-up: not a step time
                self._durations.append(t - self._step_t)
                hb.slowest_step_s = round(max(self._durations), 4)
            self._step_t = t
            self._own_s += own_s or 0.0
            if self._rate_t is None:
                self._rate_t, self._rate_step, self._own_s = t, step, 0.0
            elif t - self._rate_t >= 2.0:
                steps = step - self._rate_step
                hb.steps_per_s = round(steps / (t - self._rate_t), 3)
                if own_s is not None and self._own_s > 0:
                    hb.own_steps_per_s = round(steps / self._own_s, 3)
                self._rate_t, self._rate_step, self._own_s = t, step, 0.0
        self._append(step_line(step, t))  # at once, so a SIGKILL loses no completed step from the log

    def _append(self, line: str) -> None:
        if self._log_fd is not None:
            try:
                os.write(self._log_fd, line.encode())
            except OSError:
                log.exception("cannot append to the step log %s", self.step_log)

    def update(self, **fields: object) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.hb, k, v)

    def record_save(self, rec: SaveRecord) -> None:
        """The blocking part of a save ended (every rank; logged by the node's local rank 0)."""
        with self._lock:
            self.hb.last_save = {"step": rec.step, "blocking_s": rec.blocking_s, "committed": False}
        self._append(save_line(rec))

    def record_commit(self, rec: CommitRecord) -> None:
        """Global rank 0 committed a checkpoint."""
        with self._lock:
            self.hb.last_save = {"step": rec.step, "persist_s": rec.persist_s, "committed": True,
                                 "blocking_s": (self.hb.last_save or {}).get("blocking_s")}
        self._append(commit_line(rec))
        self._wake.set()

    def note(self, text: str) -> None:
        """A warning for the supervisor's console (logged by the node's local rank 0; the caller logs it too)."""
        self._append(note_line(NoteRecord(text, time.time())))

    def stop(self, **final: object) -> None:
        """Write the last heartbeat (with exit code and reason) and the remaining step lines, now."""
        self.update(**final)
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._write()

    # ---- the thread --------------------------------------------------------------------------------

    def _write(self) -> None:
        with self._lock:
            self.hb.seq += 1
            self.hb.time = time.time()
            snapshot = Heartbeat.from_dict(self.hb.to_dict())
        if self.folder:
            write_heartbeat(self.folder, snapshot)

    def _supervisor_gone(self) -> bool:
        if self.supervisor_pid is None:
            return False
        try:
            os.kill(self.supervisor_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _run(self) -> None:
        orphaned = False
        while not self._stopped.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stopped.is_set():
                break
            try:  # a background loop logs and keeps going: one bad write must not stop the beats
                self._write()
                if self.control_file:
                    control = read_control(self.control_file)
                    if control is not None and control.ckpt_interval:
                        self.control_interval = int(control.ckpt_interval)
                if not orphaned and self._supervisor_gone():
                    orphaned = True
                    log.warning("supervisor pid %s is gone: stopping at the next step", self.supervisor_pid)
                    if self.on_orphaned is not None:
                        self.on_orphaned()
            except Exception:
                log.exception("heartbeat write failed; retrying in %.1fs", self.interval_s)
