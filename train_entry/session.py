"""The library API: five calls that make a torchrun training script resumable under resilient.

    session = Session.start(seed=0)                    # process group, heartbeats, signals
    state = TrainState(model, optimizer, scheduler)
    step = session.resume(state)                       # the handed-over checkpoint, or 0
    while step < total_steps:
        loss = train_one_step(...)
        step += 1; state.step = step
        session.beat(step, loss)                       # agree on stop/NaN across ranks; heartbeat
        if session.should_save(step):
            session.save(step, state)
        if session.stop_requested:
            break
    sys.exit(session.finish(step, state))              # final checkpoint; 0, or 75 when preempted

The reference entry point (`python -m train_entry`) is written with exactly these calls.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import math
import numbers
import os
import socket
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from supervisor import store
from supervisor.protocol import (
    EXIT_CHECKPOINT_LOAD,
    EXIT_CONFIG,
    EXIT_NAN,
    EXIT_PREEMPTED,
    Handover,
    Heartbeat,
    SaveRecord,
)
from train_entry import dist as dist_util
from train_entry import signals
from train_entry.checkpoint import Checkpointer, SavePause
from train_entry.heartbeat import Beater
from train_entry.state import TrainState, seed_rank
from train_entry.stateful import Misuse, StatefulError

log = logging.getLogger("train_entry")

DEFAULT_INTERVAL = 50
SYNC_WARMUP_STEPS = 10  # agree every step at first, to measure the step time
SYNC_TARGET_S = 1.0  # then about this much training per agreement (a stop waits at most this long)
SYNC_MAX_STEPS = 50
DEFAULT_GRACE_S = 25.0  # torchrun's shutdown timeout is 30 s: leave room to exit
GRACE_MARGIN_S = 2.0
GROUP_ENV = "TORCHELASTIC_RUN_ID"  # torchrun's id of the rendezvous its workers formed, new at each launch
REGROUP_COPY_WAIT_S = 300.0  # a regroup's save, local only: how long rank 0 waits for its durable copy, at most
REGROUP_COPY_POLL_S = 0.5


def _process_started() -> float:
    """When this process started (wall clock), from /proc; now if unknown."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil is a dependency, but startup logging must never fail a run
        return time.time()


def _setup_logging(rank: int) -> None:
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")


