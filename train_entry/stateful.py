"""A training loop's own stateful objects (a GradScaler, an EMA, a stateful data loader, a sampler, counters),
saved and restored with the checkpoint, each as its owner declares its state to be spread over the ranks.

    TrainState(model, optimizer, scheduler, stateful={
        "scaler": Replicated(scaler),   # the same on every rank: saved once
        "ema": Sharded(ema),            # DTensors: saved as shards, resharded like the model
        "loader": PerRank(loader),      # each rank's own: saved under the rank's key
    })

Any object with `state_dict()` and `load_state_dict(sd)` (DCP's Stateful protocol) can be declared. Where each
kind goes in the checkpoint, and why:

- `Replicated`: one bytes leaf, `replicated.<name>` (torch.save of the state dict). Every rank offers the same
  key, so DCP writes one copy and every rank reads it back. A bytes leaf round-trips any structure exactly (a
  dict whose keys change over the run, lists, numbers, small tensors). At resume and at every save the ranks
  compare digests of their states: a state that differs between ranks is not replicated, and saving it under
  one key would silently keep one rank's copy (FACTS.md), so the resume or the save stops and says to declare
  it PerRank.
- `Sharded`: the state dict itself under `sharded.<name>.…`, DTensors included, so DCP writes each rank's
  shards and reshards them on load into the object's current `state_dict()` (the template): an EMA of
  FSDP2-sharded weights follows a world-size change like the model. Its keys must be the same at every
  save; a key saved but absent from the template (or the reverse) stops the resume rather than dropping it.
- `PerRank`: one bytes leaf per rank, `per_rank.<name>.rank<r>`: per-rank values under one key would be
  collapsed to one rank's on load. A relaunch on the same world size gives each rank its own state back. On
  a different world size a rank's old state has no owner: the object's `reshard_state_dict(states, rank,
  world_size)` hook, if it has one, gets every saved rank's state (a list indexed by the old rank) and
  decides: it applies this rank's new state itself and returns None, or returns it as a mapping and
  `load_state_dict()` gets it (any other return stops the resume); without the hook the resume stops with one
  sentence naming the object. It is never restarted from scratch and never handed another rank's state.

An object in the run but not in the checkpoint (added since) also stops the resume: starting it fresh
would be a silent restart. Every problem is a `StatefulError` whose message is one sentence naming the
object; `Session.resume` turns it into exit code 78 on every rank.
"""

from __future__ import annotations

import copy
import hashlib
import io
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

RESHARD_HOOK = "reshard_state_dict"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*\Z")  # no dots: names are parts of checkpoint keys
_PER_RANK_KEY = re.compile(r"^per_rank\.(?P<name>[^.]+)\.rank(?P<rank>\d+)\Z")


class Misuse(Exception):
    """A mistake in how the script uses the library, the same on every retry; its message is one sentence naming
    the fix. One the script lets escape ends the rank with EXIT_CONFIG and that sentence, not a traceback and exit 1
    that the supervisor would retry (train_entry.session installs the hook)."""


class StatefulError(Misuse, ValueError):
    """A declared stateful object cannot be saved or restored as declared. The message is one sentence
    naming the object."""


class TrainStateError(Misuse, TypeError):
    """TrainState(...) refuses what it was given (an optimizer over parameters the model does not hold...)."""


@dataclass(frozen=True, eq=False)  # compared by identity: the objects may be unhashable
class _Declared:
    obj: Any
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(self.obj, method, None)):
                hint = (": a torch.Generator keeps its state in get_state()/set_state(), so wrap it in a holder "
                        "whose state_dict() and load_state_dict(sd) call those (README, the library)"
                        if isinstance(self.obj, torch.Generator) else "")
                raise TrainStateError(f"{type(self).__name__}({type(self.obj).__name__}): the object has no "
                                      f"{method}(); a stateful object needs state_dict() and load_state_dict(sd)"
                                      f"{hint}")


@dataclass(frozen=True, eq=False)
class Replicated(_Declared):
    """The object's state is the same on every rank (a GradScaler, global counters): saved once."""

    kind: ClassVar[str] = "replicated"


@dataclass(frozen=True, eq=False)
class Sharded(_Declared):
    """The object's state holds DTensors (an EMA of FSDP2-sharded weights): saved as shards, resharded on load."""

    kind: ClassVar[str] = "sharded"


@dataclass(frozen=True, eq=False)
class PerRank(_Declared):
    """Each rank's state is its own (a data loader over the rank's share): saved under the rank's key. A
    world-size change needs the object's `reshard_state_dict(states, rank, world_size)` hook."""

    kind: ClassVar[str] = "per_rank"


