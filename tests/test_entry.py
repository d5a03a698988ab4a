"""The training entry point under real torchrun (2 ranks, CPU/gloo), real DCP files and real signals."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from supervisor import store
from supervisor.protocol import EXIT_NAN, EXIT_PREEMPTED, pid_running
from tests.ckpt_helpers import assert_same_training_state, dcp_tensors, stateful_entries
from tests.proc import Proc, child_env, heartbeat, started, step_of, torchrun, wait_for

pytestmark = pytest.mark.slow

LAUNCH_TIMEOUT = 120


def run_to_end(cwd: Path, nproc: int, args: list[str], name: str) -> str:
    with started(torchrun(nproc, args), cwd, log=cwd / f"{name}.log") as p:
        rc = p.wait(LAUNCH_TIMEOUT)
        out = p.output()
        assert rc == 0, out[-3000:]
        return out


def sample_log(folder: Path, skip: set[Path] = frozenset()) -> list[dict]:
    """Every complete row the ranks logged, leaving out the files in `skip` (one file per process)."""
    rows = []
    for f in sorted(set(folder.glob("*.jsonl")) - skip):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written right now
                pass
    return rows


def max_step(samples: Path) -> int:
    rows = sample_log(samples) if samples.is_dir() else []
    return max((r["step"] for r in rows), default=0)


def test_sigkill_between_saves_and_plain_relaunch_is_bitwise_exact(tmp_path, rng):
    """Uninterrupted vs. SIGKILLed twice at random steps and relaunched with plain torchrun, with every kind of
    stateful object the entry point has: fp16's GradScaler, a sharded EMA, a per-rank StatefulDataLoader."""
    common = ["--steps", "40", "--ckpt-interval", "10", "--precision", "fp16", "--scaler-growth-interval", "4",
              "--ema", "0.9", "--loader", "stateful", "--n-embd", "32", "--seq-len", "32"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    # The uninterrupted run is the reference only at its end: it trains alongside the killed one.
    with started(torchrun(2, common), straight, log=straight / "straight.log") as ref:
        killed_twice_then_finished(killed, common, rng)
        assert ref.wait(LAUNCH_TIMEOUT) == 0, ref.output()[-3000:]

    final_a = store.latest_valid(straight / "checkpoints")
    final_b = store.latest_valid(killed / "checkpoints")
    assert final_a.step == final_b.step == 40, "a finished run's newest valid checkpoint is its final step"
    assert_same_training_state(final_a.path, final_b.path)
    entries = stateful_entries(final_b.path)
    assert {"replicated.scaler", "per_rank.loader.rank0", "per_rank.loader.rank1"} <= entries.keys()
    assert sum(k.startswith("sharded.ema.") for k in entries) > 20
    assert entries["replicated.scaler"]["scale"] != 2.0**16, "the scaler never moved: its state proves nothing"


def killed_twice_then_finished(killed: Path, common: list[str], rng) -> None:
    """Two attempts SIGKILLed (a random rank, at a random step after a commit), then a plain relaunch to the end."""
    resumed_from: int | None = None
    for attempt in range(2):
        target = rng.choice([s for s in range((resumed_from or 0) + 3, 35) if s % 10 not in (0, 9)])
        victim = rng.choice([0, 1])
        args = [*common, "--heartbeat-dir", "hb", "--heartbeat-interval-s", "0.2",
                "--test-sleep-per-step", "0.05", "--test-log-samples", "samples"]
        # The previous attempt's heartbeats (and its sample rows past the checkpoint) must not count as
        # this attempt's progress: its dead PIDs would be "killed" again.
        shutil.rmtree(killed / "hb", ignore_errors=True)
        earlier = set((killed / "samples").glob("*.jsonl"))  # one file per process
        with started(torchrun(2, args), killed, log=killed / f"attempt{attempt}.log") as p:
            def reached(target: int = target, victim: int = victim, p: Proc = p, earlier: set = earlier) -> bool:
                steps = [r["step"] for r in sample_log(killed / "samples", skip=earlier)]
                ran = max(steps, default=0) >= target and step_of(killed / "hb", victim) >= 0
                saved = store.latest_valid(killed / "checkpoints") is not None  # the kill comes after a commit
                return (ran and saved) or p.poll() is not None

            wait_for(reached, 90, f"step {target}")
            assert p.poll() is None, p.output()[-2000:]
            pid = heartbeat(killed / "hb", victim)["pid"]
            os.kill(pid, signal.SIGKILL)
            assert p.wait(60) != 0
            out = p.output()
        if attempt:
            assert (f"resumed from step {resumed_from} " if resumed_from else "no checkpoint to resume from") in out
        latest = store.latest_valid(killed / "checkpoints")
        assert latest is not None and latest.step <= max_step(killed / "samples")
        resumed_from = latest.step
    out = run_to_end(killed, 2, common, "final")
    assert (f"resumed from step {resumed_from} " if resumed_from else "no checkpoint to resume from") in out


@pytest.mark.matrix
def test_resharding_2_to_1_to_3_consumes_every_sample_once(tmp_path):
    batch = 10  # uneven over 3 ranks: 3/3/4
    base = ["--batch", str(batch), "--ckpt-interval", "5", "--test-log-samples", "samples", "--log-every", "1"]
    out1 = run_to_end(tmp_path, 2, [*base, "--steps", "20"], "two")
    out2 = run_to_end(tmp_path, 1, [*base, "--steps", "30"], "one")
    out3 = run_to_end(tmp_path, 3, [*base, "--steps", "40"], "three")
    assert "resumed from step 20 (step_000000020)" in out2 and "resharded from 2 ranks" in out2
    assert "resumed from step 30 (step_000000030)" in out3 and "resharded from 1 ranks" in out3
    # RNG state is per rank: rank 1's was dropped with the world size, and the ranks the world grew by were
    # seeded from (seed, rank, step), never handed another rank's state.
    assert {k for k in dcp_tensors(tmp_path / "checkpoints" / store.step_dirname(30)) if k.startswith("rng.")} == \
        {"rng.rank0"}
    assert "rank 0 has no saved RNG" not in out3
    assert all(f"rank {r} has no saved RNG state in this checkpoint: seeded from (seed 0, rank {r}, step 30)" in out3
               for r in (1, 2))
    assert {k for k in dcp_tensors(tmp_path / "checkpoints" / store.step_dirname(40)) if k.startswith("rng.")} == \
        {"rng.rank0", "rng.rank1", "rng.rank2"}

    rows = sample_log(tmp_path / "samples")
    assert {r["world"] for r in rows} == {1, 2, 3}
    ids = collections.Counter()
    for r in rows:
        ids.update(range(*r["ids"]))
    assert ids == collections.Counter(range(40 * batch)), "a sample was repeated or skipped"

    def losses(out: str) -> dict[int, float]:
        return {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/\d+ loss ([\d.]+)", out)}

    l1, l2, l3 = losses(out1), losses(out2), losses(out3)
    initial = l1[1]
    for before, after in ((l1[20], l2[21]), (l2[30], l3[31])):
        # Training continues: no jump back towards the initial loss.
        assert after < before + 0.25 * (initial - before), (before, after, initial)
    assert l3[40] < 0.8 * initial


# Killed mid-data under the supervisor: test_supervisor_e2e's test_sigkill_during_a_checkpoint_write_...; every
# point of a save, many times over, in bench/kill_campaign.py.
@pytest.mark.parametrize("point, victim", [("before_marker", 0)])
def test_sigkill_during_a_save_leaves_no_valid_folder_and_resume_uses_the_previous(tmp_path, point, victim):
    args = ["--steps", "30", "--ckpt-interval", "10", "--heartbeat-dir", "hb", "--heartbeat-interval-s", "0.2",
            "--test-save-pause", f"{point}:60@20"]
    partial = tmp_path / "checkpoints" / store.partial_dirname(20)
    with started(torchrun(2, args), tmp_path, log=tmp_path / "first.log") as p:
        if point == "mid_data":
            # Both ranks' shards are written; DCP's .metadata and our marker are not.
            wait_for(lambda: (partial / "__1_0.distcp").exists() and "pausing" in p.output(), 90, "the pause")
            assert not (partial / ".metadata").exists()
        else:
            wait_for(lambda: "pausing" in p.output(), 90, "the pause before the marker")
            assert (partial / ".metadata").exists() and (partial / "__1_0.distcp").exists()
        assert not (partial / store.MARKER).exists()
        os.kill(heartbeat(tmp_path / "hb", victim)["pid"], signal.SIGKILL)
        assert p.wait(60) != 0
    info = store.inspect(partial)
    assert info.status is store.Status.INCOMPLETE and not info.valid
    assert not (tmp_path / "checkpoints" / store.step_dirname(20)).exists()
    assert store.latest_valid(tmp_path / "checkpoints").step == 10
    out = run_to_end(tmp_path, 2, ["--steps", "30", "--ckpt-interval", "10"], "second")
    assert "resumed from step 10 (step_000000010)" in out
    assert store.inspect(tmp_path / "checkpoints" / store.step_dirname(20)).valid


def test_sigterm_exits_preempted_with_a_checkpoint_at_the_stop_step(tmp_path):
    args = ["--steps", "500", "--ckpt-interval", "100", "--heartbeat-dir", "hb", "--heartbeat-interval-s", "0.2",
            "--test-sleep-per-step", "0.02"]
    with started(torchrun(2, args), tmp_path, log=tmp_path / "run.log") as p:
        wait_for(lambda: (heartbeat(tmp_path / "hb", 1) or {}).get("step", 0) >= 15, 90, "step 15")
        # SIGUSR1: every thread's stack goes to the rank's log, and training goes on.
        os.kill(heartbeat(tmp_path / "hb", 0)["pid"], signal.SIGUSR1)
        wait_for(lambda: "most recent call first" in p.output(), 30, "the stack dump")
        step_at_dump = heartbeat(tmp_path / "hb", 0)["step"]
        wait_for(lambda: heartbeat(tmp_path / "hb", 0)["step"] > step_at_dump + 5, 30, "training to go on")
        signalled_at = time.time()
        for rank in (0, 1):  # a preemption reaches every process of the node
            os.kill(heartbeat(tmp_path / "hb", rank)["pid"], signal.SIGTERM)
        p.wait(60)
        out = p.output()
    hbs = [heartbeat(tmp_path / "hb", r) for r in (0, 1)]
    assert [hb["exit_code"] for hb in hbs] == [EXIT_PREEMPTED] * 2, out[-2000:]
    assert f"exitcode  : {EXIT_PREEMPTED}" in out
    stop_step = hbs[0]["step"]
    assert hbs[1]["step"] == stop_step
    latest = store.latest_valid(tmp_path / "checkpoints", deep=True)  # the stop's own save, after the signal
    assert latest is not None and latest.step == stop_step and latest.created_at > signalled_at


def test_ranks_signalled_apart_agree_whether_the_grace_allows_the_stop_checkpoint(tmp_path):
    """Only rank 1 has the SIGTERM; rank 0 learns of the stop from the agreement. With no grace left for a save,
    both exit 75 without one: rank 0 once saved alone, and failed in the save's collective (exit 1)."""
    args = ["--steps", "500", "--ckpt-interval", "10", "--heartbeat-dir", "hb", "--heartbeat-interval-s", "0.2",
            "--test-sleep-per-step", "0.02"]
    env = child_env(RESILIENT_STOP_GRACE_S="2")  # the grace, less its 2 s margin: no time for a save
    with started(torchrun(2, args), tmp_path, env=env, log=tmp_path / "run.log") as p:
        wait_for(lambda: (heartbeat(tmp_path / "hb", 1) or {}).get("step", 0) >= 15, 90, "step 15")
        os.kill(heartbeat(tmp_path / "hb", 1)["pid"], signal.SIGTERM)
        p.wait(60)
        out = p.output()
    hbs = [heartbeat(tmp_path / "hb", r) for r in (0, 1)]
    assert [hb["exit_code"] for hb in hbs] == [EXIT_PREEMPTED] * 2, out[-3000:]
    assert "stopping without a checkpoint" in out
    assert store.latest_valid(tmp_path / "checkpoints").step < hbs[0]["step"]
    assert not list((tmp_path / "checkpoints").glob("*.partial"))


def test_nan_loss_exits_nan_and_never_saves_that_step(tmp_path):
    args = ["--steps", "40", "--ckpt-interval", "5", "--test-nan-at-step", "13", "--heartbeat-dir", "hb"]
    with started(torchrun(2, args), tmp_path, log=tmp_path / "run.log") as p:
        assert p.wait(LAUNCH_TIMEOUT) != 0
        out = p.output()
    assert f"exitcode  : {EXIT_NAN}" in out, out[-2000:]
    assert [heartbeat(tmp_path / "hb", r)["exit_reason"] for r in (0, 1)] == ["nan at step 13"] * 2
    steps = sorted(int(d.name[5:14]) for d in store.checkpoint_dirs(tmp_path / "checkpoints"))
    assert steps == [5, 10], steps
    assert store.latest_valid(tmp_path / "checkpoints").step == 10


def test_final_checkpoint_exports_to_a_single_torch_file(tmp_path, capsys):
    import subprocess
    import sys

    import torch

    from train_entry import export

    run_to_end(tmp_path, 2, ["--steps", "12", "--ckpt-interval", "100"], "run")
    final = store.latest_valid(tmp_path / "checkpoints")
    assert final.step == 12
    out = subprocess.run([sys.executable, "-m", "train_entry.export", str(final.path), str(tmp_path / "model.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "step 12" in out.stdout, out.stderr
    sd = torch.load(tmp_path / "model.pt", weights_only=False)
    assert sd["model"]["tok_emb.weight"].shape == (256, 64)  # whole: both ranks' shards of dim 0
    assert json.loads(sd["train"])["step"] == 12
    # The easy slips (the root for a step, a folder that is not there, a file inside this or another checkpoint,
    # which an unlisted file makes corrupt) are one sentence each, not a traceback (in this process: each is
    # found before anything is loaded, and a process each cost two seconds of importing torch).
    other = tmp_path / "checkpoints" / "step_000000005.partial"
    other.mkdir()
    for args, words in (([tmp_path / "checkpoints", tmp_path / "m.pt"], f"e.g. {final.path}"),
                        ([tmp_path, tmp_path / "m.pt"], f"e.g. {final.path}"),  # a run dir: its checkpoints' newest
                        ([tmp_path / "nope", tmp_path / "m.pt"], "nope: does not exist"),
                        ([final.path, tmp_path / "nowhere" / "m.pt"], "does not exist"),
                        ([final.path, tmp_path], f"is a folder; name the file to write, e.g. {tmp_path}/model.pt"),
                        ([final.path, final.path], f"inside the checkpoint {final.path}"),  # not "e.g. it/model.pt"
                        ([final.path, final.path / "model.pt"], f"inside the checkpoint {final.path}"),
                        ([final.path, other / "model.pt"], f"inside the checkpoint {other}")):
        code = export.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert store.inspect(final.path, deep=True).valid and list(other.iterdir()) == []  # nothing was written there


def test_proc_helper_kills_the_whole_tree(tmp_path):
    import sys

    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    p = Proc([sys.executable, "-c", code], tmp_path)
    wait_for(lambda: len(p.alive_descendants()) == 2, 20, "the child")
    p.kill_all()
    assert p.alive_descendants() == []


def test_ranks_under_a_torchrun_that_is_pid_1_train_and_die_with_a_torchrun_killed(tmp_path):
    """torchrun as a container's command is pid 1: each rank took "my parent is pid 1" for its parent's death and
    stopped itself at the start (exit 75 after step 1). A rank still ends when its torchrun is SIGKILLed."""
    import subprocess

    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no pid namespaces here (needs root and unshare): {probe.stderr.strip()}")
    argv = ["unshare", "--pid", "--fork", *torchrun(1, ["--steps", "5"])]
    with started(argv, tmp_path, log=tmp_path / "pid1.log") as p:
        assert p.wait(LAUNCH_TIMEOUT) == 0, p.output()[-3000:]
        assert "finished at step 5" in p.output() and "stop requested" not in p.output()
    with started(torchrun(1, ["--steps", "100000", "--test-sleep-per-step", "0.05"]), tmp_path,
                 log=tmp_path / "killed.log") as p:
        wait_for(lambda: "startup:" in p.output(), LAUNCH_TIMEOUT, "the rank past its start")
        rank = rank_pid(p)
        os.kill(p.pid, signal.SIGKILL)  # torchrun alone: the kernel's SIGTERM reaches its rank, which stops
        wait_for(lambda: not pid_running(rank), 60, "the rank to end with its torchrun")


def rank_pid(p: Proc) -> int:
    """The pid of the one rank `p` (a torchrun of one rank) started."""
    import psutil

    ranks = [c.pid for c in psutil.Process(p.pid).children() if "-m" in c.cmdline() and "train_entry" in c.cmdline()]
    assert len(ranks) == 1, ranks
    return ranks[0]
