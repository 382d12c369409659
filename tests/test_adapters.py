"""LoRA modules and adapter sets on plain layers and on the tiny model."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from torch import nn

from modules.adapters.adapter_set import AdapterSet, AdapterSetError, build_adapter_set
from modules.adapters.lora import LoRAModule


@pytest.mark.parametrize("base", [nn.Linear(16, 24), nn.Conv2d(8, 12, 3, padding=1, stride=2)])
def test_lora_starts_as_identity_and_learns_through_the_real_layer(base):
    base.requires_grad_(False)
    x = torch.randn(2, 16) if isinstance(base, nn.Linear) else torch.randn(2, 8, 10, 10)
    plain = base(x)
    lora = LoRAModule("lora_test", base, rank=4, alpha=2)
    lora.hook()
    assert torch.equal(base(x), plain)  # up starts at zero
    base(x).square().sum().backward()
    assert lora.lora_up.weight.grad is not None and lora.lora_up.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in base.parameters())  # the frozen base stays frozen
    with torch.no_grad():
        lora.lora_up.weight.normal_()
    changed = base(x)
    assert not torch.allclose(changed, plain)
    lora.unhook()
    assert torch.equal(base(x), plain)
    lora.hook()
    assert torch.equal(base(x), changed)


def test_lora_scale_is_alpha_over_rank_and_follows_a_loaded_alpha():
    base = nn.Linear(8, 8)
    lora = LoRAModule("lora_x", base, rank=4, alpha=2)
    assert lora.scale == 0.5
    state = {k: v.clone() for k, v in lora.state_dict().items()}
    state["alpha"] = torch.tensor(8.0)
    lora.load_state_dict(state)
    assert lora.scale == 2.0


def test_lora_dropout_only_while_the_base_model_trains():
    base = nn.Linear(32, 32)
    lora = LoRAModule("lora_x", base, rank=8, alpha=8, dropout=0.5)
    with torch.no_grad():
        lora.lora_up.weight.normal_()
    lora.hook()
    x = torch.randn(4, 32)
    base.eval()
    assert torch.equal(base(x), base(x))
    base.train()
    assert not torch.equal(base(x), base(x))


def test_state_dict_holds_only_adapter_tensors_with_kohya_suffixes():
    lora = LoRAModule("lora_unet_x", nn.Linear(8, 8), rank=2, alpha=1)
    assert set(lora.state_dict()) == {"lora_down.weight", "lora_up.weight", "alpha"}


def test_adapter_set_loading_is_strict_and_names_keys():
    adapters = AdapterSet()
    adapters.add("unet", LoRAModule("lora_unet_a", nn.Linear(8, 8), rank=2, alpha=1))
    state = adapters.state_dict()
    state["lora_unet_b.alpha"] = torch.tensor(1.0)
    del state["lora_unet_a.lora_up.weight"]
    with pytest.raises(AdapterSetError, match=r"missing keys: lora_unet_a\.lora_up\.weight.*unexpected keys: lora_unet_b\.alpha"):
        adapters.load_state_dict(state, source="file.safetensors")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_model, shape_images):
    from modules.model.sd15 import SD15Family

    family = SD15Family(train_config(tiny_model, shape_images, tmp_path_factory.mktemp("fam")))
    family.load()
    return family


def test_layer_presets_select_the_expected_layers(family):
    from modules.config.train_config import AdapterConfig

    def names(**kwargs):
        return [a.name for a in build_adapter_set(family, AdapterConfig(**kwargs), ["unet", "text_encoder"], torch.device("cpu"))]

    attn = names(layer_preset="attn")
    attn_mlp = names(layer_preset="attn-mlp")
    everything = names(layer_preset="all")
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in attn
    assert "lora_te_text_model_encoder_layers_1_self_attn_out_proj" in attn
    assert not any("ff_net" in n or "mlp" in n for n in attn)
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_0_proj" in attn_mlp
    assert "lora_te_text_model_encoder_layers_0_mlp_fc1" in attn_mlp
    assert "lora_unet_down_blocks_0_resnets_0_conv1" in everything
    assert set(attn) < set(attn_mlp) < set(everything)


def test_filter_entry_matching_nothing_is_an_error_naming_it(family):
    from modules.config.train_config import AdapterConfig

    config = AdapterConfig(layer_filter=[r"attn1\.to_q$", r"no_such_layer"])
    with pytest.raises(AdapterSetError, match=r"adapter\.layer_filter\[1\]: 'no_such_layer' matches no layer"):
        build_adapter_set(family, config, ["unet"], torch.device("cpu"))


def test_adapters_are_created_on_the_train_device_in_their_dtype(family):
    from modules.config.train_config import AdapterConfig

    adapters = build_adapter_set(family, AdapterConfig(dtype="bfloat16"), ["unet"], torch.device("cpu"))
    try:
        assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in adapters.parameters())
    finally:
        adapters.unhook()


def test_every_algorithm_puts_its_buffers_on_the_train_device_too(fake_device):
    """`alpha` is a buffer, not a parameter: one left on the CPU beside a train-device adapter is
    read back across devices at each use and saved from the wrong place."""
    from modules.adapters.registry import adapter_classes, create_adapter
    from modules.config.train_config import AdapterConfig

    assert {"lora", "loha", "lokr", "oft"} <= set(adapter_classes())
    for algorithm in adapter_classes():
        layer = nn.Linear(16, 16).to(fake_device)
        adapter = create_adapter(AdapterConfig(type=algorithm), "unet", "layer", layer, fake_device,
                                 torch.float32)
        tensors = {**dict(adapter.named_parameters()), **dict(adapter.named_buffers())}
        own = {name: t.device.type for name, t in tensors.items() if not name.startswith("base")}
        assert "alpha" in own, (algorithm, own)
        assert set(own.values()) == {fake_device.type}, (algorithm, own)
