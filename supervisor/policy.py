"""The restart policy: after a failed attempt, relaunch (after how long, from where) or stop, and why.

- configuration and import errors stop at once: retrying cannot help;
- a `nan` exit rolls back once to the valid checkpoint before the newest, then stops;
- `crash_loop_attempts` consecutive failures without a new valid checkpoint stop as a crash loop;
- `max_restarts` relaunches at most; preemptions do not count: the supervisor's own stop ends the run before any
  decision, and a stop it did not ask for (another node's supervisor stopped, whose ranks told the group; a
  SIGTERM to a rank) is a change of membership, as torchrun counts it, not a failure. The crash-loop rule still
  bounds stops that keep coming before any new checkpoint;
- backoff doubles per consecutive failure without progress, up to `max_backoff_s`;
- a launch that failed in the rendezvous before any rank ran (a store that closed or vanished while the
  nodes relaunch) is retried after a short wait without spending the budget, until `rendezvous_s` has passed
  since the first such launch began (its `began`: the launch itself where no rank of it ever started, all its
  time being torchrun's wait in the rendezvous; otherwise its failure);
- a checkpoint the ranks could not load is set aside (quarantined) and the run falls back to the next older
  valid one when a full check finds it corrupt, or when it checks whole yet fails to load twice (once, when
  the error says its names or shapes are not the run's: no retry changes that); the latter once per run, since
  every checkpoint failing to load says the code or model changed, not the files. The run stops for a bad
  checkpoint only when no older valid one exists. A fallback is not "no progress".
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from supervisor import api
from supervisor.api import AttemptOutcome, Decision
from supervisor.config import RestartConfig
from supervisor.state import RunState

# A load that failed because the checkpoint and the run's state differ in names or shapes (DCP's planner, or our
# storage layer resharding): no retry of the same bytes can change that, so it is not tried twice.
MISMATCH = re.compile(r"Size mismatch between saved|Missing key in checkpoint state_dict|the checkpoint holds .*, "
                      r"this run wants")


@dataclass(frozen=True)
class LoadFailure:
    """What the supervisor found after the ranks failed to load checkpoint `step`."""

    step: int
    corrupt: str | None  # why a full check failed; None: every byte matches its checksum
    older_valid: int | None  # the newest valid checkpoint below it
    local: bool = False  # it was this node's local copy: set it aside, the durable tier or an older one serves


@dataclass
class RestartPolicy:
    cfg: RestartConfig
    restarts: int = 0
    no_progress: int = 0  # consecutive failed attempts that committed no new valid checkpoint
    nan_rollbacks: int = 0
    failures: list[AttemptOutcome] = field(default_factory=list)
    rendezvous_s: float = 600.0
    rendezvous_since: float | None = None  # when the current run of rendezvous failures began
    load_failures: dict[int, int] = field(default_factory=dict)  # checkpoint step -> failed loads
    unloadable: list[int] = field(default_factory=list)  # whole checkpoints passed over: they failed to load twice

    def decide_rendezvous(self, outcome: AttemptOutcome, now: float, began: float | None = None) -> Decision:
        """A launch that never got its ranks started: retry soon, bounded in time, not counted.

        Args:
            outcome: how the launch ended.
            now: the time of the decision.
            began: when the launch that failed began (default `now`). The first of a run of such failures starts
                the window: a torchrun that waited out `join_timeout` for a node that never came has used it up,
                so the others are held about `join_timeout`, not twice that.
        """
        if self.rendezvous_since is None:
            self.rendezvous_since = now if began is None else min(began, now)
        waited = now - self.rendezvous_since
        if waited > self.rendezvous_s:
            return self._stop(f"the group could not be formed in {waited:.0f}s since the first launch that failed "
                              f"(join_timeout {self.rendezvous_s:.0f}s): {outcome.detail}")
        wait = min(2.0, self.cfg.max_backoff_s)
        return Decision(True, wait_s=wait, counts_as_restart=False,
                        message=f"rendezvous retry in {wait:.1f}s ({waited:.0f}s of {self.rendezvous_s:.0f}s)")

    def decide(self, outcome: AttemptOutcome, *, progressed: bool, newest_valid: int | None,
               older_valid: int | None, load: LoadFailure | None = None) -> Decision:
        """Decide after a failed attempt.

        Args:
            outcome: how the attempt ended.
            progressed: it committed a valid checkpoint newer than the one it started from.
            newest_valid: the newest valid checkpoint now.
            older_valid: the newest valid checkpoint below `newest_valid` (a NaN rollback target).
            load: for a CHECKPOINT_LOAD outcome, what a full check of that checkpoint found.
        """
        self.rendezvous_since = None
        self.failures.append(outcome)
        set_aside: tuple[int, str, bool] | None = None
        if load is not None:
            verdict = self._unloadable(load, outcome)
            if isinstance(verdict, Decision):
                return verdict
            set_aside = verdict
        decision = self._after(outcome, newest_valid, older_valid, load, set_aside, progressed)
        if not decision.relaunch and set_aside is not None and not set_aside[2]:
            # A checkpoint a full check found corrupt is set aside even when the run stops here (the budget is
            # spent, say): left in place, it was still "the newest valid" to status and to every rerun.
            step, why, _ = set_aside
            return dataclasses.replace(decision, quarantine_step=step, quarantine=why,
                                       quarantine_local=load is not None and load.local)
        return decision

    def _after(self, outcome: AttemptOutcome, newest_valid: int | None, older_valid: int | None,
               load: LoadFailure | None, set_aside: tuple[int, str, bool] | None, progressed: bool) -> Decision:
        self.no_progress = 0 if progressed else self.no_progress + (0 if set_aside else 1)
        if outcome.reason == api.CONFIG:
            return self._stop(f"a configuration or import error, which a restart cannot fix: {outcome.detail}")
        resume_below = None
        if outcome.reason == api.NAN:
            if self.nan_rollbacks >= 1:
                return self._stop(f"the loss became non-finite again after a rollback: {outcome.detail}")
            if older_valid is None:
                return self._stop(f"the loss became non-finite and there is no earlier valid checkpoint to roll "
                                  f"back to: {outcome.detail}")
            self.nan_rollbacks += 1
            resume_below = newest_valid
        elif not outcome.retryable:
            return self._stop(f"{outcome.reason} is not retryable: {outcome.detail}")
        if self.no_progress >= self.cfg.crash_loop_attempts:
            recent = self.failures[-self.no_progress:]
            steps = sorted({o.step for o in recent if o.step})  # step 0: a fresh start's ranks ran no step
            at = ("before their first step" if not steps else f"at step {steps[0]}" if len(steps) == 1
                  else f"at steps {', '.join(map(str, steps))}")
            return self._stop(f"crash loop: {self.no_progress} consecutive attempts made no new valid checkpoint, "
                              f"failing {at} ({outcome.reason}: {outcome.detail})")
        wait = min(self.cfg.max_backoff_s, self.cfg.backoff_s * (2 ** max(0, self.no_progress - 1)))
        if outcome.reason == api.PREEMPTED:
            return Decision(True, wait_s=wait, counts_as_restart=False,
                            message=f"relaunch in {wait:.1f}s after a stop that came from elsewhere, not counted "
                                    f"({self.restarts}/{self.cfg.max_restarts} restarts used)")
        if self.restarts >= self.cfg.max_restarts:
            return self._stop(f"the restart budget is spent ({self.restarts}/{self.cfg.max_restarts} restarts); "
                              f"the last failure: {outcome.reason}: {outcome.detail}")
        self.restarts += 1
        left = self.cfg.max_restarts - self.restarts
        message = f"restart {self.restarts}/{self.cfg.max_restarts} ({left} left) in {wait:.1f}s"
        if set_aside is not None:
            step, why, later = set_aside
            local = load is not None and load.local
            return Decision(True, wait_s=wait, quarantine_step=step, quarantine=why, quarantine_local=local,
                            quarantine_once_older_loads=later, resume_below=step if later else None,
                            message=f"{message}, from the durable tier" if local else
                            f"{message}, from the checkpoint before step {step}")
        if resume_below is not None:  # a NaN's rollback, which holds until training passes it again (review 13:
            # any later relaunch chose the step rolled back past again, by its number): set aside once older loads
            return Decision(True, wait_s=wait, resume_below=resume_below, quarantine_step=resume_below,
                            quarantine=f"the loss became non-finite after it ({outcome.detail})",
                            quarantine_once_older_loads=True,
                            message=f"{message}, rolling back below step {resume_below}")
        return Decision(True, wait_s=wait, resume_below=resume_below, message=message)

    def _unloadable(self, load: LoadFailure, outcome: AttemptOutcome) -> Decision | tuple[int, str, bool] | None:
        """Set the checkpoint aside (step, why, only once an older one loads), try it once more (None), or stop
        (a Decision)."""
        if load.local and load.corrupt is not None:  # the durable copy (or an older local one) serves instead
            return load.step, f"{load.corrupt}: {outcome.detail}", False
        # A whole local copy is no different from a whole durable one: the same bytes fail the same way (the code
        # changed); it is tried again, then passed over, never set aside as if it were damaged.
        failed = self.load_failures[load.step] = self.load_failures.get(load.step, 0) + 1
        if load.corrupt is not None:
            why = f"{load.corrupt} (a full check after the ranks failed to load it)"
        elif failed < 2 and not MISMATCH.search(outcome.detail):
            return None  # whole: a passing fault (a filesystem hiccup) deserves one more try; a mismatch does not
        elif self.unloadable and load.step not in self.unloadable:
            return self._stop(f"checkpoint step {load.step} checks whole but failed to load {_tries(failed)}, as step "
                              f"{self.unloadable[0]} did before it: the checkpoints no longer match the training "
                              f"code or model, and both are left where they are ({outcome.detail}); change the code "
                              "back and `resilient run` again resumes from the newest, or train the new model in a "
                              "new run dir")
        else:
            self.unloadable.append(load.step)
            if load.older_valid is None:
                return self._stop(f"checkpoint step {load.step} checks whole but failed to load {_tries(failed)} "
                                  f"({outcome.detail}) and no older valid checkpoint exists; it is left where it "
                                  "is: if the training code changed, change it back, or move the checkpoint aside "
                                  "to start from step 0")
            why = f"every byte checks, but the ranks failed to load it {_tries(failed)}: {outcome.detail}"
            return load.step, why, True
        if load.older_valid is None:
            return dataclasses.replace(
                self._stop(f"checkpoint step {load.step} cannot be used ({why}: {outcome.detail}) and no older "
                           "valid checkpoint exists: it is set aside, and `resilient run` again starts from step 0"),
                quarantine_step=load.step, quarantine=f"{why}: {outcome.detail}")
        return load.step, f"{why}: {outcome.detail}", False

    @staticmethod
    def _stop(message: str) -> Decision:
        return Decision(False, final_state=RunState.FAILED, message=message)


def _tries(failed: int) -> str:
    return "twice" if failed >= 2 else "(its names or shapes are not this run's)"
