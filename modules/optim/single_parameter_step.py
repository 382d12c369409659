"""Stepping one parameter at a time with an ordinary optimizer (any of modules/optim/optimizers.py
whose step is per parameter), for the fused backward and for stochastic rounding.

Why this way: the optimizers come from several packages (torch, bitsandbytes, lion, came), and
none takes "step this one tensor". All of them loop over `param_groups`, so the step is the
optimizer's own `step()` with every group but the parameter's hidden and that group holding the
parameter alone; its state stays keyed by the parameter as in a whole step. A bfloat16 weight is
stepped through a float32 copy (its optimizer state is then float32 too) and rounded back
stochastically: only one parameter's float32 copy exists at a time, never the model's, which is
the point of training in bfloat16. Optimizers whose step reads all parameters together (Prodigy,
schedule-free) are refused by modules/config/methods/fine_tune.py.

A sharded weight (a DTensor, modules/trainer/sharding.py) does not take a float32 `.data`: it is
stepped as a float32 stand-in Parameter (a copy of this rank's slice) that holds the weight's
optimizer state during the step, and its slice is rounded back element by element. The rounding
noise is this rank's (its own random state, saved per rank in backups), so a sharded run rounds
differently from one process but resumes exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from modules.optim.stochastic_rounding import copy_stochastically_
from modules.util.sharded_tensors import is_sharded, local_part


class SingleParameterStepper:
    def __init__(self, optimizer: torch.optim.Optimizer, stochastic_rounding: bool):
        self.optimizer = optimizer
        self.stochastic_rounding = stochastic_rounding
        self.group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.active = False  # inside one of our own steps (its step hooks must not step again)
        # id -> whether the float32 steps changed a rounded weight, until taken (the first-step guard:
        # a tiny update may round back to every old bfloat16 value and still be a real step); recorded
        # for every weight in the first step, then only for those the guard still watches
        self.moves: dict[int, bool] | None = {}
        self.recorded: set[int] | None = None  # None: every weight

    def take_moves(self) -> dict[int, bool]:
        """What was recorded since the last take (then nothing is, until `record_moves`)."""
        moves, self.moves = self.moves or {}, None
        return moves

    def record_moves(self, ids: set[int]) -> None:
        """Record again, for these parameters only, whether a step changes them."""
        self.moves, self.recorded = {}, set(ids)

    def _records(self, parameter: nn.Parameter) -> bool:
        # (asked before comparing: a comparison of every weight in every step would cost a read of the model)
        return self.moves is not None and (self.recorded is None or id(parameter) in self.recorded)

    def _record(self, parameter: nn.Parameter, moved: bool) -> None:
        self.moves[id(parameter)] = self.moves.get(id(parameter), False) or moved

    def rounds(self, parameter: nn.Parameter) -> bool:
        return self.stochastic_rounding and parameter.dtype == torch.bfloat16

    @torch.no_grad()
    def step(self, parameter: nn.Parameter) -> None:
        """Step `parameter` by its current gradient, as the whole optimizer step would (a parameter
        the optimizer does not hold is left as it is, as a whole step would leave it)."""
        if id(parameter) not in self.group_of:
            return
        if self.rounds(parameter) and is_sharded(parameter):
            self._step_sharded(parameter)
            return
        groups = self.optimizer.param_groups
        kept = [group["params"] for group in groups]
        stored, gradient = parameter.data, parameter.grad
        rounding = self.rounds(parameter)
        try:
            for group in groups:
                group["params"] = []
            groups[self.group_of[id(parameter)]]["params"] = [parameter]
            if rounding:
                parameter.data = stored.float()
                parameter.grad = gradient.float()
            self.active = True
            self.optimizer.step()
            if rounding and self._records(parameter):
                self._record(parameter, not torch.equal(parameter.data, stored.float()))
        finally:
            self.active = False
            for group, params in zip(groups, kept):
                group["params"] = params
            if rounding:
                copy_stochastically_(stored, parameter.data)
                parameter.data, parameter.grad = stored, gradient

    def _step_sharded(self, parameter: nn.Parameter) -> None:
        """`step` of a sharded bfloat16 weight: through a float32 stand-in holding its state."""
        optimizer, groups = self.optimizer, self.optimizer.param_groups
        kept = [group["params"] for group in groups]
        stand_in = nn.Parameter(parameter.detach().float())  # a DTensor of this rank's slice, float32
        stand_in.grad = parameter.grad.float()
        state = optimizer.state
        if parameter in state:
            state[stand_in] = state.pop(parameter)
        try:
            for group in groups:
                group["params"] = []
            groups[self.group_of[id(parameter)]]["params"] = [stand_in]
            self.active = True
            optimizer.step()
        finally:
            self.active = False
            for group, params in zip(groups, kept):
                group["params"] = params
            if stand_in in state:
                state[parameter] = state.pop(stand_in)
        stepped, stored = local_part(stand_in.detach()), local_part(parameter.detach())
        if self._records(parameter):
            self._record(parameter, not torch.equal(stepped, stored.float()))
        copy_stochastically_(stored, stepped)
