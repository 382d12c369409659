"""The fused backward pass: each trained parameter is stepped inside the backward pass, as soon as
its gradient is complete (a post-accumulate-grad hook), and its gradient freed right after, so at
most the gradients of the layers being differentiated exist at once instead of the model's.

Clipping: a global norm needs every gradient before the first step, which is what fusing gives
up; schedule.max_grad_norm clips each parameter's gradient to that norm on its own, as kohya's
(`--fused_backward_pass`) and OneTrainer's fused passes do. The first-step guard cannot read
gradients that are gone, so the hook records, on the first step, which parameters had a
non-zero gradient (`gradients_seen`).
"""

from __future__ import annotations

import torch
from torch import nn

from modules.optim.single_parameter_step import SingleParameterStepper


class FusedBackward:
    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]], max_grad_norm: float | None):
        self.named_parameters = named_parameters
        self.max_grad_norm = max_grad_norm
        self.stepper: SingleParameterStepper | None = None
        self.seen: dict[str, bool] | None = {}  # name -> non-zero gradient, until the first step is checked
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in named_parameters]

    def attach(self, stepper: SingleParameterStepper) -> None:
        self.stepper = stepper

    def _hook(self, name: str):
        def step_and_free(parameter: nn.Parameter) -> None:
            if self.seen is not None:
                self.seen[name] = bool(parameter.grad.detach().abs().sum() > 0)
            if self.max_grad_norm:
                torch.nn.utils.clip_grad_norm_([parameter], self.max_grad_norm)
            self.stepper.step(parameter)
            parameter.grad = None
        return step_and_free

    def take_gradients_seen(self) -> dict[str, bool]:
        """What the first step's gradients were (then no longer recorded)."""
        seen, self.seen = self.seen or {}, None
        return seen

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
