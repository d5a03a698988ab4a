"""Write real checkpoints through the store's own writer API (no hand-made markers), damage them, and compare
what two DCP checkpoints hold."""

from __future__ import annotations

import json
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


def dcp_tensors(path: Path) -> dict[str, object]:
    """A whole checkpoint read in this (single) process, flattened: model, optimizer, RNG, position."""
    from train_entry.export import load_whole

    flat: dict[str, object] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(load_whole(path), "")
    return flat


def assert_same_training_state(a: Path, b: Path) -> None:
    import torch

    ta, tb = dcp_tensors(a), dcp_tensors(b)
    assert ta.keys() == tb.keys()
    tensors = [k for k in ta if k.startswith(("model.", "optim.state.")) and isinstance(ta[k], torch.Tensor)]
    assert len(tensors) > 20
    unequal = [k for k in tensors if not torch.equal(ta[k], tb[k])]
    assert unequal == [], f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"
    assert json.loads(ta["train"]) == json.loads(tb["train"])
