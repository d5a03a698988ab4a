"""One attempt's lifecycle: launch torchrun, watch it, stop it, and say how it ended.

    attempt = Attempt(cfg, spec, handover, launcher, console, rec, run, listener)
    outcome = attempt.run()      # launch → watch until torchrun exits, a rank hangs or a stop is asked
                                 # → stop everything it started → AttemptOutcome

While it watches, the attempt keeps the run's rank table and step current (the `RunRecord` it is handed) and
tells its `AttemptListener` (the run loop) what the ranks logged and which checkpoints appeared; the run
loop owns everything that outlives an attempt (history, accounting, the interval, retention, the state file).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

from supervisor import api, classify, evidence, ranklogs, rdzv, state, store
from supervisor.api import AttemptOutcome, AttemptSpec
from supervisor.config import JobConfig
from supervisor.console import EventConsole
from supervisor.layout import RunLayout
from supervisor.protocol import (
    EXIT_PREEMPTED,
    CommitRecord,
    Handover,
    Heartbeat,
    LogRecord,
    StepLogReader,
    pid_alive,
    pid_running,
    read_heartbeats,
)
from supervisor.state import AttemptRecord, RunRecord
from supervisor.watch import NO_HEARTBEAT, SILENT, STALL_FLOOR_BEATS, STOP_IGNORED, Hang, RankWatch, verdict

log = logging.getLogger("resilient")

POLL_S = 0.5  # heartbeats and step log; torchrun's exit wakes the loop at once
HANG_STOP_GRACE_S = 5.0  # a hung rank cannot checkpoint: do not wait long for it
STOP_SLACK_S = 5.0  # past a stop's grace before the ranks still running are taken as outlasting it
DISK_SCAN_S = 2.0  # commits made by a rank 0 on another node show up only on disk
# A rank exited on its own, failing, and torchrun is still running this long after: it is waiting (30 s, whatever
# its --shutdown-timeout) for a peer that cannot act on SIGTERM (stopped, or stuck in a collective). Measured:
# a gloo timeout with a SIGSTOPped peer, torchrun gone 30 s after the first rank failed.
FAILED_RANK_GRACE_S = 5.0
# Every rank finished and is gone, and torchrun has not exited this long after: it is stopped, or stuck in its
# shutdown (a frozen rank proxy it waits on, a store host gone). On several nodes torchrun waits for the other
# nodes' at an exit barrier (300 s, torch's default), while their ranks may still run code after finish(): there
# it is stopped sooner only when it is itself stopped (SIGSTOP) or gone.
FINISHED_LINGER_S = 30.0
EXIT_BARRIER_S = 300.0


class AttemptHandle(Protocol):
    """What an attempt needs from a launched torchrun (TorchrunProcess, or a fake in unit tests)."""

    log_path: Path
    pid: int

    def wait(self, timeout: float) -> int | None: ...
    def alive(self) -> list[Any]: ...
    def workers(self) -> list[int]: ...
    def track(self, extra_pids: Any = ()) -> None: ...
    def signal_group(self, sig: int) -> None: ...
    def signal_ranks(self, sig: int) -> None: ...
    def stop(self, grace_s: float) -> list[int]: ...
    def close(self) -> None: ...


Launcher = Callable[[JobConfig, AttemptSpec, Handover], AttemptHandle]


class AttemptListener(Protocol):
    """The run loop, as an attempt sees it."""

    def on_records(self, records: list[LogRecord], rec: AttemptRecord) -> None:
        """Steps, saves and commits the ranks appended to the step log."""

    def on_checkpoint(self, commit: CommitRecord, mine: bool) -> None:
        """A new valid checkpoint found on disk (`mine` False: committed by a rank 0 on another node)."""

    def on_tick(self) -> None:
        """Once per watch iteration: persist what changed (rate-limited by the listener)."""

    def on_resumed(self, step: int | None, tier: str | None, launched_at: float) -> None:
        """The ranks loaded `step` from `tier` (None without a local tier), in an attempt launched then."""

    def stop_signal(self) -> int | None:
        """The signal the supervisor was asked to stop with, if any (the first, when several came)."""

    def stop_signals_since(self) -> int:
        """How many stop signals came after the first."""


def explained_by_stop(outcome: AttemptOutcome) -> bool:
    """An ending the stop's own signal accounts for, when the ranks had it too: ranks that checkpointed and
    exited 75, a rank or torchrun ended by SIGTERM or SIGINT, torchrun's non-zero exit with no rank to blame."""
    by_signal = outcome.exit_code in (-signal.SIGTERM, -signal.SIGINT)  # classify gives signal deaths negative
    return (outcome.reason == api.PREEMPTED
            or (outcome.reason in (api.WORKER_SIGNAL, api.LAUNCHER_DIED) and by_signal)
            or (outcome.reason == api.WORKER_EXIT and outcome.failed_rank is None))


