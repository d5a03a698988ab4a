"""Small durable-file helpers: files other processes read are written temp-then-rename."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never a torn one.

    Args:
        path: destination file.
        data: the whole new content.
        durable: fsync the file and its folder, so the write survives a power cut. State files that are
            rewritten every second pass False: losing the last one costs nothing.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> None:
    """`atomic_write_bytes` of `obj` as indented JSON."""
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    atomic_write_bytes(path, data, durable=durable)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; raises OSError or ValueError like `json.load`."""
    with open(path, "rb") as f:
        return json.loads(f.read())


def write_problem(folder: str | os.PathLike) -> str | None:
    """Why files cannot be created in `folder` (or, if it does not exist yet, where it would be created);
    None when they can. Asks the kernel (access(2) reports a read-only mount even to root) and creates
    nothing."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a folder"
    if os.access(p, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"
