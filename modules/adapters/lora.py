"""LoRA: output += (alpha / rank) * up(down(x)), for Linear and Conv2d base layers.

down starts random (kaiming-uniform, as nn.Linear does) and up at zero, so a fresh adapter
changes nothing. On a Conv2d, down takes the base kernel, stride and padding and up is 1x1
(the LoCon layout kohya, LyCORIS and ComfyUI read).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from modules.adapters.base import AdapterModule
from modules.quantization.base import is_linear


class LoRAModule(AdapterModule):
    def __init__(self, name: str, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(name, base, dropout=dropout)
        if is_linear(base):
            rank = min(rank, base.in_features, base.out_features)
            self.lora_down = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
            self.lora_up = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        elif isinstance(base, nn.Conv2d):
            rank = min(rank, base.in_channels, base.out_channels)
            self.lora_down = nn.Conv2d(base.in_channels, rank, base.kernel_size, base.stride, base.padding,
                                       base.dilation, bias=False, device=device, dtype=dtype)
            self.lora_up = nn.Conv2d(rank, base.out_channels, 1, bias=False, device=device, dtype=dtype)
        else:
            raise TypeError(f"{name}: LoRA supports Linear and Conv2d, not {type(base).__name__}")
        self.rank = rank
        # a buffer so it is saved and loaded with the adapter (kohya's ".alpha" key)
        self.register_buffer("alpha", torch.tensor(float(alpha), device=device), persistent=True)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        # a Python float, so the forward never reads a tensor back (a device sync on CUDA)
        self.scale = float(alpha) / rank
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_scale())

    def _refresh_scale(self) -> None:
        self.scale = float(self.alpha) / self.rank

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        hidden = self.lora_down(x.to(self.lora_down.weight.dtype))
        if self.dropout and training:
            hidden = nn.functional.dropout(hidden, self.dropout)
        # scaling the rank-sized hidden is cheaper than scaling the output
        return self.lora_up(hidden * self.scale)
