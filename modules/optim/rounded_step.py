"""bfloat16 weights stepped with stochastic rounding by an unchanged optimizer, in the ordinary
(unfused) step: a step pre-hook steps each bfloat16 weight alone through a float32 copy
(single_parameter_step.py) and hides it from the optimizer's own step, which then steps the rest
(float32 weights) as usual; the post-hook shows the weights again. Gradients stay in place, so
clipping before and the first-step guard after see them as in any step.

The optimizer state of such a weight is float32 (made while the weight was a float32 copy);
`load_state_dict` would cast it to the weight's bfloat16, so a resumed run would differ from an
uninterrupted one: `keep_float32_state` shows the weights as float32 while state loads.
"""

from __future__ import annotations

import torch

from modules.optim.single_parameter_step import SingleParameterStepper


def step_bfloat16_stochastically(stepper: SingleParameterStepper) -> None:
    optimizer = stepper.optimizer
    hidden: list[list] = []

    def before(opt, args, kwargs):
        if stepper.active:
            return None
        for group in opt.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None and stepper.rounds(parameter):
                    stepper.step(parameter)
        hidden[:] = [group["params"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if not stepper.rounds(p)]
        return None

    def after(opt, args, kwargs):
        if stepper.active or not hidden:
            return
        for group, params in zip(opt.param_groups, hidden):
            group["params"] = params
        hidden.clear()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def keep_float32_state(stepper: SingleParameterStepper) -> None:
    optimizer = stepper.optimizer
    stored: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def before(opt, state_dict):
        for group in opt.param_groups:
            for parameter in group["params"]:
                if stepper.rounds(parameter):
                    stored.append((parameter, parameter.data))
                    parameter.data = parameter.data.float()  # only its dtype is read while loading
        return None

    def after(opt):
        for parameter, data in stored:
            parameter.data = data
        stored.clear()

    optimizer.register_load_state_dict_pre_hook(before)
    optimizer.register_load_state_dict_post_hook(after)
