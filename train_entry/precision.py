"""Training precision: fp32, bf16, or fp16 with a loss scaler.

On CUDA, bf16 and fp16 go through FSDP2's `MixedPrecisionPolicy`: each block's parameters are all-gathered
and computed in the low precision while the sharded parameters, the optimizer state and the gradient
reduction stay float32. On CPU they go through `torch.autocast`, which works there for both dtypes
(matmuls in the low precision, losses and reductions in float32), and the parameters are float32 throughout.
fp16's narrow range needs a `torch.amp.GradScaler` (on either device); its state (scale, growth tracker)
is the same on every rank (DTensor all-reduces its inf/NaN check across the mesh) and is checkpointed as
`Replicated`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device, *, scaler_growth_interval: int = 2000):
        if name not in DTYPES:
            raise ValueError(f"precision {name!r}: choose one of {', '.join(DTYPES)}")
        self.name, self.device, self.dtype = name, device, DTYPES[name]
        self.scaler = (torch.amp.GradScaler(device.type, growth_interval=scaler_growth_interval)
                       if name == "fp16" else None)

    @property
    def uses_fsdp_policy(self) -> bool:
        return self.name != "fp32" and self.device.type == "cuda"

    @property
    def how(self) -> str:
        if self.name == "fp32":
            return "no casting"
        what = "FSDP2 MixedPrecisionPolicy" if self.uses_fsdp_policy else f"autocast on {self.device.type}"
        return what + (", GradScaler" if self.scaler is not None else "")

    def shard_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for every `fully_shard` call."""
        if not self.uses_fsdp_policy:
            return {}
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return {"mp_policy": MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)}

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Around the forward pass: autocast where the FSDP policy does not already cast."""
        if self.name == "fp32" or self.uses_fsdp_policy:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), through the scaler when there is one (it skips a step whose gradients overflowed)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
