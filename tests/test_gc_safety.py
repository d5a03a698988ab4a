"""What inspect-checkpoint and gc must never do, whatever they find: call a checkpoint they could not read
corrupt (and delete it), follow a path a run dir records out of it, follow a link, or delete in a folder
before naming it. Real folders written by the store; permissions really denied (the CLI run as an
unprivileged user when the tests run as root, who reads every file whatever its mode)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from supervisor import state, store
from tests.ckpt_helpers import flip_byte, write_checkpoint

NOBODY = 65534


@pytest.fixture
def shared_dir():
    """A folder an unprivileged user can reach and change (pytest's own tmp dirs are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="resilient-gc-safety-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _open_to_all(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)


def _unprivileged(*args: object) -> subprocess.CompletedProcess:
    """The installed CLI, run without root's right to read what its mode forbids."""
    cmd = [str(Path(sys.executable).with_name("resilient")), *map(str, args)]
    if os.geteuid() == 0:
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        if shutil.which("setpriv") is None or subprocess.run([*drop, cmd[0], "--version"], capture_output=True,
                                                             timeout=60).returncode != 0:
            pytest.skip("running as root, and no unprivileged user can run this checkout's CLI here")
        cmd = [*drop, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_checkpoint_that_cannot_be_read_is_unreadable_not_corrupt_and_gc_keeps_it(shared_dir):
    root = shared_dir / "ckpt"
    for step in (100, 200, 300):
        write_checkpoint(root, step)
    _open_to_all(root)
    (root / store.step_dirname(300) / store.MARKER).chmod(0)

    r = _unprivileged("inspect-checkpoint", root, "--json")
    assert r.returncode == 0, r.stderr  # step 200 is valid
    doc = json.loads(r.stdout)
    s300 = next(c for c in doc["checkpoints"] if c["step"] == 300)
    assert s300["status"] == "unreadable" and "Permission denied" in s300["reason"], s300
    assert doc["latest_valid_step"] == 200

    r = _unprivileged("gc", root, "--keep", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kept"] == [200] and [x["step"] for x in doc["removed"]] == [100]
    assert [x["step"] for x in doc["spared"]] == [300] and "not deleted" in doc["spared"][0]["why"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        store.step_dirname(200), store.step_dirname(300)]


def test_a_checkpoint_root_that_cannot_be_read_is_one_sentence(shared_dir):
    root = shared_dir / "ckpt"
    write_checkpoint(root, 1)
    root.chmod(0o311)  # enterable, not listable
    for cmd in (("inspect-checkpoint", root), ("gc", root, "--keep", "1")):
        r = _unprivileged(*cmd)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "cannot be read (Permission denied)" in r.stderr, r.stderr
    assert (root / store.step_dirname(1) / store.MARKER).is_file()
    root.chmod(0o000)  # not even enterable: the folder is named, not a job.json inside it that is not there
    r = _unprivileged("inspect-checkpoint", root)
    assert r.returncode == 2 and r.stderr.startswith(f"resilient: {root}: cannot be read (Permission denied)"), \
        r.stderr
    root.chmod(0o755)


@pytest.mark.parametrize("shut", ["file", "folder"])
def test_logs_says_a_rank_log_it_cannot_read_instead_of_passing_it_over(shared_dir, shut):
    """Another user's run dir whose rank logs are 0600 (umask 077): `logs` printed the other streams, or nothing,
    and exited 0, as if the rank had printed nothing."""
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.SUCCEEDED)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None, ended_at=2.0,
                                           reason="finished"))
    state.write(shared_dir / "state.json", rec)
    folder = shared_dir / "logs" / "attempt_1" / "ranks" / "job_x" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_text("step 1\n")
    (folder / "stderr.log").write_text("warning\n")
    _open_to_all(shared_dir)
    r = _unprivileged("logs", shared_dir)
    assert r.returncode == 0 and r.stdout == "[rank 0 out] step 1\n[rank 0 err] warning\n", r
    shut_out = folder / "stdout.log" if shut == "file" else folder.parent.parent
    shut_out.chmod(0o600 if shut == "file" else 0o700)
    r = _unprivileged("logs", shared_dir)
    assert r.returncode == 2 and r.stderr.startswith(f"resilient: {shut_out}: cannot be read (Permission denied)"), r
    assert "Traceback" not in r.stderr


