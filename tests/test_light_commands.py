"""inspect-checkpoint, gc and status through the CLI, against real folders written by the store."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor import api, state, store
from supervisor.lock import RunLock
from tests.ckpt_helpers import flip_byte, truncate, write_checkpoint
from tests.proc import REPO, wait_for

INSPECT_FIELDS = {"step", "path", "status", "reason", "size_bytes", "files", "world_size", "created_at"}


def test_inspect_json_contract_and_statuses(zoo, cli):
    r = cli("inspect-checkpoint", zoo, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {"root", "latest_valid_step", "checkpoints"} <= set(doc)
    assert doc["latest_valid_step"] == 40 and doc["root"] == str(zoo)
    by_step = {(c["step"], c["partial"]): c for c in doc["checkpoints"]}
    for c in doc["checkpoints"]:
        assert set(c) >= INSPECT_FIELDS
    assert by_step[(10, False)]["world_size"] == 2 and by_step[(10, False)]["files"] == 3
    assert [by_step[(s, False)]["status"] for s in (10, 20, 30, 40, 50, 60)] == [
        "valid", "corrupt", "corrupt", "valid", "corrupt", "corrupt"]
    assert by_step[(70, True)]["status"] == "incomplete"


def test_inspect_verify_finds_the_flipped_byte(zoo, cli):
    doc = json.loads(cli("inspect-checkpoint", zoo, "--verify", "--json").stdout)
    assert doc["latest_valid_step"] == 10
    s40 = next(c for c in doc["checkpoints"] if c["step"] == 40)
    assert s40["status"] == "corrupt" and "checksum mismatch" in s40["reason"]


def test_inspect_exit_codes_follow_the_contract(zoo, cli, tmp_path):
    assert cli("inspect-checkpoint", zoo, "--step", "40").exit_code == 0
    assert cli("inspect-checkpoint", zoo, "--step", "40", "--verify").exit_code == 1
    assert cli("inspect-checkpoint", zoo, "--step", "30").exit_code == 1
    assert cli("inspect-checkpoint", zoo / "step_000000010").exit_code == 0
    assert cli("inspect-checkpoint", zoo / "step_000000050").exit_code == 1
    r = cli("inspect-checkpoint", zoo, "--step", "999")
    assert r.exit_code == 1 and "no checkpoint for step 999" in r.stderr  # the contract: selected one not valid
    for step in ("-1", "1000000000"):  # no checkpoint can have it: a usage error (audit 6: exit 1)
        r = cli("inspect-checkpoint", zoo, "--step", step)
        assert r.exit_code == 2 and f"--step {step}: a checkpoint's step is 0 to 999999999" in r.stderr, r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("inspect-checkpoint", empty).exit_code == 2  # no run, no checkpoints: like status and gc
    assert cli("inspect-checkpoint", tmp_path / "missing").exit_code == 2


def test_inspect_table_names_each_reason(zoo, cli):
    r = cli("inspect-checkpoint", zoo)
    assert "latest valid: step 40" in r.stdout
    for words in ("no completion marker", "(truncated)", "not valid JSON", "unlisted file notes.txt",
                  "partial save, never committed"):
        assert words in r.stdout, words


def test_inspect_names_what_it_passes_over_that_looks_like_a_checkpoint(tmp_path, cli):
    root = tmp_path / "ckpt"
    real = write_checkpoint(root, 10)
    shutil.copytree(real, root / "step_5")                       # copied in by hand under a short name
    (root / "step_000000020").symlink_to(real)                   # a link is never followed
    (root / "step_000000030").write_text("x")                    # a file
    r = cli("inspect-checkpoint", root)
    assert r.exit_code == 0 and "latest valid: step 10" in r.stdout, r.output
    for name, why in (("step_5", "not a checkpoint name"), ("step_000000020", "a link"),
                      ("step_000000030", "not a folder")):
        assert f"passed over: {root / name} ({why}" in r.stdout, r.stdout
    doc = json.loads(cli("inspect-checkpoint", root, "--json").stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [10]
    assert [p["name"] for p in doc["passed_over"]] == ["step_000000020", "step_000000030", "step_5"]


def test_gc_keep_1_keeps_newest_valid_even_with_newer_invalid(zoo, cli):
    dry = json.loads(cli("gc", zoo, "--keep", "1", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and dry["kept"] == [40]
    assert len(os.listdir(zoo)) == 8, "--dry-run deletes nothing"
    r = cli("gc", zoo, "--keep", "1", "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["kept"] == [40] and not doc["dry_run"]
    assert {x.get("step") for x in doc["removed"]} == {10, 20, 30, 35, 70}
    assert {x["step"] for x in doc["spared"]} == {50, 60}  # damaged, newer than the newest valid (audit 15)
    assert doc["freed_bytes"] == dry["freed_bytes"] > 0
    assert sorted(os.listdir(zoo)) == ["step_000000040", "step_000000050", "step_000000060"]


def test_gc_keeps_n_newest_valid_and_prints_what_it_freed(tmp_path, cli):
    for s in (1, 2, 3, 4):
        write_checkpoint(tmp_path, s)
    truncate(write_checkpoint(tmp_path, 2) / "__0_0.distcp")  # damaged, older than the newest valid: goes
    truncate(write_checkpoint(tmp_path, 5) / "__0_0.distcp")  # newer: the run's newest state, kept (audit 15)
    r = cli("gc", tmp_path, "--keep", "2")
    assert r.exit_code == 0
    assert "removed step 1" in r.stdout and "removed step 2" in r.stdout and "freed" in r.stdout
    assert "kept step_000000005: corrupt" in r.stdout, r.stdout
    assert sorted(os.listdir(tmp_path)) == ["step_000000003", "step_000000004", "step_000000005"]


def test_gc_usage_errors(tmp_path, cli):
    write_checkpoint(tmp_path, 1)
    r = cli("gc", tmp_path, "--keep", "0")
    assert r.exit_code == 2 and "--keep 0" in r.stderr
    assert (tmp_path / "step_000000001").exists()
    r = cli("gc", tmp_path / "missing", "--keep", "1")
    assert r.exit_code == 2 and "no such file or folder" in r.stderr
    r = cli("gc", tmp_path / "missing", "--keep", "1", "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["exit_code"] == 2
    r = cli("gc", tmp_path, "--json")  # JSON mode: the error as JSON on stdout, like every failure
    assert r.exit_code == 2 and "needs --keep N" in json.loads(r.stdout)["error"]
    assert (tmp_path / "step_000000001").exists()


def test_gc_spares_partials_of_a_live_run(tmp_path, cli):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    write_checkpoint(root, 1)
    write_checkpoint(root, 2, commit=False)  # abandoned by its writer...
    (run_dir / "job.json").write_text(json.dumps({"job": {"checkpoint": {"dir": str(root)}}}))
    with RunLock(run_dir):  # ...but a supervisor holds the run dir: it may relaunch and own it
        doc = json.loads(cli("gc", root, "--keep", "1", "--json").stdout)
        assert doc["removed"] == [] and doc["spared"][0]["step"] == 2
    doc = json.loads(cli("gc", root, "--keep", "1", "--json").stdout)
    assert [x["step"] for x in doc["removed"]] == [2]


def _state_file(run_dir, **kw):
    kw.setdefault("supervisor", {"pid": 2**22 - 1, "host": socket.gethostname()})  # as a supervisor of this host's
    rec = state.RunRecord(name="tiny", run_dir=str(run_dir), checkpoint_dir=str(run_dir / "checkpoints"),
                          max_restarts=10, **kw)
    rec.history.append(state.AttemptRecord(attempt=0, started_at=time.time() - 30, resumed_from_step=None,
                                           ended_at=time.time() - 20, reason="worker_signal",
                                           detail="rank 1 killed by SIGKILL", failed_rank=1, step_at_failure=57))
    rec.ranks = [{"rank": 0, "pid": 123, "step": 60, "heartbeat_at": time.time() - 1, "alive": True}]
    state.write(run_dir / "state.json", rec)
    return rec


STATUS_FIELDS = {"name", "run_dir", "state", "attempt", "restarts", "step", "last_checkpoint_step", "ranks",
                 "history", "goodput"}
HISTORY_FIELDS = {"attempt", "started_at", "ended_at", "reason", "failed_rank", "step_at_failure",
                  "resumed_from_step"}
RANK_FIELDS = {"rank", "pid", "step", "heartbeat_age_s", "alive"}


def test_status_json_contract(tmp_path, cli):
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60, last_checkpoint_step=60, goodput=0.8)
    r = cli("status", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= STATUS_FIELDS
    assert set(doc["history"][0]) >= HISTORY_FIELDS and set(doc["ranks"][0]) >= RANK_FIELDS
    assert doc["state"] == "succeeded" and doc["history"][0]["reason"] == "worker_signal"
    assert doc["ranks"][0]["alive"] is False  # no supervisor holds the run dir


def test_paths_names_and_reasons_print_as_written_never_as_markup_or_emoji(tmp_path, cli):
    run_dir = tmp_path / "exp[red]1 run:ok:x"
    run_dir.mkdir()
    _state_file(run_dir, state=state.RunState.SUCCEEDED, step=60, last_checkpoint_step=10, goodput=0.8)
    write_checkpoint(run_dir / "checkpoints", 10)
    flip_byte(write_checkpoint(run_dir / "checkpoints", 20) / ".metadata", 3)
    r = cli("inspect-checkpoint", run_dir)
    assert f"{run_dir / 'checkpoints'} — latest valid: step 10" in r.stdout, r.stdout
    assert ".metadata checksum mismatch" in r.stdout and "🆗" not in r.stdout
    r = cli("status", run_dir)
    assert f"run dir   {run_dir} · supervisor pid" in r.stdout, r.stdout
    assert "rank 1 killed by SIGKILL" in r.stdout and "🆗" not in r.stdout


def test_status_plot_to_a_folder_or_into_a_missing_folder_is_one_sentence_and_creates_nothing(tmp_path, cli):
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60, last_checkpoint_step=60, goodput=0.8)
    for plot, words in ((tmp_path, "that is a folder"), (tmp_path / "nowhere" / "t.png", "does not exist")):
        r = cli("status", tmp_path, "--plot", plot)
        assert r.exit_code == 2 and words in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "nowhere").exists()


def test_status_plot_never_writes_over_the_run_it_reads(tmp_path, cli):
    """Audit 6: `--plot` into the newest checkpoint's folder made it corrupt (gc would then delete it); over
    state.json or a marker it destroyed them. Only a file that is a PNG already may be replaced."""
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60, last_checkpoint_step=60, goodput=0.8)
    newest = write_checkpoint(tmp_path / "checkpoints", 60)
    before = {p: p.read_bytes() for p in [tmp_path / "state.json", *newest.iterdir()]}
    for plot, words in ((newest / "plot.png", "inside the run's checkpoint root"),
                        (tmp_path / "checkpoints" / "plot.png", "inside the run's checkpoint root"),
                        (newest / store.MARKER, "inside the run's checkpoint root"),
                        (tmp_path / "state.json", "exists and is not a PNG")):
        r = cli("status", tmp_path, "--plot", plot)
        assert r.exit_code == 2 and words in r.stderr and "Traceback" not in r.output, r.output
    assert {p: p.read_bytes() for p in before} == before and not (newest / "plot.png").exists()
    assert store.inspect(newest).valid


def test_light_commands_through_a_job_file_whose_script_moved_since_the_run(tmp_path, cli):
    """Audit 6: status, inspect-checkpoint, gc and logs refused the job file over its missing entry script, which
    none of them runs; run still refuses it, with the line."""
    job = tmp_path / "job.yaml"
    job.write_text("name: tiny\nentrypoint: {script: moved_away.py}\nrun_dir: run\n")
    _state_file(tmp_path / "run", state=state.RunState.SUCCEEDED, step=60, last_checkpoint_step=60)
    write_checkpoint(tmp_path / "run" / "checkpoints", 60)
    for command in (["status"], ["inspect-checkpoint"], ["gc", "--keep", "1", "--dry-run"]):
        r = cli(*command[:1], job, *command[1:])
        assert r.exit_code == 0 and "moved_away" not in r.output, (command, r.output)
    r = cli("run", job)
    assert r.exit_code == 2 and "job.yaml:2: entrypoint.script 'moved_away.py' does not exist" in r.stderr, r.output


def test_a_state_file_that_is_a_link_is_named_as_one_not_as_another_versions(tmp_path, cli):
    """Audit 6: "cannot be read (Too many levels of symbolic links); was it written by a newer resilient?"."""
    _state_file(tmp_path / "elsewhere", state=state.RunState.SUCCEEDED, step=60)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").symlink_to(tmp_path / "elsewhere" / "state.json")
    r = cli("status", tmp_path / "run")
    assert r.exit_code == 2 and "it is a link, which resilient does not follow" in r.stderr, r.output
    assert "newer resilient" not in r.stderr


def test_a_checkpoint_root_inside_the_run_dir_that_is_a_file_is_one_sentence_not_no_checkpoints_yet(tmp_path, cli):
    """Audit 6: inspect-checkpoint said "no checkpoints yet" (exit 1) and gc exited 0; outside the run dir: exit 2."""
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60)
    (tmp_path / "checkpoints").write_text("not a folder")
    for command in (["inspect-checkpoint"], ["gc", "--keep", "1"]):
        r = cli(command[0], tmp_path, *command[1:])
        assert r.exit_code == 2 and "checkpoints is not a folder, yet it is where" in r.stderr, r.output
    assert (tmp_path / "checkpoints").read_text() == "not a folder"


def test_status_of_a_run_whose_supervisor_died_says_stopped(tmp_path, cli):
    _state_file(tmp_path, state=state.RunState.RUNNING)
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert doc["state"] == "stopped" and doc["recorded_state"] == "running" and not doc["supervisor_alive"]
    with RunLock(tmp_path):
        doc = json.loads(cli("status", tmp_path, "--json").stdout)
        assert doc["state"] == "running" and doc["supervisor_alive"]
    text = cli("status", tmp_path).stdout
    assert "tiny" in text and "worker_signal" in text and "rank 1 killed by SIGKILL" in text


def test_status_notes_a_rank_past_its_hang_limit_before_the_supervisor_judges_it(tmp_path, cli):
    """Audit 16: a rank 20.6 s silent against a 20 s limit had an empty NOTE; an exited rank's limit beside its
    growing heartbeat age was noise."""
    rec = _state_file(tmp_path, state=state.RunState.RUNNING)
    now = time.time()
    rec.ranks = [{"rank": 0, "pid": 123, "step": 60, "phase": "train", "heartbeat_at": now - 30, "hang_limit_s": 20.0,
                  "heartbeat_age_s": 30.0, "alive": True},
                 {"rank": 1, "pid": 124, "step": 60, "phase": "exited", "heartbeat_at": now - 30, "hang_limit_s": 20.0,
                  "alive": False}]
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        rows = [line.split() for line in cli("status", tmp_path).stdout.splitlines() if line.split()[:1] == ["-"]]
    assert rows[0][-4:] == ["silent", "30.0s", "(limit", "20.0s)"], rows
    assert rows[1][7:9] == ["-", "no"], rows  # HUNG AFTER, ALIVE of the exited rank (after "30.1s ago")
    rec.state = state.RunState.RESTARTING  # review 14: a backoff's ranks, judged and gone, turned red
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        assert "silent" not in cli("status", tmp_path).stdout
    # Audit 17: its supervisor not writing (stopped): the rank's own beat file, aged here, where the supervisor's
    # view froze (review 15: a beat file that is fresh is no note, however old the record)
    from supervisor.protocol import Heartbeat, write_heartbeat

    rec.state = state.RunState.RUNNING
    rec.ranks[0].update(pid=os.getpid(), started_at=now - 60, heartbeat_age_s=1.0, heartbeat_at=now - 120)
    state.write(tmp_path / "state.json", rec)
    doc = json.loads((tmp_path / "state.json").read_text())
    (tmp_path / "state.json").write_text(json.dumps({**doc, "updated_at": now - 120}))
    beats = tmp_path / "heartbeats" / f"attempt_{rec.attempt}"
    beats.mkdir(parents=True)
    for beat_at, says in ((now - 2, None), (now - 30, r"silent 30\.\ds \(limit 20\.0s\), and nothing watches it")):
        write_heartbeat(beats, Heartbeat(rank=0, pid=os.getpid(), phase="train", step=70, time=beat_at))
        with RunLock(tmp_path):
            text = " ".join(cli("status", tmp_path).stdout.split())
        assert (re.search(says, text) if says else "silent" not in text), text


def test_status_during_a_graceful_stop_says_so(tmp_path, cli):
    """Audit 17: for the stop's grace (up to 11 s) text and JSON said a plain `running`."""
    said = "SIGTERM at 03:20:01: the ranks checkpoint their step and exit, 20s at most"
    _state_file(tmp_path, state=state.RunState.RUNNING, stopping=said)
    with RunLock(tmp_path):
        assert f"stopping {said}" in " ".join(cli("status", tmp_path).stdout.split())
        assert json.loads(cli("status", tmp_path, "--json").stdout)["stopping"] == said
    # review 15: its supervisor killed during the stop (Slurm's KillWait), no stop is under way
    assert json.loads(cli("status", tmp_path, "--json").stdout)["stopping"] is None


