"""Replication from node-local tiers to the durable tier, on real folders without processes: two nodes'
parts assemble one durable checkpoint, which is never valid before the last part; a damaged local copy is
never vouched for; an unwritable durable tier is retried and reported; local retention keeps what has no
durable copy."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from supervisor import store
from supervisor.replicate import PARTS, LocalSaveReplaced, Replicator
from tests.ckpt_helpers import truncate

NODES = {"a": [0, 1], "b": [2, 3]}


def drained(r: Replicator, *notified: int, timeout: float = 30.0) -> bool:
    """Start `r`, tell it of the `notified` commits, and wait up to `timeout` for its queue to empty; it is
    stopped in every case."""
    r.start()
    try:
        for step in notified:
            r.notify(step)
        return r.drain(timeout)
    finally:
        r.stop()


def local_checkpoint(root: Path, step: int, node: str, ranks: dict[str, list[int]] = NODES, salt: str = "") -> Path:
    """What the ranks of `node` commit to its local tier: their shards, every rank's small file, the metadata."""
    partial = store.begin(root, step)
    world = sum(len(r) for r in ranks.values())
    names = [f"__{r}_0.distcp" for r in ranks[node]] + [f"__{r}_1.distcp" for r in range(world)] + [".metadata"]
    for name in names:
        # The shared files (small files, metadata) hold the same bytes on every node, as the ranks send them.
        shared = name.endswith("_1.distcp") or name == ".metadata"
        seed = f"{name}-{step}{salt}" if shared else f"{name}-{step}-{node}{salt}"
        # Shards past SMALL_FILE_BYTES, as real ones: a size check does not read them, the copy does.
        (partial.path / name).write_bytes(seed.encode() * (100 if shared else (2 << 20) // len(seed)))
    records = store.describe_files(partial.path, names)
    return partial.commit(world, records, extra={"tier": "local", "node": node, "nodes": sorted(ranks),
                                                 "ranks": ranks})


def replicator(tmp_path: Path, node: str, **kw) -> Replicator:
    return Replicator(tmp_path / f"local-{node}", tmp_path / "durable", node, keep_local=kw.get("keep_local", 2),
                      keep=3, outage_s=kw.get("outage_s", 3600.0))


def test_two_nodes_parts_make_one_durable_checkpoint_valid_only_when_the_last_part_lands(tmp_path):
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 10, node)
    a, b = replicator(tmp_path, "a"), replicator(tmp_path, "b")
    a._replicate(10)
    partial = tmp_path / "durable" / store.partial_dirname(10)
    assert (partial / PARTS / "a.json").exists() and not (tmp_path / "durable" / store.step_dirname(10)).exists()
    assert not store.inspect(partial).valid
    b._replicate(10)
    final = store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True)
    assert final.valid, final.reason
    assert sorted(f.name for f in final.manifest.files) == sorted(
        [f"__{r}_0.distcp" for r in range(4)] + [f"__{r}_1.distcp" for r in range(4)] + [".metadata"])
    assert final.manifest.extra["tier"] == "durable" and not partial.exists()
    assert b.state.bytes_copied < a.state.bytes_copied  # b found the shared files there: checked, not copied


def test_a_damaged_local_copy_is_never_vouched_for(tmp_path):
    local = local_checkpoint(tmp_path / "local-a", 10, "a")
    data = local / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[::-1])  # same size, different bytes: passes the size check
    with pytest.raises(ValueError, match="does not match its manifest's checksum"):
        replicator(tmp_path, "a")._replicate(10)
    partial = tmp_path / "durable" / store.partial_dirname(10)
    assert not (partial / PARTS / "a.json").exists() and not (partial / "__0_0.distcp").exists()
    small = local_checkpoint(tmp_path / "local-a", 20, "a")
    (small / ".metadata").write_bytes((small / ".metadata").read_bytes()[::-1])  # small: found before copying
    replicator(tmp_path, "a")._replicate(20)
    assert not (tmp_path / "durable" / store.partial_dirname(20) / PARTS / "a.json").exists()


def test_a_damaged_local_step_is_set_aside_and_the_others_are_copied(tmp_path):
    """It was reported as a failing durable tier (which lets local retention delete uncopied steps after the outage
    limit), and it ended the exit's copy of every other step."""
    one_node = {"a": [0, 1]}
    local_checkpoint(tmp_path / "local-a", 10, "a", one_node)
    newest = local_checkpoint(tmp_path / "local-a", 20, "a", one_node)
    data = newest / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[::-1])  # same size: only the copy's checksum finds it
    said: list[tuple[str, str | None]] = []
    r = Replicator(tmp_path / "local-a", tmp_path / "durable", "a", keep_local=2, keep=3, outage_s=3600.0,
                   announce=lambda text, style: said.append((text, style)))
    assert drained(r)
    assert store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True).valid
    assert r.state.failing_since is None and r.state.last_error is None
    aside = newest.with_name(newest.name + store.QUARANTINE_SUFFIX)
    assert not newest.exists()
    assert store.quarantine_reason(aside) == "local copy damaged: __0_0.distcp does not match its manifest's checksum"
    assert said[0] == ("local step 20 is damaged (__0_0.distcp does not match its manifest's checksum): not copied "
                       "to the durable tier, set aside as step_000000020.quarantined; the other steps are copied",
                       "red")