class Attempt:
    def __init__(self, cfg: JobConfig, spec: AttemptSpec, handover: Handover, launcher: Launcher,
                 console: EventConsole, rec: AttemptRecord, run: RunRecord, listener: AttemptListener,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.spec, self.handover, self.launcher = cfg, spec, handover, launcher
        self.console, self.rec, self.run_record, self.listener, self.clock = console, rec, run, listener, clock
        self._steps = StepLogReader(spec.step_log)
        self._group_pids: set[int] = set()
        self._world: int | None = None
        self._resume_noted = False
        self._step_shown = False  # this attempt has put a step in the record (from then on it only rises)
        self._failed_seen_at = 0.0
        self._finished_seen_at = 0.0
        self._stop_deadline: float | None = None  # a stop's grace ends then (monotonic)

    # ---- the lifecycle ----------------------------------------------------------------------------

    def run(self) -> AttemptOutcome:
        """Launch, watch, stop; the outcome carries who failed first, why, and the step training reached."""
        oom_before = oom_kills()
        handle = self.launcher(self.cfg, self.spec, self.handover)
        outcome: AttemptOutcome | None = None
        try:
            outcome = self._watch(handle, oom_before)
        finally:
            # Ranks asked to stop may still be writing their checkpoint after torchrun is gone; a torchrun that
            # outlived the stop's grace has had it.
            stopping = outcome is not None and outcome.reason == api.STOPPED
            # A stop's grace runs from its signal (_stop, which set the deadline, waited in it already): what is left
            # of it, not a second one.
            grace = HANG_STOP_GRACE_S
            if stopping and self._stop_deadline is not None:
                grace = max(0.0, self._stop_deadline - time.monotonic())
            survivors = handle.stop(grace_s=grace)
            if survivors:
                self.console.event(f"processes survived SIGKILL: {survivors}", style="red")
            handle.close()
        self.listener.on_records(self._steps.poll(), self.rec)  # what the ranks logged while being stopped
        for r in self.run_record.ranks:
            r["alive"] = False
        return outcome

    def _watch(self, handle: AttemptHandle, oom_before: int | None) -> AttemptOutcome:
        hb_cfg = self.cfg.heartbeat
        # One node with a fixed count: a rank that never beats is named (on several nodes this node's ranks'
        # numbers are known only from their beats).
        expected = int(self.cfg.nproc_per_node) if self.cfg.nnodes == "1" and self.cfg.nproc_per_node.isdigit() \
            else None
        watch = RankWatch(self.clock(), hb_cfg.timeout_s, hb_cfg.startup_timeout_s, expected_ranks=expected,
                          stall_factor=hb_cfg.stall_factor, stall_floor_s=STALL_FLOOR_BEATS * hb_cfg.interval_s,
                          save_timeout_s=hb_cfg.save_timeout_s)
        heartbeats: dict[int, Heartbeat] = {}
        next_scan = 0.0
        while True:
            rc = handle.wait(POLL_S)
            now = self.clock()
            heartbeats = current_group(read_heartbeats(self.spec.heartbeat_dir)) or heartbeats
            watch.observe(heartbeats, now, time.time())
            handle.track(hb.pid for hb in heartbeats.values())
            ranklogs.link(self.spec.logs_dir, heartbeats)
            self.listener.on_records(self._steps.poll(), self.rec)
            self._follow_resume(heartbeats)
            self._follow_group(heartbeats)
            if now >= next_scan:
                next_scan = now + DISK_SCAN_S
                self._scan_for_commits()
            self._update_ranks(heartbeats, watch, now)
            if rc is not None:
                outcome = self._ended(rc, handle, heartbeats, watch, oom_before)
                # Slurm signals every process of a job step at once: the ranks may have checkpointed and exited
                # within the poll in which the supervisor's own signal arrived. That is the stop, not a fault; a
                # rank that failed for another reason keeps it.
                if self.listener.stop_signal() is not None and explained_by_stop(outcome):
                    return self._stop(handle, heartbeats, rc)
                return outcome
            failed = self._failed_rank(heartbeats, now)
            if failed is not None and now - self._failed_seen_at >= FAILED_RANK_GRACE_S:
                return self._take_over(failed, handle, heartbeats, watch, oom_before, now)
            if self._all_finished(heartbeats, expected, now) and self._lingered(handle, now):
                return self._finished_without_torchrun(handle, heartbeats, watch, oom_before, now)
            if self.listener.stop_signal() is not None:
                return self._stop(handle, heartbeats, None)
            hangs = watch.hangs(now)
            if hangs and hangs[0].kind == NO_HEARTBEAT and hangs[0].rank is None and self.cfg.rdzv.endpoint \
                    and not handle.workers():  # standalone, torchrun has no rendezvous to wait in: a hang
                return self._no_group(handle, hangs[0])
            if hangs:
                return self._hang(handle, hangs, heartbeats)
            self.listener.on_tick()

    # ---- the endings -------------------------------------------------------------------------------

    def _take_over(self, failed: Heartbeat, handle: AttemptHandle, heartbeats: dict[int, Heartbeat],
                   watch: RankWatch, oom_before: int | None, now: float) -> AttemptOutcome:
        """A rank failed and torchrun is still waiting for a peer that does not end: capture the silent peers'
        stacks (the hang behind the failure), stop everything, and classify as torchrun would have."""
        self.console.event(f"attempt {self.spec.attempt}: rank {failed.rank} exited ({failed.exit_reason}) "
                           f"{now - self._failed_seen_at:.0f}s ago and torchrun is still waiting for the others: "
                           "stopping them", style="yellow")
        silent = self._silent_ranks(watch, heartbeats, failed.rank, live_only=True)
        stuck = [Hang(r, SILENT, age, heartbeats[r].step, heartbeats[r].phase) for age, r in silent]
        if stuck:
            self._capture(handle, stuck, heartbeats)
        handle.stop(grace_s=HANG_STOP_GRACE_S)
        return self._ended(1, handle, heartbeats, watch, oom_before, silent)  # a worker failure, as torchrun says

    def _finished_without_torchrun(self, handle: AttemptHandle, heartbeats: dict[int, Heartbeat], watch: RankWatch,
                                   oom_before: int | None, now: float) -> AttemptOutcome:
        """Every rank finished and is gone, and torchrun does not exit (audit 8: a SIGSTOPped torchrun, or a frozen
        rank proxy, left the run `running` for good, then `stopped` by the user's SIGTERM): say what torchrun is
        doing, stop it, and end the attempt as its ranks did."""
        try:
            what = psutil.Process(handle.pid).status()
        except psutil.Error:
            what = "gone"
        self.console.event(f"attempt {self.spec.attempt}: every rank finished {now - self._finished_seen_at:.0f}s "
                           f"ago and torchrun has not exited (its state: {what}): stopping it", style="yellow")
        handle.stop(grace_s=HANG_STOP_GRACE_S)
        outcome = self._ended(0, handle, heartbeats, watch, oom_before)
        outcome.detail += f"; torchrun did not exit after them (its state: {what}) and was stopped"
        return outcome

    def _ended(self, rc: int, handle: AttemptHandle, heartbeats: dict[int, Heartbeat], watch: RankWatch,
               oom_before: int | None, silent: list[tuple[float, int]] | None = None) -> AttemptOutcome:
        """torchrun exited: classify from its summary, the ranks' last heartbeats and their logs."""
        heartbeats = read_heartbeats(self.spec.heartbeat_dir) or heartbeats
        ranklogs.link(self.spec.logs_dir, heartbeats)
        self._follow_resume(current_group(heartbeats))  # ranks that ended between two polls
        self.listener.on_records(self._steps.poll(), self.rec)
        self._update_ranks(heartbeats, watch, self.clock())
        oom_after = oom_kills()
        rank_logs = {rank: classify.tail(path) for rank, path in rank_stderr_paths(self.spec, heartbeats).items()}
        outcome = classify.classify(rc, classify.tail(handle.log_path, 200_000), heartbeats, rank_logs,
                                    oom_killed=oom_before is not None and (oom_after or 0) > oom_before)
        if outcome.reason in (api.COLLECTIVE_TIMEOUT, api.NODE_LOST):
            silent = self._silent_ranks(watch, heartbeats, outcome.failed_rank) if silent is None else silent
            outcome.detail += "".join(f"; rank {r} had been silent for {age:.0f}s (it is likely the one that hung)"
                                      for age, r in silent)
        if outcome.reason == api.CHECKPOINT_FAILED:
            outcome.detail += disk_note(self.cfg.checkpoint.dir)
        if outcome.reason == api.RENDEZVOUS and self.cfg.rdzv.endpoint:
            outcome.detail += f" at {self.cfg.rdzv.endpoint}{self._missing_nodes()}"
        return outcome

    def _missing_nodes(self) -> str:
        """The run's other nodes whose supervisor is gone: the ones a group that does not form waits for."""
        return state.missing_nodes(self.cfg.run_dir, RunLayout(self.cfg.run_dir, self.run_record.node).node_dir)

    def _hang(self, handle: AttemptHandle, hangs: list[Any], heartbeats: dict[int, Heartbeat]) -> AttemptOutcome:
        """A rank is hung: capture every rank's stacks and kernel state first, then stop the group."""
        first, said = hangs[0], verdict(hangs)
        self.console.event(f"attempt {self.spec.attempt}: hang — {said}; capturing stacks before stopping",
                           style="red")
        detected = time.time()
        out = self._capture(handle, hangs, heartbeats)
        handle.stop(grace_s=HANG_STOP_GRACE_S)
        step = max((hb.step for hb in heartbeats.values()), default=None)
        return AttemptOutcome(api.HANG, said, first.rank, None, step, str(out),
                              stalled=(detected - first.for_s, detected))

    def _no_group(self, handle: AttemptHandle, first: Hang) -> AttemptOutcome:
        """No rank ever beat and torchrun has no workers: it is still in its rendezvous, which is no hang of a
        rank. Say what holds the endpoint (a foreign program on the port makes torchrun wait forever)."""
        detail = (f"torchrun started no workers in {first.for_s:.0f}s: "
                  f"{rdzv.stalled(self.cfg.rdzv.endpoint, {handle.pid})}{self._missing_nodes()}")
        self.console.event(f"attempt {self.spec.attempt}: torchrun started no workers in {first.for_s:.0f}s; "
                           "stopping it", style="red")
        handle.stop(grace_s=HANG_STOP_GRACE_S)
        return AttemptOutcome(api.RENDEZVOUS, detail, log_hint=str(handle.log_path))

    def _capture(self, handle: AttemptHandle, hangs: list[Any], heartbeats: dict[int, Heartbeat]) -> Path:
        """The hung ranks' stacks and kernel state, before anything is stopped; returns the evidence file."""
        out = self.spec.logs_dir / "hang_evidence.json"
        beating = {hb.pid for hb in heartbeats.values()}
        unheard = [pid for pid in handle.workers() if pid not in beating] \
            if any(h.kind == NO_HEARTBEAT for h in hangs) else []
        launcher_only = not heartbeats and not unheard  # no rank to look at: torchrun's own state is the evidence
        doc = evidence.capture(hangs, heartbeats, rank_stderr_paths(self.spec, heartbeats), out,
                               run_dir=self.cfg.run_dir, unheard=unheard, local_stderr=local_stderr_paths(self.spec),
                               launcher=handle.pid if launcher_only else None)
        dumped = [r["rank"] for r in doc["ranks"] if r.get("stack_dump")]
        unheard = doc.get("workers_without_heartbeat", [])
        theirs = [f"rank {w['rank']}" if w.get("rank") is not None else f"local rank {w.get('local_rank', '?')}"
                  for w in unheard if w.get("stack_dump")]
        also = f"; the state of {len(unheard)} worker(s) that never beat" if unheard else ""
        if theirs:
            also += f", stack dumps from {', '.join(theirs)}"
        if dumped:
            dumps = f"stack dumps from ranks {dumped}"
        elif launcher_only:
            dumps = "no rank to dump: torchrun's own state recorded"
        else:
            dumps = "no rank's stack dumped"
        self.console.event(f"hang evidence in {out} ({dumps}{also})")
        return out

    def _stop(self, handle: AttemptHandle, heartbeats: dict[int, Heartbeat], rc: int | None) -> AttemptOutcome:
        """The supervisor was asked to stop: the ranks checkpoint at their step and exit (`rc`: torchrun had
        already exited, the ranks having had the same signal)."""
        name = signal.Signals(self.listener.stop_signal() or signal.SIGTERM).name
        asked = time.monotonic()
        deadline = self._stop_deadline = asked + self.cfg.stop_timeout_s + STOP_SLACK_S
        # status says it while it runs (audit 17: a stop in progress looked like a healthy running run)
        self.run_record.stopping = (f"{name} at {time.strftime('%H:%M:%S')}: the ranks checkpoint their step and "
                                    f"exit, {self.cfg.stop_timeout_s:.0f}s at most")
        if rc is None:
            self.console.event(f"{name}: asking the ranks to checkpoint and stop (up to "
                               f"{self.cfg.stop_timeout_s:.0f}s)", style="yellow")
            handle.signal_ranks(signal.SIGTERM)
            handle.signal_ranks(signal.SIGCONT)  # a stopped rank (SIGSTOP, a debugger) acts on it only once continued
            rc, told = None, self.listener.stop_signals_since()
            while rc is None and (left := deadline - time.monotonic()) > 0:
                rc = handle.wait(min(0.5, left))
                self.listener.on_tick()  # the record stays fresh: `status` tells a long stop from a stopped supervisor
                if self.listener.stop_signals_since() > told:  # audit 8: a second Ctrl-C met silence
                    told = self.listener.stop_signals_since()
                    more = max(0.0, left - STOP_SLACK_S)  # as the first line counted (audit 16: "20s", then "25s")
                    self.console.event(f"already stopping: the ranks have up to {more:.0f}s more to checkpoint; "
                                       f"SIGKILL the supervisor (pid {os.getpid()}) to abandon the stop",
                                       style="yellow")
        else:
            self.console.event(f"{name}: the ranks had it too and have already stopped (torchrun exited with "
                               f"{rc})", style="yellow")
        # torchrun can be gone while a rank still writes its stop checkpoint and its last heartbeat: the account
        # below is of ranks that have ended (read before, it said 'train' and could miss the stop's checkpoint).
        while handle.alive() and time.monotonic() < deadline:
            handle.wait(0.1)
            handle.track()
        heartbeats = read_heartbeats(self.spec.heartbeat_dir) or heartbeats
        evidence_note, stalled, silent_rank = "", None, None
        ignored = [Hang(r, STOP_IGNORED, time.monotonic() - asked, hb.step, hb.phase)
                   for r, hb in sorted(heartbeats.items()) if hb.phase != "exited"] if handle.alive() else []
        if ignored:  # they are SIGKILLed next (run's finally): what they were doing is all that can still be known
            # the silent one first, named: the others likely wait for it (audit 16: a SIGSTOPped rank and the one
            # blocked on it were named alike); its beats are this host's clock's
            ages = {h.rank: time.time() - heartbeats[h.rank].time for h in ignored if heartbeats[h.rank].time}
            silent = sorted((r for r, age in ages.items() if age > STALL_FLOOR_BEATS * self.cfg.heartbeat.interval_s),
                            key=lambda r: -ages[r])
            ignored = sorted((Hang(h.rank, SILENT, ages[h.rank], h.step, h.phase) if h.rank in silent else h
                              for h in ignored),  # the evidence says which kind each was
                             key=lambda h: (silent.index(h.rank) if h.rank in silent else len(silent), h.rank))
            why = "".join(f"; rank {r} silent for {ages[r]:.0f}s (the others likely wait for it)" for r in silent[:2])
            if silent:  # goodput books the silence as a hang's, not as lost steps or tail (audit 16)
                stalled = (time.time() - ages[silent[0]], time.time())
                silent_rank = silent[0]  # and the history names it, as the console does (audit 17)
                evidence_note = why
            self.console.event(f"{name}: rank(s) {[h.rank for h in ignored]} still running after the grace{why}; "
                               "capturing stacks before stopping them", style="red")
            evidence_note += f"; stacks of the ranks that did not stop in {self._capture(handle, ignored, heartbeats)}"
        self._show_step(heartbeats)
        step = self.run_record.step
        self.run_record.take_last_beats(heartbeats)
        saved, tier = store.latest_valid(self.cfg.checkpoint.dir), ""
        if self.handover.ckpt_local_dir:  # the stop's checkpoint is committed locally, copied to the durable tier later
            local = store.latest_valid(self.handover.ckpt_local_dir)
            if local is not None and (saved is None or local.step > saved.step):
                saved, tier = local, " (in the local tier)"
        how = "the ranks and torchrun exited" if rc is not None else "the grace period ran out"
        missed, failed = "", None
        if step is not None and (saved is None or saved.step < step):
            cause = ""
            if rc:  # a rank killed in the stop, as torchrun's log tells (audit 16: only the logs were named,
                found = classify.classify(rc, classify.tail(handle.log_path, 200_000), heartbeats, {})  # where the
                if found.failed_rank is not None and found.reason not in (api.PREEMPTED, api.FINISHED, api.NODE_LOST,
                                                                          api.COLLECTIVE_TIMEOUT):  # peer's traceback
                    cause = f"{found.detail}; "  # blamed the wrong rank); its cause, whatever it was (review 15: a
                    # full disk's went unsaid), and the rank where it died by a signal, its OOM or its save (a rank
                    # that exited on a lost peer, another node's kill, is not named: review 14)
                    if found.reason in (api.WORKER_SIGNAL, api.OOM, api.CHECKPOINT_FAILED):
                        failed = found.failed_rank
            missed = f" (none at the stop step {step}: {cause}see the ranks' logs in {self.spec.logs_dir})"
        return AttemptOutcome(api.STOPPED, f"stopped by {name} ({how}); newest valid checkpoint: "
                              f"{saved.step if saved else 'none'}{tier}{missed}{evidence_note}",
                              failed if failed is not None else silent_rank, rc, step, stalled=stalled)

    # ---- following the ranks --------------------------------------------------------------------------

    def _failed_rank(self, heartbeats: dict[int, Heartbeat], now: float) -> Heartbeat | None:
        """The first rank that has exited on its own, failing (not finished, not preempted); notes when it was
        first seen so."""
        failed = sorted((hb for hb in heartbeats.values() if hb.phase == "exited"
                         and hb.exit_reason not in (None, "finished", "preempted")), key=lambda hb: hb.time)
        if not failed:
            self._failed_seen_at = 0.0
            return None
        if not self._failed_seen_at:
            self._failed_seen_at = now
        return failed[0]

    def _all_finished(self, heartbeats: dict[int, Heartbeat], expected: int | None, now: float) -> bool:
        """Every rank of this node has exited 0 and its process is gone (the count known on one node); notes when
        that was first seen."""
        done = bool(heartbeats) and (expected is None or len(heartbeats) >= expected) and all(
            hb.phase == "exited" and hb.exit_code == 0 and not pid_running(hb.pid) for hb in heartbeats.values())
        if not done:
            self._finished_seen_at = 0.0
        elif not self._finished_seen_at:
            self._finished_seen_at = now
        return done

    def _lingered(self, handle: AttemptHandle, now: float) -> bool:
        """torchrun has outlived its finished ranks for long enough to be stopped (see FINISHED_LINGER_S)."""
        waited = now - self._finished_seen_at
        if waited < FINISHED_LINGER_S:
            return False
        if self.cfg.nnodes == "1" or waited >= EXIT_BARRIER_S + FINISHED_LINGER_S:
            return True
        try:
            return psutil.Process(handle.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return True

    def _scan_for_commits(self) -> None:
        newest = store.latest_valid(self.cfg.checkpoint.dir)
        if newest is not None and newest.created_at and newest.created_at > self.rec.started_at:
            self.listener.on_checkpoint(CommitRecord(newest.step, newest.created_at, 0.0, newest.size_bytes),
                                        mine=False)

    def _follow_group(self, heartbeats: dict[int, Heartbeat]) -> None:
        """Notice torchrun re-forming the worker group in place (it does so when a node joins)."""
        live = {hb.pid for hb in heartbeats.values() if hb.phase != "exited"}
        if not live:
            return
        if self._group_pids and not (live & self._group_pids):
            world = max(hb.world_size for hb in heartbeats.values())
            self.rec.regroups = [*(self.rec.regroups or []), {"at": time.time(), "world_size": world}]
            self._resume_noted = False
            self._step_shown = False  # the new group resumes from a checkpoint: its step may be below the old one's
            self.console.event(f"attempt {self.rec.attempt}: torchrun re-formed the group in place (a node joined "
                               f"or left): world size {self._world} → {world}", style="yellow")
        self._group_pids = live
        self._world = max(hb.world_size for hb in heartbeats.values())
        self.rec.world_size = self._world

    def _follow_resume(self, heartbeats: dict[int, Heartbeat]) -> None:
        """The ranks agree on the resume step among all nodes; record the one they actually loaded."""
        # Only ranks that got as far as training have loaded anything (one that died first says None), and only
        # their words count: a peer's beat on disk may predate its load (the kill campaign caught rank 1 training
        # while rank 0's last beat still had no tier, and the attempt was recorded without one).
        # A rank that exited finished or preempted had loaded too (a resume at the last step ends at once).
        trained = [hb for hb in heartbeats.values() if hb.phase in ("train", "save") or (
            hb.phase == "exited" and hb.exit_code in (0, EXIT_PREEMPTED))]
        loaded = {hb.resumed_from for hb in trained}
        if len(loaded) != 1 or self._resume_noted:
            return
        step = loaded.pop()
        said = min(trained, key=lambda hb: hb.rank)
        tier = said.resumed_tier if step is not None else None
        if self.rec.regroups:
            self.rec.regroups[-1]["resumed_from"] = step
        elif tier and self.handover.ckpt_local_dir:  # two tiers: the ranks chose one; the launch line named both
            why = f" ({said.resumed_why})" if said.resumed_why else ""
            self.console.event(f"attempt {self.rec.attempt}: the ranks resumed from step {step} from the {tier} "
                               f"tier{why}")
            self.rec.resumed_from_step = step
        elif step != self.rec.resumed_from_step:
            self.console.event(f"attempt {self.rec.attempt}: the ranks resumed from step {step} (agreed across "
                               f"nodes; this node had handed over {self.rec.resumed_from_step})", style="yellow")
            self.rec.resumed_from_step = step
        self.rec.resumed_tier, self.rec.resumed_why = tier, said.resumed_why if tier else None
        self._resume_noted = True
        self.listener.on_resumed(step, tier, self.rec.started_at)

    def _update_ranks(self, heartbeats: dict[int, Heartbeat], watch: RankWatch, now: float) -> None:
        ages = watch.ages(now)
        slow = watch.stragglers()
        ranks = []
        for rank, hb in sorted(heartbeats.items()):
            note = None
            if rank in slow:
                note = f"straggler: {slow[rank]:.2f} own steps/s, far below the other ranks"
            ranks.append({"rank": rank, "node": hb.node, "pid": hb.pid, "started_at": hb.started_at,
                          "step": hb.step, "phase": hb.phase,
                          "world_size": hb.world_size, "heartbeat_at": hb.time,
                          "heartbeat_age_s": round(ages.get(rank, 0.0), 2),
                          "alive": hb.phase != "exited" and pid_alive(hb.pid), "steps_per_s": hb.steps_per_s,
                          "own_steps_per_s": hb.own_steps_per_s, "hang_limit_s": round(watch.limit_s(rank), 2),
                          "note": note})
        self.run_record.ranks = ranks
        self._show_step(heartbeats)

    def _show_step(self, heartbeats: dict[int, Heartbeat]) -> None:
        """The record's step from the beats, never below what this group showed already: a beat lags the step log
        (audit 13: "progress step 214 · last valid checkpoint 220"). A new group (a regroup) starts it afresh."""
        group = current_group(heartbeats)  # a regroup's older ranks' files (a smaller world) stay behind
        # a rank starting up or loading says step 0: no step of the run's (audit 16: "step 0" after a resume)
        beaten = max((hb.step for hb in group.values() if hb.step is not None and hb.phase not in ("startup", "load")),
                     default=None)
        if beaten is not None:
            shown = self.run_record.step
            self.run_record.step = beaten if not self._step_shown or shown is None else max(shown, beaten)
            self._step_shown = True

    def _silent_ranks(self, watch: RankWatch, heartbeats: dict[int, Heartbeat], failed: int | None, *,
                      live_only: bool = False) -> list[tuple[float, int]]:
        """The rank that timed out is rarely the one that hung: (silence, rank) of the two longest silent.
        `live_only` while torchrun runs: a rank whose process is gone (killed) did not hang (after torchrun's
        exit every rank is gone, and the silences are the clue)."""
        limit = STALL_FLOOR_BEATS * self.cfg.heartbeat.interval_s
        ages = watch.ages(self.clock())
        silent = sorted(((age, r) for r, age in ages.items()
                         if age > limit and r != failed and heartbeats.get(r) and heartbeats[r].phase != "exited"
                         and (not live_only or pid_running(heartbeats[r].pid))), reverse=True)
        return silent[:2]


def oom_kills() -> int | None:
    """The kernel OOM killer's count for our cgroup (v2), to tell an OOM kill from any other SIGKILL."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        for line in (Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        pass
    return None


def disk_note(root: Path) -> str:
    """A failed save on a (nearly) full filesystem says so: torch's own error may not (a short write in a
    zip header reads "unexpected pos")."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return ""
    valid = [i.size_bytes for i in store.scan(root) if i.valid] if root.is_dir() else []
    if usage.free < max(max(valid, default=0), 0.02 * usage.total):
        fix = "free space there, or lower checkpoint.keep" if len(valid) > 1 else "free space there"
        return f"; the checkpoint filesystem has {usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB ({fix})"
    return ""


def current_group(heartbeats: dict[int, Heartbeat], window_s: float = 10.0) -> dict[int, Heartbeat]:
    """Heartbeats of the newest worker group: when torchrun re-forms the group in place (a node joined),
    the files of the previous group's ranks stay behind; the ranks of one group start within seconds."""
    if not heartbeats:
        return heartbeats
    newest = max(hb.started_at for hb in heartbeats.values())
    return {r: hb for r, hb in heartbeats.items() if hb.started_at >= newest - window_s or pid_alive(hb.pid)}


def rank_stderr_paths(spec: AttemptSpec, heartbeats: dict[int, Heartbeat]) -> dict[int, Path]:
    """Each rank's stderr log: from its heartbeat (torchrun's per-rank folder), else by local rank."""
    paths: dict[int, Path] = {}
    for rank, hb in heartbeats.items():
        if hb.log_dir:
            paths[rank] = Path(hb.log_dir) / "stderr.log"
    for local, p in local_stderr_paths(spec).items():
        paths.setdefault(local, p)  # single node: local rank == rank for ranks that never beat
    return paths


def local_stderr_paths(spec: AttemptSpec) -> dict[int, Path]:
    """Each local rank's stderr log, from torchrun's per-rank folders."""
    return {int(p.parent.name): p for p in (spec.logs_dir / ranklogs.RANKS_DIR).glob("*/attempt_*/*/stderr.log")
            if p.parent.name.isdigit()}
