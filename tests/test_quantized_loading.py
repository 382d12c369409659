"""Quantizing at load: which layers, in what dtype, from which checkpoint tensors.

The layer classes themselves are pinned in test_quantized_layers.py (and its siblings); here: the
skip-list union, the compute dtype, the streamed load against diffusers' own loader, ComfyUI scaled-fp8 files,
and torchao's int8 as a QuantizedLinear like the others.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from accelerate import init_empty_weights
from conftest import train_config
from safetensors.torch import load_file, save_file
from torch import nn

from modules.loading.diffusers_folder import ModelLoadError
from modules.loading.streamed_load import load_streamed
from modules.model.sd15 import SD15Family
from modules.quantization.base import QuantizedLinear, unquantized_weight
from modules.quantization.linear_fp8 import LinearFp8
from modules.quantization.linear_nf4 import LinearNf4
from modules.quantization.replace import QUANTIZED_MODES, quantize_model_
from modules.quantization.torchao_int8 import LinearInt8, QuantizationError


class Toy(nn.Module):
    """Declares both of the class-level keep lists diffusers/transformers models carry."""

    _skip_layerwise_casting_patterns = ["casting_sensitive"]
    _keep_in_fp32_modules = ["must_stay_fp32", "ln"]

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(64)  # the first parameter, and not a Linear weight
        self.casting_sensitive = nn.Linear(64, 64)
        self.must_stay_fp32 = nn.Linear(64, 64)
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 64, bias=False)
        self.user_skipped = nn.Linear(64, 64)
        self.odd = nn.Linear(64, 24)
        self.time_embedding = nn.Linear(64, 64)


@pytest.fixture
def toy_folder(tmp_path):
    torch.manual_seed(0)
    toy = Toy()
    save_file(toy.state_dict(), str(tmp_path / "model.safetensors"))
    return tmp_path, toy


def _load_toy(folder, mode, compute_dtype=torch.bfloat16, **kwargs):
    with init_empty_weights():
        empty = Toy()
    return load_streamed(empty, folder, part="toy", where="model.parts.toy", mode=mode,
                         compute_dtype=compute_dtype, quantize_skip=[r"^toy\.user_skipped$"], **kwargs)


def test_skip_lists_are_the_union_of_every_source(toy_folder):
    folder, _ = toy_folder
    model, report = _load_toy(folder, "float8")
    assert isinstance(model.body, LinearFp8) and isinstance(model.head, LinearFp8)
    assert sorted(report.quantized) == ["body", "head"]
    for name in ("casting_sensitive", "must_stay_fp32", "user_skipped", "odd", "time_embedding"):
        assert type(getattr(model, name)) is nn.Linear, name
    assert "_skip_layerwise_casting_patterns" in report.skipped["casting_sensitive"]
    assert "_keep_in_fp32_modules" in report.skipped["must_stay_fp32"]
    assert "quantize_skip[0]" in report.skipped["user_skipped"]
    assert "multiple of 16" in report.skipped["odd"]
    assert "default skip list" in report.skipped["time_embedding"]


def test_keep_in_fp32_modules_stay_float32_while_the_rest_is_stored_in_the_compute_dtype(toy_folder):
    folder, _ = toy_folder
    for mode in ("float8", "bfloat16"):
        model, _ = _load_toy(folder, mode)
        assert model.must_stay_fp32.weight.dtype == torch.float32, mode
        assert model.ln.weight.dtype == torch.float32, mode
        assert model.casting_sensitive.weight.dtype == torch.bfloat16, mode
        assert model.user_skipped.weight.dtype == torch.bfloat16, mode


def test_compute_dtype_comes_from_the_config_not_from_a_parameter(toy_folder):
    # The first parameter is a float32 LayerNorm weight and the quantized layers store fp8 codes:
    # neither says "bfloat16", which is what the config asked for.
    folder, dense = toy_folder
    model, _ = _load_toy(folder, "float8", compute_dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.float32
    assert model.body.compute_dtype == torch.bfloat16
    x = torch.randn(3, 64)
    out = model.body(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense.body(x), atol=0.1, rtol=0.1)


def test_streamed_dense_load_matches_diffusers_own_loader(tiny_model, tmp_path, shape_images):
    from diffusers import UNet2DConditionModel

    family = SD15Family(train_config(tiny_model, shape_images, tmp_path))
    family.load()
    reference = UNet2DConditionModel.from_pretrained(str(tiny_model / "unet"))
    ours = family.parts["unet"].state_dict()
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def _unet_inputs(family):
    torch.manual_seed(3)
    config = family.parts["unet"].config
    latents = torch.randn(1, config.in_channels, 8, 8)
    text = torch.randn(1, 77, config.cross_attention_dim)
    return latents, torch.tensor([500]), text


def _unet_out(family, inputs):
    latents, timesteps, text = inputs
    with torch.no_grad():
        return family.parts["unet"](latents, timesteps, encoder_hidden_states=text).sample.float()


@pytest.fixture(scope="module")
def dense_unet_out(tmp_path_factory, tiny_model, shape_images):
    family = SD15Family(train_config(tiny_model, shape_images, tmp_path_factory.mktemp("dense")))
    family.load()
    return _unet_out(family, _unet_inputs(family))


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_each_mode_loads_the_unet_quantized_and_close_to_dense(mode, tiny_model, tmp_path, shape_images,
                                                                dense_unet_out):
    config = train_config(tiny_model, shape_images, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": mode}}}})
    family = SD15Family(config)
    family.load()
    unet = family.parts["unet"]
    report = family.quantization_reports["unet"]
    quantized = [m for m in unet.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == len(report.quantized) > 10
    assert all(type(unet.get_submodule(n)) is nn.Linear for n in report.skipped)
    out = _unet_out(family, _unet_inputs(family))
    similarity = torch.nn.functional.cosine_similarity(out.flatten(), dense_unet_out.flatten(), dim=0)
    assert similarity > (0.97 if mode == "nf4" else 0.995), similarity


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_parts_layer_options_reach_its_layers(double_quant, tiny_model, tmp_path, shape_images):
    # model.parts.unet.nf4_double_quant travels as the part's LayerOptions (config -> family load ->
    # streamed loader -> the mode's layer factory): each nf4 layer is made with it
    config = train_config(tiny_model, shape_images, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": "nf4", "nf4_double_quant": double_quant}}}})
    family = SD15Family(config)
    family.load()
    layers = [m for m in family.parts["unet"].modules() if isinstance(m, LinearNf4)]
    assert len(layers) > 10 and {layer.double_quant for layer in layers} == {double_quant}


# --- ComfyUI scaled fp8 -----------------------------------------------------------------------------

def _write_scaled_fp8_unet(tiny_model, folder, per_channel=False, code_max=448.0):
    """The tiny model's UNet as a ComfyUI 'scaled fp8' checkpoint: each big Linear weight as fp8
    codes of weight / scale, the scale in `.scale_weight`, and the `scaled_fp8` marker. The scale
    maps each amax onto `code_max` (448: float8_e4m3fn's largest value, LinearFp8's own rule)."""
    shutil.copytree(tiny_model, folder)
    path = folder / "unet" / "diffusion_pytorch_model.safetensors"
    dense = load_file(str(path))
    scaled, scales = {}, {}
    for key, tensor in dense.items():
        if key.endswith(".weight") and tensor.dim() == 2 and tensor.shape[0] % 16 == 0 and tensor.shape[1] % 16 == 0:
            amax = tensor.abs().amax(dim=1, keepdim=True) if per_channel else tensor.abs().max()
            scale = (amax / code_max).clamp(min=1e-12)
            scaled[key] = (tensor / scale).to(torch.float8_e4m3fn)
            scaled[key[: -len("weight")] + "scale_weight"] = scale.reshape(-1) if per_channel else scale.reshape(1)
            scales[key] = scale
        else:
            scaled[key] = tensor
    scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, str(path))
    return dense, scaled, scales


def test_scaled_fp8_checkpoint_scales_become_the_fp8_layer_scales(tiny_model, tmp_path, shape_images):
    """The file's scales map amax onto 240 (float8_e4m3fnuz's largest value, as some converters
    do), not LinearFp8's 448: quantizing the file's dense values again would change every code
    and scale, so only keeping them as they are passes."""
    model = tmp_path / "model"
    dense, scaled, scales = _write_scaled_fp8_unet(tiny_model, model, code_max=240.0)
    config = train_config(model, shape_images, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": "float8"}}}})
    family = SD15Family(config)
    family.load()
    unet = family.parts["unet"]
    checked = 0
    for key, scale in scales.items():
        layer = unet.get_submodule(key[: -len(".weight")])
        if isinstance(layer, LinearFp8):
            # the file's own codes and scale, kept exactly
            assert torch.equal(layer.weight.view(torch.uint8), scaled[key].view(torch.uint8)), key
            assert torch.equal(layer.scale.reshape(()), scale.reshape(()).float()), key
            assert not torch.equal(layer.scale, (scaled[key].float() * scale).abs().max() / 448.0)  # not our rule
            checked += 1
        expected = scaled[key].float() * scale
        torch.testing.assert_close(unquantized_weight(layer, torch.float32, "cpu"), expected, atol=1e-2, rtol=0.1)
    assert checked > 10


@pytest.mark.parametrize("per_channel", [False, True])
def test_scaled_fp8_checkpoint_is_dequantized_with_its_scales_into_dense_modes(per_channel, tiny_model, tmp_path,
                                                                               shape_images):
    model = tmp_path / "model"
    dense, scaled, scales = _write_scaled_fp8_unet(tiny_model, model, per_channel)
    config = train_config(model, shape_images, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": "float32"}}}})
    family = SD15Family(config)
    family.load()
    weights = family.parts["unet"].state_dict()
    assert "scaled_fp8" not in weights and not any(k.endswith(".scale_weight") for k in weights)
    for key, scale in scales.items():
        # the dequantized value, not the raw codes (which are up to 448 / amax times too large)
        torch.testing.assert_close(weights[key], scaled[key].float() * scale)
        torch.testing.assert_close(weights[key], dense[key], atol=0.07 * dense[key].abs().max().item(), rtol=0.07)


def test_a_scale_without_its_weight_is_refused_by_name(tiny_model, tmp_path, shape_images):
    model = tmp_path / "model"
    _write_scaled_fp8_unet(tiny_model, model)
    path = model / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    victim = next(k for k in tensors if k.endswith(".scale_weight"))
    tensors["down_blocks.9.stray.scale_weight"] = tensors[victim].clone()
    save_file(tensors, str(path))
    family = SD15Family(train_config(model, shape_images, tmp_path))
    with pytest.raises(ModelLoadError, match=r"unexpected keys: down_blocks\.9\.stray\.scale_weight"):
        family.load()


# --- torchao int8 ------------------------------------------------------------------------------------

def test_torchao_int8_is_a_quantized_linear_whose_matmul_is_torchaos():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    reference = nn.Linear(64, 64)
    reference.load_state_dict(model[0].state_dict())
    quantize_model_(model, "toy", "int8", torch.float32)
    layer = model[0]
    assert isinstance(layer, LinearInt8) and layer.weight.dtype == torch.int8 and layer.scale.dtype == torch.float32
    # the same codes and scale as torchao's own int8 Linear, and the same output from its kernel
    quantize_(reference, Int8WeightOnlyConfig())
    assert torch.equal(layer.weight, reference.weight.qdata) and torch.equal(layer.scale, reference.weight.scale)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-6, atol=1e-6)


def test_a_torchao_whose_quantize_does_nothing_is_refused(monkeypatch):
    import torchao.quantization

    monkeypatch.setattr(torchao.quantization, "quantize_", lambda model, config: None)
    with pytest.raises(QuantizationError, match="left the layer dense"):
        LinearInt8.from_linear(nn.Linear(64, 64), torch.float32)


def test_adapter_on_a_torchao_int8_layer_gets_gradients():
    from modules.adapters.lora import LoRAModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    quantize_model_(model, "toy", "int8", torch.float32)
    adapter = LoRAModule("lora_toy_0", model[0], rank=4, alpha=4)
    adapter.hook()
    nn.init.normal_(adapter.lora_up.weight)
    x = torch.randn(3, 64, requires_grad=True)
    model(x).sum().backward()
    assert adapter.lora_up.weight.grad.abs().sum() > 0 and adapter.lora_down.weight.grad.abs().sum() > 0
    assert x.grad is not None and not model[0].weight.requires_grad


def test_weight_files_prefer_the_plain_name_and_fall_back_to_a_variant(tmp_path):
    from modules.loading.streamed_load import checkpoint_files

    for name in ("diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors", "x.bin"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in checkpoint_files(tmp_path, "w")] == ["diffusion_pytorch_model.safetensors"]
    (tmp_path / "diffusion_pytorch_model.safetensors").unlink()
    assert [p.name for p in checkpoint_files(tmp_path, "w")] == ["diffusion_pytorch_model.fp16.safetensors"]
    (tmp_path / "diffusion_pytorch_model.fp16.safetensors").unlink()
    assert [p.name for p in checkpoint_files(tmp_path, "w")] == ["x.bin"]
    (tmp_path / "x.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"^w: no weights"):
        checkpoint_files(tmp_path, "w")