def test_an_unwritable_durable_tier_is_retried_and_reported_and_local_copies_are_kept(tmp_path):
    (tmp_path / "durable").write_text("not a folder")  # every write under it fails
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a")
    r = replicator(tmp_path, "a", keep_local=1)
    r.start()
    try:
        assert not r.drain(3.0)
        snap = r.snapshot()
        assert snap["pending"] == [10, 20, 30] and snap["failing_since"] is not None and snap["last_error"]
        r._local_retention()
        assert [i.step for i in store.scan(tmp_path / "local-a")] == [10, 20, 30]  # nothing durable: all kept
        r.state.failing_since -= 7200  # past the outage limit: unreplicated ones may go, said loudly
        r._local_retention()
        assert [i.step for i in store.scan(tmp_path / "local-a")] == [30] and r.state.deleted_unreplicated == [10, 20]
        assert r.snapshot()["pending"] == [30]  # audit 7: the deleted ones were still listed as to be copied
    finally:
        r.stop()
    assert r.state.superseded == 0  # nor counted, at the end, as superseded


def test_a_link_where_the_durable_partial_goes_is_not_copied_through_and_its_folder_is_left_alone(tmp_path):
    """Review 13: the copy went into the folder the link led to, and the publish's clean-up unlinked the user's files
    there. The tier reports the failure instead, naming the link; nothing is written through it."""
    mine = tmp_path / "users_own_folder"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    (tmp_path / "durable").mkdir()
    (tmp_path / "durable" / store.partial_dirname(10)).symlink_to(mine)
    local_checkpoint(tmp_path / "local-a", 10, "a", {"a": [0, 1]})
    r = replicator(tmp_path, "a")
    r.start()
    try:
        assert not r.drain(3.0)
        assert "a link or a file, not a folder" in (r.snapshot()["last_error"] or ""), r.snapshot()
    finally:
        r.stop()
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
    assert not (tmp_path / "durable" / store.step_dirname(10)).exists()


def test_a_local_step_removed_while_it_is_copied_is_no_failure_of_the_durable_tier(tmp_path, monkeypatch):
    """Review 13: the local file gone at its open() was counted as a durable-tier failure, which starts the outage
    clock that lets local retention delete uncopied steps."""
    from supervisor import replicate

    local = local_checkpoint(tmp_path / "local-a", 10, "a", {"a": [0, 1]})
    real = replicate.page_aligned_buffer

    def wiped_first(nbytes):  # just before the first file is read: the node's tier wiped (a replaced node)
        shutil.rmtree(local)
        return real(nbytes)

    monkeypatch.setattr(replicate, "page_aligned_buffer", wiped_first)
    r = replicator(tmp_path, "a")
    assert drained(r, 10)
    assert r.state.failing_since is None and r.state.last_error is None, r.snapshot()
    assert not (tmp_path / "durable" / store.step_dirname(10)).exists()
    assert not (tmp_path / "durable" / store.partial_dirname(10)).exists()  # its room given back


def test_local_steps_a_rollback_passed_over_are_not_copied_until_saved_again(tmp_path):
    """Review 13: after a NaN rollback below step 20 the replicator went on copying 20 and 30; the newest durable step
    was then the one rolled back past, and the new training's saves below it were held back as superseded."""
    one = {"a": [0, 1]}
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a", one)
    r = replicator(tmp_path, "a", keep_local=5)
    r.roll_back(20)
    r.notify(10)
    r.start()
    try:
        assert r.drain(30.0)
    finally:
        r.stop()
    durable = tmp_path / "durable"
    assert [i.step for i in store.scan(durable) if i.valid] == [10]
    r = replicator(tmp_path, "a", keep_local=5)  # the same supervisor's, as far as the copies go
    r.roll_back(20)
    r.start()
    try:
        local_checkpoint(tmp_path / "local-a", 20, "a", one, salt="the new training")  # step 20 saved again
        r.notify(20)
        assert r.drain(30.0)
    finally:
        r.stop()
    assert [i.step for i in store.scan(durable) if i.valid] == [10, 20]


def test_a_restarted_supervisor_goes_on_timing_the_outage_it_inherited_and_says_it_again(tmp_path):
    """The outage clock began anew with each supervisor: one restarted every hour never reached a limit of an hour,
    and the local tier (uncopied checkpoints kept) filled. A copy that works still ends the outage."""
    (tmp_path / "durable").write_text("not a folder")  # every write under it fails
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a")
    said: list[str] = []
    r = Replicator(tmp_path / "local-a", tmp_path / "durable", "a", keep_local=1, keep=3, outage_s=3600.0,
                   announce=lambda text, style: said.append(text))
    # it failed from 7200 s ago until its supervisor's last word 60 s ago: 7140 s of outage, not counting the 60
    r.carry_outage({"failing_since": time.time() - 7200, "last_error": "step 10: No space left on device"},
                   time.time() - 60)
    assert r.state.failing_since is None  # nothing failed here yet: no outage is in force, retention waits
    for garbage, seen in (({"failing_since": True}, 1.0), ({"failing_since": time.time() + 3600}, time.time()),
                          ({"failing_since": "x"}, 1.0), (None, None), ({"failing_since": 5.0}, None)):
        other = Replicator(tmp_path / "local-a", tmp_path / "durable", "a", keep_local=1, keep=3, outage_s=3600.0)
        other.carry_outage(garbage, seen)  # a damaged or future record carries nothing: no raise
        assert other._outage_before == 0.0
    r.start()
    try:
        assert not r.drain(3.0)
        assert sum("cannot copy step" in text for text in said) == 1, said  # the new console hears it once
        assert 7100 < time.time() - r.state.failing_since < 7180  # the outage's length, the time between not
        r._local_retention()
        assert [i.step for i in store.scan(tmp_path / "local-a")] == [30]  # past the limit: uncopied ones went
        (tmp_path / "durable").unlink()
        (tmp_path / "durable").mkdir()
        assert r.drain(30.0), r.snapshot()
        assert r.state.failing_since is None and any("works again" in text for text in said), said
    finally:
        r.stop()