Declared = Replicated | Sharded | PerRank


USER_BUGS = (LookupError, AttributeError, TypeError, ValueError, AssertionError, NotImplementedError)


def pack(state: Any) -> bytes:
    """A state dict as bytes (torch.save: tensors, numbers, strings, nested containers). The same state packs to
    the same bytes on every rank: tensors go to the CPU first (torch.save writes each one's device, `cuda:1`), and
    sets are written sorted. Tensors come back on the CPU; load_state_dict copies them where they belong."""
    buf = io.BytesIO()
    torch.save(_on_cpu(state), buf)
    return buf.getvalue()


class _SortedSet(set):
    """A set pickled in a fixed order: a set of strings iterates in the order of the process's string hashes
    (PYTHONHASHSEED), so two ranks holding the same set pickled different bytes and a Replicated object seemed
    to differ between them. It unpickles as a plain set."""

    def __reduce__(self) -> tuple[Any, ...]:
        return set, (sorted(self, key=_order),)


class _SortedFrozenSet(frozenset):
    def __reduce__(self) -> tuple[Any, ...]:
        return frozenset, (sorted(self, key=_order),)


def _order(item: Any) -> str:
    """A sort key that does not depend on string hashes: a frozenset inside a set is keyed by its sorted items."""
    if isinstance(item, frozenset):
        return "frozenset(" + ",".join(sorted(map(_order, item))) + ")"
    if isinstance(item, tuple):
        return "(" + ",".join(map(_order, item)) + ")"
    return repr(item)


def _on_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if type(obj) is set:
        return _SortedSet(_on_cpu(v) for v in obj)
    if type(obj) is frozenset:
        return _SortedFrozenSet(_on_cpu(v) for v in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the dict's own type: an OrderedDict, a defaultdict
        for k, v in obj.items():
            out[k] = _on_cpu(v)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_on_cpu(v) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def unpack(blob: bytes) -> Any:
    # The checkpoint is our own (every file checksummed in its manifest), like the pickled leaves DCP itself
    # loads with weights_only=False; user objects may hold more than tensors (NumPy RNG state, tuples).
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) of nested dicts, as DCP flattens them (lists are leaves here: a saved key under a
    list is matched by prefix)."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, obj


