"""FSDP2 sharding of the parts too big for one GPU (`distributed.shard_parts`).

Each of the part's repeated blocks (`family.checkpoint_blocks(part)`, the units checkpointing
recomputes) and then the part's root are given to `fully_shard` on a 1-D device mesh over the
ranks: each rank keeps 1/N of every weight (a DTensor sharded on dim 0), and a block's full weights
are all-gathered just before its forward (and again before its backward) and freed after, so a
rank holds its shards plus about one block's full weights at a time.

It runs after the training methods are set up: an adapter hooks its base module's forward and is
not a child of it (modules/adapters/base.py), so the adapters stay ordinary, replicated tensors,
their gradients go through the trainer's all-reduce (distributed.py), and their files are written
as a single process writes them. The frozen base weights are what is split. In a fine-tune the
trained weights are split too; the methods look their (new, DTensor) parameters up again
(`parameters_replaced`), and the second half of this file sums, clips, gathers and re-splits them.

Because every forward of a sharded part is a collective, every rank runs each one: sampling and
validation run on all ranks with the same prompts and seeds, and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.config.errors import ConfigError
from modules.quantization.weight_modes import get_weight_mode
from modules.trainer.distributed import reduce_device
from modules.util.sharded_tensors import full_value, is_sharded, local_part, slice_of

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
        sum_gradients_(root)
        local, full = shard_bytes(root)
        trainer.callbacks.on_status(f"model.parts.{part}: sharded over {trainer.ranks.world} processes "
                                    f"({local / 2**20:.1f} of {full / 2**20:.1f} MiB of weights on this one)")
    return list(names)


def _deepest_first(root: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """`blocks` with nested ones before the blocks holding them (fully_shard goes bottom-up)."""
    depth = {id(module): name.count(".") for name, module in root.named_modules()}
    return sorted(blocks, key=lambda block: -depth.get(id(block), 0))


def reshard_(trainer: GenericTrainer) -> None:
    """Free the whole weights FSDP still holds. The root of a sharded part keeps its all-gathered
    weights after a forward until a backward (FSDP2 does not reshard the root after its forward), and
    the next forward reuses them without gathering again: after a forward-only pass (a sample, a
    validation) whose weights were then changed in the slices (the EMA or schedule-free's average
    swapped in or out), that next forward would run on stale values."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.sharded:
        for module in trainer.family.parts[part].modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def shard_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of `module`'s parameters this rank holds, bytes of the whole parameters)."""
    local = full = 0
    for parameter in module.parameters():
        local += local_part(parameter).numel() * parameter.element_size()
        full += parameter.numel() * parameter.element_size()
    return local, full


# --- trained sharded weights (a fine-tune of a sharded part) ---------------------------------
# Their gradients are DTensors that FSDP reduce-scatters after each block's backward: summed over
# the ranks, never averaged (divide factor 1, sum-only collectives, which gloo needs too), as the
# trainer's own all-reduce sums the other gradients (each rank's loss is already weighted by its
# share of the global batch). Files hold whole tensors, so a sharded run's saves and backups are
# the ones a single process writes, and either run resumes the other's backup.


def sum_gradients_(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for child in module.modules():
        if isinstance(child, FSDPModule):
            child.set_gradient_divide_factor(1.0)
            child.set_force_sum_reduction_for_comms(True)


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag true on any rank (one collective)."""
    import torch.distributed as dist

    if not flags:
        return []
    values = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over a mix of sharded gradients (each rank holds a slice:
    their squares are summed over the ranks) and replicated ones (the same on every rank, counted once)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [local_part(g) for g in grads if is_sharded(g)]
    plain = [g for g in grads if not is_sharded(g)]
    device = sharded[0].device if sharded else plain[0].device
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for grad in sharded:
        squares += grad.float().square().sum().to(device)
    reduced = squares.to(reduce_device(squares.device))
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    squares = reduced.to(device)
    for grad in plain:
        squares += grad.float().square().sum().to(device)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in sharded + plain:
        grad.mul_(scale.to(grad.device, grad.dtype))
    return norm


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with the state of sharded weights whole (a collective; the same
    layout a single process saves)."""
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, parameter in enumerate(params):
        if is_sharded(parameter) and index in state["state"]:
            state["state"][index] = {k: full_value(v) if isinstance(v, torch.Tensor) else v
                                     for k, v in state["state"][index].items()}
    return state


def reshard_optimizer_state_(optimizer: torch.optim.Optimizer) -> None:
    """After optimizer.load_state_dict of whole tensors: the state of each sharded weight cut back
    to this rank's slice, as a DTensor like the weight, in the state's own dtype (a bfloat16 weight
    stepped through float32 with stochastic rounding keeps float32 moments)."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if not is_sharded(parameter):
                continue
            for key, value in optimizer.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor) and not is_sharded(value) and value.shape == parameter.shape:
                    optimizer.state[parameter][key] = DTensor.from_local(
                        slice_of(value, parameter), parameter.device_mesh, parameter.placements,
                        run_check=False, shape=parameter.shape, stride=parameter.stride())


@contextlib.contextmanager
def whole_state_dicts(trainer: GenericTrainer):
    """While saving a model: each sharded part's state_dict() returns its whole tensors in RAM on
    rank 0 (gathered by every rank together, torch.distributed.checkpoint's full state dict), so
    the savers write what a single process writes. The other ranks keep nothing of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    patched = []
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    try:
        for part in trainer.sharded:
            module = trainer.family.parts[part]
            whole = get_model_state_dict(module, options=options)  # rank 0's; {} on the others
            module.state_dict = lambda *args, _whole=whole, **kwargs: dict(_whole)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.state_dict