def test_a_durable_tier_that_cannot_be_listed_is_a_failure_retried_not_the_end_of_copying(tmp_path, monkeypatch):
    """Review 9: the scan that picks the next step (EACCES, EIO or ESTALE on a shared filesystem) ran outside the
    thread's handler: the thread died, copying stopped for good, and the exit's drain waited its whole limit."""
    for step in (10, 20):
        local_checkpoint(tmp_path / "local-a", step, "a", ranks={"a": [0, 1]})
    (tmp_path / "durable").mkdir()
    r = replicator(tmp_path, "a")
    real_scan, refusing = r._scan, [True]

    def scan(root):
        if refusing[0] and root == r.durable_root:
            raise PermissionError(13, "Permission denied", str(root))
        return real_scan(root)

    monkeypatch.setattr(r, "_scan", scan)
    r.start()  # its own look at the durable tier fails too: the thread's next look queues what it lacks
    try:
        r.notify(20)  # the ranks' commit
        assert not r.drain(3.0) and r._thread.is_alive()
        assert "Permission denied" in r.snapshot()["last_error"]
        refusing[0] = False
        assert r.drain(30.0), r.snapshot()
        assert store.latest_valid(tmp_path / "durable").step == 20
    finally:
        r.stop()


def test_a_step_with_nothing_to_write_is_no_news_that_a_failing_durable_tier_works_again(tmp_path):
    """A local step found damaged before any copy was taken for a success: "the durable tier works again" while it
    was still full, and the outage clock that lets retention delete uncopied steps began anew (audit)."""
    (tmp_path / "durable").write_text("not a folder")  # every write under it fails
    damaged = local_checkpoint(tmp_path / "local-a", 10, "a")
    (damaged / ".metadata").write_bytes((damaged / ".metadata").read_bytes()[::-1])  # small: found at once
    said: list[str] = []
    r = Replicator(tmp_path / "local-a", tmp_path / "durable", "a", keep_local=2, keep=3, outage_s=3600.0,
                   announce=lambda text, style: said.append(text))
    since = r.state.failing_since = time.time() - 60
    assert drained(r, 10, timeout=10.0)
    assert r.state.failing_since == since and not any("works again" in text for text in said), said


def test_the_node_that_did_not_publish_sees_the_publish_within_seconds(tmp_path):
    """Node b put its part of step 10 in; node a's publish came after: b's state (what status shows) said the
    durable tier one interval behind until b's next copy (audit: for most of every interval)."""
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 10, node)
    b = replicator(tmp_path, "b")
    b.start()
    try:
        b.notify(10)  # (not drain: at its end it waits up to 20 s for the other nodes' publish)
        deadline = time.monotonic() + 30.0
        while not (b.snapshot()["pending"] == [] and b._part(10).exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b._part(10).exists() and b.snapshot()["newest_durable"] is None  # its part is in, not published
        replicator(tmp_path, "a")._replicate(10)
        deadline = time.monotonic() + 5.0
        while b.snapshot()["newest_durable"] != 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.snapshot()["newest_durable"] == 10
    finally:
        b.stop()


def test_a_restarted_replicator_finds_what_is_left_and_finishes_it(tmp_path):
    local_checkpoint(tmp_path / "local-a", 10, "a")
    local_checkpoint(tmp_path / "local-b", 10, "b")
    replicator(tmp_path, "b")._replicate(10)
    partial = tmp_path / "durable" / store.partial_dirname(10)
    (partial / "__0_0.distcp").write_bytes(b"cut short")  # a's earlier try, killed mid-copy
    (partial / ".__1_0.distcp.a.tmp").write_bytes(b"half")
    a = replicator(tmp_path, "a")
    assert a._unreplicated() == [10]
    a._replicate(10)
    assert store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True).valid
    assert not list((tmp_path / "durable").glob("*.partial"))
    assert a._unreplicated() == []


def test_local_retention_keeps_the_newest_and_drops_older_ones_the_durable_tier_holds(tmp_path):
    one_node = {"a": [0, 1]}  # a one-node save: this node's part is all the durable checkpoint needs
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a", one_node)
    r = replicator(tmp_path, "a", keep_local=1)
    r._replicate(10)
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [20, 30]  # 20 has no durable copy yet
    r._replicate(20)
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [30]
    assert [i.step for i in store.scan(tmp_path / "durable") if i.valid] == [10, 20]
    truncate(tmp_path / "local-a" / store.step_dirname(30) / "__0_0.distcp")
    assert r._unreplicated() == []  # a damaged local copy is not queued


def test_retention_keeps_deleted_data_files_for_the_next_save_and_stop_frees_them(tmp_path):
    """A local checkpoint retention deletes leaves its data files in the spare pool (up to what the newest
    checkpoint holds in data files), never the small files; a save claims one whole; stop() frees the rest."""
    one_node = {"a": [0, 1]}
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a", one_node)
    r = replicator(tmp_path, "a", keep_local=1)
    for step in (10, 20, 30):
        r._replicate(step)
    r._local_retention()
    local = tmp_path / "local-a"
    assert [i.step for i in store.scan(local)] == [30]
    newest = store.inspect(local / store.step_dirname(30)).manifest
    data = sum(f.size for f in newest.files if f.name.endswith(store.DATA_SUFFIX))
    spares = store.spare_sizes(local)
    assert all(store.DATA_SUFFIX + "." in p.name for p in spares)  # data files only, never the small ones
    assert len(spares) == 2 and sum(spares.values()) <= data  # step 10's two shards; 20's would pass the limit

    dest = tmp_path / "__1_0.distcp"
    assert store.claim_spare(local, dest) and dest.stat().st_size == spares[min(
        spares, key=lambda p: (not p.name.startswith("__1_0.distcp."), p.name))]
    assert len(store.spare_sizes(local)) == 1
    r.stop()  # never started: stop() still applies retention, and drops the pool
    assert store.spare_sizes(local) == {} and not (local / store.SPARE_DIR).exists()
    assert [i.step for i in store.scan(local)] == [30] and store.inspect(local / store.step_dirname(30)).valid


