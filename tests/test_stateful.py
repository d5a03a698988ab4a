"""The bookkeeping of train_entry.stateful, without processes: which checkpoint keys each kind of object gets,
what a resume asks DCP for, and which sentence stops it. DCP is stood in for by copying the saved entries
into the template; tests/test_stateful_e2e.py runs the real thing."""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from train_entry.stateful import (  # noqa: E402
    PerRank,
    Replicated,
    Sharded,
    StatefulError,
    StatefulSet,
    pack,
    unpack,
)


class Counter:
    def __init__(self, value: Any = 0):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "history": [self.value] * 2, "t": torch.tensor([float(self.value)])}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]


class Reshardable(Counter):
    def __init__(self, value: Any = 0):
        super().__init__(value)
        self.handed: tuple | None = None

    def reshard_state_dict(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        self.handed = ([s["value"] for s in states], rank, world_size)


class Refuses(Counter):
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError("no 'epoch' in the state\nsecond line of a long message")


def save(world: int, make: Any) -> dict[str, Any]:
    """What a checkpoint written by `world` ranks holds: each rank's entries, one copy of a shared key."""
    saved: dict[str, Any] = {}
    for rank in range(world):
        saved.update(StatefulSet(make(rank)).state_dict(rank))
    return saved


def resume(objects: dict[str, Any], saved: dict[str, Any], rank: int, world: int) -> list[str]:
    """Template, 'DCP' (copy the saved entries in), load: what Session.resume does on one rank."""
    sset = StatefulSet(objects)
    template = sset.template(rank, world, set(saved))
    for key in template:
        assert key in saved, f"asked DCP for {key}, which the checkpoint lacks"
        template[key] = saved[key]
    return sset.load(template, rank, world)


def test_each_kind_gets_its_keys_and_per_rank_state_goes_back_to_its_own_rank():
    saved = save(2, lambda r: {"scaler": Replicated(Counter(7)), "loader": PerRank(Counter(100 + r))})
    assert set(saved) == {"replicated.scaler", "per_rank.loader.rank0", "per_rank.loader.rank1"}
    assert all(isinstance(v, bytes) for v in saved.values())  # what staging and DCP carry as-is
    for rank in (0, 1):
        scaler, loader = Counter(), Counter()
        notes = resume({"scaler": Replicated(scaler), "loader": PerRank(loader)}, saved, rank, 2)
        assert (scaler.value, loader.value) == (7, 100 + rank)
        assert notes == ["scaler (replicated)", "loader (per_rank)"]


def test_a_bytes_leaf_round_trips_any_structure_exactly():
    state = {"a": [1, 2.5, "x"], "gen": torch.Generator().manual_seed(3).get_state(), "nested": {"k": (1, 2)}}
    back = unpack(pack(state))
    assert back["a"] == [1, 2.5, "x"] and back["nested"] == {"k": (1, 2)}
    assert torch.equal(back["gen"], state["gen"])
    assert pack(state) == pack(unpack(pack(state)))  # deterministic: ranks compare digests of it


Pair = collections.namedtuple("Pair", "a b")  # at module level: pickle finds it by name


def test_a_bytes_leaf_keeps_the_containers_own_types():
    counts = collections.defaultdict(int, {"x": 2})
    state = {"o": collections.OrderedDict(w=torch.ones(2)), "d": counts, "p": Pair(torch.zeros(1), [3])}
    back = unpack(pack(state))
    assert type(back["o"]) is collections.OrderedDict and torch.equal(back["o"]["w"], torch.ones(2))
    assert type(back["d"]) is collections.defaultdict and back["d"]["missing"] == 0 and back["d"]["x"] == 2
    assert back["p"].b == [3] and torch.equal(back["p"].a, torch.zeros(1))


def test_a_world_size_change_hands_every_rank_state_to_the_hook_in_rank_order():
    saved = save(3, lambda r: {"loader": PerRank(Reshardable(10 * r))})
    loader = Reshardable()
    notes = resume({"loader": PerRank(loader)}, saved, rank=1, world=2)
    assert loader.handed == ([0, 10, 20], 1, 2)
    assert loader.value == 0, "load_state_dict must not also run"
    assert notes == ["loader (per_rank, 3 ranks -> 2 by its reshard_state_dict hook)"]


class ReturnsItsShare(Counter):
    def reshard_state_dict(self, states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
        return {"value": sum(s["value"] for s in states[rank::world_size])}


def test_a_hook_that_returns_this_ranks_state_has_it_loaded_not_dropped():
    """Audit 12: the returned state was dropped and the object restarted from scratch, while the log said it was
    restored by its hook."""
    saved = save(4, lambda r: {"loader": PerRank(ReturnsItsShare(10 * r))})
    loader = ReturnsItsShare()
    notes = resume({"loader": PerRank(loader)}, saved, rank=1, world=2)
    assert loader.value == 10 + 30 and notes == ["loader (per_rank, 4 ranks -> 2 by its reshard_state_dict hook)"]


class ReturnsATuple(Counter):
    def reshard_state_dict(self, states: list[dict[str, Any]], rank: int, world_size: int) -> tuple:
        return (states[rank]["value"],)


def test_a_hook_that_returns_neither_none_nor_a_state_dict_stops_the_resume():
    """Review 12: a tuple returned was ignored and the object restarted from scratch, without a word."""
    saved = save(2, lambda r: {"loader": PerRank(ReturnsATuple(r))})
    with pytest.raises(StatefulError, match=r"its reshard_state_dict\(\) returned a tuple: return None once it has "
                                            r"applied this rank's state, or return this rank's state dict"):
        resume({"loader": PerRank(ReturnsATuple())}, saved, rank=0, world=1)


def test_a_world_size_change_without_the_hook_stops_with_one_sentence_naming_the_object():
    saved = save(2, lambda r: {"loader": PerRank(Counter(r))})
    with pytest.raises(StatefulError) as e:
        resume({"loader": PerRank(Counter())}, saved, rank=0, world=1)
    msg = str(e.value)
    assert msg.startswith("stateful 'loader' (Counter, PerRank) holds per-rank state saved by 2 ranks and this "
                          "run has 1")
    assert "reshard_state_dict(states, rank, world_size)" in msg and "\n" not in msg


def test_a_load_state_dict_that_raises_is_named_in_one_line():
    saved = save(1, lambda r: {"ok": Replicated(Counter(1)), "bad": Replicated(Counter(2))})
    with pytest.raises(StatefulError) as e:
        resume({"ok": Replicated(Counter()), "bad": Replicated(Refuses())}, saved, rank=0, world=1)
    assert str(e.value) == ("stateful 'bad' (Refuses, Replicated): its load_state_dict() raised ValueError: "
                            "no 'epoch' in the state")
    assert isinstance(e.value.__cause__, ValueError)  # chained: the original traceback is not lost


@pytest.mark.parametrize("declared, saved_as, expect", [
    (Replicated, None, "is not in this checkpoint"),
    (PerRank, Replicated, "was saved as replicated: declare it as it was saved"),
    (Replicated, PerRank, "was saved as per-rank"),
])
def test_an_object_the_checkpoint_lacks_or_saved_as_another_kind_is_never_restarted(declared, saved_as, expect):
    saved = save(1, lambda r: {"other": Replicated(Counter())} | ({"x": saved_as(Counter(5))} if saved_as else {}))
    with pytest.raises(StatefulError, match=expect):
        resume({"x": declared(Counter())}, saved, rank=0, world=1)


def test_sharded_entries_must_match_the_objects_state_dict_both_ways():
    # Sharded state goes to DCP as is: the template is the object's own state_dict(), flattened by DCP.
    keys = {"sharded.ema.w", "sharded.ema.b", "train"}

    class Dict:
        def __init__(self, names):
            self.names = names

        def state_dict(self):
            return {n: torch.zeros(2) for n in self.names}

        def load_state_dict(self, sd):
            pass

    template = StatefulSet({"ema": Sharded(Dict(["w", "b"]))}).template(0, 1, keys)
    assert set(template["sharded.ema"]) == {"w", "b"}
    lost = "the checkpoint holds 1 entries its state_dict() lacks (e.g. 'b')"
    with pytest.raises(StatefulError, match=re.escape(lost)):
        StatefulSet({"ema": Sharded(Dict(["w"]))}).template(0, 1, keys)
    with pytest.raises(StatefulError, match=re.escape("its state_dict() has 1 entries the checkpoint lacks")):
        StatefulSet({"ema": Sharded(Dict(["w", "b", "c"]))}).template(0, 1, keys)


def test_declarations_are_checked_when_the_train_state_is_built():
    """Each refusal is a Misuse: escaping the script, it ends the rank with EXIT_CONFIG and its sentence, which the
    supervisor stops on (audit: these were a plain TypeError/ValueError, a traceback, retried into a crash loop)."""
    from train_entry.ema import EMA
    from train_entry.stateful import Misuse

    with pytest.raises(TypeError, match="declare how its state is spread over the ranks: Replicated") as e:
        StatefulSet({"scaler": Counter()})
    assert isinstance(e.value, Misuse)
    with pytest.raises(ValueError, match=re.escape("stateful name 'a.b'")) as e:
        StatefulSet({"a.b": Replicated(Counter())})
    assert isinstance(e.value, Misuse)

    class SaveOnly:
        def state_dict(self):
            return {}

    with pytest.raises(TypeError, match="the object has no load_state_dict") as e:
        Replicated(SaveOnly())
    assert isinstance(e.value, Misuse)
    with pytest.raises(TypeError, match=r"a torch\.Generator keeps its state in get_state") as e:
        PerRank(torch.Generator())
    assert isinstance(e.value, Misuse)
    with pytest.raises(ValueError, match="EMA decay must lie strictly between 0 and 1") as e:
        EMA(torch.nn.Linear(2, 2), decay=0.0)
    assert isinstance(e.value, Misuse)


def test_declared_kinds_are_checked_against_the_state_and_replicated_digests_compared():
    not_sharded = "'ema' (Counter, Sharded) holds no DTensor: declare it Replicated"
    with pytest.raises(StatefulError, match=re.escape(not_sharded)):
        StatefulSet({"ema": Sharded(Counter())}).check()
    same = [StatefulSet({"s": Replicated(Counter(1)), "p": PerRank(Counter(r))}).check() for r in (0, 1)]
    assert set(same[0]) == {"s"}  # only replicated states are compared
    assert StatefulSet({"s": Replicated(Counter())}).differing(same) is None
    differ = [StatefulSet({"s": Replicated(Counter(r))}).check() for r in (0, 0, 5)]
    msg = StatefulSet({"s": Replicated(Counter())}).differing(differ)
    assert msg is not None and "differs between rank 0 and rank 2" in msg and "declare it PerRank" in msg


def test_objects_in_the_checkpoint_that_the_run_no_longer_declares_are_listed():
    saved = save(2, lambda r: {"a": Replicated(Counter()), "b": PerRank(Counter())}) | {"sharded.ema.w": 0}
    assert StatefulSet({"a": Replicated(Counter())}).undeclared(set(saved)) == ["b", "ema"]


def test_what_trainstate_takes_and_what_its_extra_may_hold():
    from train_entry.state import TrainState
    from train_entry.stateful import StatefulError

    m = torch.nn.Linear(2, 1)
    with pytest.warns(UserWarning):  # torch warns of a parameter listed twice in one optimizer, and keeps it
        one = torch.optim.SGD([m.weight, m.weight, m.bias], lr=0.1)
    TrainState(m, one)  # accepted, as before several optimizers were
    with pytest.raises(TypeError, match="no optimizer"):
        TrainState(m, [])
    with pytest.raises(TypeError, match="a parameter is in two optimizers"):
        TrainState(m, [torch.optim.SGD([m.weight], lr=0.1), torch.optim.SGD([m.weight, m.bias], lr=0.1)])
    state = TrainState(m, torch.optim.SGD(m.parameters(), lr=0.1),
                       extra={"best": float("nan"), "pair": (1, 2), "runs": [{"ok": 1}]})
    state.position()  # NaN, tuples, nested dicts with string keys: JSON gives them back
    state.tokens_seen = torch.tensor(8)  # `+= torch.tensor(n)`: a count that is a tensor
    with pytest.raises(StatefulError, match="the training position cannot be saved as JSON"):
        state.position()
    state.tokens_seen = 0
    for extra, says in (({"x": [{None: 2}]}, "key None, which would come back from its checkpoint as the string "
                                              "'null'"),
                        ({True: 1}, "as the string 'true'"), ({3: "epoch"}, "as the string '3'")):
        state.extra.clear()
        state.extra.update(extra)
        with pytest.raises(StatefulError, match=re.escape(says)):
            state.position()


def test_an_object_declared_twice_or_saved_already_by_the_train_state_is_refused_when_it_is_declared():
    """Audit: one loader under two names was saved and restored twice, and an optimizer also declared Replicated drew
    the advice "declare it PerRank", which would save one rank's whole copy beside the sharded one."""
    from train_entry.state import TrainState

    loader = Counter()
    with pytest.raises(StatefulError, match=r"stateful 'a' and 'b' are one Counter: .* declare it once"):
        StatefulSet({"a": PerRank(loader), "b": Replicated(loader)})
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    for obj, what in ((opt, "optimizer"), (sched, "scheduler"), (m, "model")):
        with pytest.raises(StatefulError, match=f"stateful 'x' is the {what} that TrainState.* saves already"):
            TrainState(m, opt, sched, stateful={"x": Replicated(obj)})
    state = TrainState(m, opt, sched)
    state.stateful = {"x": PerRank(opt)}  # declared after the TrainState, before the resume: refused there
    with pytest.raises(StatefulError, match="is the optimizer"):
        state.settle()
    with pytest.raises(StatefulError, match="'3'"):  # extra as given is checked when built, not at the first save
        TrainState(m, opt, extra={3: "epoch"})


def test_an_optimizer_over_parameters_the_model_does_not_hold_is_refused_when_the_state_is_built():
    """Built before fully_shard (which replaces the parameters), or holding a tensor kept beside the model: the
    first save failed an interval later with a bare KeyError."""
    from train_entry.state import TrainState

    m = torch.nn.Linear(2, 1)
    temperature = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(TypeError, match=r"holds a parameter that is not one of model\.parameters\(\)"):
        TrainState(m, torch.optim.AdamW([*m.parameters(), temperature]))
    with pytest.raises(TypeError, match="the scheduler is a int"):
        TrainState(m, torch.optim.SGD(m.parameters(), lr=0.1), scheduler=[3])


def test_stateful_objects_changed_before_the_resume_are_read_again_and_after_it_refused():
    """`state.stateful["x"] = ...` after TrainState(...) was never saved nor restored, without a word."""
    from train_entry.state import TrainState

    m = torch.nn.Linear(2, 1)
    state = TrainState(m, torch.optim.SGD(m.parameters(), lr=0.1))
    state.stateful["count"] = Replicated(Counter(3))  # before the resume: taken
    assert set(state.check_stateful()) == {"count"}
    state.stateful = {"count": Replicated(Counter(3)), "mine": PerRank(Counter(1))}
    state.settle()
    assert "per_rank.mine.rank0" in state.state_dict(0, torch.device("cpu"))
    state.stateful["late"] = Replicated(Counter())  # after it: it was never restored
    with pytest.raises(StatefulError, match=r"state.stateful changed after session.resume\(state\)"):
        state.state_dict(0, torch.device("cpu"))


def test_several_schedulers_are_saved_and_restored_each_in_its_place():
    """A list of schedulers (the README's list of optimizers invites one) failed at the first save with an
    AttributeError."""
    from train_entry.state import TrainState

    def made():
        m = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD([{"params": [m.weight]}, {"params": [m.bias]}], lr=1.0)
        return m, opt, [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]

    m, opt, scheds = made()
    for _ in range(3):
        opt.step()
        for sched in scheds:
            sched.step()
    sd = TrainState(m, opt, scheds).state_dict(0, torch.device("cpu"))
    assert sd["scheduler"]["0"]["last_epoch"] == sd["scheduler"]["1"]["last_epoch"] == 3
    m2, opt2, fresh = made()
    restored = TrainState(m2, opt2, fresh)
    template = restored.template(0, {"train", "scheduler.0.last_epoch", "scheduler.1.last_epoch"}, world_size=1)
    assert set(template["scheduler"]) == {"0", "1"}
    restored.load({**template, "train": sd["train"], "scheduler": sd["scheduler"]}, 0, torch.device("cpu"), 0,
                  world_size=1)
    assert [s.last_epoch for s in fresh] == [3, 3] and [s.get_last_lr() for s in fresh] == \
        [s.get_last_lr() for s in scheds]
    with pytest.raises(StatefulError, match="the LR scheduler is not in this checkpoint"):
        restored.template(0, {"train"}, world_size=1)


def test_a_replicated_set_packs_to_the_same_bytes_whatever_the_processs_string_hashes():
    """Sets of strings iterate in the order of PYTHONHASHSEED: two ranks holding the same set seemed to differ
    ("declare it PerRank", exit 78) under plain torchrun. This process against one with other string hashes."""
    import hashlib
    import os
    import subprocess
    import sys

    state = ("{'files': {f'shard-{i:05d}.tar' for i in range(40)}, 'seen': [frozenset({'a', 'b', 'c'})], "
             "'nested': {frozenset({'a0', 'b0', 'c0'}), frozenset({'x', 'y'}), ('t', frozenset({'p', 'q'}))}}")
    here = eval(state)  # a literal of this test's own, built the same way in both processes
    blob = pack(here)
    assert unpack(blob) == here and type(unpack(blob)["files"]) is set
    other = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # never this process's own seed
    code = f"import hashlib; from train_entry.stateful import pack; print(hashlib.sha256(pack({state})).hexdigest())"
    there = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": other},
                           capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert there == hashlib.sha256(blob).hexdigest()


def test_schedulers_saved_in_another_layout_or_with_no_state_are_named_not_taken_for_damage():
    """One scheduler saved, a list resumed (or the reverse, or lists of other lengths): DCP failed on a missing key
    and the run took its checkpoints for damaged ones. `scheduler=[]` saved nothing, then refused every resume."""
    from train_entry.state import TrainState

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)

    def sched():
        return torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    one = {"train", "scheduler.last_epoch", "scheduler.base_lrs"}
    two = {"train", "scheduler.0.last_epoch", "scheduler.1.last_epoch"}
    for run, keys, says in (([sched()], one, "holds one scheduler and this run has a list of 1"),
                            (sched(), two, "holds a list of 2 schedulers and this run has one scheduler"),
                            ([sched(), sched(), sched()], two, "holds a list of 2 schedulers and this run has a "
                                                               "list of 3"),
                            ([sched()], two, "holds a list of 2 schedulers and this run has a list of 1")):
        with pytest.raises(StatefulError, match=re.escape(says)):
            TrainState(m, opt, run).template(0, keys, world_size=1)
    assert "scheduler" not in TrainState(m, opt, []).state_dict(0, torch.device("cpu"))
    assert "scheduler" not in TrainState(m, opt, []).template(0, {"train"}, world_size=1)


def test_a_model_whose_layers_changed_since_the_save_stops_the_resume_naming_them():
    """Audit: a model with a layer removed resumed with exit 0, its weights and their optimizer state dropped for
    good; one with a layer added failed each checkpoint's load in turn before the run named the cause."""
    from train_entry.state import TrainState, model_changed

    def state_of(*widths: int) -> TrainState:
        m = torch.nn.Sequential(*(torch.nn.Linear(w, w) for w in widths))
        return TrainState(m, torch.optim.SGD(m.parameters(), lr=0.1))

    keys = {k for k in _flat_keys(state_of(4, 4).state_dict(0, torch.device("cpu")))}
    assert "model.1.weight" in keys and "model.0.bias" in keys
    state_of(4, 4).template(0, keys, world_size=1)  # the same model: fine
    with pytest.raises(StatefulError, match=r"the checkpoint holds 1\.bias, 1\.weight, which this model lacks\): "
                                            r"change it back, or train the new model in a new run dir"):
        state_of(4).template(0, keys, world_size=1)
    with pytest.raises(StatefulError, match=r"this model has 2\.bias, 2\.weight, which the checkpoint lacks"):
        state_of(4, 4, 4).template(0, keys, world_size=1)
    # a value DCP flattened into several keys (a module's extra state as a dict) is the same name
    assert model_changed({"model.w", "model.norm._extra_state.a", "model.norm._extra_state.b"},
                         {"w": 0, "norm._extra_state": {}}) is None
    assert model_changed({"train", "rng.rank0"}, {"w": 0}) is None  # no model in it: nothing to compare


def _flat_keys(sd: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in sd.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out