def test_logs_of_a_run_dir_whose_logs_folder_is_a_link_says_so(tmp_path, cli):
    """Audit 15: "no attempt has started yet", of a run whose logs/ had become a link (not followed)."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (elsewhere / "attempt_1").mkdir(parents=True)
    _state_file(run_dir, state=state.RunState.SUCCEEDED)
    (run_dir / "logs").symlink_to(elsewhere)
    r = cli("logs", run_dir)
    assert r.exit_code == 2 and r.stderr.strip() == (f"resilient: {run_dir / 'logs'} is a link, which resilient does "
                                                     "not follow out of a run dir; put the logs folder itself back "
                                                     "there."), r.output


def test_status_in_a_restarts_backoff_says_when_the_next_attempt_launches(tmp_path, cli):
    """Audit 16: `restarting`, and nothing to tell a 15 s backoff from a stuck supervisor."""
    _state_file(tmp_path, state=state.RunState.RESTARTING, attempt=1, next_launch_at=time.time() + 12.4)
    with RunLock(tmp_path):
        doc = json.loads(cli("status", tmp_path, "--json").stdout)
        assert doc["state"] == "restarting" and doc["next_launch_at"] == pytest.approx(time.time() + 12.4, abs=5)
        text = " ".join(cli("status", tmp_path).stdout.split())
        assert re.search(r"restart attempt 2 launches in 1[0-2]s \(the backoff after attempt 1\)", text), text
    doc = json.loads(cli("status", tmp_path, "--json").stdout)  # its supervisor gone: no launch is coming
    assert doc["state"] == "stopped" and doc["next_launch_at"] is None


def test_status_of_a_dead_supervisors_run_charges_the_steps_beyond_the_newest_checkpoint_as_lost(tmp_path, cli):
    """Audit 16: "lost 0 steps" at step 163 with checkpoint 100 once the supervisor was SIGKILLed; 63 after the
    rerun. Shown as the rerun will book it, as for any run that stops."""
    from supervisor.goodput import Accounting

    acc = Accounting()
    acc.start_session(1000.0)
    acc.launch(1, 1000.0, None)
    for s in range(1, 164):
        acc.step(s, 1001.0 + 0.1 * s)
        if s == 100:
            acc.save(s, 0.0)
    write_checkpoint(tmp_path / "checkpoints", 100)
    rec = _state_file(tmp_path, state=state.RunState.RUNNING, step=163, last_checkpoint_step=100, attempt=1)
    rec.history = [state.AttemptRecord(attempt=1, started_at=1000.0, resumed_from_step=None)]
    rec.accounting = {"summary": acc.summary(1018.0), "ledger": acc.to_dict()}
    state.write(tmp_path / "state.json", rec)
    assert json.loads((tmp_path / "state.json").read_text())["accounting"]["summary"]["lost_steps"] == 0
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert doc["state"] == "stopped" and doc["accounting"]["summary"]["lost_steps"] == 63, doc["accounting"]


def test_status_of_a_dead_supervisors_run_shows_its_ranks_that_still_run_as_alive(tmp_path):
    """Audit 16: with the supervisor SIGKILLed, every rank showed ALIVE `no`, a stopped orphan still running among them.
    A rank is asked again on its own machine; a pid another process took since (created after the rank started) is
    not the rank."""
    import socket
    import subprocess
    import time

    from supervisor.commands.status import NodeStatus
    from supervisor.state import RunRecord

    gone = subprocess.Popen(["true"])
    gone.wait()
    now = time.time()
    rec = RunRecord(name="tiny", run_dir=".", checkpoint_dir="checkpoints",
                    supervisor={"pid": 1, "host": socket.gethostname()},
                    ranks=[{"rank": 0, "pid": os.getpid(), "started_at": now, "alive": True},
                           {"rank": 1, "pid": gone.pid, "started_at": now, "alive": True},
                           {"rank": 2, "pid": os.getpid(), "started_at": now - 10 ** 7, "alive": True}])
    node = NodeStatus(rec, tmp_path, supervisor_alive=False)
    assert [r["alive"] for r in node.ranks(now)] == [True, False, False]
    rec.supervisor["host"] = "another-host"  # another machine's pids are not this one's
    assert [r["alive"] for r in node.ranks(now)] == [False, False, False]


def test_status_of_a_killed_supervisors_tiered_run_counts_the_stop_checkpoint_its_ranks_left_locally(tmp_path, cli):
    """kill -9 of the supervisor: its ranks commit their stop checkpoint to the local tier. status said the older
    step the dead supervisor last wrote, while a rerun resumes from the local one."""
    from supervisor.state import ReplicationState

    for step in (740, 750):
        write_checkpoint(tmp_path / "checkpoints", step)
    for step in (750, 760):
        write_checkpoint(tmp_path / "local", step)
    rep = ReplicationState("local", "checkpoints", newest_local=750, newest_local_at=time.time() - 5,
                           newest_durable=750, newest_durable_at=time.time() - 5)
    _state_file(tmp_path, state=state.RunState.RUNNING, step=755, last_checkpoint_step=750,
                replication=rep.to_dict())
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert doc["state"] == "stopped" and doc["last_checkpoint_step"] == 760, doc
    r = doc["replication"]
    assert (r["newest_local"], r["newest_durable"], r["lag_steps"], r["pending"]) == (760, 750, 10, [760]), r
    assert "not copied yet [760]" in cli("status", tmp_path).stdout


def test_status_of_an_ended_tiered_run_gives_the_durable_step_on_disk_not_the_recorded_one(tmp_path, cli):
    """Audit 7: after `gc --verify` removed a corrupt durable step 120, status still said `local step 120 · durable
    step 120 · up to date`."""
    from supervisor.state import ReplicationState

    for step in (100, 120):
        write_checkpoint(tmp_path / "checkpoints", step)
    shutil.rmtree(tmp_path / "checkpoints" / store.step_dirname(120))  # gone since the supervisor last wrote
    rep = ReplicationState(str(tmp_path / "local"), "checkpoints", newest_local=120, newest_local_at=time.time(),
                           newest_durable=120, newest_durable_at=time.time())
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=120, replication=rep.to_dict())
    assert "local step 120 · durable step 100 · lag 20 steps" in cli("status", tmp_path).stdout
    assert json.loads(cli("status", tmp_path, "--json").stdout)["replication"]["newest_durable"] == 100


def test_a_dead_supervisors_tiers_line_is_brought_to_what_both_tiers_hold(tmp_path, cli):
    """Audit 13: after `kill -9` of a node's supervisor, status said `durable step 160 · not copied yet [160, 172]`
    (160 was on disk), and `last valid checkpoint 340` after the local tier holding it was removed."""
    from supervisor.state import ReplicationState

    for step in (140, 160):
        write_checkpoint(tmp_path / "checkpoints", step)
    write_checkpoint(tmp_path / "local", 172)
    rep = ReplicationState(str(tmp_path / "local"), "checkpoints", newest_local=172, newest_local_at=time.time(),
                           newest_durable=140, newest_durable_at=time.time() - 4, pending=[150, 160, 172])
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=172, last_checkpoint_step=172,
                replication=rep.to_dict())
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert (doc["replication"]["newest_durable"], doc["replication"]["pending"]) == (160, [172]), doc["replication"]
    assert "last_checkpoint_problem" not in doc  # 172 is whole in the local tier
    shutil.rmtree(tmp_path / "local" / store.step_dirname(172))  # the node replaced
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert doc["replication"]["pending"] == [] and doc["last_checkpoint_problem"] == "gone; newest valid: 160", doc
    assert "(not valid on disk now: gone; newest valid: 160)" in " ".join(cli("status", tmp_path).stdout.split())
    # The same record written on another machine: a folder of that name here is not its local tier (review 11)
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=172, last_checkpoint_step=172,
                replication=rep.to_dict(), supervisor={"pid": 1, "host": "another-host"})
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert doc["replication"]["pending"] == [172] and "last_checkpoint_problem" not in doc, doc


def test_status_says_which_local_steps_the_durable_tier_never_got(tmp_path, cli):
    """A durable tier slower than the saves: the replicator copied the newest and skipped the rest; status says
    so in the tiers line and in --json."""
    from supervisor.state import ReplicationState

    rep = ReplicationState(str(tmp_path / "local"), "checkpoints", newest_local=140,
                           newest_local_at=time.time(), newest_durable=120, newest_durable_at=time.time() - 4,
                           pending=[140], replicated=3, superseded=2)
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=150, replication=rep.to_dict())
    text = cli("status", tmp_path).stdout
    assert "local step 140 · durable step 120 · lag 20 steps" in text
    # No supervisor runs: nothing is being copied (it said "copying"), and a failure is told in the past.
    assert "not copied yet [140] (`resilient run` again copies it) · 2 not copied (superseded)" in text
    replication = json.loads(cli("status", tmp_path, "--json").stdout)["replication"]
    assert replication["superseded"] == 2 and replication["durable_root"] == str(tmp_path / "checkpoints")  # absolute
    climbing = rep.to_dict() | {"local_root": "../../elsewhere"}  # a hand edit: refused, as by inspect and gc
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=150, replication=climbing)
    r = cli("status", tmp_path)
    assert r.exit_code == 2 and "'../../elsewhere', which leads out of the run dir" in r.stderr, r.output
    rep.failing_since, rep.last_error, rep.pending, rep.deleted_unreplicated = time.time(), "step 140: full", \
        [100, 140], [100]
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=150, replication=rep.to_dict())
    text = cli("status", tmp_path).stdout
    assert "the durable tier was FAILING when the supervisor stopped: step 140: full" in text, text
    assert "not copied yet [140]" in text  # 100 was deleted (the outage limit): not waiting for a copy


def test_status_without_a_run_is_a_clean_message(tmp_path, cli):
    r = cli("status", tmp_path)
    assert r.exit_code == 2 and "no run and no checkpoints here" in r.stderr and "Traceback" not in r.output
    write_checkpoint(tmp_path / "root", 1)
    r = cli("status", tmp_path / "root")
    assert r.exit_code == 2 and "no run here (no state file)" in r.stderr
    (tmp_path / "state.json").write_text('{"schema_version": 99}')
    r = cli("status", tmp_path)
    assert r.exit_code == 2 and "schema_version 99" in r.stderr


def test_version(cli):
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout.startswith("resilient ")


def test_a_ctrl_c_while_the_cli_is_still_importing_is_exit_130_without_a_traceback():
    """The first ~0.1 s of `resilient run` are typer's and rich's imports: a Ctrl-C there printed ~20 lines of
    traceback (audit). The interrupt is made to land inside those imports, as it did."""
    script = ("import builtins, sys\n"
              "real = builtins.__import__\n"
              "def interrupted(name, *a, **k):\n"
              "    if name == 'rich.console':\n"
              "        raise KeyboardInterrupt\n"
              "    return real(name, *a, **k)\n"
              "builtins.__import__ = interrupted\n"
              "sys.argv = ['resilient', 'status']\n"
              "from supervisor.entry import main\n"
              "main()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 130 and out.stderr == "" and out.stdout == "", out


def test_importing_the_cli_does_not_import_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import supervisor.cli"],
                         capture_output=True, text=True, check=True, timeout=60)
    modules = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "typer" in modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}


def test_light_commands_never_import_torch(zoo, tmp_path):
    _state_file(tmp_path, state=state.RunState.SUCCEEDED)
    rank0 = tmp_path / "logs/attempt_0/ranks/r_x/attempt_0/0"
    rank0.mkdir(parents=True)
    (rank0 / "stdout.log").write_text("step 1\n")
    code = (
        "import sys\nfrom supervisor.cli import app\n"
        "codes = []\n"
        "for argv in sys.argv[1:]:\n"
        "    try: app(argv.split('|'))\n"
        "    except SystemExit as e: codes.append(e.code)\n"
        "assert codes == [0] * len(sys.argv[1:]), f'exit codes {codes}'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    runs = [f"status|{tmp_path}|--json", f"inspect-checkpoint|{zoo}|--verify|--json",
            f"gc|{zoo}|--keep|2|--dry-run|--json", f"logs|{tmp_path}|--follow"]
    out = subprocess.run([sys.executable, "-c", code, *runs], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[rank 0 out] step 1" in out.stdout, "logs ran"


def test_flip_byte_helper_changes_exactly_one_byte(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"\0" * 200)
    flip_byte(p)
    assert p.read_bytes().count(b"\xff") == 1


def test_status_watch_returns_when_the_run_is_over(tmp_path, cli):
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60)
    r = cli("status", tmp_path, "--watch")
    assert r.exit_code == 0 and "tiny" in r.stdout and "succeeded" in r.stdout


@pytest.mark.parametrize("as_json", [True, False])
def test_status_watch_into_a_pipe_prints_a_snapshot_each_second_until_the_run_ends(tmp_path, cli, as_json):
    """rich's live view draws nothing into a file or pipe until the end (a reviewer's file stayed empty for the
    whole run); --watch --json ignored --watch."""
    import threading

    _state_file(tmp_path, state=state.RunState.RUNNING, step=10)
    with RunLock(tmp_path):
        ends = threading.Timer(1.5, lambda: _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60))
        ends.start()
        try:
            r = cli("status", tmp_path, "--watch", *(["--json"] if as_json else []))
        finally:
            ends.join()
    assert r.exit_code == 0, r.output
    if as_json:
        states = [json.loads(line)["state"] for line in r.stdout.splitlines()]
        assert states[0] == "running" and states[-1] == "succeeded" and len(states) >= 2, states
    else:
        assert r.stdout.count("tiny — running") >= 1 and r.stdout.count("tiny — succeeded") == 1, r.stdout


def test_status_watch_goes_on_while_any_node_runs_when_another_nodes_supervisor_died(tmp_path, cli):
    """Audit 18: node b's supervisor was killed just after it wrote its record, the last written; `--watch --json`
    judged the run by that node and exited 0 at once, while node a relaunched and the run went on."""
    import threading

    def node(name: str, run_state: state.RunState) -> None:
        rec = state.RunRecord(name="tiny", run_dir=".", checkpoint_dir="checkpoints", node=name, state=run_state,
                              supervisor={"pid": 2**22 - 1, "host": socket.gethostname()})
        state.write(tmp_path / "nodes" / name / "state.json", rec)

    node("a", state.RunState.RUNNING)
    with RunLock(tmp_path / "nodes" / "a"):
        node("b", state.RunState.RUNNING)  # written last; its supervisor is gone (no lock held)
        ends = threading.Timer(1.5, lambda: node("a", state.RunState.SUCCEEDED))
        ends.start()
        try:
            r = cli("status", tmp_path, "--watch", "--json")
        finally:
            ends.join()
    assert r.exit_code == 0, r.output
    states = [json.loads(line)["state"] for line in r.stdout.splitlines()]
    assert states[0] == "running" and len(states) >= 2 and states[-1] != "running", states


def test_inspect_and_gc_show_and_act_on_both_tiers(tmp_path, cli):
    """A run dir whose nodes keep local tiers: node a's inside the run dir (recorded relative to it), node b's
    outside (recorded as it is). inspect gives each tier a column; gc applies keep and keep_local, and never
    deletes a local checkpoint the durable tier lacks."""
    run_dir, nvme_b = tmp_path / "run", tmp_path / "nvme-b"
    durable, local_a = run_dir / "checkpoints", run_dir / "local" / "a"
    for step in (20, 40):
        write_checkpoint(durable, step)
    write_checkpoint(durable, 60, commit=False)  # being replicated
    for step in (20, 40, 60):
        write_checkpoint(local_a, step)
        write_checkpoint(nvme_b, step)
    write_checkpoint(local_a, 50)  # never replicated
    flip_byte(nvme_b / "step_000000060" / ".metadata", 2)
    for node, root in (("a", "local/a"), ("b", str(nvme_b))):
        rec = state.RunRecord(name="tiers", run_dir=".", checkpoint_dir="checkpoints", node=node,
                              state=state.RunState.SUCCEEDED,
                              replication={"local_root": root, "durable_root": "checkpoints"})
        (run_dir / "nodes" / node).mkdir(parents=True)
        state.write(run_dir / "nodes" / node / "state.json", rec)

    r = cli("inspect-checkpoint", run_dir)
    assert r.exit_code == 0, r.output
    head = next(line for line in r.stdout.splitlines() if "STEP" in line).split()
    assert head[:4] == ["STEP", "DURABLE", "LOCAL:a", "LOCAL:b"], head
    rows = {line.split()[0]: line.split()[1:4] for line in r.stdout.splitlines() if line.split()[:1] in
            (["20"], ["40"], ["50"], ["60"])}
    assert rows == {"20": ["valid"] * 3, "40": ["valid"] * 3, "50": ["-", "valid", "-"],
                    "60": ["incomplete", "(partial)", "valid"]}, rows
    assert f"local tier of node b: {nvme_b}" in r.stdout  # a tier outside the run dir is named
    doc = json.loads(cli("inspect-checkpoint", run_dir, "--json").stdout)
    assert [c["tier"] for c in doc["checkpoints"]] == ["durable"] * 3
    tiers = {t["node"]: t for t in doc["local_tiers"]}
    assert tiers["a"]["root"] == str(local_a) and tiers["b"]["latest_valid_step"] == 40
    assert [c["status"] for c in tiers["b"]["checkpoints"]] == ["valid", "valid", "corrupt"]

    # A copy of the run dir sees its own copy of node a's tier, and node b's outside one as recorded.
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    doc = json.loads(cli("inspect-checkpoint", copy, "--json").stdout)
    assert {t["node"]: t["root"] for t in doc["local_tiers"]} == {"a": str(copy / "local" / "a"), "b": str(nvme_b)}

    doc = json.loads(cli("gc", run_dir, "--keep", "1", "--keep-local", "1", "--json").stdout)
    assert doc["kept"] == [40] and sorted(x["step"] for x in doc["removed"]) == [20, 60]  # 60: an abandoned partial
    local = {t["node"]: t for t in doc["local_tiers"]}
    assert sorted(x["step"] for x in local["a"]["removed"]) == [20, 40]
    # no supervisor runs: the reason names what copies it (audit 13: "the supervisor is still copying it")
    assert [(x["step"], x["why"]) for x in local["a"]["spared"]] == [
        (50, "no durable copy yet: `resilient run` again copies the newest such step")]
    # b's 60 is corrupt, newer than its newest valid 40: kept to look at, as in the durable tier (audit 15)
    assert sorted(x["step"] for x in local["b"]["removed"]) == [20]
    assert [x["step"] for x in local["b"]["spared"]] == [60]
    assert sorted(p.name for p in local_a.iterdir()) == ["step_000000050", "step_000000060"]
    assert sorted(p.name for p in nvme_b.iterdir()) == ["step_000000040", "step_000000060"]


def test_inspect_exits_0_when_only_a_local_tier_holds_what_a_run_resumes_from(tmp_path, cli):
    """The durable tier has no whole checkpoint yet (a copy cut short), the local tier has one: the next run resumes
    from it, and inspect said "no valid checkpoint" with exit 1."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / "checkpoints", 60, commit=False)
    write_checkpoint(run_dir / "local", 60)
    rec = state.RunRecord(name="tiers", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.SUCCEEDED,
                          replication={"local_root": "local", "durable_root": "checkpoints"})
    state.write(run_dir / "state.json", rec)
    r = cli("inspect-checkpoint", run_dir)
    assert r.exit_code == 0 and "no valid checkpoint yet; local tier: step 60" in r.stdout, r.output
    # A second node without step 60: no relaunch takes it from the local tiers.
    rec.node, rec.replication = "b", {"local_root": "local-b", "durable_root": "checkpoints"}
    (run_dir / "nodes" / "b").mkdir(parents=True)
    state.write(run_dir / "nodes" / "b" / "state.json", rec)
    write_checkpoint(run_dir / "local-b", 40)
    assert cli("inspect-checkpoint", run_dir).exit_code == 1


