"""Staging: the copy of a rank's state that an async save persists while training goes on.

The host buffers are allocated once (pinned on CUDA, so device-to-host copies run at the link's speed and
asynchronously) and reused by every later save while the state keeps its layout (the same tensors, shapes
and dtypes under the same keys); a changed layout reallocates them. All device-to-host copies are issued
together and synchronized once. Host memory therefore holds one staging copy of the rank's shard for the
life of the run, never more.

DTensors are staged as DTensors over the same mesh and placements whose local shard is the host buffer,
which is what DCP plans and writes. Everything else is copied too (containers rebuilt, other leaves
deep-copied), so training may change the live state while the copy persists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from supervisor.torchcompat import dtensor_like

Path = tuple[Any, ...]  # where a tensor sits in the state dict: keys and list indices


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


def _layout(sd: dict[str, Any]) -> list[tuple[Path, torch.Size, torch.dtype]]:
    found: list[tuple[Path, torch.Size, torch.dtype]] = []

    def visit(path: Path, t: torch.Tensor) -> None:
        local = _local(t)
        found.append((path, local.shape, local.dtype))

    _walk(sd, (), visit)
    return found


class HostStager:
    """Copies state dicts into host buffers that are allocated once and reused while the layout holds."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._layout: list[tuple[Path, torch.Size, torch.dtype]] | None = None
        self._buffers: dict[Path, torch.Tensor] = {}
        self.allocations = 0  # how many times the buffers were (re)allocated: 1 for a steady run

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _allocate(self, layout: list[tuple[Path, torch.Size, torch.dtype]]) -> None:
        self._buffers = {}  # drop the old buffers before taking new ones: never two copies at once
        self._buffers = {path: torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
                         for path, shape, dtype in layout}
        self._layout = layout
        self.allocations += 1

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A copy of `sd` with every tensor in this stager's host buffers; returns once the copies landed."""
        layout = _layout(sd)
        if layout != self._layout:
            self._allocate(layout)
        device_copies = False

        def visit(path: Path, t: torch.Tensor) -> torch.Tensor:
            nonlocal device_copies
            local, buf = _local(t), self._buffers[path]
            device_copies |= local.device.type != "cpu"
            buf.copy_(local.detach(), non_blocking=local.device.type != "cpu" and self.pin_memory)
            return buf if local is t else dtensor_like(t, buf)

        staged = _walk(sd, (), visit)
        if device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()  # once, after every copy was issued
        return staged
