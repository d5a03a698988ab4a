"""Small durable-file helpers: files other processes read are written temp-then-rename; checkpoint files are
written front to back, hashed as they go, around the page cache where they can be (`HashedFile`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

PAGE = 4096  # O_DIRECT's alignment for buffers, offsets and lengths (a multiple of every logical block size)
CHUNK = 64 << 20  # bytes per write and per hash update: few GIL acquisitions, bounded memory per call
TAP_BLOCK = 1 << 20  # HashedFile.write's tap: hashed twice while in the cache


NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})  # a folder that takes no more writes
READ_ONLY = "read-only file system"  # write_problem's answer for a read-only mount


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap the two names atomically (Linux renameat2 RENAME_EXCHANGE), True if done; False where the kernel, the C
    library or the filesystem cannot (NFS, older kernels): the caller renames in two steps then."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def _new_temp(path: Path, mode: int) -> tuple[int, Path]:
    """A new temp file beside `path`, created with `mode` as open() creates files: the kernel applies the umask
    and a folder's default ACL (mkstemp's 0600 made a checkpoint's marker unreadable to another account, an
    eval job, that could read its data files)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), tmp
        except FileExistsError:
            continue


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True, private: bool = False) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never a torn one.

    Args:
        path: destination file.
        data: the whole new content.
        durable: fsync the file and its folder, so the write survives a power cut. State files that are
            rewritten every second pass False: losing the last one costs nothing.
        private: readable by this account only (0600), as for a job's environment; else the umask's mode.
    """
    path = Path(path)
    fd, tmp = _new_temp(path, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True, private: bool = False) -> None:
    """`atomic_write_bytes` of `obj` as indented JSON."""
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    atomic_write_bytes(path, data, durable=durable, private=private)


def file_identity(path: str | os.PathLike) -> list[int] | None:
    """Which file `path` is now (inode, size, mtime; a replaced or rewritten file is another), or None if none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, *, follow: bool = False) -> int:
    """A descriptor on `path` if it is a regular file. A FIFO is never waited on (it would hang every reader), a
    link never followed (it may lead out of the run dir) unless `follow` (the rank-log links the run makes), a
    device never read: each raises OSError saying so."""
    fd = os.open(path, flags | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW) | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_to_probe(path: str | os.PathLike, *, regular: bool = False) -> int:
    """`path` opened to test another process's flock on it: for writing where this user may (NFS emulates flock
    with POSIX locks, whose exclusive kind needs a descriptor open for writing; review 14), else for reading, as
    before (no permission, a read-only mount, a folder). `regular`: through open_regular. OSError as open's."""
    def opened(flags: int) -> int:
        return open_regular(path, flags) if regular else os.open(path, flags | os.O_CLOEXEC)

    try:
        return opened(os.O_RDWR)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ETXTBSY):
            raise
        return opened(os.O_RDONLY)


def read_regular(path: str | os.PathLike, *, follow: bool = False) -> bytes:
    """The bytes of a regular file (`open_regular`'s rules: a link or a FIFO raises OSError)."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        return f.read()


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file (a regular one: `open_regular`); raises OSError or ValueError like `json.load`. NaN and
    Infinity, which Python writes and JSON lacks, read as None, so what is read can be printed as JSON again."""
    return parse_json(read_regular(path), parse_constant=lambda _: None)


def unreadable_fix(e: OSError) -> str | None:
    """What to do about a run's own file that read_json could not give: a link (never followed), or no read access;
    None where the error names nothing the user can mend by hand."""
    if e.errno == errno.ELOOP:
        return "it is a link, which resilient does not follow: put the file itself there"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "give this user read access to it"
    return None


def parse_json(data: bytes | str, **kwargs: Any) -> Any:
    """`json.loads`, where a document nested deeper than the interpreter recurses (`[[[…` a few thousand deep: a
    damaged or planted file) is a ValueError like any other malformed one, not a RecursionError no caller expects."""
    try:
        return json.loads(data, **kwargs)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None


