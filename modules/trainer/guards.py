"""Guards that turn silent failures into loud ones.

An adapter that never learns (gradients went to a copy of the layer, or the optimizer holds
other tensors than the forward uses) trains for hours with a normal-looking loss. After the
first optimizer step, every trainable parameter must have a gradient, every parameter whose
gradient is non-zero must have moved, and every adapter module must have moved as a whole.
(A fresh LoRA's down matrix legitimately gets a zero gradient on step one, because its up
matrix starts at zero, so "moved" is checked per module, not per tensor.)
"""

from __future__ import annotations

from modules.errors import UserError

import math

import torch

from modules.trainer.distributed import reduce_device
from modules.trainer.sharding import any_rank
from modules.util.sharded_tensors import is_sharded, local_part


class TrainingError(UserError, RuntimeError):
    pass


def snapshot(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    # in RAM: for a full fine-tune this is a copy of the whole trained model
    # (a sharded weight: this rank's slice; check_first_step asks the other ranks about theirs)
    return {name: local_part(p.detach()).to("cpu", copy=True) for name, p in named_parameters}


# relative to the run's largest gradient: below it a tensor's step may round to nothing (measured: a
# fine-tune bias at 3.2e-6 against 0.99 on one thread, test_sharded_variants, did not move)
NEGLIGIBLE_GRADIENT = 1e-4


def check_first_step(named_parameters: list[tuple[str, torch.nn.Parameter]],
                     before: dict[str, torch.Tensor], gradients_seen: dict[str, bool] | None = None,
                     moves: dict[str, bool] | None = None) -> None:
    """`gradients_seen`: name -> non-zero gradient, for parameters whose gradients were freed in the
    backward pass (a fused backward); the others' `.grad` is read. `moves`: name -> changed by the
    optimizer, where the stored value cannot show it (stochastically rounded bfloat16 weights);
    the others are compared with `before`."""
    no_grad, not_updated, modules_moved = [], [], {}
    seen, moves = gradients_seen or {}, moves or {}
    flags = {}  # name -> (moved, gradient non-zero), on this rank's slice of a sharded weight
    largest = {name: local_part(p.grad.detach()).abs().max().item() if local_part(p.grad).numel() else 0.0
               for name, p in named_parameters if name not in seen and p.grad is not None}
    # a gradient this far below the largest one may rightly move its weight by less than the weight's
    # resolution (a bias whose gradient is float noise): not judged as unmoved
    negligible = NEGLIGIBLE_GRADIENT * max(largest.values(), default=0.0)
    for name, parameter in named_parameters:
        moved = moves[name] if name in moves else not torch.equal(local_part(parameter.detach()).cpu(), before[name])
        if name in seen:
            flags[name] = (moved, seen[name])
        elif parameter.grad is not None:
            flags[name] = (moved, largest[name] > negligible)
        else:
            flags[name] = (moved, None)
    sharded = [name for name, parameter in named_parameters if is_sharded(parameter) and flags[name][1] is not None]
    if sharded:  # a slice may be empty or unchanged on one rank: the weight as a whole, over the ranks
        device = reduce_device(dict(named_parameters)[sharded[0]].device)
        merged = any_rank([flag for name in sharded for flag in flags[name]], device)
        flags.update({name: (merged[2 * i], merged[2 * i + 1]) for i, name in enumerate(sharded)})
    for name, _ in named_parameters:
        module = name.rsplit(".", 2)[0]
        moved, nonzero = flags[name]
        modules_moved[module] = modules_moved.get(module, False) or moved
        if nonzero is None:
            no_grad.append(name)
            continue
        if not moved and nonzero:
            not_updated.append(name)
    frozen_modules = sorted(m for m, moved in modules_moved.items() if not moved)
    problems = []
    if no_grad:
        problems.append(_listing("module(s) received no gradient (is the adapter attached to a copy of its layer?)",
                                 sorted({n.rsplit(".", 2)[0] for n in no_grad})))
    if not_updated:
        problems.append(_listing("tensor(s) had a gradient but did not change (not in the optimizer?)", not_updated))
    if frozen_modules and not no_grad:
        problems.append(_listing("module(s) did not change at all", frozen_modules))
    if problems:
        raise TrainingError("the trained weights are not learning after the first optimizer step:\n" + "\n".join(problems))


def _listing(what: str, names: list[str]) -> str:
    shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
    return f"  {len(names)} {what}: {shown}"


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at step {step}: stopping; the last backup holds the last good state "
            "(try a lower learning rate or float32)"
        )
