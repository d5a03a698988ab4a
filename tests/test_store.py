"""The checkpoint store: writing protocol, validation statuses, latest_valid and retention."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading

import pytest

from supervisor import retention, store
from supervisor.store import Status
from tests.ckpt_helpers import flip_byte, truncate, write_checkpoint


def test_layout_names_are_zero_padded_and_partials_never_match():
    assert store.step_dirname(50) == "step_000000050"
    assert store.partial_dirname(50) == "step_000000050.partial"
    assert store.STEP_RE.match("step_000000050")
    assert not store.STEP_RE.match("step_000000050.partial")
    assert not store.STEP_RE.match("step_50")


def test_commit_writes_manifest_last_and_publishes_folder(tmp_path):
    final = write_checkpoint(tmp_path, 10)
    assert final == tmp_path / "step_000000010"
    assert not (tmp_path / "step_000000010.partial").exists()
    doc = json.loads((final / store.MARKER).read_text())
    assert doc["step"] == 10 and doc["world_size"] == 2
    assert doc["checksum_algorithm"] == "xxh3_128"
    assert {f["name"] for f in doc["files"]} == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert doc["writer"]["resilient"]
    assert doc["extra"] == {"tokens_seen": 1000}
    assert not (final / store.WRITER_LOCK).exists()
    info = store.inspect(final, deep=True)
    assert info.status is Status.VALID, info.reason


def test_files_a_file_browser_or_nfs_leaves_beside_a_checkpoint_do_not_make_it_corrupt(tmp_path):
    final = write_checkpoint(tmp_path, 10)
    for name in (".DS_Store", "._.metadata", ".nfs000000000123abcd00000001", "Thumbs.db"):
        (final / name).write_bytes(b"x")
    assert store.inspect(final, deep=True).valid
    (final / ".nfs").write_bytes(b"x")  # not an NFS silly rename, and a folder is never litter
    (final / "._dir").mkdir()
    info = store.inspect(final)
    assert info.status is Status.CORRUPT and info.reason == "unlisted file ._dir and 1 more"


def test_commit_refuses_unlisted_or_short_files(tmp_path):
    partial = store.begin(tmp_path, 5)
    (partial.path / "a").write_bytes(b"xxxx")
    (partial.path / "stray").write_bytes(b"y")
    records = store.describe_files(partial.path, ["a"])
    with pytest.raises(RuntimeError, match="unlisted"):
        partial.commit(1, records)
    with pytest.raises(RuntimeError, match="record says"):
        partial.commit(1, [store.FileRecord("a", 99, "0")])
    assert not (tmp_path / "step_000000005").exists()


def test_commit_replaces_an_older_folder_of_the_same_step(tmp_path):
    first = write_checkpoint(tmp_path, 20)
    truncate(first / "__0_0.distcp")
    assert store.inspect(first).status is Status.CORRUPT
    again = write_checkpoint(tmp_path, 20)
    assert store.inspect(again, deep=True).valid
    assert store.trash_dirs(tmp_path) == []


def test_a_step_saved_again_is_swapped_in_whole_so_a_crash_leaves_one_of_them_as_the_step(tmp_path, monkeypatch):
    """Review 13: the older folder was renamed aside, then the new one into place; a crash between the two left no
    step_N, and both were deleted later as partials. The two now swap in one rename (renameat2 on this machine's
    filesystems); a crash right after it leaves the new save as the step."""
    from supervisor import fsutil

    write_checkpoint(tmp_path, 20)
    old_metadata = (tmp_path / store.step_dirname(20) / ".metadata").read_bytes()
    partial = write_checkpoint(tmp_path, 20, commit=False, close=False)
    (partial.path / ".metadata").write_bytes(b"the new save")
    records = store.describe_files(partial.path, ["__0_0.distcp", "__1_0.distcp", ".metadata"])
    (tmp_path / "x").mkdir()
    (tmp_path / "y").write_text("y")
    assert fsutil.exchange(tmp_path / "x", tmp_path / "y") and (tmp_path / "x").read_text() == "y"  # here it swaps
    real_rename = os.rename

    def crash_after_the_swap(a, b):
        raise KeyboardInterrupt("killed")  # the first rename after the swap: the old folder aside

    monkeypatch.setattr(store.os, "rename", crash_after_the_swap)
    with pytest.raises(KeyboardInterrupt):
        partial.commit(2, records)
    monkeypatch.setattr(store.os, "rename", real_rename)
    now = store.inspect(tmp_path / store.step_dirname(20), deep=True)
    assert now.valid and (now.path / ".metadata").read_bytes() == b"the new save", now.reason
    left = store.inspect(tmp_path / store.partial_dirname(20))
    assert left.partial and not left.valid and (left.path / ".metadata").read_bytes() == old_metadata
    assert [i.step for i in store.scan(tmp_path) if i.valid] == [20]


def test_begin_waits_out_a_scan_that_holds_the_new_partials_lock_for_an_instant(tmp_path, monkeypatch):
    """Review 13: writer_alive (status, gc, retention) takes the lock for an instant; between begin's open and its
    flock that failed the save as "another writer took the lock"."""
    import fcntl

    real_open = os.open

    def scanned_at_once(path, flags, mode=0o777, **kw):
        fd = real_open(path, flags, mode, **kw)
        if str(path).endswith(store.WRITER_LOCK):
            scan = real_open(path, os.O_RDONLY)
            fcntl.flock(scan, fcntl.LOCK_EX | fcntl.LOCK_NB)
            threading.Timer(0.05, os.close, (scan,)).start()
        return fd

    monkeypatch.setattr(store.os, "open", scanned_at_once)
    partial = store.begin(tmp_path, 10)
    monkeypatch.undo()
    assert store.writer_alive(partial.path) == os.getpid()
    partial.close()


def test_begin_removes_a_dead_writers_partial_but_not_a_live_one(tmp_path):
    live = write_checkpoint(tmp_path, 30, commit=False, close=False)
    assert store.writer_alive(live.path) == os.getpid()
    with pytest.raises(RuntimeError, match="live writer"):
        store.begin(tmp_path, 30)
    live.close()
    assert store.writer_alive(live.path) is None
    fresh = store.begin(tmp_path, 30)
    assert list(fresh.path.iterdir()) == [fresh.path / store.WRITER_LOCK]
    fresh.close()


def test_every_status_and_reason(zoo):
    got = {(i.step, i.partial): i for i in store.scan(zoo)}
    expect = {
        (10, False): (Status.VALID, "sizes match"),
        (20, False): (Status.CORRUPT, "no completion marker, yet named as committed"),
        (30, False): (Status.CORRUPT, "__1_0.distcp is 4087 bytes, manifest says 4097 (truncated)"),
        (35, False): (Status.CORRUPT, ".metadata checksum mismatch"),
        (40, False): (Status.VALID, "sizes match, 1 small file(s) checksummed"),
        (50, False): (Status.CORRUPT, "completion marker is unreadable: not valid JSON"),
        (60, False): (Status.CORRUPT, "unlisted file notes.txt"),
        (70, True): (Status.INCOMPLETE, "partial save, never committed"),
    }
    assert set(got) == set(expect)
    for key, (status, reason) in expect.items():
        assert got[key].status is status, (key, got[key].reason)
        assert reason in got[key].reason, (key, got[key].reason)
    assert store.latest_valid(zoo).step == 40
    deep = {i.step: i for i in store.scan(zoo, deep=True)}
    assert deep[40].status is Status.CORRUPT and "checksum mismatch" in deep[40].reason
    assert deep[10].status is Status.VALID
    assert store.latest_valid(zoo, deep=True).step == 10


def test_latest_valid_never_returns_an_invalid_folder(zoo):
    for below in (None, 80, 40, 11):
        info = store.latest_valid(zoo, below=below)
        assert info is not None and info.valid
        assert store.inspect(info.path).valid
    assert store.latest_valid(zoo, below=10) is None
    assert store.latest_valid(zoo / "missing") is None


def test_a_marker_for_another_step_is_corrupt(tmp_path):
    a = write_checkpoint(tmp_path, 1)
    b = write_checkpoint(tmp_path, 2)
    (b / store.MARKER).write_bytes((a / store.MARKER).read_bytes())
    info = store.inspect(b)
    assert info.status is Status.CORRUPT and "marker says step 1" in info.reason


def test_retention_keeps_newest_valid_and_spares_live_partials(zoo):
    infos = store.scan(zoo)
    p = retention.plan(zoo, infos, keep=1, owner_alive=False)
    assert [i.step for i in p.kept] == [40]
    removed = {r.step for r in p.remove}
    # Damaged folders newer than the newest valid stay in any case (audit 15: one stray file, notes.txt in 60, made
    # gc delete an intact newest save): the run's newest state, salvageable by hand. An abandoned partial goes.
    assert removed == {10, 20, 30, 35, 70}
    assert {c.step: why.split(" (")[0] for c, why in p.spared} == {50: "corrupt", 60: "corrupt"}
    # With a live supervisor, the partial too.
    p = retention.plan(zoo, infos, keep=1, owner_alive=True)
    assert {r.step for r in p.remove} == {10, 20, 30, 35}
    assert {c.step for c, _ in p.spared} == {50, 60, 70}
    with pytest.raises(ValueError):
        retention.plan(zoo, infos, keep=0, owner_alive=False)


def test_retention_leaves_a_folder_named_like_a_checkpoint_that_holds_no_checkpoint_file(tmp_path):
    """Audit 15: a user's step_000000007/notes.txt, in a root a job was pointed at, was deleted as "corrupt: no
    completion marker". A save's folder cut short holds DCP files, and still goes."""
    write_checkpoint(tmp_path, 10)
    (tmp_path / "step_000000007").mkdir()
    (tmp_path / "step_000000007" / "notes.txt").write_text("mine")
    cut = write_checkpoint(tmp_path, 5)
    os.unlink(cut / store.MARKER)
    (tmp_path / "step_000000020").mkdir()  # review 14: newer than the newest valid, it was "damaged, newer"
    (tmp_path / "step_000000020" / "notes.txt").write_text("mine")
    p = retention.plan(tmp_path, store.scan(tmp_path), keep=1, owner_alive=False)
    assert [r.step for r in p.remove] == [5]
    assert [(c.step, why.split(": ")[-1]) for c, why in p.spared] == [(7, "remove it by hand"),
                                                                      (20, "remove it by hand")]
    from supervisor.resume import choose_resume

    choice = choose_resume(tmp_path, "size")
    assert choice.step == 10 and choice.corrupt == []  # passed over, and not set aside with a QUARANTINE.json