def test_local_retention_deletes_what_the_durable_tier_dropped_by_its_own_retention(tmp_path):
    """keep (durable) = keep_local = 2: each durable commit drops the durable copy of the step local retention is
    about to delete. It is older than the newest durable step, so it goes; only a step newer than every durable
    one is held (before, every local checkpoint was held forever, and a tmpfs tier grew without bound)."""
    one_node = {"a": [0, 1]}
    r = Replicator(tmp_path / "local-a", tmp_path / "durable", "a", keep_local=2, keep=2, outage_s=3600.0)
    for step in (10, 20, 30, 40):
        local_checkpoint(tmp_path / "local-a", step, "a", one_node)
        r._replicate(step)
        r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "durable") if i.valid] == [30, 40]
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [30, 40]
    local_checkpoint(tmp_path / "local-a", 50, "a", one_node)
    local_checkpoint(tmp_path / "local-a", 60, "a", one_node)  # neither replicated yet
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [50, 60]  # 30, 40 are in the durable tier
    r.keep_local = 1
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [50, 60]  # 50 is newer than durable 40: held


def test_a_durable_tier_behind_the_saves_copies_the_newest_step_and_skips_what_it_supersedes(tmp_path):
    """Three local checkpoints wait (the durable tier was slower than the saves): the running replicator copies
    the newest, never the two it supersedes, and local retention may then delete them. Oldest first, the durable
    tier fell a save further behind with each save, and the local tier held every step it had not copied."""
    one_node = {"a": [0, 1]}
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a", one_node)
    r = replicator(tmp_path, "a", keep_local=1)
    assert drained(r, timeout=10.0)
    assert [i.step for i in store.scan(tmp_path / "durable")] == [30]  # no partial of 10 or 20 either
    assert r.state.replicated == 1 and r.state.superseded == 2
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [30]


def test_every_node_copies_the_step_another_node_has_begun(tmp_path):
    """Node b put its part of step 20 into the durable tier; node a, with 20 and 30 queued, finishes 20 (the
    newest would leave both steps half there while the saves go on) and then copies 30."""
    for step in (20, 30):
        for node in NODES:
            local_checkpoint(tmp_path / f"local-{node}", step, node)
    replicator(tmp_path, "b")._replicate(20)
    a = replicator(tmp_path, "a")
    assert a._pick([20, 30]) == 20
    a._replicate(20)
    assert store.inspect(tmp_path / "durable" / store.step_dirname(20)).valid
    assert a._pick([30]) == 30 and replicator(tmp_path, "b")._pick([30]) == 30
    # a's part of 40 waits for b; b has begun 30 meanwhile: a goes on to 50, not back to 30 (40 supersedes it)
    for step in (40, 50):
        for node in NODES:
            local_checkpoint(tmp_path / f"local-{node}", step, node)
    a._replicate(40)
    replicator(tmp_path, "b")._replicate(30)
    assert a._pick([30, 50]) == 50


def test_a_part_of_an_earlier_save_of_the_same_step_is_never_published_with_a_new_one(tmp_path):
    """Node a copied its part of step 20; node b never did (its node was replaced). The job resumed from an older
    durable step and saved step 20 again, other bytes. a copies its new part again, and the durable step 20 holds
    only the new save's files: publishing a's old part beside b's new one would mix two training states."""
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 20, node)
    a = replicator(tmp_path, "a")
    a._replicate(20)  # the old save's part of a
    for node in NODES:  # the job went back and saved step 20 again
        shutil.rmtree(tmp_path / f"local-{node}")
        local_checkpoint(tmp_path / f"local-{node}", 20, node, salt="-again")
    replicator(tmp_path, "b")._replicate(20)  # b's new part: a's old one must not complete the checkpoint
    assert not (tmp_path / "durable" / store.step_dirname(20)).exists()
    a._replicate(20)
    final = tmp_path / "durable" / store.step_dirname(20)
    assert store.inspect(final, deep=True).valid
    for node, name in (("a", "__0_0.distcp"), ("b", "__2_0.distcp"), ("a", ".metadata")):
        new = tmp_path / f"local-{node}" / store.step_dirname(20) / name
        assert (final / name).read_bytes() == new.read_bytes(), name


def test_a_step_saved_again_by_fewer_nodes_publishes_without_the_earlier_saves_files(tmp_path):
    """Audit 7: after an elastic shrink the surviving node saved step 80 again at a smaller world; node b's files of
    the earlier save, left in the durable partial, failed every publish ("unlisted files"), reported as a failing
    durable tier, and the step never reached it."""
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 80, node)
    replicator(tmp_path, "b")._replicate(80)  # b's part of the bigger world's save, then b was lost
    shutil.rmtree(tmp_path / "local-a")
    local_checkpoint(tmp_path / "local-a", 80, "a", ranks={"a": [0, 1]}, salt="-alone")
    a = replicator(tmp_path, "a")
    a._replicate(80)
    final = tmp_path / "durable" / store.step_dirname(80)
    assert store.inspect(final, deep=True).valid and a.state.failing_since is None
    assert sorted(p.name for p in final.iterdir() if p.name != store.MARKER) == \
        sorted(p.name for p in (tmp_path / "local-a" / store.step_dirname(80)).iterdir() if p.name != store.MARKER)


