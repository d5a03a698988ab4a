"""A run dir belongs to the user: copied, moved, archived or read-only, resilient acts only on what it is
pointed at. Real folders written by the real supervisor (torchrun replaced by a fake that leaves what a
finished attempt leaves), real read-only mounts, the CLI in-process or as a process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from supervisor import state, store
from supervisor.lock import RunLock
from supervisor.protocol import Heartbeat, write_heartbeat
from supervisor.replicate import ROOT_LOCK
from tests.ckpt_helpers import flip_byte, write_checkpoint
from tests.proc import REPO, child_env, readonly, started, wait_for
from tests.runs import RUN_TIMEOUT, finished_attempt, resilient, run_job, status

JOB = "name: demo\nentrypoint:\n  module: train_entry\nnproc_per_node: 2\ncheckpoint: {keep: 3}\n"


def steps(root: Path) -> list[int]:
    return [int(p.name[5:14]) for p in store.checkpoint_dirs(root)] if root.is_dir() else []


@pytest.fixture
def finished_run(tmp_path, cli, monkeypatch):
    """`resilient run` of a 2-rank job through the real supervisor; the fake attempt saves steps 20, 40, 60."""

    def make(job_text: str = JOB, name: str = "run") -> Path:
        job = tmp_path / f"{name}.yaml"
        job.write_text(job_text)
        run_dir = tmp_path / name
        monkeypatch.setattr("supervisor.commands.run.make_launcher", finished_attempt)
        r = cli("run", job, "--run-dir", run_dir)
        assert r.exit_code == 0, r.output
        return run_dir

    return make


def test_a_run_records_paths_relative_to_its_run_dir(finished_run):
    run_dir = finished_run()
    job = json.loads((run_dir / "job.json").read_text())["job"]
    assert job["run_dir"] == "." and job["checkpoint"]["dir"] == "checkpoints"
    rec = json.loads((run_dir / "state.json").read_text())
    assert rec["run_dir"] == "." and rec["checkpoint_dir"] == "checkpoints"
    assert rec["history"][0]["log_dir"] == "logs/attempt_1"
    recorded = (run_dir / "job.json").read_text() + (run_dir / "state.json").read_text()
    assert f'"{run_dir}"' not in recorded and f'"{run_dir}/' not in recorded, "an absolute path into the run dir"
    # Each rank's folder has a stable name: a relative link to torchrun's folder for that rank.
    link = run_dir / "logs/attempt_1/rank_1"
    assert os.readlink(link) == "ranks/fake-run_x1/attempt_0/1"
    assert (link / "stdout.log").read_text() == "attempt 1 hello from rank 1\n"


def test_on_a_second_node_the_links_carry_global_ranks(tmp_path, cli, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: finished_attempt(first_rank=2))
    assert cli("run", job, "--run-dir", tmp_path / "run", "--node", "n2").exit_code == 0
    logs = tmp_path / "run/nodes/n2/logs/attempt_1"
    assert sorted(os.listdir(logs)) == ["rank_2", "rank_3", "ranks", "torchrun.log"]  # never by local rank here
    assert os.readlink(logs / "rank_3") == "ranks/fake-run_x1/attempt_0/1"
    assert cli("logs", tmp_path / "run", "--rank", "3").stdout.startswith("[rank 3 out] attempt 1 hello from rank 3")


def test_status_json_resolves_recorded_paths_and_fills_world_size(finished_run, cli):
    run_dir = finished_run()
    doc = json.loads(cli("status", run_dir, "--json").stdout)
    assert doc["run_dir"] == str(run_dir) and doc["checkpoint_dir"] == str(run_dir / "checkpoints")
    assert doc["history"][0]["log_dir"] == str(run_dir / "logs/attempt_1")
    assert doc["history"][0]["world_size"] == 2
    assert "tail" in cli("status", run_dir).stdout and "failure handling" not in cli("status", run_dir).stdout


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_copied_or_moved_run_dir_acts_on_itself_only(finished_run, cli, tmp_path, how):
    original = finished_run()
    other = tmp_path / "archive" / "mine"
    other.parent.mkdir()
    if how == "copied":
        shutil.copytree(original, other, symlinks=True)  # cp -a
    else:
        os.rename(original, other)
    r = cli("inspect-checkpoint", other, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["root"] == str(other / "checkpoints") and doc["latest_valid_step"] == 60
    assert all(c["path"].startswith(str(other)) for c in doc["checkpoints"])
    r = cli("gc", other, "--keep", "1")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == f"checkpoint root {other / 'checkpoints'}"
    assert "removed step 20" in r.stdout and "removed step 40" in r.stdout
    assert steps(other / "checkpoints") == [60]
    if how == "copied":
        assert steps(original / "checkpoints") == [20, 40, 60], "gc on the copy touched the original"
    else:
        assert not original.exists()
    doc = json.loads(cli("status", other, "--json").stdout)
    assert doc["run_dir"] == str(other) and doc["history"][0]["log_dir"] == str(other / "logs/attempt_1")
    r = cli("logs", other, "--rank", "1")
    assert r.exit_code == 0 and r.stdout == "[rank 1 out] attempt 1 hello from rank 1\n" \
                                            "[rank 1 err] attempt 1 warning from rank 1\n", r.output


def legacy_run_dir(run_dir: Path) -> None:
    """A run dir as supervisors before relative paths wrote it: absolute paths into itself."""
    root = run_dir / "checkpoints"
    for s in (20, 40, 60):
        write_checkpoint(root, s)
    (run_dir / "job.json").write_text(json.dumps(
        {"schema_version": 1, "job": {"name": "old", "run_dir": str(run_dir), "checkpoint": {"dir": str(root)}}}))
    rec = state.RunRecord(name="old", run_dir=str(run_dir), checkpoint_dir=str(root), state=state.RunState.SUCCEEDED)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=time.time() - 9, resumed_from_step=None,
                                           ended_at=time.time(), reason="finished",
                                           log_dir=str(run_dir / "logs/attempt_1")))
    (run_dir / "logs/attempt_1/ranks/r_x/attempt_0/0").mkdir(parents=True)
    (run_dir / "logs/attempt_1/ranks/r_x/attempt_0/0/stdout.log").write_text("old output\n")
    (run_dir / "state.json").write_text(json.dumps(rec.to_dict()))


def test_status_reads_the_checkpoint_root_inspect_and_gc_read_and_names_one_reached_through_a_link(tmp_path, cli):
    """Audit 6: a state file recording another folder (a hand edit, a copied file) made status read that folder as the
    run's, unnamed, while inspect-checkpoint and gc read job.json's; a linked root was named by gc, not by status."""
    run_dir, elsewhere = tmp_path / "runs/mine", tmp_path / "elsewhere"
    legacy_run_dir(run_dir)
    write_checkpoint(elsewhere, 10)
    doc = json.loads((run_dir / "state.json").read_text())
    doc |= {"checkpoint_dir": str(elsewhere), "last_checkpoint_step": 60}
    (run_dir / "state.json").write_text(json.dumps(doc))
    status = json.loads(cli("status", run_dir, "--json").stdout)
    assert status["checkpoint_dir"] == str(run_dir / "checkpoints") and status["last_checkpoint_step"] == 60, status
    assert "not valid on disk now" not in cli("status", run_dir).stdout
    shutil.move(run_dir / "checkpoints", elsewhere / "real")
    (run_dir / "checkpoints").symlink_to(elsewhere / "real")
    note = f"checkpoint root {run_dir / 'checkpoints'} (a link to {elsewhere / 'real'})"
    for command in ("status", "inspect-checkpoint"):  # a line as long as two paths may wrap where a space is
        assert note in " ".join(cli(command, run_dir).stdout.split()), command


def test_a_copied_legacy_run_dir_never_follows_its_absolute_paths_back(tmp_path, cli):
    original, copy = tmp_path / "runs/mine", tmp_path / "archive/mine"
    legacy_run_dir(original)
    shutil.copytree(original, copy, symlinks=True)
    assert json.loads(cli("gc", copy, "--keep", "1", "--dry-run", "--json").stdout)["root"] == str(copy / "checkpoints")
    assert cli("gc", copy, "--keep", "1").exit_code == 0
    assert steps(copy / "checkpoints") == [60] and steps(original / "checkpoints") == [20, 40, 60]
    doc = json.loads(cli("status", copy, "--json").stdout)
    assert doc["checkpoint_dir"] == str(copy / "checkpoints")
    assert doc["history"][0]["log_dir"] == str(copy / "logs/attempt_1")
    # Torchrun's folders without the links (older runs): found by local rank, inside the run dir.
    assert cli("logs", copy).stdout == "[rank 0 out] old output\n"
    os.rename(copy, tmp_path / "moved")
    r = cli("inspect-checkpoint", tmp_path / "moved")
    assert r.exit_code == 0 and str(tmp_path / "moved/checkpoints") in r.stdout and str(copy) not in r.stdout


def test_a_checkpoint_root_outside_the_run_dir_is_named_and_a_gone_one_is_one_sentence(finished_run, cli,
                                                                                        tmp_path):
    outside = tmp_path / "shared-ckpt"
    run_dir = finished_run(JOB.replace("{keep: 3}", f"{{keep: 3, dir: {outside}}}"))
    assert json.loads((run_dir / "job.json").read_text())["job"]["checkpoint"]["dir"] == str(outside)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, symlinks=True)
    note = f"checkpoint root {outside} (outside the run dir {copy}, as its job records it)"
    r = cli("gc", copy, "--keep", "2")
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == note, r.output
    assert steps(outside) == [40, 60]
    r = cli("gc", copy, "--keep", "1", "--json")
    assert r.stderr.strip() == f"resilient: {note}" and json.loads(r.stdout)["root"] == str(outside)
    assert note in cli("inspect-checkpoint", copy).stdout
    assert f"checkpoint root {outside} (outside the run dir" in cli("status", copy).stdout
    shutil.rmtree(outside)
    for command in (["inspect-checkpoint", copy], ["gc", copy, "--keep", "1"]):
        r = cli(*command)
        assert r.exit_code == 2 and r.stdout == "", r.output
        assert r.stderr == (f"resilient: {copy} records its checkpoint root as {outside}, which does not exist; "
                            "restore or mount that folder, or pass the checkpoint root you mean as TARGET.\n")
    assert cli("status", copy).exit_code == 0  # status does not need the checkpoints


def test_every_light_command_gives_an_empty_folder_the_same_sentence(tmp_path, cli):
    empty = tmp_path / "empty"
    empty.mkdir()
    answers = {(r.exit_code, r.stderr) for r in (cli("status", empty), cli("inspect-checkpoint", empty),
                                                  cli("gc", empty, "--keep", "1"), cli("logs", empty))}
    assert answers == {(2, f"resilient: {empty}: no run and no checkpoints here (no job.json, state.json or step_* "
                           "folders); pass a run dir, a job file or a checkpoint root.\n")}
    job = tmp_path / "job.yaml"  # a job that never ran: the same agreement
    job.write_text(JOB)
    answers = {(r.exit_code, r.stderr) for r in (cli("status", job), cli("inspect-checkpoint", job),
                                                  cli("gc", job, "--keep", "1"), cli("logs", job))}
    assert answers == {(2, f"resilient: {job}: no run of this job yet (nothing in {tmp_path / 'runs/demo'}); start "
                           f"it with `resilient run {job}`.\n")}


def test_inspect_step_keeps_the_roots_latest_valid_in_its_head(tmp_path, cli):
    for s in (250, 300):
        write_checkpoint(tmp_path, s)
    r = cli("inspect-checkpoint", tmp_path, "--step", "250")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0].startswith(f"{tmp_path} — step 250: valid; latest valid: step 300")
    doc = json.loads(cli("inspect-checkpoint", tmp_path, "--step", "250", "--json").stdout)
    assert doc["latest_valid_step"] == 300 and doc["selected_step"] == 250
    assert [c["step"] for c in doc["checkpoints"]] == [250]


def test_a_bad_module_name_points_at_its_line(tmp_path, cli):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\nnproc_per_node: 1\nentrypoint:\n  module: no_such_module_here\n")
    r = cli("run", job)
    assert r.exit_code == 2 and r.stderr.startswith(f"resilient: {job}:4: entrypoint.module 'no_such_module_here'")
    assert not (tmp_path / "runs").exists()


def test_logs_names_what_is_missing(finished_run, cli):
    run_dir = finished_run()
    r = cli("logs", run_dir, "--attempt", "7")
    assert r.exit_code == 2 and "no attempt 7 (attempts: 1)" in r.stderr
    r = cli("logs", run_dir, "--rank", "5")
    assert r.exit_code == 2 and "has no output for rank 5 (ranks: 0, 1)" in r.stderr
    r = cli("logs", run_dir, "--follow")  # a finished run: everything, then it returns
    assert r.exit_code == 0 and r.stdout.count("hello from rank") == 2
    r = cli("logs", run_dir, "--attempt", "7", "--follow")  # over without it: it printed nothing and said 0
    assert r.exit_code == 2 and "no attempt 7 (attempts: 1)" in r.stderr
    r = cli("logs", run_dir, "--rank", "5", "--follow")  # it printed a header and said 0
    assert r.exit_code == 2 and "has no output for rank 5 (ranks: 0, 1)" in r.stderr


def test_logs_streams_a_big_log_a_chunk_at_a_time(tmp_path, monkeypatch):
    """`logs` read each whole file into memory (about 900 MB of RSS for a 204 MB log): now a chunk at a time,
    lines cut across chunks joined whole, characters cut across chunks kept whole, a line longer than a chunk
    (a progress bar redrawn with \\r, no newline for megabytes) printed in pieces under one prefix, and a last
    line without its newline printed at the end."""
    from supervisor.commands import logs

    monkeypatch.setattr(logs, "CHUNK", 7)
    log = tmp_path / "out.log"
    bar = "\r".join(f"{i}% ████" for i in range(0, 101, 10))
    log.write_bytes(f"alpha\nbéta gamma\n\n{bar}\ndelta".encode())
    tail = logs.Tail(log, "[r0] ")
    chunks = list(tail.read())
    assert max(len(c) for c in chunks) < 40 and "\ufffd" not in "".join(chunks), chunks
    assert "".join(chunks) == f"[r0] alpha\n[r0] béta gamma\n[r0] \n[r0] {bar}\n"
    with log.open("ab") as f:
        f.write(b" epsilon\n")
    assert "".join(tail.read(final=True)) == "[r0] delta epsilon\n"
    assert list(tail.read(final=True)) == []
    log.write_bytes(b"new\n")  # truncated under --follow (a rotated log): it went silent for good
    assert "".join(tail.read()) == "[r0] new\n"
    (tmp_path / "next.log").write_bytes(b"replaced, and longer than what was read before\n")
    os.replace(tmp_path / "next.log", log)  # another file under the name (both existed: another inode)
    assert "".join(tail.read()) == "[r0] replaced, and longer than what was read before\n"


def test_logs_follow_prints_each_line_once_when_a_rank_link_moves(tmp_path):
    """torchrun re-formed the group in place: `rank_0` moved to the new group's folder. The tail that had followed
    the link read the new file from its start too, and every line of it came twice."""
    from supervisor.commands import logs

    attempt = tmp_path / "logs" / "attempt_1"
    for group in ("g0", "g1"):
        (attempt / group / "0").mkdir(parents=True)
    (attempt / "g0" / "0" / "stdout.log").write_text("old 1\n")
    os.symlink("g0/0", attempt / "rank_0")
    nl = logs.NodeLogs(tmp_path, 1)
    nl.discover(None)
    assert "".join(nl.read()) == "[rank 0 out] old 1\n"
    with (attempt / "g0" / "0" / "stdout.log").open("a") as f:
        f.write("old 2\n")  # the old group's last words, written before the link moved
    (attempt / "g1" / "0" / "stdout.log").write_text("new 1\n")
    os.symlink("g1/0", attempt / ".rank_0.tmp")
    os.replace(attempt / ".rank_0.tmp", attempt / "rank_0")
    nl.discover(None)
    assert sorted("".join(nl.read(final=True)).splitlines()) == ["[rank 0 out] new 1", "[rank 0 out] old 2"]


def test_logs_of_a_big_file_holds_a_chunk_not_the_file(tmp_path):
    import tracemalloc

    from supervisor.commands import logs

    log = tmp_path / "out.log"
    line = b"x" * 99 + b"\n"
    log.write_bytes(line * 160_000)  # 16 MB
    tail = logs.Tail(log, "[rank 0 out] ")
    tracemalloc.start()
    try:
        printed = sum(len(chunk) for chunk in tail.read(final=True))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert printed == 160_000 * (len(line) + len("[rank 0 out] "))
    assert peak < 8 * logs.CHUNK, f"{peak / 1e6:.1f} MB held at once for a 16 MB log"


def test_logs_follow_of_an_attempt_still_to_come_waits_for_it(tmp_path):
    from supervisor.commands import logs
    from supervisor.lock import RunLock

    node = tmp_path / "run"
    node.mkdir()
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING)
    rec.history.append(state.AttemptRecord(attempt=2, started_at=1.0, resumed_from_step=None))
    state.write(node / "state.json", rec)
    with RunLock(node):
        assert not logs._over([node / "state.json"], 2) and not logs._over([node / "state.json"], 3)
        assert logs._over([node / "state.json"], 1)  # an attempt of the past
    assert logs._over([node / "state.json"], 3)  # nobody runs it any more


def test_status_wait_ranks_waits_for_training_ranks(tmp_path, cli, monkeypatch):
    from supervisor.commands import status as status_cmd

    r = cli("status", tmp_path / "not-yet", "--wait-ranks", "--wait-timeout", "0.3")
    assert r.exit_code == 1 and "no run with all ranks training after 0.3s" in r.stderr
    said = " ".join(r.stderr.split())  # once, as --watch and --follow say it (audit 14: it waited without a word)
    assert said.count("no such file or folder") == 1 and "waiting for it (up to 0.3s; Ctrl-C to leave)" in said, said
    rec = state.RunRecord(name="w", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING)
    rec.ranks = [{"rank": 0, "pid": 11, "world_size": 2, "alive": True, "phase": "train", "heartbeat_at": time.time()}]
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        r = cli("status", tmp_path, "--wait-ranks", "--wait-timeout", "0.3")
        assert r.exit_code == 1, "rank 1 is not listed yet"
        rec.ranks.append({**rec.ranks[0], "rank": 1, "pid": 12})
        state.write(tmp_path / "state.json", rec)
        r = cli("status", tmp_path, "--wait-ranks", "--json")
        assert r.exit_code == 0 and [x["pid"] for x in json.loads(r.stdout)["ranks"]] == [11, 12]
    monkeypatch.setattr(status_cmd, "ENDED_GRACE_S", 0.0)
    r = cli("status", tmp_path, "--wait-ranks")  # no supervisor holds it: the run is over
    assert r.exit_code == 1 and "the run has ended (stopped)" in r.stderr


def test_status_wait_ranks_says_a_bad_job_file_at_once(tmp_path, cli):
    """A job file with a typo waited out the whole timeout (300 s by default), then said that no ranks trained,
    exit 1: the job file's own sentence (exit 2) comes at once, as without --wait-ranks."""
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "jobs" / "tiny-cpu.yaml").read_text() + "bogus: 1\n")
    started = time.monotonic()
    r = cli("status", job, "--wait-ranks", "--wait-timeout", "30")
    assert r.exit_code == 2 and 'unknown key "bogus"' in r.stderr and "job.yaml:" in r.stderr, r.output
    assert time.monotonic() - started < 10


