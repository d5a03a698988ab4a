"""Replication: each node's supervisor copies its node's local checkpoints into the durable tier.

With `checkpoint.local_dir`, the ranks commit every checkpoint to a node-local folder (NVMe, /dev/shm), each
node its own ranks' shards plus every rank's small file and DCP's metadata, with its own marker. This thread,
in the torch-free supervisor (alive across rank crashes), copies each one into `checkpoint.dir`:

1. into the durable `step_<N>.partial`, shared by the nodes (a shared flock on its `.writer.lock` tells gc
   the folder is live), each file through a temp name, checksummed while copied and compared with the local
   manifest before it is renamed into place; a file another node already put there is checked, not copied;
2. `.parts/<node>.json`, written last for this node: the files it vouches for;
3. when every node of the save has its part there, one of them publishes the folder: the marker last, as for
   any checkpoint (store.publish). Until then it is a partial, never valid.

A publish removes the partial's bookkeeping, writes the marker and renames the folder; a node that entered the
folder then (a restarted supervisor queues again a step whose part is there) would leave its lock file or
`.parts/` in the published checkpoint, which would then inspect as corrupt. So every entry into a durable
partial (and every removal of one) holds `.replication.lock` in the durable root shared, and a publish holds
it exclusive: an entry sees the partial before the publish or the committed step after it.

Newest first: when the durable tier is slower than the saves, each copy takes the newest local checkpoint
(the one another node has begun, if any, so the nodes finish the same step) and the older ones it supersedes
are never copied; local retention may then delete them.

It resumes after a supervisor restart: whatever local checkpoint is newer than the newest durable one and
has no part of this node in the durable tier yet is queued again. Failures (a durable tier that is full or
unwritable) never stop training: the step stays queued, retried with a growing wait, and `failing_since`
says so. Local retention keeps `keep_local` checkpoints and never deletes one that has no durable copy,
unless the durable tier has been failing for longer than `checkpoint.durable_outage_s`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from supervisor import retention, store
from supervisor.fsutil import CHUNK, HashedFile, atomic_write_bytes, file_identity, fsync_dir, page_aligned_buffer
from supervisor.state import ReplicationState

log = logging.getLogger("resilient")

PARTS = ".parts"
ROOT_LOCK = ".replication.lock"  # in the durable root: shared to enter a partial, exclusive to publish or delete
RETRY_S = (2.0, 5.0, 15.0, 30.0, 60.0)
PUBLISH_WAIT_S = 20.0  # at exit, how long a node waits for the other nodes' parts of its newest step
REVISIT_S = 10.0  # how often a node looks again for a commit it was not told of, or a part of its a publish dropped
PAUSE_ENV = "RESILIENT_TEST_REPLICATE_PAUSE_S"  # test hook: sleep after the first file of each step


def split_unreplicated(plan: retention.Plan, infos: list[store.CheckpointInfo],
                       durable: set[int]) -> tuple[retention.Plan, list[retention.Removal]]:
    """`plan` (a local tier's retention) less the valid local checkpoints newer than the newest valid durable one,
    and those: they may be the only copy of that progress. One the durable tier no longer holds but that is older
    than its newest is not held: the durable tier's own retention (`keep`) dropped its copy, and a newer one is
    there (holding it leaked the local tier whenever `keep` <= `keep_local`: the kill campaign's tmpfs tier kept
    every checkpoint). Used by the replicator's retention and by `gc --keep-local`."""
    valid = {i.path for i in infos if i.valid}
    newest = max(durable, default=-1)
    held = [r for r in plan.remove if r.path in valid and r.step is not None and r.step > newest]
    return retention.Plan(plan.kept, [r for r in plan.remove if r not in held], plan.spared), held


class LocalSaveReplaced(Exception):
    """The local checkpoint being copied was saved again meanwhile (the ranks went back and reached its step
    again), or removed: the copy starts over with the new save, if any. No failure of the durable tier."""


class LocalCopyDamaged(ValueError):
    """A file of the local checkpoint does not match its manifest's checksum: the local tier's fault, not the
    durable tier's. That step is set aside and the others are copied."""


def _save_of(files: list[Any]) -> str:
    """What identifies one save across the nodes' parts (store.save_identity), from records or their dicts."""
    return store.save_identity(f if isinstance(f, store.FileRecord) else _record(f) for f in files)


def _record(d: dict[str, Any]) -> store.FileRecord:
    """A file record as a part lists it (`FileRecord.to_dict`)."""
    return store.FileRecord(d["name"], int(d["size"]), d["checksum"])


def _replaced(partial: Path, part: dict[str, Any], sums: dict[str, str | None], algorithm: str) -> list[str]:
    """The files of `part` in `partial` that are no longer those its node verified: another file now (inode,
    size, mtime) with other bytes. `sums` keeps the checksums read, for the other parts."""
    ids = part.get("ids") or {}  # a part written before parts recorded them: nothing to compare
    out = []
    for f in part["files"]:
        name = f["name"]
        if name not in ids or file_identity(partial / name) == ids[name]:
            continue
        if name not in sums:
            try:
                sums[name] = store.checksum_file(partial / name, algorithm)
            except OSError:
                sums[name] = None
        if sums[name] != f["checksum"]:
            out.append(name)
    return out


def _read_part(path: Path) -> list[Any]:
    try:
        return json.loads(path.read_bytes())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


@contextlib.contextmanager
def root_lock(root: Path, mode: int, *, create: bool = True) -> Iterator[bool]:
    """`root`'s replication lock in `mode` (fcntl.LOCK_SH / LOCK_EX, with LOCK_NB: yields False when busy).
    Without `create`, a root that has none (no tiered run replicates into it) yields True, unlocked, and so does
    one this process cannot write (a read-only mount, another user's root): it can delete nothing there, which
    is all the lock guards against (gc says so itself)."""
    try:
        fd = os.open(root / ROOT_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        yield True
        return
    except OSError as e:
        if create or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        yield True
        return
    try:
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def yield_to_training() -> None:
    """Lower this thread's CPU and disk priority to the least (Linux sets both per thread): on a node whose cores
    all train, the copy takes what the ranks leave; it is never in training's way, only later."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    with contextlib.suppress(Exception):  # best effort, lowest level: not idle, which heavy data loading starves
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)


class Replicator:
    """Replicates one node's local tier into the durable tier, in a background thread."""

    def __init__(self, local_root: Path, durable_root: Path, node: str, *, keep_local: int, keep: int,
                 outage_s: float, announce: Callable[[str, str | None], None] | None = None):
        self.local_root, self.durable_root, self.node = Path(local_root), Path(durable_root), node
        self.keep_local, self.keep, self.outage_s = keep_local, keep, outage_s
        self.announce = announce or (lambda text, style: log.info("%s", text))
        self.state = ReplicationState(str(self.local_root), str(self.durable_root))
        self._queue: set[int] = set()
        self._handled: set[int] = set()  # steps this process copied, found copied or skipped as superseded
        self._unusable: set[int] = set()  # local steps damaged, gone, or of a timeline left: passed over
        # the steps the current attempt's ranks were handed to load, until they have (review 13: retention here
        # could delete one mid-load, a non-newest common local step or the durable one of an elastic shrink)
        self.loading: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilient-replicate", daemon=True)
        self._pause = float(os.environ.get(PAUSE_ENV) or 0.0)
        self._failures = 0  # copies failed in this process, ever
        self._said_failing = False  # the console has the failing tier's first sentence (once per outage here)
        self._outage_before = 0.0  # how long the previous supervisor of this node had seen the durable tier fail
        self._buffer: memoryview | None = None  # page-aligned, for the durable writes (O_DIRECT)
        self._inspected = store.InspectCache()  # both tiers are scanned at every commit

    # ---- called by the supervisor ----------------------------------------------------------------------

    def start(self) -> None:
        """Queue every local checkpoint the durable tier lacks (a restart resumes here), and start."""
        self._revisit(thorough=True)  # a tier that cannot be listed now: the thread's periodic look queues them
        with contextlib.suppress(OSError):
            self._refresh()
        self._thread.start()
        self._wake.set()

    def notify(self, step: int) -> None:
        """The ranks committed `step` to the local tier."""
        with self._lock:
            self._queue.add(step)
            self._unusable.discard(step)  # a new save of a step number passed over before
            if self.state.newest_local is None or step > self.state.newest_local:  # the lag status shows, now
                self.state.newest_local, self.state.newest_local_at = step, time.time()
        self._wake.set()

    def pass_over_older_timeline(self, resumed: int | None, launched_at: float) -> None:
        """The ranks resumed from step `resumed` (of either tier): this node's local steps above it that were
        committed before this attempt began belong to the training it left (another node was replaced, or a local
        step was damaged, or another node lacks them). Nobody resumes from them, and on several nodes they can never
        be published: they are not copied (ahead of the new training's first steps, they held its durable copies
        back)."""
        stale = []
        with contextlib.suppress(OSError):
            infos = self._scan(self.local_root) if self.local_root.is_dir() else []
            stale = [i.step for i in infos if not i.partial and i.step > (-1 if resumed is None else resumed)
                     and i.created_at is not None and i.created_at < launched_at]
        if stale:
            with self._lock:
                self._unusable.update(stale)
                self._queue.difference_update(stale)
            log.info("not copying local step(s) %s to the durable tier: the ranks resumed from step %s, before "
                     "them", stale, resumed)

    def roll_back(self, below: int) -> None:
        """The supervisor rolled the training back below step `below` (a non-finite loss): this node's local steps
        from there on are the training it left, and are not copied (review 13: copied on, the step rolled back past
        became the newest durable one, and the new training's copies were held back as superseded until they passed
        it). A new save of such a step number is copied as any (notify)."""
        with contextlib.suppress(OSError):
            infos = self._scan(self.local_root) if self.local_root.is_dir() else []
            stale = [i.step for i in infos if not i.partial and i.step >= below]
            with self._lock:
                self._unusable.update(stale)
                self._queue.difference_update(stale)
            if stale:
                log.info("not copying local step(s) %s to the durable tier: the run rolled back below step %d",
                         stale, below)

    def drain(self, timeout_s: float, stop: Callable[[], float | None] = lambda: None) -> bool:
        """Wait until nothing is queued, `timeout_s` passed, or a copy failed once more while waiting (a durable
        tier that is down does not hold the exit for long); True when this node's part of every local
        checkpoint newer than the durable tier's newest is there (the other nodes' may still be missing).
        `stop()` gives the seconds left once the supervisor is asked to stop (None until then): a scheduler's
        grace period does not wait for the whole copy."""
        deadline = time.monotonic() + timeout_s
        failures = self._failures
        cut = False
        looked = self._revisit(thorough=True)  # a tier that cannot be listed: what it lacks is not known
        while time.monotonic() < deadline and self._failures == failures:
            if not cut and (left := stop()) is not None:
                cut, deadline = True, min(deadline, time.monotonic() + left)
            with self._lock:
                empty = not self._queue
            if empty:
                with contextlib.suppress(OSError):
                    self._await_publish(min(deadline, time.monotonic() + PUBLISH_WAIT_S))
                return looked
            self._wake.set()  # a retry now, not after its backoff
            self._idle.wait(0.1)
        with self._lock:
            return not self._queue

    def _revisit(self, *, thorough: bool) -> bool:
        """Queue again each local step newer than the durable tier's newest that this node was not told of, or
        whose part of this node is not in the durable tier (another node's publish dropped it: one of its files
        had changed since this node vouched for it). Otherwise that step would wait as a partial until a newer
        one supersedes it. `thorough` (at exit) validates both tiers; the periodic look, which every node of a
        big job makes every REVISIT_S on the shared filesystem, takes the durable newest this node last saw and
        stats only the step's own folders (`_replicate` checks the rest, under the lock). False when a tier
        could not be looked at."""
        try:
            # the scans outside the lock the thread needs (`_handled` only grows: a stale read re-queues no more)
            if thorough:
                steps = self._unreplicated()
            else:
                with self._lock:
                    newest = -1 if self.state.newest_durable is None else self.state.newest_durable
                dirs = store.checkpoint_dirs(self.local_root) if self.local_root.is_dir() else []
                committed = (int(m.group(1)) for p in dirs if (m := store.STEP_RE.match(p.name)))
                steps = [s for s in committed if s > newest and s not in self._unusable
                         and not (self.durable_root / store.step_dirname(s)).exists()]
            again = [s for s in steps if s not in self._handled or not self._part(s).exists()]
        except OSError as e:
            log.warning("looking for local steps the durable tier lacks: %s", e)
            with self._lock:
                self.state.last_error = f"listing the tiers: {e.strerror or e} ({e.filename})"
            return False
        with self._lock:
            self._queue.update(again)
        return True

    def _await_publish(self, deadline: float) -> None:
        """This node's parts are all there; on several nodes another one may publish the newest step a moment
        later. Wait for that (briefly: that node may be gone), so that retention and the final numbers see it:
        otherwise a node that finished first keeps the steps newer than the durable tier's newest it saw, and
        its state file shows a lag the durable tier no longer has."""
        while time.monotonic() < deadline:
            local = [i.step for i in self._scan(self.local_root) if i.valid and i.step not in self._unusable] \
                if self.local_root.is_dir() else []  # a step passed over is published by nobody
            if not local or max(local) <= max(self._durable_valid(), default=-1):
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._thread.is_alive():  # the last copies' retention and the final numbers for the state file
            with contextlib.suppress(Exception):
                # Steps the periodic look queued again from a stale newest durable step, superseded since: not
                # "pending" in the state file (a reviewer's run showed a node up to date with [90, 110] pending).
                self._drop_superseded()
                self._local_retention(spares=False)
                self._refresh()
            with contextlib.suppress(Exception):  # a skipped step's partial another node's publish had to spare
                self._durable_retention(wait=False)  # on the way out: not behind another node's lock
            with contextlib.suppress(OSError):  # no save will write over them now: their memory goes back
                store.drop_spares(self.local_root)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self.state.pending = sorted(self._queue)
            return self.state.to_dict()

    # ---- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        yield_to_training()
        failures, revisit_at = 0, time.monotonic() + REVISIT_S
        while not self._stop.is_set():
            self._wake.wait(RETRY_S[min(failures, len(RETRY_S) - 1)] if failures else 1.0)
            self._wake.clear()
            if not failures:
                self._see_published()
            if not failures and time.monotonic() >= revisit_at:
                revisit_at = time.monotonic() + REVISIT_S
                try:
                    self._revisit(thorough=False)
                except Exception as e:  # the thread goes on copying what it is told of
                    log.warning("looking again for local steps the durable tier lacks: %s", e)
            try:
                failures = self._copy_queued(failures)
            except Exception as e:  # never the end of the thread, which stopped copying for good (review 9)
                failures += 1
                log.warning("copying to the durable tier: %s", e)

    def _copy_queued(self, failures: int) -> int:
        """Copy the queued steps, newest first, until the queue is empty or a copy fails; the failures in a row."""
        while not self._stop.is_set():
            with self._lock:
                todo = sorted(self._queue)
            if not todo:
                self._idle.set()
                break
            self._idle.clear()
            step = max(todo)
            try:  # a background loop logs and keeps going: the durable tier may come back
                step = self._pick(todo)  # which scans the durable tier: its failures are the same news
                wrote = self._replicate(step)
            except LocalSaveReplaced as e:  # still queued: copied again, the new save
                log.info("%s", e)
            except LocalCopyDamaged as e:  # no news of the durable tier: the next step is copied at once
                self._damaged(step, e)
            except Exception as e:  # every failure of the durable tier is the same news
                failures += 1
                self._failed(step, e)
            else:
                failures = 0
                self._done(step)
                if wrote:  # news of the durable tier only when this node's write went through
                    self._recovered()
            with contextlib.suppress(Exception):
                self._local_retention()
                self._refresh()
            if failures:
                break
        return failures

    def _see_published(self) -> None:
        """Another node may have published this node's newest local step since this node put its part there:
        one stat a second while the state file shows a lag, and the state is read again once it is there (status
        showed the node that did not publish one interval behind for most of each interval)."""
        with self._lock:
            local, durable = self.state.newest_local, self.state.newest_durable
        if local is None or (durable is not None and durable >= local):
            return
        with contextlib.suppress(Exception):
            if (self.durable_root / store.step_dirname(local)).is_dir():
                self._refresh()

    def _pick(self, todo: list[int]) -> int:
        """The step to copy next: the newest queued one that another node has already put its part of into the
        durable tier (so that every node finishes the same step), else the newest queued one. A durable tier
        slower than the saves thus copies the latest progress and skips what it supersedes, instead of falling
        further behind with every save while the local tier holds every step it has not copied."""
        def parts(step: int) -> set[str]:
            return {p.stem for p in (self.durable_root / store.partial_dirname(step) / PARTS).glob("*.json")}

        # Not back to a step older than one whose part of ours waits for the other nodes: that one supersedes it.
        waiting = [i.step for i in self._scan(self.durable_root) if i.partial and self.node in parts(i.step)] \
            if self.durable_root.is_dir() else []
        mine = max(waiting, default=-1)
        begun = [s for s in todo if s >= mine and parts(s) - {self.node}]
        return max(begun or todo)

    def _done(self, step: int) -> None:
        """`step` has this node's part in the durable tier: it leaves the queue, and so do the queued steps older
        than the newest durable checkpoint (superseded: local retention may delete them, nobody resumes from them)."""
        with self._lock:
            self._queue.discard(step)
            self._handled.add(step)
        self._drop_superseded()

    def _drop_superseded(self) -> None:
        """The queued steps older than the newest durable checkpoint leave the queue: nobody resumes from them."""
        newest = max(self._durable_valid(), default=-1)
        with self._lock:
            superseded = sorted(s for s in self._queue if s < newest)
            self._queue.difference_update(superseded)
            self.state.superseded += sum(  # steps start() re-queued with their part there were copied
                s not in self._handled and not self._part(s).exists() for s in superseded)
            self._handled.update(superseded)
        if superseded:
            log.info("not copying local step(s) %s to the durable tier: step %d is there, newer", superseded, newest)

    def _part(self, step: int) -> Path:
        """This node's part of `step` in the durable tier, while that is a partial."""
        return self.durable_root / store.partial_dirname(step) / PARTS / f"{self.node}.json"

    def _failed(self, step: int, error: Exception) -> None:
        self._failures += 1
        reason = f"{type(error).__name__}: {error}" if not isinstance(error, OSError) or not error.strerror else \
            f"{error.strerror} ({getattr(error, 'filename', '') or self.durable_root})"
        first = not self._said_failing
        self._said_failing = True
        # An outage the previous supervisor of this node timed goes on from its length then (carry_outage)
        self.state.failing_since = self.state.failing_since or (time.time() - self._outage_before)
        self.state.last_error = f"step {step}: {reason}"
        if first:
            self.announce(f"cannot copy step {step} to the durable tier {self.durable_root}: {reason}; training goes "
                          "on with the local tier, and the copy is retried", "red")

    def _damaged(self, step: int, error: LocalCopyDamaged) -> None:
        """Set the damaged local step aside (no relaunch takes it from the local tier) and pass it over."""
        local = self.local_root / store.step_dirname(step)
        with self._lock:
            self._queue.discard(step)
            self._unusable.add(step)
        try:
            where = f"set aside as {store.quarantine(local, f'local copy damaged: {error}').name}"
        except OSError as e:
            where = f"could not be set aside ({e.strerror or e})"
        self.announce(f"local step {step} is damaged ({error}): not copied to the durable tier, {where}; the "
                      "other steps are copied", "red")

    def _recovered(self) -> None:
        if self.state.failing_since is not None:
            self.announce(f"the durable tier {self.durable_root} works again (failing for "
                          f"{time.time() - self.state.failing_since:.0f}s)", "green")
        self.state.failing_since, self.state.last_error = None, None
        self._said_failing = False
        self._outage_before = 0.0

    def carry_outage(self, previous: dict | None, last_seen: float | None) -> None:
        """A durable tier the previous supervisor of this node saw failing, and never saw work again: the outage
        limit counts on from the length it had reached when that supervisor last wrote (`last_seen`), once a
        copy here fails too; the time no supervisor ran is not counted, and a copy that works here ends it (a
        supervisor restarted each hour never reached a limit of an hour, and the local tier filled; review 11: an
        outage carried as a start time let one failed copy a day later delete uncopied steps)."""
        since = (previous or {}).get("failing_since")
        if isinstance(since, (int, float)) and not isinstance(since, bool) and isinstance(last_seen, (int, float)) \
                and 0 < since <= last_seen <= time.time():
            self._outage_before = last_seen - since

    # ---- one step ------------------------------------------------------------------------------------------

    def _replicate(self, step: int) -> bool:
        """Put this node's part of `step` into the durable tier, and publish the step once every node's part is
        there; True when this node wrote there, False when there was nothing to write (the local copy is gone or
        damaged, another node completed the step, a newer one is durable): no news of the durable tier."""
        local = self.local_root / store.step_dirname(step)
        marker = file_identity(local / store.MARKER)  # which save of this step the copy is of: taken before it is
        info = store.inspect(local)  # read (review 16: the ranks saving it again in between, the copy of the new
        if file_identity(local / store.MARKER) != marker:  # save checked against the old manifest, which set the
            # good new save aside as damaged; or an inspect across the swap judged it invalid for good)
            raise LocalSaveReplaced(f"local step {step} was saved again while it was read: copying the new save")
        if not info.valid:  # gone (retention, a wiped node) or damaged: nothing of this node to vouch for
            log.warning("not replicating %s: %s", local, info.reason)
            self._unusable.add(step)
            return False
        manifest = info.manifest
        assert manifest is not None
        final = self.durable_root / store.step_dirname(step)
        partial = self.durable_root / store.partial_dirname(step)
        mine = self._part(step)
        self.durable_root.mkdir(parents=True, exist_ok=True)
        with root_lock(self.durable_root, fcntl.LOCK_SH):  # the partial as before a publish or a removal, or none
            done = store.inspect(final) if final.is_dir() else None
            if done is not None and done.valid and done.manifest is not None \
                    and _save_of(done.manifest.files) == _save_of(manifest.files):
                return False  # another node completed it
            # (valid, yet another save of this step number: the one a rollback re-made replaces it, once every
            # node's part of the new save is there)
            if step < max(self._durable_valid(), default=-1):
                return False  # superseded while queued: a newer step is durable (this partial may be retention's)
            partial.mkdir(exist_ok=True)
            if not store.real_folder(partial):  # review 13: copied into a link's folder, whose files were then unlinked
                raise OSError(errno.ENOTDIR, "a link or a file, not a folder: resilient copies and deletes nothing "
                              "through it (remove it)", str(partial))
            live = os.open(partial / store.WRITER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(live, fcntl.LOCK_SH)  # gc and retention: a writer is at work here
                if mine.exists() and _save_of(_read_part(mine)) != _save_of(manifest.files):
                    # An earlier save of this step number (before a resume from an older checkpoint): its files are
                    # not this save's, and publishing them beside another node's new part would mix two states.
                    log.warning("step %d: this node's part in the durable tier is from an earlier save of that "
                                "step; copying this one", step)
                    mine.unlink()
                copy = not mine.exists()  # if it is there, only a publish (or its check) removes it, once this is out
            except BaseException:
                os.close(live)
                raise
        try:
            for stale in partial.glob(f".*.{self.node}.tmp"):  # this node's copy cut short by a crash
                stale.unlink(missing_ok=True)
            for _ in range(2):  # again, once, if the publish finds a file of this part changed since
                if copy:  # no publish can take the folder away before this part is there
                    self._copy_part(step, local, partial, mine, manifest)
                self._unless_passed_over(step)
                if not self._try_commit(step, partial, manifest):
                    break
                copy = True
        except BaseException as e:
            os.close(live)
            self._reclaim(partial)
            if isinstance(e, ValueError) and file_identity(local / store.MARKER) != marker:
                raise LocalSaveReplaced(f"local step {step} was saved again while it was copied: copying the new "
                                        "save") from e
            raise
        os.close(live)
        return True

    def _reclaim(self, partial: Path) -> None:
        """After a failed copy: a durable partial that no node's part vouches for and no writer is in goes, so a
        full durable tier gets its room back (the next try copies a newer step, and would find none left)."""
        aside = None
        with contextlib.suppress(OSError), root_lock(self.durable_root, fcntl.LOCK_EX | fcntl.LOCK_NB) as free:
            if free and partial.is_dir() and not any((partial / PARTS).glob("*.json")) \
                    and store.writer_alive(partial) is None:
                aside = store.aside_path(partial)
                os.rename(partial, aside)
        if aside is not None:  # deleted after the lock: a node waits for the rename only
            shutil.rmtree(aside, ignore_errors=True)

    def _copy_part(self, step: int, local: Path, partial: Path, mine: Path, manifest: store.Manifest) -> None:
        """Copy (or find whole) every file of this node's local checkpoint, then write its part, which names
        each file it vouches for with the identity it had then (inode, size, mtime): the publish checks them."""
        t0, copied, ids = time.monotonic(), 0, {}
        for i, rec in enumerate(manifest.files):
            self._unless_passed_over(step)
            n, ids[rec.name] = self._copy_verified(local / rec.name, partial / rec.name, rec,
                                                   manifest.checksum_algorithm)
            copied += n
            if i == 0 and self._pause:
                log.warning("test hook: pausing %.1fs inside the replication of step %d", self._pause, step)
                time.sleep(self._pause)
        self._unless_passed_over(step)  # before the part that vouches for it: nothing of it is published
        fsync_dir(partial)
        (partial / PARTS).mkdir(exist_ok=True)
        doc = {"node": self.node, "files": [f.to_dict() for f in manifest.files], "ids": ids, "at": time.time(),
               "world_size": manifest.world_size, "nodes": manifest.extra.get("nodes", [self.node])}
        atomic_write_bytes(mine, json.dumps(doc).encode(), durable=True)
        self.state.bytes_copied += copied
        self.state.seconds_copying += time.monotonic() - t0
        if step not in self._handled:  # copied again (its part dropped) it counts once
            self.state.replicated += 1

    def _unless_passed_over(self, step: int) -> None:
        """A rollback passed over `step` while it was being copied (review 14: the copy under way when the loss went
        non-finite was most often of the very step rolled back past, and it published): the copy stops here."""
        with self._lock:
            passed = step in self._unusable
        if passed:
            raise LocalSaveReplaced(f"local step {step} was passed over by a rollback while it was copied: not copied")

    def _copy_verified(self, src: Path, dest: Path, rec: store.FileRecord,
                       algorithm: str) -> tuple[int, list[int] | None]:
        """Copy `src` to `dest` through a temp name, checksummed while copied; returns the bytes copied (0 when
        `dest` was already there, whole: another node's copy of a shared file, or an earlier try's) and the
        identity of the file whose bytes were checked (a rename keeps it)."""
        before = file_identity(dest)
        if before is not None and before[1] == rec.size and store.checksum_file(dest, algorithm) == rec.checksum \
                and file_identity(dest) == before:  # the same file throughout the read: not replaced meanwhile
            return 0, before
        tmp = dest.with_name(f".{dest.name}.{self.node}.tmp")
        if self._buffer is None:  # one for the replicator's life: fresh pages cost (see store.keep_spare)
            self._buffer = page_aligned_buffer(CHUNK)
        buf = self._buffer
        try:
            out = HashedFile(tmp, store.hasher(algorithm), direct=True)  # the durable write, around the page cache
        except FileNotFoundError as e:  # the partial is gone: another node published it (or it was reclaimed)
            raise LocalSaveReplaced(f"durable {dest.parent.name} was published or emptied by another node while "
                                    "this node copied into it: copying again") from e
        try:
            try:
                fin = open(src, "rb", buffering=0)  # noqa: SIM115 (closed by the with below)
            except FileNotFoundError as e:  # review 13: a local fault, which started the durable tier's outage clock
                raise LocalSaveReplaced(f"local {src.parent.name} was removed or saved again while it was "
                                        "copied: copying the new save, if any") from e
            with fin:
                while n := fin.readinto(buf):  # the one copy on this node's CPU: out of the local tier
                    out.write(buf[:n], aligned=True)
            digest = out.close()
        except BaseException:
            out.abort()
            tmp.unlink(missing_ok=True)  # a full disk gets its room back
            raise
        if digest != rec.checksum:
            tmp.unlink(missing_ok=True)
            raise LocalCopyDamaged(f"{src.name} does not match its manifest's checksum")
        ident = file_identity(tmp)
        with root_lock(self.durable_root, fcntl.LOCK_SH):  # never between a publish's checks and its rename
            try:
                os.replace(tmp, dest)
            except FileNotFoundError as e:
                # Another node published (or its publish dropped) the partial while this node copied another save
                # of the step into it (review 16): the temp went with the folder, where it made the published
                # checkpoint inspect corrupt. Taken out, and the step copied again: no news of the durable tier.
                final = self.durable_root / store.step_dirname(int(dest.parent.name[5:14]))
                (final / tmp.name).unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)
                raise LocalSaveReplaced(f"durable {dest.parent.name} was published or emptied by another node while "
                                        "this node copied into it: copying again") from e
        return rec.size, ident

    def _try_commit(self, step: int, partial: Path, manifest: store.Manifest) -> bool:
        """Publish the durable checkpoint if every node of the save has its part there (one node does). True
        when this node's part was dropped because one of its files changed after it was verified."""
        nodes = set(manifest.extra.get("nodes") or [self.node])
        this_save = _save_of(manifest.files)

        def parts() -> dict[str, Any]:
            found = {}
            for p in (partial / PARTS).glob("*.json"):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    doc = json.loads(p.read_bytes())
                    if _save_of(doc["files"]) == this_save:  # a part of an earlier save waits for its node
                        found[p.stem] = doc
            return found

        if not nodes <= set(parts()):
            return False
        with root_lock(self.durable_root, fcntl.LOCK_EX):
            found = parts()  # again: another node may have published it (the folder is gone) while this one waited
            if not partial.is_dir() or not nodes <= set(found):
                return False
            # A node copying another save of this step number (its local tier held an older one) may have
            # replaced a file after a node of this save verified it. A file that is not the one a part vouched
            # for is read again: two nodes copying a shared file at once replace it with the same bytes.
            sums: dict[str, str | None] = {}
            changed = {node: names for node, doc in found.items()
                       if (names := _replaced(partial, doc, sums, manifest.checksum_algorithm))}
            if changed:
                for node, names in changed.items():
                    (partial / PARTS / f"{node}.json").unlink(missing_ok=True)
                    log.warning("step %d: %s changed in the durable tier after node %s verified it (a copy of "
                                "another save of that step?); its part is dropped and the step not published "
                                "until it is copied again", step, ", ".join(sorted(names)), node)
                return self.node in changed
            records: dict[str, store.FileRecord] = {}
            for part in found.values():
                for f in part["files"]:
                    rec = _record(f)
                    if records.setdefault(rec.name, rec) != rec:
                        raise ValueError(f"nodes disagree about {rec.name} of step {step}")
            _drop_unvouched(partial, step, set(records))
            extra = {k: v for k, v in manifest.extra.items() if k not in ("tier", "node")}
            extra["tier"] = "durable"
            extra["saved_at"] = saved_at = store.saved_time(manifest.created_at, manifest.extra)
            store.publish(partial, step, manifest.world_size, list(records.values()), extra,
                          manifest.checksum_algorithm)
        with self._lock:  # what status and the exit see, before this step leaves the queue
            if self.state.newest_durable is None or step > self.state.newest_durable:
                self.state.newest_durable, self.state.newest_durable_at = step, saved_at
        self.announce(f"step {step} is in the durable tier ({len(nodes)} node(s)' parts)", None)
        try:
            self._durable_retention()
        except OSError as e:  # the step is published: this is no failed copy, and the next publish tries again
            log.warning("durable retention after step %d: %s", step, e)
        return False

    def _durable_retention(self, *, wait: bool = True) -> None:
        """`keep` durable checkpoints; partials older than the newest valid one go unless a writer holds them.
        Under the lock (no node enters a partial it finds unheld) the folders are only renamed aside; they are
        deleted after it, so that a slow filesystem's deletes hold up no node's entry or publish."""
        if not self.durable_root.is_dir():
            return
        with root_lock(self.durable_root, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)) as held:
            if not held:
                return
            infos = self._scan(self.durable_root)
            plan = retention.plan(self.durable_root, infos, self.keep, owner_alive=True,
                                  handed_over=retention.may_be_loading(infos, self.loading))
            plan = retention.set_aside(plan)
        if plan.remove:
            retention.apply(plan)

    # ---- the tiers -----------------------------------------------------------------------------------------

    def _scan(self, root: Path) -> list[store.CheckpointInfo]:
        return store.scan(root, cache=self._inspected)

    def _durable_valid(self) -> dict[int, store.CheckpointInfo]:
        if not self.durable_root.is_dir():
            return {}
        return {i.step: i for i in self._scan(self.durable_root) if i.valid}

    def _unreplicated(self) -> list[int]:
        """Local checkpoints newer than the newest durable one: the durable tier lacks them (this node's part may
        be there already; queuing it again only retries the publish, which the last node's crash may have cut)."""
        if not self.local_root.is_dir():
            return []
        newest = max(self._durable_valid(), default=-1)
        return [i.step for i in self._scan(self.local_root)
                if i.valid and i.step > newest and i.step not in self._unusable]

    def _local_retention(self, *, spares: bool = True) -> None:
        """Keep `keep_local` newest local checkpoints; older ones go only once the durable tier has them (or it
        has been failing longer than the outage limit). With `spares`, a deleted checkpoint's data files are
        kept for the next save to write over, up to what this node's newest checkpoint holds in data files."""
        if not self.local_root.is_dir():
            return
        outage = self.state.failing_since is not None and time.time() - self.state.failing_since > self.outage_s
        infos = self._scan(self.local_root)
        loading = retention.may_be_loading(infos, self.loading)
        plan, held = split_unreplicated(retention.plan(self.local_root, infos, self.keep_local, owner_alive=True,
                                                       handed_over=loading),
                                        infos, set(self._durable_valid()))
        if outage:
            for r in held:
                self.state.deleted_unreplicated.append(r.step)
                self.announce(f"deleting local step {r.step}, which has no durable copy: the durable tier has been "
                              f"failing for {time.time() - (self.state.failing_since or 0):.0f}s", "red")
            with self._lock:  # gone, so neither pending nor, later, "superseded" (audit 7: both counted them)
                self._queue.difference_update(r.step for r in held)
                self._handled.update(r.step for r in held)
            plan = retention.Plan(plan.kept, plan.remove + held, plan.spared)
        if plan.remove:
            newest = plan.kept[-1].manifest if plan.kept else None
            data = sum(f.size for f in newest.files if f.name.endswith(store.DATA_SUFFIX)) if newest else 0
            retention.apply(plan, spare_bytes=data if spares else 0)

    def _refresh(self) -> None:
        local = [i for i in self._scan(self.local_root) if i.valid] if self.local_root.is_dir() else []
        durable = self._durable_valid()
        with self._lock:
            if local:
                self.state.newest_local, self.state.newest_local_at = local[-1].step, local[-1].created_at
            if durable:
                newest = max(durable)
                info = durable[newest]
                self.state.newest_durable = newest
                extra = info.manifest.extra if info.manifest else {}
                self.state.newest_durable_at = store.saved_time(info.created_at, extra)


def _drop_unvouched(partial: Path, step: int, vouched: set[str]) -> None:
    """Before a publish, under the root's exclusive lock (no node copies meanwhile): the files of an earlier save of
    this step that no part of this save vouches for go (audit 7: after an elastic shrink the surviving node saved
    step 80 again at world size 1, and the world-2 save's `__1_1.distcp` left in the partial failed every publish,
    reported as a failing durable tier). Bookkeeping and OS litter stay, as the publish judges them."""
    for entry in os.scandir(partial):
        if entry.name in vouched or entry.name in store.RESERVED or store.OS_LITTER.match(entry.name):
            continue
        if entry.is_file(follow_symlinks=False) or entry.is_symlink():
            os.unlink(entry.path)
            log.info("step %d: removed %s from its durable partial: no node's part of this save vouches for it",
                     step, entry.name)
