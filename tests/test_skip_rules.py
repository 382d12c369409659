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


def test_a_keep_in_fp32_entry_matches_a_module_at_any_depth():
    """T5's `_keep_in_fp32_modules` is ['wo']: the layers it means are nested deep
    (encoder.block.0.layer.1.DenseReluDense.wo); a match at the start of the name only would
    quantize and store them in the compute dtype (T5 in fp16 overflows there)."""
    from transformers import T5Config, T5EncoderModel

    model = T5EncoderModel(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2))
    assert type(model)._keep_in_fp32_modules == ["wo"]
    linears = {name: layer for name, layer in model.named_modules() if isinstance(layer, nn.Linear)}
    kept = sorted(name for name in linears if keeps_float32(model, name))
    assert kept == ["encoder.block.0.layer.1.DenseReluDense.wo", "encoder.block.1.layer.1.DenseReluDense.wo"]
    assert "T5EncoderModel._keep_in_fp32_modules" == skip_reason(model, "text_encoder_3", kept[0], linears[kept[0]], [])
    assert not keeps_float32(model, "encoder.block.0.layer.1.DenseReluDense.wi")
    assert not keeps_float32(model, "encoder.block.0.layer.1.DenseReluDense.wox")  # whole names, not prefixes


def test_lists_set_on_the_instance_alone_are_read_too():
    """A model may carry its lists on the instance (set after it was built), not its class."""
    model = _Blocks()
    model._skip_layerwise_casting_patterns = ["time_proj"]
    model._keep_in_fp32_modules = ["attn_q"]
    assert not hasattr(_Blocks, "_keep_in_fp32_modules")
    assert "_skip_layerwise_casting_patterns" in skip_reason(model, "unet", "time_proj", model.time_proj, [])
    assert keeps_float32(model, "attn_q") and not keeps_float32(model, "q")


@pytest.mark.parametrize("tie", [True, False])
def test_a_head_stays_dense_where_the_config_ties_it_to_the_token_table(tie):
    """The tie is the instance's (`all_tied_weights_keys`, from `tie_word_embeddings`), not the
    class's `_tied_weights_keys`, which lists SmolLM3's head either way: an untied head is quantized."""
    import torch
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = SmolLM3ForCausalLM(config)
    reason = skip_reason(model, "text_encoder", "lm_head", model.lm_head, [])
    assert (reason == "its weight is tied to model.embed_tokens.weight (SmolLM3ForCausalLM's tied weights)") is tie
    assert tie or reason is None
