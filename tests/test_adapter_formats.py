"""Adapter files on the tiny SD1.5 model: every type in every key layout saves and loads back to
the same adapter; the key names are the ones other tools read; files other tools (and diffusers'
and peft's own savers) wrote load to continue training; keys that fit nothing are named."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file, save_file

from modules.adapters.adapter_set import AdapterSetError, build_adapter_set
from modules.adapters.formats.files import (
    AdapterFileError,
    file_state,
    load_adapter_file,
    save_adapter_file,
)
from modules.model.components.ldm_unet_keys import ldm_unet_module_name
from modules.config.train_config import AdapterConfig

TYPES = {
    "lora": {"type": "lora"},
    "dora": {"type": "lora", "dora": True, "dora_axis": "output"},
    "dora-input": {"type": "lora", "dora": True, "dora_axis": "input"},
    "loha": {"type": "loha"},
    "lokr": {"type": "lokr", "rank": 2},
    "lokr-both-wd": {"type": "lokr", "rank": 2, "decompose_both": True, "dora": True, "dora_axis": "output"},
    "oft": {"type": "oft", "block_size": 2},  # LyCORIS's layout: 4 channels (conv_out) with 4 would be 1x1 blocks
}
DIFFUSERS_CANNOT = {"dora-input", "lokr-both-wd", "oft"}
PARTS = ["unet", "text_encoder"]


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_model, shape_images):
    from modules.model.sd15 import SD15Family

    family = SD15Family(train_config(tiny_model, shape_images, tmp_path_factory.mktemp("formats")))
    family.load()
    for part in family.parts.values():
        part.eval()
    return family


@contextlib.contextmanager
def adapters_on(family, seed=0, parts=PARTS, **options):
    """Hooked adapters of `options` (every Linear and Conv2d), perturbed so they do something."""
    size = {} if options.get("type") == "oft" else {"rank": 4, "alpha": 2}  # OFT has neither
    config = AdapterConfig(**{"layer_preset": "all", **size, **options})
    adapters = build_adapter_set(family, config, parts, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in adapters.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    try:
        yield adapters
    finally:
        adapters.unhook()


def outputs(family):
    ids = family.tokenize(["a red circle on a blue background"])["input_ids"]
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        text = family.encode_text({"input_ids": ids})["hidden_states"]
        return text, family.unet(latents, torch.tensor([500]), encoder_hidden_states=text).sample


@pytest.mark.parametrize("fmt", ["kohya", "comfy", "diffusers"])
@pytest.mark.parametrize("kind", TYPES)
def test_every_type_round_trips_through_every_format(family, tmp_path, kind, fmt):
    path = tmp_path / "adapter.safetensors"
    plain_text, plain = outputs(family)
    with adapters_on(family, seed=1, **TYPES[kind]) as saved:
        text, out = outputs(family)
        state = saved.state_dict()
        if fmt == "diffusers" and kind in DIFFUSERS_CANNOT:
            with pytest.raises(AdapterFileError, match=r"^output\.format: 'diffusers' cannot hold"):
                save_adapter_file(path, saved, family, fmt, torch.float32, {})
            return
        save_adapter_file(path, saved, family, fmt, torch.float32, {})
    if kind == "oft":  # never alpha 0 in a file (A1111 reads it as "no rotation"): a bound no reader reaches
        assert all(float(v) > 0 for k, v in load_file(str(path)).items() if k.endswith(".alpha"))
    assert (out - plain).abs().max() > 1e-3 and (text - plain_text).abs().max() > 1e-3
    with adapters_on(family, seed=2, **TYPES[kind]) as loaded:
        assert any(not torch.equal(loaded.state_dict()[k], state[k]) for k in state)  # a different start
        load_adapter_file(path, loaded, family)
        again_text, again = outputs(family)
        for key, tensor in loaded.state_dict().items():
            if fmt == "diffusers":  # the scale is folded into one factor and back
                assert torch.allclose(tensor, state[key], rtol=1e-5, atol=1e-7), key
            else:
                assert torch.equal(tensor, state[key]), key
    assert (again - out).abs().max() < 1e-5 and (again_text - text).abs().max() < 1e-5


def test_key_layouts_are_the_ones_other_tools_read(family):
    with adapters_on(family) as adapters:
        kohya, comfy, diffusers = (set(file_state(adapters, family, fmt)) for fmt in ("kohya", "comfy", "diffusers"))
    assert {"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
            "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha",
            "lora_unet_conv_in.lora_up.weight",
            "lora_te_text_model_encoder_layers_1_mlp_fc2.lora_up.weight"} <= kohya
    assert {"diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.lora_down.weight",
            "diffusion_model.input_blocks.0.0.lora_up.weight",  # conv_in
            "diffusion_model.output_blocks.0.0.in_layers.2.lora_down.weight",  # up_blocks.0.resnets.0.conv1
            "diffusion_model.middle_block.1.proj_in.alpha",
            # text encoders keep kohya's names: Forge does not match ComfyUI's text_encoders.clip_l. paths
            "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"} <= comfy
    assert {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
            "unet.conv_in.lora_B.weight",
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"} <= diffusers
    assert not any(k.endswith(".alpha") for k in diffusers)
    assert len(kohya) == len(comfy) and len(diffusers) == len(kohya) * 2 // 3
    with adapters_on(family, type="lokr", rank=1, dora=True, decompose_both=True) as adapters:
        lokr = set(file_state(adapters, family, "kohya"))
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    assert {f"{stem}.{k}" for k in ("lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "dora_scale", "alpha")} <= lokr


def _unet(layers_per_block, levels):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16, block_out_channels=(32,) * levels, layers_per_block=layers_per_block, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=16, attention_head_dim=8,
    )


@pytest.mark.parametrize("layout", [(1, 2), (2, 4)], ids=["tiny", "sd15-layout"])
def test_ldm_names_are_what_diffusers_single_file_loader_maps_back(layout):
    """diffusers' own ldm -> diffusers converter must send every tensor renamed by our map back home."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    unet = _unet(*layout)
    state = unet.state_dict()
    ldm = {}
    for key, tensor in state.items():
        module, _, tensor_name = key.rpartition(".")
        ldm[f"model.diffusion_model.{ldm_unet_module_name(unet, module)}.{tensor_name}"] = tensor
    back = convert_ldm_unet_checkpoint(ldm, dict(unet.config))
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_ldm_names_of_the_sd15_layout():
    fake = SimpleNamespace(config=SimpleNamespace(layers_per_block=2), down_blocks=[None] * 4,
                           up_blocks=[SimpleNamespace()] + [SimpleNamespace(attentions=None)] * 3)
    expected = {
        "down_blocks.0.attentions.1.proj_in": "input_blocks.2.1.proj_in",
        "down_blocks.2.downsamplers.0.conv": "input_blocks.9.0.op",
        "down_blocks.3.resnets.1.time_emb_proj": "input_blocks.11.0.emb_layers.1",
        "mid_block.attentions.0.transformer_blocks.0.attn2.to_k": "middle_block.1.transformer_blocks.0.attn2.to_k",
        "mid_block.resnets.1.conv2": "middle_block.2.out_layers.3",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.1.conv",
        "up_blocks.1.attentions.2.proj_out": "output_blocks.5.1.proj_out",
        "up_blocks.1.upsamplers.0.conv": "output_blocks.5.2.conv",
        "up_blocks.3.resnets.2.conv_shortcut": "output_blocks.11.0.skip_connection",
        "time_embedding.linear_2": "time_embed.2",
        "conv_out": "out.2",
    }
    assert {name: ldm_unet_module_name(fake, name) for name in expected} == expected


