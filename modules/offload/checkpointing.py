"""Gradient checkpointing per block, non-reentrant, with optional activation offloading.

The blocks are the family's `checkpoint_blocks(part)`, the same list the layer offloader parks,
so every parked block is recomputed right before its own backward and its layers are on the
train device for both. The model libraries' own checkpointing is not used for this: diffusers
checkpoints a UNet's resnets but not its first mid-block resnet or its attention blocks as a
whole, and a parked block that is not recomputed would need its layers back in the middle of
the backward pass. `use_reentrant=False`: the reentrant variant drops gradients of inputs that
do not require grad and cannot nest. With activation offloading the block's inputs (what the
checkpoint keeps) wait on the temp device until the backward pass needs them; that works with or
without layer offloading.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn


def _move(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value


def checkpointed_call(function: Callable, *args, offload_to: torch.device | None = None, **kwargs):
    """`function(*args, **kwargs)` under non-reentrant checkpointing; with `offload_to`, the tensors
    the checkpoint keeps (the block's inputs) wait there and come back for the recomputation."""
    if offload_to is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]

    def run(*parked):
        return function(*(_move(a, d) if d is not None else a for a, d in zip(parked, devices)), **kwargs)

    return torch.utils.checkpoint.checkpoint(run, *(_move(a, offload_to) for a in args), use_reentrant=False)


def checkpoint_blocks_(blocks: list[nn.Module], offload_to: torch.device | None = None) -> None:
    """Make each block recompute its forward in the backward pass (when grad is enabled)."""
    for block in blocks:
        original = block.forward  # the bound forward; calling it skips the wrapper below

        def forward(*args, _original=original, **kwargs):
            if torch.is_grad_enabled():
                return checkpointed_call(_original, *args, offload_to=offload_to, **kwargs)
            return _original(*args, **kwargs)

        block.forward = forward
