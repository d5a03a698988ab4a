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


STATEFUL_PREFIXES = ("replicated.", "sharded.", "per_rank.")


def stateful_entries(path: Path) -> dict[str, object]:
    """The stateful objects' entries of a checkpoint (train_entry.stateful), bytes leaves decoded: e.g.
    {"replicated.scaler": {"scale": ...}, "per_rank.loader.rank1": {...}, "sharded.ema.0.weight": tensor}."""
    from train_entry.stateful import unpack

    return {k: unpack(v) if isinstance(v, bytes) else v for k, v in dcp_tensors(path).items()
            if k.startswith(STATEFUL_PREFIXES)}


def same_value(a: object, b: object) -> bool:
    """Bitwise equality through nested containers (tensors compared with torch.equal, dtypes included)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def assert_same_training_state(a: Path, b: Path) -> None:
    """Model, optimizer and position bitwise equal, and every stateful object's entries (scaler, EMA, loader)."""
    import torch

    ta, tb = dcp_tensors(a), dcp_tensors(b)
    assert ta.keys() == tb.keys()
    tensors = [k for k in ta if k.startswith(("model.", "optim.state.")) and isinstance(ta[k], torch.Tensor)]
    assert len(tensors) > 20
    unequal = [k for k in tensors if not torch.equal(ta[k], tb[k])]
    assert unequal == [], f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"
    assert json.loads(ta["train"]) == json.loads(tb["train"])
    sa, sb = stateful_entries(a), stateful_entries(b)
    unequal = [k for k in sa if not same_value(sa[k], sb[k])]
    assert unequal == [], f"stateful entries differ: {unequal[:3]}"