def test_piped_output_is_not_wrapped_at_80_columns(finished_run, tmp_path):
    run_dir = finished_run()
    env = {k: v for k, v in child_env().items() if k != "COLUMNS"}
    for argv in (["status", run_dir], ["inspect-checkpoint", run_dir]):
        out = subprocess.run(resilient(*argv), capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        head = next(line for line in out.stdout.splitlines() if "goodput" in line or "latest valid" in line)
        assert len(head) > 80 and head.rstrip().endswith(("0.0s", "every byte)")), head


def test_readme_links_resolve_inside_the_repo():
    import re

    text = (REPO / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)#]+)", text) if "://" not in t]
    assert "CONTRACT.md" in links
    assert [t for t in links if not (REPO / t).exists()] == []


# ---- read-only run dirs and checkpoint roots: real read-only mounts --------------------------------------


def run_cli(argv: list, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=child_env(), timeout=timeout)


def test_a_read_only_run_dir_or_checkpoint_root_stops_run_with_one_line(readonly_mounts, tmp_path):
    job = REPO / "jobs" / "tiny-cpu.yaml"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = run_cli(readonly(run_dir, resilient("run", job, "--run-dir", run_dir)))
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"resilient: {run_dir}: the run dir cannot be written (read-only file system); nothing was "
                          "launched. Make it writable (remount it read-write), or pick another --run-dir.\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = run_cli(readonly(ckpt, resilient("run", job, "--run-dir", run_dir, "--set", f"checkpoint.dir={ckpt}")))
    assert out.returncode == 2 and out.stderr.startswith(f"resilient: {ckpt}: the checkpoint root cannot be written "
                                                         "(read-only file system); nothing was launched."), out.stderr
    assert len(out.stderr.splitlines()) == 1 and os.listdir(run_dir) == [], "nothing may be created"


def test_an_immutable_checkpoint_root_is_not_told_to_remount(tmp_path):
    """Audit 13: `chattr +i` makes a folder unwritable even to root (EPERM): the fix named a remount, which does
    nothing for it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    made = subprocess.run(["chattr", "+i", str(ckpt)], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot make a folder immutable here (needs root and chattr): {made.stderr.strip()}")
    try:
        out = run_cli(resilient("run", REPO / "jobs" / "tiny-cpu.yaml", "--run-dir", tmp_path / "run", "--set",
                                f"checkpoint.dir={ckpt}"))
    finally:
        subprocess.run(["chattr", "-i", str(ckpt)], check=False, timeout=30)
    assert out.returncode == 2 and out.stderr == (
        f"resilient: {ckpt}: the checkpoint root cannot be written (permission denied); nothing was launched. Give "
        "this user write access there (its mode and owner, or an immutable attribute: `lsattr -d`), or set "
        "checkpoint.dir to a writable folder.\n"), out.stderr


def test_run_on_a_full_disk_stops_with_one_sentence_before_anything_is_launched(small_disk, cli, monkeypatch):
    """Review 9: the run dir's lock was written outside any handler, so a run dir on a disk that filled up ended
    `resilient run` in a traceback."""
    run_dir = small_disk / "run"
    run_dir.mkdir()
    with open(small_disk / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass

    def launcher():
        raise AssertionError("nothing may be launched")

    monkeypatch.setattr("supervisor.commands.run.make_launcher", launcher)
    result = cli("run", REPO / "jobs" / "tiny-cpu.yaml", "--run-dir", run_dir)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert said.startswith(f"resilient: {run_dir}") and "No space left on device; nothing was launched. Free space " \
        "there (or make it writable) and run again." in said, said


def test_gc_on_a_read_only_root_removes_nothing_and_says_so(readonly_mounts, tmp_path):
    root = tmp_path / "ckpt"
    for s in (1, 2, 3):
        write_checkpoint(root, s)
    why = (f"{root}: cannot delete there (read-only file system); nothing was removed. Make it writable (remount "
           "it read-write) and run gc again.")
    out = run_cli(readonly(root, resilient("gc", root, "--keep", "1")))
    assert out.returncode == 2 and steps(root) == [1, 2, 3]
    assert out.stdout == f"checkpoint root {root}\n" and out.stderr == f"resilient: {why}\n"
    out = run_cli(readonly(root, resilient("gc", root, "--keep", "1", "--json")))
    assert out.returncode == 2 and json.loads(out.stdout) == {"error": why, "exit_code": 2}
    out = run_cli(readonly(root, resilient("gc", root, "--keep", "1", "--dry-run")))  # a dry run needs no writes
    assert out.returncode == 0 and "would remove step 1" in out.stdout and steps(root) == [1, 2, 3]
    (root / ROOT_LOCK).touch()  # a durable tier that nodes replicate into: gc takes its lock first
    out = run_cli(readonly(root, resilient("gc", root, "--keep", "1")))
    assert out.returncode == 2 and out.stderr == f"resilient: {why}\n" and steps(root) == [1, 2, 3], out.stderr
    out = run_cli(readonly(root, resilient("gc", root, "--keep", "3")))  # nothing to delete: said, exit 0
    assert out.returncode == 0 and out.stderr == "" and steps(root) == [1, 2, 3], out.stderr


def test_gc_lists_what_it_could_not_remove_apart_and_exits_1(readonly_mounts, tmp_path):
    root = tmp_path / "ckpt"
    for s in (1, 2, 3):
        write_checkpoint(root, s)
    stuck = root / store.step_dirname(1)  # a mount point: it cannot be renamed or deleted
    out = run_cli(readonly(stuck, resilient("gc", root, "--keep", "1", "--json")))
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert [r["step"] for r in doc["removed"]] == [2] and steps(root) == [1, 3]
    assert [(f["step"], f["why"]) for f in doc["failed"]] == [(1, "Device or resource busy")]
    assert doc["freed_bytes"] == doc["removed"][0]["size_bytes"]
    write_checkpoint(root, 4)
    out = run_cli(readonly(stuck, resilient("gc", root, "--keep", "1")))
    assert out.returncode == 1 and steps(root) == [1, 4]
    assert "could not remove step 1 (" in out.stdout and "removed step 3" in out.stdout
    assert out.stdout.splitlines()[-1].endswith("; 1 folder(s) could not be removed")


def test_light_commands_read_a_read_only_run_dir(readonly_mounts, finished_run, tmp_path):
    run_dir = finished_run()
    for argv in (["status", run_dir], ["inspect-checkpoint", run_dir], ["logs", run_dir],
                 ["gc", run_dir, "--keep", "3"]):  # nothing to remove: nothing to write
        out = run_cli(readonly(run_dir, resilient(*argv)))
        assert out.returncode == 0, (argv, out.stderr)


def test_a_lock_that_cannot_be_taken_is_a_usage_error_not_a_traceback(tmp_path):
    from supervisor.errors import UsageError

    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match="cannot take the run dir's lock"):
        RunLock(tmp_path / "a-file" / "run").acquire()


# ---- for real: the README's recovery exercise, the logs, and a moved run dir that resumes ---------------


@pytest.mark.slow
def test_recovery_exercise_rank_logs_and_a_moved_run_dir_that_resumes(tmp_path, cli):
    run_dir = tmp_path / "runs" / "recover"
    # As the README has it: the PID is asked for in another shell, before the run dir even exists.
    with started(resilient("status", run_dir, "--wait-ranks", "--json"), tmp_path, log=tmp_path / "wait.log") as w, \
            started(run_job(run_dir, steps=60, sleep=0.1), tmp_path, log=tmp_path / "sup1.log") as sup:
        assert w.wait(120) == 0, w.output()
        said = w.output()  # stdout and stderr together: the wait said once on stderr, then the JSON on stdout
        assert said.count("waiting for it (up to") <= 1 and said.rstrip().endswith("}"), said
        ranks = json.loads(said[said.index("{"):])["ranks"]
        assert [(r["rank"], r["alive"], r["phase"]) for r in ranks] == [(0, True, "train"), (1, True, "train")]
        with started(resilient("logs", run_dir, "--follow"), tmp_path, log=tmp_path / "follow.log") as follow:
            # following attempt 1 before the kill: under load its start took longer than the relaunch
            wait_for(lambda: "==> attempt 1: " in follow.output(), 60, "logs --follow on attempt 1")
            os.kill(ranks[1]["pid"], signal.SIGKILL)
            assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
            assert follow.wait(30) == 0, "--follow ends with the run"
            followed = follow.output()
    assert [h["reason"] for h in status(run_dir)["history"]] == ["worker_signal", "finished"]
    assert "==> attempt 1: " in followed and "==> attempt 2: " in followed and "[rank 0 out] step 60/60" in followed
    # between the two, the supervisor's verdict: the last traceback shown is rank 0's lost connection (audit 16)
    assert "==> attempt 1 ended: worker_signal (rank 1) — rank 1 killed by SIGKILL" in followed, followed[-3000:]
    assert followed.index("==> attempt 1 ended") < followed.index("==> attempt 2: ")
    assert followed.rstrip().endswith("==> attempt 2 ended: finished — all ranks finished <=="), followed[-500:]
    for k in (1, 2):
        for r in (0, 1):
            link = run_dir / f"logs/attempt_{k}/rank_{r}"
            assert os.readlink(link).startswith("ranks/") and (link / "stderr.log").is_file()
    out = cli("logs", run_dir, "--attempt", "2", "--rank", "0").stdout
    assert "[rank 0 out] step 60/60" in out and "[rank 0 err] " in out and "[rank 1" not in out

    moved = tmp_path / "moved"
    os.rename(run_dir, moved)
    doc = json.loads(cli("inspect-checkpoint", moved, "--json").stdout)
    assert doc["root"] == str(moved / "checkpoints") and doc["latest_valid_step"] == 60
    with started(run_job(moved, steps=80, sleep=0.0), tmp_path, log=tmp_path / "sup2.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
        assert "resuming from step 60" in sup.output()
    assert not run_dir.exists(), "the resumed run wrote to where the run dir used to be"
    assert [h["resumed_from_step"] for h in status(moved)["history"]][-1] == 60
    assert steps(moved / "checkpoints") == [40, 60, 80]

    copy = tmp_path / "archive" / "recover"
    shutil.copytree(moved, copy, symlinks=True)
    assert cli("gc", copy, "--keep", "1").exit_code == 0
    assert steps(copy / "checkpoints") == [80] and steps(moved / "checkpoints") == [40, 60, 80]
    assert "[rank 0 out] step 80/80" in cli("logs", copy, "--rank", "0").stdout


def test_logs_never_reads_through_a_link_out_of_the_attempts_logs_nor_waits_on_a_fifo(tmp_path, cli):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    (outside / "attempt_0" / "1").mkdir(parents=True)
    (outside / "secret.txt").write_text("SECRET OUTSIDE THE RUN DIR\n")
    (outside / "attempt_0" / "1" / "stdout.log").write_text("OUTSIDE RANK 1\n")
    logs_dir = run_dir / "logs" / "attempt_1"
    own = logs_dir / "ranks" / "x" / "attempt_0"
    for rank in (0, 2):
        (own / str(rank)).mkdir(parents=True)
    (own / "0" / "stdout.log").symlink_to(outside / "secret.txt")  # a file link out
    (logs_dir / "ranks" / "y").symlink_to(outside)  # a folder link out: rank 1
    os.mkfifo(own / "2" / "stdout.log")
    (own / "2" / "stderr.log").write_text("rank 2 says hello\n")
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.SUCCEEDED)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None, ended_at=2.0))
    state.write(run_dir / "state.json", rec)

    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", cli("logs", run_dir)), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # it waits on the FIFO: open it for writing so that no thread is left behind
        os.close(os.open(own / "2" / "stdout.log", os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
        pytest.fail("logs waited on a FIFO")
    out = result["r"].output
    assert "rank 2 says hello" in out, out
    assert "SECRET" not in out and "OUTSIDE RANK 1" not in out, out


def killed_supervisors_record(run_dir: Path) -> None:
    """What a supervisor SIGKILLed mid-attempt leaves: its state file, running, one attempt not ended."""
    rec = state.RunRecord(name="demo", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None))
    state.write(run_dir / "state.json", rec)


def test_checkpoints_committed_while_no_supervisor_ran_are_trimmed_to_keep_before_the_first_launch(
        tmp_path, cli, monkeypatch):
    """The ranks of a killed supervisor checkpoint and stop on their own; nothing trimmed what they committed. A
    root a new run is only pointed at is not trimmed (audit 15: another job's checkpoints were deleted before the
    first launch)."""
    run_dir = tmp_path / "run"
    for step in (10, 30, 50, 70, 90):
        write_checkpoint(run_dir / "checkpoints", step)
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: finished_attempt(steps=(100,)))
    r = cli("run", job, "--run-dir", tmp_path / "new-run", "--set", f"checkpoint.dir={run_dir / 'checkpoints'}")
    assert r.exit_code == 0 and "before the first launch" not in r.output, r.output
    assert "holds checkpoints with no record of the job that wrote them" in " ".join(r.output.split()), r.output
    assert steps(run_dir / "checkpoints") == [10, 30, 50, 70, 90, 100]  # (the fake attempt's commit trims nothing)
    shutil.rmtree(run_dir / "checkpoints" / "step_000000100")
    killed_supervisors_record(run_dir)  # now the root is this run dir's, whose supervisor was killed
    (run_dir / "checkpoints" / "step_000000040" / "__0_0.distcp").parent.mkdir()  # no marker: corrupt, said so
    (run_dir / "checkpoints" / "step_000000040" / "__0_0.distcp").write_bytes(b"x")
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: finished_attempt(steps=(100,)))
    r = cli("run", job, "--run-dir", run_dir)
    assert r.exit_code == 0, r.output
    assert "before the first launch (keep 3): removed step_000000010, step_000000030, step_000000040 (corrupt: " \
        in r.output, r.output  # audit 6: all three were said to be "committed while no supervisor was running"
    assert steps(run_dir / "checkpoints") == [50, 70, 90, 100]  # the fake attempt's own commit is not trimmed


def test_retention_at_start_never_removes_the_chosen_checkpoint_for_a_newer_one_it_passed_over(
        tmp_path, cli, monkeypatch):
    """With `verify: checksum`, a newer checkpoint whose bytes cannot be read is passed over by the choice but
    looks whole to retention's size check: `keep: 1` kept it and removed the one chosen."""
    run_dir = tmp_path / "run"
    for step in (10, 20):  # shards big enough that the size check does not read them (small files it checksums)
        write_checkpoint(run_dir / "checkpoints", step, size=2 << 20)
    real = store.checksum_file

    def eio_in_step_20(path, *a, **kw):
        if "step_000000020" in str(path) and str(path).endswith(".distcp"):  # a big shard, read only in full
            raise OSError(5, "Input/output error", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(store, "checksum_file", eio_in_step_20)
    killed_supervisors_record(run_dir)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("keep: 3", "keep: 1, verify: checksum"))
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: finished_attempt(steps=(30,)))
    r = cli("run", job, "--run-dir", run_dir)
    assert r.exit_code == 0, r.output
    assert "resuming from step 10" in r.output and "removed step_000000010" not in r.output, r.output
    assert 10 in steps(run_dir / "checkpoints")