def test_retention_never_touches_a_partial_with_a_live_writer(tmp_path):
    write_checkpoint(tmp_path, 1)
    live = write_checkpoint(tmp_path, 0, commit=False, close=False)  # older than newest valid, but live
    p = retention.plan(tmp_path, store.scan(tmp_path), keep=1, owner_alive=False)
    assert p.remove == [] and "in progress" in p.spared[0][1]
    live.close()
    p = retention.plan(tmp_path, store.scan(tmp_path), keep=1, owner_alive=True)
    assert [r.step for r in p.remove] == [0]
    done = retention.apply(p)
    assert done.freed_bytes > 0 and done.failed == [] and not live.path.exists()


def test_a_changed_byte_inside_the_marker_that_keeps_it_valid_json_is_found(tmp_path):
    final = write_checkpoint(tmp_path, 10)
    marker = final / store.MARKER
    text = marker.read_text()
    marker.write_text(text.replace('"world_size": 2', '"world_size": 3'))  # same length, still JSON
    info = store.inspect(final)
    assert info.status is Status.CORRUPT and "own checksum" in info.reason


def test_a_cached_scan_checksums_only_what_changed_and_sees_every_change(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    for step in (10, 20, 30):
        write_checkpoint(root, step)
    read = []
    real = store.checksum_file
    monkeypatch.setattr(store, "checksum_file", lambda path, *a: read.append(path.parent.name) or real(path, *a))
    cache = store.InspectCache()
    assert [i.valid for i in store.scan(root, cache=cache)] == [True, True, True] and len(read) == 9
    read.clear()
    assert [i.valid for i in store.scan(root, cache=cache)] == [True, True, True] and read == []  # nothing changed
    flip_byte(root / store.step_dirname(20) / "__1_0.distcp", 5)   # a write: its times change, so it is read again
    infos = store.scan(root, cache=cache)
    assert [i.status for i in infos] == [Status.VALID, Status.CORRUPT, Status.VALID], infos
    assert set(read) == {store.step_dirname(20)}
    read.clear()
    shutil.copy2(root / store.step_dirname(30) / ".metadata", tmp_path / "m")
    (root / store.step_dirname(30) / ".metadata").write_bytes(b"metadata-31")  # same size, then its old times back
    st = os.stat(tmp_path / "m")
    os.utime(root / store.step_dirname(30) / ".metadata", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store.scan(root, cache=cache)[2].status is Status.CORRUPT  # the change time gives it away
    shutil.rmtree(root / store.step_dirname(10))
    write_checkpoint(root, 10)                                     # the same name, written anew
    read.clear()
    assert store.scan(root, cache=cache)[0].valid and set(read) == {store.step_dirname(10), store.step_dirname(20),
                                                                     store.step_dirname(30)}
    other = tmp_path / "other"                                     # one cache, two roots (the replicator's tiers)
    write_checkpoint(other, 40)
    assert store.scan(other, cache=cache)[0].valid
    read.clear()
    store.scan(root, cache=cache), store.scan(other, cache=cache)
    assert read == [store.step_dirname(20)] * 3 + [store.step_dirname(30)], read  # the two corrupt ones only


def test_quarantine_renames_aside_with_the_reason_and_nothing_else_sees_it(tmp_path):
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    flip_byte(bad / ".metadata", 3)
    moved = store.quarantine(bad, ".metadata checksum mismatch")
    assert moved.name == "step_000000020.quarantined" and not bad.exists()
    assert store.latest_valid(tmp_path).step == 10 and [i.step for i in store.scan(tmp_path)] == [10]
    listed = store.scan(tmp_path, quarantined=True)
    assert [(i.step, i.quarantined, i.status) for i in listed] == [(10, False, Status.VALID),
                                                                   (20, True, Status.CORRUPT)]
    assert listed[1].reason == "quarantined: .metadata checksum mismatch"
    # Its marker still says who wrote it, and when: not the time it was set aside (audit).
    assert listed[1].world_size == 2 and listed[1].created_at == listed[1].manifest.created_at
    again = store.quarantine(write_checkpoint(tmp_path, 20), "again")  # the same step set aside twice
    assert again.name == "step_000000020.quarantined.2" and moved.exists()
    # Retention never deletes one: it is evidence.
    plan = retention.plan(tmp_path, store.scan(tmp_path, quarantined=True), keep=1, owner_alive=False)
    assert {i.path for i, _ in plan.spared} == {moved, again} and plan.remove == []


def test_two_runs_cannot_claim_one_checkpoint_root_but_one_runs_nodes_can(tmp_path):
    from supervisor.errors import RunLockedError
    from supervisor.lock import RootClaim

    root = tmp_path / "shared-ckpt"
    first = RootClaim(root, tmp_path / "run-a").acquire()
    node_b = RootClaim(root, tmp_path / "run-a").acquire()  # another node of the same run
    with pytest.raises(RunLockedError, match=r"checkpoint root of another live run \(.*run-a"):
        RootClaim(root, tmp_path / "run-b").acquire()
    first.release()
    node_b.release()
    RootClaim(root, tmp_path / "run-b").acquire().release()  # once the first run is gone, the root is free


def test_two_nodes_of_one_run_cannot_claim_one_local_tier_and_each_refusal_names_its_key(tmp_path):
    """Two nodes on one host with one local_dir (no {node} in it) crash-looped on each other's partial saves, told
    that "two jobs must not share a checkpoint root" (audit)."""
    from supervisor.errors import RunLockedError
    from supervisor.lock import RootClaim

    local = tmp_path / "shm"
    a = RootClaim(local, tmp_path / "run", "checkpoint.local_dir", node="a").acquire()
    RootClaim(local, tmp_path / "run", "checkpoint.local_dir", node="a").acquire().release()  # node a again: its own
    with pytest.raises(RunLockedError, match=r"is the local tier of node a of this run \(supervisor pid \d+ on .*\); "
                                             r"each node needs its own: put \{node\} in checkpoint.local_dir"):
        RootClaim(local, tmp_path / "run", "checkpoint.local_dir", node="b").acquire()
    with pytest.raises(RunLockedError, match=r"give this job its own checkpoint\.local_dir, or stop the other run"):
        RootClaim(local, tmp_path / "other-run", "checkpoint.local_dir", node="a").acquire()
    a.release()
    RootClaim(local, tmp_path / "run", "checkpoint.local_dir", node="b").acquire().release()


def test_a_local_tier_wiped_while_its_run_holds_it_is_claimed_again(tmp_path):
    """Audit 13: wiped mid-run, the tier was made again by the ranks' next save with neither the record of whose
    checkpoints it holds nor the run's lock: the next job given it resumed from this job's weights."""
    import shutil

    from supervisor.errors import ConfigError, RunLockedError
    from supervisor.lock import OWNER_FILE, OWNERS_DIR, RootClaim

    durable, local = tmp_path / "alpha-ckpt", tmp_path / "shm" / "n1"
    claim = RootClaim(local, tmp_path / "run-a", "checkpoint.local_dir", node="n1", job="alpha", durable=durable)
    claim.acquire()
    try:
        claim.reassert()  # nothing gone: nothing made
        shutil.rmtree(local)
        write_checkpoint(local, 400)  # the ranks' next save makes the folder again
        assert not (local / OWNERS_DIR).exists()
        claim.reassert()
        assert json.loads((local / OWNERS_DIR / OWNER_FILE).read_text())["job"] == "alpha"
        other = RootClaim(local, tmp_path / "run-b", "checkpoint.local_dir", node="n1", job="beta", durable=durable)
        with pytest.raises(ConfigError, match="holds checkpoints of job 'alpha'"):
            other.acquire()
        second_run = RootClaim(local, tmp_path / "run-b", "checkpoint.local_dir", node="n1", job="alpha",
                               durable=durable)
        with pytest.raises(RunLockedError, match="another live run"):  # the run's lock is back too
            second_run.acquire()
    finally:
        claim.release()
    with pytest.raises(ConfigError, match="holds checkpoints of job 'alpha'"):  # and once the run has ended
        other.refuse_if_taken()


def test_a_wiped_root_another_run_took_meanwhile_is_not_joined_and_the_run_is_told(tmp_path):
    """Wiped mid-run and taken by a new run within the second before this run looked: this run held it again beside
    the other, without a word, and both wrote checkpoints there."""
    import shutil

    from supervisor.lock import OWNERS_DIR, RootClaim

    root = tmp_path / "ckpt"
    mine = RootClaim(root, tmp_path / "run-a", job="alpha").acquire()
    try:
        shutil.rmtree(root)
        other = RootClaim(root, tmp_path / "run-b", job="beta").acquire()
        try:
            said = mine.reassert()
            assert said is not None and said.startswith(f"{root} (checkpoint.dir) was emptied while this run used it "
                                                        f"and is now held by the live run {tmp_path / 'run-b'} "
                                                        f"(supervisor pid {os.getpid()} on ")
            assert said.endswith("stop one of them and give each its own checkpoint.dir")
            assert [p.name for p in (root / OWNERS_DIR).glob("*.lock") if p.name != "claim.lock"] == [other._name()]
        finally:
            other.release()
        write_checkpoint(root, 10)  # the other run's, recorded as job beta's: still not this run's to take
        said = mine.reassert()
        assert said is not None and "is now held by job 'beta':" in said, said
    finally:
        mine.release()


def test_a_wiped_durable_root_is_held_again_by_every_node_of_the_run(tmp_path):
    """Review 11: after node a made the run's claim file again, node b still held the unlinked old one; once a
    ended, nothing held the root for the live run, and another run could take it."""
    import shutil

    from supervisor.errors import RunLockedError
    from supervisor.lock import RootClaim

    root = tmp_path / "ckpt"
    a = RootClaim(root, tmp_path / "run", job="alpha").acquire()
    b = RootClaim(root, tmp_path / "run", job="alpha").acquire()  # another node of the same run
    try:
        shutil.rmtree(root)
        a.reassert()
        b.reassert()
        a.release()
        with pytest.raises(RunLockedError, match="another live run"):
            RootClaim(root, tmp_path / "other-run", job="alpha").acquire()
    finally:
        a.release()
        b.release()


def test_a_root_holding_another_jobs_checkpoints_is_refused_even_when_no_run_holds_it(tmp_path):
    """Audit 7: job beta given job alpha's local_dir (the README's `/local_nvme/{node}`) resumed from alpha's weights,
    and a third job copied alpha's step into its own durable tier; a job of another name took alpha's durable root
    and its retention deleted alpha's steps. A root records whose checkpoints it holds."""
    from supervisor.errors import ConfigError
    from supervisor.lock import RootClaim

    durable, local = tmp_path / "alpha-ckpt", tmp_path / "nvme" / "n1"
    RootClaim(durable, tmp_path / "run-a", job="alpha").acquire().release()
    RootClaim(local, tmp_path / "run-a", "checkpoint.local_dir", node="n1", job="alpha", durable=durable) \
        .acquire().release()
    for root in (durable, local):
        write_checkpoint(root, 60)
    says = (r"nvme/n1 holds checkpoints of job 'alpha', which this run would resume from as its own; nothing was "
            r"launched\. Give this job its own checkpoint\.local_dir \(a folder per job, e\.g\. "
            r"/local_nvme/beta/\{node\}\)")
    with pytest.raises(ConfigError, match=says):
        RootClaim(local, tmp_path / "run-b", "checkpoint.local_dir", node="n1", job="beta",
                  durable=tmp_path / "beta-ckpt").refuse_if_taken()
    with pytest.raises(ConfigError, match=r"alpha-ckpt holds checkpoints of job 'alpha'.*checkpoint\.dir"):
        RootClaim(durable, tmp_path / "run-b", job="beta").acquire()
    # The same job from a new run dir that copies to another durable root: the local tier is not its cache.
    with pytest.raises(ConfigError, match=r"holds checkpoints of this job's run that copies them to .*alpha-ckpt"):
        RootClaim(local, tmp_path / "run-c", "checkpoint.local_dir", node="n1", job="alpha",
                  durable=tmp_path / "new-ckpt").acquire()
    # A copy of the run dir sharing the outside durable root (same job) takes both, as before.
    RootClaim(durable, tmp_path / "copy-of-run-a", job="alpha").acquire().release()
    RootClaim(local, tmp_path / "copy-of-run-a", "checkpoint.local_dir", node="n1", job="alpha", durable=durable) \
        .acquire().release()
    # Emptied, or never recorded (written before records were kept): the new job's to take, and recorded.
    shutil.rmtree(local / store.step_dirname(60))
    RootClaim(local, tmp_path / "run-b", "checkpoint.local_dir", node="n1", job="beta", durable=tmp_path / "b") \
        .acquire().release()
    legacy = tmp_path / "legacy"
    write_checkpoint(legacy, 20)
    RootClaim(legacy, tmp_path / "run-b", job="beta").acquire().release()
    with pytest.raises(ConfigError, match="holds checkpoints of job 'beta'"):
        RootClaim(legacy, tmp_path / "run-a", job="alpha").acquire()


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_written_over_a_spare_holds_exactly_the_new_bytes_and_never_writes_through_a_link(tmp_path, direct):
    """HashedFile(reuse=True) writes over a longer old file (its pages reused) and cuts the tail; a spare that is
    a symlink or shares its inode with another name is replaced, so the file it points at is never touched."""
    from supervisor.fsutil import HashedFile, page_aligned_buffer

    new = page_aligned_buffer(3 * 4096 + 100)  # whole pages (O_DIRECT may take them), then a short tail
    new[:] = os.urandom(len(new))
    target = tmp_path / "__0_0.distcp"
    target.write_bytes(b"\xff" * (5 * 4096))
    outside, linked = tmp_path / "outside.bin", tmp_path / "linked.bin"
    for victim in (outside, linked):
        victim.write_bytes(b"keep me")

    def write(path, reuse=True):
        f = HashedFile(path, store.hasher(), direct=direct, reuse=reuse)
        f.write(new[:3 * 4096], aligned=True)
        f.write(new[3 * 4096:3 * 4096 + 100])
        return f.reuse, f.close()

    expected = store.hasher()
    expected.update(bytes(new[:3 * 4096 + 100]))
    assert write(target) == (True, expected.hexdigest())
    assert target.read_bytes() == bytes(new[:3 * 4096 + 100])

    target.unlink()
    target.symlink_to(outside)
    assert write(target)[0] is False and not target.is_symlink()
    os.unlink(target)
    os.link(linked, target)
    assert write(target)[0] is False and target.read_bytes() == bytes(new[:3 * 4096 + 100])
    assert outside.read_bytes() == linked.read_bytes() == b"keep me"


def test_a_spare_pool_that_is_a_link_is_never_followed(tmp_path):
    """`.spare` as a symlink to a folder outside the tier: retention moves nothing there, a save claims nothing
    from it, and dropping the pool removes the link, not what it points at."""
    root, outside = tmp_path / "local", tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "__0_0.distcp.x").write_bytes(b"not the tier's")
    write_checkpoint(root, 1)
    (root / store.SPARE_DIR).symlink_to(outside)
    aside = root / ".trash.step_000000001"
    os.rename(root / store.step_dirname(1), aside)
    assert store.keep_spare(aside, root, 1 << 30) == 0 and (aside / "__0_0.distcp").exists()
    assert store.spare_sizes(root) == {} and not store.claim_spare(root, tmp_path / "__0_0.distcp")
    store.drop_spares(root)
    assert not (root / store.SPARE_DIR).is_symlink() and (outside / "__0_0.distcp.x").read_bytes() == b"not the tier's"


def _answers(fn, fifos, timeout=10.0):
    """fn() run in a thread: its answer, failing the test if it waits on one of `fifos` (which are then opened for
    writing, so the thread ends and none is left behind)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    t.start()
    t.join(timeout)
    hung = t.is_alive()
    if hung:
        for f in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout)
    assert not hung, f"waited on a FIFO: {fifos}"
    return out["v"]


def test_a_fifo_or_a_link_in_a_checkpoint_is_never_waited_on_nor_read_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpt"
    # The marker a FIFO: every reader of the root used to hang on it.
    fifo_marker = write_checkpoint(root, 1)
    (fifo_marker / store.MARKER).unlink()
    os.mkfifo(fifo_marker / store.MARKER)
    # A listed file a link to a copy of itself outside: same size, same checksum, yet not the checkpoint's bytes.
    linked = write_checkpoint(root, 2)
    data = linked / "__0_0.distcp"
    (outside / "copy").write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside / "copy")
    # A set-aside checkpoint whose QUARANTINE.json is a FIFO, and a partial save whose writer lock is one.
    aside = store.quarantine(write_checkpoint(root, 3), "test")
    (aside / store.QUARANTINE_FILE).unlink()
    os.mkfifo(aside / store.QUARANTINE_FILE)
    partial = write_checkpoint(root, 4, commit=False).path
    (partial / store.WRITER_LOCK).unlink()
    os.mkfifo(partial / store.WRITER_LOCK)
    fifos = [fifo_marker / store.MARKER, aside / store.QUARANTINE_FILE, partial / store.WRITER_LOCK]

    infos = _answers(lambda: [store.inspect(p, deep=True) for p in store.checkpoint_dirs(root, quarantined=True)],
                     fifos)
    by_step = {i.step: i for i in infos}
    assert by_step[1].status is Status.CORRUPT and "not a regular file" in by_step[1].reason, by_step[1]
    assert by_step[2].status is Status.CORRUPT and "__0_0.distcp is not a regular file" in by_step[2].reason
    assert by_step[3].status is Status.CORRUPT and "QUARANTINE.json is missing or unreadable" in by_step[3].reason
    assert by_step[4].status is Status.INCOMPLETE and "cannot be checked" in by_step[4].reason, by_step[4]
    assert store.latest_valid(root) is None
    # gc: a partial whose lock cannot be checked is spared (nobody can show its writer dead).
    plan = _answers(lambda: retention.plan(root, store.scan(root), keep=1, owner_alive=False), fifos)
    assert partial not in {r.path for r in plan.remove}, plan
    assert any(i.path == partial and "cannot be checked" in why for i, why in plan.spared), plan.spared
    assert (outside / "copy").exists()


def test_only_ascii_digits_name_a_step_and_impossible_marker_values_are_corrupt(tmp_path):
    assert store.STEP_RE.match("step_000000002")
    assert not store.STEP_RE.match("step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0662")  # Arabic-Indic
    (tmp_path / "step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0662").mkdir()
    assert store.checkpoint_dirs(tmp_path) == []

    for field, value in [("created_at_unix", 1e20), ("created_at_unix", float("nan")), ("step", -1)]:
        path = write_checkpoint(tmp_path / field / str(value), 7)
        doc = json.loads((path / store.MARKER).read_text())
        doc.pop("marker_checksum")  # an older marker, without its own checksum
        doc[field] = value
        (path / store.MARKER).write_text(json.dumps(doc))
        info = store.inspect(path)
        assert info.status is Status.CORRUPT, (field, value, info)
    path = write_checkpoint(tmp_path / "huge", 8)
    doc = json.loads((path / store.MARKER).read_text())
    doc.pop("marker_checksum")
    (path / store.MARKER).write_text(json.dumps(doc).replace('"size": 4096', '"size": 1e999', 1))
    info = store.inspect(path)
    assert info.status is Status.CORRUPT and "field files[1].size is missing or not an integer" in info.reason, info
    assert store.iso(1e20) == "?" and store.iso(float("nan")) == "?"


def test_a_committed_checkpoint_is_readable_as_the_umask_says_and_the_job_file_stays_private(tmp_path):
    """The marker was written 0600 (mkstemp) beside 0644 data files: another account (an eval job) saw every
    checkpoint as unreadable. The job file keeps 0600: its env may hold a token."""
    import os
    import stat

    from supervisor.fsutil import atomic_write_json

    partial = store.begin(tmp_path, 10)
    (partial.path / "data.bin").write_bytes(b"x" * 10)
    final = partial.commit(1, store.describe_files(partial.path, ["data.bin"]))
    as_open = stat.S_IMODE(os.stat(final / "data.bin").st_mode)  # the umask's (and a default ACL's) mode
    assert stat.S_IMODE(os.stat(final / store.MARKER).st_mode) == as_open  # 0644 under the usual umask
    atomic_write_json(tmp_path / "job.json", {"env": {"TOKEN": "x"}}, private=True)
    assert stat.S_IMODE(os.stat(tmp_path / "job.json").st_mode) == 0o600


@pytest.mark.parametrize("seed", range(6))
def test_piece_sums_built_from_a_stream_fed_in_any_blocks_match_each_items_own_pieces(tmp_path, seed):
    """The writer sums items as their bytes stream past, in blocks that cut items anywhere, items overlapping (one
    tensor under two names), empty ones too; the table at the file's end gives each back by (offset, length) and
    every piece checks, and a changed byte fails exactly its own piece."""
    import random

    rng = random.Random(seed)
    data = rng.randbytes(5000)
    piece = rng.choice([7, 64, 1000, 1 << 20])
    items = sorted({(o, min(rng.randint(0, 1500), 5000 - o)) for o in rng.sample(range(5000), 12)})
    items += [items[0], (0, 0)]  # an alias, and an empty item
    summer = store.PieceSummer(items, piece)
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 900)
        summer.feed(pos, memoryview(data)[pos:pos + n])
        pos += n
    sums = summer.sums()
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data + store.sums_trailer([(o, n, s) for (o, n), s in zip(items, sums, strict=True)]))
    with open(path, "rb") as f:
        table = store.read_sums_trailer(f.fileno(), path.name)
    for (offset, length), s in zip(items, sums, strict=True):
        assert table[(offset, length)] == s
        own = data[offset:offset + length]
        assert len(s.digests) == max(1, -(-length // piece))
        s.check_all(own, "item")
        if length:
            at = rng.randrange(length)
            bad = bytearray(own)
            bad[at] ^= 1
            with pytest.raises(store.PieceMismatch, match=f"item: its bytes {at // piece * piece}-"):
                s.check_all(bytes(bad), "item")


def test_a_data_file_without_its_table_of_checksums_says_so(tmp_path):
    path = tmp_path / "__0_0.distcp"

    def table_of(content: bytes) -> dict:
        path.write_bytes(content)
        fd = os.open(path, os.O_RDONLY)
        try:
            return store.read_sums_trailer(fd, path.name)
        finally:
            os.close(fd)

    with pytest.raises(store.PieceMismatch, match=r"__0_0\.distcp: its table of checksums is not at its end"):
        table_of(b"x" * 100)
    with pytest.raises(store.PieceMismatch, match=r"__0_0\.distcp: its table of checksums does not parse"):
        table_of(b"{not json" + (9).to_bytes(8, "little") + store.SUMS_MAGIC)
    assert table_of(b"data" + store.sums_trailer([])) == {}
    whole = store.sums_trailer([(0, 4, store.PieceSums(store.CHECKSUM_ALGORITHM, 64, (b"0123456789abcdef",)))])
    assert table_of(b"data" + whole)[(0, 4)].piece == 64
    for good, bad in ((b'"piece":64', b'"piece":0,'), (b'"piece":64', b'"piece":"x"'),
                      (b'"xxh3_128"', b'"xxh3_129"')):  # the same length: only the field is damaged
        with pytest.raises(store.PieceMismatch, match=r"its table of checksums does not parse .*the file was damaged"):
            table_of(b"data" + whole.replace(good, bad))


@pytest.mark.parametrize("owner_alive", [False, True])
def test_a_save_being_committed_is_held_by_its_writer_until_it_is_a_checkpoint(tmp_path, monkeypatch, owner_alive):
    """Review 13: publish unlinked the writer's lock before it wrote the marker and renamed the folder; retention in
    that window (a gc with no live owner, or a live owner's save below a newer valid step after a rollback) took the
    partial for an abandoned one and deleted it: the save was lost and rank 0 failed. A crash just after the commit
    leaves the lock file in the checkpoint, which stays valid."""
    from supervisor import retention

    root = tmp_path / "ckpt"
    write_checkpoint(root, 10)
    if owner_alive:
        write_checkpoint(root, 100)  # an abandoned timeline's newer step
    p = store.begin(root, 20)
    (p.path / "__0_0.distcp").write_bytes(b"y" * 100)
    records = store.describe_files(p.path, ["__0_0.distcp"])
    real, seen = store.atomic_write_bytes, {}

    def gc_in_the_window(path, data, **kw):
        if path.name == store.MARKER and not seen:
            seen["alive"] = store.writer_alive(path.parent)
            plan = retention.plan(root, store.scan(root), keep=5, owner_alive=owner_alive)
            seen["removed"] = [r.path.name for r in plan.remove]
            retention.apply(plan)
        return real(path, data, **kw)

    monkeypatch.setattr(store, "atomic_write_bytes", gc_in_the_window)
    final = p.commit(1, records)
    assert seen == {"alive": os.getpid(), "removed": []}
    assert store.inspect(final).valid and not (final / store.WRITER_LOCK).exists()
    (final / store.WRITER_LOCK).write_text("{}")  # as a crash between the rename and the lock file's removal
    assert store.inspect(final, deep=True).valid


def test_a_shared_root_whose_mount_keeps_flock_on_each_node_is_told_apart():
    """Review 13: every lock resilient takes between nodes is a flock; on Lustre's localflock or NFS's nolock /
    local_lock those exclude nothing across hosts, and a multi-node run is warned."""
    from supervisor.fsutil import node_local_locks

    info = ("22 27 0:21 / /proc rw,relatime - proc proc rw\n"
            "30 27 0:40 / /shared rw,relatime - lustre mds@tcp:/fs rw,localflock\n"
            "31 30 0:41 / /shared/nfs rw,relatime - nfs4 srv:/x rw,vers=4.2,local_lock=all\n"
            "32 27 0:42 / /home rw,relatime - nfs4 srv:/home rw,vers=4.2,local_lock=none\n"
            "33 27 0:43 / /ok\\040dir rw,nolock - nfs srv:/ok rw\n")
    assert node_local_locks("/shared/ckpt", info) == "lustre with localflock"
    assert node_local_locks("/shared/nfs/run/ckpt", info) == "nfs4 with local_lock=all"
    assert node_local_locks("/home/u/ckpt", info) is None
    assert node_local_locks("/ok dir/ckpt", info) == "nfs with nolock"
    assert node_local_locks("/tmp/x", info) is None


def test_a_save_of_a_step_whose_name_a_strangers_folder_holds_moves_that_folder_off_it_whole(tmp_path):
    """Audit 17: gc and retention left a user's step_000000100/notes.txt alone, and then the run's save of step 100
    swapped itself in and deleted the folder with the user's file in it, without a word."""
    (tmp_path / "step_000000100").mkdir()
    (tmp_path / "step_000000100" / "notes.txt").write_text("mine")
    final = write_checkpoint(tmp_path, 100)
    assert store.inspect(final, deep=True).valid
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("step_000000100.not-resilient.")]
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "mine"
    assert [i.step for i in store.scan(tmp_path, quarantined=True)] == [100]  # no scan takes it for a checkpoint
    assert [why.startswith("someone else's folder") for name, why in store.passed_over(tmp_path)] == [True]


def test_a_writer_lock_that_is_a_folder_is_taken_as_held_not_gone(tmp_path):
    """Review 15: opened for writing, a folder there failed with EISDIR and read as "writer gone", so gc deleted
    the partial; uncheckable, it is spared as before."""
    partial = write_checkpoint(tmp_path, 10, commit=False)
    os.unlink(partial.path / store.WRITER_LOCK)
    (partial.path / store.WRITER_LOCK).mkdir()
    assert store.writer_alive(partial.path) == store.UNCHECKABLE
