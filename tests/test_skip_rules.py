"""Which layers stay dense: the model class's lists are read as lists of names, whatever their form."""

from __future__ import annotations

import pytest
from torch import nn

from modules.quantization.skip_rules import keeps_float32, skip_reason


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_q = nn.Linear(32, 32)
        self.to_out = nn.Linear(32, 32)
        self.q = nn.Linear(32, 32)
        self.time_proj = nn.Linear(32, 32)


class _ListModel(_Blocks):
    _skip_layerwise_casting_patterns = ["time_proj"]
    _keep_in_fp32_modules = ["attn_q"]


class _StringModel(_Blocks):
    # diffusers and transformers also accept a single bare string here
    _skip_layerwise_casting_patterns = "time_proj"
    _keep_in_fp32_modules = "attn_q"


@pytest.mark.parametrize("model_class", [_ListModel, _StringModel])
def test_class_lists_name_whole_modules_whether_a_list_or_a_bare_string(model_class):
    model = model_class()
    reasons = {name: skip_reason(model, "unet", name, layer, []) for name, layer in model.named_children()}
    # a bare string split into letters would skip "to_out" (regex "t") and keep "q" in float32
    assert reasons["to_out"] is None and reasons["q"] is None
    assert "_skip_layerwise_casting_patterns ('time_proj')" in reasons["time_proj"]
    assert "_keep_in_fp32_modules" in reasons["attn_q"]
    assert keeps_float32(model, "attn_q") and not keeps_float32(model, "q") and not keeps_float32(model, "time_proj")
