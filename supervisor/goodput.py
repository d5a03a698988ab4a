"""Goodput accounting: where the wall time of a run went, from events the supervisor already sees.

Per attempt, on the wall clock of the node (launch and end from the supervisor, steps and saves from the
step log of the node's local rank 0):

    startup   launch → first completed step (imports, rendezvous, loading the checkpoint, first step)
    train     first step → last step; of which
      blocking    training blocked by checkpoint saves
      lost        steps re-executed later: those beyond the step the next attempt resumed from
    tail      last step → end of the attempt (the final or stop checkpoint and exit; or detecting a failure
              and stopping the processes)
    stalled   a detected hang (or a stop a silent rank outlasted), from the hung rank's last sign of progress to
              its detection: taken out of the kept training, the lost steps or the tail, wherever it fell
    down      end of an attempt → launch of the next (classifying, backoff)

useful = train − lost − blocking (of the kept steps) − stalled; goodput = useful / wall, where wall is the time
a supervisor was running (summed over `resilient run` invocations: time with no supervisor is not charged).
Startup, useful, blocking, stalled, lost, tail and down do not overlap: they add up to the wall time but for
the supervisor's own start and finish.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KEEP_SAVES = 32


@dataclass
class AttemptAccount:
    attempt: int
    launched_at: float
    resume_step: int | None
    first_step_at: float | None = None
    last_step: int | None = None
    last_step_at: float | None = None
    ended_at: float | None = None
    steps_run: int = 0
    blocking_s: float = 0.0
    saved_at: dict[str, float] = field(default_factory=dict)  # saved step (str, for JSON) → when it completed
    blocking_by_step: dict[str, float] = field(default_factory=dict)
    lost_steps: int = 0
    lost_s: float = 0.0
    lost_blocking_s: float = 0.0
    finalized: bool = False
    relaunch: bool = False  # launched by the supervisor that saw the previous attempt end (not a later rerun)
    stall_since: float | None = None  # a detected hang: the hung rank's last sign of progress
    stall_until: float | None = None  # ... and its detection

    @property
    def train_s(self) -> float:
        if self.first_step_at is None or self.last_step_at is None:
            return 0.0
        return self.last_step_at - self.first_step_at

    @property
    def startup_s(self) -> float:
        end = self.first_step_at if self.first_step_at is not None else (self.ended_at or self.launched_at)
        return max(0.0, end - self.launched_at)

    def _stall_in(self, start: float | None, end: float | None) -> float:
        """The part of a detected hang between `start` and `end`."""
        if self.stall_since is None or self.stall_until is None or start is None or end is None:
            return 0.0
        return max(0.0, min(self.stall_until, end) - max(self.stall_since, start))

    @property
    def tail_s(self) -> float:
        """Last step → end, but a hang in it (that is `stalled_s`)."""
        if self.ended_at is None:
            return 0.0
        start = self.last_step_at if self.last_step_at is not None else self.ended_at
        return max(0.0, self.ended_at - start - self._stall_in(start, self.ended_at))

    @property
    def lost_work_s(self) -> float:
        """The lost steps' time, but a hang among them (that is `stalled_s`)."""
        if not self.lost_s or self.last_step_at is None:
            return self.lost_s
        return max(0.0, self.lost_s - self._stall_in(self.last_step_at - self.lost_s, self.last_step_at))

    @property
    def blocking_inside_s(self) -> float:
        """Blocking by saves of the kept steps while training: a save of the last step (the final or a stop
        save) blocks after training ended, in the tail; the blocking of lost steps is in `lost_s`."""
        after_last = self.blocking_by_step.get(str(self.last_step), 0.0) if self.last_step is not None else 0.0
        return max(0.0, self.blocking_s - self.lost_blocking_s - (after_last if not self.lost_steps else 0.0))

    @property
    def stalled_s(self) -> float:
        """A detected hang from the first step on, wherever it fell: in the kept training, among the lost steps,
        or after the last step (audit 16: the same 20 s hang was `hung`, `tail` or `lost` by what followed it).
        Before the first step it is startup."""
        if self.first_step_at is None or self.last_step_at is None:
            return 0.0
        return self._stall_in(self.first_step_at, self.ended_at if self.ended_at is not None else self.last_step_at)

    @property
    def useful_s(self) -> float:
        kept_stall = self._stall_in(self.first_step_at, None if self.last_step_at is None else
                                    self.last_step_at - self.lost_s)
        return max(0.0, self.train_s - self.lost_s - self.blocking_inside_s - kept_stall)


