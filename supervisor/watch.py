"""Rank liveness from heartbeats, judged with the supervisor's own monotonic clock.

A heartbeat's timestamps come from another process (maybe another host); we never compare clocks. We note
*when we saw* a rank's `seq` change (it beats) and its `step` change (it progresses). Every check is a pure
function of `now`, so tests drive it without sleeping.

Rules, per rank:
- no heartbeat yet: hung once `startup_timeout_s` has passed since launch;
- silent (seq unchanged) for `timeout_s`: hung, whatever its phase (stopped, dead-locked, GIL held);
- phase `startup` or `load` past `startup_timeout_s` since launch: hung;
- phase `train` without a new step for `timeout_s`: hung (stuck in a collective: its beat thread lives); before
  its first step (a compile, autotuning) only once `startup_timeout_s` has passed since launch as well;
- phase `save` and `load` are not held to progress; a `save` is hung once `save_timeout_s` (default
  `startup_timeout_s`) has passed since it began; `exited` is never hung.

With a `stall_factor` k, a rank in `train` is held to a tighter limit once it has reported its step times:
k × the slowest of its recent steps, never less than `stall_floor_s` (the supervisor sees a step only when
a heartbeat is written, once per interval) and never more than `timeout_s`. Silence counts against the
same limit, so the rank that stopped is still the one named.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from supervisor.protocol import Heartbeat

SILENT = "silent"
NO_PROGRESS = "no_progress"
NO_HEARTBEAT = "no_heartbeat"
STARTUP = "startup"  # still starting up or loading after startup_timeout_s
SAVE_TOO_LONG = "save_too_long"  # in a save longer than save_timeout_s
STOP_IGNORED = "stop_ignored"  # still running when a graceful stop's grace ran out
STALL_FLOOR_BEATS = 3  # a stall limit is never below this many heartbeat intervals


@dataclass
class RankSeen:
    hb: Heartbeat
    seq_at: float  # our monotonic time when seq last changed
    step_at: float  # our monotonic time when step last changed


@dataclass(frozen=True)
class Hang:
    rank: int | None
    kind: str  # SILENT, NO_PROGRESS, NO_HEARTBEAT, STARTUP, SAVE_TOO_LONG, STOP_IGNORED
    for_s: float
    step: int | None
    phase: str | None
    never_stepped: bool = False  # in `train` since its resume without reporting one step
    waiting: bool = False  # in the step-end agreement, waiting for the others
    saving: tuple[int, ...] = ()  # ranks waiting for this one inside save(step): it never called it, or not yet

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "no rank"
        if self.kind == SILENT:
            return f"{who} silent for {self.for_s:.0f}s in phase {self.phase} at step {self.step}{self._saving()}"
        if self.kind == NO_PROGRESS and self.never_stepped:
            since = "since it started" if not self.step else f"since it resumed at step {self.step}"
            return (f"{who} reported no step in {self.for_s:.0f}s {since} (a script of your own must call "
                    "session.beat(step, loss) every step)")
        if self.kind == NO_PROGRESS:
            waits = " (waiting for the others at the step-end agreement)" if self.waiting else ""
            return f"{who} made no progress for {self.for_s:.0f}s at step {self.step}{waits}{self._saving()}"
        if self.kind in (STARTUP, SAVE_TOO_LONG):
            return f"{who} still in {self.phase} after {self.for_s:.0f}s"
        if self.kind == STOP_IGNORED:
            return f"{who} still running {self.for_s:.0f}s after the stop signal (step {self.step}, {self.phase})"
        if self.rank is not None:
            return f"{who} wrote no heartbeat in {self.for_s:.0f}s (the other ranks did)"
        return f"no heartbeat from any rank after {self.for_s:.0f}s"

    def _saving(self) -> str:
        if not self.saving:
            return ""
        ranks = "rank " + ", ".join(map(str, self.saving)) if len(self.saving) < 4 else f"{len(self.saving)} ranks"
        return (f" and has not entered save({self.step}), where {ranks} {'waits' if len(self.saving) == 1 else 'wait'}"
                " for it: save() is collective, call it on every rank at the same steps")


def verdict(hangs: list[Hang]) -> str:
    """The first (likeliest) hang's sentence, and the other silent ranks: a node's ranks all stopped (a SIGSTOP of
    the group, a frozen host) named only the first."""
    also = [h.rank for h in hangs[1:] if h.kind == SILENT and h.rank is not None]
    if not also:
        return hangs[0].describe()
    who = f"rank {also[0]}" if len(also) == 1 else "ranks " + ", ".join(map(str, also[:7])) + \
        (f" and {len(also) - 7} more" if len(also) > 7 else "")
    return f"{hangs[0].describe()}; {who} silent too"


OBSERVE_GAP_S = 5.0  # looks this far apart: the supervisor did not look in between (its poll is 0.5 s)


@dataclass
class RankWatch:
    launched_at: float
    timeout_s: float
    startup_timeout_s: float
    expected_ranks: int | None = None
    stall_factor: float | None = None
    stall_floor_s: float = 3.0
    save_timeout_s: float | None = None  # None: startup_timeout_s
    seen: dict[int, RankSeen] = field(default_factory=dict)
    group_started_at: float | None = None  # torchrun re-formed the group in place (a node joined)
    observed_at: float | None = None

    def observe(self, heartbeats: dict[int, Heartbeat], now: float, wall: float | None = None) -> None:
        """Take the ranks' latest beats, seen at `now`. After a gap in the looking (the supervisor was stopped,
        or starved of CPU), a beat that changed meanwhile is dated by its own clock (`wall`: this host's time.time(),
        which the ranks on this node write), not by `now`: a rank silent since before the gap is caught on the
        first look after it, not a whole timeout later (audit 8)."""
        gap = self.observed_at is not None and now - self.observed_at > OBSERVE_GAP_S
        self.observed_at = now

        def dated(at: float | None, floor: float) -> float:
            if not gap or at is None or wall is None:
                return now
            return min(now, max(floor, now - max(0.0, wall - at)))

        for rank in [r for r in self.seen if r not in heartbeats]:
            del self.seen[rank]  # a rank of an older worker group
        for rank, hb in heartbeats.items():
            prev = self.seen.get(rank)
            if prev is None or hb.pid != prev.hb.pid:
                if prev is not None:
                    self.group_started_at = now
                self.seen[rank] = RankSeen(hb, now, now)
                continue
            if hb.seq != prev.hb.seq:
                prev.seq_at = dated(hb.time, prev.seq_at)
            if hb.step != prev.hb.step or hb.phase != prev.hb.phase:
                # leaving a save or a load is progress: its time is not "no progress" (its beat's time dates it;
                # progress_at is the last step's, from before the save)
                moved = hb.progress_at if hb.step != prev.hb.step and hb.progress_at is not None else hb.time
                prev.step_at = dated(moved, prev.step_at)
            prev.hb = hb

    def limit_s(self, rank: int) -> float:
        """How long `rank` may go without a beat, or in `train` without a step, before it counts as hung."""
        s = self.seen.get(rank)
        if self.stall_factor is None or s is None or s.hb.phase != "train" or not s.hb.slowest_step_s:
            return self.timeout_s
        return min(self.timeout_s, max(self.stall_floor_s, self.stall_factor * s.hb.slowest_step_s))

    def hangs(self, now: float) -> list[Hang]:
        """Every rank that looks hung at `now`; silent ranks (the likely culprits) first."""
        found: list[Hang] = []
        since_launch = now - max(self.launched_at, self.group_started_at or self.launched_at)
        if not self.seen:
            if since_launch > self.startup_timeout_s:
                found.append(Hang(None, NO_HEARTBEAT, since_launch, None, None))
            return found
        for rank, s in sorted(self.seen.items()):
            phase = s.hb.phase
            if phase == "exited":
                continue
            silent, limit = now - s.seq_at, self.limit_s(rank)
            if silent > limit:
                found.append(Hang(rank, SILENT, silent, s.hb.step, phase))
            elif phase in ("startup", "load"):
                if since_launch > self.startup_timeout_s:
                    found.append(Hang(rank, STARTUP, since_launch, s.hb.step, phase))
            elif phase == "save":  # not held to the step's pace, but not forever either (a hung NFS mount)
                if now - s.step_at > (self.save_timeout_s or self.startup_timeout_s):
                    found.append(Hang(rank, SAVE_TOO_LONG, now - s.step_at, s.hb.step, phase))
            elif phase == "train" and s.hb.first_step_at is None and since_launch <= self.startup_timeout_s:
                continue  # its first step: the startup's allowance
            elif phase == "train" and now - s.step_at > limit:
                # a save of its step started elsewhere and waits for this rank: `if rank == 0: save()` (or slow
                # code of the user's between beat() and save())
                # (not when this rank's own beat shows it has been through that save: an async one in flight, or
                # one done; review 14: a rank whose save returned was told it never called it, the one stuck
                # staging on a GPU spared until save_timeout_s)
                been = s.hb.step is not None and (s.hb.saving_step == s.hb.step
                                                  or (s.hb.last_save or {}).get("step") == s.hb.step)
                saving = () if been else tuple(
                    r for r, o in sorted(self.seen.items())
                    if o.hb.phase == "save" and s.hb.step is not None and o.hb.saving_step == s.hb.step)
                # This rank has been through save(step) and waits; a peer still in it (staging, on a wedged GPU) is
                # the one held up: named first, before its own save_timeout_s (review 15: this rank was named)
                stuck = [(r, o) for r, o in sorted(self.seen.items()) if been and r != rank and
                         o.hb.phase == "save" and o.hb.saving_step == s.hb.step]
                for r, o in stuck:
                    if not any(h.rank == r for h in found):
                        found.append(Hang(r, SAVE_TOO_LONG, now - o.step_at, o.hb.step, o.hb.phase))
                if silent > self.stall_floor_s:  # stopped beating too: the one the others wait for
                    found.append(Hang(rank, SILENT, silent, s.hb.step, phase, saving=saving))
                else:
                    found.append(Hang(rank, NO_PROGRESS, now - s.step_at, s.hb.step, phase,
                                      never_stepped=s.hb.first_step_at is None, waiting=s.hb.in_sync or bool(stuck),
                                      saving=saving))
        if self.expected_ranks and since_launch > self.startup_timeout_s:
            for rank in range(self.expected_ranks):
                if rank not in self.seen:
                    found.append(Hang(rank, NO_HEARTBEAT, since_launch, None, None))
        found = list({(h.rank, h.kind): h for h in found}.values())  # a peer in save named by several waiting ranks
        # One never heard of: what the others wait for.
        order = {SILENT: 0, NO_HEARTBEAT: 1, STARTUP: 2, SAVE_TOO_LONG: 2, NO_PROGRESS: 3}
        # Among ranks without progress, one waiting for the others at the step-end agreement is not the one held up.
        return sorted(found, key=lambda h: (order[h.kind], h.waiting, -h.for_s))

    def ages(self, now: float) -> dict[int, float]:
        """Seconds since we last saw each rank beat."""
        return {rank: now - s.seq_at for rank, s in self.seen.items()}

    def stragglers(self, factor: float = 0.5) -> dict[int, float]:
        """Ranks whose own step rate is below `factor` × the other ranks' median: rank → its rate. Reported,
        not killed.

        In synchronous training every rank completes steps at the same wall rate, so the rate compared is the
        one that leaves out the time a rank waited for the others at the step-end sync: the rank everybody
        waits for has the lowest. (Time lost inside FSDP's own collectives is not attributed.)"""
        rates = {r: s.hb.own_steps_per_s for r, s in self.seen.items()
                 if s.hb.own_steps_per_s is not None and s.hb.phase == "train"}
        if len(rates) < 2:
            return {}
        slow = {}
        for r, v in rates.items():  # against the others' median: with two ranks, the straggler is half of any median
            others = statistics.median(x for q, x in rates.items() if q != r)
            if others > 0 and v < factor * others:
                slow[r] = v
        return slow

    def max_step(self) -> int | None:
        steps = [s.hb.step for s in self.seen.values()]
        return max(steps) if steps else None