def test_a_key_that_fits_no_adapter_is_named(family, tmp_path):
    path = tmp_path / "other.safetensors"
    with adapters_on(family) as adapters:
        state = file_state(adapters, family, "kohya")
        state["lora_unet_no_such_block_to_q.lora_down.weight"] = torch.zeros(4, 8)
        stem = "lora_unet_down_blocks_0_attentions_0_proj_in"
        state[f"{stem}.lora_mid.weight"] = torch.zeros(4, 4, 3, 3)
        save_file(state, str(path))
        with pytest.raises(AdapterFileError) as error:
            load_adapter_file(path, adapters, family)
    message = str(error.value)
    assert message.startswith("adapter.init_from: other.safetensors: 2 key(s) map to no layer")
    assert "lora_unet_no_such_block_to_q.lora_down.weight" in message
    assert f"{stem}.lora_mid.weight (LoCon's Tucker (CP) middle layer, not supported)" in message


def test_a_file_of_another_model_is_named_as_one_with_what_its_header_says(family, tmp_path):
    path = tmp_path / "flux.safetensors"
    save_file({"lora_transformer_single_blocks_0_attn_to_q.lora_down.weight": torch.zeros(4, 8)}, str(path),
              metadata={"modelspec.architecture": "flux-1-dev/lora"})
    with adapters_on(family) as adapters:
        with pytest.raises(AdapterFileError) as error:
            load_adapter_file(path, adapters, family)
    assert (f"none does: is it an adapter of another model than model.family {family.name!r}? (its header says "
            f"'flux-1-dev/lora'; this family's LoRA is {family.modelspec_architecture!r})") in str(error.value)


def test_a_file_missing_adapters_of_this_run_is_refused_naming_them(family, tmp_path):
    path = tmp_path / "partial.safetensors"
    with adapters_on(family) as adapters:
        state = file_state(adapters, family, "kohya")
        dropped = "lora_te_text_model_encoder_layers_0_mlp_fc1"
        save_file({k: v for k, v in state.items() if not k.startswith(dropped + ".")}, str(path))
        with pytest.raises(AdapterSetError, match=rf"partial\.safetensors does not fit .* missing keys: {dropped}\.alpha"):
            load_adapter_file(path, adapters, family)


