"""EMA of the trainable weights: ema = decay * ema + (1 - decay) * weight, after optimizer steps.

The average is kept in float32 on the train device or in RAM (`ema.device: cpu`, for big full
fine-tunes). `swapped_in()` puts the averaged values into the live parameters for sampling and
saving and restores the trained values after, so the hooks and files see the EMA weights
without a second copy of the model.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class EMA:
    def __init__(self, parameters: list[nn.Parameter], decay: float, device: torch.device):
        self.parameters = list(parameters)
        self.decay = decay
        self.shadow = [p.detach().to(device=device, dtype=torch.float32, copy=True) for p in self.parameters]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        for shadow, parameter in zip(self.shadow, self.parameters):
            shadow.lerp_(parameter.detach().to(device=shadow.device, dtype=torch.float32), 1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self):
        # the trained values wait where the average lives (RAM with ema.device cpu): a full
        # fine-tune's weights are never copied a second time on the train device
        saved = [p.detach().to(shadow.device, copy=True) for p, shadow in zip(self.parameters, self.shadow)]
        with torch.no_grad():
            for shadow, parameter in zip(self.shadow, self.parameters):
                parameter.copy_(shadow.to(device=parameter.device, dtype=parameter.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for value, parameter in zip(saved, self.parameters):
                    parameter.copy_(value.to(parameter.device))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state['shadow'])} tensors, this run trains {len(self.shadow)}")
        self.updates = state["updates"]
        for shadow, value in zip(self.shadow, state["shadow"]):
            shadow.copy_(value)
