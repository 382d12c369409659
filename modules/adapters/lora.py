"""LoRA: output += (alpha / rank) * up(down(x)), for Linear and Conv2d base layers; with `dora`,
the weight decomposition of DoRA on top (weight_decompose.py).

down starts random (kaiming-uniform, as nn.Linear does) and up at zero, so a fresh adapter
changes nothing. On a Conv2d, down takes the base kernel, stride and padding and up is 1x1
(the LoCon layout kohya, LyCORIS and ComfyUI read). Dropout acts on the rank-sized hidden
(kohya's neuron dropout); rank dropout drops whole ranks, rescaled to keep the expected value.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modules.adapters.base import AdapterModule
from modules.adapters.weight_decompose import Axis, WeightDecomposed
from modules.config.adapters.lora import LoRAConfig




class LoRAModule(WeightDecomposed, AdapterModule):
    algorithm = "lora"
    config_class = LoRAConfig
    key_names = ("lora_down.weight", "lora_up.weight")
    unsupported_keys = {"lora_mid.weight": "LoCon's Tucker (CP) middle layer"}
    peft_names = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}
    peft_scaled = ("lora_up.weight",)
    lycoris_algo = "locon"

    @classmethod
    def from_config(cls, config, part, name, module, device, dtype, output_format="kohya"):
        rank, alpha = config.size_for(part)
        return cls(name, module, rank, alpha, dora=config.dora, dora_axis=config.resolved_dora_axis(output_format)
                   or "output", **cls.common_options(config, device, dtype))

    @classmethod
    def network_metadata(cls, config, output_format="kohya"):
        if not config.dora:  # plain LoRA: kohya's own module
            return {"ss_network_module": "networks.lora", "ss_network_dim": str(config.rank),
                    "ss_network_alpha": str(config.alpha)}
        return super().network_metadata(config, output_format)

    def default_alpha(self, local):
        return float(local["lora_down.weight"].shape[0]) if "lora_down.weight" in local else float(self.alpha)

    def peft_unsupported(self):
        if self.dora_axis not in (None, "output"):
            return ("peft's DoRA decomposes on the output axis (adapter.dora_axis: input cannot be written); "
                    "use 'kohya' or 'comfy'")
        return None

    def __init__(self, name: str, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 rank_dropout: float = 0.0, module_dropout: float = 0.0, dora: bool = False,
                 dora_axis: Axis = "output"):
        super().__init__(name, base, dropout=dropout, rank_dropout=rank_dropout, module_dropout=module_dropout)
        rank = min(rank, self.in_dim, self.out_dim)
        if self.is_conv:
            self.lora_down = nn.Conv2d(self.in_dim, rank, base.kernel_size, base.stride, base.padding,
                                       base.dilation, bias=False, device=device, dtype=dtype)
            self.lora_up = nn.Conv2d(rank, self.out_dim, 1, bias=False, device=device, dtype=dtype)
        else:
            self.lora_down = nn.Linear(self.in_dim, rank, bias=False, device=device, dtype=dtype)
            self.lora_up = nn.Linear(rank, self.out_dim, bias=False, device=device, dtype=dtype)
        self.rank = rank
        # a buffer so it is saved and loaded with the adapter (kohya's ".alpha" key)
        self.register_buffer("alpha", torch.tensor(float(alpha), device=device), persistent=True)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        # a Python float, so the forward never reads a tensor back (a device sync on CUDA)
        self.scale = float(alpha) / rank
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_scale())
        if dora:
            self.setup_decomposition(dora_axis, device, dtype)

    def _refresh_scale(self) -> None:
        self.scale = float(self.alpha) / self.rank

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        hidden = self.lora_down(x.to(self.lora_down.weight.dtype))
        if self.rank_dropout and training:
            channel = 1 if self.is_conv else -1
            keep = (torch.rand(self.rank, device=hidden.device) >= self.rank_dropout).to(hidden.dtype)
            shape = [1] * hidden.dim()
            shape[channel] = self.rank
            hidden = hidden * (keep / (1 - self.rank_dropout)).view(shape)
        if self.dropout and training:
            hidden = F.dropout(hidden, self.dropout)
        # scaling the rank-sized hidden is cheaper than scaling the output
        return self.lora_up(hidden * self.scale)

    def adapt(self, module, x, output, training):
        if self.dora_axis is None:
            return super().adapt(module, x, output, training)
        delta_out = self.delta(x, training) if self.dora_axis == "output" else None
        return self.decomposed_output(module, x, output, delta_out, training)

    def delta_weight(self, training: bool = False) -> torch.Tensor:
        up = self.lora_up.weight.flatten(1)
        down = self.lora_down.weight.flatten(1)
        return (up @ down).view(self.weight_shape) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.decomposed_weight() if self.dora_axis else super().merged_weight()
