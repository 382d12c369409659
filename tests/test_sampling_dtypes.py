"""Sampling follows training's dtype rules: each part computes in `family.compute_dtype(part)`
whatever dtypes its neighbours use (issue 14.1). The shipped SD presets (bf16 text encoder and
UNet, float32 VAE) crashed at their first sample with "Input type (c10::BFloat16) and bias type
(float)", and FLUX with a float32 text encoder beside a bf16-computing transformer with "mat1 and
mat2 must have the same dtype".

Each family samples with its denoiser in every weight mode (train_dtype bf16, so quantized modes
compute in bf16) beside a float32 text encoder and VAE, and with the presets' layout (bf16 text
encoders, float32 VAE); the image must be near the all-float32 image of the same seed, so a
pipeline that silently ran a part in a lower dtype (embeddings squeezed through fp8) shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import train_config

from modules.config.train_config import SamplePromptConfig
from modules.model.registry import family_names, get_family_class
from modules.quantization.capabilities import ALL_MODES, detect_capabilities, working_modes

PROMPT = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64, height=64,
                            seed=3)
# the largest mean absolute pixel difference (0..255) from the float32 image allowed to a run with
# bf16/8-bit/4-bit parts (measured on these tiny models: under 2)
TOLERANCE = 5.0


def _sample(tiny_family_model, tmp_path, family_name: str, parts: dict) -> np.ndarray:
    config = train_config(tiny_family_model(family_name), tmp_path, tmp_path, {
        "model": {"family": family_name, "parts": parts}, "train_dtype": "bfloat16"})
    family = get_family_class(family_name)(config)
    family.load()
    return np.asarray(family.sample(PROMPT, torch.device("cpu")), dtype=np.float32)


_REFERENCES: dict[str, np.ndarray] = {}


def _reference(tiny_family_model, tmp_path, family_name: str) -> np.ndarray:
    if family_name not in _REFERENCES:
        _REFERENCES[family_name] = _sample(tiny_family_model, tmp_path, family_name, {})
    return _REFERENCES[family_name]


def _text_parts(family_name: str) -> list[str]:
    return [spec.name for spec in get_family_class(family_name).part_specs if spec.name.startswith("text_encoder")]


def _assert_near_reference(image, reference):
    difference = float(np.abs(image - reference).mean())
    assert difference < TOLERANCE, f"mean pixel difference {difference:.1f} from the float32 sample"
    assert image.std() > 1.0  # an image, not a flat colour


@pytest.mark.parametrize("mode", [m for m in ALL_MODES if m != "float32"])
@pytest.mark.parametrize("family_name", family_names())
def test_denoiser_in_each_weight_mode_samples_beside_float32_parts(tmp_path, tiny_family_model, family_name, mode):
    if mode not in working_modes(detect_capabilities("cpu")):
        pytest.skip(f"{mode} does not work on this machine's CPU")
    denoiser = get_family_class(family_name).denoiser_part
    image = _sample(tiny_family_model, tmp_path, family_name, {denoiser: {"weight_dtype": mode}})
    _assert_near_reference(image, _reference(tiny_family_model, tmp_path, family_name))


@pytest.mark.parametrize("family_name", family_names())
def test_presets_layout_bf16_text_and_denoiser_float32_vae_samples(tmp_path, tiny_family_model, family_name):
    family_class = get_family_class(family_name)
    parts = {name: {"weight_dtype": "bfloat16"} for name in [*_text_parts(family_name), family_class.denoiser_part]}
    parts["vae"] = {"weight_dtype": "float32"}
    image = _sample(tiny_family_model, tmp_path, family_name, parts)
    _assert_near_reference(image, _reference(tiny_family_model, tmp_path, family_name))


@pytest.mark.parametrize("family_name", family_names())
def test_float8_text_encoders_and_a_bf16_vae_sample(tmp_path, tiny_family_model, family_name):
    # the FLUX and Z-Image presets: float8 text encoder(s), bf16 VAE; the text embeddings must reach
    # the denoiser at the compute dtype, never squeezed through the fp8 storage dtype
    family_class = get_family_class(family_name)
    parts = {name: {"weight_dtype": "float8"} for name in _text_parts(family_name)}
    parts[family_class.denoiser_part] = {"weight_dtype": "bfloat16"}
    parts["vae"] = {"weight_dtype": "bfloat16"}
    image = _sample(tiny_family_model, tmp_path, family_name, parts)
    _assert_near_reference(image, _reference(tiny_family_model, tmp_path, family_name))