def test_a_root_another_live_run_holds_is_refused_before_a_new_run_dir_is_made(tmp_path, cli):
    """Exit 3 left a new run dir behind holding only its supervisor.lock."""
    from supervisor.lock import RootClaim

    root = tmp_path / "shared"
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    with RootClaim(root, tmp_path / "other-run"):
        r = cli("run", job, "--run-dir", tmp_path / "new-run", "--set", f"checkpoint.dir={root}")
    assert r.exit_code == 3 and "checkpoint root of another live run" in r.stderr, r.output
    assert not (tmp_path / "new-run").exists()


def test_a_folder_holding_other_things_is_refused_as_run_dir_and_nothing_is_written(tmp_path, cli, monkeypatch):
    """`run_dir: /` wrote job.json, state.json, logs/ and checkpoints/ into the system's root; `.` does the same into
    a project. A folder that is not (yet) a run's is refused unless it holds only what may sit beside a run."""
    monkeypatch.setattr("supervisor.commands.run.make_launcher", finished_attempt)
    job = tmp_path / "demo.yaml"
    job.write_text(JOB)
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    r = cli("run", job, "--run-dir", project)
    assert r.exit_code == 2, r.output
    assert "the run dir already holds things that are not a run's ('src', 'train.py')" in r.stderr, r.stderr
    assert sorted(os.listdir(project)) == ["src", "train.py"], "a refused run dir must get nothing written"
    # Job files, notes, dotfiles, a volume's lost+found and a refused run's lock may sit beside a first run.
    fresh = tmp_path / "fresh"
    (fresh / "lost+found").mkdir(parents=True)
    for name in ("demo.yaml", "NOTES.md", ".envrc", "supervisor.lock"):
        (fresh / name).write_text("")
    r = cli("run", job, "--run-dir", fresh)
    assert r.exit_code == 0, r.output
    assert steps(fresh / "checkpoints") == [20, 40, 60]


