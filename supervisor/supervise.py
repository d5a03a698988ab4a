"""The supervision loop: choose a checkpoint, run an attempt, decide, relaunch.

    while True:
        choice   = newest valid checkpoint, corrupt newer ones set aside (supervisor/resume.py)
        outcome  = Attempt(...).run()        launch, watch, stop (supervisor/attempt.py)
        decision = finished? stopped? else the restart policy (supervisor/policy.py)

The Supervisor owns what outlives one attempt: the run's record and state file, the history, goodput
accounting, the `auto` interval, retention and the local tier's replicator.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from supervisor import api, ranklogs, retention, run_record, state, store
from supervisor.api import AttemptOutcome, AttemptSpec, Decision, ResumeChoice
from supervisor.attempt import Attempt, Launcher
from supervisor.config import JobConfig
from supervisor.console import EventConsole
from supervisor.errors import ExitCode
from supervisor.fsutil import NO_ROOM, atomic_write_json
from supervisor.goodput import Accounting
from supervisor.interval_control import IntervalControl
from supervisor.layout import CONTROL_FILE, RunLayout, inside, recorded
from supervisor.policy import RestartPolicy
from supervisor.protocol import (
    CommitRecord,
    Handover,
    NoteRecord,
    SaveRecord,
    StepRecord,
)
from supervisor.rdzv import Generations, run_id
from supervisor.replicate import Replicator
from supervisor.resume import ResumeChooser
from supervisor.state import AttemptRecord, RunState

log = logging.getLogger("resilient")

STATE_EVERY_S = 1.0
REPLICATION_DRAIN_S = 600.0  # a finished run waits this long at most for its last durable copies
STOP_POLL_S = 0.05  # how soon a stop cuts a restart's backoff short
MAX_NOTES = 10  # rank 0's warnings kept for `status`: the newest


class Supervisor:
    def __init__(self, cfg: JobConfig, layout: RunLayout, *, launcher: Launcher,
                 console: EventConsole | None = None, clock: Callable[[], float] = time.monotonic,
                 keep_claims: Callable[[], Iterable[str | None]] = lambda: (), adopted_root: bool = False):
        self.cfg, self.layout, self.launcher = cfg, layout, launcher
        self.adopted_root = adopted_root  # the root's checkpoints recorded no owner: nothing trimmed at the start
        # the roots' claims made again if a root was wiped (each record write); a sentence for one another run took
        self.keep_claims = keep_claims
        self._farewell: Callable[[dict[str, Any]], str] | None = None  # a finished run's last line, from its books
        self.console = console or EventConsole(cfg.name)
        self.clock = clock
        self.policy = RestartPolicy(cfg.restart, rendezvous_s=float(cfg.rdzv.conf.get("join_timeout", 600)))
        self._stop_signal: int | None = None
        self._stops_since = 0
        self._launched_at: float | None = None  # when the current attempt began (self.clock())
        self._blocking: dict[int, float] = {}
        self._announced: set[tuple[int, int]] = set()  # (attempt, step): a rollback's attempt commits a step again
        self._owned: set[tuple[int, int]] = set()  # those whose commit record this node's rank 0 logged
        self._inspected = store.InspectCache()  # retention scans the root at every commit
        self.record, prev_updated_at = run_record.open_record(cfg, layout, self.console)
        self.accounting = Accounting.from_dict(self.record.accounting.get("ledger"), last_seen=prev_updated_at)
        if (lost := self.record.history[-1] if self.record.history else None) and lost.reason == api.SUPERVISOR_LOST:
            self.accounting.ranks_went_on(lost.attempt, lost.step_at_failure)
        self._restarts_before = self.record.restarts  # the budget is per invocation; the count is not
        ck = cfg.checkpoint
        self.interval = IntervalControl(ck, layout.node_dir / CONTROL_FILE, self.record.accounting.get("tuner"),
                                        announce=self.console.event)
        # Several nodes: each formation of the group gets its own rendezvous run id (supervisor/rdzv.py).
        self.generations = Generations(cfg.run_dir) if cfg.rdzv.endpoint is not None else None
        self._generation = self.generations.current() if self.generations else None
        self._last_state_write = 0.0
        self._state_write_error: str | None = None  # the last write of state.json failed (a full disk): said once
        # A node-local tier: the ranks save there, this node's part is copied to the durable tier in the background.
        self.local_root = ck.local_root(layout.node_name)
        self.replicator = (Replicator(self.local_root, ck.dir, layout.node_name,
                                      keep_local=ck.keep_local, keep=ck.keep, outage_s=ck.durable_outage_s,
                                      announce=lambda text, style: self.console.event(text, style=style))
                           if self.local_root is not None else None)
        previous = self.record.replication or {}
        if self.replicator is not None and previous.get("durable_root") == recorded(str(ck.dir), cfg.run_dir):
            self.replicator.carry_outage(previous, prev_updated_at)  # the same durable tier: its outage goes on
        self.resume = ResumeChooser(ck, self.local_root, self.console, self._quarantined, self._next_attempt_number)

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            prepare = getattr(self.launcher, "prepare", None)
            if prepare is not None:  # the launcher's helpers start importing while we check checkpoints
                prepare(self.cfg)
            self.layout.node_dir.mkdir(parents=True, exist_ok=True)
            job = self.cfg.to_dict(relative_to=self.cfg.run_dir)
            # private: its env may hold a token (the checkpoints and state files are readable as the umask says)
            atomic_write_json(self.layout.job_file, {"schema_version": 1, "job": job}, durable=False, private=True)
        except BaseException as e:  # the helpers prepare() started go too; a full run dir is said as one
            self._close_launcher()
            if isinstance(e, OSError) and e.errno in NO_ROOM:
                return self._no_room(e)
            raise
        self.accounting.start_session(time.time())
        if self.replicator is not None:
            self.replicator.start()
        try:
            return self._loop()
        finally:
            self._close_launcher()
            if self.replicator is not None:
                self._drain_replication()
            self.accounting.end_session(time.time())
            self.save_state()
            if self._farewell is not None:
                self.console.event(self._farewell(self.record.accounting["summary"]), style="green")

    def _close_launcher(self) -> None:
        close = getattr(self.launcher, "close", None)
        if close is not None:
            close()

    def _drain_replication(self) -> None:
        """Before leaving: the local checkpoints not yet in the durable tier get their copy (bounded: a stop
        within the job's stop timeout; otherwise REPLICATION_DRAIN_S)."""
        assert self.replicator is not None
        snap = self.replicator.snapshot()
        durable = snap["newest_durable"] if snap["newest_durable"] is not None else -1
        pending = [s for s in snap["pending"] if s > durable]  # a step just published leaves the queue a moment later
        if pending:
            self.console.event(f"copying local step(s) {pending} to the durable tier before exiting")
        limit = self.cfg.stop_timeout_s if self._stop_signal is not None else REPLICATION_DRAIN_S
        asked, told = self._stop_signal, self._stops_since

        def stop() -> float | None:  # a signal during the copy: it gets the stop's own time, no more
            nonlocal asked, told
            if asked is None and self._stop_signal is not None:
                asked = self._stop_signal
                self.console.event(f"{signal.Signals(asked).name}: copying for up to {self.cfg.stop_timeout_s:.0f}s "
                                   "more, then exiting", style="yellow")
                return self.cfg.stop_timeout_s
            if self._stops_since > told:  # a second Ctrl-C: answered, as during the ranks' stop
                told = self._stops_since
                self.console.event(f"already stopping: copying to the durable tier for up to {limit:.0f}s; SIGKILL "
                                   f"the supervisor (pid {os.getpid()}) to abandon the copy", style="yellow")
            return None

        if not self.replicator.drain(limit, stop):
            left = self.replicator.snapshot()
            if left["pending"]:
                self.console.event(f"the durable tier still lacks local step(s) {left['pending']} "
                                   f"({left['last_error'] or 'still copying'}); `resilient run` again goes on "
                                   "copying", style="red")
            else:  # nothing queued, but the tiers could not be listed to know it
                self.console.event(f"could not check that the durable tier holds every local step "
                                   f"({left['last_error']}); `resilient run` again looks again", style="red")
        self.replicator.stop()

    def _loop(self) -> int:
        try:
            return self._attempts()
        except OSError as e:  # said as one sentence, the run's state left failed rather than running: the root's
            # scan between attempts (a flaky shared filesystem) as much as an attempt's own files
            return self._no_room(e) if e.errno in NO_ROOM else self._os_failure(e)

    def _attempts(self) -> int:
        self._start_interval()
        below: int | None = None
        first = True
        while True:
            if self._stop_signal is not None:
                return self._stopped(None)
            choice = self.resume.choose(below)
            if choice.step is None and self.resume.local_step is None and self.resume.set_aside_now:
                return self._all_damaged(self.resume.set_aside_now)
            if first:  # after the choice has set aside what it found corrupt: never trim good ones for those
                self._retain_at_start(choice.step)
                first = False
            spec = self._next_spec(choice)
            outcome = self._run_attempt(spec, choice)
            if outcome.reason == api.FINISHED:
                return self._finished(outcome)
            if outcome.reason == api.STOPPED:
                return self._stopped(outcome)
            decision = self._decide(outcome, choice)
            if not decision.relaunch:
                self.resume.set_aside(decision)  # a checkpoint found corrupt, even as the run stops
                return self._failed(decision.message, outcome, spec)
            if self._stop_signal is not None:  # the stop came with the failure: no restart to announce or count
                self.resume.set_aside(decision)
                return self._stopped(None)
            below = self._before_relaunch(decision)

    # ---- before an attempt ------------------------------------------------------------------------

    def _retain_at_start(self, chosen: int | None) -> None:
        """Checkpoints committed while no supervisor ran (the ranks of a killed one checkpoint and stop) were
        never trimmed: apply `keep` once before the first launch of a rerun, to the chosen checkpoint and older
        ones (a newer folder the choice passed over, unreadable to its full check, may look whole to retention's
        size check).
        One node, one tier only: with several, the node whose rank 0 commits trims (others may be loading), and
        the replicator keeps a local tier's."""
        if self.cfg.nnodes != "1" or self.replicator is not None or chosen is None or not self.record.history \
                or self.adopted_root:  # a root this run was only pointed at is not trimmed (audit 15, review 14)
            return
        done = self._keep(lambda info: info.step <= chosen)
        if done is None:
            return
        if done.removed:  # the valid ones were committed while no supervisor ran (the ranks of a killed one)
            self.console.event(f"before the first launch (keep {self.cfg.checkpoint.keep}): removed "
                               f"{retention.named(done.removed)}")
        for r, why in done.failed:
            self.console.event(f"could not remove {r.path.name}: {why}", style="yellow")

    def _keep(self, among: Callable[[store.CheckpointInfo], bool] = lambda info: True) -> Any:
        """Apply `keep` to the durable root's checkpoints `among` (all by default): what was really removed and
        what resisted (a read-only mount), or None when nothing was to go."""
        root = self.cfg.checkpoint.dir
        infos = [i for i in store.scan(root, cache=self._inspected) if among(i)]
        plan = retention.plan(root, infos, self.cfg.checkpoint.keep, owner_alive=True)
        return retention.apply(plan) if plan.remove else None

    def _quarantined(self, entry: dict[str, Any]) -> None:
        self.record.quarantined = [*self.record.quarantined, entry]
        if entry.get("step") == self.record.last_checkpoint_step:  # set aside: no longer the one to resume from
            with contextlib.suppress(OSError):  # (audit 17: status went on naming it, and called it "gone")
                self.record.last_checkpoint_step = self.resume.newest_step()  # in either tier

    def _next_attempt_number(self) -> int:
        """After the last recorded attempt, and after every attempt's logs folder (a history lost with a damaged
        state file must not make a new attempt write into an old one's logs and step log)."""
        last = self.record.history[-1].attempt if self.record.history else 0
        return max([last, *ranklogs.attempts(self.layout.node_dir)]) + 1

    def _next_spec(self, choice: ResumeChoice) -> AttemptSpec:
        attempt = self._next_attempt_number()
        rdzv = run_id(self.cfg.rdzv.id, self._generation) if self._generation is not None else None
        return AttemptSpec(attempt, choice.step, choice.path, self.layout.logs_dir(attempt),
                           self.layout.heartbeat_dir(attempt), self.layout.step_log(attempt),
                           self.interval.control_file, rdzv)

    def _handover(self, spec: AttemptSpec) -> Handover:
        c = self.cfg
        return Handover(
            run_dir=str(c.run_dir), node=self.layout.node, attempt=spec.attempt, ckpt_dir=str(c.checkpoint.dir),
            ckpt_local_dir=str(self.local_root) if self.local_root is not None else None,
            local_resume_step=self.resume.local_step,
            ckpt_interval=c.checkpoint.interval_steps, ckpt_async=c.checkpoint.async_save,
            resume_step=spec.resume_step, resume_path=str(spec.resume_path) if spec.resume_path else None,
            heartbeat_dir=str(spec.heartbeat_dir), heartbeat_interval_s=c.heartbeat.interval_s,
            step_log=str(spec.step_log), control_file=str(spec.control_file),
            collective_timeout_s=c.collective_timeout_s, stop_grace_s=c.stop_timeout_s, supervisor_pid=os.getpid(),
            launched_at=time.time())

    # ---- one attempt --------------------------------------------------------------------------------

    def _run_attempt(self, spec: AttemptSpec, choice: ResumeChoice) -> AttemptOutcome:
        rec = self._begin_attempt(spec, choice)
        attempt = Attempt(self.cfg, spec, self._handover(spec), self.launcher, self.console, rec, self.record,
                          listener=self, clock=self.clock)
        self._launched_at = self.clock()
        outcome = attempt.run()
        self._end_attempt(rec, outcome)
        return outcome

    def _begin_attempt(self, spec: AttemptSpec, choice: ResumeChoice) -> AttemptRecord:
        for d in (spec.logs_dir, spec.heartbeat_dir, spec.step_log.parent):
            d.mkdir(parents=True, exist_ok=True)
        if choice.skipped:
            (spec.logs_dir / "resume.json").write_text(json.dumps(
                {"resume_step": choice.step, "skipped": [{"folder": n, "why": w} for n, w in choice.skipped]},
                indent=2) + "\n")
        for name, why in choice.skipped:
            self.console.event(f"skipping {name}: {why}", style="yellow")
        start = f"resuming from step {choice.step} ({choice.path.name})" if choice.path else "starting fresh"
        if self.resume.local_step is not None and (choice.step is None or self.resume.local_step >= choice.step):
            start = (f"resuming from local step {self.resume.local_step} if every node holds it, else "
                     + (f"durable step {choice.step}" if choice.step is not None else "fresh"))
        self.console.event(f"attempt {spec.attempt}: launching {self.cfg.nnodes}×{self.cfg.nproc_per_node} ranks, "
                           f"{start}; logs in {spec.logs_dir}")
        rec = AttemptRecord(attempt=spec.attempt, started_at=time.time(), resumed_from_step=choice.step,
                            offered_local_step=self.resume.local_step,
                            log_dir=recorded(spec.logs_dir, self.cfg.run_dir),
                            skipped=[f"{n}: {w}" for n, w in choice.skipped] or None)
        self.accounting.launch(spec.attempt, rec.started_at, choice.step)
        self._sync_lost_steps()
        self.record.restarts = self._restarts_before + self.policy.restarts  # counted once it happens
        self.record.history.append(rec)
        self.record.attempt = spec.attempt
        if self.replicator is not None:
            self.replicator.loading = frozenset(s for s in (choice.step, self.resume.local_step) if s is not None)
        if choice.step is not None:  # until the ranks' first step, where they resume (audit 16: a killed supervisor's
            self.record.step = choice.step  # stale step and checkpoint showed, then "step 0" while the ranks loaded)
            if self.record.last_checkpoint_step is None or choice.step > self.record.last_checkpoint_step:
                self.record.last_checkpoint_step = choice.step
        self._transition(RunState.RUNNING)
        self.interval.new_attempt()
        self._retune()
        return rec

    def _end_attempt(self, rec: AttemptRecord, outcome: AttemptOutcome) -> None:
        rec.ended_at = time.time()
        self.record.stopping = None  # a stop under way ended with the attempt: its outcome says how
        self.accounting.end(rec.ended_at)
        if outcome.stalled is not None:  # steps run after a hang's detection leave its stall inside training
            self.accounting.stalled(*outcome.stalled)
        # The step log is the group's progress: rank 0 appends each step it completed, at once. Heartbeats
        # lag it by a beat, and can also lead it: a peer may finish step N+1 after rank 0 died inside it.
        logged = self.accounting.attempts[-1].last_step
        if logged is not None:
            outcome.step = self.record.step = logged
        rec.reason, rec.detail, rec.failed_rank = outcome.reason, outcome.detail, outcome.failed_rank
        # A rank's heartbeat says step 0 until it has loaded: "at step 0" after a resume from 150 misled.
        stepped = outcome.step is not None and (outcome.step > 0 or rec.first_step_at is not None)
        rec.exit_code = outcome.exit_code
        rec.step_at_failure = outcome.step if stepped and outcome.reason != api.FINISHED else None
        newest = self.resume.newest_step()  # authoritative, even if the step log lagged
        self.record.last_checkpoint_step = rec.last_checkpoint_step = newest
        self.save_state()
        if outcome.reason not in (api.FINISHED, api.STOPPED):
            where = f" at step {outcome.step}" if stepped else " before its first step"
            self.console.event(f"attempt {rec.attempt} failed{where}: {outcome.reason} — {outcome.detail}",
                               style="red")

    # ---- what an attempt tells us while it runs (AttemptListener) -----------------------------------

    def _sync_lost_steps(self) -> None:
        """Each attempt's lost steps in the history, as the ledger charges them now (a later resume can charge
        older attempts again)."""
        lost = {a.attempt: a.lost_steps for a in self.accounting.attempts}
        for h in self.record.history:
            if h.attempt in lost and h.ended_at is not None:
                h.lost_steps = lost[h.attempt]

    def on_records(self, records: list[Any], rec: AttemptRecord) -> None:
        for r in records:
            if isinstance(r, StepRecord):
                if rec.first_step_at is None:
                    rec.first_step_at = r.t
                    self.accounting.resumed(r.step - 1 or None)  # the first step done follows the one loaded
                    self._sync_lost_steps()
                    self.console.event(f"attempt {rec.attempt}: training (first step {r.step} after "
                                       f"{r.t - rec.started_at:.1f}s)")
                    spare = getattr(self.launcher, "spare", None)
                    if spare is not None:  # ready for the next relaunch, now that the imports are done
                        spare()
                self.record.step = r.step
                self.accounting.step(r.step, r.t)
            elif isinstance(r, SaveRecord):
                self.accounting.save(r.step, r.blocking_s)
                self._blocking[r.step] = r.blocking_s
            elif isinstance(r, CommitRecord):
                self.on_checkpoint(r, mine=True)
            elif isinstance(r, NoteRecord):
                self._note(r, rec)
        if self.interval.measure(records):
            self._retune()

    def _note(self, note: NoteRecord, rec: AttemptRecord) -> None:
        """A warning from rank 0 (a stateful object no longer declared, so restarted): on the console and in
        `status`, once per run however many attempts repeat it; the rank's log has it too."""
        if self._add_note(rec.attempt, note.text):
            self.console.event(f"attempt {rec.attempt}: rank 0 warns: {note.text}", style="yellow")
            self.save_state()

    def _warn_once(self, text: str) -> None:
        """The supervisor's own warning, as rank 0's: on the console and in `status`, once (written with the record
        being written now)."""
        if self._add_note(self.record.attempt, text):
            self.console.event(text, style="yellow")

    def _add_note(self, attempt: int, text: str) -> bool:
        if any(n.get("text") == text for n in self.record.notes):
            return False
        del self.record.notes[:-(MAX_NOTES - 1)]
        self.record.notes.append({"attempt": attempt, "step": self.record.step, "text": text})
        return True

    def on_checkpoint(self, commit: CommitRecord, mine: bool) -> None:
        """A new valid checkpoint: announce it once; the node whose rank 0 committed it applies retention."""
        key = (self.record.attempt, commit.step)
        if key in self._announced:
            if mine and key not in self._owned:  # the disk scan saw the folder before rank 0 logged its commit
                self._owned.add(key)
                if removed := self._own(commit):
                    self.console.event(f"after checkpoint step {commit.step}: {removed.removeprefix('; ')}")
            return
        self._announced.add(key)
        if mine:
            self._owned.add(key)
        self.record.last_checkpoint_step = commit.step
        if self.replicator is not None:  # a local commit: the replicator copies it and keeps both tiers' retention
            if mine:  # said before the replicator hears of it: its "in the durable tier" came first (audit 13)
                blocked = self._blocking.pop(commit.step, None)
                how = f"training blocked {blocked:.3f}s, " if blocked is not None else ""
                self.console.event(f"checkpoint step {commit.step} committed to the local tier ({how}"
                                   f"{commit.bytes / 1e6:.1f} MB in {commit.persist_s:.2f}s)")
                self._own(commit)
            self.save_state()
            return
        removed = self._own(commit) if mine else ""
        blocked = self._blocking.pop(commit.step, None)
        how = f"training blocked {blocked:.3f}s, " if blocked is not None else ""
        found = " (committed by rank 0 on another node)" if self.cfg.nnodes != "1" else " (found on disk)"
        took = f" in {commit.persist_s:.2f}s" if mine else found
        self.console.event(f"checkpoint step {commit.step} committed ({how}{commit.bytes / 1e6:.1f} MB{took})"
                           f"{removed}")
        self.save_state()

    def _own(self, commit: CommitRecord) -> str:
        """What the node whose rank 0 committed a checkpoint does: the replicator copies it (and keeps both tiers'
        retention); without one, retention is applied here, judged as of this commit (a newer one already on
        disk, with fast steps, is its own line's to count, or this one's "removed" would read as if fewer than
        `keep` were left). Returns what retention did, for the commit's line. Missed once: the disk scan announced
        the commit first, and a run kept one checkpoint more than `keep` (a flaky test found it)."""
        if self.replicator is not None:
            self.replicator.notify(commit.step)
            return ""
        done = self._keep(lambda info: info.step <= commit.step)
        if done is None:
            return ""
        removed = "; removed " + retention.named(done.removed) if done.removed else ""
        return removed + "".join(f"; could not remove {r.path.name}: {why}" for r, why in done.failed)

    def on_tick(self) -> None:
        self.save_state(force=False)

    def on_resumed(self, step: int | None, tier: str | None, launched_at: float) -> None:
        self.resume.resumed(step)
        if self.replicator is not None:
            self.replicator.loading = frozenset()  # loaded: retention may judge them as any
        # Charged again from where the ranks really resumed: an attempt that ends before its first step (a rerun
        # that resumes at the last step, newer in the local tier than the durable step it was launched with)
        # never corrects the launch's charge through a step record.
        self.accounting.resumed(step)
        self._sync_lost_steps()
        if self.replicator is not None and tier is not None:  # from either tier (review 16: after a resume from an
            # older local step every node held, this node's newer ones of the training left were copied on)
            self.replicator.pass_over_older_timeline(step, launched_at)

    def stop_signal(self) -> int | None:
        return self._stop_signal

    def request_stop(self, signum: int) -> None:
        """From a signal handler: stop gracefully (the ranks checkpoint), then exit 143/130. It sets one attribute
        and takes no lock: a handler runs between any two bytecodes of the main thread, and one that took a lock
        (a threading.Event's, as this did) could block for good on the lock it interrupted."""
        if self._stop_signal is None:  # the first decides the exit code; later ones are acknowledged
            self._stop_signal = signum
        else:
            self._stops_since += 1

    def stop_signals_since(self) -> int:
        return self._stops_since

    # ---- after a failed attempt ---------------------------------------------------------------------

    def _decide(self, outcome: AttemptOutcome, choice: ResumeChoice) -> Decision:
        self._next_generation(outcome)
        if outcome.reason == api.RENDEZVOUS:
            # No rank ever beat: the attempt was all torchrun's wait in the rendezvous, and that wait counts. One
            # whose ranks began (loading a large checkpoint, say) before the store went: the window starts now.
            began = self._launched_at if self.record.history[-1].world_size is None else None
            return self.policy.decide_rendezvous(outcome, self.clock(), began=began)
        progressed, newest, older = self.resume.progress(choice)
        return self.policy.decide(outcome, progressed=progressed, newest_valid=newest, older_valid=older,
                                  load=self.resume.load_failure(outcome, choice))

    def _next_generation(self, outcome: AttemptOutcome) -> None:
        """torchrun closed the rendezvous it formed (or found it closed): relaunch in the next one. A launch
        that never got that far (the store unreachable) retries the same generation."""
        if self.generations is None or self._generation is None:
            return
        if outcome.reason != api.RENDEZVOUS or "Closed" in outcome.detail:
            self._generation = self.generations.after(self._generation)

    def _before_relaunch(self, decision: Decision) -> int | None:
        """Set aside what the decision says, wait the backoff; returns the step to resume below, if any."""
        self.resume.set_aside(decision)
        self._settle()  # `status` in the backoff: the failed attempt's lost steps now (the launch charges anew)
        self.accounting.in_backoff = True  # and its down time as it grows
        # ended: the history row says how (audits 16, 17: listed as if training, a hang limit on, under the next
        # attempt's header)
        self.record.ranks = []
        self._transition(RunState.RESTARTING)
        if decision.resume_below is not None:
            if not decision.quarantine_once_older_loads:
                self.console.event(f"rolling back: resuming below step {decision.resume_below} once", style="yellow")
            if self.replicator is not None:
                self.replicator.roll_back(decision.resume_below)
        self.console.event(decision.message, style="yellow")
        self.record.next_launch_at = time.time() + decision.wait_s  # audit 16: status could not tell a backoff from
        self.save_state()  # a stuck supervisor
        self._wait_unless_stopped(decision.wait_s)
        self.record.next_launch_at = None
        return decision.resume_below

    def _wait_unless_stopped(self, seconds: float) -> None:
        """The backoff: `seconds`, cut short by a stop (looked at every STOP_POLL_S)."""
        deadline = time.monotonic() + seconds
        while self._stop_signal is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(STOP_POLL_S, left))
            self.save_state(force=False)  # once a second: `status` tells a live supervisor from a stopped one

    # ---- endings ----------------------------------------------------------------------------------

    def _finished(self, outcome: AttemptOutcome) -> int:
        if outcome.unsaved_end:
            self._settle()
            self.console.event(outcome.detail, style="yellow")
        if outcome.step is None:  # the ranks exited 0 and never reached the library: a script whose main() never
            # ran finishes the same way (audit 8); said, though a job with nothing to do is no failure
            self.console.event("the ranks exited 0 without a heartbeat: the script never started resilient's "
                               "Session (is its main() called?)", style="yellow")
        self._transition(RunState.SUCCEEDED)
        # Said once the session's books are closed (after the exit copy): the figures `status` then shows.
        at = f"at step {outcome.step}" if outcome.step is not None else "(its ranks reported no step: no heartbeat)"
        self._farewell = lambda g: (f"finished {at} after {len(self.record.history)} attempt(s), "
                                    f"{self.record.restarts} restart(s); goodput {g['goodput']:.1%}, "
                                    f"{g['lost_steps']} steps lost")
        return ExitCode.OK

    def _settle(self) -> None:
        """The run ends without finishing: the steps beyond the newest valid checkpoint are lost (a rerun redoes
        them), charged now rather than only by a rerun. A root that cannot be listed now (the failure a stop may be
        saying) keeps the last charge."""
        try:
            newest = self.resume.newest_step()
        except OSError:
            return
        self.accounting.settle(newest)
        self._sync_lost_steps()

    def _stopped(self, outcome: AttemptOutcome | None) -> int:
        self._settle()
        if outcome is None:  # between attempts: a backoff the stop cut short is down time, as a relaunch's is
            self.accounting.down_until(time.time())
        sig = self._stop_signal or signal.SIGTERM
        self.record.message = outcome.detail if outcome else f"stopped by {signal.Signals(sig).name}"
        self._transition(RunState.STOPPED)
        again = "resumes"
        with contextlib.suppress(OSError):  # (audit 19: "newest valid checkpoint: none; ... again resumes")
            again = "resumes" if self.resume.newest_step() is not None else "starts afresh (no valid checkpoint)"
        self.console.event(f"{self.record.message}; `resilient run` again {again}", style="yellow")
        return ExitCode.SIGINT if sig == signal.SIGINT else ExitCode.SIGTERM

    def _no_room(self, e: OSError) -> int:
        """The run dir took no more writes (full, over quota, read-only) as an attempt was set up: a relaunch
        would meet the same, so the run stops with the sentence that says what to free."""
        why = self._end_attempt_with(e)
        in_run_dir = e.filename is None or inside(Path(self.cfg.run_dir) / os.fsdecode(e.filename), self.cfg.run_dir)
        what = "the run dir" if in_run_dir else "a checkpoint folder"
        return self._end_failed(f"resilient stopped the run: {what} cannot be written ({why}). Free space "
                                "there (or make it writable); `resilient run` again resumes from the newest "
                                "valid checkpoint.")

    def _os_failure(self, e: OSError) -> int:
        """Any other system error around an attempt (torchrun's interpreter not executable, no process left to
        fork): one sentence, where it used to be a traceback that left the state file saying `running`."""
        why = self._end_attempt_with(e)
        return self._end_failed(f"resilient stopped the run: {why}. Fix that; `resilient run` again resumes from "
                                "the newest valid checkpoint.")

    def _end_attempt_with(self, e: OSError) -> str:
        if os.environ.get("RESILIENT_DEBUG") == "1":
            traceback.print_exception(e)
        why = f"{e.filename}: {e.strerror or e}" if e.filename is not None else f"the system: {e.strerror or e}"
        last = self.record.history[-1] if self.record.history else None
        if last is not None and last.ended_at is None:
            last.ended_at, last.reason, last.detail = time.time(), api.LAUNCHER_DIED, f"system error: {why}"
            self.accounting.end(last.ended_at)
        return why

    def _all_damaged(self, names: list[str]) -> int:
        """The check before a launch has just set aside every checkpoint left: the run stops, as when the ranks
        find the last one damaged, rather than retrain from step 0 unasked and report success."""
        return self._end_failed(
            f"resilient stopped the run: every checkpoint left was damaged and is set aside ({', '.join(names)}; "
            f"never deleted): nothing valid remains to resume from. `resilient run` again starts from step 0; "
            f"to resume instead, put an intact copy back under {self.cfg.checkpoint.dir}.")

    def _failed(self, why: str, outcome: AttemptOutcome, spec: AttemptSpec) -> int:
        newest = store.latest_valid(self.cfg.checkpoint.dir)
        look = outcome.log_hint or str(spec.logs_dir)
        at = self.record.history[-1].step_at_failure if self.record.history else outcome.step
        rank_hint = ""
        if outcome.failed_rank is not None:  # a log_hint is a file (the hang evidence): the rank's log is beside it
            log = f"rank {outcome.failed_rank}'s stderr.log"
            rank_hint = f" ({log} under it)" if outcome.log_hint is None else f" (and {log} under {spec.logs_dir})"
        return self._end_failed(
            f"resilient stopped the run: {why.rstrip('.')}. Attempt {spec.attempt} ended "  # DCP's end in one
            f"{'before its first step' if at is None else f'at step {at}'}; "
            + (f"the newest valid checkpoint is step {newest.step}. " if newest else "no valid checkpoint exists. ")
            + f"Look at {look}{rank_hint}, and `resilient status {self.cfg.run_dir}` for the history.")

    def _end_failed(self, message: str) -> int:
        """The run stops failed: its lost steps charged, `message` recorded for status and said."""
        self._settle()
        self.accounting.down_until(time.time())  # ended between attempts (after a backoff): that time is down
        self.record.message = message
        self._transition(RunState.FAILED)
        self.console.paragraph(message)
        return ExitCode.FAILED

    # ---- the record -------------------------------------------------------------------------------

    def save_state(self, force: bool = True) -> None:
        now = self.clock()
        if force or now - self._last_state_write >= STATE_EVERY_S:
            try:
                lost = [text for text in self.keep_claims() if text]
            except Exception as e:  # a claim is kept for the next run's sake: never a reason to end this one
                lost = []
                log.debug("could not check the roots' claims: %s", e)
            for text in lost:
                self._warn_once(text)
            summary = self.accounting.summary(time.time())
            self.record.goodput = summary["goodput"]
            if self.replicator is not None:
                snap = self.replicator.snapshot()
                for key in ("local_root", "durable_root"):  # relative when inside the run dir, as every path
                    snap[key] = recorded(snap[key], self.cfg.run_dir)
                self.record.replication = snap
            self.record.accounting = {"summary": summary, "ledger": self.accounting.to_dict()}
            if self.interval.auto:
                self.record.accounting["tuner"] = self.interval.memory()
            try:
                state.write(self.layout.state_file, self.record)
            except OSError as e:  # a full disk must not end the supervision it is there to ride out
                if self._state_write_error is None:
                    self.console.event(f"cannot write {self.layout.state_file} ({e.strerror or e}); supervising "
                                       "on, `resilient status` shows the last state written", style="red")
                self._state_write_error = str(e)
                return
            if self._state_write_error is not None:
                self.console.event(f"{self.layout.state_file.name} is written again")
                self._state_write_error = None
            self._last_state_write = now

    def _transition(self, new: RunState) -> None:
        self.record.transition(new)
        self.save_state()

    # ---- the checkpoint interval ------------------------------------------------------------------

    def _start_interval(self) -> None:
        fixed = self.interval.start()
        if fixed is not None:
            self.record.checkpoint_interval = fixed
        self.save_state()

    def _retune(self) -> None:
        """`auto`'s interval chosen again, from the run's failures and restart costs so far."""
        if not self.interval.auto:
            return
        # A rendezvous that did not form lost no training: it is no failure of the job's hardware.
        failures = sum(1 for h in self.record.history if h.reason in api.RETRYABLE and h.reason != api.RENDEZVOUS)
        costs = self.accounting.restart_costs()
        restart = sorted(costs)[len(costs) // 2] if costs else None
        self.record.checkpoint_interval = self.interval.choose(self.accounting.summary(time.time())["wall_s"],
                                                               failures, restart)
