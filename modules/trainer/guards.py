"""Guards that turn silent failures into loud ones.

An adapter that never learns (gradients went to a copy of the layer, or the optimizer holds
other tensors than the forward uses) trains for hours with a normal-looking loss. After the
first optimizer step, every trainable parameter must have a gradient, every parameter whose
gradient is non-zero must have moved, and every adapter module must have moved as a whole.
(A fresh LoRA's down matrix legitimately gets a zero gradient on step one, because its up
matrix starts at zero, so "moved" is checked per module, not per tensor.)

A first step can also be too small to show: a 1-element gate at 0.5 stepped by Adafactor at the
warm-up's first learning rate (an update of ~2.5e-8, under float32's half-spacing of 3e-8 there),
a norm weight at 1.0 with a tiny lr, a bfloat16 weight. So an unmoved tensor that has a gradient
and that the optimizer holds (membership, which is what "not in the optimizer" asks) is not judged
at step 1: it is watched (`PendingMoves`) until it moves, and fails only if it has not moved by the
end of the warm-up plus `SETTLE_STEPS` steps at the full learning rate. Why a deadline and not the
optimizer's step against the weight's spacing: the step size is each optimizer's own formula
(Adam's ~lr, Adafactor's lr x RMS(weight), SGD's lr x gradient, ...), which no generic code can
know; waiting needs no formula, still catches stale storage (an optimizer step that never reaches
the stored weight, such as a parked weight written back from an old copy: it never moves), and
costs only a copy of the watched tensors. Tensors outside the optimizer still fail at step 1.
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


# steps at the full learning rate (after the warm-up) that a watched tensor gets to move: a float32 step
# below the weight's resolution rounds back every time (it does not add up), so a tensor still unmoved
# after them does not learn at this learning rate, or its stored weight is not the one stepped
SETTLE_STEPS = 10


def check_first_step(named_parameters: list[tuple[str, torch.nn.Parameter]],
                     before: dict[str, torch.Tensor], gradients_seen: dict[str, bool] | None = None,
                     moves: dict[str, bool] | None = None, in_optimizer: set[int] | None = None,
                     deadline: int = SETTLE_STEPS) -> PendingMoves | None:
    """`gradients_seen`: name -> non-zero gradient, for parameters whose gradients were freed in the
    backward pass (a fused backward); the others' `.grad` is read. `moves`: name -> changed by the
    optimizer, where the stored value cannot show it (stochastically rounded bfloat16 weights);
    the others are compared with `before`. `in_optimizer`: the ids of the parameters a step updates
    (the optimizer's groups; a fused backward's stepper's): an unmoved one with a gradient is watched
    until step `deadline` (the returned PendingMoves) instead of failing now; None: membership
    unknown, every unmoved tensor with a gradient fails now."""
    no_grad, not_updated, watched, modules_moved = [], [], [], {}
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
    for name, parameter in named_parameters:
        module = name.rsplit(".", 2)[0]
        moved, nonzero = flags[name]
        if nonzero and not moved and in_optimizer is not None and id(parameter) in in_optimizer:
            watched.append(name)  # stepped, perhaps by less than its resolution: judged later
            moved = True  # (nor is its module called unchanged now)
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
    return PendingMoves({name: before[name] for name in watched}, deadline) if watched else None


class PendingMoves:
    """Trained tensors that had a gradient, are in the optimizer and did not move in the first step,
    with their values before it: each later step asks whether they have moved since, until all have
    (then `done`) or step `deadline` comes, when those still unmoved stop the run."""

    def __init__(self, before: dict[str, torch.Tensor], deadline: int):
        self.before, self.deadline = before, deadline

    @property
    def names(self) -> set[str]:
        return set(self.before)

    @property
    def done(self) -> bool:
        return not self.before

    def check(self, named_parameters: list[tuple[str, torch.nn.Parameter]], step: int,
              moves: dict[str, bool] | None = None) -> None:
        """After optimizer step `step` (1-based); `moves` as for check_first_step, recorded since the
        last check. Every rank calls it while any tensor is watched (a sharded weight is merged)."""
        moves, current = moves or {}, dict(named_parameters)
        names = [name for name in self.before if name in current]
        flags = [moves[name] if name in moves else not torch.equal(local_part(current[name].detach()).cpu(),
                                                                   self.before[name]) for name in names]
        sharded = [i for i, name in enumerate(names) if is_sharded(current[name])]
        if sharded:
            merged = any_rank([flags[i] for i in sharded], reduce_device(current[names[sharded[0]]].device))
            for i, moved in zip(sharded, merged):
                flags[i] = moved
        for name, moved in zip(names, flags):
            if moved:
                del self.before[name]
        if self.before and step >= self.deadline:
            raise TrainingError(f"the trained weights are not learning: by step {step}, " + _listing(
                "tensor(s) in the optimizer had a gradient but never changed (steps below the weight's resolution "
                "at this learning rate, or the stored weight is not the one stepped)", sorted(self.before)).lstrip())

    def unresolved(self) -> str | None:
        """What to tell at the end of a run shorter than the deadline, if some never moved."""
        if self.done:
            return None
        return _listing("trained tensor(s) had a gradient but did not change in this run (their steps may be "
                        "below the weight's resolution; a longer run would have stopped at step "
                        f"{self.deadline})", sorted(self.before)).lstrip()


def _listing(what: str, names: list[str]) -> str:
    shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
    return f"  {len(names)} {what}: {shown}"


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at step {step}: stopping; the last backup holds the last good state "
            "(try a lower learning rate or float32)"
        )