def test_links_in_a_run_dir_never_take_its_files_or_another_runs_state_elsewhere(tmp_path, cli, monkeypatch):
    """Audit 6: a `logs` link wrote the new attempt's logs into another run's folder, a `.resilient-owners` link took
    the locks there, and a `nodes/<name>` link made status show another run as a node of this one."""
    monkeypatch.setattr("supervisor.commands.run.make_launcher", finished_attempt)
    job = tmp_path / "demo.yaml"
    job.write_text(JOB)
    other = tmp_path / "other"
    for folder in ("logs", "owners"):
        (other / folder).mkdir(parents=True)
    for link, target in (("logs", other / "logs"), ("checkpoints/.resilient-owners", other / "owners")):
        run_dir = tmp_path / link.replace("/", "-")
        (run_dir / link).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / link).symlink_to(target)
        r = cli("run", job, "--run-dir", run_dir)
        assert r.exit_code == 2 and f"{run_dir / link} is a link to {target}" in r.stderr, r.output
        assert not list(target.iterdir()) and not (run_dir / "state.json").exists()
    run_dir = tmp_path / "mn"
    (run_dir / "nodes" / "a").mkdir(parents=True)
    for folder, step in ((run_dir / "nodes" / "a", 10), (other, 12345)):
        state.write(folder / "state.json", state.RunRecord(name="demo", run_dir=".", checkpoint_dir="checkpoints",
                                                           node=folder.name, step=step))
    (run_dir / "nodes" / "b").symlink_to(other)
    doc = json.loads(cli("status", run_dir, "--json").stdout)
    assert [n["step"] for n in doc.get("nodes", [])] in ([], [10]) and doc["step"] == 10, doc


