"""An exponential moving average of a model's weights, sharded like the model.

With FSDP2 every parameter is a DTensor sharded on dim 0; the average keeps one DTensor per parameter with the
same mesh and placements, so each rank holds and updates only its shard (no gather, no extra full copy) and a
checkpoint saves it as shards that DCP reshards on a world-size change, exactly like the model. Declare it
`Sharded(ema)` in the TrainState. Without FSDP (plain tensors) the same class works, and its state is
`Replicated`.
"""

from __future__ import annotations

from typing import Any

import torch

from train_entry.stateful import StatefulError


class EMA:
    """`shadow = decay * shadow + (1 - decay) * weight` after every optimizer step.

    The average is kept in float32 whatever the training precision: FSDP2's mixed precision computes in
    bf16 but keeps the sharded parameters, and this copy, in float32.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise StatefulError(f"EMA decay must lie strictly between 0 and 1, not {decay}")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().clone().float() for name, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Move the average towards the model's current weights (call after optimizer.step())."""
        for name, p in model.named_parameters():
            if name in self.shadow:
                # lerp_ on DTensors of the same placements runs on the local shards: elementwise, no collective.
                self.shadow[name].lerp_(p.detach().float(), 1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Overwrite the model's weights with the average (for evaluation; save the weights first to go back)."""
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name])

    def state_dict(self) -> dict[str, Any]:
        # The live tensors: a save copies them (staging), a load fills them in place through DCP.
        return dict(self.shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.keys() != self.shadow.keys():
            missing, unexpected = self.shadow.keys() - state.keys(), state.keys() - self.shadow.keys()
            raise KeyError(f"EMA state does not match the model: missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
        for name, t in state.items():
            if t is not self.shadow[name]:
                self.shadow[name].copy_(t)