def test_a_step_saved_again_after_a_rollback_replaces_its_durable_copy(tmp_path):
    """A NaN after step 20 rolls the job back below it; step 20 is saved again, other bytes. The durable step 20
    is the one the NaN followed: the new save replaces it once every node's part is there (it was taken for
    'another node completed it', and the durable tier kept the old save for good)."""
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 20, node)
    a, b = replicator(tmp_path, "a"), replicator(tmp_path, "b")
    a._replicate(20)
    b._replicate(20)
    final = tmp_path / "durable" / store.step_dirname(20)
    old = store.inspect(final).manifest
    for node in NODES:  # the rollback's new save of step 20
        shutil.rmtree(tmp_path / f"local-{node}")
        local_checkpoint(tmp_path / f"local-{node}", 20, node, salt="-again")
    a._replicate(20)
    assert store.inspect(final).manifest == old  # b's part of the new save is not there yet
    b._replicate(20)
    info = store.inspect(final, deep=True)
    assert info.valid and info.manifest != old
    for node, name in (("a", "__0_0.distcp"), ("b", "__2_0.distcp"), ("a", ".metadata")):
        assert (final / name).read_bytes() == (tmp_path / f"local-{node}" / store.step_dirname(20) / name).read_bytes()
    assert not list((tmp_path / "durable").glob("*.partial"))


def test_a_node_done_with_its_parts_waits_briefly_for_another_node_to_publish(tmp_path, monkeypatch):
    """At exit, node b's parts are there but node a has not added its own: b waits for a's publish (so its retention
    and state see the step durable), and not long when a never comes."""
    import threading
    import time

    from supervisor import replicate

    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 10, node)
    a, b = replicator(tmp_path, "a"), replicator(tmp_path, "b")
    b._replicate(10)
    later = threading.Timer(0.5, a._replicate, args=(10,))
    t0 = time.monotonic()
    later.start()
    b.start()
    try:
        assert b.drain(30.0)
    finally:
        later.join()
        b.stop()
    assert 0.4 < time.monotonic() - t0 < 10 and store.inspect(tmp_path / "durable" / store.step_dirname(10)).valid

    local_checkpoint(tmp_path / "local-b", 20, "b")
    b = replicator(tmp_path, "b")
    b._replicate(20)  # a never adds its part of 20
    monkeypatch.setattr(replicate, "PUBLISH_WAIT_S", 0.5)
    b.start()
    t0 = time.monotonic()
    try:
        assert b.drain(30.0) and time.monotonic() - t0 < 5
    finally:
        b.stop()



def _waits_for_flock(path: Path) -> bool:
    """Someone is blocked in flock on `path` (Linux lists a waiter as `->` in /proc/locks)."""
    try:
        inode = path.stat().st_ino
    except FileNotFoundError:
        return False
    return any("->" in line and line.split()[6].endswith(f":{inode}")
               for line in Path("/proc/locks").read_text().splitlines() if "FLOCK" in line)


def test_a_node_entering_a_step_while_another_publishes_it_leaves_the_checkpoint_whole(tmp_path, monkeypatch):
    """Node a's part of step 10 is there (a restarted supervisor queues the step again); node b publishes it at
    the moment a enters the folder again. Before, a re-created its lock file and `.parts/` in the folder b had
    cleaned for the rename, and the published step 10 inspected corrupt. Now a waits for the publish and finds
    the step done."""
    import threading

    from supervisor import replicate

    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 10, node)
    a, b = replicator(tmp_path, "a"), replicator(tmp_path, "b")
    a._replicate(10)
    partial = tmp_path / "durable" / store.partial_dirname(10)
    inside, go = threading.Event(), threading.Event()
    real_fsync = store.fsync_dir

    def paused_fsync(path):  # publish's first step after it removed the bookkeeping: hold it there
        if Path(path) == partial:
            inside.set()
            assert go.wait(30)
        real_fsync(path)

    monkeypatch.setattr(store, "fsync_dir", paused_fsync)
    errors: list[BaseException] = []

    def run(r: Replicator) -> None:
        try:
            r._replicate(10)
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    publisher = threading.Thread(target=run, args=(b,))
    publisher.start()
    reentry = threading.Thread(target=run, args=(a,))
    try:
        assert inside.wait(30)
        reentry.start()
        lock = tmp_path / "durable" / replicate.ROOT_LOCK
        deadline = time.monotonic() + 30
        while reentry.is_alive() and not _waits_for_flock(lock) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reentry.is_alive(), "node a entered the folder while node b published it"
    finally:
        go.set()
        publisher.join(30)
        if reentry.ident is not None:
            reentry.join(30)
    assert not errors, errors
    final = store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True)
    assert final.valid, final.reason
    assert not partial.exists()


def test_drain_copies_a_local_commit_nobody_notified_of(tmp_path):
    one_node = {"a": [0, 1]}
    r = replicator(tmp_path, "a")
    r.start()
    try:
        local_checkpoint(tmp_path / "local-a", 10, "a", one_node)  # committed, never notified
        assert r.drain(30.0)
    finally:
        r.stop()
    assert store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True).valid


