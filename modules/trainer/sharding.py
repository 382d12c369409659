"""FSDP2 sharding of the parts too big for one GPU (`distributed.shard_parts`).

Each of the part's repeated blocks (`family.checkpoint_blocks(part)`, the units checkpointing
recomputes) and then the part's root are given to `fully_shard` on a 1-D device mesh over the
ranks: each rank keeps 1/N of every weight (a DTensor sharded on dim 0), and a block's full weights
are all-gathered just before its forward (and again before its backward) and freed after, so a
rank holds its shards plus about one block's full weights at a time.

It runs after the training methods are set up: an adapter hooks its base module's forward and is
not a child of it (modules/adapters/base.py), so the adapters stay ordinary, replicated tensors,
their gradients go through the trainer's all-reduce (distributed.py), and their files are written
as a single process writes them. The frozen base weights are what is split.

Because every forward of a sharded part is a collective, every rank runs each one: sampling and
validation run on all ranks with the same prompts and seeds, and only rank 0 writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.config.errors import ConfigError
from modules.quantization.weight_modes import get_weight_mode

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def shard_parts_(trainer: GenericTrainer) -> list[str]:
    """Shard the config's `distributed.shard_parts` in place; the parts sharded (none in one process)."""
    names = trainer.config.distributed.shard_parts
    if not names or not trainer.ranks.active:
        return []
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    family = trainer.family
    problems = []
    for part in names:
        mode = family.weight_mode(part)  # after auto is resolved: the mode the part was loaded in
        if not get_weight_mode(mode).dense:
            problems.append(f"model.parts.{part}.weight_dtype: auto chose {mode}, but a sharded part "
                            f"(distributed.shard_parts) needs dense weights: set float32, bfloat16 or float16")
        if not family.checkpoint_blocks(part):
            problems.append(f"distributed.shard_parts: the {family.name} family lists no blocks in {part} to "
                            f"shard one at a time")
    if problems:
        raise ConfigError(problems)
    mesh = init_device_mesh(trainer.device.type, (trainer.ranks.world,))
    for part in names:
        root = family.parts[part]
        for block in _deepest_first(root, family.checkpoint_blocks(part)):
            fully_shard(block, mesh=mesh)
        fully_shard(root, mesh=mesh)
        local, full = shard_bytes(root)
        trainer.callbacks.on_status(f"model.parts.{part}: sharded over {trainer.ranks.world} processes "
                                    f"({local / 2**20:.1f} of {full / 2**20:.1f} MiB of weights on this one)")
    return list(names)


def _deepest_first(root: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """`blocks` with nested ones before the blocks holding them (fully_shard goes bottom-up)."""
    depth = {id(module): name.count(".") for name, module in root.named_modules()}
    return sorted(blocks, key=lambda block: -depth.get(id(block), 0))


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own values of a sharded tensor; an ordinary tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def shard_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of `module`'s parameters this rank holds, bytes of the whole parameters)."""
    local = full = 0
    for parameter in module.parameters():
        local += local_part(parameter).numel() * parameter.element_size()
        full += parameter.numel() * parameter.element_size()
    return local, full
