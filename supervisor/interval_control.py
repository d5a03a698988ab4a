"""The checkpoint interval in force: the job's fixed one, or `auto`'s choice (`interval.IntervalTuner`), told to
rank 0 through the control file when it moves enough to be worth a change. The run loop feeds it the step log
and asks it again after each measurement; what it shows goes to the run's record."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.config import CheckpointConfig
from supervisor.interval import IntervalTuner
from supervisor.protocol import CommitRecord, Control, LogRecord, SaveRecord, StepRecord, write_control


class IntervalControl:
    def __init__(self, ck: CheckpointConfig, control_file: Path, memory: object,
                 announce: Callable[[str], None]):
        """`memory`: what the run's earlier supervisors measured (the tuner's, from the record)."""
        self.control_file, self._announce = control_file, announce
        self._fixed = ck.interval_steps
        self.tuner = IntervalTuner(ck.expected_mtbf_s, ck.min_interval_steps, ck.max_interval_steps) \
            if ck.auto else None
        if self.tuner is not None:
            self.tuner.restore(memory)
        self.steps: int | None = ck.interval_steps  # in force (None: auto, nothing told yet)
        self._measured = False  # the interval in force came from measurements (not the cold start)

    @property
    def auto(self) -> bool:
        return self.tuner is not None

    def start(self) -> dict[str, Any] | None:
        """A fixed interval's record (a stale `auto` choice in the control file must not override it)."""
        if self.tuner is not None:
            return None
        self.control_file.unlink(missing_ok=True)
        return {"mode": "fixed", "steps": self._fixed, "why": "checkpoint.interval_steps in the job file"}

    def new_attempt(self) -> None:
        if self.tuner is not None:
            self.tuner.new_attempt()

    def measure(self, records: list[LogRecord]) -> bool:
        """Feed the step log's records; True when a save's cost became known (time to choose again): a
        background save's once the step in progress at its commit is logged."""
        if self.tuner is None:
            return False
        before = self.tuner.measured
        for r in records:
            if isinstance(r, StepRecord):
                self.tuner.on_step(r.step, r.t)
            elif isinstance(r, SaveRecord):
                self.tuner.on_save(r.step, r.blocking_s)
            elif isinstance(r, CommitRecord):
                self.tuner.on_commit(r.step, r.persist_s)
        return self.tuner.measured != before

    def choose(self, observed_s: float, failures: int, restart_s: float | None) -> dict[str, Any]:
        """`auto`'s choice now; told to rank 0 when it moves by 10 % and 2 steps or more (at a few steps, 10 % is
        less than one: it flapped between neighbours at every save). Returns what the record shows."""
        assert self.tuner is not None
        choice = self.tuner.choose(observed_s, failures, restart_s)
        # The first measured choice is taken at once; after it, a move waits for a few save costs (the median of
        # one or two flapped between them at every save).
        may_move = not self._measured or self.tuner.settled
        if self.steps is None or (may_move and abs(choice.steps - self.steps) >= max(0.1 * self.steps, 2)):
            write_control(self.control_file, Control(choice.steps, choice.why))
            if self.steps is not None or choice.seconds is not None:
                moved = f"{self.steps} → " if self.steps is not None else ""  # a rerun's first: no arrow
                self._announce(f"checkpoint interval {moved}{choice.steps} steps ({choice.why})")
            self.steps = choice.steps
            self._measured = choice.seconds is not None
        shown = choice.to_dict()  # `steps` is the interval in force; a choice not (yet) taken is shown beside
        if shown["steps"] != self.steps:
            shown.update(steps=self.steps, proposed_steps=choice.steps)
        return shown

    def memory(self) -> dict[str, list[float]] | None:
        return self.tuner.memory() if self.tuner is not None else None