def test_inspect_step_looks_in_every_tier_and_names_a_local_tier_that_is_not_there(tmp_path, cli):
    """--step N said "no checkpoint for step N" (exit 1) for a step only the local tiers held, and named the durable
    root, whose listing shows no local tier; a node's local tier that was gone was left out without a word (audit)."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / "checkpoints", 100)
    flip_byte(write_checkpoint(run_dir / "checkpoints", 150) / ".metadata", 3)
    for node in ("a", "b"):
        for step in (150, 200):
            write_checkpoint(run_dir / "local" / node, step)
        rec = state.RunRecord(name="tiers", run_dir=".", checkpoint_dir="checkpoints", node=node,
                              state=state.RunState.SUCCEEDED,
                              replication={"local_root": f"local/{node}", "durable_root": "checkpoints"})
        (run_dir / "nodes" / node).mkdir(parents=True)
        state.write(run_dir / "nodes" / node / "state.json", rec)
    r = cli("inspect-checkpoint", run_dir, "--step", "200")
    assert r.exit_code == 0 and "step 200: valid in every node's local tier (no durable copy)" in r.stdout, r.output
    r = cli("inspect-checkpoint", run_dir, "--step", "150", "--verify")  # the durable copy is corrupt, not the local
    assert r.exit_code == 0 and "step 150: corrupt" in r.stdout, r.output
    r = cli("inspect-checkpoint", run_dir, "--step", "175")
    assert r.exit_code == 1 and r.stderr == (f"resilient: {run_dir}: no checkpoint for step 175 in any tier; "
                                             f"`resilient inspect-checkpoint {run_dir}` lists them.\n"), r.stderr
    shutil.rmtree(run_dir / "local" / "a")                        # node a replaced: its tier is gone
    r = cli("inspect-checkpoint", run_dir, "--step", "200")
    assert r.exit_code == 1 and "step 200: not valid in every node's local tier" in r.stdout, r.output
    assert f"local tier of node a: {run_dir / 'local' / 'a'} — not on this machine" in r.stdout, r.stdout
    doc = json.loads(cli("inspect-checkpoint", run_dir, "--json").stdout)
    assert [(t["node"], t["missing"]) for t in doc["local_tiers"]] == [("b", False), ("a", True)]
    assert doc["latest_valid_step"] == 100
    r = cli("gc", run_dir, "--keep", "1", "--dry-run")
    assert r.exit_code == 0 and f"local tier of node a: {run_dir / 'local' / 'a'} — not on this machine" in r.stdout


def test_gc_deletes_a_finished_runs_spare_files_and_leaves_a_live_runs(tmp_path, cli):
    """The data files a run kept to write its next saves over (store.keep_spare) are the run's while it lives;
    after it, they are only memory taken (a local tier on tmpfs): gc frees them and says what they were."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    write_checkpoint(root, 1)
    (root / store.SPARE_DIR).mkdir()
    (root / store.SPARE_DIR / "__0_0.distcp.1").write_bytes(bytes(8192))
    (run_dir / "job.json").write_text(json.dumps({"job": {"checkpoint": {"dir": str(root)}}}))
    with RunLock(run_dir):
        doc = json.loads(cli("gc", root, "--keep", "1", "--json").stdout)
        assert doc["removed"] == [] and (root / store.SPARE_DIR).is_dir()
    doc = json.loads(cli("gc", root, "--keep", "1", "--json").stdout)
    assert [(Path(x["path"]).name, x["size_bytes"]) for x in doc["removed"]] == [(store.SPARE_DIR, 8192)]
    assert "deleted checkpoints" in doc["removed"][0]["why"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000000001"]


def test_gc_waits_for_the_replication_lock_and_removes_nothing_while_a_node_holds_it(tmp_path, cli, monkeypatch):
    """A durable tier the nodes' supervisors replicate into: gc judges and deletes only while it holds their
    lock (a node entering a partial gc found unheld, or a publish that has dropped the partial's writer lock,
    would otherwise lose its folder). While a node holds it, gc waits, then says so and removes nothing."""
    import fcntl

    from supervisor.commands import gc
    from supervisor.replicate import ROOT_LOCK

    for s in (1, 2, 3):
        write_checkpoint(tmp_path, s)
    monkeypatch.setattr(gc, "LOCK_WAIT_S", 0.3)
    fd = os.open(tmp_path / ROOT_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a node inside its entry into a partial
        r = cli("gc", tmp_path, "--keep", "1")
        assert r.exit_code == 1 and "replication lock" in r.stderr and "nothing was removed" in r.stderr
        assert len([n for n in os.listdir(tmp_path) if n.startswith("step_")]) == 3
    finally:
        os.close(fd)
    r = cli("gc", tmp_path, "--keep", "1")
    assert r.exit_code == 0 and sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_000000003"]


def test_logs_follow_ends_when_the_state_file_is_gone_and_no_supervisor_holds_the_run(tmp_path):
    """A run dir deleted under `logs --follow` (or a state file another version wrote): it followed forever."""
    from supervisor.commands import logs

    node = tmp_path / "run"
    node.mkdir()
    (node / "state.json").write_text('{"schema_version": 99}')
    assert logs._over([node / "state.json"], None)
    with RunLock(node):  # a live supervisor still holds it: its next write may be readable
        assert not logs._over([node / "state.json"], None)
    assert logs._over([tmp_path / "deleted" / "state.json"], None)


def test_logs_follow_of_a_killed_supervisors_run_goes_on_while_its_ranks_still_write(tmp_path):
    """kill -9 of the supervisor: its ranks checkpoint and log their last lines without it; --follow ended the
    moment the supervisor's lock went and missed them (a reviewer's run)."""
    from supervisor.commands import logs
    from supervisor.protocol import Heartbeat, write_heartbeat

    _state_file(tmp_path, state=state.RunState.RUNNING, attempt=2)
    beats = tmp_path / "heartbeats" / "attempt_2"
    beats.mkdir(parents=True)
    write_heartbeat(beats, Heartbeat(0, os.getpid(), attempt=2, phase="save", time=time.time()))  # alive: us
    assert not logs._over([tmp_path / "state.json"], None)
    write_heartbeat(beats, Heartbeat(0, os.getpid(), attempt=2, phase="exited", time=time.time()))
    assert logs._over([tmp_path / "state.json"], None)


def test_logs_rank_follow_across_attempts_is_content_with_the_ranks_earlier_output(tmp_path, monkeypatch, capsys):
    """`logs --rank 1 --follow`: rank 1 wrote in attempt 1; attempt 2 (a smaller world, say) never had a rank 1.
    It erred "no output for rank 1" after printing rank 1's lines; the rank was seen, so it ends 0."""
    from supervisor.commands import logs

    rec = _state_file(tmp_path, state=state.RunState.RUNNING, attempt=1)
    (tmp_path / "logs" / "attempt_1" / "rank_1").mkdir(parents=True)
    (tmp_path / "logs" / "attempt_1" / "rank_1" / "stdout.log").write_text("one\n")

    def relaunch():  # the supervisor's relaunch, then the run's end, one poll each
        (tmp_path / "logs" / "attempt_2" / "rank_0").mkdir(parents=True)
        (tmp_path / "logs" / "attempt_2" / "rank_0" / "stdout.log").write_text("zero\n")
        rec.attempt = 2
        state.write(tmp_path / "state.json", rec)

    def finish():
        rec.state = state.RunState.SUCCEEDED
        state.write(tmp_path / "state.json", rec)

    steps = iter([relaunch, finish])
    monkeypatch.setattr(logs.time, "sleep", lambda _s: next(steps, lambda: None)())
    with RunLock(tmp_path):
        assert logs.main(str(tmp_path), 1, None, True) == 0
    out = capsys.readouterr()
    assert out.out == "[rank 1 out] one\n", out
    assert "attempt 2" in out.err and "no output for rank 1" not in out.err


def test_nodes_the_run_went_on_without_are_retired_and_do_not_count(tmp_path, cli):
    """Nodes a and b (their supervisors gone) were followed by c and d, whose attempts began after a's and b's
    last word: the run is c's and d's. A node whose supervisor is gone but that nobody followed still counts."""
    run_dir = tmp_path / "run"

    def node(name, st, updated, launched, rank):
        rec = state.RunRecord(name="mn", run_dir=".", checkpoint_dir="checkpoints", node=name, state=st,
                              attempt=1, ranks=[{"rank": rank, "pid": 1, "step": 5, "alive": True, "phase": "train",
                                                 "world_size": 2, "node": name}])
        rec.history.append(state.AttemptRecord(attempt=1, started_at=launched, resumed_from_step=None))
        rec.goodput = 0.5 + rank / 10
        rec.accounting = {"summary": dict.fromkeys(state.SUMMARY_SHOWN, 0.0) | {"goodput": rec.goodput}}
        (run_dir / "nodes" / name).mkdir(parents=True)
        path = run_dir / "nodes" / name / "state.json"
        state.write(path, rec)
        doc = json.loads(path.read_text())
        doc["updated_at"] = updated
        path.write_text(json.dumps(doc))

    node("a", state.RunState.STOPPED, 100.0, 10.0, 0)
    node("b", state.RunState.RUNNING, 100.0, 10.0, 1)  # its supervisor killed: never wrote its end
    node("c", state.RunState.SUCCEEDED, 300.0, 200.0, 1)
    node("d", state.RunState.SUCCEEDED, 300.0, 200.0, 0)
    doc = json.loads(cli("status", run_dir, "--json").stdout)
    assert doc["state"] == "succeeded"
    assert {n["node"]: n["retired"] for n in doc["nodes"]} == {"a": True, "b": True, "c": False, "d": False}
    assert {r["node"] for r in doc["ranks"]} == {"c", "d"}
    # The top level is one node's view: its history says whose (audit 7: the entries named no node).
    assert [h["node"] for h in doc["history"]] == [next(n["node"] for n in doc["nodes"] if n["history"] ==
                                                        doc["history"])]
    assert all(h["node"] == n["node"] for n in doc["nodes"] for h in n["history"])
    # each node's own books, not only the last writer's (audit 13: the contract's nodes[].goodput was missing)
    assert {n["node"]: (n["goodput"], n["accounting"]["summary"]["goodput"]) for n in doc["nodes"]} == \
        {"a": (0.5, 0.5), "b": (0.6, 0.6), "c": (0.6, 0.6), "d": (0.5, 0.5)}
    said = " ".join(cli("status", run_dir).stdout.split())
    assert "retired: the run went on without it" in said and "c: succeeded, attempt 1, 0 restart(s), goodput 60.0%" \
        in said, said
    primary = max(("c", "d"), key=lambda n: state.read(run_dir / "nodes" / n / "state.json").updated_at)
    assert f"succeeded node {primary}'s view: attempt 1" in said, said  # whose record the lines below are (audit 18)
    shutil.rmtree(run_dir / "nodes" / "c")
    shutil.rmtree(run_dir / "nodes" / "d")
    doc = json.loads(cli("status", run_dir, "--json").stdout)  # nobody followed them: a stopped run
    assert doc["state"] == "stopped" and not any(n["retired"] for n in doc["nodes"])


def test_a_lost_node_a_fixed_size_run_still_needs_is_shown_not_retired(tmp_path, cli):
    """nnodes 2: node b's supervisor was killed, a relaunched and waited for it in the rendezvous, then failed.
    b was called "retired: the run went on without it" and its attempt hidden, though the run had waited for it
    (a reviewer's Slurm job). With nnodes 1:2 the run may go on without b: retired, as before."""
    run_dir = tmp_path / "run"

    def node(name, st, updated, launched, min_nodes):
        rec = state.RunRecord(name="mn", run_dir=".", checkpoint_dir="checkpoints", node=name, state=st, attempt=1,
                              min_nodes=min_nodes)
        rec.history.append(state.AttemptRecord(attempt=1, started_at=launched, resumed_from_step=None,
                                               reason=api.SUPERVISOR_LOST if name == "b" else None))
        (run_dir / "nodes" / name).mkdir(parents=True, exist_ok=True)
        path = run_dir / "nodes" / name / "state.json"
        state.write(path, rec)
        doc = json.loads(path.read_text())
        doc["updated_at"] = updated
        path.write_text(json.dumps(doc))

    node("b", state.RunState.RUNNING, 100.0, 10.0, 2)  # its supervisor killed: never wrote its end
    node("a", state.RunState.FAILED, 300.0, 200.0, 2)
    doc = json.loads(cli("status", run_dir, "--json").stdout)
    assert {n["node"]: n["retired"] for n in doc["nodes"]} == {"a": False, "b": False}
    assert doc["state"] == "failed"
    text = cli("status", run_dir).stdout
    assert "retired" not in text and "the run needs 2 nodes" in text, text
    assert api.SUPERVISOR_LOST in text  # b's attempt is in the history
    node("b", state.RunState.RUNNING, 100.0, 10.0, 1)
    node("a", state.RunState.SUCCEEDED, 300.0, 200.0, 1)  # nnodes 1:2, say: it went on without b
    doc = json.loads(cli("status", run_dir, "--json").stdout)
    assert {n["node"]: n["retired"] for n in doc["nodes"]} == {"a": False, "b": True}
    assert doc["state"] == "succeeded"


def test_a_rendezvous_that_does_not_form_names_the_nodes_whose_supervisor_is_gone(tmp_path):
    """What a fixed-size group waits for: the other nodes' supervisors that are not running and did not finish."""
    run_dir = tmp_path / "run"
    for name, st in (("a", state.RunState.RESTARTING), ("b", state.RunState.RUNNING),
                     ("c", state.RunState.SUCCEEDED), ("d", state.RunState.STOPPED)):
        state.write(run_dir / "nodes" / name / "state.json",
                    state.RunRecord(name="mn", run_dir=".", checkpoint_dir="checkpoints", node=name, state=st))
    said = state.missing_nodes(run_dir, run_dir / "nodes" / "a")
    assert said.startswith("; node b's supervisor is not running (last heard "), said
    assert "node d's" in said and "node a's" not in said and "node c's" not in said, said
    assert state.missing_nodes(tmp_path / "nowhere", tmp_path) == ""


def test_status_of_a_job_file_takes_run_s_run_dir_options(tmp_path, cli):
    """`status JOB --run-dir DIR` finds the run `run JOB --run-dir DIR` made (the sbatch script asks so); the
    options need a job file, and a run dir not made yet is said as such."""
    run_dir = _run_dir(tmp_path)
    job = REPO / "jobs" / "tiny-cpu.yaml"
    for given in (["--run-dir", str(run_dir)], ["--set", f"run_dir={run_dir}"]):
        doc = json.loads(cli("status", job, *given, "--json").stdout)
        assert doc["run_dir"] == str(run_dir) and doc["state"] == "succeeded"
    out = cli("status", run_dir, "--set", "checkpoint.keep=2")
    assert out.exit_code == 2 and "apply to a job file as TARGET" in out.output
    out = cli("status", job, "--run-dir", tmp_path / "later")
    assert out.exit_code == 2 and "no run of this job in" in out.output, out.output


def _run_dir(tmp_path: Path, steps=(1, 2, 3, 4), **replication) -> Path:
    run_dir = tmp_path / "run"
    for step in steps:
        write_checkpoint(run_dir / "checkpoints", step)
    rec = state.RunRecord(name="hostile", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.SUCCEEDED,
                          replication=dict(replication))
    state.write(run_dir / "state.json", rec)
    (run_dir / "job.json").write_text(json.dumps({"schema_version": 1, "job": {
        "checkpoint": {"dir": "checkpoints", "keep_local": 1}}}))
    return run_dir


def test_a_damaged_state_or_job_record_is_one_sentence_and_nothing_is_deleted(tmp_path, cli):
    run_dir = _run_dir(tmp_path)
    good = json.loads((run_dir / "state.json").read_text())
    deep = "[" * 100_000 + "]" * 100_000  # past the interpreter's recursion: a RecursionError no caller caught
    for key, value in [("history", [1]), ("ranks", [1]), ("replication", "x"), ("supervisor", "x"),
                       ("accounting", {"summary": "x"}), ("run_dir", 5), ("updated_at", 1e20), ("step", "NaN"),
                       ("ranks", [{"rank": 0, "step": "x"}]), ("accounting", {"summary": {"wall_s": "x"}}),
                       ("replication", {"local_root": "l", "durable_root": "d", "pending": ["a"]}),
                       ("history", "DEEP")]:
        (run_dir / "state.json").write_text(json.dumps({**good, key: value}).replace('"NaN"', "NaN")
                                            .replace('"DEEP"', deep))
        for args in (("status", run_dir), ("status", run_dir, "--json"), ("logs", run_dir),
                     ("inspect-checkpoint", run_dir), ("gc", run_dir, "--keep", "1", "--dry-run")):
            r = cli(*args)  # in process, exceptions not caught: a traceback fails the test by itself
            assert r.exit_code in (0, 2) and "Traceback" not in r.output, (key, args, r.output)
            if args[0] == "status" and key != "step":  # status reads every field: the damage must be said
                assert r.exit_code == 2, (key, args, r.output)
            elif args[0] == "status" and "--json" in args:  # NaN where Python wrote it reads as nothing
                assert r.exit_code == 0 and json.loads(r.stdout)["step"] is None, r.output
            if r.exit_code == 2:
                if args[0] != "logs":  # logs reads the attempts' folders (this run dir has none)
                    said = "state.json: not JSON" if value == "DEEP" else "state.json: malformed"
                    assert said in r.output and "damaged" in r.output, (key, args, r.output)
                if "--json" in args:
                    assert json.loads(r.stdout)["exit_code"] == 2, r.output
                else:
                    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    # Audit 15: Python's words ("'int' object has no attribute 'items'", "is not <class 'int'>", "schema_version
    # None" for a list) where the field and what it should hold are meant.
    for doc, says in [({**good, "history": [1, 2]}, "malformed (history[0]: 1 is not an object)"),
                      ({**good, "history": [{"attempt": 1}]}, "malformed (history[0]: started_at, resumed_from_step "
                                                              "missing)"),
                      ({**good, "attempt": "x"}, "malformed (attempt: 'x' is not an integer)"),
                      ([1, 2], "not a state record (a JSON object), but list JSON")]:
        (run_dir / "state.json").write_text(json.dumps(doc))
        r = cli("status", run_dir)
        assert r.exit_code == 2 and f"state.json: {says}" in r.stderr, r.output
    (run_dir / "state.json").write_text(json.dumps({**good, "goodput": 1e308}))  # said as a bound, not "not float"
    assert "goodput: 1e+308 is not a number (finite, below 1e12) or null" in cli("status", run_dir).stderr
    # NaN and Infinity where Python wrote them read as nothing, so `status --json` stays JSON.
    (run_dir / "state.json").write_text(json.dumps({**good, "goodput": float("inf")}))
    r = cli("status", run_dir, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["goodput"] is None, r.output

    (run_dir / "state.json").write_text(json.dumps(good))
    for damaged in ('{"schema_version": 1, "job": ', '[1]', '{"job": {"checkpoint": 5}}', '{"job": ' + deep + "}"):
        (run_dir / "job.json").write_text(damaged)
        for args in (("inspect-checkpoint", run_dir), ("gc", run_dir, "--keep", "1")):
            r = cli(*args)
            assert r.exit_code == 2 and "job.json cannot be read" in r.output, (damaged, args, r.output)
    assert [c.step for c in store.scan(run_dir / "checkpoints")] == [1, 2, 3, 4]
    (run_dir / "job.json").unlink()
    (run_dir / "checkpoints" / "step_000000004" / store.MARKER).write_text(deep)
    store.quarantine(run_dir / "checkpoints" / "step_000000003", "a test")
    (run_dir / "checkpoints" / "step_000000003.quarantined" / store.QUARANTINE_FILE).write_text(deep)
    for args in (("inspect-checkpoint", run_dir), ("gc", run_dir, "--keep", "1", "--dry-run"), ("status", run_dir)):
        r = cli(*args)
        assert r.exit_code in (0, 1) and "Traceback" not in r.output, (args, r.output)
    doc = json.loads(cli("inspect-checkpoint", run_dir, "--json").stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {1: "valid", 2: "valid", 3: "corrupt",
                                                                      4: "corrupt"}, doc
    r = cli("inspect-checkpoint", run_dir / "checkpoints" / "step_000000002" / store.MARKER)
    assert r.exit_code == 2 and "is a file of checkpoint step_000000002; pass its checkpoint root" in r.stderr


def test_a_run_dir_without_job_json_is_not_a_way_for_gc_to_a_root_only_its_state_file_names(tmp_path, cli):
    """Audit 15: gc deleted in the folder the state file recorded (\"as its job records it\") and left the run dir's
    own checkpoints alone. Refused, as a damaged job.json is; status still reads the run."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "victim"
    for step in (10, 20):
        write_checkpoint(elsewhere, step)
        write_checkpoint(run_dir / "checkpoints", step)
    rec = _state_file(run_dir, state=state.RunState.SUCCEEDED)
    rec.checkpoint_dir = str(elsewhere)
    state.write(run_dir / "state.json", rec)
    for args in (("gc", run_dir, "--keep", "1"), ("inspect-checkpoint", run_dir)):
        r = cli(*args)
        assert r.exit_code == 2 and r.stderr.strip() == (
            f"resilient: {run_dir} has no job.json, and its state file names the checkpoint root {elsewhere}, "
            "outside the run dir: nothing is done to a root only a state file names. Pass that root as TARGET if "
            "it is this run's."), r.output
    assert [i.step for i in store.scan(elsewhere)] == [10, 20]
    assert cli("status", run_dir).exit_code == 0


def test_gc_takes_no_local_tier_for_the_durable_root_and_refuses_a_bad_keep_local(tmp_path, cli):
    # A node's local tier recorded as the durable root itself (a {node} template that met checkpoint.dir).
    run_dir = _run_dir(tmp_path, local_root="checkpoints")
    doc = json.loads(cli("gc", run_dir, "--keep", "3", "--json").stdout)
    assert doc["kept"] == [2, 3, 4] and [x["step"] for x in doc["removed"]] == [1], doc
    assert "local_tiers" not in doc, doc
    # Two nodes naming one local folder: its checkpoints are judged once, each deletion reported once.
    nvme = tmp_path / "nvme"
    for step in (1, 2, 3):
        write_checkpoint(nvme, step)
    for node in ("a", "b"):
        rec = state.RunRecord(name="hostile", run_dir=".", checkpoint_dir="checkpoints", node=node,
                              state=state.RunState.SUCCEEDED, replication={"local_root": str(nvme)})
        state.write(run_dir / "nodes" / node / "state.json", rec)
    doc = json.loads(cli("gc", run_dir, "--keep", "3", "--json").stdout)
    assert len(doc["local_tiers"]) == 1 and [x["step"] for x in doc["local_tiers"][0]["removed"]] == [1, 2], doc
    for bad in (0, -1, "2", 1.5):
        (run_dir / "job.json").write_text(json.dumps({"schema_version": 1, "job": {
            "checkpoint": {"dir": "checkpoints", "keep_local": bad}}}))
        r = cli("gc", run_dir, "--keep", "3")
        assert r.exit_code == 2 and "checkpoint.keep_local" in r.output and "--keep-local" in r.output, r.output
    assert sorted(p.name for p in nvme.iterdir()) == ["step_000000003"]


def test_gc_names_the_folder_a_linked_checkpoint_root_leads_to(tmp_path, cli):
    run_dir = _run_dir(tmp_path, steps=())
    elsewhere = tmp_path / "big-disk"
    for step in (1, 2):
        write_checkpoint(elsewhere, step)
    (run_dir / "checkpoints").symlink_to(elsewhere)
    r = cli("gc", run_dir, "--keep", "1")
    assert r.exit_code == 0 and f"(a link to {elsewhere})" in r.stdout.splitlines()[0], r.output
    r = cli("gc", run_dir, "--keep", "1", "--json")
    assert f"(a link to {elsewhere})" in r.stderr, r.output


def test_inspect_of_one_checkpoint_folder_with_another_step_is_one_sentence(tmp_path, cli):
    """It silently reported the other step, not the folder given."""
    write_checkpoint(tmp_path, 250)
    folder = write_checkpoint(tmp_path, 300)
    r = cli("inspect-checkpoint", folder, "--step", "250")
    assert r.exit_code == 2 and f"{folder} is the checkpoint of step 300, not 250: drop --step" in r.stderr, r.output
    assert cli("inspect-checkpoint", folder, "--step", "300").exit_code == 0


def test_status_says_when_a_live_supervisor_is_stopped_and_its_record_old(tmp_path, cli):
    """Audit 8: with the supervisor stopped (Ctrl-Z, SIGSTOP), status showed its last record as the present: ranks
    23 s silent against a 10 s limit, still `running`, the supervisor `alive`."""
    sleeper = subprocess.Popen(["sleep", "60"])  # stands in for the supervisor: the test holds the lock
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(sleeper.pid).status() == psutil.STATUS_STOPPED, 10, "the stand-in stopped")
        _state_file(tmp_path, state=state.RunState.RUNNING, step=10,
                    supervisor={"pid": sleeper.pid, "host": socket.gethostname()})
        with RunLock(tmp_path):
            said = " ".join(cli("status", tmp_path).stdout.split())
            assert "(alive but stopped (Ctrl-Z or SIGSTOP): nothing watches the ranks; what follows is " in said, said
            doc = json.loads(cli("status", tmp_path, "--json").stdout)  # a script sees it too, not only a reader
            assert doc["supervisor_stale"].startswith("alive but stopped") and doc["record_age_s"] >= 0, doc
            os.kill(sleeper.pid, signal.SIGCONT)
            wait_for(lambda: psutil.Process(sleeper.pid).status() != psutil.STATUS_STOPPED, 10, "the stand-in on")
            assert "(alive)" in " ".join(cli("status", tmp_path).stdout.split())  # a record of a second ago
            assert json.loads(cli("status", tmp_path, "--json").stdout)["supervisor_stale"] is None
            doc = json.loads((tmp_path / "state.json").read_text())
            doc["updated_at"] -= 120
            (tmp_path / "state.json").write_text(json.dumps(doc))
            said = " ".join(cli("status", tmp_path).stdout.split())
            assert "(alive, but what follows is 120s old: it is busy" in said, said
            assert json.loads(cli("status", tmp_path, "--json").stdout)["record_age_s"] >= 120
    finally:
        sleeper.kill()
        sleeper.wait()


def test_status_watch_into_a_reader_that_leaves_exits_0(tmp_path):
    """`status --watch --json | head -1`: the reader has its line and goes; status exited 1 (failed), silently."""
    _state_file(tmp_path, state=state.RunState.RUNNING, step=10)
    cli_path = Path(sys.executable).with_name("resilient")
    with RunLock(tmp_path):  # a live supervisor: the run never ends while status watches
        out = subprocess.run(f"'{cli_path}' status '{tmp_path}' --watch --json | head -1; exit ${{PIPESTATUS[0]}}",
                             shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "running", (out.returncode, out.stderr)
    assert out.stderr == ""


def test_ctrl_c_of_a_follow_exits_130_and_usage_errors_name_the_command_as_started(tmp_path):
    """click's Abort (Ctrl-C, an EOF) escaped the one-sentence errors as a traceback on click releases that raise
    it; `python -m supervisor run --bogus` named the command `resilient -m supervisor run`."""
    import signal

    from tests.proc import child_env, started, wait_for

    _state_file(tmp_path, state=state.RunState.RUNNING)
    (tmp_path / "logs" / "attempt_1").mkdir(parents=True)
    argv = [sys.executable, "-m", "supervisor", "logs", str(tmp_path), "--follow"]
    with RunLock(tmp_path), started(argv, tmp_path, log=tmp_path / "follow.log") as follow:
        wait_for(lambda: "==> attempt 1" in follow.output(), 30, "logs --follow in its loop")
        follow.signal(signal.SIGINT)
        assert follow.wait(30) == 130 and "Traceback" not in follow.output(), follow.output()
    r = subprocess.run([sys.executable, "-m", "supervisor", "run", "--bogus"], capture_output=True, text=True,
                       env=child_env(), timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("resilient run: No such option: --bogus; see `resilient run "
                                                     "--help`."), r.stderr
    r = subprocess.run([sys.executable, "-m", "supervisor", "status", "--json", "--bogus"], capture_output=True,
                       text=True, env=child_env(), timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2 and r.stderr == "", r
    # `logs` has no --json mode: its unknown option is a sentence, not a JSON error; click names no command for
    # `--watch=x`, which is still told as `resilient status`'s error, in JSON since status has --json
    r = subprocess.run([sys.executable, "-m", "supervisor", "logs", "--json"], capture_output=True, text=True,
                       env=child_env(), timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("resilient logs: No such option: --json"), r
    r = subprocess.run([sys.executable, "-m", "supervisor", "status", "--watch=x", "--json"], capture_output=True,
                       text=True, env=child_env(), timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["error"].startswith("resilient status: Option '--watch'"), r


def test_status_of_an_orphaned_run_skips_damaged_beats_and_step_lines_and_never_waits_on_a_fifo(tmp_path, cli):
    """Review 9: a beat whose step was a string, a step line of 1e999 and a step log that is a FIFO stopped `status`
    of a run whose supervisor died in a TypeError, an OverflowError or forever; a quarantined entry's path given as
    a list, in a TypeError. The supervisor reads the same files as it runs."""
    for name, beat, lines in (("beat", {"rank": 0, "pid": 2**22 + 1, "step": "7", "time": time.time()}, None),
                              ("line", None, b'{"step": 3, "t": 1.0}\n{"step": 1e999, "t": 2.0}\n'),
                              ("fifo", None, None)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING,
                              attempt=1, step=3, supervisor={"pid": 2**22 + 1, "host": socket.gethostname()})
        rec.history.append(state.AttemptRecord(attempt=1, started_at=time.time() - 60, resumed_from_step=None))
        state.write(run_dir / "state.json", rec)
        (run_dir / "steps").mkdir()
        if beat is not None:
            (run_dir / "heartbeats" / "attempt_1").mkdir(parents=True)
            (run_dir / "heartbeats" / "attempt_1" / "rank_0.json").write_text(json.dumps({**beat, "schema_version": 1}))
        if lines is not None:
            (run_dir / "steps" / "attempt_1.jsonl").write_bytes(lines)
        if name == "fifo":
            os.mkfifo(run_dir / "steps" / "attempt_1.jsonl")
        r = cli("status", run_dir, "--json")
        assert r.exit_code == 0, (name, r.output)
        assert json.loads(r.stdout)["state"] != "running", name
    doc = json.loads((tmp_path / "line" / "state.json").read_text())
    doc["quarantined"] = [{"step": 5, "path": ["step_000000005.quarantined"], "reason": "corrupt", "at": 1.0}]
    (tmp_path / "line" / "state.json").write_text(json.dumps(doc))
    r = cli("status", tmp_path / "line")
    assert r.exit_code == 2 and "quarantined[0].path: ['step_000000005.quarantined'] is not text" in r.stderr, r.output


def test_a_recorded_path_with_a_nul_character_is_one_sentence(tmp_path, cli):
    """Review 9: the first system call on it raised ValueError (embedded null byte), a traceback in each command."""
    (tmp_path / "job.json").write_text(json.dumps({"schema_version": 1, "job": {"name": "x",
                                                                                "checkpoint": {"dir": "ck\0pt"}}}))
    for command in (("inspect-checkpoint",), ("gc", "--keep", "1", "--dry-run")):
        r = cli(command[0], tmp_path, *command[1:])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert f"{tmp_path / 'job.json'} (checkpoint.dir) records the path 'ck\\x00pt', which holds a NUL " \
            "character" in " ".join(r.stderr.split()), r.output


def test_status_says_when_the_recorded_checkpoint_is_no_longer_valid_on_disk(tmp_path, cli):
    """A finished run's step 60 truncated (or deleted) since: status went on calling it the last valid one."""
    for step in (40, 60):
        write_checkpoint(tmp_path / "checkpoints", step)
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=60, last_checkpoint_step=60, goodput=0.8)
    assert "last_checkpoint_problem" not in json.loads(cli("status", tmp_path, "--json").stdout)
    truncate(tmp_path / "checkpoints" / store.step_dirname(60) / "__1_0.distcp")
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    problem = doc["last_checkpoint_problem"]
    assert doc["last_checkpoint_step"] == 60 and problem.startswith("corrupt: __1_0.distcp is 4087 bytes"), problem
    assert doc["last_checkpoint_problem"].endswith("; newest valid: 40")
    shutil.rmtree(tmp_path / "checkpoints" / store.step_dirname(60))
    text = " ".join(cli("status", tmp_path).stdout.split())
    assert "last valid checkpoint 60 (not valid on disk now: gone; newest valid: 40)" in text, text
    shutil.rmtree(tmp_path / "checkpoints")  # an unmounted root: not "gone; newest valid: none"
    problem = json.loads(cli("status", tmp_path, "--json").stdout)["last_checkpoint_problem"]
    assert problem.endswith("cannot be seen from here (not mounted, or gone)"), problem


def test_a_quarantined_folder_or_a_root_of_only_quarantined_ones_can_be_inspected(tmp_path, cli):
    """Both were 'no run and no checkpoints here', exit 2."""
    aside = store.quarantine(write_checkpoint(tmp_path, 30), "a reviewer's test")
    r = cli("inspect-checkpoint", aside, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and [c["step"] for c in doc["checkpoints"]] == [30], r.output  # set aside: not resumed
    r = cli("inspect-checkpoint", tmp_path, "--json")
    assert r.exit_code == 1 and "quarantined" in json.loads(r.stdout)["checkpoints"][0]["reason"], r.output


def test_logs_into_a_reader_that_leaves_exits_0(tmp_path):
    """`resilient logs RUN | head -1` said "cannot be read (Broken pipe)" and exited 1."""
    _state_file(tmp_path, state=state.RunState.SUCCEEDED, step=10)
    rank_dir = tmp_path / "logs" / "attempt_1" / "rank_0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text("step line\n" * 200_000)  # more than a pipe holds
    (rank_dir / "stderr.log").write_text("")
    cli_path = Path(sys.executable).with_name("resilient")
    out = subprocess.run(f"'{cli_path}' logs '{tmp_path}' | head -1; exit ${{PIPESTATUS[0]}}",
                         shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "[rank 0 out] step line\n" and out.stderr == "", out


def test_inspect_of_a_quarantined_folder_reports_that_folder_not_its_steps_new_twin(tmp_path, cli):
    """A NaN's rollback or a re-save leaves step_100.quarantined beside a new step_100: naming the quarantined one
    reported the new one, exit 0."""
    aside = store.quarantine(write_checkpoint(tmp_path, 100), "a reviewer's test")
    write_checkpoint(tmp_path, 100)
    r = cli("inspect-checkpoint", aside, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["selected_step"] == 100, r.output
    assert cli("inspect-checkpoint", tmp_path / store.step_dirname(100)).exit_code == 0


def test_names_no_encoding_can_print_are_shown_escaped(tmp_path):
    """A marker that names a lone surrogate (its checksum over it intact) and a file whose name is not UTF-8:
    the text views crashed with UnicodeEncodeError halfway through the table."""
    from tests.proc import child_env

    root = tmp_path / "ckpt"
    named = write_checkpoint(root, 10)
    marker = named / store.MARKER
    doc = json.loads(marker.read_bytes())
    doc.pop("marker_checksum")
    doc["files"][0]["name"] = "\ud800x"
    doc["marker_checksum"] = store._marker_checksum(doc, doc["checksum_algorithm"])
    marker.write_text(json.dumps(doc))
    stray = write_checkpoint(root, 20)
    open(os.fsencode(stray) + b"/\xff", "wb").close()
    for argv, code in ((["inspect-checkpoint", str(root)], 1), (["gc", str(root), "--keep", "1", "--dry-run"], 0)):
        r = subprocess.run([sys.executable, "-m", "supervisor", *argv], capture_output=True, env=child_env(),
                           timeout=60)
        out = r.stdout.decode()
        assert r.returncode == code and b"Traceback" not in r.stderr, r
        assert "\\ud800x is missing" in out and "unlisted file \\udcff" in out, out


def test_logs_follow_of_a_run_whose_supervisor_died_says_the_attempt_ended_with_it(tmp_path, cli):
    """Audit 17: after SIGKILL of `resilient run`, --follow printed the ranks' last lines and exited 0 without a word
    on the attempt's end, which status reports as supervisor_lost."""
    rec = _state_file(tmp_path, state=state.RunState.RUNNING, attempt=1)
    rec.history = [state.AttemptRecord(attempt=1, started_at=time.time() - 30, resumed_from_step=None)]
    state.write(tmp_path / "state.json", rec)
    ranks = tmp_path / "logs" / "attempt_1" / "ranks" / "x" / "attempt_0" / "0"
    ranks.mkdir(parents=True)
    (ranks / "stdout.log").write_text("step 10\n")
    r = cli("logs", tmp_path, "--follow")
    assert r.exit_code == 0, r.output
    assert "==> attempt 1 ended: supervisor_lost — the supervisor (pid 4194303) died during this attempt <==" in \
        " ".join(r.stderr.split()), r.output


def test_inspect_counts_a_local_step_only_when_every_node_holds_the_same_save_of_it(tmp_path, cli):
    """Review 16: two nodes holding different saves of step 200 (one saved again after a resume) were counted as
    "valid in every node's local tier", where a relaunch never mixes them and resumes from an older one."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / "checkpoints", 100)
    for node in ("a", "b"):
        write_checkpoint(run_dir / "local" / node, 150)
        rec = state.RunRecord(name="tiers", run_dir=".", checkpoint_dir="checkpoints", node=node,
                              state=state.RunState.SUCCEEDED,
                              replication={"local_root": f"local/{node}", "durable_root": "checkpoints"})
        (run_dir / "nodes" / node).mkdir(parents=True)
        state.write(run_dir / "nodes" / node / "state.json", rec)
    write_checkpoint(run_dir / "local" / "a", 200)
    partial = store.begin(run_dir / "local" / "b", 200)  # another save of step 200
    (partial.path / ".metadata").write_bytes(b"metadata of another save of step 200")
    partial.commit(1, store.describe_files(partial.path, [".metadata"]))
    assert store.inspect(run_dir / "local" / "b" / store.step_dirname(200)).valid
    r = cli("inspect-checkpoint", run_dir, "--step", "200")
    assert r.exit_code == 1 and "step 200: not valid in every node's local tier" in r.stdout, r.output
    r = cli("inspect-checkpoint", run_dir, "--step", "150")  # the same save on both (their own shards)
    assert r.exit_code == 0 and "step 150: valid in every node's local tier" in r.stdout, r.output


def test_status_says_a_live_attempt_with_no_rank_yet_waits_for_its_group(tmp_path, cli):
    """Audit 18: a node waiting in the rendezvous for a lost peer read as plain "running", no word of why."""
    rec = state.RunRecord(name="tiny", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING,
                          attempt=2, min_nodes=2, supervisor={"pid": os.getpid(), "host": socket.gethostname()})
    rec.history = [state.AttemptRecord(attempt=2, started_at=time.time() - 34, resumed_from_step=100)]
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        said = " ".join(cli("status", tmp_path).stdout.split())
        assert re.search(r"waiting attempt 2's torchrun has started no rank for 3[45](\.\d)?s: it waits in the "
                         r"rendezvous for at least 2 node\(s\)", said), said
        rec.history[0].world_size = 2  # its ranks began
        state.write(tmp_path / "state.json", rec)
        assert "waiting" not in cli("status", tmp_path).stdout
