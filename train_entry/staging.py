"""Staging: the copy of a rank's state that an async save persists while training goes on.

Every tensor is copied into one host arena, a single uint8 buffer allocated once (pinned on CUDA, so
device-to-host copies run at the link's speed and asynchronously) and reused by every later save while the
state keeps its layout (the same tensors, shapes and dtypes under the same keys); a changed layout
reallocates it. Pinning gigabytes takes about a second (measured on an H100: 1.07 s for 2 GB), so the session
has the arena allocated in the background once training runs (`prepare`), not in the first save. The arena
is an anonymous mapping registered with CUDA (cudaHostRegister) rather than torch's pinned allocator, which
rounds every allocation up to a power of two (a 2.6 GB state would pin 4 GiB).

Each tensor has its own 64-byte-aligned slot, the sharded ones (DTensor shards) first, from a page-aligned
start: the persist writes them as one region, straight from the arena to the disk with O_DIRECT
(train_entry/storage.py). All device-to-host copies are issued together and synchronized once.
Host memory therefore holds one staging copy of the rank's shard for the life of the run, never more.

DTensors are staged as DTensors over the same mesh and placements whose local shard is the host slot, which
is what DCP plans and writes. Everything else is copied too (containers rebuilt, other leaves deep-copied),
so training may change the live state while the copy persists.
"""

from __future__ import annotations

import copy
import gc
import threading
from collections.abc import Callable
from typing import Any

import torch

from supervisor.torchcompat import dtensor_like

Path = tuple[Any, ...]  # where a tensor sits in the state dict: keys and list indices
Layout = list[tuple[Path, torch.Size, torch.dtype, bool]]  # ..., is it a DTensor's shard
ALIGN = 64
PAGE = 4096
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the caller's


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
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple takes fields
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    return copy.deepcopy(obj)


def _layout(sd: dict[str, Any]) -> Layout:
    found: Layout = []

    def visit(path: Path, t: torch.Tensor) -> None:
        local = _local(t)
        found.append((path, local.shape, local.dtype, local is not t))

    _walk(sd, (), visit)
    return found


class HostStager:
    """Copies state dicts into one host arena that is allocated once and reused while the layout holds."""

    def __init__(self, pin_memory: bool, device: torch.device | None = None):
        self.pin_memory = pin_memory
        self.device = device  # the rank's GPU: a thread that pins must not open a context on GPU 0
        self.arena: torch.Tensor | None = None  # uint8, every slot inside it
        self._registered = False  # the arena is registered with CUDA (unregistered before it is dropped)
        self._layout: Layout | None = None
        self._slots: dict[Path, torch.Tensor] = {}
        self._preparing: threading.Thread | None = None
        self.allocations = 0  # how many times the arena was (re)allocated: 1 for a steady run

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def prepare(self, sd: dict[str, Any]) -> None:
        """Allocate the arena for `sd`'s layout in a background thread; the next `stage` waits for it. A
        failure there is left for `stage` to meet again, in the save, where it is reported."""
        layout = _layout(sd)
        if layout == self._layout or self._preparing is not None:
            return

        def allocate() -> None:
            try:
                if self.pin_memory and self.device is not None and self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                self._allocate(layout)
            except Exception:  # stage() allocates again and raises it there, in the save
                self._layout = None

        self._preparing = threading.Thread(target=allocate, name="resilient-staging-alloc", daemon=True)
        self._preparing.start()

    def _allocate(self, layout: Layout) -> None:
        old, registered = self.arena, self._registered
        self._slots, self.arena, self._layout, self._registered = {}, None, None, False
        if old is not None and registered:
            torch.cuda.cudart().cudaHostUnregister(old.data_ptr())
        if old is not None:
            del old  # drop the old arena before taking a new one: never two at once
            gc.collect()  # and what a save left in reference cycles, which may hold views of it (DCP on torch 2.7)
        offsets: dict[Path, int] = {}
        end = 0
        for sharded in (True, False):  # the shards first: one page-aligned region for the persist to write
            for path, shape, dtype, is_shard in layout:
                if is_shard == sharded:
                    offsets[path] = end
                    end += (shape.numel() * dtype.itemsize + ALIGN - 1) // ALIGN * ALIGN
            if sharded:
                end = (end + PAGE - 1) // PAGE * PAGE
        arena, registered = (_pinned_apart(max(end, PAGE), self.device) if self.pin_memory
                             else _page_aligned_empty(max(end, PAGE), False))
        for path, shape, dtype, _ in layout:
            nbytes = shape.numel() * dtype.itemsize
            self._slots[path] = arena[offsets[path]:offsets[path] + nbytes].view(dtype).view(shape)
        self.arena, self._layout, self._registered = arena, layout, registered
        self.allocations += 1

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A copy of `sd` with every tensor in this stager's arena; returns once the copies landed."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
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


def _pinned_apart(nbytes: int, device: torch.device | None) -> tuple[torch.Tensor, bool]:
    """`_page_aligned_empty(nbytes, True)` in a thread of its own. A refused cudaHostRegister leaves CUDA's last
    error set in the calling thread (torch's bindings cannot clear it), and the next kernel launched there fails
    with it (measured on an H100: `CUDA error: invalid argument`); in a thread that ends, the error ends with it.
    An arena allocated in the training thread (sync saves, a save before the background preparation, a new
    layout) would otherwise kill the rank at its first step after every save."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # not a context on GPU 0
            out["arena"] = _page_aligned_empty(nbytes, True)
        except BaseException as e:  # raised in the caller's thread below
            out["error"] = e

    t = threading.Thread(target=run, name="resilient-staging-pin", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["arena"]


def _page_aligned_empty(nbytes: int, pin_memory: bool) -> tuple[torch.Tensor, bool]:
    """A uint8 host buffer of `nbytes` (a multiple of PAGE) that starts on a page boundary, as O_DIRECT needs:
    an anonymous mapping (its tensor's storage holds it), registered with CUDA when `pin_memory`. Returns it and
    whether it was registered (else, when pinned, it comes from torch's own pinned allocator)."""
    import mmap

    arena = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    if pin_memory:
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, HOST_REGISTER_PORTABLE))
        except (AttributeError, RuntimeError, TypeError):  # no such binding in this build (e.g. ROCm)
            err = -1
        if err != 0:  # refused (e.g. a locked-memory limit) or unavailable: torch's own pinned allocator
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
        return arena, True
    return arena, False