def _has_dtensor(state: Any) -> bool:
    from torch.distributed.tensor import DTensor

    def any_dtensor(obj: Any) -> bool:
        if isinstance(obj, DTensor):
            return True
        if isinstance(obj, Mapping):
            return any(any_dtensor(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(any_dtensor(v) for v in obj)
        return False

    return any_dtensor(state)


def _covered(key: str, paths: set[str]) -> bool:
    """Whether `key` is one of `paths` or lies under one (a list leaf that DCP flattened further)."""
    return key in paths or any(key.startswith(p + ".") for p in paths)


@dataclass
class _Plan:
    """What the template asked DCP for, per object, so that load() restores each the same way."""

    kind: str
    saved_world: int | None = None  # per_rank: how many ranks saved it
    reshard: bool = False  # per_rank: the saved world differs, the hook takes every rank's state


class StatefulSet:
    """The declared objects of a TrainState: what they add to a state dict, and how they are restored."""

    def __init__(self, declared: Mapping[str, Declared] | None):
        self.declared: dict[str, Declared] = {}
        for name, decl in (declared or {}).items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise StatefulError(f"stateful name {name!r}: use letters, digits, '_' and '-' (it becomes part "
                                    "of checkpoint keys)")
            if not isinstance(decl, (Replicated, Sharded, PerRank)):
                raise TrainStateError(f"stateful[{name!r}] is a bare {type(decl).__name__}: declare how its state "
                                      f"is spread over the ranks: Replicated(obj), Sharded(obj) or PerRank(obj)")
            twin = next((other for other, d in self.declared.items() if d.obj is decl.obj), None)
            if twin is not None:
                raise StatefulError(f"stateful {twin!r} and {name!r} are one {type(decl.obj).__name__}: its state "
                                    "would be saved twice and restored twice; declare it once")
            self.declared[name] = decl
        self._plan: dict[str, _Plan] = {}

    def __bool__(self) -> bool:
        return bool(self.declared)

    @staticmethod
    def describe(name: str, decl: Declared) -> str:
        return f"stateful {name!r} ({type(decl.obj).__name__}, {type(decl).__name__})"

    # ---- saving -------------------------------------------------------------------------------------

    def state_dict(self, rank: int) -> dict[str, Any]:
        """The top-level checkpoint entries of every declared object, for this rank."""
        sd: dict[str, Any] = {}
        for name, decl in self.declared.items():
            try:
                state = decl.obj.state_dict()
            except USER_BUGS as e:  # audit 19: a traceback and exit 1, retried from the last checkpoint to it again
                # (only a bug's kinds: an OOM, an OSError, a dead peer's error are retried as before; review 17)
                raise StatefulError(f"{self.describe(name, decl)}: its state_dict() raised {type(e).__name__}: "
                                    f"{str(e).strip()[:200]}; every save calls it (the rank's log has the "
                                    "traceback)") from e
            if isinstance(decl, Sharded):
                sd[f"sharded.{name}"] = state
            elif isinstance(decl, Replicated):
                sd[f"replicated.{name}"] = self._pack(name, decl, state)
            else:
                sd[f"per_rank.{name}.rank{rank}"] = self._pack(name, decl, state)
        return sd

    def _pack(self, name: str, decl: Declared, state: Any) -> bytes:
        try:
            return pack(state)
        except Exception as e:  # a lambda, a lock, an open file in the state: the same at every save
            raise StatefulError(f"{self.describe(name, decl)}: its state_dict() cannot be saved ({type(e).__name__}: "
                                f"{str(e).strip()[:200]}); keep tensors, numbers, strings and containers of "
                                "them in it") from None

    def check(self) -> dict[str, str]:
        """Check each object's state against its declaration; return the digests of the replicated states,
        for the ranks to compare (`differing`). Raises StatefulError naming the first object that does not fit.
        """
        digests: dict[str, str] = {}
        for name, decl in self.declared.items():
            state = decl.obj.state_dict()
            sharded = _has_dtensor(state)
            if isinstance(decl, Sharded) and not sharded:
                raise StatefulError(f"{self.describe(name, decl)} holds no DTensor: declare it Replicated if its "
                                    "state is the same on every rank, PerRank if each rank has its own (an "
                                    "optimizer holds no state before its first step: pass every optimizer to "
                                    "TrainState as a list instead, TrainState(model, [opt1, opt2]))")
            if not isinstance(decl, Sharded) and sharded:
                raise StatefulError(f"{self.describe(name, decl)} holds DTensors: declare it Sharded, so that "
                                    "each rank saves its shard and a world-size change reshards it")
            if isinstance(decl, Replicated):
                digests[name] = hashlib.sha256(self._pack(name, decl, state)).hexdigest()
            elif isinstance(decl, PerRank):
                self._pack(name, decl, state)  # fails now, not an interval later at the first save
        return digests

    def replicated_keys(self) -> dict[str, str]:
        """The checkpoint key of each Replicated object, with its description."""
        return {f"replicated.{name}": self.describe(name, decl) for name, decl in self.declared.items()
                if isinstance(decl, Replicated)}

    def differing(self, digests: list[dict[str, str]]) -> str | None:
        """The sentence for the first Replicated object whose digest differs between ranks (`digests` is
        indexed by rank), or None."""
        for name, decl in self.declared.items():
            if isinstance(decl, Replicated):
                seen = [d.get(name) for d in digests]
                if any(s != seen[0] for s in seen):
                    other = next(r for r, s in enumerate(seen) if s != seen[0])
                    return (f"{self.describe(name, decl)} differs between rank 0 and rank {other}, so it is not "
                            "replicated: only one rank's copy would be saved; declare it PerRank")
        return None

    # ---- loading ------------------------------------------------------------------------------------

    def template(self, rank: int, world_size: int, keys: set[str]) -> dict[str, Any]:
        """Checkpoint entries for DCP to load into, given the checkpoint's keys. Raises StatefulError (the
        same on every rank: it depends only on the keys, the world size and the declarations)."""
        sd: dict[str, Any] = {}
        self._plan = {}
        for name, decl in self.declared.items():
            saved = self._saved_kind(name, keys)
            if saved is None:
                raise StatefulError(f"{self.describe(name, decl)} is not in this checkpoint (added since it was "
                                    "written?): resuming would restart it from scratch; remove it, or start a "
                                    "new run")
            if saved != decl.kind:
                raise StatefulError(f"{self.describe(name, decl)} was saved as {saved.replace('_', '-')}: declare "
                                    "it as it was saved")
            if isinstance(decl, Replicated):
                sd[f"replicated.{name}"] = b""
                self._plan[name] = _Plan(decl.kind)
            elif isinstance(decl, Sharded):
                sd[f"sharded.{name}"] = self._sharded_template(name, decl, keys)
                self._plan[name] = _Plan(decl.kind)
            else:
                ranks = sorted(int(m["rank"]) for k in keys if (m := _PER_RANK_KEY.match(k)) and m["name"] == name)
                saved_world = len(ranks)
                if ranks != list(range(saved_world)):
                    raise StatefulError(f"{self.describe(name, decl)} is missing the state of some ranks in this "
                                        f"checkpoint (has ranks {ranks})")
                reshard = saved_world != world_size
                if reshard and not callable(getattr(decl.obj, RESHARD_HOOK, None)):
                    raise StatefulError(
                        f"{self.describe(name, decl)} holds per-rank state saved by {saved_world} ranks and this "
                        f"run has {world_size}, with no {RESHARD_HOOK}(states, rank, world_size) hook to divide "
                        f"it: relaunch on {saved_world} ranks or add the hook")
                for r in ranks if reshard else [rank]:
                    sd[f"per_rank.{name}.rank{r}"] = b""
                self._plan[name] = _Plan(decl.kind, saved_world, reshard)
        return sd

    def _saved_kind(self, name: str, keys: set[str]) -> str | None:
        if f"replicated.{name}" in keys:
            return Replicated.kind
        if any(k.startswith(f"sharded.{name}.") for k in keys):
            return Sharded.kind
        if any((m := _PER_RANK_KEY.match(k)) and m["name"] == name for k in keys):
            return PerRank.kind
        return None

    def _sharded_template(self, name: str, decl: Declared, keys: set[str]) -> Any:
        template = decl.obj.state_dict()
        prefix = f"sharded.{name}."
        saved = {k[len(prefix):] for k in keys if k.startswith(prefix)}
        paths = {p for p, _ in leaves(template)}
        lost = sorted(k for k in saved if not _covered(k, paths))
        missing = sorted(p for p in paths if not any(k == p or k.startswith(p + ".") for k in saved))
        if lost or missing:
            what = (f"the checkpoint holds {len(lost)} entries its state_dict() lacks (e.g. {lost[0]!r})" if lost
                    else f"its state_dict() has {len(missing)} entries the checkpoint lacks (e.g. {missing[0]!r})")
            raise StatefulError(f"{self.describe(name, decl)} does not match what was saved: {what}")
        return template

    def load(self, sd: dict[str, Any], rank: int, world_size: int) -> list[str]:
        """Hand each object its loaded state (after DCP filled the template). Returns one note per object
        for the log; raises StatefulError naming the object whose load_state_dict (or hook) raised."""
        notes = []
        for name, decl in self.declared.items():
            plan = self._plan[name]
            if isinstance(decl, Sharded):
                state, method = sd[f"sharded.{name}"], "load_state_dict"
            elif isinstance(decl, Replicated):
                state, method = unpack(sd[f"replicated.{name}"]), "load_state_dict"
            elif plan.reshard:
                state = [unpack(sd[f"per_rank.{name}.rank{r}"]) for r in range(plan.saved_world or 0)]
                method = RESHARD_HOOK
            else:
                state, method = unpack(sd[f"per_rank.{name}.rank{rank}"]), "load_state_dict"
            mine = None
            try:
                if method == RESHARD_HOOK:  # positionally, as the README shows it
                    mine = decl.obj.reshard_state_dict(state, rank, world_size)
                    if isinstance(mine, Mapping):  # audit 12: a hook that returns this rank's state had it dropped
                        method = "load_state_dict"
                        decl.obj.load_state_dict(mine)
                else:
                    decl.obj.load_state_dict(state)
            except Exception as e:  # the object's own code: name it rather than show a traceback wall
                detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""  # one line, not a wall
                raise StatefulError(f"{self.describe(name, decl)}: its {method}() raised "
                                    f"{type(e).__name__}{': ' + detail if detail else ''}") from e
            if mine is not None and not isinstance(mine, Mapping):  # neither applied nor loadable: never silent
                raise StatefulError(f"{self.describe(name, decl)}: its {RESHARD_HOOK}() returned a "
                                    f"{type(mine).__name__}: return None once it has applied this rank's state, "
                                    "or return this rank's state dict for load_state_dict()")
            notes.append(f"{name} ({decl.kind}"
                         + (f", {plan.saved_world} ranks -> {world_size} by its {RESHARD_HOOK} hook" if plan.reshard
                            else "") + ")")
        return notes

    def undeclared(self, keys: set[str]) -> list[str]:
        """Names of stateful objects in the checkpoint that this run does not declare (they are ignored)."""
        found = set()
        for k in keys:
            if k.startswith("replicated."):
                found.add(k.split(".", 1)[1])
            elif k.startswith("sharded."):
                found.add(k.split(".", 2)[1])
            elif m := _PER_RANK_KEY.match(k):
                found.add(m["name"])
        return sorted(found - set(self.declared))