@pytest.mark.parametrize("comes_back", ["revisit", "drain"])
def test_a_file_replaced_by_a_copy_of_another_save_after_it_was_verified_is_never_published(tmp_path, monkeypatch,
                                                                                           comes_back):
    """Node a's local tier still held an older save of step 20, whose ranks it held differently (a: 2, 3). Node
    b copies the new save (b: 2, 3) and vouches for it; then a copies its old save over b's shard files. When a
    has the new save and copies it, both parts are of the same save, but b's shards on disk are a's old bytes
    (of the same size): publishing would make a checkpoint whose manifest its files do not match. The publish
    finds b's files replaced since b verified them, drops b's part, and publishes once b has copied again: b finds
its part gone when it next looks (every REVISIT_S), or at its exit (drain), whichever comes first."""
    from supervisor import replicate

    monkeypatch.setattr(replicate, "REVISIT_S", 0.2 if comes_back == "revisit" else 3600.0)
    old = {"a": [2, 3], "b": [0, 1]}
    new = {"a": [0, 1], "b": [2, 3]}
    local_checkpoint(tmp_path / "local-b", 20, "b", new, salt="-new")
    local_checkpoint(tmp_path / "local-a", 20, "a", old, salt="-old")  # the same sizes: a size check passes
    a, b = replicator(tmp_path, "a"), replicator(tmp_path, "b")
    b.start()  # copies its part of 20, which then waits for a's
    try:
        deadline = time.monotonic() + 30
        while not (20 in b._handled and b._part(20).exists()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b._part(20).exists()
        a._replicate(20)  # the old save, over b's shards and the shared files
        shutil.rmtree(tmp_path / "local-a")
        local_checkpoint(tmp_path / "local-a", 20, "a", new, salt="-new")
        a._replicate(20)  # its part of the new save: the two parts agree, but b's files are not b's any more
        final = tmp_path / "durable" / store.step_dirname(20)
        partial = tmp_path / "durable" / store.partial_dirname(20)
        assert not final.exists()
        assert not (partial / PARTS / "b.json").exists() and (partial / PARTS / "a.json").exists()
        if comes_back == "revisit":  # b, still running, finds its part dropped and copies it again
            deadline = time.monotonic() + 30
            while not final.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            assert b.drain(30)  # b's exit finds its part dropped and copies it again
        assert final.exists()
    finally:
        b.stop()
    info = store.inspect(final, deep=True)
    assert info.valid, info.reason
    for node, name in (("b", "__2_0.distcp"), ("a", "__0_0.distcp"), ("b", ".metadata")):
        assert (final / name).read_bytes() == (tmp_path / f"local-{node}" / store.step_dirname(20) / name).read_bytes()
    assert not list((tmp_path / "durable").glob(".trash.*"))


def test_two_nodes_copying_a_shared_file_at_once_still_publish(tmp_path):
    """Both nodes copy the shared files (metadata, the ranks' small files); when they do so at the same moment,
    the second rename replaces the first node's file with the same bytes after the first node vouched for it.
    The publish reads such a file again and finds it whole: no part is dropped."""
    for node in NODES:
        local_checkpoint(tmp_path / f"local-{node}", 10, node)
    a, b = replicator(tmp_path, "a"), replicator(tmp_path, "b")
    a._replicate(10)
    partial = tmp_path / "durable" / store.partial_dirname(10)
    for name in (".metadata", "__0_1.distcp"):  # b's copies, renamed over a's
        tmp = partial / f".{name}.b.tmp"
        shutil.copyfile(partial / name, tmp)
        tmp.replace(partial / name)
    b._replicate(10)
    info = store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True)
    assert info.valid, info.reason


def test_the_periodic_look_queues_an_unannounced_commit_without_scanning_the_durable_tier(tmp_path, monkeypatch):
    """Every node of a big job looks again every REVISIT_S, on the shared filesystem: it stats the step's own
    folders there and validates nothing of the durable tier (the look at exit does)."""
    one_node = {"a": [0, 1]}
    r = replicator(tmp_path, "a")
    local_checkpoint(tmp_path / "local-a", 10, "a", one_node)
    r._replicate(10)
    r._done(10)
    assert r.state.newest_durable == 10
    local_checkpoint(tmp_path / "local-a", 20, "a", one_node)  # committed, never notified
    looked = []
    real_scan, real_inspect = store.scan, store.inspect
    monkeypatch.setattr(store, "scan", lambda root, **kw: looked.append(Path(root)) or real_scan(root, **kw))
    monkeypatch.setattr(store, "inspect", lambda path, **kw: looked.append(Path(path)) or real_inspect(path, **kw))
    r._revisit(thorough=False)
    assert r.snapshot()["pending"] == [20]
    assert not [p for p in looked if p.is_relative_to(tmp_path / "durable")], looked
    r._revisit(thorough=True)  # at exit: both tiers validated
    assert [p for p in looked if p.is_relative_to(tmp_path / "durable")]


def test_a_copy_that_failed_on_a_full_durable_tier_gives_its_room_back(tmp_path, small_disk):
    """Each failed copy left its finished files in its partial, which nothing removed (no newer step became
    durable): a durable tier that was full once stayed full after room came back."""
    ranks = {"a": [0, 1]}  # two 2 MiB shards a checkpoint: one fits beside the filler, not both
    local = tmp_path / "local-a"
    for step in (10, 20):
        local_checkpoint(local, step, "a", ranks)
    r = Replicator(local, small_disk, "a", keep_local=2, keep=3, outage_s=3600.0)
    filler = small_disk / "filler"
    filler.write_bytes(bytes(2 << 20))
    with pytest.raises(OSError):
        r._replicate(10)
    assert not (small_disk / store.partial_dirname(10)).exists()
    filler.unlink()  # room again: enough for one checkpoint, had the failed copy not kept half of one
    r._replicate(20)
    assert store.inspect(small_disk / store.step_dirname(20), deep=True).valid