def test_a_job_given_another_jobs_checkpoint_root_is_refused_and_nothing_there_is_touched(tmp_path, cli, monkeypatch):
    """Audit 7: a job of another name pointed at a finished job's checkpoint.dir resumed from its step, and its
    retention deleted that job's older steps."""
    monkeypatch.setattr("supervisor.commands.run.make_launcher", finished_attempt)
    shared = tmp_path / "shared-ckpt"
    for name in ("alpha", "beta"):
        (tmp_path / f"{name}.yaml").write_text(JOB.replace("name: demo", f"name: {name}"))
    r = cli("run", tmp_path / "alpha.yaml", "--run-dir", tmp_path / "alpha", "--set", f"checkpoint.dir={shared}")
    assert r.exit_code == 0 and steps(shared) == [20, 40, 60], r.output
    assert f"checkpoint root {shared} (outside the run dir {tmp_path / 'alpha'}" in " ".join(r.output.split())
    r = cli("run", tmp_path / "beta.yaml", "--run-dir", tmp_path / "beta", "--set", f"checkpoint.dir={shared}",
            "--set", "checkpoint.keep=1")
    assert r.exit_code == 2 and f"{shared} holds checkpoints of job 'alpha'" in r.stderr, r.output
    assert steps(shared) == [20, 40, 60] and not (tmp_path / "beta").exists()


