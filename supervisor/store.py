"""The checkpoint store: the one place that owns the on-disk format, for the supervisor and the writers.

Layout under a checkpoint root::

    step_000000050/                  a committed checkpoint
        __0_0.distcp  __1_0.distcp  .metadata     data written by DCP (any files, really)
        COMPLETE.json                the completion marker: manifest of every file, size and checksum
    step_000000060.partial/          a save in progress, or abandoned; never a checkpoint
        .writer.lock                 flock-ed by the committing writer while the save is live
    step_000000070.quarantined/      a checkpoint set aside: corrupt, or whole yet unloadable; never resumed
        QUARANTINE.json              from, never deleted by resilient (the user removes it)

Writing protocol (`begin` → every rank writes and `describe_files` its own files → rank 0 `commit`):

1. rank 0 `begin(root, step)` makes a fresh partial folder and holds its writer lock;
2. every rank writes its data there, fsyncs it, and checksums its own files (`describe_files`);
3. rank 0 gathers the records and calls `commit`, which checks the folder holds exactly those files,
   writes the marker last (temp, fsync, rename, fsync of the folder), renames the folder to `step_<N>`
   and fsyncs the root.

A checkpoint is valid only when its marker parses (and matches its own checksum) and every listed file is
present with its recorded size, with nothing unlisted beside them; the small files that make a checkpoint
loadable (DCP's `.metadata`, anything up to SMALL_FILE_BYTES) must also match their checksums, in every
mode, and a deep check reads every byte. Within a rank's data file, each item's bytes have checksums of their
own, per piece, in a table at the file's end (`sums_trailer`), which the loading ranks check as they read.
This module never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import re
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import __version__
from supervisor.fsutil import (
    atomic_write_bytes,
    exchange,
    fsync_dir,
    open_regular,
    open_to_probe,
    parse_json,
    read_regular,
)

log = logging.getLogger("resilient")

FORMAT = "resilient-checkpoint"
SCHEMA_VERSION = 1
MARKER = "COMPLETE.json"
WRITER_LOCK = ".writer.lock"
PARTIAL_SUFFIX = ".partial"
TRASH_PREFIX = ".trash."
SPARE_DIR = ".spare"  # in a local tier: data files of deleted checkpoints, for the next saves to write over
DATA_SUFFIX = "_0.distcp"  # a rank's data file (its tensors), the one file of a save worth writing over
STEP_RE = re.compile(r"^step_([0-9]{9})\Z")  # \Z: "$" also matches before a final newline
PARTIAL_RE = re.compile(r"^step_([0-9]{9})\.partial\Z")
QUARANTINE_SUFFIX = ".quarantined"
QUARANTINE_RE = re.compile(r"^step_([0-9]{9})\.quarantined(?:\.([0-9]+))?\Z")
QUARANTINE_FILE = "QUARANTINE.json"
# Files this small are checksummed by every check, not only a deep one: reading them costs nothing, and
# DCP's .metadata (a few KB to MB) is read first by every load, so one flipped byte there fails every rank.
SMALL_FILE_BYTES = 1 << 20
# Files that a file browser or a network filesystem leaves in any folder it touches (macOS's .DS_Store and ._
# AppleDouble files, NFS's .nfsXXXX silly renames, Windows' Thumbs.db): beside a committed checkpoint they say
# nothing of its bytes, and counting them as unlisted set whole checkpoints aside (audit). Never DCP's names.
OS_LITTER = re.compile(r"^(\.DS_Store|\._.+|\.nfs[0-9A-Fa-f]+|Thumbs\.db)\Z")
CHECKSUM_ALGORITHM = "xxh3_128"  # fastest measured here: bench/checksums.py
CHUNK = 8 << 20

Progress = Callable[[int], None]


class Status(str, enum.Enum):
    VALID = "valid"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"
    # Could not be read here (permissions, an I/O error, a checksum package not installed): nothing is known about
    # its bytes, so it is neither resumed from nor deleted.
    UNREADABLE = "unreadable"


class UnsupportedChecksum(Exception):
    """A marker names a checksum algorithm this machine cannot compute (its optional package is missing)."""


MAX_STEP = 10**9 - 1  # the 9-digit layout's last


def step_dirname(step: int) -> str:
    """`step_000000050` for step 50."""
    if step < 0 or step > MAX_STEP:
        raise ValueError(f"step {step} does not fit the 9-digit layout")
    return f"step_{step:09d}"


def partial_dirname(step: int) -> str:
    return step_dirname(step) + PARTIAL_SUFFIX


# --------------------------------------------------------------------------------------------------
# Checksums


def hasher(algorithm: str = CHECKSUM_ALGORITHM) -> Any:
    """A streaming hasher (`update`, `hexdigest`) for the manifest's algorithm."""
    return _hasher(algorithm)


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "crc32c":
        try:
            import crc32c  # optional: only to verify manifests written with it
        except ImportError:
            raise UnsupportedChecksum("its checksums are crc32c, which needs the crc32c package here "
                                      "(pip install crc32c)") from None
        return crc32c.CRC32CHash()
    if algorithm in ("sha256", "blake2b", "md5"):
        return hashlib.new(algorithm)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum_file(path: str | os.PathLike, algorithm: str = CHECKSUM_ALGORITHM,
                  progress: Progress | None = None) -> str:
    """Hex digest of a whole file, read sequentially in large chunks."""
    h = _hasher(algorithm)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:  # a link in a checkpoint is never read through
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while n := f.readinto(buf):
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