def test_a_marker_whose_checksum_package_is_missing_is_unreadable_and_kept(tmp_path, cli, monkeypatch):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        write_checkpoint(root, step)
    marker = root / store.step_dirname(3) / store.MARKER
    doc = json.loads(marker.read_bytes())
    doc["checksum_algorithm"] = "crc32c"  # written elsewhere, where the package was installed
    marker.write_text(json.dumps(doc))
    monkeypatch.setitem(sys.modules, "crc32c", None)  # `import crc32c` fails, as without the package

    r = cli("inspect-checkpoint", root, "--json")
    s3 = next(c for c in json.loads(r.stdout)["checkpoints"] if c["step"] == 3)
    assert s3["status"] == "unreadable" and "pip install crc32c" in s3["reason"], s3
    doc = json.loads(cli("gc", root, "--keep", "1", "--json").stdout)
    assert doc["kept"] == [2] and [x["step"] for x in doc["spared"]] == [3] and marker.is_file()


def _run_dir(path: Path, checkpoint_dir: str) -> Path:
    path.mkdir(parents=True)
    (path / "job.json").write_text(json.dumps({"schema_version": 1, "job": {"checkpoint": {"dir": checkpoint_dir}}}))
    return path


@pytest.mark.parametrize("where", ["job.json", "state.json"])
def test_a_path_recorded_out_of_the_run_dir_with_dotdot_is_not_followed(tmp_path, cli, where):
    victim = tmp_path / "victim"
    for step in (1, 2, 3):
        write_checkpoint(victim, step)
    run_dir = _run_dir(tmp_path / "run", "../victim" if where == "job.json" else "checkpoints")
    if where == "state.json":
        write_checkpoint(run_dir / "checkpoints", 3)
        rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", node="a",
                              state=state.RunState.SUCCEEDED,
                              replication={"local_root": "../victim", "durable_root": "checkpoints"})
        (run_dir / "nodes" / "a").mkdir(parents=True)
        state.write(run_dir / "nodes" / "a" / "state.json", rec)
    for cmd in (("gc", run_dir, "--keep", "1"), ("inspect-checkpoint", run_dir)):
        r = cli(*cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert "leads out of the run dir" in r.stderr and "'../victim'" in r.stderr, r.stderr
    assert sorted(p.name for p in victim.iterdir()) == [store.step_dirname(s) for s in (1, 2, 3)]


def test_status_refuses_a_log_dir_recorded_out_of_the_run_dir_in_both_views(tmp_path, cli):
    """Only `status --json` resolves the history's log_dir, so only it refused one with `..`: the text view, which
    shows none, answered 0 for the same state file."""
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.SUCCEEDED)
    rec.history.append(state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None, ended_at=2.0,
                                           reason="finished", log_dir="../../etc"))
    state.write(tmp_path / "state.json", rec)
    for args in (("status", tmp_path), ("status", tmp_path, "--json")):
        r = cli(*args)
        assert r.exit_code == 2 and "leads out of the run dir" in r.output, (args, r.output)


def test_gc_does_not_follow_a_link_named_like_its_leftovers(tmp_path, cli):
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    write_checkpoint(root, 1)
    elsewhere.mkdir()
    (elsewhere / "data").write_bytes(bytes(1000))
    (root / f"{store.TRASH_PREFIX}{store.step_dirname(0)}.1").symlink_to(elsewhere)
    for extra in (("--dry-run",), ()):
        r = cli("gc", root, "--keep", "1", "--json", *extra)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["removed"] == []
    assert (elsewhere / "data").stat().st_size == 1000


def test_gc_names_a_local_tier_outside_the_run_dir_before_deleting_in_it(tmp_path, cli):
    run_dir, nvme = _run_dir(tmp_path / "run", "checkpoints"), tmp_path / "nvme"
    for step in (1, 2):
        write_checkpoint(run_dir / "checkpoints", step)
        write_checkpoint(nvme, step)
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", node="a",
                          state=state.RunState.SUCCEEDED, replication={"local_root": str(nvme)})
    state.write(run_dir / "state.json", rec)
    r = cli("gc", run_dir, "--keep", "1", "--keep-local", "1", "--json")
    assert r.exit_code == 0, r.output
    assert f"local tier of node a: {nvme}" in r.stderr  # JSON on stdout; the folder named before it is touched
    assert [x["step"] for x in json.loads(r.stdout)["local_tiers"][0]["removed"]] == [1]
    r = cli("gc", run_dir, "--keep", "1", "--keep-local", "1")
    lines = r.stdout.splitlines()
    assert lines[0] == f"checkpoint root {run_dir / 'checkpoints'}" and f"local tier of node a: {nvme}" in lines


