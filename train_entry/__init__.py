"""resilient's FSDP2 + DCP training entry point, and the library it is written with.

`torchrun ... -m train_entry [args]` trains the reference model; a user's own torchrun script uses the same
five calls (see `train_entry.session`), and declares the loop's other stateful objects (see
`train_entry.stateful`):

    from train_entry import EMA, PerRank, Replicated, Session, Sharded, TrainState
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train_entry.ema import EMA
    from train_entry.session import Session
    from train_entry.state import TrainState
    from train_entry.stateful import PerRank, Replicated, Sharded, StatefulError, TrainStateError

__all__ = ["EMA", "PerRank", "Replicated", "Session", "Sharded", "StatefulError", "TrainState", "TrainStateError"]

# torch is imported only when the library is actually used.
_HOME = {"EMA": "train_entry.ema", "Session": "train_entry.session", "TrainState": "train_entry.state",
         "PerRank": "train_entry.stateful", "Replicated": "train_entry.stateful", "Sharded": "train_entry.stateful",
         "StatefulError": "train_entry.stateful", "TrainStateError": "train_entry.stateful"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(name)