def test_a_local_step_saved_again_while_it_is_copied_is_copied_anew_with_no_alarm(tmp_path, monkeypatch):
    """The ranks went back (a resume from an older step) and saved step 20 again while the replicator copied the
    first save: the copy read new bytes against the old manifest. That is no failure of the durable tier (it was
    reported as one: 'FAILING' in status, and the copy's backoff); the new save is copied."""
    from supervisor import replicate

    local = tmp_path / "local-a"
    local_checkpoint(local, 20, "a", {"a": [0]})
    r = Replicator(local, tmp_path / "durable", "a", keep_local=2, keep=3, outage_s=3600.0)
    real, resaved = replicate.Replicator._copy_verified, []

    def copy_verified(self, src, dest, rec, algorithm):
        if not resaved:
            resaved.append(True)
            shutil.rmtree(local / store.step_dirname(20))
            local_checkpoint(local, 20, "a", {"a": [0]}, salt="-again")
        return real(self, src, dest, rec, algorithm)

    monkeypatch.setattr(replicate.Replicator, "_copy_verified", copy_verified)
    assert drained(r, 20)
    final = store.inspect(tmp_path / "durable" / store.step_dirname(20), deep=True)
    assert final.valid and (tmp_path / "durable" / store.step_dirname(20) / ".metadata").read_bytes() == (
        local / store.step_dirname(20) / ".metadata").read_bytes()
    assert r.state.failing_since is None and r.state.last_error is None and r._failures == 0


def test_local_steps_of_a_timeline_left_behind_are_not_copied_ahead_of_the_new_ones(tmp_path):
    """Node b was replaced: the ranks resumed from durable step 20. Node a's local steps 60-100 are of the training
    they left, and b will never hold them: copying them first (newest first) held the new training's durable
    copies back. Passed over, unless the new training saves that step number again."""
    local = tmp_path / "local-a"
    durable_ranks = {"a": [0]}
    local_checkpoint(tmp_path / "durable", 20, "a", durable_ranks)
    for step in (60, 80, 100):
        local_checkpoint(local, step, "a", durable_ranks)
    r = Replicator(local, tmp_path / "durable", "a", keep_local=5, keep=5, outage_s=3600.0)
    for step in (60, 80, 100):
        r.notify(step)  # as start() queues them
    launched_at = time.time()
    r.pass_over_older_timeline(20, launched_at)
    assert r.snapshot()["pending"] == [] and r._unreplicated() == []
    local_checkpoint(local, 40, "a", durable_ranks)  # the new training's first save
    r.notify(40)
    assert r.snapshot()["pending"] == [40]
    shutil.rmtree(local / store.step_dirname(60))
    local_checkpoint(local, 60, "a", durable_ranks, salt="-new")  # ...and its step 60
    r.notify(60)
    assert r.snapshot()["pending"] == [40, 60] and r._unreplicated() == [40, 60]


def test_a_commit_shows_in_the_lag_at_once_not_after_the_next_copy(tmp_path):
    """status said `local step -` and no lag while the first copies were under way (the newest local step was read
    only after a copy), the figure that says what a lost node would cost."""
    r = replicator(tmp_path, "a")
    r.notify(20)
    r.notify(10)
    snap = r.snapshot()
    assert (snap["newest_local"], snap["lag_steps"], snap["pending"]) == (20, 20, [10, 20])


def test_the_lag_in_seconds_is_between_the_saves_not_from_the_durable_copys_publish(tmp_path):
    """Audit 7: `lag 100 steps, 4.7s` while the newest durable step had been saved 16 s earlier: its time was the
    publish's, late by the copy."""
    saved = store.inspect(local_checkpoint(tmp_path / "local-a", 10, "a", ranks={"a": [0, 1]})).created_at
    r = replicator(tmp_path, "a")
    r._replicate(10)
    assert r.state.newest_durable_at == saved
    durable = store.inspect(tmp_path / "durable" / store.step_dirname(10))
    assert durable.valid and durable.manifest.extra["saved_at"] == saved and durable.created_at > saved
    r2 = replicator(tmp_path, "a")
    r2._refresh()  # a restarted supervisor reads it from the durable copy
    assert r2.state.newest_durable_at == saved


def test_steps_queued_again_from_a_stale_newest_durable_step_are_not_pending_at_the_end(tmp_path):
    """The periodic look queued local steps 10 and 20 again from the newest durable step it last saw, and the
    supervisor stopped before the thread took them: step 30, durable meanwhile, supersedes them. A node whose tiers
    were up to date showed them "pending" in its state file for good (seen in the slow-durable-tier e2e test)."""
    for node in NODES:
        for step in (10, 20, 30):
            local_checkpoint(tmp_path / f"local-{node}", step, node)
    a, b = replicator(tmp_path, "a", keep_local=3), replicator(tmp_path, "b", keep_local=3)
    a._replicate(30)
    b._replicate(30)
    assert store.inspect(tmp_path / "durable" / store.step_dirname(30)).valid
    a._queue.update({10, 20})  # as _revisit(thorough=False) did, its newest durable step still None
    a.stop()  # the thread never started: stop() settles what the state file says
    snap = a.snapshot()
    assert snap["pending"] == [] and snap["newest_durable"] == 30, snap


def test_retention_spares_the_steps_the_ranks_were_handed_to_load_until_they_have(tmp_path):
    """Review 13: with keep_local 1, a local step the relaunched ranks were loading (not the newest) was deleted by the
    replicator's retention mid-load: the load failed, an attempt was wasted."""
    one = {"a": [0, 1]}
    for step in (10, 20):
        local_checkpoint(tmp_path / "local-a", step, "a", one)
    r = replicator(tmp_path, "a", keep_local=1)
    r._replicate(10)
    r._replicate(20)
    r.loading = frozenset({10})
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [10, 20]
    r.loading = frozenset()
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [20]