class PieceMismatch(ValueError):
    """Bytes read back do not match the checksum recorded for them when they were saved."""


@dataclass(frozen=True)
class PieceSums:
    """The checksums of one saved item (a tensor's raw bytes, or a pickled value, in a rank's data file), one
    per `piece` bytes from its start: a load verifies each piece it reads, so a flipped bit is found there even
    when the check before a relaunch looked at sizes only. Kept in a table at the end of the data file
    (`sums_trailer`), which the file's own checksum covers."""

    algorithm: str
    piece: int
    digests: tuple[bytes, ...]

    def check(self, index: int, view: memoryview | bytes, what: str) -> None:
        """Raises PieceMismatch unless `view` is piece `index`'s bytes as saved; `what` names the item."""
        h = _hasher(self.algorithm)
        h.update(view)
        if index >= len(self.digests) or h.digest() != self.digests[index]:
            start = index * self.piece
            raise PieceMismatch(f"{what}: its bytes {start}-{start + len(view)} do not match the checksum "
                                "recorded when they were saved (the file was damaged since)")

    def check_all(self, view: memoryview | bytes, what: str) -> None:
        for i, start in enumerate(range(0, max(len(view), 1), self.piece)):
            self.check(i, view[start:start + self.piece], what)


SUMS_MAGIC = b"RSUMS\x00\x00\x01"  # the last 8 bytes of a data file that ends with its items' checksums


def sums_trailer(items: Sequence[tuple[int, int, PieceSums]]) -> bytes:
    """What a rank appends to its data file: a table of its items' checksums, keyed by (offset, length), then the
    table's length and SUMS_MAGIC. Every item's sums share one algorithm and piece size."""
    algorithm = items[0][2].algorithm if items else CHECKSUM_ALGORITHM
    piece = items[0][2].piece if items else 0
    assert all(s.algorithm == algorithm and s.piece == piece for _, _, s in items)
    doc = {"algorithm": algorithm, "piece": piece,
           "items": [[offset, length, b"".join(s.digests).hex()] for offset, length, s in items]}
    table = json.dumps(doc, separators=(",", ":")).encode()
    return table + len(table).to_bytes(8, "little") + SUMS_MAGIC


