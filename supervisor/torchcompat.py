"""Where the torch releases we support differ, and what we do about it: the one place that knows.

Every difference is detected by feature (what the installed torch has or does), never by its version
number, so a release we have not seen takes the path its features call for. torch is imported inside the
functions only: this module is used by processes that already run torch (torchrun's launcher, the ranks),
never by the supervisor's own process or the light commands.

Measured differences across the supported range (README, "Supported torch"):

- torchrun's parser: `--shutdown-timeout` is absent in 2.7, 2.8 and 2.11 (present in 2.13). Options we
  pass only to tune torchrun are dropped when its parser does not know them (`torchrun_args`); anything else
  still reaches torchrun, which refuses what it does not know as a configuration error.
- `dcp.save`'s return value: some releases fill `Metadata.storage_data`, some leave it None. We never read
  it: the files a rank wrote are what our storage writer recorded (train_entry/storage.py).
- Freeing the pinned blocks torch's caching host allocator keeps: `torch._C._host_emptyCache` (present from
  2.7 to 2.15, private); where a release lacks it, the blocks stay cached, as before.
- DCP's `DefaultStager`: absent in 2.7 and 2.8, and on some releases a reused stager fails its second
  `stage()` (KeyError: <class 'type'>). We stage into our own buffers (train_entry/staging.py), which need
  only `dtensor_like` from here.
"""

from __future__ import annotations

import argparse
from typing import Any

# Options resilient passes to tune torchrun, not to define the job: dropped where torchrun lacks them.
TUNING_OPTIONS = ("--shutdown-timeout",)


def torchrun_args(args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`args` without the TUNING_OPTIONS (and their values) that `parser` (torchrun's) does not define.

    Only torchrun's own options are looked at: scanning stops at the entry point (`-m MODULE` or a script).
    """
    actions = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("-") or token in ("-m", "--module", "--"):
            return out + args[i:]  # the entry point and its own arguments
        flag, eq, _ = token.partition("=")
        following = args[i + 1] if i + 1 < len(args) else None
        if flag in actions:
            takes_value = not eq and actions[flag].nargs != 0
        else:  # not torchrun's: a value follows unless the next token is an option itself
            takes_value = not eq and following is not None and not following.startswith("-")
        width = 2 if takes_value and following is not None else 1
        if not (flag in TUNING_OPTIONS and flag not in actions):
            out += args[i:i + width]
        i += width
    return out


def dtensor_like(template: Any, local: Any) -> Any:
    """A DTensor with `template`'s mesh, placements and global shape whose local shard is `local` (which may
    live on another device, e.g. host memory): what DCP needs to plan and write a staged shard.

    `DTensor.from_local` would move `local` back to the mesh's device, so the constructor is used; it has
    taken (local_tensor, spec, requires_grad=...) across the supported range.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, template._spec, requires_grad=False)


def release_cached_pinned_memory() -> None:
    """Give back the pinned host blocks torch's caching allocator holds unused (a GPU load's read buffers: 128
    MiB a rank, kept for the run otherwise). Blocks in use stay; without the function, nothing happens."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_initialized():
        empty()
