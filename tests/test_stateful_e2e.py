"""A training loop's own stateful objects under real torchrun (2 CPU gloo ranks), real SIGKILLs and real DCP
files: a GradScaler (Replicated), an EMA (Sharded) and a StatefulDataLoader (PerRank), saved and restored
bitwise, resharded where they can be, and stopped with one sentence where they cannot."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
from pathlib import Path

import pytest

from supervisor import store
from tests.ckpt_helpers import assert_same_training_state, dcp_tensors, same_value, stateful_entries
from tests.proc import REPO, started, torchrun, wait_for
from tests.runs import RUN_TIMEOUT, live_ranks, rank_log, resilient, state, status

pytestmark = pytest.mark.slow

EXAMPLE_JOB = REPO / "jobs" / "my-script-stateful.yaml"
LAUNCH_TIMEOUT = 120
EXIT_CONFIG_TORCHRUN = 1  # torchrun exits 1 for any worker failure; the rank's own 78 is in its summary


def example_job(run_dir: Path, steps: int, *sets: str) -> list[str]:
    """`resilient run` of the user's example: 512 samples, so an epoch is 8 steps and a checkpoint every 20
    steps falls mid-epoch and at an epoch's end in turn."""
    args = ["--steps", str(steps), "--samples", "512", "--device", "cpu"]
    argv = resilient("run", EXAMPLE_JOB, "--run-dir", run_dir, "--set", f"entrypoint.args={json.dumps(args)}",
                     "--set", "checkpoint.interval_steps=20", "--set", "restart.backoff_s=0.2",
                     "--set", "heartbeat.interval_s=0.2")
    for s in sets:
        argv += ["--set", s]
    return argv


