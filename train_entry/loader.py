"""The reference's data path as a stateful data loader: the pattern for loaders that carry their own position.

`--loader stream` (the default) computes each batch from the global sample position saved in the
TrainState. `--loader stateful` reads the same samples through torchdata's `StatefulDataLoader` (an optional
dependency: `pip install 'resilient[data]'`), whose position lives in the loader and is checkpointed as the
loader's own per-rank state, `PerRank(loader)`. Without torchdata a minimal loader with the same protocol
stands in (and says so).

The loader follows a world-size change through the `reshard_state_dict` hook: its batch sampler yields this
rank's contiguous slice of each global batch, so every rank's saved state holds the same global position,
and a new rank continues from that position with its slice at the new world size: nothing is repeated or
skipped. A loader whose per-rank states cannot be combined (say, a shuffled shard per rank) has no such
hook, and resuming it on another world size stops with a sentence naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from train_entry.data import TokenStream, rank_slice

log = logging.getLogger("train_entry")

Batch = tuple[range, torch.Tensor, torch.Tensor]  # this rank's global sample ids, inputs, targets


class Samples(Dataset):
    """The token stream as a map-style dataset: global sample id -> (id, sequence)."""

    def __init__(self, stream: TokenStream):
        self.stream = stream

    def __getitem__(self, g: int) -> tuple[int, torch.Tensor]:
        return g, self.stream.sequences(range(g, g + 1))[0]


class RankBatches:
    """A stateful batch sampler: this rank's slice of each global batch, from a global position, forever.
    It is its own iterator, so the loader's sampler state and its iterator state are one position."""

    def __init__(self, global_batch: int, rank: int, world_size: int, position: int = 0):
        self.global_batch, self.rank, self.world_size, self.position = global_batch, rank, world_size, position

    def __iter__(self) -> RankBatches:
        return self

    def __next__(self) -> list[int]:
        ids = rank_slice(self.position, self.global_batch, self.rank, self.world_size)
        self.position += self.global_batch
        return list(ids)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class _MinimalStatefulLoader:
    """torchdata's StatefulDataLoader protocol for this case only (a stateful batch sampler, no workers)."""

    def __init__(self, dataset: Dataset, batch_sampler: RankBatches, collate_fn: Callable[[list], Any]):
        self.dataset, self.batch_sampler, self.collate_fn = dataset, batch_sampler, collate_fn

    def __iter__(self) -> Iterator[Any]:
        for ids in self.batch_sampler:
            yield self.collate_fn([self.dataset[i] for i in ids])

    def state_dict(self) -> dict[str, Any]:
        return {"batch_sampler": self.batch_sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state["batch_sampler"])


def stateful_dataloader_class() -> type | None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


class StatefulLoader:
    """The reference's loader: declare it `PerRank(loader)`; iterate `batches(device)` after the resume."""

    def __init__(self, stream: TokenStream, global_batch: int, rank: int, world_size: int, seed: int):
        self.sampler = RankBatches(global_batch, rank, world_size)
        cls = stateful_dataloader_class()
        if cls is None:
            if rank == 0:
                log.warning("torchdata is not installed: --loader stateful uses resilient's minimal loader with the "
                            "same state_dict protocol (pip install 'resilient[data]' for StatefulDataLoader)")
            self.loader: Any = _MinimalStatefulLoader(Samples(stream), self.sampler, default_collate)
        else:
            # Its own generator: a DataLoader iterator draws a base seed when it is created, from the global RNG
            # if it has no generator, and a resumed run creates one where the uninterrupted run did not.
            self.loader = cls(Samples(stream), batch_sampler=self.sampler, num_workers=0,
                              generator=torch.Generator().manual_seed(seed))

    def batches(self, device: torch.device) -> Iterator[Batch]:
        for ids, seqs in self.loader:
            seqs = seqs.to(device)
            yield range(int(ids[0]), int(ids[-1]) + 1), seqs[:, :-1], seqs[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        # The loader's own state, and the global position in the clear for reshard_state_dict.
        return {"loader": self.loader.state_dict(), "position": self.sampler.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])

    def reshard_state_dict(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        """The world size changed: continue from the saved global position with this rank's new slice."""
        positions = {s["position"] for s in states}
        if len(positions) != 1:
            raise ValueError(f"the saved ranks were at different global positions {sorted(positions)}")
        self.sampler.position = positions.pop()  # the loader has not started: it begins there


def stream_batches(stream: TokenStream, position: Callable[[], int], global_batch: int, rank: int,
                   world_size: int, device: torch.device) -> Iterator[Batch]:
    """The default data path: each batch computed from the TrainState's global position (read at each step)."""
    while True:
        ids = rank_slice(position(), global_batch, rank, world_size)
        yield (ids, *stream.batch(ids, device))
