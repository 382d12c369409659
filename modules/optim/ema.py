"""EMA of the trainable weights: ema = decay * ema + (1 - decay) * weight, after optimizer steps.

The average is kept in float32 on the train device or in RAM (`ema.device: cpu`, for big full
fine-tunes). `swapped_in()` puts the averaged values into the live parameters for sampling and
saving and restores the trained values after, so the hooks and files see the EMA weights
without a second copy of the model.

A sharded weight (a fine-tune of a part in `distributed.shard_parts`, modules/trainer/sharding.py)
is averaged on this rank's slice only (a plain tensor, so `ema.device: cpu` needs no collective on
the CPU); `state_dict` gathers the whole averages (a collective: every rank calls it, as for a
backup), so a backup holds what a single process writes, and `load_state_dict` cuts each rank's
slice back out of them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from modules.util.sharded_tensors import full_value, local_part, rejoined, slice_of


class EMA:
    def __init__(self, parameters: list[nn.Parameter], decay: float, device: torch.device):
        self.parameters = list(parameters)
        self.decay = decay
        self.shadow = [local_part(p.detach()).to(device=device, dtype=torch.float32, copy=True)
                       for p in self.parameters]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        for shadow, parameter in zip(self.shadow, self.parameters):
            shadow.lerp_(local_part(parameter.detach()).to(device=shadow.device, dtype=torch.float32), 1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self):
        # the trained values wait where the average lives (RAM with ema.device cpu): a full
        # fine-tune's weights are never copied a second time on the train device
        live = [local_part(p.detach()) for p in self.parameters]
        saved = [value.to(shadow.device, copy=True) for value, shadow in zip(live, self.shadow)]
        with torch.no_grad():
            for shadow, value in zip(self.shadow, live):
                value.copy_(shadow.to(device=value.device, dtype=value.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for kept, value in zip(saved, live):
                    value.copy_(kept.to(value.device))

    def state_dict(self) -> dict:
        whole = [full_value(rejoined(shadow, parameter)).cpu() for shadow, parameter in zip(self.shadow, self.parameters)]
        return {"decay": self.decay, "updates": self.updates, "shadow": whole}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state['shadow'])} tensors, this run trains {len(self.shadow)}")
        self.updates = state["updates"]
        for shadow, value, parameter in zip(self.shadow, state["shadow"], self.parameters):
            shadow.copy_(slice_of(value, parameter))