class Session:
    """One rank's connection to resilient: the handover, the process group, heartbeats and checkpoints."""

    def __init__(self, handover: Handover, ctx: dist_util.DistContext, beater: Beater,
                 checkpointer: Checkpointer, stop: signals.StopRequest, *, interval: int | None,
                 seed: int, grace_s: float, sync_every: int = 0, interval_moves: bool = False):
        self.handover, self.ctx, self.beater, self.ckpt, self.stop = handover, ctx, beater, checkpointer, stop
        self.interval = interval or DEFAULT_INTERVAL
        # `auto`: the supervisor moves the interval, so it counts from the last save (or the resume step);
        # multiples of a moving interval would leave gaps of a few steps, each a save for almost nothing.
        self.interval_moves = interval_moves
        self.seed = seed
        self.grace_s = grace_s
        self.stop_requested = False  # agreed by all ranks, at a step boundary
        self._state: TrainState | None = None  # set by resume()
        self.last_saved_step: int | None = None
        self.resumed_from: int | None = None
        self._last_beat: float | None = None
        self.startup: dict[str, float] = {}
        self._sync_every: int | None = sync_every or None  # None: chosen after the warm-up steps
        self._warmup_until = 0
        self._window_loss = self._window_weight = 0.0
        self._window_steps = 0
        self._window_start: float | None = None
        self._mean: float | None = None
        self._step_warned = self._position_warned = self._beat_warned = False
        self._params_compared = False  # the plain parameters compared across the ranks, at the first save
        self._no_time_for: int | None = None  # the stop step whose checkpoint the ranks agreed the grace cannot fit
        self._finished: int | None = None
        self._resumed = False
        self._train_state: TrainState | None = None  # the one resumed: finish() takes it when the loop ignores a stop
        self._beat_step: int | None = None  # the last step beat() marked done
        self._stop_step: int | None = None  # the step at which the ranks agreed to stop

    # ---- start --------------------------------------------------------------------------------------

    @classmethod
    def start(cls, *, ckpt_dir: str | None = None, ckpt_interval: int | None = None,
              async_save: bool | None = None, heartbeat_dir: str | None = None,
              heartbeat_interval_s: float = 1.0, collective_timeout_s: float | None = None,
              device: str = "auto", seed: int = 0, save_pause: SavePause | None = None,
              sync_every: int = 0) -> Session:
        """Join the job. What the supervisor handed over (environment) wins over these arguments, which
        are the settings for a plain `torchrun` launch."""
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:  # the environment is wrong: EXIT_CONFIG, as the rank exit codes say
            print(f"resilient: {' and '.join(missing)} not set: start this script with torchrun "
                  "(`torchrun --nproc-per-node N SCRIPT`) or with `resilient run JOB.yaml`.", file=sys.stderr)
            sys.exit(EXIT_CONFIG)
        h = Handover.from_env()
        if not h.supervised and ckpt_interval is not None:  # under `resilient run` the job's interval wins
            whole = not isinstance(ckpt_interval, bool) and isinstance(ckpt_interval, (numbers.Integral, float)) \
                and float(ckpt_interval).is_integer() and ckpt_interval >= 1
            if not whole:
                print(f"resilient: Session.start(ckpt_interval={ckpt_interval!r}): give a whole number of steps, 1 "
                      f"or more, or None for {DEFAULT_INTERVAL}.", file=sys.stderr)
                sys.exit(EXIT_CONFIG)
            ckpt_interval = int(ckpt_interval)
        rank = int(os.environ.get("RANK", 0))
        _setup_logging(rank)
        stop = signals.StopRequest()
        signals.install(stop)
        dist_util.die_with_parent()
        node = h.node or socket.gethostname()  # as the supervisor names it (RunLayout.node_name)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        hb = Heartbeat(rank=rank, pid=os.getpid(), attempt=h.attempt, local_rank=local_rank,
                       world_size=int(os.environ.get("WORLD_SIZE", 1)), node=node,
                       started_at=time.time(),
                       log_dir=os.path.dirname(os.environ.get("TORCHELASTIC_ERROR_FILE", "")) or None,
                       restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        beater = Beater(hb, h.heartbeat_dir or heartbeat_dir, h.heartbeat_interval_s or heartbeat_interval_s,
                        step_log=h.step_log if local_rank == 0 else None,
                        control_file=h.control_file if rank == 0 else None,
                        supervisor_pid=h.supervisor_pid, on_orphaned=lambda: stop.set("supervisor gone"))
        beater.start()
        _misuse_ends_in_config(beater)
        t_pg = time.monotonic()
        try:
            ctx = dist_util.init(h.collective_timeout_s or collective_timeout_s or 600.0, device)
        except ValueError as e:  # the script's setup, the same on every retry: EXIT_CONFIG, one sentence
            end_as_config(beater, "start", str(e), destroy_group=False)  # a group the script made is gloo's too
        pg_s = time.monotonic() - t_pg
        beater.update(world_size=ctx.world_size)
        durable = h.ckpt_dir or ckpt_dir or "checkpoints"
        root = h.ckpt_local_dir or durable  # saves go to this node's local tier when there is one
        use_async = h.ckpt_async if h.ckpt_async is not None else (True if async_save is None else async_save)
        committer = ctx.local_rank == 0 if h.ckpt_local_dir else ctx.is_main
        ckpt = Checkpointer(root, ctx, async_save=use_async, on_committed=beater.record_commit if committer else None,
                            pause=save_pause, durable_root=durable, node=node)
        interval = h.ckpt_interval if h.supervised else ckpt_interval
        grace = (h.stop_grace_s or DEFAULT_GRACE_S) - GRACE_MARGIN_S
        if ctx.is_main:
            log.info("rank 0 of %d on %s (%s); checkpoints in %s every %s steps (%s)", ctx.world_size,
                     ctx.device, ctx.backend, root, interval or f"{DEFAULT_INTERVAL} (auto)",
                     "async" if use_async else "sync")
        session = cls(h, ctx, beater, ckpt, stop, interval=interval, seed=seed, grace_s=grace,
                      sync_every=sync_every, interval_moves=h.supervised and h.ckpt_interval is None)
        session.startup = {"process_start_to_session_s": time.time() - _process_started(), "process_group_s": pg_s}
        atexit.register(session._at_exit)  # runs before the beater's (atexit is last in, first out)
        return session

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    # ---- resume -------------------------------------------------------------------------------------

    def _choose_resume_step(self) -> tuple[int | None, str, str]:
        """The step every rank loads, and from which tier (and why): agreed across ranks and nodes.

        Supervised, each node's supervisor handed over the newest valid step it found; the smallest wins (a
        node behind on a lagging filesystem must not resume from a different one). A checkpoint committed
        after the launch was written by this attempt (an earlier worker group, before torchrun re-formed
        the group for a joining node) and is newer than anything handed over: it wins. Unsupervised, rank
        0 takes the newest valid checkpoint. With a local tier, the ranks read their node's local copy when
        every rank's node holds the same step there, whole, with that rank's shard (same nodes, same world
        size), and it is no older than the durable choice.
        """
        h = self.handover
        asked: list[Any] = [None] * self.world_size
        mine = (h.supervised, h.resume_step, h.launched_at, self._local_offer(), self._saved_since_launch())
        dist.all_gather_object(asked, mine, group=self.ctx.ckpt_group)
        decision: list[Any] = [None]
        if self.ctx.is_main:
            step = self._decide([a[:3] for a in asked])
            decision[0] = self._tier(step, [a[3] for a in asked])
            saved = [a[4] for a in asked if a[4] is not None]
            if saved:
                decision[0] = self._await_durable_copy(decision[0], *max(saved))
        dist.broadcast_object_list(decision, src=0, group=self.ctx.ckpt_group)
        return decision[0]

    def _saved_since_launch(self) -> tuple[int, str] | None:
        """This node's newest valid local step saved after this attempt's launch, with its save's identity: the
        checkpoint an earlier worker group of the attempt took when torchrun re-formed the group in place (a node
        joined). None without a local tier, unsupervised, or without one."""
        h = self.handover
        if not self.ckpt.local or not h.supervised or h.launched_at is None or not self.ckpt.root.is_dir():
            return None
        for path in reversed(store.checkpoint_dirs(self.ckpt.root)):
            info = store.inspect(path)
            if not info.valid or info.manifest is None:
                continue
            if not _saved_by_this_attempt(info.manifest, h.launched_at):
                return None  # the newest valid one is older than the launch
            return info.step, store.save_identity(info.manifest.files)
        return None

    def _await_durable_copy(self, decided: tuple[int | None, str, str], step: int,
                            identity: str) -> tuple[int | None, str, str]:
        """The group re-formed after its ranks saved `step` to their nodes' local tiers, which the larger group
        cannot read (the world changed): wait, bounded, for the supervisors to copy it to the durable tier, rather
        than resume from an older durable step (review 16: the steps since the attempt's launch were lost)."""
        if decided[0] is not None and decided[0] >= step:
            return decided
        limit = min(REGROUP_COPY_WAIT_S, 0.5 * (self.handover.collective_timeout_s or 600.0))  # the others wait
        path = self.ckpt.durable_root / store.step_dirname(step)  # in a collective meanwhile
        log.info("the group re-formed after step %d was saved to the local tiers: waiting up to %.0fs for its "
                 "durable copy", step, limit)
        deadline = time.monotonic() + limit
        while True:
            info = store.inspect(path) if path.is_dir() else None
            if info is not None and info.valid and info.manifest is not None \
                    and store.save_identity(info.manifest.files) == identity:
                return step, "durable", f"the group re-formed: step {step}, saved at the regroup, copied durably"
            if time.monotonic() >= deadline or self.stop:  # (a stop: no longer worth the wait)
                log.warning("the durable copy of step %d, saved when the group re-formed, did not come within %.0fs:"
                            " resuming from %s", step, limit, decided[0] if decided[0] is not None else "step 0")
                return decided
            time.sleep(REGROUP_COPY_POLL_S)

    def _decide(self, asked: list[tuple[bool, int | None, float | None]]) -> int | None:
        root = self.ckpt.durable_root
        supervised = [a for a in asked if a[0]]
        if not supervised:
            info = store.latest_valid(root)
            return info.step if info else None
        handed = sorted({step for _, step, _ in supervised if step is not None})
        if len(handed) > 1:
            log.warning("nodes handed over different steps %s: every rank resumes from %d", handed, handed[0])
        launched = min((t for _, _, t in supervised if t is not None), default=None)
        newer = None
        if launched is not None and root.is_dir():
            for path in reversed(store.checkpoint_dirs(root)):
                info = store.inspect(path)
                # when it was saved: a durable copy's created_at is its publish (review 13: the replicator still
                # copying a step a rollback passed over made it "committed by this attempt", and it came back)
                if info.valid and info.manifest is not None and _saved_by_this_attempt(info.manifest, launched):
                    newer = info
                    break
        if newer is not None and (not handed or newer.step > handed[0]):
            log.info("step %d was committed by this attempt after its launch: resuming from it", newer.step)
            return newer.step
        if not handed:
            return None
        want = handed[0]
        path = root / store.step_dirname(want)
        info = store.inspect(path) if path.is_dir() else None
        if info is not None and info.valid:
            return want
        # Below it first (it may be a rollback's target); then a newer one: a fresh start while valid checkpoints
        # exist would train from step 0 over them (review 13: a rollback's step deleted before the ranks read it).
        fallback = store.latest_valid(root, below=want) or store.latest_valid(root)
        log.warning("handed-over step %d is not valid here (%s); using %s", want,
                    info.reason if info else "missing", fallback.step if fallback else "a fresh start")
        return fallback.step if fallback else None

    def _local_offer(self) -> tuple[dict[int, str], str]:
        """The local steps this rank could read, up to the one its supervisor handed over (checked there), each
        with the identity of its save (store.save_identity); or none and why not."""
        h = self.handover
        if not self.ckpt.local:
            return {}, "no local tier"
        if h.local_resume_step is None:
            return {}, f"node {self.ckpt.node} has no local checkpoint"
        offer: dict[int, str] = {}
        why = ""
        for path in reversed(store.checkpoint_dirs(self.ckpt.root)):
            m = store.STEP_RE.match(path.name)
            if m is None or int(m.group(1)) > h.local_resume_step:
                continue
            step, info = int(m.group(1)), store.inspect(path)
            extra = info.manifest.extra if info.manifest else {}
            held = (extra.get("ranks") or {}).get(self.ckpt.node, [])
            if not info.valid:
                why = why or f"node {self.ckpt.node}'s local step {step} is {info.status.value}"
            elif self.ckpt.node in (extra.get("lacks_shards_of_other_nodes") or []):
                why = why or (f"node {self.ckpt.node}'s local step {step} lacks shards that ranks on other nodes "
                              "wrote (a tensor replicated across nodes, as HSDP's, is saved once)")
            elif info.world_size != self.world_size or self.rank not in held:
                why = why or (f"the world changed since local step {step} (saved by {info.world_size} ranks, rank "
                              f"{self.rank} {'held' if self.rank in held else 'not held'} on node {self.ckpt.node})")
            else:
                assert info.manifest is not None
                offer[step] = store.save_identity(info.manifest.files)
        return offer, why

    def _tier(self, durable_step: int | None, offers: list[tuple[dict[int, str], str]]) -> tuple[int | None, str, str]:
        """The step to load, its tier and why: the newest local step every rank offers as the same save (two
        nodes may hold different saves of one step number), unless older than `durable_step`."""
        if not self.ckpt.local:
            return durable_step, "durable", "one tier"
        empty = next((why for offer, why in offers if not offer), None)
        if empty is not None:
            return durable_step, "durable", empty
        common = set.intersection(*(set(offer.items()) for offer, _ in offers))
        newest = sorted({max(offer) for offer, _ in offers})
        if not common:
            return durable_step, "durable", f"the nodes hold no local step in common (their newest: {newest})"
        local = max(step for step, _ in common)
        if durable_step is not None and local < durable_step:
            return durable_step, "durable", f"the local step {local} is older than the durable step {durable_step}"
        behind = "" if newest == [local] else f" (the nodes' newest local steps: {newest})"
        return local, "local", f"every node holds step {local} whole{behind}"

    def resume(self, state: TrainState) -> int:
        """Load the agreed checkpoint into `state` (resharding if the world size changed); return the step
        to continue from, 0 for a fresh start.

        A stateful object that cannot be restored as declared (train_entry.stateful) ends every rank with
        EXIT_CONFIG (78) and one sentence naming it: the checkpoint's bytes were verified, so what fails is
        the object or its declaration, and every checkpoint of the run would fail the same way.
        """
        self.ckpt.wait()  # a save in flight gathers on the checkpoint group too
        try:
            state.settle()  # the stateful objects declared now are the ones resumed
        except (StatefulError, TypeError, ValueError) as e:  # one declared since TrainState(...): checked now
            self._exit_config("resume", -1, str(e), everyone_failed=True)
        self.beater.set_phase("load", now=True)
        t_resume = time.monotonic()
        self._warn_of_unheld_scheduler(state)
        step, tier, why = self._choose_resume_step()
        if state.stateful:
            self._check_stateful(state)
        if step is None:
            seed_rank(self.seed, self.rank, 0, self.device)
            if self.ctx.is_main:
                log.info("no checkpoint to resume from: starting at step 0")
        else:
            path = (self.ckpt.root if tier == "local" else self.ckpt.durable_root) / store.step_dirname(step)
            t0 = time.monotonic()
            tiers = {"loading_tier": tier, "resumed_tier": tier, "resumed_why": why} if self.ckpt.local else {}
            self.beater.update(loading_step=step, **tiers)
            problem, notes = None, []
            try:
                # The template raises the same StatefulError on every rank (it depends only on the checkpoint's
                # keys, the world size and the declarations), so no rank is left alone inside DCP's load.
                sd = self.ckpt.load(path, lambda keys: self._template(state, keys))
                notes = state.load(sd, self.rank, self.device, self.seed, world_size=self.world_size)
            except StatefulError as e:
                problem = str(e)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException; every failure is news
                self._exit_unloadable(step, path, e)
            if state.stateful or problem is not None:  # without stateful objects, only the scheduler's: every rank's
                self._stop_unless_all_fine(problem, f"resume from {path.name}")
            if state.step != step:
                self._exit_unloadable(step, path, RuntimeError(f"it holds step {state.step}, expected {step}"))
            if self.ctx.is_main:
                manifest = store.inspect(path).manifest
                saved_world = manifest.world_size if manifest else "?"
                reshard = f", resharded from {saved_world} ranks" if saved_world != self.world_size else ""
                tiers = f" from the {tier} tier ({why})" if self.ckpt.local else ""
                log.info("resumed from step %d (%s)%s in %.2fs%s", step, path.name, tiers, time.monotonic() - t0,
                         reshard)
                if notes:
                    log.info("restored stateful: %s", ", ".join(notes))
        self.last_saved_step = step
        self.resumed_from = step
        self._resumed = True
        self.startup["choose_and_load_s"] = time.monotonic() - t_resume
        if self.ctx.is_main:
            log.info("startup: %s", ", ".join(f"{k} {v:.2f}" for k, v in self.startup.items()))
        self._warmup_until = (step or 0) + SYNC_WARMUP_STEPS
        self._state = state  # its layout sizes the staging arena once training runs (beat)
        self._train_state = state
        self.beater.update(step=step or 0, resumed_from=step)
        self.beater.set_phase("train", now=True)
        return step or 0

    def _warn_of_unheld_scheduler(self, state: TrainState) -> None:
        """An LR scheduler is attached to an optimizer (every torch LRScheduler writes `initial_lr` into its param
        groups) but not given to TrainState: it is never saved, and each resume restarts its schedule (audit 19: the
        warmup began again at step 76, silently)."""
        if state.scheduler is not None or any(isinstance(getattr(d, "obj", d), torch.optim.lr_scheduler.LRScheduler)
                                              for d in state.stateful.values()):  # held as a stateful object
            return
        several = state.optimizer if isinstance(state.optimizer, (list, tuple)) else [state.optimizer]
        if any("initial_lr" in group for opt in several for group in opt.param_groups):
            self._warn("an LR scheduler is attached to the optimizer but not given to TrainState: it is not saved, "
                       "and a resumed run restarts its schedule; pass it, TrainState(model, optimizer, scheduler)")

    def _template(self, state: TrainState, keys: set[str]) -> dict[str, Any]:
        ignored = state.undeclared_stateful(keys)
        if ignored:
            self._warn(f"the checkpoint holds stateful {', '.join(map(repr, ignored))}, which this run does not "
                       "declare: not restored (a data loader starts over); declare it as it was saved")
        if state.scheduler is None and any(k.startswith("scheduler.") for k in keys):
            self._warn("the checkpoint holds an LR scheduler, which this run does not have: not restored")
        return state.template(self.rank, keys, world_size=self.world_size)

    def _warn(self, text: str) -> None:
        """A warning the user should see without reading rank 0's log: logged, and (rank 0) noted in the step log,
        which the supervisor shows on its console and in `status`."""
        if self.ctx.is_main:
            log.warning("%s", text)
            self.beater.note(text)

    def _gather(self, mine: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.ctx.ckpt_group)
        return everyone

    def _check_stateful(self, state: TrainState) -> None:
        """Every rank's stateful objects fit their declarations, and the replicated ones are the same on
        every rank (one small gather; otherwise a save would silently keep one rank's copy)."""
        try:
            mine: tuple[str | None, dict[str, str]] = (None, state.check_stateful())
        except StatefulError as e:
            mine = (str(e), {})
        everyone = self._gather(mine)
        failed = [(r, problem) for r, (problem, _) in enumerate(everyone) if problem]
        if not failed and (differs := state.stateful_differs([digests for _, digests in everyone])):
            failed = [(-1, differs)]
        if failed:
            self._exit_config("start", *failed[0], everyone_failed=len(failed) == self.world_size)

    def _compare_plain_params(self, state: TrainState, step: int) -> None:
        """Once, at the first save: a parameter that is not a DTensor (a DDP model's, or one left unwrapped) must be
        the same on every rank that holds it under that name, or DCP saves one rank's copy of each such tensor and
        the checkpoint mixes the ranks' models (audit: the README's snippet without fully_shard did, exit 0). The
        first elements of each tell (ranks training copies of their own differ there from the first step); ranks
        holding other names (pipeline stages) are not compared."""
        if self.world_size == 1:
            return
        names, sample = hashlib.sha256(), hashlib.sha256()
        for name, p in state.model.named_parameters():
            if isinstance(p, DTensor):
                continue
            names.update(name.encode() + b"\0")
            sample.update(p.detach().reshape(-1)[:256].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        everyone = self._gather((names.hexdigest(), sample.hexdigest()))
        mine = everyone[self.rank]
        differ = sorted(r for r, (n, d) in enumerate(everyone) if n == mine[0] and d != mine[1])
        problem = (f"the model's parameters differ between ranks {self.rank} and {differ[0]}: each rank trains its "
                   "own copy, and a checkpoint would mix them; wrap the model in fully_shard (FSDP2) or "
                   "DistributedDataParallel, or average its gradients across the ranks") if differ else None
        self._stop_unless_all_fine(problem, f"save step {step}")

    def _require_resumed(self, call: str) -> None:
        """`beat` and `save` before `resume`: a save would replace the run's valid checkpoints with a fresh start's
        steps, and its background gather would meet resume's on the checkpoint group. Every rank runs the same
        script, so every rank ends here alike."""
        if not self._resumed:
            self._exit_config(f"run session.{call}()", -1, "it came before session.resume(state); call resume "
                              "once, before the training loop: it loads the checkpoint to go on from",
                              everyone_failed=True)
        if self._finished is not None:  # audit 19: torch's own error, a traceback, and the run relaunched to it
            self._exit_config(f"run session.{call}()", -1, "it came after session.finish(), which saved the final "
                              "step and closed the session; end the script with sys.exit(session.finish(step, "
                              "state)) and train or save nothing after it", everyone_failed=True)

    def _step_given(self, call: str, step: Any) -> int:
        """The step as an int, or exit 78: a float step failed every save in a rank traceback (retried as a checkpoint
        failure), and a numpy integer failed every heartbeat write (the rank was killed as hung). Every rank runs
        the same script, so every rank ends here alike."""
        integral = isinstance(step, numbers.Integral) and not isinstance(step, bool)
        if integral and 0 <= int(step) <= store.MAX_STEP:
            return int(step)
        what = f"outside 0..{store.MAX_STEP}" if integral else f"a {type(step).__name__}"
        self._exit_config(f"run session.{call}()", -1, f"{call}({step!r}): the step is {what}; give it the training "
                          "step as an int (the optimizer steps done)", everyone_failed=True)

    def _stop_unless_all_fine(self, problem: str | None, doing: str) -> None:
        """Agree across ranks on `problem` (None: fine here); if any rank has one, exit with EXIT_CONFIG."""
        failed = [(r, p) for r, p in enumerate(self._gather(problem)) if p]
        if failed:
            self._exit_config(doing, *failed[0], everyone_failed=len(failed) == self.world_size)

    def _exit_config(self, doing: str, rank: int, problem: str, everyone_failed: bool) -> NoReturn:
        """Every rank logs the same sentence (the supervisor reports the failed rank's last log line) and exits
        with EXIT_CONFIG: retrying cannot help."""
        where = f"rank {rank}: " if rank >= 0 and self.world_size > 1 and not everyone_failed else ""
        end_as_config(self.beater, doing, where + problem, destroy_group=True)

    # ---- every step ---------------------------------------------------------------------------------

    def beat(self, step: int, loss: float | torch.Tensor | None = None, weight: float = 1.0) -> float | None:
        """Mark `step` done.

        Every step: a non-finite local loss exits the process with EXIT_NAN (76) at once, before anything of
        this step can be saved (the NaN reaches every rank's parameters within the step, and no checkpoint
        commits without every rank). Every `sync_every` steps, all ranks agree in one small all-reduce on
        the mean loss since the last agreement (weighted), on whether to stop (a signal reached any rank)
        and on the supervisor's checkpoint interval. `sync_every` is chosen after ten warm-up steps so that
        an agreement covers about SYNC_TARGET_S of training: 1 for steps of a second or more, more for
        tiny steps, where one all-reduce costs a few percent of a step (bench: ~1.6 ms on 2 busy cores).

        Returns the mean loss over all ranks of the last agreed window: the same on every rank, but for logging
        only, since which steps a window holds depends on the measured step time and the resume step (feed a
        scheduler such as ReduceLROnPlateau a loss you all-reduce yourself, or a resumed run will not match).

        Called again with the same step (once per micro-batch of gradient accumulation), it checks and adds that
        loss and nothing else: the step was marked done once. A step that goes back is refused (exit 78), and a
        loop that goes on after the ranks agreed to stop ends here, as `finish()` would end it (exit 75).
        """
        self._require_resumed("beat")
        step = self._step_given("beat", step)
        value = 0.0 if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if loss is not None and not math.isfinite(value):
            self._exit_nan(step, value)
        self.ckpt.raise_if_failed()  # a failed background save ends the rank now, not an interval later
        now = time.monotonic()
        self._window_loss += value * weight
        self._window_weight += weight
        if step == self._beat_step:
            return self._mean
        if self._beat_step is not None and step < self._beat_step:
            self._exit_config("run session.beat()", -1, f"beat({step}) came after beat({self._beat_step}): give it "
                              "the training step, one more each optimizer step, the count save() gets",
                              everyone_failed=True)
        if self._stop_step is not None and step > self._stop_step:
            self._end_ignored_stop(step)
        self._beat_step = step
        self._window_steps += 1
        if self._window_start is None:
            self._window_start = now
        if self._sync_every is not None and step % self._sync_every != 0:
            self.beater.progress(step)
            return self._mean
        want_interval = 0.0
        control = self.beater.control_interval
        if self.ctx.is_main and control and control != self.interval:
            want_interval = float(control)
        if self.device.type == "cuda":  # this rank's own kernels end outside the window: slow ones are its own
            torch.cuda.current_stream(self.device).synchronize()  # (a GPU loss's float() above has done it)
            now = time.monotonic()
        step_s = (now - self._window_start) / self._window_steps
        t = torch.tensor([self._window_loss, self._window_weight, 1.0 if self.stop else 0.0, want_interval,
                          step_s], dtype=torch.float64, device=self.device)
        self.beater.update(in_sync=True)  # a hang here is another rank's: the supervisor blames that one
        dist.all_reduce(t)
        # On NCCL the call only queues the reduction on the GPU's stream: the wait for the others is this read,
        # which must fall inside the window (review 10: it fell after it, so on a GPU no rank was ever seen
        # waiting for a hung one, and that wait was counted as the rank's own time). One read, one sync.
        loss_sum, total_weight, stop, want, step_s_sum = t.tolist()
        self.beater.update(in_sync=False)
        done = time.monotonic()
        # Time not spent waiting for the others at this sync, per step: the rank everyone waits for has most.
        own_s = None if self._last_beat is None else ((now - self._last_beat) / self._window_steps)
        self._last_beat = done
        # weight 0 on every rank (a token-weighted loss of all-padding batches): no mean, as the tensor's 0/0 gave
        self._mean = None if loss is None else loss_sum / total_weight if total_weight else math.nan
        self._window_loss = self._window_weight = 0.0
        self._window_steps, self._window_start = 0, done
        if stop > 0 and not self.stop_requested:
            self.stop_requested, self._stop_step = True, step
            if self.ctx.is_main:
                log.warning("stop requested (%s): stopping after step %d", self.stop.reason or "another rank",
                            step)
        if want > 0:
            new = int(want)
            if self.ctx.is_main:
                log.info("checkpoint interval %d -> %d steps (from the supervisor)", self.interval, new)
            self.interval = new
        if self._sync_every is None and step >= self._warmup_until:
            mean_step_s = step_s_sum / self.world_size
            self._sync_every = max(1, min(SYNC_MAX_STEPS, round(SYNC_TARGET_S / max(mean_step_s, 1e-6))))
            if self.ctx.is_main:
                log.info("ranks agree every %d step(s) (%.1f ms per step)", self._sync_every, mean_step_s * 1e3)
        if self._state is not None and step >= self._warmup_until:
            # Once, at an agreement (every rank at this step: the state dict may be collective), with the
            # optimizer's state in place: the staging arena is allocated in the background from here.
            state, self._state = self._state, None
            with contextlib.suppress(StatefulError):  # the next save says it, with exit 78, on every rank
                self.ckpt.prepare(lambda: state.state_dict(self.rank, self.device))
        self.beater.progress(step, own_s)
        return self._mean

    def should_save(self, step: int) -> bool:
        """At every interval (multiples of a fixed one; `auto`: that many steps after the last save or the
        resume), and at once when a stop was agreed. The same answer on every rank."""
        if step == self.last_saved_step:
            return False
        if self.stop_requested:
            return True
        if self.interval_moves:
            return step - (self.last_saved_step or 0) >= self.interval
        return step % self.interval == 0

    def save(self, step: int, state: TrainState, *, sync: bool | None = None) -> float | None:
        """Checkpoint `state` as `step` (which becomes `state.step` if it was not). Async unless `sync` or
        stopping; returns the seconds training was blocked, or None if skipped (already saved, or a stop whose
        grace cannot fit a save)."""
        self._require_resumed("save")
        step = self._step_given("save", step)
        if self._beat_step is not None and step < self._beat_step:  # micro-steps in beat(): lost steps, the interval
            # (before the already-saved skip, audit 19: save(25) after beat(30) passed in silence when 25 was saved)
            self._exit_config(f"save step {step}", -1, f"save({step}) came after beat({self._beat_step}): beat() and "
                              "save() must count the same steps, the optimizer's (a micro-batch count in beat() "
                              "misleads the supervisor's lost-step and interval accounting)", everyone_failed=True)
        if step == self.last_saved_step:
            return None
        if self._beat_step is None and step > (self.resumed_from or 0) and not self._beat_warned:
            self._beat_warned = True  # audit 12: the run "finished at step 0", its hangs caught only after the startup
            self._warn(f"save({step}) with no session.beat() before it: call session.beat(step, loss) every step; "
                       "the supervisor sees progress, agrees stops and judges hangs through it (a rank that never "
                       "beats is judged hung only after heartbeat.startup_timeout_s)")
        sync = bool(self.stop_requested) if sync is None else sync
        # In `save` before the first collective: a rank that never calls save() (`if rank == 0: save()`) is then
        # the one named for the hang, the others waiting for it in save(step).
        self.beater.set_phase("save", now=sync)
        self.beater.update(saving_step=step)
        blocking = self._save(step, state, sync)
        self.beater.update(saving_step=self.ckpt.in_flight)
        self.beater.set_phase("train")
        return blocking

    def _save(self, step: int, state: TrainState, sync: bool) -> float | None:
        if not self._params_compared:
            self._params_compared = True
            self._compare_plain_params(state, step)
        if state.step != step:  # the checkpoint of `step` must say `step`: a resume checks it and refuses otherwise
            if not self._step_warned:
                self._warn(f"save({step}) with state.step {state.step}: the checkpoint records step {step} (set "
                           "state.step = step before saving)")
            self._step_warned = True
            state.step = step
        if self.stop_requested and step == self._no_time_for:  # agreed already (finish() asks again): once is enough
            return None
        if self.stop_requested and not self._grace_allows():
            self._no_time_for = step  # on every rank: the agreement is collective
            if self.ctx.is_main:
                log.warning("stopping without a checkpoint of step %d: the grace period is too short", step)
            return None
        extra = {"samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen}
        if (group := os.environ.get(GROUP_ENV)) is not None:  # which torchrun group saved it: this attempt's?
            extra["torchelastic_run_id"] = group
        blocking = self.ckpt.save(step, lambda: self._state_dict(state), sync=sync, extra=extra)
        self.last_saved_step = step
        self.beater.record_save(SaveRecord(step, time.time(), blocking))
        return blocking

    def _state_dict(self, state: TrainState) -> dict[str, Any]:
        """`state`'s state dict for a save, once every rank has checked that its Replicated objects are still
        the same as the others' (one small all-reduce of their digests; with none, nothing): DCP would keep one
        rank's copy and hand it to every rank at the resume. A drifted one ends every rank with EXIT_CONFIG."""
        try:
            sd = state.state_dict(self.rank, self.device)
        except StatefulError as e:  # the same script on every rank: every rank ends here alike
            if e.__cause__ is not None:  # the object's own exception: where in its code, before the sentence
                log.error("stateful state_dict() failed at save step %d", state.step, exc_info=e.__cause__)
            self._exit_config(f"save step {state.step}", -1, str(e), everyone_failed=True)
        keys = state.replicated_keys()
        if self.world_size == 1:
            return sd
        blobs = [sd[k] for k in keys] + [sd["train"].encode()]
        mine = [int.from_bytes(hashlib.blake2b(b, digest_size=7).digest(), "little") for b in blobs]
        t = torch.tensor(mine + [-d for d in mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the largest and, negated, the smallest of each digest
        got = t.tolist()  # one copy to the host (on a GPU, one sync), not two per digest
        same = [got[i] == -got[len(mine) + i] for i in range(len(mine))]
        for ok, what in zip(same[:-1], keys.values(), strict=True):
            if not ok:
                self._exit_config("save", -1, f"{what} differs between the ranks, so it is not replicated: "
                                  "only one rank's copy would be saved; declare it PerRank", everyone_failed=True)
        if not same[-1] and not self._position_warned:
            self._position_warned = True
            self._warn(f"the training position (state.step, samples_seen, tokens_seen, extra) differs between the "
                       f"ranks at step {state.step}: the checkpoint keeps rank 0's and a resume gives it to every "
                       "rank; count them the same on every rank (global counts)")
        return sd

    def _grace_allows(self) -> bool:
        """Whether the stop's checkpoint fits in what is left of the grace, agreed by every rank: the save is
        collective, and ranks that had the signal at different times (or only from the others) must not split,
        some saving while the rest exit."""
        mine = 1.0
        if self.stop.at is not None:
            left = self.grace_s - (time.monotonic() - self.stop.at)
            mine = 1.0 if left > (self.ckpt.last_save_s or 0.0) else 0.0
        t = torch.tensor([mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t[0] > 0)

    # ---- the end ------------------------------------------------------------------------------------

    def _end_ignored_stop(self, step: int) -> NoReturn:
        """The loop went on past the step where the ranks agreed to stop: it would save every step (should_save says
        yes once stopping) until the supervisor's grace ran out and it killed the ranks as hung. End it as finish()
        does, and say so. With the stop's step saved, nothing more is: this beat() comes in the middle of the
        script's step, whose bookkeeping after it has not run (audit 19: step 64 saved with step 63's data
        position); with it unsaved, this step is saved if the grace allows, rather than lose the interval."""
        stop = self._stop_step
        assert stop is not None and self._train_state is not None  # beat() comes after resume()
        saved = self.last_saved_step == stop
        self._warn(f"the loop went on to step {step} after the ranks agreed to stop at step {stop}: ended there as "
                   f"finish() does{f', step {stop} saved' if saved else ''}; break out of the loop when "
                   "session.stop_requested is true")
        sys.exit(self.finish(stop if saved else step, self._train_state))

    def finish(self, step: int, state: TrainState) -> int:
        """Save the final step (if not saved yet), wait for the save in flight, say goodbye.

        Returns the exit code: 0 when training ended, EXIT_PREEMPTED (75) when stopped by a signal; a second
        call returns it again and does nothing else. The process group stays up for the script's own ending (a
        `dist.destroy_process_group()` of its own, a last collective); if the script leaves it, it is destroyed
        when the interpreter exits. The session saves and beats no more: save() or beat() after it ends the rank
        with EXIT_CONFIG (78) and one sentence.
        """
        if self._finished is not None:
            return self._finished
        code = EXIT_PREEMPTED if self.stop_requested else 0
        self.save(step, state, sync=True)
        if self.ckpt.in_flight is not None:  # the last interval's save still persists: not held to progress
            self.beater.set_phase("save", now=True)
        self.ckpt.wait()
        self.beater.stop(phase="exited", exit_code=code, saving_step=None, step=step,  # also where no beat() said it
                         exit_reason="preempted" if code else "finished")
        # The group is left up (audit 19: destroyed here, the tutorial's own cleanup after finish() raised, and the
        # finished run was relaunched until its crash-loop rule): _at_exit destroys it if the script did not.
        if self.ctx.is_main:
            log.info("%s at step %d", "preempted" if code else "finished", step)
        self._finished = code
        return code

    def _at_exit(self) -> None:
        """A script that ends without finish(): a save still in flight lands before the interpreter goes (its
        thread is a daemon, which exit would kill mid-write). After finish(): the process group, unless the script
        destroyed it, then a pause for the collectives' threads (else the interpreter's teardown can abort this
        rank with SIGABRT: dist.let_collective_threads_settle)."""
        if self._finished is None and self.ckpt.in_flight is not None and dist.is_initialized():
            self.beater.set_phase("save", now=True)  # a save is not held to progress (finish() says the same)
            with contextlib.suppress(Exception):
                self.ckpt.wait()
        if self._finished is not None:  # the ranks ended together: no peer is gone that a destroy could wait on
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            dist_util.let_collective_threads_settle()

    def _exit_unloadable(self, step: int, path: Any, error: BaseException) -> None:
        """The checkpoint handed over cannot be loaded: say so with the traceback in this rank's log, and exit
        EXIT_CHECKPOINT_LOAD (74). The supervisor checks that checkpoint in full, sets it aside if it is bad (or
        fails to load twice) and relaunches from an older one."""
        why = root_cause(error)
        log.error("cannot load checkpoint step %d (%s): %s; exiting with code %d", step, path, why,
                  EXIT_CHECKPOINT_LOAD, exc_info=error)
        self.beater.stop(phase="exited", exit_code=EXIT_CHECKPOINT_LOAD, saving_step=None,
                         exit_reason=f"checkpoint_load: step {step}: {why}"[:500])
        dist_util.let_collective_threads_settle()  # the exit code, not a teardown's SIGABRT
        sys.exit(EXIT_CHECKPOINT_LOAD)

    def _exit_nan(self, step: int, loss: float) -> None:
        if self.ctx.is_main:
            log.error("loss is %s at step %d: exiting with code %d; step %d is not saved", loss, step, EXIT_NAN,
                      step)
        try:
            self.ckpt.wait()  # a save of an earlier, finite step may still be in flight: let it land
        finally:
            self.beater.stop(phase="exited", exit_code=EXIT_NAN, exit_reason=f"nan at step {step}", saving_step=None)
        dist_util.let_collective_threads_settle()  # the exit code, not a teardown's SIGABRT
        sys.exit(EXIT_NAN)


def _saved_by_this_attempt(manifest: store.Manifest, launched_at: float) -> bool:
    """Whether a checkpoint was saved by this attempt, by an earlier worker group of its torchrun (the group
    re-formed in place). By torchrun's group id, which every attempt's launch makes anew: the save time against
    the launch compared clocks of different machines (review 16: a node's clock ahead made a step a rollback
    passed over "this attempt's", and handed it back). Without the id (a checkpoint from before it was recorded),
    by the save time."""
    group = manifest.extra.get("torchelastic_run_id")
    saved = store.saved_time(manifest.created_at, manifest.extra)
    after = saved is not None and saved > launched_at
    # Both, where the id is there: a rerun of a multi-node run may form the same group id again (its generation
    # moves on only after a failed attempt; review 17), and the clocks alone can disagree.
    return after and (not isinstance(group, str) or group == os.environ.get(GROUP_ENV))


def _misuse_ends_in_config(beater: Beater) -> None:
    """A library misuse the script lets escape (`TrainState(...)` refusing an optimizer built before fully_shard)
    ends the rank as the session's own refusals do: one sentence and EXIT_CONFIG, which the supervisor stops on,
    not a traceback and exit 1, which it retried until its crash-loop rule. Installed after the heartbeat's hook,
    so it runs first; any other exception goes on to it."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, Misuse):
            end_as_config(beater, "train", str(value), destroy_group=dist.is_initialized())
        previous(kind, value, tb)

    sys.excepthook = hook


def end_as_config(beater: Beater, doing: str, problem: str, *, destroy_group: bool) -> NoReturn:
    """End this rank as a configuration error (the script's setup, the same on every retry): one sentence on the
    log, short enough for the supervisor's one-line report (classify.DETAIL_CHARS of the last log line), the
    heartbeat's last word, and EXIT_CONFIG, which the supervisor stops on rather than retry."""
    log.error("cannot %s: %s (exit %d)", doing, problem, EXIT_CONFIG)
    beater.stop(phase="exited", exit_code=EXIT_CONFIG, exit_reason="config", saving_step=None)
    if destroy_group and dist.is_initialized():  # (a script may have destroyed it after finish())
        dist.destroy_process_group()
    leave_now(EXIT_CONFIG)


def leave_now(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown, where a process that has used gloo is at times aborted
    (SIGABRT, "terminate called without an active exception", seen in the misuse tests under plain torchrun; why:
    dist.let_collective_threads_settle): the signal death torchrun then reports would be retried as a fault, where
    `code` says retrying cannot help.
    Logs and stdio are flushed first; atexit handlers do not run (nothing was trained)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def root_cause(error: BaseException) -> str:
    """One line for a failure: DCP's CheckpointException wraps each rank's own exception (a size mismatch, a
    missing key) in a traceback wall of its own; the first failed rank's exception says what went wrong."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda kv: kv[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_first_line(inner)}"
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:400]}" if text else type(error).__name__