def test_example_survives_two_sigkills_bitwise_and_refuses_a_world_size_its_loader_cannot_follow(tmp_path, rng):
    """The acceptance line: model, optimizer, EMA, scaler and loader state equal an uninterrupted run's."""
    pytest.importorskip("torchdata", reason="the example needs torchdata: pip install -e '.[dev]' installs it")
    straight, killed = tmp_path / "straight", tmp_path / "killed"

    def attempt_ranks(attempt: int, min_step: int) -> list[dict]:
        return live_ranks(killed, min_step) if state(killed).get("attempt") == attempt else []

    first = rng.randint(25, 45)  # attempt 2 is killed 10 steps later: 145+ steps before the run ends
    # The uninterrupted run is the reference only at its end: it trains alongside the killed one.
    with started(example_job(straight, 200), tmp_path, log=tmp_path / "straight.log") as ref, \
            started(example_job(killed, 200), tmp_path, log=tmp_path / "killed.log") as sup:
        for attempt, at_step in ((1, first), (2, first + 10)):
            ranks = wait_for(lambda a=attempt, s=at_step: attempt_ranks(a, s), 120, f"attempt {attempt} training")
            os.kill(rng.choice(ranks)["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        assert ref.wait(RUN_TIMEOUT) == 0, ref.output()[-3000:]
    history = status(killed)["history"]
    assert [h["reason"] for h in history] == ["worker_signal", "worker_signal", "finished"], history
    a, b = store.latest_valid(straight / "checkpoints"), store.latest_valid(killed / "checkpoints")
    assert a.step == b.step == 200
    assert_same_training_state(a.path, b.path)

    # Each object really carried state worth restoring.
    entries, model = stateful_entries(b.path), dcp_tensors(b.path)
    assert entries["replicated.scaler"]["scale"] != 2.0**16, "the scaler never moved from its initial scale"
    assert not same_value(entries["per_rank.loader.rank0"], entries["per_rank.loader.rank1"])
    assert not same_value(entries["sharded.ema.0.weight"], model["model.0.weight"])

    # The loader's per-rank state (a shuffled shard per rank) has no reshard hook: one rank stops, naming it.
    with started(example_job(killed, 220, "nproc_per_node=1"), tmp_path, log=tmp_path / "one.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 1
        console = sup.output()
    last = status(killed)["history"][-1]
    assert last["reason"] == "config", last
    sentence = ("stateful 'loader' (StatefulDataLoader, PerRank) holds per-rank state saved by 2 ranks and this run "
                "has 1")
    assert sentence in last["detail"] and sentence in console
    log0 = rank_log(killed, last["attempt"], 0)
    assert "Traceback" not in log0 and log0.count(sentence) == 1, log0[-3000:]
    assert store.latest_valid(killed / "checkpoints").step == 200, "nothing was saved over the run's checkpoints"


def run_to_end(cwd: Path, nproc: int, args: list[str], name: str) -> str:
    with started(torchrun(nproc, args), cwd, log=cwd / f"{name}.log") as p:
        rc = p.wait(LAUNCH_TIMEOUT)
        out = p.output()
        assert rc == 0, out[-3000:]
        return out


def test_bf16_ema_and_loader_reshard_2_to_1_and_an_object_that_refuses_its_state_is_named(tmp_path):
    """2 ranks save an EMA, a loader and an object whose load_state_dict raises; on 1 rank that object stops the
    resume with its name (exit 78, no traceback); without it, the EMA reshards and the loader's hook re-slices."""
    import torch

    decay = 0.9
    base = ["--precision", "bf16", "--ema", str(decay), "--loader", "stateful", "--batch", "10", "--n-embd", "32",
            "--ckpt-interval", "10", "--test-log-samples", "samples"]
    out1 = run_to_end(tmp_path, 2, [*base, "--steps", "10", "--test-stateful-load-raises"], "two")
    assert "precision bf16 (autocast on cpu); stateful objects: ema (Sharded), loader (PerRank), " \
           "test_refuses_load (Replicated)" in out1

    with started(torchrun(1, [*base, "--steps", "11", "--test-stateful-load-raises"]), tmp_path,
                 log=tmp_path / "refused.log") as p:
        assert p.wait(LAUNCH_TIMEOUT) == EXIT_CONFIG_TORCHRUN
        refused = p.output()
    sentence = ("cannot resume from step_000000010: stateful 'test_refuses_load' (RefusesToLoad, Replicated): its "
                "load_state_dict() raised RuntimeError: test hook: this object refuses its saved state (exit 78)")
    assert sentence in refused and "exitcode  : 78" in refused, refused[-3000:]
    assert re.search(r'File "[^"]*train_entry/', refused) is None, "a rank printed a traceback"
    assert store.latest_valid(tmp_path / "checkpoints").step == 10

    out2 = run_to_end(tmp_path, 1, [*base, "--steps", "11"], "one")
    assert "resumed from step 10 (step_000000010)" in out2 and "resharded from 2 ranks" in out2
    assert "loader (per_rank, 2 ranks -> 1 by its reshard_state_dict hook)" in out2
    assert "the checkpoint holds stateful 'test_refuses_load', which this run does not declare" in out2

    # The loader continued from the saved global position with the new slicing: every sample once.
    ids: collections.Counter = collections.Counter()
    for f in (tmp_path / "samples").glob("*.jsonl"):
        for row in map(json.loads, f.read_text().splitlines()):
            ids.update(range(*row["ids"]))
    assert ids == collections.Counter(range(11 * 10)), "a sample was repeated or skipped"

    # The EMA of step 11 (one rank) is the EMA of step 10 (two ranks, resharded) moved one step towards the
    # weights of step 11, not a fresh average of the weights.
    root = tmp_path / "checkpoints"
    ema10 = stateful_entries(root / store.step_dirname(10))
    ema11 = stateful_entries(root / store.step_dirname(11))
    w10, w11 = dcp_tensors(root / store.step_dirname(10)), dcp_tensors(root / store.step_dirname(11))
    names = [k.removeprefix("sharded.ema.") for k in ema11 if k.startswith("sharded.ema.")]
    assert len(names) > 20
    restarted_gap = 0.0
    for n in names:
        expected = ema10[f"sharded.ema.{n}"].lerp(w11[f"model.{n}"], 1.0 - decay)
        torch.testing.assert_close(ema11[f"sharded.ema.{n}"], expected, rtol=0, atol=1e-7)
        restarted = w10[f"model.{n}"].lerp(w11[f"model.{n}"], 1.0 - decay)
        restarted_gap = max(restarted_gap, float((ema11[f"sharded.ema.{n}"] - restarted).abs().max()))
    assert restarted_gap > 1e-4, "the EMA looks restarted from the weights"


def test_a_replicated_object_that_drifts_apart_stops_the_first_save_on_every_rank(tmp_path):
    """Declared Replicated, counted differently on each rank: DCP would save one rank's copy and hand it to every
    rank at the resume (the check at the start compares only freshly built objects). The save compares the
    ranks' digests, and every rank stops with the object's name before anything is written."""
    args = ["--steps", "20", "--ckpt-interval", "5", "--test-replicated-drift"]
    with started(torchrun(2, args), tmp_path, log=tmp_path / "drift.log") as p:
        assert p.wait(LAUNCH_TIMEOUT) == EXIT_CONFIG_TORCHRUN
        out = p.output()
    # Every rank stops on its own word (torchrun reports the ranks it saw fail, and SIGTERMs the others).
    for rank in (0, 1):
        assert f"[rank {rank}] ERROR cannot save: stateful 'test_drifts' (Drifts, Replicated) differs between the " \
               "ranks" in out, out[-3000:]
    assert "exitcode  : 78" in out, out[-3000:]
    root = tmp_path / "checkpoints"
    assert not root.exists() or store.latest_valid(root) is None
