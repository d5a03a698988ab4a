"""Write real checkpoints through the store's own writer API (no hand-made markers)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor import store


def write_checkpoint(root: Path, step: int, *, world_size: int = 2, size: int = 4096,
                     commit: bool = True, close: bool = True) -> Path | store.PartialCheckpoint:
    """A checkpoint with one data file per rank plus a metadata file, written like the entry point does."""
    partial = store.begin(root, step)
    records = []
    for rank in range(world_size):
        name = f"__{rank}_0.distcp"
        data = os.urandom(size + rank)
        with open(partial.path / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        records += store.describe_files(partial.path, [name])  # each rank checksums its own files
    (partial.path / ".metadata").write_bytes(b"metadata-" + str(step).encode())
    records += store.describe_files(partial.path, [".metadata"])
    if not commit:
        if close:
            partial.close()
        return partial
    return partial.commit(world_size, records, extra={"tokens_seen": step * 100})


def flip_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: Path, by: int = 10) -> None:
    os.truncate(path, path.stat().st_size - by)