def test_retention_spares_an_older_step_every_node_holds_while_the_ranks_load(tmp_path):
    """Review 16: this node handed over its newest local step 30, but the ranks load the newest step every node
    holds, 10 (another node's 20 and 30 were lost). A publish of 10 moved it out of `keep_local` and retention
    deleted it under the ranks reading it. Every valid step up to the newest handed over is kept until they have
    loaded; in the durable tier too (the ranks take the smallest step the nodes handed over)."""
    one = {"a": [0, 1]}
    for step in (10, 20, 30):
        local_checkpoint(tmp_path / "local-a", step, "a", one)
    r = replicator(tmp_path, "a", keep_local=1)
    r.keep = 1
    r.loading = frozenset({20, 30})  # handed over; the publishes come while the ranks load
    r._replicate(10)
    r._replicate(20)
    r._local_retention()
    r._durable_retention()
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [10, 20, 30]
    assert [i.step for i in store.scan(tmp_path / "durable")] == [10, 20]
    r.loading = frozenset()  # loaded
    r._durable_retention()
    r._local_retention()
    assert [i.step for i in store.scan(tmp_path / "durable")] == [20]
    assert [i.step for i in store.scan(tmp_path / "local-a")] == [30]


def test_a_rollback_stops_the_copy_of_the_step_it_passes_over_that_is_under_way(tmp_path, monkeypatch):
    """Review 14: roll_back only took the steps out of the queue; the copy under way when the loss went non-finite,
    most often of the very step rolled back past, went on and published it."""
    one = {"a": [0, 1]}
    local_checkpoint(tmp_path / "local-a", 10, "a", one)
    local_checkpoint(tmp_path / "local-a", 20, "a", one)
    r = replicator(tmp_path, "a", keep_local=5)
    r._replicate(10)
    real, copied = Replicator._copy_verified, []

    def nan_after_the_first_file(self, src, dest, rec, algorithm):
        out = real(self, src, dest, rec, algorithm)
        copied.append(rec.name)
        if len(copied) == 1:
            self.roll_back(20)  # the supervisor's thread, in the middle of this copy
        return out

    monkeypatch.setattr(Replicator, "_copy_verified", nan_after_the_first_file)
    with pytest.raises(Exception, match="local step 20 was passed over by a rollback while it was copied"):
        r._replicate(20)
    assert len(copied) == 1
    assert [i.step for i in store.scan(tmp_path / "durable") if i.valid] == [10]
    assert not (tmp_path / "durable" / store.partial_dirname(20)).exists()  # its room given back


def test_a_local_step_saved_again_while_the_replicator_reads_it_is_copied_as_the_new_save(tmp_path, monkeypatch):
    """Review 16: the marker's identity was taken after the inspect. The ranks saving the step again in between, the
    copy of the new save was checked against the old manifest, and the good new save was set aside as damaged."""
    one = {"a": [0, 1]}
    local_checkpoint(tmp_path / "local-a", 10, "a", one)
    r = replicator(tmp_path, "a")
    real = store.inspect
    calls = []

    def saved_again_meanwhile(path, *a, **kw):
        info = real(path, *a, **kw)
        if path.parent == tmp_path / "local-a" and not calls:
            calls.append(path)
            local_checkpoint(tmp_path / "local-a", 10, "a", one, salt="again")
        return info

    monkeypatch.setattr(store, "inspect", saved_again_meanwhile)
    with pytest.raises(LocalSaveReplaced):
        r._replicate(10)
    assert r._replicate(10) and not r._unusable
    durable = store.inspect(tmp_path / "durable" / store.step_dirname(10), deep=True)
    local = store.inspect(tmp_path / "local-a" / store.step_dirname(10))
    assert durable.valid and local.valid and durable.manifest is not None and local.manifest is not None
    assert store.save_identity(durable.manifest.files) == store.save_identity(local.manifest.files)


def test_a_node_copying_another_save_while_one_publishes_leaves_nothing_in_the_published_folder(tmp_path, monkeypatch):
    """Review 16: node c copies its own save of step 10 into the partial that node a publishes meanwhile. c's temp
    went with the folder into step_10, which then inspected corrupt ("unlisted file") and was set aside; and c's
    failure was said as a failing durable tier. The temp is taken out and c copies again."""
    from supervisor import replicate

    local_checkpoint(tmp_path / "local-a", 10, "a", {"a": [0, 1]})
    local_checkpoint(tmp_path / "local-c", 10, "c", {"c": [0, 1]}, salt="another save")
    a, c = replicator(tmp_path, "a"), replicator(tmp_path, "c")
    final = tmp_path / "durable" / store.step_dirname(10)
    identity = replicate.file_identity
    published = []

    def publish_meanwhile(path):  # c has copied a file to its temp, and holds no lock until it renames it
        if str(path).endswith(".c.tmp") and not published:
            published.append(path)
            assert a._replicate(10)  # a publishes the partial c is copying into
            (final / Path(path).name).write_bytes(b"c's temp, moved with the folder")  # what a late temp leaves
        return identity(path)

    monkeypatch.setattr(replicate, "file_identity", publish_meanwhile)
    with pytest.raises(LocalSaveReplaced, match="published or emptied by another node"):
        c._replicate(10)
    assert published and [p.name for p in final.iterdir() if p.name.endswith(".tmp")] == []
    info = store.inspect(final, deep=True)
    assert info.valid, info.reason