@dataclass
class Accounting:
    attempts: list[AttemptAccount] = field(default_factory=list)
    wall_before_s: float = 0.0  # supervised wall time of earlier `resilient run` invocations
    session_started: float | None = None
    down_s: float = 0.0
    in_backoff: bool = False  # between a failed attempt and the next launch: the down time so far is shown live

    # ---- events -----------------------------------------------------------------------------------

    def start_session(self, t: float) -> None:
        self.session_started = t

    def end_session(self, t: float) -> None:
        if self.in_backoff:  # the run ends in a backoff (nothing left to choose): its wait was down time
            self.down_until(t)
        if self.session_started is not None:
            self.wall_before_s += t - self.session_started
            self.session_started = None

    def launch(self, attempt: int, t: float, resume_step: int | None) -> None:
        self.in_backoff = False
        relaunch = False
        if self.attempts:
            prev = self.attempts[-1]
            self._charge_back(self.attempts, resume_step)
            if prev.ended_at is not None and self.session_started is not None and prev.ended_at >= self.session_started:
                self.down_s += max(0.0, t - prev.ended_at)
                relaunch = True
        self.attempts.append(AttemptAccount(attempt, t, resume_step, relaunch=relaunch))

    def down_until(self, t: float) -> None:
        """The session ends between attempts (a stop in the backoff): the time since this session's last attempt
        ended is down time, as it is when a relaunch follows (audit 8: the parts no longer added up to the wall)."""
        self.in_backoff = False
        self.down_s += self._down_since_end(t)

    def _down_since_end(self, t: float) -> float:
        """Time since this session's last attempt ended, if it did in this session."""
        prev = self.attempts[-1] if self.attempts else None
        if prev is not None and prev.ended_at is not None and self.session_started is not None \
                and prev.ended_at >= self.session_started:
            return max(0.0, t - prev.ended_at)
        return 0.0

    def resumed(self, step: int | None) -> None:
        """The ranks of the current attempt resumed from `step`, which may differ from what it was launched with
        (the nodes agreed on another, or they read a newer local-tier copy): charge the previous attempt again."""
        if not self.attempts:
            return
        a = self.attempts[-1]
        if step == a.resume_step:
            return
        a.resume_step = step
        self._charge_back(self.attempts[:-1], step)

    def _charge_back(self, earlier: list[AttemptAccount], resume_step: int | None) -> None:
        """Charge every earlier attempt for its steps that a later attempt redoes: an attempt keeps its steps up
        to the lowest step any later attempt resumed from (a rollback after a NaN can go back past where the
        last attempt began, into older ones). Made anew each time: a resume step can still move."""
        low = resume_step or 0
        for a in reversed(earlier):
            a.finalized, a.lost_steps, a.lost_s, a.lost_blocking_s = False, 0, 0.0, 0.0
            self.finalize(a, low)
            low = min(low, a.resume_step or 0)

    def step(self, step: int, t: float) -> None:
        a = self.attempts[-1]
        if a.first_step_at is None:
            a.first_step_at = t
        a.last_step, a.last_step_at = step, t
        a.steps_run += 1

    def save(self, step: int, blocking_s: float) -> None:
        """A save of `step` blocked training for `blocking_s` (it follows the step's own record)."""
        a = self.attempts[-1]
        a.blocking_s += blocking_s
        key = str(step)
        a.blocking_by_step[key] = a.blocking_by_step.get(key, 0.0) + blocking_s
        if a.last_step == step and a.last_step_at is not None:
            a.saved_at[key] = a.last_step_at  # only saved steps can be where a later attempt resumes
        for d in (a.saved_at, a.blocking_by_step):  # bounded: resume points are among the newest saves
            for old in list(d)[:-KEEP_SAVES]:
                del d[old]

    def end(self, t: float) -> None:
        self.attempts[-1].ended_at = t

    def ranks_went_on(self, attempt: int, step: int | None) -> None:
        """Attempt `attempt`, whose supervisor died, was trained on to `step` by its ranks (their step log says,
        until torchrun's SIGTERM reached them): those steps are charged when lost, as any (audit 13: lost 88 of
        350 - 260). Times stay the dead supervisor's: the wall clock counts only while a supervisor ran."""
        a = self.attempts[-1] if self.attempts else None
        if a is not None and a.attempt == attempt and step is not None and a.last_step is not None \
                and step > a.last_step:
            a.last_step = step

    def stalled(self, since: float, until: float) -> None:
        """The current attempt hung from `since` (its last progress) until it was detected at `until`."""
        a = self.attempts[-1]
        a.stall_since, a.stall_until = since, until

    def settle(self, newest_valid: int | None) -> None:
        """The run ends here (stopped, failed): what a rerun will redo, beyond the newest valid checkpoint, is
        lost now. A rerun's launch charges again from where it really resumes."""
        if self.attempts:
            self._charge_back(self.attempts, newest_valid)

    def finalize(self, a: AttemptAccount, resume_step: int | None) -> None:
        """Charge the work of attempt `a` that the next attempt (resuming from `resume_step`) redoes."""
        if a.finalized:
            return
        a.finalized = True
        if a.last_step is None or a.last_step_at is None:
            return
        start = a.resume_step or 0
        r = resume_step or 0
        if r >= a.last_step:
            return
        kept_until = max(r, start)
        a.lost_steps = a.last_step - kept_until
        t_kept = a.saved_at.get(str(kept_until)) if kept_until > start else None
        if t_kept is not None:
            a.lost_s = a.last_step_at - t_kept
        elif kept_until > start and a.steps_run > 1:  # a save no step log of this supervisor's showed (its ranks
            # committed it after it died): the lost steps at the attempt's own pace, not its whole training (audit 17)
            a.lost_s = min(a.train_s, a.lost_steps * a.train_s / (a.steps_run - 1))
        else:
            a.lost_s = a.train_s
        a.lost_blocking_s = sum(b for s, b in a.blocking_by_step.items() if int(s) > kept_until)

    # ---- results ----------------------------------------------------------------------------------

    def restart_costs(self) -> list[float]:
        """Per relaunch: last step of the failed attempt → first step of the next one; only where one supervisor
        saw both (a stop and a later rerun is no restart cost: hours with no supervisor would count)."""
        out = []
        for prev, cur in zip(self.attempts, self.attempts[1:], strict=False):
            if cur.relaunch and prev.last_step_at is not None and cur.first_step_at is not None:
                out.append(max(0.0, cur.first_step_at - prev.last_step_at))  # a clock stepped back: no cost
        return out

    def summary(self, now: float) -> dict[str, Any]:
        wall = self.wall_before_s + (now - self.session_started if self.session_started is not None else 0.0)
        useful = sum(a.useful_s for a in self.attempts)
        out = {
            "wall_s": wall,
            "useful_s": useful,
            "startup_s": sum(a.startup_s for a in self.attempts),
            "train_s": sum(a.train_s for a in self.attempts),
            "checkpoint_blocking_s": sum(a.blocking_inside_s for a in self.attempts),
            "stalled_s": sum(a.stalled_s for a in self.attempts),
            "lost_steps": sum(a.lost_steps for a in self.attempts),
            "lost_s": sum(a.lost_work_s for a in self.attempts),
            "tail_s": sum(a.tail_s for a in self.attempts),
            # a backoff under way, live (audit 17: booked only at the launch, the parts fell short by it)
            "down_s": self.down_s + (self._down_since_end(now) if self.in_backoff else 0.0),
            "open_s": self._open_s(now),
            "attempts": len(self.attempts),
            "goodput": useful / wall if wall > 0 else None,
        }
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}

    def _open_s(self, now: float) -> float:
        """The running attempt's time since its last step (or its launch) that no part holds yet: it becomes
        train, startup, hung, lost or tail once the attempt steps again or ends (audit 16: while a hang was not yet
        detected the parts fell up to 20 s short of the wall time, with nothing to say where it went)."""
        a = self.attempts[-1] if self.attempts else None
        if a is None or a.ended_at is not None:
            return 0.0
        return max(0.0, now - (a.last_step_at if a.last_step_at is not None else a.launched_at))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, *, last_seen: float | None = None) -> Accounting:
        """Restore a ledger. A session that never ended (its supervisor was killed) is charged up to
        `last_seen`, the last time that supervisor wrote its state."""
        if not d:
            return cls()
        attempts = [AttemptAccount(**a) for a in d.get("attempts", [])]
        wall, down = float(d.get("wall_before_s", 0.0)), float(d.get("down_s", 0.0))
        if d.get("session_started") is not None and last_seen is not None:
            wall += max(0.0, last_seen - float(d["session_started"]))
            if attempts and attempts[-1].ended_at is None:  # its supervisor died during it: ended when last seen
                attempts[-1].ended_at = max(last_seen, attempts[-1].last_step_at or last_seen)
            elif attempts and d.get("in_backoff"):  # it died in a backoff: down until last seen (review 15)
                down += max(0.0, last_seen - max(attempts[-1].ended_at or last_seen, float(d["session_started"])))
        return cls(attempts, wall, None, down)
