"""Two checkpoint tiers under `resilient run` for real (`checkpoint.local_dir`): the ranks commit to the node's
local folder, the supervisor copies each checkpoint to `checkpoint.dir`. Faults: the supervisor killed in the
middle of a copy, a corrupted local copy, a killed rank, a full durable tier, a replaced node (its local tier
gone), two nodes with their own local tiers, and two nodes whose durable copies are slower than their saves."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from supervisor import store
from tests.ckpt_helpers import flip_byte
from tests.proc import Proc, child_env, free_port, started, wait_for
from tests.runs import RUN_TIMEOUT, live_ranks, rank_log, resilient, run_job, state, status

pytestmark = pytest.mark.slow

INTERVAL = 20  # run_job's checkpoint.interval_steps


def finish(argv: list[str], cwd: Path, log_name: str, env: dict | None = None, expect: int = 0) -> str:
    with started(argv, cwd, env=env, log=cwd / log_name) as sup:
        code = sup.wait(RUN_TIMEOUT)
        out = sup.output()
    assert code == expect, out[-3000:]
    return out


def valid_steps(root: Path) -> list[int]:
    return [i.step for i in store.scan(root) if i.valid] if root.is_dir() else []


def inspect_json(target: Path) -> dict:
    out = subprocess.run(resilient("inspect-checkpoint", target, "--json"), capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def copying(durable: Path) -> Path | None:
    """A durable partial that the replicator has started to fill (a file beside its lock)."""
    for p in durable.glob("*.partial") if durable.is_dir() else []:
        if any(f.name != store.WRITER_LOCK for f in p.iterdir()):
            return p
    return None


def test_the_local_tier_is_replicated_through_a_supervisor_kill_and_a_bad_local_copy_falls_back_to_durable(tmp_path):
    run_dir, local = tmp_path / "run", tmp_path / "local"
    durable = run_dir / "checkpoints"
    tier = f"checkpoint.local_dir={local}"
    # 1. The supervisor is killed -9 while it copies a checkpoint (a test hook holds the copy after one file).
    paused = child_env(RESILIENT_TEST_REPLICATE_PAUSE_S="60")
    sup = Proc(run_job(run_dir, tier, steps=60, sleep=0.0), tmp_path, env=paused, log=tmp_path / "first.log")
    try:
        partial = wait_for(lambda: copying(durable), 90, "a copy to the durable tier under way")
        wait_for(lambda: valid_steps(local)[-1:] == [60], 90, "the ranks' last local commit")
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(30)
    finally:
        sup.kill_all()
    assert valid_steps(durable) == [] and not store.inspect(partial).valid
    listed = {c["step"]: c for c in inspect_json(durable)["checkpoints"]}
    assert listed[int(partial.name.split("_")[1].split(".")[0])]["status"] == "incomplete"
    assert valid_steps(local) == [20, 40, 60]  # none replicated: none deleted, keep_local notwithstanding

    # 2. `resilient run` again: the ranks resume from the local tier, and the copies complete, newest first.
    console = finish(run_job(run_dir, tier, steps=80, sleep=0.0), tmp_path, "second.log")
    assert "resuming from local step 60 if every node holds it" in console
    assert "from the local tier (every node holds step 60 whole)" in console
    # Newest first: 60 is copied, 20 and 40 never are (superseded; the killed copy's partial is cleaned up).
    assert valid_steps(durable) == [60, 80] and valid_steps(local) == [60, 80]
    for step in (60, 80):
        deep = store.inspect(durable / store.step_dirname(step), deep=True)
        assert deep.valid and deep.manifest.extra["tier"] == "durable", deep.reason
    assert not list(durable.glob("*.partial"))

    # 3. The newest local copy is corrupt: set aside, the ranks take the durable copy; a rank killed later
    #    resumes from the local tier. The ranks' steps reach state.json through 1 s heartbeats and 1 s state writes,
    #    so the run goes on well past step 105 (to 160, slower steps): a window of a few hundred ms (to 120, CI
    #    missed it) could pass unseen. The kill may then land after a later local commit (120, 140): the resume is
    #    from whichever is newest.
    flip_byte(local / store.step_dirname(80) / ".metadata", offset=100)
    with started(run_job(run_dir, tier, steps=160, sleep=0.08), tmp_path, log=tmp_path / "third.log") as sup:
        try:
            ranks = wait_for(lambda: 100 in valid_steps(local) and live_ranks(run_dir, min_step=105), 120,
                             "training past step 105 with step 100 committed locally")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- console ---\n{sup.output()[-3000:]}") from None
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        console = sup.output()
    assert "skipping local step_000000080: corrupt: .metadata checksum mismatch" in console
    history = status(run_dir)["history"]
    assert [(h["resumed_from_step"], h["resumed_tier"]) for h in history[-2:-1]] == [(80, "durable")]
    assert "older than the durable step 80" in history[-2]["resumed_why"]
    assert history[-2]["offered_local_step"] == 60  # offered beside durable 80: gc spares it while the ranks load
    resumed = history[-1]["resumed_from_step"]
    assert resumed in (100, 120, 140) and history[-1]["resumed_tier"] == "local", history[-1]
    assert history[-1]["resumed_why"] == f"every node holds step {resumed} whole"
    assert any(c["quarantined"] and c["step"] == 80 for c in inspect_json(local)["checkpoints"])
    rep = status(run_dir)["replication"]
    assert (rep["newest_local"], rep["newest_durable"], rep["lag_steps"], rep["pending"]) == (160, 160, 0, [])
    text = subprocess.run(resilient("status", run_dir), capture_output=True, text=True, env=child_env(), timeout=60)
    assert f"resumed   step {resumed} from the local tier (every node holds step {resumed} whole)" in text.stdout
    assert "local step 160 · durable step 160 · up to date" in text.stdout
    # Retention kept deleted checkpoints' data files for later saves to write over, and the run's end freed them.
    logs = "".join(rank_log(run_dir, h["attempt"], 0) for h in history)  # every attempt of the three runs
    assert "its data written over a deleted checkpoint's file" in logs
    assert not (local / store.SPARE_DIR).exists()


def test_a_signal_during_the_exit_copy_cuts_it_to_the_stop_timeout(tmp_path):
    """A finished run copies its last local checkpoints before leaving (up to 10 minutes): a SIGTERM then (a
    scheduler's grace period) gives it stop_timeout_s more, not the rest (it was ignored: SIGKILL came mid-copy)."""
    run_dir, local = tmp_path / "run", tmp_path / "local"
    paused = child_env(RESILIENT_TEST_REPLICATE_PAUSE_S="600")
    with started(run_job(run_dir, f"checkpoint.local_dir={local}", "stop_timeout_s=1", steps=40, sleep=0.0),
                 tmp_path, env=paused, log=tmp_path / "sup.log") as sup:
        wait_for(lambda: "to the durable tier before exiting" in sup.output(), 120, "the exit copy")
        sup.signal(signal.SIGTERM)
        code = sup.wait(30)
        console = sup.output()
    assert code == 0, console[-3000:]  # the job had finished: the signal cut only the copy
    assert "SIGTERM: copying for up to 1s more, then exiting" in console, console[-3000:]
    assert "`resilient run` again goes on copying" in console
    assert valid_steps(local) == [20, 40] and valid_steps(run_dir / "checkpoints") == []


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; returns it."""
    filler = disk / "test-filler.bin"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_durable_tier_does_not_stop_training_and_a_replaced_node_loses_at_most_the_lag(tmp_path, small_disk):
    run_dir, local = tmp_path / "run", tmp_path / "local"
    sets = (f"checkpoint.local_dir={local}", f"checkpoint.dir={small_disk}", "checkpoint.keep=1")
    with started(run_job(run_dir, *sets, steps=400, sleep=0.02), tmp_path, log=tmp_path / "first.log") as sup:
        wait_for(lambda: valid_steps(small_disk), 90, "a first durable checkpoint")
        filler = fill(small_disk)
        failing = wait_for(lambda: state(run_dir).get("replication", {}).get("failing_since"), 60,
                           "the supervisor to notice the full durable tier")
        at_failure = max(r["step"] for r in state(run_dir)["ranks"])
        wait_for(lambda: live_ranks(run_dir, min_step=at_failure + 2 * INTERVAL), 90, "training going on")
        rep = wait_for(lambda: (r := state(run_dir).get("replication", {})) and
                       (r.get("lag_steps") or 0) >= 3 * INTERVAL and r, 90, "the local tier three checkpoints ahead")
        text = subprocess.run(resilient("status", run_dir), capture_output=True, text=True, env=child_env(),
                              timeout=60).stdout
        # The node is lost: supervisor, torchrun and ranks at once.
        step_at_loss = max(r["step"] for r in state(run_dir)["ranks"])
        sup.kill_all()
        console = sup.output()
    assert console.count("cannot copy step") == 1 and "No space left on device" in console, console[-3000:]
    assert "training goes on with the local tier" in console
    assert "the durable tier is FAILING for" in text and "No space left on device" in text
    # status ran a moment after `rep` was read: the local tier may have committed another step by then.
    shown = re.search(r"lag (\d+) steps", text)
    assert shown and int(shown[1]) >= rep["lag_steps"] and int(shown[1]) % INTERVAL == 0, text
    durable_step = valid_steps(small_disk)[-1]
    assert failing and rep["newest_durable"] == durable_step
    newest_local = valid_steps(local)[-1]
    assert len(valid_steps(local)) > 2  # nothing unreplicated deleted to honour keep_local
    lag = newest_local - durable_step

    # A new node in its place: an empty local tier, and room on the durable one.
    shutil.rmtree(local)
    filler.unlink()
    console = finish(run_job(run_dir, *sets, steps=step_at_loss + 40, sleep=0.0), tmp_path, "second.log")
    resumed = status(run_dir)["history"][-1]
    assert (resumed["resumed_from_step"], resumed["resumed_tier"]) == (durable_step, "durable"), resumed
    assert "has no local checkpoint" in resumed["resumed_why"], resumed
    lost = step_at_loss - durable_step
    assert lost <= INTERVAL + lag, (lost, lag)
    assert valid_steps(small_disk) == [step_at_loss + 40]
    assert store.inspect(small_disk / store.step_dirname(step_at_loss + 40), deep=True).valid


def test_a_nan_rolls_back_through_the_local_tier_while_the_durable_tier_is_full(tmp_path, small_disk):
    """The durable tier fills after step 20: the loss goes non-finite at step 70, after local step 60. The rollback
    resumes from local step 40, the one before the newest in either tier; it counted from the durable tier's newest,
    found nothing older than 20 there and stopped ("no earlier valid checkpoint to roll back to")."""
    run_dir, local = tmp_path / "run", tmp_path / "local"
    sets = (f"checkpoint.local_dir={local}", f"checkpoint.dir={small_disk}")
    argv = run_job(run_dir, *sets, steps=200, sleep=0.05, extra_args=("--test-nan-at-step", "70"))
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        wait_for(lambda: valid_steps(small_disk), 90, "a first durable checkpoint")
        fill(small_disk)
        assert sup.wait(RUN_TIMEOUT) == 1, sup.output()[-3000:]
        console = sup.output()
    assert valid_steps(small_disk)[-1] < 60, "the durable tier was to lag the local one"
    doc = status(run_dir)
    assert [h["reason"] for h in doc["history"]] == ["nan", "nan"], console[-3000:]
    second = doc["history"][1]
    assert (second["resumed_from_step"], second["resumed_tier"]) == (40, "local"), second
    assert "rolling back below step 60" in console and "non-finite again after a rollback" in doc["message"]
    # the step the loss went non-finite after is set aside in the local tier once step 40 loads
    assert [q["step"] for q in doc["quarantined"]] == [60] and (local / "step_000000060.quarantined").is_dir()


def job_file(tmp_path: Path, port: int, *, steps: int = 100, interval: int = 20) -> Path:
    job = tmp_path / "mn.yaml"
    job.write_text(f"""\
name: mn-tiers
run_dir: run
entrypoint:
  module: train_entry
  args: [--steps, "{steps}", --n-embd, "32", --device, cpu, --test-sleep-per-step, "0.05"]
nnodes: "2"
nproc_per_node: 1
rdzv: {{endpoint: "127.0.0.1:{port}", conf: {{last_call_timeout: 3}}}}
checkpoint: {{interval_steps: {interval}, keep: 3, local_dir: "local/{{node}}"}}
restart: {{backoff_s: 0.5}}
heartbeat: {{timeout_s: 30, startup_timeout_s: 180}}
collective_timeout_s: 60
stop_timeout_s: 15
""")
    return job


def test_two_nodes_resume_from_their_own_local_tiers_and_assemble_the_durable_checkpoint(tmp_path):
    job = job_file(tmp_path, free_port())
    nodes = []
    try:
        # One loopback address per node: the rendezvous numbers nodes by address, so each keeps its rank
        # across the restart (on one host with a shared address the agents' pids would decide).
        for i, name in enumerate(("a", "b")):
            nodes.append(Proc(resilient("run", job, "--node", name, "--set", f"rdzv.local_addr=127.0.0.{i + 1}"),
                              tmp_path, log=tmp_path / f"{name}.log"))
        b_state = tmp_path / "run" / "nodes" / "b" / "state.json"

        def b_rank():
            try:
                doc = json.loads(b_state.read_text())
            except (OSError, ValueError):
                return None
            return next((r for r in doc.get("ranks", []) if r.get("alive") and r.get("phase") == "train"
                         and r.get("step", 0) >= 50), None)

        rank = wait_for(b_rank, 180, "node b's rank training past step 50")
        psutil.Process(rank["pid"]).kill()
        for n in nodes:
            assert n.wait(300) == 0, n.output()[-3000:]
    finally:
        for n in nodes:
            n.kill_all()
    run_dir = tmp_path / "run"
    held = {}
    for name in ("a", "b"):
        doc = json.loads((run_dir / "nodes" / name / "state.json").read_text())
        resumed = doc["history"][-1]
        assert resumed["resumed_tier"] == "local", resumed
        step = resumed["resumed_from_step"]
        why = f"every node holds step {step} whole"
        # A kill inside the next save can leave that step committed on one node's tier only: the why says so.
        behind = f"{why} (the nodes' newest local steps: [{step}, {step + INTERVAL}])"
        assert resumed["resumed_why"] in (why, behind), resumed
        # A node's local tier holds its own rank's shards, not the other's.
        copy = tmp_path / "local" / name / store.step_dirname(100)
        ranks = store.inspect(copy).manifest.extra["ranks"][name]
        held[name] = sorted(p.name for p in copy.glob("__*_0.distcp"))
        assert held[name] == [f"__{r}_0.distcp" for r in ranks], (name, held[name], ranks)
    assert held == {"a": ["__0_0.distcp"], "b": ["__1_0.distcp"]}, held
    durable = run_dir / "checkpoints"
    assert valid_steps(durable) == [60, 80, 100]
    final = durable / store.step_dirname(100)
    assert store.inspect(final, deep=True).valid
    assert sorted(p.name for p in final.glob("__*_0.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(store.inspect(final).manifest.extra["nodes"]) == ["a", "b"]
    assert not (final / ".parts").exists()  # the bookkeeping of the assembly goes once it is published
    # A node's local copy lacks the other node's shards: export names the durable one instead of a DCP traceback.
    out = subprocess.run([sys.executable, "-m", "train_entry.export", str(copy), str(tmp_path / "m.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "export the durable tier's step_000000100" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "m.pt").exists()


def test_two_nodes_behind_a_slow_durable_tier_copy_the_same_newest_steps_and_skip_the_rest(tmp_path):
    """Saves every ~0.6 s; each node's copy of a step takes 2 s (node a) or 0.5 s (node b) more than its bytes (the
    test hook). Each node copies the newest step, or the one the other node has begun, so the durable tier gets
    whole checkpoints with both nodes' shards, the newest last, while steps in between are never copied and the
    local tiers keep only `keep_local`. Copied oldest first, node a would still be copying at the end, one
    save further behind with each save."""
    job = job_file(tmp_path, free_port(), steps=120, interval=10)
    nodes = []
    try:
        for i, (name, pause) in enumerate((("a", "2"), ("b", "0.5"))):
            nodes.append(Proc(resilient("run", job, "--node", name, "--set", f"rdzv.local_addr=127.0.0.{i + 1}"),
                              tmp_path, env=child_env(RESILIENT_TEST_REPLICATE_PAUSE_S=pause),
                              log=tmp_path / f"{name}.log"))
        for n in nodes:
            assert n.wait(300) == 0, n.output()[-3000:]
    finally:
        for n in nodes:
            n.kill_all()
    run_dir, durable = tmp_path / "run", tmp_path / "run" / "checkpoints"
    steps = valid_steps(durable)
    assert steps and steps[-1] == 120, steps
    for step in steps:
        final = store.inspect(durable / store.step_dirname(step), deep=True)
        assert final.valid, (step, final.reason)
        assert sorted(p.name for p in final.path.glob("__*_0.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    reps = {name: json.loads((run_dir / "nodes" / name / "state.json").read_text())["replication"]
            for name in ("a", "b")}
    # 12 saves, ~2.5 s a copy on node a: most were never copied (oldest first, it copied all 12, the last ones
    # while the run waited to exit)
    assert reps["a"]["superseded"] >= 2 and reps["a"]["replicated"] + reps["a"]["superseded"] <= 12, reps["a"]
    assert not list(durable.glob("*.partial"))  # the skipped steps' partials went with the last node's exit
    for name, rep in reps.items():
        assert rep["pending"] == [], (name, rep)
        # Each node left once step 120 was published, whichever node published it: its local tier keeps
        # keep_local (2) steps and its state file has no lag.
        assert rep["newest_durable"] == 120 and rep["lag_steps"] == 0, (name, rep)
        assert valid_steps(tmp_path / "local" / name) == [110, 120], name
