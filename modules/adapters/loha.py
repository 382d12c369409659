"""LoHa (LyCORIS): dW = (alpha / rank) * (w1_a @ w1_b) * (w2_a @ w2_b), a Hadamard product of two
low-rank products, so rank r reaches an effective rank up to r^2.

Shapes are LyCORIS's (and peft's): w?_a is (out, rank), w?_b is (rank, in * kh * kw); a Conv2d's
delta is reshaped to its kernel. hada_w2_a starts at zero so a fresh adapter changes nothing; the
other factors start as LyCORIS starts them (normal, w1_a small). The delta weight is applied with
the base layer's own operation (F.linear / F.conv2d), dropout on that output, rank dropout on the
delta's rows.
"""

from __future__ import annotations


import torch
from torch import nn

from modules.adapters.base import AdapterModule
from modules.config.adapters.loha import LoHaConfig




class LoHaModule(AdapterModule):
    algorithm = "loha"
    config_class = LoHaConfig
    key_names = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
    unsupported_keys = {"hada_t1": "LoHa's Tucker (CP) core", "hada_t2": "LoHa's Tucker (CP) core"}
    peft_scaled = ("hada_w1_a",)

    @classmethod
    def from_config(cls, config, part, name, module, device, dtype, output_format="kohya"):
        rank, alpha = config.size_for(part)
        return cls(name, module, rank, alpha, **cls.common_options(config, device, dtype))

    def default_alpha(self, local):
        return float(local["hada_w1_b"].shape[0]) if "hada_w1_b" in local else float(self.alpha)

    def peft_unsupported(self):
        return None

    def __init__(self, name: str, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 rank_dropout: float = 0.0, module_dropout: float = 0.0):
        super().__init__(name, base, dropout=dropout, rank_dropout=rank_dropout, module_dropout=module_dropout)
        rank = min(rank, self.out_dim, self.fan_in)
        self.rank = rank
        factory = {"device": device, "dtype": dtype}
        self.hada_w1_a = nn.Parameter(torch.empty(self.out_dim, rank, **factory))
        self.hada_w1_b = nn.Parameter(torch.empty(rank, self.fan_in, **factory))
        self.hada_w2_a = nn.Parameter(torch.empty(self.out_dim, rank, **factory))
        self.hada_w2_b = nn.Parameter(torch.empty(rank, self.fan_in, **factory))
        with torch.no_grad():
            nn.init.normal_(self.hada_w1_a, std=0.1)
            nn.init.normal_(self.hada_w1_b, std=1.0)
            nn.init.zeros_(self.hada_w2_a)
            nn.init.normal_(self.hada_w2_b, std=1.0)
        self.register_buffer("alpha", torch.tensor(float(alpha), device=device), persistent=True)
        self.scale = float(alpha) / rank
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_scale())

    def _refresh_scale(self) -> None:
        self.scale = float(self.alpha) / self.rank

    def delta_weight(self, training: bool = False) -> torch.Tensor:
        weight = (self.hada_w1_a @ self.hada_w1_b) * (self.hada_w2_a @ self.hada_w2_b) * self.scale
        return self.row_dropout(weight, training).view(self.weight_shape)