@pytest.mark.parametrize("saved, wanted, hint", [
    ({"type": "loha"}, {"type": "lora"}, r"it holds loha adapters .* and adapter\.type is 'lora'"),
    ({"type": "lora", "dora": True}, {"type": "lora"}, r"set adapter\.dora: true"),
    ({"type": "lora"}, {"type": "lora", "dora": True}, r"set adapter\.dora: false"),
    ({"type": "lora", "dora": True, "dora_axis": "output"}, {"type": "lora", "dora": True, "dora_axis": "input"},
     r"dora_scale is on the output axis .* set adapter\.dora_axis: output"),
    ({"type": "lora", "dora": True, "dora_axis": "input"}, {"type": "lora", "dora": True, "dora_axis": "output"},
     r"dora_scale is on the input axis .* set adapter\.dora_axis: input"),
    ({"type": "lora", "dora": True, "dora_axis": "output", "format": "diffusers"},
     {"type": "lora", "dora": True, "dora_axis": "input"},
     r"magnitudes are peft's, on the output axis .* set adapter\.dora_axis: output"),
])
def test_a_file_of_other_settings_names_the_setting_to_change(family, tmp_path, saved, wanted, hint):
    path = tmp_path / "settings.safetensors"
    saved = dict(saved)
    fmt = saved.pop("format", "kohya")
    with adapters_on(family, **saved) as adapters:
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
    with adapters_on(family, **wanted) as adapters, pytest.raises(AdapterFileError, match=hint):
        load_adapter_file(path, adapters, family)


def test_an_a1111_era_kohya_file_with_ldm_names_and_no_alpha_loads(family, tmp_path):
    """Older kohya files name UNet layers by ldm blocks and may leave alpha out (alpha = rank)."""
    path = tmp_path / "old.safetensors"
    with adapters_on(family, rank=4, alpha=4) as adapters:
        expected = outputs(family)
        comfy = file_state(adapters, family, "comfy")
    old = {}
    for key, tensor in comfy.items():
        if key.endswith(".alpha"):
            continue
        stem, _, suffix = key.partition(".lora_")
        if stem.startswith("diffusion_model."):
            stem = "lora_unet_" + stem.removeprefix("diffusion_model.").replace(".", "_")
        old[f"{stem}.lora_{suffix}"] = tensor
    assert "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_up.weight" in old
    save_file(old, str(path))
    with adapters_on(family, seed=5, rank=4, alpha=1) as adapters:
        load_adapter_file(path, adapters, family)
        assert all(float(a.alpha) == 4.0 for a in adapters)
        text, out = outputs(family)
    assert (text - expected[0]).abs().max() < 1e-5 and (out - expected[1]).abs().max() < 1e-5


def test_a_file_diffusers_and_peft_saved_loads_to_continue_training(family, tiny_model, tmp_path):
    """A LoRA trained with peft on diffusers' UNet and saved by diffusers (alpha 8 in its
    metadata) loads into a run with another alpha and gives the same UNet output."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None, local_files_only=True)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in pipe.unet.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    StableDiffusionPipeline.save_lora_weights(
        tmp_path, unet_lora_layers=get_peft_model_state_dict(pipe.unet),
        unet_lora_adapter_metadata=pipe.unet.peft_config["default"].to_dict())
    path = tmp_path / "pytorch_lora_weights.safetensors"
    assert next(iter(load_file(str(path)))).startswith("unet.")
    latents, text = torch.randn(1, 4, 32, 32), torch.randn(1, 77, 32)
    pipe.unet.eval()
    with torch.no_grad():
        theirs = pipe.unet(latents, 10, encoder_hidden_states=text).sample
    with adapters_on(family, parts=["unet"], layer_preset="attn", alpha=2) as adapters:
        load_adapter_file(path, adapters, family)
        assert all(float(a.alpha) == 2.0 for a in adapters)  # the run keeps its own alpha
        with torch.no_grad():
            ours = family.unet(latents, 10, encoder_hidden_states=text).sample
    assert (ours - theirs).abs().max() < 1e-5


def test_unreadable_or_pickled_files_are_refused_by_name(family, tmp_path):
    with adapters_on(family) as adapters:
        pickled = tmp_path / "lora.pt"
        pickled.write_bytes(b"not read")
        with pytest.raises(AdapterFileError, match=r"adapter\.init_from: lora\.pt: only \.safetensors"):
            load_adapter_file(pickled, adapters, family)
        broken = tmp_path / "broken.safetensors"
        broken.write_bytes(b"\x00" * 16)
        with pytest.raises(AdapterFileError, match=r"broken\.safetensors is not a readable safetensors file"):
            load_adapter_file(broken, adapters, family)
