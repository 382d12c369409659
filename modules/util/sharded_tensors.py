"""Tensors of a sharded part (FSDP2 DTensors, modules/trainer/sharding.py) read and written as
whole ones: this rank's slice, the whole value gathered, a whole value cut back into the slice.
Each helper takes an ordinary tensor too and then does nothing, so the adapters, the EMA, the
optimizer steppers and the guards call them without asking whether a part is sharded."""

from __future__ import annotations

import torch


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own values of a sharded tensor; an ordinary tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one, in RAM (a collective: every rank calls it together)."""
    return tensor.full_tensor().cpu() if is_sharded(tensor) else tensor


@torch.no_grad()
def copy_into_shard_(parameter: torch.Tensor, full: torch.Tensor) -> None:
    """`parameter` = `full`, each rank keeping its own slice (no communication: every rank has `full`)."""
    if not is_sharded(parameter):
        parameter.copy_(full)
        return
    local_part(parameter).copy_(_slice_like(full, parameter))


def slice_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's slice of `full` as `like` (a sharded tensor of full's shape) cuts it; `full`
    itself for an ordinary `like`. No communication, in full's dtype."""
    return _slice_like(full, like) if is_sharded(like) else full


def rejoined(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's slice, cut as `like`'s) as a DTensor sharded like `like`, for
    `full_value`; `local` itself for an ordinary `like`."""
    if not is_sharded(like):
        return local
    from torch.distributed.tensor import DTensor

    # the collective runs where the mesh is (a slice kept in RAM goes there for the gather)
    return DTensor.from_local(local.to(like.to_local().device), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def _slice_like(full: torch.Tensor, like) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    local = like.to_local()
    # FSDP2's shards are DTensor Shard(0) chunks: the same slice distribute_tensor cuts (in full's dtype)
    return distribute_tensor(full.to(local.device), like.device_mesh, like.placements,
                             src_data_rank=None).to_local()
