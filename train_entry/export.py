"""One checkpoint, whole, as a single torch.save file: `python -m train_entry.export CHECKPOINT OUT.pt`.

Reads every rank's shards (any world size) through resilient's storage layer, in this one process, without
a process group: the final model of a finished run, for evaluation or serving.

    python -m train_entry.export runs/tiny-cpu/checkpoints/step_000000300 model.pt
    state = torch.load("model.pt", weights_only=False)   # state["model"], state["optim"], state["train"], ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from supervisor import store
from train_entry.storage import RawReader


def load_whole(checkpoint: str | Path) -> dict[str, Any]:
    """Everything the checkpoint holds, as plain (unsharded) tensors and objects, nested as saved."""
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=RawReader(checkpoint), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def _first_line(e: BaseException) -> str:
    """An exception's message in one sentence's room: torch's run to pages."""
    return (str(e).splitlines() or [repr(e)])[0][:200]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train_entry.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_<N> folder")
    p.add_argument("out", help="the .pt file to write")
    args = p.parse_args(argv)
    if not os.path.exists(args.checkpoint):
        print(f"{args.checkpoint}: does not exist; give one checkpoint's folder, e.g. "
              "runs/NAME/checkpoints/step_000000300.", file=sys.stderr)
        return 2
    try:
        info = store.inspect(args.checkpoint, deep=True)
    except ValueError as e:  # a checkpoint root, a run dir: not one step's folder
        newest = next((found for root in (args.checkpoint, os.path.join(args.checkpoint, "checkpoints"))
                       if os.path.isdir(root) and (found := store.latest_valid(root)) is not None), None)
        hint = f", e.g. {newest.path}" if newest is not None else ""
        print(f"{args.checkpoint}: {e}; give one checkpoint's folder{hint}.", file=sys.stderr)
        return 2
    if not info.valid:
        print(f"{args.checkpoint}: not a valid checkpoint ({info.status.value}: {info.reason})", file=sys.stderr)
        return 1
    extra = info.manifest.extra if info.manifest is not None else {}
    if extra.get("tier") == "local" and len(extra.get("nodes") or ()) > 1:
        print(f"{args.checkpoint}: a node-local copy, which holds only node {extra.get('node')!r}'s shards of "
              f"{len(extra['nodes'])} nodes'; export the durable tier's step_{info.step:09d} (checkpoint.dir).",
              file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        print(f"{args.out}: its folder {out_dir} does not exist; create it or name another file.", file=sys.stderr)
        return 2
    real_ckpt = os.path.realpath(args.checkpoint)
    real_out = os.path.realpath(args.out if os.path.isdir(args.out) else out_dir)
    # Inside this checkpoint or any other of its root (a step folder, a partial): an unlisted file there makes that
    # checkpoint corrupt.
    folders = [real_ckpt, *(os.path.realpath(d) for d in store.checkpoint_dirs(os.path.dirname(real_ckpt),
                                                                               quarantined=True))]
    inside = next((d for d in folders if os.path.commonpath([real_out, d]) == d), None)
    if inside is not None:
        print(f"{args.out}: inside the checkpoint {inside}, where an unlisted file makes it corrupt; name a file "
              "outside the checkpoint folders.", file=sys.stderr)
        return 2
    if os.path.isdir(args.out):  # torch.save would find it only after the whole load
        print(f"{args.out}: is a folder; name the file to write, e.g. {os.path.join(args.out, 'model.pt')}.",
              file=sys.stderr)
        return 2
    try:
        whole = load_whole(args.checkpoint)
    except Exception as e:  # a checkpoint whose bytes check yet do not load (DCP's own error, wrapped)
        print(f"{args.checkpoint}: cannot be read whole ({e.__class__.__name__}: {_first_line(e)}); nothing was "
              "exported.", file=sys.stderr)
        return 1
    tmp = f"{args.out}.{os.getpid()}.tmp"  # a full disk leaves no half-written file under the name asked for
    try:
        torch.save(whole, tmp)
        os.replace(tmp, args.out)
    except (OSError, RuntimeError) as e:  # torch's writer reports a short write as RuntimeError
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        why = e.strerror if isinstance(e, OSError) and e.strerror else _first_line(e)
        print(f"{args.out}: cannot be written ({why}); nothing was exported.", file=sys.stderr)
        return 1
    print(f"{args.out}: step {info.step}, {info.size_bytes / 1e6:.1f} MB of shards from {info.world_size} rank(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