def read_sums_trailer(fd: int, name: str) -> dict[tuple[int, int], PieceSums]:
    """The checksums table at the end of data file `fd` (`name` for the message), by (offset, length);
    PieceMismatch if the file does not end with one that parses."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, 16, max(0, size - 16))
    length = int.from_bytes(tail[:8], "little") if len(tail) == 16 else -1
    if tail[8:] != SUMS_MAGIC or not 0 < length <= size - 16:
        raise PieceMismatch(f"{name}: its table of checksums is not at its end (the file was damaged or cut)")
    try:
        doc = json.loads(os.pread(fd, length, size - 16 - length))
        algorithm, piece, out = doc["algorithm"], doc["piece"], {}
        if type(piece) is not int or (piece <= 0 and doc["items"]):  # an empty table has no piece size
            raise ValueError(f"piece {piece!r}")
        _hasher(algorithm)  # ValueError for a name that is none
        for offset, n, digests in doc["items"]:
            raw = bytes.fromhex(digests)
            count = max(1, -(-n // piece))
            width = len(raw) // count
            out[(offset, n)] = PieceSums(algorithm, piece, tuple(raw[k:k + width] for k in range(0, len(raw), width)))
        return out
    except (ValueError, KeyError, TypeError, UnsupportedChecksum) as e:
        raise PieceMismatch(f"{name}: its table of checksums does not parse ({e}): the file was damaged, or "
                            "written by a newer resilient") from None


class PieceSummer:
    """Builds the PieceSums of items within a stream of bytes being written: `feed` it the whole stream, in
    order, as (position, bytes); each item is a (start, length) range of the stream (ranges may overlap: a
    state can hold one tensor under two names)."""

    def __init__(self, items: Sequence[tuple[int, int]], piece: int, algorithm: str = CHECKSUM_ALGORITHM):
        self.items, self.piece, self.algorithm = list(items), piece, algorithm
        self.digests: list[list[bytes]] = [[] for _ in self.items]
        self._order = sorted(range(len(self.items)), key=lambda k: self.items[k][0])
        self._next = 0  # in _order: the first item not yet begun
        self._open: dict[int, Any] = {}  # item -> the hasher of its piece being summed

    def feed(self, pos: int, view: memoryview) -> None:
        end = pos + len(view)
        while self._next < len(self._order) and self.items[self._order[self._next]][0] < end:
            self._open[self._order[self._next]] = None
            self._next += 1
        for k in list(self._open):
            start, length = self.items[k]
            lo, hi = max(pos, start), min(end, start + length)
            while lo < hi:  # piece by piece
                piece_end = start + (len(self.digests[k]) + 1) * self.piece
                upto = min(hi, piece_end)
                h = self._open[k] or _hasher(self.algorithm)
                h.update(view[lo - pos:upto - pos])
                self._open[k] = h
                if upto == piece_end or upto == start + length:
                    self.digests[k].append(h.digest())
                    self._open[k] = None
                lo = upto
            if start + length <= end:
                del self._open[k]

    def sums(self) -> list[PieceSums]:
        """One PieceSums per item (an empty item has the digest of no bytes)."""
        empty = _hasher(self.algorithm).digest()
        return [PieceSums(self.algorithm, self.piece, tuple(d) if d or length else (empty,))
                for d, (_, length) in zip(self.digests, self.items, strict=True)]


# --------------------------------------------------------------------------------------------------
# The manifest


@dataclass(frozen=True)
class FileRecord:
    """One data file of a checkpoint, relative to its folder."""

    name: str
    size: int
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Manifest:
    """The content of the completion marker."""

    step: int
    world_size: int
    created_at: float
    files: tuple[FileRecord, ...]
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    writer: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": iso(self.created_at),
            "created_at_unix": self.created_at,
            "checksum_algorithm": self.checksum_algorithm,
            "total_bytes": self.total_bytes,
            "writer": self.writer,
            "files": [f.to_dict() for f in self.files],
            "extra": self.extra,
        }
        doc["marker_checksum"] = _marker_checksum(doc, self.checksum_algorithm)
        return (json.dumps(doc, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a marker; raises ValueError with a short reason for anything malformed."""
        try:
            doc = parse_json(data)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
            raise ValueError(f"not valid JSON ({e.__class__.__name__})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a resilient completion marker")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema_version {doc.get('schema_version')!r} is not {SCHEMA_VERSION}")
        recorded = doc.pop("marker_checksum", None)  # absent in markers written before it existed
        try:
            if recorded is not None and recorded != _marker_checksum(doc, str(doc.get("checksum_algorithm"))):
                raise ValueError("does not match its own checksum (a changed byte)")
        except (TypeError, ValueError) as e:
            raise ValueError(str(e) if "own checksum" in str(e) else f"its own checksum cannot be computed ({e})") \
                from None
        def field(src: Any, name: str, kind: type, where: str = "") -> Any:
            """`src[name]` as `kind`, or a reason naming the field (audit 15: Python's "dictionary update sequence
            element #0 has length 1" and "cannot convert float infinity to integer" were the reasons given)."""
            value = src.get(name) if isinstance(src, dict) else None
            ok = isinstance(value, kind) and not isinstance(value, bool) if kind in (int, str, dict) else \
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok:
                words = {int: "an integer", float: "a finite number", str: "text", dict: "an object"}[kind]
                raise ValueError(f"field {where}{name} is missing or not {words}")
            return kind(value)

        if not isinstance(doc.get("files"), list):
            raise ValueError("field files is missing or not a list")
        files = tuple(FileRecord(field(f, "name", str, f"files[{i}]."), field(f, "size", int, f"files[{i}]."),
                                 field(f, "checksum", str, f"files[{i}].")) for i, f in enumerate(doc["files"]))
        manifest = cls(step=field(doc, "step", int), world_size=field(doc, "world_size", int),
                       created_at=field(doc, "created_at_unix", float), files=files,
                       checksum_algorithm=field(doc, "checksum_algorithm", str),
                       writer=field({"writer": doc.get("writer", {})}, "writer", dict),
                       extra=field({"extra": doc.get("extra", {})}, "extra", dict))
        if any(f.name in ("", ".", "..") or "/" in f.name or f.size < 0 for f in files):
            raise ValueError("lists a file name or size that cannot be right")
        if len({f.name for f in files}) != len(files):
            raise ValueError("lists a file twice")
        if not (0 <= manifest.created_at < MAX_UNIX_TIME) or manifest.step < 0 or manifest.world_size < 1:
            raise ValueError("has a time, step or world size that cannot be right")
        return manifest


def _marker_checksum(doc: dict[str, Any], algorithm: str) -> str:
    """The marker's checksum of itself: over its canonical JSON without this field."""
    h = _hasher(algorithm)
    h.update(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def save_identity(files: Iterable[FileRecord]) -> str:
    """What tells two saves of one step number apart, alike in every node's folder of one save: the checksums of
    the files every node holds (DCP's metadata, every rank's small file), never the data files (each node's own)."""
    h = hashlib.sha256()
    for name, checksum in sorted((f.name, f.checksum) for f in files if not f.name.endswith(DATA_SUFFIX)):
        h.update(f"{name}\0{checksum}\n".encode())
    return h.hexdigest()[:16]


MAX_UNIX_TIME = 253402300800.0  # 10000-01-01: past it a date cannot be written


def iso(ts: float) -> str:
    """A Unix time as ISO 8601 in UTC; one no date can hold (a damaged file's) as "?"."""
    try:
        return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, ValueError, OSError):
        return "?"


def writer_versions() -> dict[str, str]:
    """Versions recorded in each manifest; torch's only if the writer already imported it."""
    import sys

    versions = {"resilient": __version__, "python": platform.python_version(), "host": socket.gethostname()}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    return versions


# --------------------------------------------------------------------------------------------------
# Writing


def describe_files(folder: str | os.PathLike, names: Iterable[str], algorithm: str = CHECKSUM_ALGORITHM,
                   known: dict[str, str] | None = None) -> list[FileRecord]:
    """Size and checksum of `names` in `folder`: what each rank reports for the files it wrote.

    `known` holds digests computed while the files were written (same algorithm); the others are read back.
    """
    folder = Path(folder)
    known = known or {}
    return [FileRecord(n, (folder / n).stat().st_size, known.get(n) or checksum_file(folder / n, algorithm))
            for n in sorted(names)]


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


