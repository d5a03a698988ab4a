"""Staging: the copy of a rank's state that an async save persists while training goes on.

Every tensor is copied into one host arena, a single uint8 buffer allocated once (pinned on CUDA, so
device-to-host copies run at the link's speed and asynchronously) and reused by every later save while the
state keeps its layout (the same tensors, shapes and dtypes under the same keys); a changed layout
reallocates it. Each tensor has its own 64-byte-aligned slot, so the persist can write the arena's bytes as
one region (train_entry/storage.py). All device-to-host copies are issued together and synchronized once.
Host memory therefore holds one staging copy of the rank's shard for the life of the run, never more.

DTensors are staged as DTensors over the same mesh and placements whose local shard is the host slot, which
is what DCP plans and writes. Everything else is copied too (containers rebuilt, other leaves deep-copied),
so training may change the live state while the copy persists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from supervisor.torchcompat import dtensor_like

Path = tuple[Any, ...]  # where a tensor sits in the state dict: keys and list indices
Layout = list[tuple[Path, torch.Size, torch.dtype]]
ALIGN = 64


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _walk(obj: Any, path: Path, visit: Callable[[Path, torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return visit(path, obj)
    if isinstance(obj, dict):
        return {k: _walk(v, (*path, k), visit) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_walk(v, (*path, i), visit) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else type(obj)(items)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    return copy.deepcopy(obj)


def _layout(sd: dict[str, Any]) -> Layout:
    found: Layout = []

    def visit(path: Path, t: torch.Tensor) -> None:
        local = _local(t)
        found.append((path, local.shape, local.dtype))

    _walk(sd, (), visit)
    return found


class HostStager:
    """Copies state dicts into one host arena that is allocated once and reused while the layout holds."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self.arena: torch.Tensor | None = None  # uint8, every slot inside it
        self._layout: Layout | None = None
        self._slots: dict[Path, torch.Tensor] = {}
        self.allocations = 0  # how many times the arena was (re)allocated: 1 for a steady run

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def _allocate(self, layout: Layout) -> None:
        self._slots, self.arena = {}, None  # drop the old arena before taking a new one: never two at once
        offsets, end = [], 0
        for _, shape, dtype in layout:
            offsets.append(end)
            nbytes = shape.numel() * dtype.itemsize
            end += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        arena = torch.empty(max(end, ALIGN), dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
        for (path, shape, dtype), offset in zip(layout, offsets, strict=True):
            nbytes = shape.numel() * dtype.itemsize
            self._slots[path] = arena[offset:offset + nbytes].view(dtype).view(shape)
        self.arena, self._layout = arena, layout
        self.allocations += 1

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A copy of `sd` with every tensor in this stager's arena; returns once the copies landed."""
        layout = _layout(sd)
        if layout != self._layout:
            self._allocate(layout)
        device_copies = False

        def visit(path: Path, t: torch.Tensor) -> torch.Tensor:
            nonlocal device_copies
            local, slot = _local(t), self._slots[path]
            device_copies |= local.device.type != "cpu"
            slot.copy_(local.detach(), non_blocking=local.device.type != "cpu" and self.pin_memory)
            return slot if local is t else dtensor_like(t, slot)

        staged = _walk(sd, (), visit)
        if device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()  # once, after every copy was issued
        return staged
