"""The supervision loop: choose a checkpoint, launch, watch, classify, decide, relaunch.

    while True:
        choice  = newest valid checkpoint (checked as the job says; newer folders skipped with reasons)
        handle  = launch torchrun for attempt k, handing `choice` to the ranks
        outcome = watch until torchrun exits, a rank hangs, or we are told to stop
        decision = finished? stopped? else the restart policy
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from supervisor import __version__, api, classify, evidence, ranklogs, retention, state, store
from supervisor.api import AttemptOutcome, AttemptSpec, ResumeChoice
from supervisor.config import JobConfig
from supervisor.console import EventConsole
from supervisor.errors import ExitCode
from supervisor.fsutil import atomic_write_json
from supervisor.goodput import Accounting
from supervisor.interval import IntervalTuner
from supervisor.layout import RunLayout, recorded
from supervisor.protocol import (
    CommitRecord,
    Control,
    Handover,
    Heartbeat,
    SaveRecord,
    StepLogReader,
    StepRecord,
    read_heartbeats,
    write_control,
)
from supervisor.rdzv import Generations, run_id
from supervisor.state import AttemptRecord, RunRecord, RunState
from supervisor.watch import STALL_FLOOR_BEATS, RankWatch

log = logging.getLogger("resilient")

POLL_S = 0.5  # heartbeats and step log; torchrun's exit wakes the loop at once
STATE_EVERY_S = 1.0
HANG_STOP_GRACE_S = 5.0  # a hung rank cannot checkpoint: do not wait long for it


class AttemptHandle(Protocol):
    """What the loop needs from a launched attempt (TorchrunProcess, or a fake in unit tests)."""

    log_path: Path

    def wait(self, timeout: float) -> int | None: ...
    def track(self, extra_pids: Any = ()) -> None: ...
    def signal_group(self, sig: int) -> None: ...
    def signal_ranks(self, sig: int) -> None: ...
    def stop(self, grace_s: float) -> list[int]: ...
    def close(self) -> None: ...


Launcher = Callable[[JobConfig, AttemptSpec, Handover], AttemptHandle]


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


def choose_resume(root: Path, verify: str, below: int | None = None) -> ResumeChoice:
    """The newest valid checkpoint (strictly below `below` if given), and why newer folders were skipped."""
    skipped: list[tuple[str, str]] = []
    if not root.is_dir():
        return ResumeChoice(None, None, skipped)
    for path in reversed(store.checkpoint_dirs(root)):
        info = store.inspect(path, deep=verify == "checksum" and not path.name.endswith(store.PARTIAL_SUFFIX))
        if below is not None and info.step >= below:
            if info.valid:
                skipped.append((path.name, f"rolled back past it (a non-finite loss followed step {below})"))
            continue
        if info.valid:
            return ResumeChoice(info.step, info.path, skipped)
        skipped.append((path.name, f"{info.status.value}: {info.reason}"))
    return ResumeChoice(None, None, skipped)


class Supervisor:
    def __init__(self, cfg: JobConfig, layout: RunLayout, *, launcher: Launcher,
                 console: EventConsole | None = None, clock: Callable[[], float] = time.monotonic):
        from supervisor.policy import RestartPolicy

        self.cfg, self.layout, self.launcher = cfg, layout, launcher
        self.console = console or EventConsole(cfg.name)
        self.clock = clock
        self.policy = RestartPolicy(cfg.restart, rendezvous_s=float(cfg.rdzv.conf.get("join_timeout", 600)))
        self.stop_signal: int | None = None
        self._wake = threading.Event()
        self._blocking: dict[int, float] = {}
        self._announced: set[int] = set()
        self._resume_noted = False
        self.record = self._load_record()
        self.accounting = Accounting.from_dict(self.record.accounting.get("ledger"), last_seen=self._prev_updated_at)
        self._restarts_before = self.record.restarts  # the budget is per invocation; the count is not
        ck = cfg.checkpoint
        self.tuner = (IntervalTuner(ck.expected_mtbf_s, ck.min_interval_steps, ck.max_interval_steps)
                      if ck.auto else None)
        self.control_file = layout.node_dir / "control.json"
        # Several nodes: each formation of the group gets its own rendezvous run id (supervisor/rdzv.py).
        self.generations = Generations(cfg.run_dir) if cfg.rdzv.endpoint is not None else None
        self._generation = self.generations.current() if self.generations else None
        self._interval: int | None = ck.interval_steps
        self._last_state_write = 0.0

    # ---- the record -------------------------------------------------------------------------------

    def _load_record(self) -> RunRecord:
        prev: RunRecord | None = None
        if self.layout.state_file.is_file():
            with contextlib.suppress(state.StateFileError):
                prev = state.read(self.layout.state_file)
        self._prev_updated_at = prev.updated_at if prev else None
        rec = RunRecord(name=self.cfg.name, run_dir=".",  # paths relative to the run dir: layout.recorded
                        checkpoint_dir=recorded(self.cfg.checkpoint.dir, self.cfg.run_dir),
                        node=self.layout.node, max_restarts=self.cfg.restart.max_restarts)
        if prev is not None:  # a rerun keeps the history, so status tells the whole story
            rec.history, rec.step, rec.last_checkpoint_step = prev.history, prev.step, prev.last_checkpoint_step
            last = rec.history[-1] if rec.history else None
            if last is not None and last.ended_at is None:  # its supervisor died (kill -9, node lost)
                last.ended_at = prev.updated_at
                last.reason = api.SUPERVISOR_LOST
                last.detail = f"the supervisor (pid {prev.supervisor.get('pid')}) died during this attempt"
            rec.accounting, rec.restarts = prev.accounting, prev.restarts
        rec.supervisor = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                          "version": __version__}
        return rec

    def save_state(self, force: bool = True) -> None:
        now = self.clock()
        if force or now - self._last_state_write >= STATE_EVERY_S:
            summary = self.accounting.summary(time.time())
            self.record.goodput = summary["goodput"]
            self.record.accounting = {"summary": summary, "ledger": self.accounting.to_dict()}
            state.write(self.layout.state_file, self.record)
            self._last_state_write = now

    def _transition(self, new: RunState) -> None:
        self.record.transition(new)
        self.save_state()

    # ---- signals ----------------------------------------------------------------------------------

    def request_stop(self, signum: int) -> None:
        """From a signal handler: stop gracefully (the ranks checkpoint), then exit 143/130."""
        self.stop_signal = signum
        self._wake.set()

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        self.layout.node_dir.mkdir(parents=True, exist_ok=True)
        job = self.cfg.to_dict(relative_to=self.cfg.run_dir)
        atomic_write_json(self.layout.job_file, {"schema_version": 1, "job": job}, durable=False)
        self.accounting.start_session(time.time())
        try:
            return self._loop()
        finally:
            close = getattr(self.launcher, "close", None)
            if close is not None:
                close()
            self.accounting.end_session(time.time())
            self.save_state()

    def _loop(self) -> int:
        if self.tuner is None:
            self.control_file.unlink(missing_ok=True)  # a stale "auto" choice must not override a fixed interval
            self.record.checkpoint_interval = {"mode": "fixed", "steps": self.cfg.checkpoint.interval_steps,
                                               "why": "checkpoint.interval_steps in the job file"}
        self.save_state()
        resume_below: int | None = None
        while True:
            if self.stop_signal is not None:
                return self._stopped(None)
            choice = choose_resume(self.cfg.checkpoint.dir, self.cfg.checkpoint.verify, resume_below)
            spec = self._next_spec(choice)
            outcome = self._run_attempt(spec, choice)
            if outcome.reason == api.FINISHED:
                self._transition(RunState.SUCCEEDED)
                g = self.accounting.summary(time.time())
                self.console.event(f"finished at step {outcome.step} after {len(self.record.history)} attempt(s), "
                                   f"{self.record.restarts} restart(s); goodput {g['goodput']:.1%}, "
                                   f"{g['lost_steps']} steps lost", style="green")
                return ExitCode.OK
            if outcome.reason == api.STOPPED:
                return self._stopped(outcome)
            self._next_generation(outcome)
            if outcome.reason == api.RENDEZVOUS:
                decision = self.policy.decide_rendezvous(outcome, self.clock())
            else:
                newest = store.latest_valid(self.cfg.checkpoint.dir)
                older = store.latest_valid(self.cfg.checkpoint.dir, below=newest.step) if newest else None
                progressed = newest is not None and (choice.step is None or newest.step > choice.step)
                decision = self.policy.decide(outcome, progressed=progressed,
                                              newest_valid=newest.step if newest else None,
                                              older_valid=older.step if older else None)
            if not decision.relaunch:
                return self._failed(decision.message, outcome, spec)
            self.record.restarts = self._restarts_before + self.policy.restarts
            self._transition(RunState.RESTARTING)
            resume_below = decision.resume_below
            if resume_below is not None:
                self.console.event(f"rolling back: resuming below step {resume_below} once", style="yellow")
            self.console.event(decision.message, style="yellow")
            if self._wake.wait(decision.wait_s):
                self._wake.clear()

    def _next_generation(self, outcome: AttemptOutcome) -> None:
        """torchrun closed the rendezvous it formed (or found it closed): relaunch in the next one. A launch
        that never got that far (the store unreachable) retries the same generation."""
        if self.generations is None or self._generation is None:
            return
        formed = outcome.reason != api.RENDEZVOUS or "Closed" in outcome.detail
        if formed:
            self._generation = self.generations.after(self._generation)

    def _next_spec(self, choice: ResumeChoice) -> AttemptSpec:
        attempt = (self.record.history[-1].attempt + 1) if self.record.history else 1
        logs = self.layout.logs_dir(attempt)
        rdzv = run_id(self.cfg.rdzv.id, self._generation) if self._generation is not None else None
        return AttemptSpec(attempt, choice.step, choice.path, logs, self.layout.heartbeat_dir(attempt),
                           self.layout.step_log(attempt), self.control_file, rdzv)

    def _handover(self, spec: AttemptSpec) -> Handover:
        c = self.cfg
        return Handover(
            run_dir=str(c.run_dir), node=self.layout.node, attempt=spec.attempt, ckpt_dir=str(c.checkpoint.dir),
            ckpt_interval=c.checkpoint.interval_steps, ckpt_async=c.checkpoint.async_save,
            resume_step=spec.resume_step, resume_path=str(spec.resume_path) if spec.resume_path else None,
            heartbeat_dir=str(spec.heartbeat_dir), heartbeat_interval_s=c.heartbeat.interval_s,
            step_log=str(spec.step_log), control_file=str(spec.control_file),
            collective_timeout_s=c.collective_timeout_s, stop_grace_s=c.stop_timeout_s, supervisor_pid=os.getpid(),
            launched_at=time.time())

    def _announce(self, spec: AttemptSpec, choice: ResumeChoice) -> None:
        for name, why in choice.skipped:
            self.console.event(f"skipping {name}: {why}", style="yellow")
        start = f"resuming from step {choice.step} ({choice.path.name})" if choice.path else "starting fresh"
        self.console.event(f"attempt {spec.attempt}: launching {self.cfg.nnodes}×{self.cfg.nproc_per_node} ranks, "
                           f"{start}; logs in {spec.logs_dir}")

    def _run_attempt(self, spec: AttemptSpec, choice: ResumeChoice) -> AttemptOutcome:
        for d in (spec.logs_dir, spec.heartbeat_dir, spec.step_log.parent):
            d.mkdir(parents=True, exist_ok=True)
        if choice.skipped:
            (spec.logs_dir / "resume.json").write_text(json.dumps(
                {"resume_step": choice.step, "skipped": [{"folder": n, "why": w} for n, w in choice.skipped]},
                indent=2) + "\n")
        self._announce(spec, choice)
        rec = AttemptRecord(attempt=spec.attempt, started_at=time.time(), resumed_from_step=choice.step,
                            log_dir=recorded(spec.logs_dir, self.cfg.run_dir),
                            skipped=[f"{n}: {w}" for n, w in choice.skipped] or None)
        self._resume_noted = False
        self._group_pids: set[int] = set()
        self._world: int | None = None
        self.accounting.launch(spec.attempt, rec.started_at, choice.step)
        if len(self.record.history) and self.accounting.attempts[:-1]:
            self.record.history[-1].lost_steps = self.accounting.attempts[-2].lost_steps
        self.record.history.append(rec)
        self.record.attempt = spec.attempt
        self._transition(RunState.RUNNING)
        if self.tuner is not None:
            self.tuner.new_attempt()
            self._retune()
        oom_before = oom_kills()
        handle = self.launcher(self.cfg, spec, self._handover(spec))
        steps = StepLogReader(spec.step_log)
        outcome: AttemptOutcome | None = None
        try:
            outcome = self._watch(spec, handle, rec, oom_before, steps)
        finally:
            # Ranks asked to stop may still be writing their checkpoint after torchrun is gone.
            stopping = outcome is not None and outcome.reason == api.STOPPED
            survivors = handle.stop(grace_s=self.cfg.stop_timeout_s if stopping else HANG_STOP_GRACE_S)
            if survivors:
                self.console.event(f"processes survived SIGKILL: {survivors}", style="red")
            handle.close()
        self._follow_steps(steps.poll(), rec)  # what the ranks logged while they were being stopped
        rec.ended_at = time.time()
        self.accounting.end(rec.ended_at)
        # The step log is the group's progress: rank 0 appends each step it completed, at once. Heartbeats
        # lag it by a beat, and can also lead it: a peer may finish step N+1 after rank 0 died inside it.
        logged = self.accounting.attempts[-1].last_step
        if logged is not None:
            outcome.step = self.record.step = logged
        rec.reason, rec.detail, rec.failed_rank = outcome.reason, outcome.detail, outcome.failed_rank
        rec.exit_code, rec.step_at_failure = outcome.exit_code, None if outcome.reason == api.FINISHED else outcome.step
        newest = store.latest_valid(self.cfg.checkpoint.dir)  # authoritative, even if the step log lagged
        self.record.last_checkpoint_step = newest.step if newest else None
        rec.last_checkpoint_step = self.record.last_checkpoint_step
        for r in self.record.ranks:
            r["alive"] = False
        self.save_state()
        if outcome.reason not in (api.FINISHED, api.STOPPED):
            where = f" at step {outcome.step}" if outcome.step is not None else ""
            self.console.event(f"attempt {spec.attempt} failed{where}: {outcome.reason} — {outcome.detail}",
                               style="red")
        return outcome

    # ---- watching one attempt ---------------------------------------------------------------------

    def _watch(self, spec: AttemptSpec, handle: AttemptHandle, rec: AttemptRecord,
               oom_before: int | None, steps: StepLogReader) -> AttemptOutcome:
        hb_cfg = self.cfg.heartbeat
        watch = RankWatch(self.clock(), hb_cfg.timeout_s, hb_cfg.startup_timeout_s, stall_factor=hb_cfg.stall_factor,
                          stall_floor_s=STALL_FLOOR_BEATS * hb_cfg.interval_s)
        heartbeats: dict[int, Heartbeat] = {}
        next_scan = 0.0
        while True:
            rc = handle.wait(POLL_S)
            now = self.clock()
            heartbeats = current_group(read_heartbeats(spec.heartbeat_dir)) or heartbeats
            watch.observe(heartbeats, now)
            handle.track(hb.pid for hb in heartbeats.values())
            ranklogs.link(spec.logs_dir, heartbeats)
            self._follow_steps(steps.poll(), rec)
            self._follow_resume(rec, heartbeats)
            self._follow_group(rec, heartbeats)
            if now >= next_scan:  # commits made by a rank 0 on another node show up only on disk
                next_scan = now + 2.0
                newest = store.latest_valid(self.cfg.checkpoint.dir)
                if newest is not None and newest.step not in self._announced and newest.created_at and \
                        newest.created_at > rec.started_at:
                    self._on_checkpoint(CommitRecord(newest.step, newest.created_at, 0.0, newest.size_bytes),
                                        mine=False)
            self._update_ranks(heartbeats, watch, now)
            if rc is not None:
                heartbeats = read_heartbeats(spec.heartbeat_dir) or heartbeats
                ranklogs.link(spec.logs_dir, heartbeats)
                self._follow_steps(steps.poll(), rec)
                self._update_ranks(heartbeats, watch, self.clock())
                oom_after = oom_kills()
                outcome = classify.classify(rc, classify.tail(handle.log_path, 200_000), heartbeats,
                                            self._rank_logs(spec, heartbeats),
                                            oom_killed=oom_before is not None and (oom_after or 0) > oom_before)
                if outcome.reason in (api.COLLECTIVE_TIMEOUT, api.NODE_LOST):
                    outcome.detail += self._silent_ranks(watch, heartbeats, outcome.failed_rank)
                if outcome.reason == api.CHECKPOINT_FAILED:
                    outcome.detail += disk_note(self.cfg.checkpoint.dir)
                return outcome
            if self.stop_signal is not None:
                return self._stop_attempt(spec, handle, heartbeats)
            hangs = watch.hangs(now)
            if hangs:
                return self._hang(spec, handle, hangs, heartbeats)
            self.save_state(force=False)

    def _follow_steps(self, records: list[Any], rec: AttemptRecord) -> None:
        for r in records:
            if isinstance(r, StepRecord):
                if rec.first_step_at is None:
                    rec.first_step_at = r.t
                    self.console.event(f"attempt {rec.attempt}: training (first step {r.step} after "
                                       f"{r.t - rec.started_at:.1f}s)")
                    spare = getattr(self.launcher, "spare", None)
                    if spare is not None:  # ready for the next relaunch, now that the imports are done
                        spare()
                self.record.step = r.step
                self.accounting.step(r.step, r.t)
                if self.tuner is not None:
                    self.tuner.on_step(r.step, r.t)
            elif isinstance(r, SaveRecord):
                self.accounting.save(r.step, r.blocking_s)
                self._blocking[r.step] = r.blocking_s
                if self.tuner is not None:
                    self.tuner.on_save(r.step, r.blocking_s)
            elif isinstance(r, CommitRecord):
                if self.tuner is not None:
                    self.tuner.on_commit(r.step, r.persist_s)
                self._on_checkpoint(r)
                if self.tuner is not None:
                    self._retune()

    def _retune(self) -> None:
        """Re-evaluate the auto interval; tell rank 0 (control file) when it moves by 10 % or more."""
        assert self.tuner is not None
        failures = sum(1 for h in self.record.history if h.reason in api.RETRYABLE)
        costs = self.accounting.restart_costs()
        restart = sorted(costs)[len(costs) // 2] if costs else None
        choice = self.tuner.choose(self.accounting.summary(time.time())["wall_s"], failures, restart)
        self.record.checkpoint_interval = choice.to_dict()
        if self._interval is None or abs(choice.steps - self._interval) >= 0.1 * self._interval:
            write_control(self.control_file, Control(choice.steps, choice.why))
            if self._interval is not None or choice.seconds is not None:
                self.console.event(f"checkpoint interval {self._interval or '-'} → {choice.steps} steps ({choice.why})")
            self._interval = choice.steps

    def _on_checkpoint(self, r: CommitRecord, mine: bool = True) -> None:
        """A new valid checkpoint: announce it once; the node whose rank 0 committed it applies retention."""
        if r.step in self._announced:
            return
        self._announced.add(r.step)
        self.record.last_checkpoint_step = r.step
        removed = ""
        if mine:
            plan = retention.plan(self.cfg.checkpoint.dir, store.scan(self.cfg.checkpoint.dir),
                                  self.cfg.checkpoint.keep, owner_alive=True)
            if plan.remove:
                done = retention.apply(plan)  # what was really removed: a folder may resist (a read-only mount)
                if done.removed:
                    removed = "; removed " + ", ".join(r.path.name for r in done.removed)
                removed += "".join(f"; could not remove {r.path.name}: {why}" for r, why in done.failed)
        blocked = self._blocking.pop(r.step, None)
        how = f"training blocked {blocked:.3f}s, " if blocked is not None else ""
        took = f" in {r.persist_s:.2f}s" if mine else " (committed by rank 0 on another node)"
        self.console.event(f"checkpoint step {r.step} committed ({how}{r.bytes / 1e6:.1f} MB{took}){removed}")
        self.save_state()

    def _follow_group(self, rec: AttemptRecord, heartbeats: dict[int, Heartbeat]) -> None:
        """Notice torchrun re-forming the worker group in place (it does so when a node joins)."""
        live = {hb.pid for hb in heartbeats.values() if hb.phase != "exited"}
        if not live:
            return
        if self._group_pids and not (live & self._group_pids):
            world = max(hb.world_size for hb in heartbeats.values())
            rec.regroups = [*(rec.regroups or []), {"at": time.time(), "world_size": world}]
            self._resume_noted = False
            self.console.event(f"attempt {rec.attempt}: torchrun re-formed the group in place (a node joined or "
                               f"left): world size {self._world} → {world}", style="yellow")
        self._group_pids = live
        self._world = rec.world_size = max(hb.world_size for hb in heartbeats.values())

    def _follow_resume(self, rec: AttemptRecord, heartbeats: dict[int, Heartbeat]) -> None:
        """The ranks agree on the resume step among all nodes; record the one they actually loaded."""
        # Only ranks that got as far as training have loaded anything (one that died first says None).
        loaded = {hb.resumed_from for hb in heartbeats.values() if hb.phase in ("train", "save")}
        if len(loaded) != 1:
            return
        step = loaded.pop()
        if self._resume_noted:
            return
        if rec.regroups:
            rec.regroups[-1]["resumed_from"] = step
        elif step != rec.resumed_from_step:
            self.console.event(f"attempt {rec.attempt}: the ranks resumed from step {step} (agreed across nodes; "
                               f"this node had handed over {rec.resumed_from_step})", style="yellow")
            rec.resumed_from_step = step
        self._resume_noted = True

    def _update_ranks(self, heartbeats: dict[int, Heartbeat], watch: RankWatch, now: float) -> None:
        ages = watch.ages(now)
        slow = watch.stragglers()
        ranks = []
        for rank, hb in sorted(heartbeats.items()):
            note = None
            if rank in slow:
                note = f"straggler: {slow[rank]:.2f} own steps/s, far below the other ranks"
            ranks.append({"rank": rank, "node": hb.node, "pid": hb.pid, "step": hb.step, "phase": hb.phase,
                          "world_size": hb.world_size, "heartbeat_at": hb.time,
                          "heartbeat_age_s": round(ages.get(rank, 0.0), 2),
                          "alive": hb.phase != "exited" and _pid_alive(hb.pid), "steps_per_s": hb.steps_per_s,
                          "own_steps_per_s": hb.own_steps_per_s, "hang_limit_s": round(watch.limit_s(rank), 2),
                          "note": note})
        self.record.ranks = ranks
        if heartbeats:
            self.record.step = max(hb.step for hb in heartbeats.values())

    def _silent_ranks(self, watch: RankWatch, heartbeats: dict[int, Heartbeat], failed: int | None) -> str:
        """The rank that timed out is rarely the one that hung: name any rank that had stopped beating."""
        limit = STALL_FLOOR_BEATS * self.cfg.heartbeat.interval_s
        ages = watch.ages(self.clock())
        silent = sorted(((age, r) for r, age in ages.items()
                         if age > limit and r != failed and heartbeats.get(r) and heartbeats[r].phase != "exited"),
                        reverse=True)
        return "".join(f"; rank {r} had been silent for {age:.0f}s (it is likely the one that hung)"
                       for age, r in silent[:2])

    def _rank_logs(self, spec: AttemptSpec, heartbeats: dict[int, Heartbeat]) -> dict[int, str]:
        return {rank: classify.tail(path) for rank, path in rank_stderr_paths(spec, heartbeats).items()}

    def _hang(self, spec: AttemptSpec, handle: AttemptHandle, hangs: list[Any],
              heartbeats: dict[int, Heartbeat]) -> AttemptOutcome:
        first = hangs[0]
        self.console.event(f"attempt {spec.attempt}: hang — {first.describe()}; capturing stacks before stopping",
                           style="red")
        out = spec.logs_dir / "hang_evidence.json"
        doc = evidence.capture(hangs, heartbeats, rank_stderr_paths(spec, heartbeats), out,
                               run_dir=self.cfg.run_dir)
        dumped = [r["rank"] for r in doc["ranks"] if r.get("stack_dump")]
        self.console.event(f"hang evidence in {out} (stack dumps from ranks {dumped or 'none'})")
        handle.stop(grace_s=HANG_STOP_GRACE_S)
        step = max((hb.step for hb in heartbeats.values()), default=None)
        return AttemptOutcome(api.HANG, first.describe(), first.rank, None, step, str(out))

    def _stop_attempt(self, spec: AttemptSpec, handle: AttemptHandle,
                      heartbeats: dict[int, Heartbeat]) -> AttemptOutcome:
        name = signal.Signals(self.stop_signal or signal.SIGTERM).name
        self.console.event(f"{name}: asking the ranks to checkpoint and stop (up to {self.cfg.stop_timeout_s:.0f}s)",
                           style="yellow")
        handle.signal_ranks(signal.SIGTERM)
        rc = handle.wait(self.cfg.stop_timeout_s + 5)
        heartbeats = read_heartbeats(spec.heartbeat_dir) or heartbeats
        self.record.step = step = max((hb.step for hb in heartbeats.values()), default=self.record.step)
        saved = store.latest_valid(self.cfg.checkpoint.dir)
        self.record.last_checkpoint_step = saved.step if saved else self.record.last_checkpoint_step
        how = "torchrun exited" if rc is not None else "the grace period ran out"
        return AttemptOutcome(api.STOPPED, f"stopped by {name} ({how}); newest valid checkpoint: "
                              f"{saved.step if saved else 'none'}", None, rc, step)

    # ---- endings ----------------------------------------------------------------------------------

    def _stopped(self, outcome: AttemptOutcome | None) -> int:
        sig = self.stop_signal or signal.SIGTERM
        self.record.message = outcome.detail if outcome else f"stopped by {signal.Signals(sig).name}"
        self._transition(RunState.STOPPED)
        self.console.event(f"{self.record.message}; `resilient run` again resumes", style="yellow")
        return ExitCode.SIGINT if sig == signal.SIGINT else ExitCode.SIGTERM

    def _failed(self, why: str, outcome: AttemptOutcome, spec: AttemptSpec) -> int:
        newest = store.latest_valid(self.cfg.checkpoint.dir)
        look = outcome.log_hint or str(spec.logs_dir)
        rank_hint = f" (rank {outcome.failed_rank}'s stderr.log under it)" if outcome.failed_rank is not None else ""
        self.record.message = (
            f"resilient stopped the run: {why}. Attempt {spec.attempt} ended at step {outcome.step}; "
            f"the newest valid checkpoint is {('step ' + str(newest.step)) if newest else 'none'}. "
            f"Look at {look}{rank_hint}, and `resilient status {self.cfg.run_dir}` for the history.")
        self._transition(RunState.FAILED)
        self.console.paragraph(self.record.message)
        return ExitCode.FAILED


def disk_note(root: Path) -> str:
    """A failed save on a (nearly) full filesystem says so: torch's own error may not (a short write in a
    zip header reads "unexpected pos")."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return ""
    newest = max((i.size_bytes for i in store.scan(root) if i.valid), default=0) if root.is_dir() else 0
    if usage.free < max(newest, 0.02 * usage.total):
        return (f"; the checkpoint filesystem has {usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB "
                "(free space there, or lower checkpoint.keep)")
    return ""


def current_group(heartbeats: dict[int, Heartbeat], window_s: float = 10.0) -> dict[int, Heartbeat]:
    """Heartbeats of the newest worker group: when torchrun re-forms the group in place (a node joined),
    the files of the previous group's ranks stay behind; the ranks of one group start within seconds."""
    if not heartbeats:
        return heartbeats
    newest = max(hb.started_at for hb in heartbeats.values())
    return {r: hb for r, hb in heartbeats.items() if hb.started_at >= newest - window_s or _pid_alive(hb.pid)}


def rank_stderr_paths(spec: AttemptSpec, heartbeats: dict[int, Heartbeat]) -> dict[int, Path]:
    """Each rank's stderr log: from its heartbeat (torchrun's per-rank folder), else by local rank."""
    paths: dict[int, Path] = {}
    for rank, hb in heartbeats.items():
        if hb.log_dir:
            paths[rank] = Path(hb.log_dir) / "stderr.log"
    for p in (spec.logs_dir / "ranks").glob("*/attempt_*/*/stderr.log"):
        local = int(p.parent.name)
        paths.setdefault(local, p)  # single node: local rank == rank for ranks that never beat
    return paths


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
