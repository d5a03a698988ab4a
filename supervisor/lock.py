"""The run dir lock: one live supervisor per node of a run dir.

An `flock` on `<node dir>/supervisor.lock`; the kernel drops it when the holder dies, however it dies, so
a stale lock never blocks a restart. The file also records who holds it, for the error message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from supervisor.errors import ConfigError, RunLockedError, UsageError
from supervisor.fsutil import atomic_write_json, open_regular, open_to_probe, read_json
from supervisor.layout import LOCK_FILE


class RunLock:
    """Exclusive hold on a node dir for the life of this object (or process)."""

    def __init__(self, node_dir: str | os.PathLike):
        self.path = Path(node_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunLockedError naming the holder."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # never through a link: its target was truncated and written over (a run dir is the user's)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:  # `resilient run` checks first; this is the race with a remount
            if e.errno == errno.ELOOP:
                raise ConfigError(f"{self.path} is a link to {os.path.realpath(self.path)}: resilient writes a run's "
                                  "own files only inside its run dir; remove the link; nothing was launched.") from None
            raise UsageError(f"{self.path.parent}: cannot take the run dir's lock ({e.strerror}); make the run dir "
                             "writable, or pick another --run-dir.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            who = holder(self.path.parent) or {}
            other = "--node" if self.path.parent.parent.name == "nodes" else "--run-dir"  # a node's folder (audit 18)
            raise RunLockedError(
                f"{self.path.parent} is held by another live supervisor (pid {who.get('pid', '?')} on "
                f"{who.get('host', '?')}); stop it first, or pick another {other}."
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        with _named_on_error(fd, self.path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(node_dir: str | os.PathLike) -> dict | None:
    """Who holds the lock of `node_dir` ({"pid", "host", "since"}), or None if nobody does."""
    path = Path(node_dir) / LOCK_FILE
    try:
        fd = open_regular(path)  # a FIFO there would hang status, logs and gc
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                return json.loads(os.pread(fd, 4096, 0) or b"{}") or {"pid": None}
            except ValueError:
                return {"pid": None}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


OWNERS_DIR = ".resilient-owners"  # inside a checkpoint root: one lock file per run that writes there
OWNER_FILE = "owner.json"  # in OWNERS_DIR: the job whose checkpoints the root holds (a local tier: and its durable one)


class RootClaim:
    """A run's hold on its checkpoint root: two runs (two run dirs) must never write one root, nor two nodes one
    node-local tier.

    Every supervisor of a run (one per node; they share its run dir) holds a shared `flock` on
    `<root>/.resilient-owners/<run>.lock` for its life, where `<run>` names the run dir (and, for a local tier,
    the node). Taking it, a supervisor first checks, under an exclusive lock on `claim.lock` so that two starting
    at the same instant are ordered, that no other run's file is held. The kernel drops the locks when a holder
    dies.

    With `job`, the root also records whose checkpoints it holds (OWNER_FILE): the job's name and, for a local tier,
    the durable root it is copied to. A root that holds checkpoints of another job, or a local tier that holds those
    of another durable root, is refused even when no run holds it now (audit 7: a second job given the README's
    `/local_nvme/{node}` resumed from the first job's weights without a word).
    """

    def __init__(self, root: str | os.PathLike, run_dir: str | os.PathLike, key: str = "checkpoint.dir",
                 node: str | None = None, *, job: str | None = None, durable: str | os.PathLike | None = None):
        self.root = Path(root)
        self.run_dir = Path(os.path.realpath(run_dir))
        self.key = key  # the job-file key that names the root, for the sentence when it cannot be made
        self.node = node  # a node-local tier's: one node's alone, never shared with the run's other nodes
        self.owner = None if job is None else {
            "job": job, "durable_root": None if durable is None else os.path.realpath(durable)}
        self._fd: int | None = None
        self.adopted = False  # acquire took a root holding checkpoints that recorded no owner: said on the console

    def _name(self) -> str:
        import hashlib

        owner = str(self.run_dir) if self.node is None else f"{self.run_dir}\0{self.node}"
        return hashlib.sha256(owner.encode()).hexdigest()[:16] + ".lock"

    def prepare(self) -> None:
        """Make the root's owners folder and its claim file, or ConfigError: `resilient run` asks before it takes
        any lock, so that a root the filesystem refuses leaves nothing behind in the run dir."""
        os.close(self._open_mutex())

    def _open_mutex_raw(self) -> int:
        owners = self.root / OWNERS_DIR
        owners.mkdir(parents=True, exist_ok=True)
        return os.open(owners / "claim.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)

    def _open_mutex(self) -> int:
        try:
            return self._open_mutex_raw()
        except OSError as e:  # access() said writable, the filesystem says no (/sys, /proc, some FUSE mounts)
            raise ConfigError(f"{self.root}: the checkpoint folder cannot be created or written there "
                              f"({e.strerror or e}); nothing was launched. Point {self.key} at a writable "
                              "folder.") from None

    def acquire(self) -> RootClaim:
        """Take the claim or raise RunLockedError naming the other run."""
        owners = self.root / OWNERS_DIR
        mutex = self._open_mutex()
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)
            self.refuse_if_taken()
            if self.owner is not None and (recorded := self._recorded_owner()) != self.owner:
                self.adopted = recorded is None and _holds_checkpoints(self.root)
                atomic_write_json(owners / OWNER_FILE, self.owner, durable=False)
            self._fd = self._hold(owners)
        finally:
            os.close(mutex)  # closing drops the exclusive lock
        return self

    def _hold(self, owners: Path) -> int:
        """This run's lock file in `owners`, made if need be, held shared, saying who holds it; its fd."""
        path = owners / self._name()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)  # a link: ELOOP
        with _named_on_error(fd, path):
            fcntl.flock(fd, fcntl.LOCK_SH)
            info = json.dumps({"run_dir": str(self.run_dir), "pid": os.getpid(), "host": socket.gethostname(),
                               "node": self.node})
            os.pwrite(fd, info.encode().ljust(4096), 0)  # one run's nodes all write the same run dir
        return fd

    def _recorded_owner(self) -> dict | None:
        try:
            doc = read_json(self.root / OWNERS_DIR / OWNER_FILE)
        except (OSError, ValueError):
            return None  # none yet (a root made before owners were recorded, or a new one): this run's from now
        return doc if isinstance(doc, dict) else None

    def _foreign_owner(self) -> str | None:
        """Whose checkpoints the root holds when they are not this run's to resume from ("job 'beta'"), else None."""
        recorded = self._recorded_owner() if self.owner is not None else None
        if recorded is None or recorded == self.owner or not _holds_checkpoints(self.root):
            return None
        assert self.owner is not None
        if recorded.get("job") != self.owner["job"]:
            return f"job {recorded.get('job')!r}"
        if self.node is not None and recorded.get("durable_root") != self.owner["durable_root"]:
            return f"this job's run that copies them to {recorded.get('durable_root')}"
        return None

    def refuse_if_foreign(self) -> None:
        """ConfigError when the root holds checkpoints that another job wrote (a local tier: for another durable
        root); creates nothing. An empty root, or one without a record (written before records were kept), is this
        run's to take."""
        whose = self._foreign_owner()
        if whose is None:
            return
        assert self.owner is not None
        example = f"/local_nvme/{self.owner['job']}/{{node}}" if self.node is not None else \
            f"/shared/ckpt/{self.owner['job']}"
        raise ConfigError(f"{self.root} holds checkpoints of {whose}, which this run would resume from as its own; "
                          f"nothing was launched. Give this job its own {self.key} (a folder per job, e.g. {example}), "
                          "or empty that one if its checkpoints are no longer wanted.")

    def refuse_if_taken(self) -> None:
        """RunLockedError naming the other live run that holds the root; creates nothing, so `resilient run` asks
        first, before it makes a new run dir that a refusal would leave behind (acquire asks again, ordered)."""
        self.refuse_if_foreign()
        who = self._other_holder()
        if who is not None:
            by = f"supervisor pid {who.get('pid', '?')} on {who.get('host', '?')}"
            if self.node is not None and who.get("run_dir") == str(self.run_dir) and who.get("node"):
                raise RunLockedError(
                    f"{self.root} is the local tier of node {who['node']} of this run ({by}); each node needs its "
                    f"own: put {{node}} in {self.key} (as in /dev/shm/ckpt-{{node}}).")
            raise RunLockedError(
                f"{self.root} is the checkpoint root of another live run ({who.get('run_dir', '?')}, {by}); two runs "
                f"must not share one: give this job its own {self.key}, or stop the other run.")

    def _other_holder(self) -> dict | None:
        """What the live holder of another run's lock file in the root recorded ({} if unreadable), or None."""
        return live_holder(self.root, but=self._name())

    def reassert(self) -> str | None:
        """Make the claim again if its files are gone while this run holds it: a local tier wiped mid-run (a
        cleaner, an operator) was made again by the ranks' next save with neither the record of whose checkpoints
        it holds nor this run's lock, so the next job given that folder took it and resumed from this one's
        weights without a word (audit 13). A lock file another node of the run made again is held again too (the
        old one, unlinked, blocks nobody). A few stat calls when nothing is gone; never raises (a filesystem that
        errs now is asked again at the next call).

        Another run that took the wiped root in between keeps it: this run does not join it, and the sentence that
        says so is returned for the console (it was joined without a word: two runs writing one root)."""
        if self._fd is None:
            return None
        owners = self.root / OWNERS_DIR
        try:
            held, there = os.fstat(self._fd), os.stat(owners / self._name())
            if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino) and \
                    (self.owner is None or (owners / OWNER_FILE).exists()):
                return None
        except OSError:
            pass  # gone (or unreadable now): made again below, if the filesystem lets us
        with contextlib.suppress(OSError):
            mutex = self._open_mutex_raw()
            try:  # not waited for: a claim being taken (or a hung lock server) is tried again at the next call
                fcntl.flock(mutex, fcntl.LOCK_EX | fcntl.LOCK_NB)
                who, whose = self._other_holder(), self._foreign_owner()
                if who is not None or whose is not None:
                    by = f"the live run {who.get('run_dir', '?')} (supervisor pid {who.get('pid', '?')} on " \
                         f"{who.get('host', '?')})" if who is not None else whose
                    return (f"{self.root} ({self.key}) was emptied while this run used it and is now held by {by}: "
                            "both runs' checkpoints go there and either may resume from the other's; stop one of "
                            f"them and give each its own {self.key}")
                if self.owner is not None and self._recorded_owner() is None:
                    atomic_write_json(owners / OWNER_FILE, self.owner, durable=False)
                old, self._fd = self._fd, self._hold(owners)
                os.close(old)
            finally:
                os.close(mutex)
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RootClaim:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def live_holder(root: str | os.PathLike, but: str | None = None) -> dict | None:
    """What the supervisor holding a run's claim on checkpoint root `root` recorded (run_dir, pid, host, node; {}
    if unreadable), or None when no live supervisor holds one (`but`: a lock file of the caller's own, not asked)."""
    try:
        held = sorted((Path(root) / OWNERS_DIR).glob("*.lock"))
    except OSError:
        return None
    for path in held:
        if path.name not in (but, "claim.lock") and (who := _held_by(path)) is not None:
            return who
    return None


def _held_by(path: Path) -> dict | None:
    """Who holds `path` (its recorded JSON), or None when no live process does."""
    try:
        fd = open_to_probe(path)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno == errno.EBADF:  # read-only on NFS (review 14): cannot tell, so held by someone unknown
                return {}  # (review 15: "no holder" let gc go on)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                return json.loads(os.pread(fd, 4096, 0).rstrip(b" \0") or b"{}")
            except ValueError:
                return {}
        return None
    finally:
        os.close(fd)


def _holds_checkpoints(root: Path) -> bool:
    """Whether `root` holds a checkpoint folder of any state (a step, a partial save, one set aside)."""
    from supervisor import store  # imported when asked: lock is imported by light code that needs no store

    try:
        return bool(store.checkpoint_dirs(root, quarantined=True))
    except OSError:
        return False


@contextlib.contextmanager
def _named_on_error(fd: int, path: Path) -> Iterator[None]:
    """Writes to a lock file: an OSError (a full disk) closes it and names it, so `run` can say where to free space
    (os.pwrite's own error names no file)."""
    try:
        yield
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, e.strerror, str(path)) from None
