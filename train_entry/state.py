"""What a checkpoint holds: model and optimizer (sharded, via get/set_state_dict), LR scheduler, each rank's
RNG states, the training position (step, samples and tokens seen), and the loop's own stateful objects
(a GradScaler, an EMA, a data loader: see train_entry.stateful)."""

from __future__ import annotations

import json
import logging
import pickle
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from train_entry.stateful import Declared, StatefulError, StatefulSet, TrainStateError, leaves

log = logging.getLogger("train_entry")


def rng_key(rank: int) -> str:
    # Per-rank values under one shared key would be collapsed to one rank's value on load, so each rank
    # saves its RNG under its own key. After a world-size change, new ranks have none: see seed_rank().
    return f"rng.rank{rank}"


def rng_state(device: torch.device) -> bytes:
    bundle: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        bundle["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:
        bundle["numpy"] = sys.modules["numpy"].random.get_state()
    return pickle.dumps(bundle)


def set_rng_state(blob: bytes, device: torch.device) -> None:
    bundle = pickle.loads(blob)
    torch.set_rng_state(bundle["torch"])
    random.setstate(bundle["python"])
    if device.type == "cuda" and "cuda" in bundle:
        torch.cuda.set_rng_state(bundle["cuda"], device)
    if "numpy" in bundle and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(bundle["numpy"])


def seed_rank(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Seed this rank's RNGs as a function of (seed, rank, step): for a fresh start, and for ranks that
    have no saved RNG state after the world size grew."""
    s = (seed * 1_000_003 + rank * 10_007 + step) % (2**63)
    torch.manual_seed(s)
    random.seed(s)
    if device.type == "cuda":
        torch.cuda.manual_seed(s)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(s % (2**32))


@dataclass
class TrainState:
    """The resumable state of a training run.

    `step`, `samples_seen`, `tokens_seen` and `extra` (small JSON values: a user's own counters, restored into
    the same dict) must be the same on every rank: global counts. A checkpoint keeps rank 0's. `stateful`
    holds the loop's other objects with state_dict()/load_state_dict(), each declared Replicated, Sharded or
    PerRank (train_entry.stateful): a GradScaler, an EMA, a stateful data loader. They are checked when the
    TrainState is built, read again if `stateful` changes before `Session.resume`, and may not change after it
    (an object added then would never have been restored: a silent restart).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]  # several: each over its own parameters
    scheduler: Any = None  # or a list of them
    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    stateful: Mapping[str, Declared] = field(default_factory=dict)

    def __post_init__(self) -> None:
        several = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
        for opt in several:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TrainStateError(f"TrainState(model, optimizer, ...): the optimizer is {type(opt).__name__}, "
                                      "not a torch.optim.Optimizer; pass the one training steps with (or a list of "
                                      "them)")
        if not several:
            raise TrainStateError("TrainState(model, []): no optimizer; pass the one training steps with (or a list)")
        seen: set[int] = set()
        for opt in several:
            mine = {id(p) for group in opt.param_groups for p in group["params"]}
            if mine & seen:
                raise TrainStateError("TrainState(model, [optimizers]): a parameter is in two optimizers; each "
                                      "optimizer's state is saved under its parameters' names, so each parameter may "
                                      "have one")
            seen |= mine
        if seen - {id(p) for p in self.model.parameters()}:
            raise TrainStateError("TrainState(model, optimizer): the optimizer holds a parameter that is not one of "
                                  "model.parameters(), whose state could not be saved under a name; build the "
                                  "optimizer from model.parameters() after fully_shard (which replaces them), and "
                                  "keep a learnable tensor of your own as a parameter of a module inside the model")
        for sched in self._schedulers():
            if not callable(getattr(sched, "state_dict", None)) or not callable(getattr(sched, "load_state_dict",
                                                                                       None)):
                raise TrainStateError(f"TrainState(model, optimizer, scheduler): the scheduler is a "
                                      f"{type(sched).__name__}, which has no state_dict() and load_state_dict(); "
                                      "pass an LR scheduler (or a list of them)")
        # Checked now, not at the first save; read again if `stateful` changes before the resume.
        self._stateful, self._declared, self._settled = self._checked(dict(self.stateful)), dict(self.stateful), False
        self.position()  # state.extra as given, checked now too (it is checked again at every save)

    @property
    def _listed(self) -> bool:
        """Several schedulers, saved one entry each by position (one scheduler is saved as itself)."""
        return isinstance(self.scheduler, (list, tuple))

    def _schedulers(self) -> list[Any]:
        if self.scheduler is None:
            return []
        return list(self.scheduler) if self._listed else [self.scheduler]

    def _scheduler_state(self) -> Any:
        if self._listed:
            return {str(i): sched.state_dict() for i, sched in enumerate(self.scheduler)}
        return self.scheduler.state_dict()

    def _scheduler_template(self, keys: set[str]) -> Any:
        """The schedulers' entries to load, once the checkpoint holds the same layout: one scheduler, or a list
        of as many. Otherwise a StatefulError (DCP would fail on a missing key, as if the files were damaged)."""
        want = self._scheduler_state()
        saved = {k.split(".")[1] for k in keys if k.startswith("scheduler.")}
        if not saved:
            if any(leaves(want)):
                raise StatefulError("the LR scheduler is not in this checkpoint (added since it was written?): "
                                    "resuming would restart its schedule from the beginning; remove it, or start "
                                    "a new run")
            return want
        listed = sorted(map(int, saved)) if all(x.isdigit() for x in saved) else None
        if listed != (list(range(len(self._schedulers()))) if self._listed else None):
            held = f"a list of {len(listed)} schedulers" if listed is not None else "one scheduler"
            has = f"a list of {len(self._schedulers())}" if self._listed else "one scheduler"
            raise StatefulError(f"the checkpoint holds {held} and this run has {has}: pass them as they were "
                                "saved, or start a new run")
        return want

    def _objects(self) -> StatefulSet:
        """The declared objects as `stateful` holds them now. A change after the resume is a StatefulError: the
        object was not restored, and saving it from here on would hide that it restarted."""
        now = dict(self.stateful)
        if now.keys() != self._declared.keys() or any(now[k] is not self._declared[k] for k in now):
            if self._settled:
                raise StatefulError(f"state.stateful changed after session.resume(state) ({sorted(now)} where "
                                    f"{sorted(self._declared)} was resumed): what was added was never restored from "
                                    "the checkpoint; declare every object before session.resume(state)")
            self._stateful, self._declared = self._checked(now), now
        return self._stateful

    def _checked(self, declared: dict[str, Declared]) -> StatefulSet:
        """The declarations as a StatefulSet, refusing one that is the model, an optimizer or a scheduler: those are
        saved already (sharded, through get_state_dict), and a second copy as Replicated or PerRank would be one
        rank's whole state, restored over the sharded one (audit: the advice to declare it PerRank was wrong)."""
        several = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
        saved = [("model", self.model)] + [("optimizer", o) for o in several] + \
            [("scheduler", s) for s in self._schedulers()]
        for name, decl in declared.items():
            what = next((what for what, obj in saved if getattr(decl, "obj", None) is obj), None)
            if what is not None:
                raise StatefulError(f"stateful {name!r} is the {what} that TrainState(model, optimizer, scheduler) "
                                    "saves already: remove it from stateful")
        return StatefulSet(declared)

    def settle(self) -> None:
        """Called by Session.resume: from here on the declared objects are the ones resumed."""
        self._objects()
        self._settled = True

    def position(self) -> dict[str, Any]:
        """The training position as saved (JSON). Raises StatefulError for what JSON would not give back the
        same: a tensor count, a tuple, a key that is not a string (an int key comes back as a string)."""
        pos = {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
               "extra": self.extra}
        try:
            json.dumps(pos)
        except (TypeError, ValueError) as e:
            raise StatefulError(f"the training position cannot be saved as JSON ({e}): keep plain numbers in "
                                "state.step, samples_seen and tokens_seen (int(t) of a tensor), and numbers, "
                                "strings, lists and dicts with string keys in state.extra") from None
        found = _non_string_key(self.extra)
        if found:
            key = found[0]
            raise StatefulError(f"state.extra has the key {key!r}, which would come back from its checkpoint as the "
                                f"string {next(iter(json.loads(json.dumps({key: 0}))))!r} (JSON keys are "
                                "strings): use string keys there")
        return pos

    def state_dict(self, rank: int, device: torch.device) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "train": json.dumps(self.position()),
            rng_key(rank): rng_state(device),
        }
        if self._schedulers():
            sd["scheduler"] = self._scheduler_state()
        sd.update(self._objects().state_dict(rank))
        return sd

    def check_stateful(self) -> dict[str, str]:
        """Check the stateful objects against their declarations (StatefulError if one does not fit); return
        the digests of the replicated ones, for the ranks to compare."""
        return self._objects().check()

    def replicated_keys(self) -> dict[str, str]:
        """The state dict's keys that every rank offers with the same bytes (DCP saves one rank's), with what
        each holds."""
        return self._objects().replicated_keys()

    def stateful_differs(self, digests: list[dict[str, str]]) -> str | None:
        """Why the ranks' replicated states are not the same (a sentence), or None."""
        return self._objects().differing(digests)

    def template(self, rank: int, keys: set[str], *, world_size: int) -> dict[str, Any]:
        """A state dict shaped for DCP to load into: this run's sharding, the checkpoint's optional keys.
        Raises StatefulError when a stateful object cannot be restored from what the checkpoint holds."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if problem := model_changed(keys, model_sd):
            raise StatefulError(problem)
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "train": ""}
        if rng_key(rank) in keys:
            sd[rng_key(rank)] = b""
        if self._schedulers():
            sd["scheduler"] = self._scheduler_template(keys)
        sd.update(self._objects().template(rank, world_size, keys))
        return sd

    def undeclared_stateful(self, keys: set[str]) -> list[str]:
        """Stateful objects the checkpoint holds and this run does not declare."""
        return self._objects().undeclared(keys)

    def load(self, sd: dict[str, Any], rank: int, device: torch.device, seed: int, *,
             world_size: int) -> list[str]:
        """Restore everything from a loaded `template`. Returns a note per stateful object restored; raises
        StatefulError naming an object whose own load_state_dict (or reshard hook) failed."""
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if "scheduler" in sd:
            for i, sched in enumerate(self._schedulers()):
                sched.load_state_dict(sd["scheduler"][str(i)] if self._listed else sd["scheduler"])
        pos = json.loads(sd["train"])
        self.step, self.samples_seen, self.tokens_seen = pos["step"], pos["samples_seen"], pos["tokens_seen"]
        self.extra.clear()  # in place: the caller may hold this dict and go on counting in it
        self.extra.update(pos.get("extra", {}))
        try:
            # Before the RNG: an object's load_state_dict may draw random numbers, which the uninterrupted
            # run never drew; restoring the RNG afterwards keeps the resumed run on the same stream.
            return self._objects().load(sd, rank, world_size)
        finally:
            if rng_key(rank) in sd:
                set_rng_state(sd[rng_key(rank)], device)
            else:  # the world grew: this rank's RNG was never saved (another rank's must not be reused)
                log.warning("rank %d has no saved RNG state in this checkpoint: seeded from (seed %d, rank %d, "
                            "step %d)", rank, seed, rank, self.step)
                seed_rank(seed, rank, self.step, device)


def _non_string_key(obj: Any) -> tuple[Any, ...]:
    """(key,) for the first dict key in `obj` that JSON would turn into a string (an int epoch, None), or ().
    (Tuples as values come back as lists, which compare and unpack alike; NaN comes back as NaN.)"""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return (k,)
            found = _non_string_key(v)
            if found:
                return found
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found = _non_string_key(v)
            if found:
                return found
    return ()


def model_changed(keys: set[str], model_sd: Mapping[str, Any]) -> str | None:
    """Why the checkpoint's model (its `keys`) is not this one's, in one sentence, or None. Layers removed since the
    save were ignored by DCP without a word (their weights dropped for good once retention took the checkpoints
    that held them); layers added failed each checkpoint's load in turn. Both are the code's, on every checkpoint,
    so they stop the run at once (EXIT_CONFIG). Names only: a shape that changed is DCP's to name."""
    saved = {k[len("model."):] for k in keys if k.startswith("model.")}
    if not saved:  # nothing of a model in it (a test's, a script's own layout): nothing to compare
        return None

    def prefixes(name: str) -> list[str]:  # the name and its parents: DCP flattens a dict value into several keys
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]

    mine = set(model_sd)
    gone = sorted(k for k in saved if not any(p in mine for p in prefixes(k)))
    under_saved = {p for k in saved for p in prefixes(k)}
    new = sorted(k for k in mine if k not in under_saved)
    if not gone and not new:
        return None

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    what = "; ".join(x for x in (f"the checkpoint holds {some(gone)}, which this model lacks" if gone else "",
                                 f"this model has {some(new)}, which the checkpoint lacks" if new else "") if x)
    return (f"the model changed since this checkpoint was saved ({what}): change it back, or train the new model "
            "in a new run dir")