BEGIN_LOCK_WAIT_S = 1.0  # how long begin() waits out a scan's momentary hold of a new partial's lock
HELD = -1  # writer_alive: a writer holds the lock, its PID unrecorded
UNCHECKABLE = -2  # writer_alive: the lock cannot be opened (no permission, not a file): taken as held


def writer_alive(partial: str | os.PathLike) -> int | None:
    """The PID recorded by a live writer of this partial folder (HELD if it recorded none, UNCHECKABLE if the lock
    cannot be checked: a save nobody can show to be dead is treated as live), or None if no writer holds it."""
    lock = Path(partial) / WRITER_LOCK
    try:  # (a folder there: read-only it is "not a regular file", uncheckable, as before; review 15)
        fd = open_to_probe(lock, regular=True)
    except FileNotFoundError:
        return None
    except OSError as e:  # no permission, or a link or FIFO in its place; not a passing fault (EMFILE, EIO)
        return UNCHECKABLE if e.errno in (errno.EACCES, errno.EPERM, errno.ELOOP, errno.EINVAL, errno.ENXIO) \
            else None
    try:
        try:
            if _try_lock(fd):
                return None
        except OSError as e:
            if e.errno == errno.EBADF:  # read-only on NFS (review 14): cannot tell, so taken as live
                return UNCHECKABLE
            raise
        try:
            return int(json.loads(os.pread(fd, 4096, 0) or b"{}").get("pid", 0)) or HELD
        except (ValueError, TypeError, AttributeError, OverflowError):
            return HELD
    finally:
        os.close(fd)


def writer_text(pid: int) -> str:
    """What a live or unverifiable writer (writer_alive's answer) means, in words."""
    if pid > 0:
        return f"save in progress (writer pid {pid} is alive)"
    if pid == UNCHECKABLE:
        return "its writer lock cannot be checked (no permission, or not a file): taken as a save in progress"
    return "save or copy in progress (its writer holds the lock)"  # e.g. a replicator's copy


