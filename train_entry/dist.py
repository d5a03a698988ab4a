"""Process groups: gloo on CPU, NCCL on GPU (chosen by device), plus a gloo group for checkpointing."""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from supervisor import prewarm_client

log = logging.getLogger("train_entry")


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU when CUDA is available, else the CPU."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {preference!r} was asked for (Session.start(device=...), or the entry point's "
                         "--device), but CUDA is not available on this machine")
    # Before set_device, whose CUDA error (a RuntimeError) would be retried as a crash (review 10). `auto` says it
    # too: a rank falling back to the CPU beside GPU ranks would mix backends in one group.
    if local_rank >= (count := torch.cuda.device_count()):
        raise ValueError(f"local rank {local_rank} needs GPU {local_rank}, but this node shows {count} "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): set the job's "
                         f"nproc_per_node to at most {count}, or run on the CPU (--device cpu)")
    return torch.device("cuda", local_rank)


def init(timeout_s: float, device_preference: str = "auto") -> DistContext:
    """Join the job's process group (torchrun's env:// rendezvous) with the collective timeout.

    The checkpoint group is always gloo: background saves gather small Python objects and must not share
    the training group (an async save on the training group deadlocked in measurements here).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_preference, local_rank)
    if dist.is_initialized():
        _meet_on_the_scripts_group()
        raise ValueError("the default process group was already initialized (init_process_group in the script?): "
                         "Session.start() joins the job itself; remove the script's own init_process_group")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = dt.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
    mesh = init_device_mesh(device.type, (world,))
    return DistContext(dist.get_rank(), world, local_rank, device, backend, mesh, ckpt_group)


def _meet_on_the_scripts_group(timeout_s: float = 30.0) -> None:
    """The script formed its own gloo group: every rank refuses it together. A rank that left at once (exit 78)
    broke the group still connecting on a slower one, whose init_process_group then raised from gloo (a traceback
    and exit 1 where the sentence and 78 belong). Bounded: a rank that never comes is waited for `timeout_s`."""
    if dist.get_backend() != "gloo":  # NCCL connects lazily: nothing of it is left half-made
        return
    try:
        dist.monitored_barrier(timeout=dt.timedelta(seconds=timeout_s))
    except Exception as e:  # a rank gone or late: the refusal goes on
        log.debug("ranks did not meet before the refusal: %s", e)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` when our parent (torchrun) dies, so a killed launcher orphans no rank. A rank the
    prewarm server forked has that server as its parent, whose death (an OOM kill) must not stop it: its proxy,
    torchrun's child, dies with torchrun instead and forwards the signal."""
    if not prewarm_client.IN_FORK:
        # torchrun as a container's command is pid 1: "our parent is pid 1" stopped every rank at its start
        prewarm_client.die_with_parent(sig, os.getppid())


SETTLE_LIMIT_S = 0.5


def let_collective_threads_settle(limit_s: float = SETTLE_LIMIT_S, poll_s: float = 0.01) -> None:
    """Leave the GIL free until this process's other threads have gone idle (at most `limit_s`), so that none is
    left dropping a collective's tensors when the interpreter finalizes. Call it after the last collective.

    A gloo worker thread drops its reference to a finished collective's tensors after the collective has returned
    (`ProcessGroupGloo::runLoop`); where Python had dropped them first, that decref takes the GIL. Once the
    interpreter is finalizing, torch still takes it (its guard is `Py_IsInitialized`, true until the end:
    pytorch/pytorch#190489), Python ends the thread with `pthread_exit`, whose unwind through a noexcept destructor
    calls std::terminate: SIGABRT, "terminate called without an active exception". Core dumps of such ranks show
    exactly this, in `~AsyncAllgatherWork` after DCP's last all_gather_object: 6 of 126 runs of a 2-rank script
    ending in `destroy_process_group()`, in loops two at a time on 2 cores; 0 of 164 with this call after it.
    """
    tasks = "/proc/self/task"
    me = threading.get_native_id()
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(poll_s)  # the GIL is free meanwhile: a thread waiting for it gets it
        try:
            busy = [t for t in os.listdir(tasks) if int(t) != me and _runnable(f"{tasks}/{t}/stat")]
        except OSError:  # no /proc: the sleeps are all there is
            busy = []
        quiet = 0 if busy else quiet + 1


def _runnable(stat_path: str) -> bool:
    """The thread is running or waiting for a CPU (state R in /proc/.../stat; gone counts as idle)."""
    try:
        with open(stat_path, "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"R"