def test_status_and_logs_read_a_run_whose_job_record_is_damaged_gc_still_refuses(finished_run, cli):
    """A damaged job.json made status and logs exit 2 with a fix (pass the checkpoint root) that gave "no run
    here"; neither needs it. They read the run, saying once where its checkpoints are taken from; gc, which
    would delete in the wrong folder, still refuses."""
    run_dir = finished_run()
    (run_dir / "job.json").write_text("{")
    r = cli("status", run_dir, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["last_checkpoint_step"] == 60, r.output
    assert r.stderr.count("job.json cannot be read") == 1, r.stderr
    assert f"the checkpoint root its state file records, {run_dir / 'checkpoints'}" in r.stderr, r.stderr
    r = cli("logs", run_dir)
    assert r.exit_code == 0 and "attempt 1 hello from rank 1" in r.stdout, r.output
    r = cli("gc", run_dir, "--keep", "1")
    assert r.exit_code == 2 and "job.json cannot be read" in r.stderr and steps(run_dir / "checkpoints") == [20, 40, 60]


def test_status_wait_ranks_waits_out_a_damaged_state_file_and_an_ended_run_is_said_as_ended(tmp_path, cli):
    """`resilient run` sets a damaged state.json aside: --wait-ranks exited 2 at once; now it waits. A run that
    has ended, asked with a timeout shorter than the grace given to a restart, is said to have ended."""
    (tmp_path / "state.json").write_text("{")
    r = cli("status", tmp_path, "--wait-ranks", "--wait-timeout", "0.3")
    assert r.exit_code == 1 and "no run with all ranks training after 0.3s" in r.stderr, r.output
    rec = state.RunRecord(name="w", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.SUCCEEDED)
    state.write(tmp_path / "state.json", rec)
    r = cli("status", tmp_path, "--wait-ranks", "--wait-timeout", "0.3")
    assert r.exit_code == 1 and "the run has ended (succeeded)" in r.stderr, r.output


def test_options_that_would_be_ignored_or_contradict_each_other_are_refused(tmp_path, cli):
    """--wait-timeout without --wait-ranks did nothing; --run-dir A with --set run_dir=B took A without a word."""
    job = tmp_path / "demo.yaml"
    job.write_text(JOB)
    r = cli("status", tmp_path, "--wait-timeout", "3")
    assert r.exit_code == 2 and "add --wait-ranks, or drop --wait-timeout" in r.stderr, r.output
    for command in ("run", "status"):
        r = cli(command, job, "--run-dir", tmp_path / "a", "--set", f"run_dir={tmp_path / 'b'}")
        assert r.exit_code == 2 and "both name the run dir; pass one of them" in r.stderr, r.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_script_that_never_beats_and_ends_0_is_said_finished_without_a_step(tmp_path, cli, monkeypatch):
    """A user's script without the library's heartbeat, ending with 0: the farewell said "finished at step None"."""
    from tests.runs import FakeHandle

    monkeypatch.setattr("supervisor.commands.run.make_launcher",
                        lambda: lambda cfg, spec, handover: FakeHandle(spec.logs_dir / "torchrun.log", rc=0))
    job = tmp_path / "demo.yaml"
    job.write_text(JOB)
    r = cli("run", job, "--run-dir", tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert "finished (its ranks reported no step: no heartbeat) after 1 attempt(s)" in r.output, r.output
    assert "step None" not in r.output
    # Audit 8: a script whose main() never ran ends the same way; it is said (the job may have had nothing to do)
    assert "the script never started resilient's Session (is its main() called?)" in " ".join(r.output.split())


@pytest.mark.parametrize("command", [("logs", "--follow"), ("status", "--watch")])
def test_follow_and_watch_wait_for_a_run_dir_still_to_be_made(finished_run, tmp_path, command):
    """Started beside a `resilient run` that has not made its run dir yet, `logs --follow` and `status --watch`
    exited 2 at once ("no such file or folder"); they wait for it, saying so once, and go on as usual."""
    done = finished_run()
    later = tmp_path / "later"
    with started([*resilient(command[0], later, command[1]), *(["--json"] if command[0] == "status" else [])],
                 tmp_path, log=tmp_path / "cmd.log") as proc:
        wait_for(lambda: "waiting for it (Ctrl-C to leave)" in proc.output(), 30, "the command to say it waits")
        assert proc.poll() is None
        os.rename(done, later)  # the run dir appears whole, as a finished run's
        assert proc.wait(30) == 0, proc.output()
        out = proc.output()
    assert out.count("waiting for it") == 1, out
    shown = "attempt 1 hello from rank 1" if command[0] == "logs" else '"state": "succeeded"'
    assert shown in out, out


def test_a_relaunch_check_that_sets_aside_every_checkpoint_stops_the_run_and_a_rerun_starts_over(
        finished_run, cli, monkeypatch, tmp_path):
    """Audit: with every checkpoint damaged, a check before the launch set them all aside and the run retrained
    from step 0 unasked, exit 0, while the ranks finding the last one damaged stopped the run (exit 1). Both
    stop now; running again is the user's decision to start over."""
    run_dir = finished_run()
    root = run_dir / "checkpoints"
    for path in store.checkpoint_dirs(root):
        flip_byte(path / ".metadata", 3)
    launched = []
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: lambda *a: launched.append(a))
    r = cli("run", tmp_path / "run.yaml", "--run-dir", run_dir)
    assert r.exit_code == 1 and not launched, r.output
    assert "every checkpoint left was damaged and is set aside (step_000000060.quarantined, " \
           "step_000000040.quarantined, step_000000020.quarantined; never deleted)" in " ".join(r.output.split())
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_0000000{s}.quarantined" for s in (20, 40, 60)]
    doc = json.loads((run_dir / "state.json").read_text())
    assert doc["state"] == "failed" and "starts from step 0" in doc["message"]
    monkeypatch.setattr("supervisor.commands.run.make_launcher", finished_attempt)
    r = cli("run", tmp_path / "run.yaml", "--run-dir", run_dir)
    assert r.exit_code == 0 and "starting fresh" in r.output, r.output


def test_a_rerun_after_a_killed_supervisor_shows_the_step_it_resumes_from_until_the_ranks_step(tmp_path, cli,
                                                                                                 monkeypatch):
    """Audit 16: the killed supervisor's record said step 240 and checkpoint 200 (a poll stale; its ranks then saved
    253 on their own), and status showed those, then "step 0" while the ranks loaded, until the next checkpoint."""
    run_dir = tmp_path / "run"
    for step in (200, 253):
        write_checkpoint(run_dir / "checkpoints", step)
    rec = state.RunRecord(name="demo", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING,
                          step=240, last_checkpoint_step=200, attempt=1)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None))
    state.write(run_dir / "state.json", rec)
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    seen = {}

    def launch(cfg, spec, handover):
        doc = json.loads((run_dir / "state.json").read_text())
        seen.update(step=doc["step"], last_checkpoint_step=doc["last_checkpoint_step"])
        seen.update(first=first)
        write_heartbeat(spec.heartbeat_dir, Heartbeat(rank=0, pid=2**22, world_size=2, phase="startup", step=0))
        return finished_attempt(steps=(260,))(cfg, spec, handover)

    first = {}
    real_write = state.write

    def first_write(path, record):  # audit 17: the start-up's first record said 240/200 and attempt 0
        if not first:
            first.update(step=record.step, last_checkpoint_step=record.last_checkpoint_step, attempt=record.attempt)
        real_write(path, record)

    monkeypatch.setattr(state, "write", first_write)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: launch)
    r = cli("run", job, "--run-dir", run_dir)
    assert r.exit_code == 0 and "resuming from step 253" in r.output, r.output
    assert seen["step"] == 253 and seen["last_checkpoint_step"] == 253, seen
    assert first == {"step": 240, "last_checkpoint_step": 253, "attempt": 1}, first  # no step log: beats say 240
    doc = json.loads((run_dir / "state.json").read_text())
    assert doc["step"] == 260 and doc["last_checkpoint_step"] == 260, doc