class PartialCheckpoint:
    """A save in progress: its folder, and the writer lock that tells others it is live.

    Rank 0 creates it with `begin`, every rank writes into `path`, and rank 0 finishes it with `commit`
    (or `abandon`). Closing without committing releases the lock and leaves an abandoned partial folder
    that `gc` may remove.
    """

    def __init__(self, root: Path, step: int, path: Path, lock_fd: int):
        self.root, self.step, self.path = root, step, path
        self._lock_fd: int | None = lock_fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> PartialCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def commit(self, world_size: int, records: Sequence[FileRecord],
               extra: dict[str, Any] | None = None, algorithm: str = CHECKSUM_ALGORITHM) -> Path:
        """Write the marker last and publish the folder as `step_<N>`.

        Args:
            world_size: ranks that wrote this checkpoint.
            records: every data file of every rank (rank 0 gathers them).
            extra: small JSON facts to keep beside the manifest (data position, tokens seen, ...).
            algorithm: the checksum algorithm the records used.

        Returns:
            The committed folder.

        Raises:
            RuntimeError: if the folder does not hold exactly the recorded files at their sizes; nothing
                is published then.
        """
        assert self._lock_fd is not None, "commit after close"
        final = publish(self.path, self.step, world_size, records, extra, algorithm)
        self.path = final
        self.close()
        return final

    def abandon(self) -> None:
        """Remove the partial folder (the save failed and will not be committed)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.close()


RESERVED = frozenset({WRITER_LOCK, ".commit.lock", ".parts"})  # bookkeeping in a partial folder, never data


def saved_time(created_at: float | None, extra: dict[str, Any]) -> float | None:
    """When a checkpoint was saved: a durable copy records its local save's time in `saved_at` (its own `created_at`
    is when the replicator published it). The replication lag is between saves (audit 7: from the publish, `lag 100
    steps, 4.7s` hid the 16 s of training that only the local tier held)."""
    saved = extra.get("saved_at")
    return float(saved) if isinstance(saved, (int, float)) and not isinstance(saved, bool) else created_at


def _written_by_a_save(name: str) -> bool:
    return name.endswith(".distcp") or name in (".metadata", MARKER)  # DCP's files, the marker


def holds_checkpoint_files(folder: Path) -> bool:
    """Whether `folder` holds a file a save writes: a folder without one was not written by resilient (audit 15: a
    user's `step_000000007/notes.txt` was deleted)."""
    try:
        return any(_written_by_a_save(e.name) for e in os.scandir(folder))
    except OSError:
        return True  # unknown: judged as before


NOT_A_CHECKPOINT = "holds no checkpoint file: a folder of someone else's named like a checkpoint"
NOT_OURS_SUFFIX = ".not-resilient"  # a stranger's folder named like a checkpoint, moved off the name a save takes


def publish(partial: Path, step: int, world_size: int, records: Sequence[FileRecord],
            extra: dict[str, Any] | None = None, algorithm: str = CHECKSUM_ALGORITHM) -> Path:
    """Write the marker last and rename `partial` to `step_<N>` beside it; returns the committed folder.

    The folder must hold exactly the recorded files at their sizes (its bookkeeping entries, RESERVED, are
    removed first); otherwise RuntimeError and nothing is published.
    """
    names = {r.name for r in records}
    if len(names) != len(records) or MARKER in names or names & RESERVED:
        raise RuntimeError("file records are duplicated or name reserved files")
    present = {e.name: e.stat().st_size for e in os.scandir(partial) if e.name not in RESERVED}
    for r in records:
        if present.get(r.name) != r.size:
            raise RuntimeError(f"{r.name}: on disk {present.get(r.name)} bytes, record says {r.size}")
    if unlisted := sorted(n for n in set(present) - names if not OS_LITTER.match(n)):  # as inspect() judges
        raise RuntimeError(f"unlisted files in the save folder: {', '.join(unlisted)}")
    manifest = Manifest(step=step, world_size=world_size, created_at=time.time(),
                        files=tuple(sorted(records, key=lambda r: r.name)),
                        checksum_algorithm=algorithm, writer=writer_versions(), extra=extra or {})
    for name in RESERVED - {WRITER_LOCK}:  # the writer's lock stays held through the rename (review 13: gc or
        entry = partial / name  # retention judged a partial without one abandoned and deleted a save being committed)
        if entry.is_dir():
            shutil.rmtree(entry)
        elif entry.exists():
            os.unlink(entry)
    fsync_dir(partial)  # the data files' entries, before the marker that vouches for them
    atomic_write_bytes(partial / MARKER, manifest.to_json(), durable=True)
    root = partial.parent
    final = root / step_dirname(step)
    if final.exists() and inspect(final).status is Status.UNREADABLE:
        # Nothing is known about its bytes, and such a folder is never deleted: set aside, kept for its owner.
        quarantine(final, f"an unreadable step_{step:09d} found when this step was saved again")
    elif final.is_dir() and not final.is_symlink() and not holds_checkpoint_files(final):
        # Someone else's folder under the name: moved off it whole, under a name no scan takes (audit 17: the save
        # swapped in and deleted the user's step_000000100/notes.txt without a word).
        kept = root / f"{final.name}{NOT_OURS_SUFFIX}.{time.time_ns()}"
        os.rename(final, kept)
        log.warning("%s held no checkpoint file (someone else's folder): moved to %s, untouched, for step %d's save",
                    final, kept.name, step)
    if final.exists():
        # An older attempt's folder for the same step (invalid, or superseded after a rollback): swapped with this
        # one in one step where the filesystem can (review 13: a crash between two renames left neither as step_N,
        # and both went as partials), else moved aside first so that the rename is atomic; dropped after.
        if exchange(partial, final):
            fsync_dir(root)
            trash = aside_path(final)
            os.rename(partial, trash)  # the older one, now under the partial's name
        else:
            trash = aside_path(final)
            os.rename(final, trash)
            os.rename(partial, final)
            fsync_dir(root)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(partial, final)
        fsync_dir(root)
    with contextlib.suppress(FileNotFoundError):  # committed: no longer a save in progress (a crash before this
        os.unlink(final / WRITER_LOCK)  # leaves it, which inspect passes over)
    return final


def begin(root: str | os.PathLike, step: int) -> PartialCheckpoint:
    """Create a fresh partial folder for `step` and take its writer lock (rank 0 only).

    A leftover partial folder for the same step from a dead writer is removed first; one whose writer is
    still alive is an error (two jobs writing into the same root).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / partial_dirname(step)
    if path.exists():
        pid = writer_alive(path)
        if pid is not None:
            raise RuntimeError(f"{path} is held by a live writer: {writer_text(pid)}; "
                               "two jobs must not share a checkpoint root")
        shutil.rmtree(path)
    path.mkdir()
    fd = os.open(path / WRITER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    # A scan (status, gc, retention) asking writer_alive holds the lock for an instant: waited out, not taken for
    # another writer (review 13: a `status --watch` at that instant failed the save).
    deadline = time.monotonic() + BEGIN_LOCK_WAIT_S
    while not _try_lock(fd):
        if time.monotonic() >= deadline:
            os.close(fd)
            raise RuntimeError(f"{path}: another writer took the lock")
        time.sleep(0.005)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    fsync_dir(root)
    return PartialCheckpoint(root, step, path, fd)


def partial_path(root: str | os.PathLike, step: int) -> Path:
    """Where `begin` puts the partial folder of `step`: other ranks write there."""
    return Path(root) / partial_dirname(step)


# --------------------------------------------------------------------------------------------------
# Reading and validation


@dataclass(frozen=True)
class CheckpointInfo:
    """What validation found in one folder."""

    step: int
    path: Path
    status: Status
    reason: str
    size_bytes: int
    files: int
    world_size: int | None = None
    created_at: float | None = None
    partial: bool = False
    manifest: Manifest | None = None
    quarantined: bool = False

    @property
    def valid(self) -> bool:
        return self.status is Status.VALID

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "status": self.status.value,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "world_size": self.world_size,
            "created_at": iso(self.created_at) if self.created_at is not None else None,
            "partial": self.partial,
            "quarantined": self.quarantined,
            "checksum_algorithm": self.manifest.checksum_algorithm if self.manifest else None,
            "extra": self.manifest.extra if self.manifest else {},
        }


# A link may lead out of the checkpoint and a FIFO would hang every reader; no save writes either.
NOT_REGULAR = "is not a regular file (a link, a folder or a device): no save writes one"


def _entries(folder: Path) -> dict[str, os.stat_result]:
    return {e.name: e.stat(follow_symlinks=False) for e in os.scandir(folder)}


def inspect(path: str | os.PathLike, *, deep: bool = False, progress: Progress | None = None) -> CheckpointInfo:
    """Validate one checkpoint folder (committed, partial or quarantined).

    Args:
        path: a `step_<N>`, `step_<N>.partial` or `step_<N>.quarantined` folder.
        deep: also re-read every byte against the recorded checksums (small files are checksummed always).
        progress: called with byte counts while reading, for a progress bar.
    """
    path = Path(path)
    m = STEP_RE.match(path.name) or PARTIAL_RE.match(path.name) or QUARANTINE_RE.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint folder name (step_<9 digits>)")
    step = int(m.group(1))
    partial = path.name.endswith(PARTIAL_SUFFIX)
    quarantined = QUARANTINE_RE.match(path.name) is not None
    try:
        entries = _entries(path)
        mtime = path.stat().st_mtime
    except OSError as e:
        return CheckpointInfo(step, path, Status.UNREADABLE, f"cannot list the folder ({e.strerror})", 0, 0,
                              partial=partial, quarantined=quarantined)
    size = sum(st.st_size for st in entries.values())
    nfiles = sum(1 for n in entries if n not in (MARKER, WRITER_LOCK, QUARANTINE_FILE))

    def result(status: Status, reason: str, manifest: Manifest | None = None) -> CheckpointInfo:
        return CheckpointInfo(step, path, status, reason, size, nfiles,
                              manifest.world_size if manifest else None,
                              manifest.created_at if manifest else mtime, partial, manifest, quarantined)

    if quarantined:  # its marker, if it still reads, gives its world size and when it was written
        kept = None
        if MARKER in entries and stat.S_ISREG(entries[MARKER].st_mode):
            with contextlib.suppress(ValueError, UnsupportedChecksum, OSError):
                kept = Manifest.from_json(read_regular(path / MARKER))
        return result(Status.CORRUPT, f"quarantined: {quarantine_reason(path)}", kept)
    if partial:
        pid = writer_alive(path)
        if pid is not None:
            return result(Status.INCOMPLETE, writer_text(pid))
        return result(Status.INCOMPLETE, "partial save, never committed (its writer is gone)")
    if not any(_written_by_a_save(n) for n in entries):
        return result(Status.CORRUPT, NOT_A_CHECKPOINT)  # audit 17: told of a marker "removed since"
    if MARKER not in entries:  # the marker is written before the rename to step_<N>: its loss is damage
        return result(Status.CORRUPT, "no completion marker, yet named as committed (it was written before the "
                                      "folder got this name: removed since, or the folder copied in part)")
    if not stat.S_ISREG(entries[MARKER].st_mode):
        return result(Status.CORRUPT, f"{MARKER} {NOT_REGULAR}")
    try:
        manifest = Manifest.from_json(read_regular(path / MARKER))
    except ValueError as e:
        return result(Status.CORRUPT, f"completion marker is unreadable: {e}")
    except UnsupportedChecksum as e:
        return result(Status.UNREADABLE, f"cannot be checked on this machine: {e}")
    except OSError as e:
        return result(Status.UNREADABLE, f"completion marker cannot be read ({e.strerror})")
    if manifest.step != step:
        return result(Status.CORRUPT, f"marker says step {manifest.step}, folder is step {step}", manifest)
    listed = {f.name for f in manifest.files}
    for f in manifest.files:
        st = entries.get(f.name)
        if st is None:
            return result(Status.CORRUPT, f"{f.name} is missing", manifest)
        if not stat.S_ISREG(st.st_mode):
            return result(Status.CORRUPT, f"{f.name} {NOT_REGULAR}", manifest)
        if st.st_size != f.size:
            how = "truncated" if st.st_size < f.size else "grown"
            return result(Status.CORRUPT, f"{f.name} is {st.st_size} bytes, manifest says {f.size} ({how})",
                          manifest)
    unlisted = sorted(n for n in set(entries) - listed - {MARKER}
                      if not ((OS_LITTER.match(n) or n == WRITER_LOCK) and stat.S_ISREG(entries[n].st_mode)))
    if unlisted:
        return result(Status.CORRUPT, f"unlisted file {unlisted[0]}" +
                      (f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""), manifest)
    to_read = manifest.files if deep else [f for f in manifest.files if f.size <= SMALL_FILE_BYTES]
    for f in to_read:
        try:
            digest = checksum_file(path / f.name, manifest.checksum_algorithm, progress)
        except ValueError as e:
            return result(Status.CORRUPT, f"cannot verify: {e}", manifest)
        except UnsupportedChecksum as e:
            return result(Status.UNREADABLE, f"cannot be checked on this machine: {e}", manifest)
        except OSError as e:
            return result(Status.UNREADABLE, f"{f.name} cannot be read ({e.strerror})", manifest)
        if digest != f.checksum:
            return result(Status.CORRUPT, f"{f.name} checksum mismatch ({manifest.checksum_algorithm})",
                          manifest)
    if deep:
        return result(Status.VALID, f"all {len(manifest.files)} files match their checksums", manifest)
    small = f", {len(to_read)} small file(s) checksummed" if to_read else ""
    return result(Status.VALID, f"marker and all {len(manifest.files)} file sizes match{small}", manifest)


def quarantine_reason(path: str | os.PathLike) -> str:
    """Why a quarantined folder was set aside (from its QUARANTINE.json)."""
    try:
        doc = parse_json(read_regular(Path(path) / QUARANTINE_FILE))
        return str(doc["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return "set aside (its QUARANTINE.json is missing or unreadable)"


def quarantine(path: str | os.PathLike, reason: str) -> Path:
    """Set a committed checkpoint aside for good: rename it to `step_<N>.quarantined` (`.2`, ... if taken) and
    record why inside it. Never deletes anything. Returns the new folder.

    Raises:
        OSError: if the rename fails (e.g. the folder is gone: another node quarantined it first).
    """
    path = Path(path)
    target = path.with_name(path.name + QUARANTINE_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{QUARANTINE_SUFFIX}.{n}")
    os.rename(path, target)
    fsync_dir(path.parent)
    doc = {"reason": reason, "at": iso(time.time()), "was": path.name, "by": {"pid": os.getpid(),
                                                                            "host": socket.gethostname()}}
    with contextlib.suppress(OSError):  # a folder this user cannot write into is set aside all the same
        atomic_write_bytes(target / QUARANTINE_FILE, (json.dumps(doc, indent=1) + "\n").encode())
    return target


def checkpoint_dirs(root: str | os.PathLike, *, quarantined: bool = False) -> list[Path]:
    """Committed-name and partial folders under `root` (and quarantined ones if asked), by step, oldest first;
    for one step: committed, then partial, then quarantined."""
    root = Path(root)
    found = []
    for e in os.scandir(root):
        kind = 0 if STEP_RE.match(e.name) else 1 if PARTIAL_RE.match(e.name) else 2 \
            if quarantined and QUARANTINE_RE.match(e.name) else None
        if kind is not None and e.is_dir(follow_symlinks=False):
            found.append((int(e.name[5:14]), kind, e.name, root / e.name))
    return [p for *_, p in sorted(found)]


def passed_over(root: str | os.PathLike) -> list[tuple[str, str]]:
    """Entries under `root` named like checkpoints that no scan takes, each with why: a name that is not
    `step_<9 digits>` (a folder copied in by hand as `step_5`), a link (never followed), a file."""
    found = []
    for e in os.scandir(root):
        if not e.name.startswith("step_"):
            continue
        named = STEP_RE.match(e.name) or PARTIAL_RE.match(e.name) or QUARANTINE_RE.match(e.name)
        if e.is_symlink():
            found.append((e.name, "a link: links are never followed"))
        elif not named and NOT_OURS_SUFFIX in e.name:  # review 15: it was told to take a checkpoint's name again
            found.append((e.name, "someone else's folder, which held no checkpoint file, moved off its step's name "
                                  "by a save of that step: yours to keep or remove"))
        elif not named:
            found.append((e.name, "not a checkpoint name: step_ and 9 digits, e.g. step_000000050"))
        elif not e.is_dir(follow_symlinks=False):
            found.append((e.name, "not a folder"))
    return sorted(found)


def aside_path(folder: Path) -> Path:
    """Where `folder` is renamed before it is deleted: beside it, under a name no scan takes for a checkpoint."""
    return folder.parent / f"{TRASH_PREFIX}{folder.name}.{time.time_ns()}"


# aside_path's names, of the checkpoint folders and the spare pool it is given (review 14: a pool whose delete was
# cut short was never listed again): a folder named otherwise by someone else is theirs
TRASH_RE = re.compile(r"^\.trash\.(?:step_[0-9]{9}(?:\.partial|\.quarantined(?:\.[0-9]+)?)?|\.spare)\.[0-9]{10,}\Z")


def trash_dirs(root: str | os.PathLike) -> list[Path]:
    """Folders `commit` moved aside and did not get to delete (real folders: a link there leads elsewhere), by
    aside_path's own names only (audit 6: gc removed a user's `.trash.keepme`)."""
    return [Path(e.path) for e in os.scandir(root)
            if TRASH_RE.match(e.name) and e.is_dir(follow_symlinks=False)]


def keep_spare(folder: Path, root: Path, limit_bytes: int) -> int:
    """Move the data files of `folder` (a checkpoint already renamed aside for deletion) into `root`'s spare pool,
    while the pool holds less than `limit_bytes`; returns the bytes kept. Only plain files with one link move, and
    only into a pool that is a real folder (a link there could lead outside the tier).

    A local tier on tmpfs pays for every page a new file takes (allocated and zeroed on the ranks' cores, and on a
    VM backed by its host on first touch: a 512 MB write beside training took 1.66 s into fresh pages, 0.33-0.48 s
    into pages written before). A save that writes over a spare file (`claim_spare`) reuses them, and the tier
    holds no more than without the pool: the spare stands in for the save it is about to become.
    """
    pool = root / SPARE_DIR
    held = sum(spare_sizes(root).values())
    kept = 0
    for e in sorted(os.scandir(folder), key=lambda e: e.name):
        if not e.name.endswith(DATA_SUFFIX) or not e.is_file(follow_symlinks=False):
            continue
        st = e.stat(follow_symlinks=False)
        if st.st_nlink != 1 or held + st.st_size > limit_bytes:
            continue
        with contextlib.suppress(FileExistsError):
            pool.mkdir()
        if not real_folder(pool):
            return kept
        try:
            os.rename(e.path, pool / f"{e.name}.{uuid.uuid4().hex}")
        except OSError:
            continue
        held += st.st_size
        kept += st.st_size
    return kept


def real_folder(path: Path) -> bool:
    """Whether `path` is a folder itself, not a link to one (whose files are someone else's)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _spares(pool: Path) -> list[os.DirEntry[str]]:
    """The pool's plain files; none when the pool is missing or not a real folder."""
    if not real_folder(pool):
        return []
    try:
        return [e for e in os.scandir(pool) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def spare_sizes(root: Path) -> dict[Path, int]:
    """The spare pool's files and their sizes (empty when there is none). A file a rank claims meanwhile is
    left out."""
    sizes = {}
    for e in _spares(root / SPARE_DIR):
        with contextlib.suppress(FileNotFoundError):
            sizes[Path(e.path)] = e.stat(follow_symlinks=False).st_size
    return sizes


def claim_spare(root: Path, dest: Path) -> bool:
    """Rename one file of `root`'s spare pool to `dest` (preferring one that had `dest`'s name); True when one
    was taken. Ranks claim concurrently: a rename either takes a file whole or finds it gone."""
    pool = root / SPARE_DIR
    names = sorted((e.name for e in _spares(pool)), key=lambda n: (not n.startswith(dest.name + "."), n))
    for name in names:
        try:
            os.rename(pool / name, dest)
        except OSError:
            continue
        return True
    return False


def drop_spares(root: Path) -> None:
    """Delete `root`'s spare pool (the run is over). A link named like the pool is removed, never followed."""
    pool = root / SPARE_DIR
    if real_folder(pool):
        shutil.rmtree(pool, ignore_errors=True)
    elif pool.is_symlink():
        pool.unlink(missing_ok=True)


def scan(root: str | os.PathLike, *, deep: bool = False, progress: Progress | None = None,
         quarantined: bool = False, cache: InspectCache | None = None) -> list[CheckpointInfo]:
    """Validate every checkpoint folder under `root` (quarantined ones too if asked), oldest first; a shallow
    scan with `cache` takes a folder's earlier result where nothing in it has changed since."""
    dirs = checkpoint_dirs(root, quarantined=quarantined)
    if cache is not None and not deep:
        cache.forget_gone(Path(root), dirs)
        return [cache.inspect(p) for p in dirs]
    return [inspect(p, deep=deep, progress=progress) for p in dirs]


def _fingerprint(folder: Path) -> tuple | None:
    """What changes when anything in `folder` is written, replaced, added, removed or renamed: each entry's
    name, inode, mode, size and modification and change times, and the folder's own; None if it cannot be read."""
    try:
        st = os.lstat(folder)
        entries = sorted((e.name, s.st_ino, s.st_mode, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                         for e in os.scandir(folder) for s in (e.stat(follow_symlinks=False),))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, tuple(entries))


class InspectCache:
    """Shallow inspections of committed folders found valid, reused while nothing in the folder has changed
    (`_fingerprint`). The supervisor and the replicator scan their roots at every commit; checksumming the
    retained checkpoints' small files again each time was most of the supervisor's ~11 ms a commit, on the
    ranks' cores (README, Goodput). What a fingerprint cannot see, bytes that change in place with no write
    (bit rot), a size check does not see either; the full checks before a relaunch and `--verify` read them."""

    def __init__(self) -> None:
        self._valid: dict[Path, tuple[tuple, CheckpointInfo]] = {}
        self._lock = threading.Lock()  # the replicator's thread and the supervisor's scan with one cache

    def inspect(self, path: Path) -> CheckpointInfo:
        before = _fingerprint(path)
        with self._lock:
            known = self._valid.get(path)
        if before is not None and known is not None and known[0] == before:
            return known[1]
        info = inspect(path)
        with self._lock:
            if before is not None and info.valid and _fingerprint(path) == before:  # unchanged while it was read
                self._valid[path] = (before, info)
            else:
                self._valid.pop(path, None)
        return info

    def forget_gone(self, root: Path, there: Iterable[Path]) -> None:
        """Drop what is known of `root`'s folders that are no longer `there` (deleted, renamed aside)."""
        keep = set(there)
        with self._lock:
            self._valid = {p: known for p, known in self._valid.items() if p.parent != root or p in keep}


def latest_valid(root: str | os.PathLike, *, deep: bool = False, below: int | None = None,
                 progress: Progress | None = None) -> CheckpointInfo | None:
    """The newest valid checkpoint (optionally below step `below`); never an invalid folder."""
    if not Path(root).is_dir():
        return None
    for p in reversed(checkpoint_dirs(root)):
        if p.name.endswith(PARTIAL_SUFFIX):
            continue
        info = inspect(p, deep=deep, progress=progress)
        if info.valid and (below is None or info.step < below):
            return info
    return None


def total_bytes(infos: Iterable[CheckpointInfo]) -> int:
    return sum(i.size_bytes for i in infos)