def write_problem(folder: str | os.PathLike) -> str | None:
    """Why files cannot be created in `folder` (or, if it does not exist yet, where it would be created);
    None when they can. Asks the kernel (access(2) reports a read-only mount even to root) and creates
    nothing."""
    p = Path(folder)
    while not os.path.exists(p) and p != p.parent:  # False, not PermissionError, under a folder shut to us
        p = p.parent
    if not os.path.isdir(p):
        return f"{p} is not a folder"
    if os.access(p, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return READ_ONLY if read_only else "permission denied"


def how_to_make_writable(problem: str) -> str:
    """The fix for write_problem's answer: a remount only fixes a read-only mount (audit 13: it was named for a
    folder made immutable with `chattr +i`, which says EPERM)."""
    if problem == READ_ONLY:
        return "Make it writable (remount it read-write)"
    return "Give this user write access there (its mode and owner, or an immutable attribute: `lsattr -d`)"


class Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class HashedFile:
    """One file written front to back: hashed and written in chunks (both release the GIL), fsynced on close.

    With `direct`, the file is also opened O_DIRECT where the filesystem allows it, and every write whose buffer,
    offset and length are page-aligned goes to the disk without passing through the page cache: no kernel copy
    on the writer's CPU (measured here: 512 MB buffered, 1.5 s of CPU on a cold page cache; O_DIRECT, 0.02 s at
    1.8-2.2 GB/s). Anything unaligned is written through the cache. Used by the ranks' checkpoint writer
    (train_entry/storage.py) and by the supervisor's replication into the durable tier.
    """

    def __init__(self, path: str | os.PathLike, hasher: Hasher, *, direct: bool = False, reuse: bool = False):
        self.path = Path(path)
        # `reuse`: the file's pages are written over, not freed and taken again (close() cuts off any tail)
        fd = _open_over(self.path) if reuse else None
        self.reuse = fd is not None
        self.fd = fd if fd is not None else os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                                                    | os.O_CLOEXEC, 0o644)
        self.direct_fd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # some filesystems refuse O_DIRECT
                self.direct_fd = None
        self.hash = hasher
        self.size = 0
        self.direct_bytes = 0

    def write(self, data: memoryview, *, aligned: bool = False,
              tap: Callable[[int, memoryview], None] | None = None) -> None:
        """Append `data`; `aligned`: its buffer starts on a page boundary (O_DIRECT may take it). `tap` is shown
        every byte, with its offset in the file, each TAP_BLOCK right after the file's hash has read it (while it
        is still in the CPU's cache: a second hash of the same bytes then costs ~40% of the first, not 100%)."""
        fd = self.direct_fd if aligned and self.direct_fd is not None and self.size % PAGE == 0 else self.fd
        for start in range(0, len(data), CHUNK):
            chunk = data[start:start + CHUNK]
            offset = self.size + start
            if tap is None:
                self.hash.update(chunk)
            else:
                for at in range(0, len(chunk), TAP_BLOCK):
                    block = chunk[at:at + TAP_BLOCK]
                    self.hash.update(block)
                    tap(offset + at, block)
            if fd == self.direct_fd and len(chunk) % PAGE == 0:
                try:
                    pwrite_all(fd, chunk, offset)
                    self.direct_bytes += len(chunk)
                    continue
                except OSError:  # the filesystem refused this one after all: through the cache from here
                    fd = self.fd
            pwrite_all(self.fd, chunk, offset)
        self.size += len(data)

    def close(self) -> str:
        """fsync (the metadata, and anything written through the cache), close; returns the hex digest."""
        try:
            if self.reuse:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            self.abort()
        return self.hash.hexdigest()

    def abort(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.direct_fd = -1, None


def _open_over(path: Path) -> int | None:
    """`path` opened for writing over it, if it is a plain file (not a link to one) that no other name shares;
    else None, and whatever is there is removed: writing over it must touch nothing else."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError:
        fd = None
    if fd is not None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            return fd
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return None


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def page_aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` rounded up to whole pages, starting on a page boundary (an anonymous mapping),
    as O_DIRECT needs."""
    import mmap

    return memoryview(mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE)))


# Mount options under which flock() is the node's own: the locks resilient takes between nodes on a shared root
# (a partial's writer, the durable tier's replication lock, the run's claim) then exclude nothing across hosts.
LOCAL_LOCK_OPTIONS = ("localflock", "nolock", "local_lock=flock", "local_lock=all")


def node_local_locks(path: str | os.PathLike, mountinfo: str | None = None) -> str | None:
    """The mount of `path` and the option that makes flock() node-local there ("nfs4 with local_lock=all"), or None
    (a local filesystem, a shared one with coherent locks, or one that cannot be told; review 13)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    where = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 6:
            continue
        point = fields[4].replace("\\040", " ")
        under = where == point or where.startswith(point.rstrip("/") + "/")
        if under and (best is None or len(point) > best[0]):
            best = (len(point), line)
    if best is None:
        return None
    before, after = best[1].split(" - ", 1)
    options = set(before.split()[5].split(",")) | set(after.split()[2].split(",") if len(after.split()) > 2 else ())
    found = next((o for o in LOCAL_LOCK_OPTIONS if o in options), None)
    return None if found is None else f"{after.split()[0]} with {found}"
