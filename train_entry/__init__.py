"""resilient's FSDP2 + DCP training entry point, and the library it is written with.

`torchrun ... -m train_entry [args]` trains the reference model; a user's own torchrun script uses the same
five calls (see `train_entry.session`):

    from train_entry import Session, TrainState
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train_entry.session import Session
    from train_entry.state import TrainState

__all__ = ["Session", "TrainState"]


def __getattr__(name: str):  # torch is imported only when the library is actually used
    if name == "Session":
        from train_entry.session import Session

        return Session
    if name == "TrainState":
        from train_entry.state import TrainState

        return TrainState
    raise AttributeError(name)