def test_gc_refuses_a_local_tier_given_on_its_own(tmp_path, cli):
    """A local tier given as TARGET: gc knew nothing of the durable tier and would delete a step it has no copy of
    (the run dir's gc keeps those)."""
    nvme = tmp_path / "nvme"
    for step in (1, 2):
        partial = store.begin(nvme, step)
        (partial.path / "data").write_bytes(b"x" * 100)
        partial.commit(1, store.describe_files(partial.path, ["data"]), extra={"tier": "local", "node": "a"})
    r = cli("gc", nvme, "--keep", "1")
    assert r.exit_code == 2 and "is a node's local checkpoint tier; nothing was removed" in r.stderr, r.output
    assert [i.step for i in store.scan(nvme) if i.valid] == [1, 2]


def test_gc_verify_keeps_an_older_whole_checkpoint_when_the_newest_has_a_flipped_byte(tmp_path, cli, monkeypatch):
    """Sizes alone (the default) cannot see a flipped byte in a large shard: gc would keep the damaged newest and
    delete the older whole one. With --verify the kept ones are read to the last byte first, before gc takes the
    replication lock (the nodes' supervisors wait on it while gc holds it)."""
    import fcntl

    from supervisor.replicate import ROOT_LOCK

    root = tmp_path / "ckpt"
    for step in (1, 2):
        write_checkpoint(root, step, size=store.SMALL_FILE_BYTES + 1)
    flip_byte(root / store.step_dirname(2) / "__0_0.distcp")
    (root / ROOT_LOCK).touch()  # a tiered run replicates into this root
    real_inspect, read_under_lock = store.inspect, []

    def inspect(path, *, deep=False, progress=None):
        if deep:
            fd = os.open(root / ROOT_LOCK, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                read_under_lock.append(path)
            finally:
                os.close(fd)
        return real_inspect(path, deep=deep, progress=progress)

    monkeypatch.setattr(store, "inspect", inspect)
    doc = json.loads(cli("gc", root, "--keep", "1", "--dry-run", "--json").stdout)
    assert doc["kept"] == [2] and [x["step"] for x in doc["removed"]] == [1]  # what the default would do
    assert doc["verified"] is False  # and it says it judged by sizes (audit: it said "valid" and nothing more)
    assert "kept valid steps: 2 (sizes checked; --verify reads every byte)" in cli("gc", root, "--keep", "1",
                                                                                   "--dry-run").output
    r = cli("gc", root, "--keep", "1", "--verify", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    # 2, found corrupt, is newer than the newest whole one: kept to look at, not deleted (audit 15)
    assert doc["kept"] == [1] and doc["removed"] == [] and doc["verified"], doc
    assert [x["step"] for x in doc["spared"]] == [2] and "checksum mismatch" in doc["spared"][0]["why"]
    assert store.inspect(root / store.step_dirname(1), deep=True).valid
    assert read_under_lock == []


def test_gc_of_a_live_run_spares_the_step_its_supervisor_handed_over_for_a_rollback(tmp_path, cli):
    """A NaN rolled the run back to step 50 while step 100 stayed valid; `gc --keep 1` at that moment deleted 50
    before the ranks read it, and they started afresh from step 0."""
    from supervisor.lock import RunLock

    root = tmp_path / "checkpoints"
    for step in (50, 100):
        write_checkpoint(root, step)
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING,
                          attempt=2)
    rec.history += [state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None, ended_at=2.0,
                                        reason="nan"),
                    state.AttemptRecord(attempt=2, started_at=3.0, resumed_from_step=50)]
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        r = cli("gc", tmp_path, "--keep", "1", "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["removed"] == [], r.output
        assert store.inspect(root / store.step_dirname(50)).valid
    r = cli("gc", tmp_path, "--keep", "1", "--json")  # nobody loads it any more
    assert r.exit_code == 0 and [x["step"] for x in json.loads(r.stdout)["removed"]] == [50], r.output


def test_gc_of_a_live_run_spares_the_local_step_its_supervisor_offered_for_a_rollback(tmp_path, cli):
    """With a local tier the ranks are offered the local tier's step beside the durable one. The durable tier kept
    only 100 (`keep: 1`); a rollback below 100 offered local step 50, which the durable tier no longer has:
    `gc --keep-local 1` deleted it before the ranks read it."""
    from supervisor.lock import RunLock

    nvme = tmp_path / "nvme"
    write_checkpoint(tmp_path / "checkpoints", 100)
    for step in (50, 100):
        write_checkpoint(nvme, step)
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", node="a",
                          state=state.RunState.RUNNING, attempt=2, replication={"local_root": str(nvme)})
    rec.history += [state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None, ended_at=2.0,
                                        reason="nan"),
                    state.AttemptRecord(attempt=2, started_at=3.0, resumed_from_step=None, offered_local_step=50)]
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        r = cli("gc", tmp_path, "--keep", "1", "--keep-local", "1", "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["local_tiers"][0]["removed"] == [], r.output
        assert store.inspect(nvme / store.step_dirname(50)).valid
    r = cli("gc", tmp_path, "--keep", "1", "--keep-local", "1", "--json")  # nobody loads it any more
    assert r.exit_code == 0 and [x["step"] for x in json.loads(r.stdout)["local_tiers"][0]["removed"]] == [50], \
        r.output


def test_gc_of_a_live_run_spares_every_step_up_to_the_handed_one_until_the_ranks_begin_training(tmp_path, cli):
    """Review 16: the ranks load the smallest step the nodes handed over (or the newest every node holds locally),
    which may be older than this node's: until they train, gc keeps every valid step up to the handed one."""
    from supervisor.lock import RunLock

    root = tmp_path / "checkpoints"
    for step in (50, 100, 150):
        write_checkpoint(root, step)
    rec = state.RunRecord(name="x", run_dir=".", checkpoint_dir="checkpoints", state=state.RunState.RUNNING,
                          attempt=2)
    loading = state.AttemptRecord(attempt=2, started_at=3.0, resumed_from_step=100)
    rec.history += [state.AttemptRecord(attempt=1, started_at=1.0, resumed_from_step=None, ended_at=2.0,
                                        reason="worker_signal"), loading]
    state.write(tmp_path / "state.json", rec)
    with RunLock(tmp_path):
        r = cli("gc", tmp_path, "--keep", "1", "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["removed"] == [], r.output
        loading.first_step_at = 4.0  # training: past loading, only the handed step is spared
        state.write(tmp_path / "state.json", rec)
        r = cli("gc", tmp_path, "--keep", "1", "--json")
        assert r.exit_code == 0 and [x["step"] for x in json.loads(r.stdout)["removed"]] == [50], r.output


def test_saving_a_step_again_sets_an_unreadable_folder_of_that_step_aside_instead_of_deleting_it(tmp_path, cli,
                                                                                                monkeypatch):
    """A rerun that saved step 200 again replaced an unreadable step_200 (whose bytes nobody could judge, and which
    gc promises never to delete) without a word. status lists the folder set aside, as it lists the supervisor's."""
    root = tmp_path / "ckpt"
    old = write_checkpoint(root, 200)
    marker = old / store.MARKER
    doc = json.loads(marker.read_bytes())
    doc["checksum_algorithm"] = "crc32c"
    marker.write_text(json.dumps(doc))
    monkeypatch.setitem(sys.modules, "crc32c", None)  # unreadable here: its checksum package is missing
    assert store.inspect(old).status is store.Status.UNREADABLE
    new = write_checkpoint(root, 200)
    assert store.inspect(new).valid
    aside = root / (store.step_dirname(200) + store.QUARANTINE_SUFFIX)
    assert json.loads((aside / store.MARKER).read_bytes())["checksum_algorithm"] == "crc32c"
    assert "unreadable step_000000200" in store.quarantine_reason(aside)
    state.write(tmp_path / "state.json", state.RunRecord(name="x", run_dir=".", checkpoint_dir="ckpt",
                                                         state=state.RunState.SUCCEEDED, last_checkpoint_step=200))
    r = cli("status", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    assert [(q["step"], q["path"]) for q in json.loads(r.stdout)["quarantined"]] == [(200, aside.name)], r.stdout
    r = cli("status", tmp_path)
    assert f"set aside step 200 as {aside.name}: an unreadable step_000000200" in r.stdout, r.stdout


def test_gc_of_a_root_named_by_itself_that_a_live_run_holds_is_refused_and_deletes_nothing(tmp_path, cli):
    """Review 13: named by its root (as an outside root is), a live run's was judged as a dead one's: the older step a
    rollback had handed its ranks went, and they started afresh. Through the run dir gc knows that step; once the run
    has ended the root is gc's."""
    from supervisor.lock import RootClaim

    root = tmp_path / "shared" / "ckpt"
    for step in (10, 20, 30):
        write_checkpoint(root, step)
    claim = RootClaim(root, tmp_path / "run", job="demo").acquire()  # what the run's supervisor holds
    try:
        r = cli("gc", root, "--keep", "1")
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.stderr.strip() == (f"resilient: {root} is a checkpoint root of the live run {tmp_path / 'run'} "
                                    f"(supervisor pid {os.getpid()} on {socket.gethostname()}); nothing was removed. "
                                    "gc it through that run dir, `resilient gc RUN_DIR --keep N`, which knows the "
                                    "step its ranks are loading, or once the run has ended."), r.stderr
        assert [i.step for i in store.scan(root)] == [10, 20, 30]
        copy = tmp_path / "copy-of-run"  # review 14: a copy of the run dir shares its outside root
        copy.mkdir()
        (copy / "job.json").write_text(json.dumps({"schema_version": 1, "job": {"checkpoint": {"dir": str(root)}}}))
        r = cli("gc", copy, "--keep", "1")
        assert r.exit_code == 2 and f"is a checkpoint root of the live run {tmp_path / 'run'}" in r.stderr, r.output
        assert [i.step for i in store.scan(root)] == [10, 20, 30]
    finally:
        claim.release()
    # Review 15: the live run's own run dir, whatever path its supervisor saw it by (a container's /workspace/run),
    # knows the steps its ranks load: gc through it goes on.
    from supervisor.lock import RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text(json.dumps({"schema_version": 1, "job": {"checkpoint": {"dir": str(root)}}}))
    with RootClaim(root, "/workspace/run", job="demo"), RunLock(run_dir):
        r = cli("gc", run_dir, "--keep", "2")
        assert r.exit_code == 0 and [i.step for i in store.scan(root)] == [20, 30], r.output
    r = cli("gc", root, "--keep", "1")
    assert r.exit_code == 0 and [i.step for i in store.scan(root)] == [30], r.output


def test_gc_removes_the_folders_a_commit_moved_aside_and_no_folder_of_the_users_named_alike(tmp_path, cli):
    """Audit 6: gc removed `.trash.keepme/important.txt`, a folder resilient never made."""
    root = tmp_path / "ckpt"
    for step in (20, 40):
        write_checkpoint(root, step)
    aside = store.aside_path(write_checkpoint(root, 10))
    os.rename(root / store.step_dirname(10), aside)
    pool = store.aside_path(root / store.SPARE_DIR)  # review 14: a spare pool's delete cut short was never listed
    (pool / "x").mkdir(parents=True)
    mine = [".trash.keepme", ".trash.keepme.1795831930123456789"]  # the second: "aside_path's form", not its names
    for name in mine:
        (root / name).mkdir()
        (root / name / "important.txt").write_text("mine")
    # Review 13: "$" matched before a final newline, so this was a second step 20 (and the real one went at keep 1).
    (root / "step_000000020\n").mkdir()
    r = cli("gc", root, "--keep", "2")
    assert r.exit_code == 0 and f"removed {aside.name}" in r.stdout, r.output
    assert not aside.exists() and all((root / name / "important.txt").read_text() == "mine" for name in mine)
    assert not pool.exists()
    assert [i.step for i in store.scan(root)] == [20, 40] and (root / "step_000000020\n").is_dir()
    r = cli("gc", root, "--keep", "1")
    assert r.exit_code == 0 and (root / "step_000000020\n").is_dir(), r.output
    assert [i.step for i in store.scan(root)] == [40]


def test_gc_where_no_checkpoint_is_valid_removes_abandoned_partials_only(tmp_path, cli):
    """With nothing valid left, gc deleted every damaged checkpoint and exited 0: all that remained of the run's
    progress (a bit flipped in a shard can be salvaged by hand; a deleted folder cannot). They are spared, named
    with the reason; an abandoned partial save still goes."""
    from tests.ckpt_helpers import truncate

    root = tmp_path / "ckpt"
    for step in (100, 200, 300):
        write_checkpoint(root, step)
    abandoned = write_checkpoint(root, 400, commit=False)
    flip_byte(root / store.step_dirname(100) / ".metadata", 3)
    truncate(root / store.step_dirname(200) / "__1_0.distcp")
    (root / store.step_dirname(300) / store.MARKER).unlink()
    before = [c["status"] for c in json.loads(cli("inspect-checkpoint", root, "--json").stdout)["checkpoints"]]
    assert before == ["corrupt", "corrupt", "corrupt", "incomplete"], before

    r = cli("gc", root, "--keep", "1", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["kept"] == [], r.output
    assert [x["step"] for x in doc["removed"]] == [400] and not abandoned.path.exists(), doc
    assert [x["step"] for x in doc["spared"]] == [100, 200, 300], doc
    assert all("no valid checkpoint is left here" in x["why"] for x in doc["spared"]), doc
    assert [p.name for p in store.checkpoint_dirs(root)] == [store.step_dirname(s) for s in (100, 200, 300)]
    # Once a valid checkpoint is there again, the damaged older ones go as before.
    write_checkpoint(root, 500)
    doc = json.loads(cli("gc", root, "--keep", "1", "--json").stdout)
    assert doc["kept"] == [500] and sorted(x["step"] for x in doc["removed"]) == [100, 200, 300], doc