def test_a_rerun_pointed_at_a_root_of_unrecorded_checkpoints_trims_nothing_before_its_first_launch(tmp_path, cli,
                                                                                                   monkeypatch):
    """Review 14: a run dir with a history, given another root by --set, said it took the root's unrecorded
    checkpoints as its own and on the next line removed two of them before the user could act on it."""
    other, run_dir = tmp_path / "other-jobs-ckpt", tmp_path / "run"
    for step in (10, 30, 50, 70, 90):
        write_checkpoint(other, step)
    killed_supervisors_record(run_dir)
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: finished_attempt(steps=(100,)))
    r = cli("run", job, "--run-dir", run_dir, "--set", f"checkpoint.dir={other}")
    assert r.exit_code == 0 and "before the first launch" not in r.output, r.output
    assert steps(other) == [10, 30, 50, 70, 90, 100]


def test_a_lock_file_in_the_run_dir_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path, cli, monkeypatch):
    """Found reading review 13's link cases: the run dir's supervisor.lock, a link, was opened through it: the file
    it led to was truncated and written with the supervisor's pid."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim.txt"
    run_dir.mkdir()
    victim.write_text("precious")
    (run_dir / "supervisor.lock").symlink_to(victim)
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    monkeypatch.setattr("supervisor.commands.run.make_launcher", lambda: finished_attempt(steps=(10,)))
    r = cli("run", job, "--run-dir", run_dir)
    assert r.exit_code == 2 and f"{run_dir / 'supervisor.lock'} is a link to {victim}" in r.stderr, r.output
    assert victim.read_text() == "precious" and sorted(p.name for p in run_dir.iterdir()) == ["supervisor.lock"]
    from supervisor.errors import ConfigError
    from supervisor.lock import RunLock

    with pytest.raises(ConfigError, match="is a link to"):  # the lock itself, past the check (a race)
        RunLock(run_dir).acquire()
    assert victim.read_text() == "precious"


def test_a_node_started_with_another_job_than_the_running_nodes_is_refused_naming_the_key(tmp_path, cli,
                                                                                          monkeypatch):
    """Audit 18: node b ran another checkpoint interval than node a; both started without a word, their ranks waited
    for each other in different collectives, and the run ended in a crash loop of hangs, nothing naming the cause."""
    job = tmp_path / "mn.yaml"
    job.write_text(JOB.replace("checkpoint: {keep: 3}", "checkpoint: {keep: 3, interval_steps: 20}") +
                   'nnodes: "1:2"\nrdzv: {endpoint: "127.0.0.1:29999"}\n')
    monkeypatch.setattr("supervisor.commands.run.make_launcher", finished_attempt)
    run_dir = tmp_path / "run"
    assert cli("run", job, "--run-dir", run_dir, "--node", "a").exit_code == 0
    with RunLock(run_dir / "nodes" / "a"):  # node a runs, and has written the run's job record since
        recorded = run_dir / "job.json"
        os.utime(recorded)
        r = cli("run", job, "--run-dir", run_dir, "--node", "b", "--set", "checkpoint.interval_steps=30")
        assert r.exit_code == 2, r.output
        assert r.stderr.startswith("resilient: checkpoint.interval_steps is 30 here but 20 in the job of the running "
                                   "node(s) a"), r.stderr
        assert "Traceback" not in r.output and not (run_dir / "nodes" / "b").exists()
        assert cli("run", job, "--run-dir", run_dir, "--node", "b").exit_code == 0  # the same job: it runs
        # a record from before node a held its lock is a past job's, not compared (review 17: nodes started together
        # with a changed job refused each other)
        os.utime(recorded, (1.0, 1.0))
        assert cli("run", job, "--run-dir", run_dir, "--node", "b", "--set", "checkpoint.interval_steps=30"
                   ).exit_code == 0
    # nobody runs: a changed job is the user's to start (the run's record follows it)
    assert cli("run", job, "--run-dir", run_dir, "--node", "b", "--set", "checkpoint.interval_steps=30"
               ).exit_code == 0

