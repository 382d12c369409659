"""Sampling follows training's dtype rules: each part computes in `family.compute_dtype(part)`
whatever dtypes its neighbours use (issue 14.1). The shipped SD presets (bf16 text encoder and
UNet, float32 VAE) crashed at their first sample with "Input type (c10::BFloat16) and bias type
(float)", and FLUX with a float32 text encoder beside a bf16-computing transformer with "mat1 and
mat2 must have the same dtype".

Each family samples with its denoiser in every weight mode (train_dtype bf16, so quantized modes
compute in bf16) beside a float32 text encoder and VAE, and with the presets' layouts; the image
must be near the all-float32 image of the same seed, so a pipeline that silently ran a part in a
lower dtype (embeddings squeezed through fp8) shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import train_config

from modules.config.train_config import SamplePromptConfig
from modules.config.families import family_names, get_family_class
from modules.quantization.capabilities import ALL_MODES, detect_capabilities, working_modes

PROMPT = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=32, height=32,
                            seed=3)
# the largest mean absolute pixel difference (0..255) from the float32 image allowed to a run with
# bf16/8-bit/4-bit parts (measured on these tiny models at 64 px: under 2; every case passes it at the 32 px
# sampled here, a quarter of the pixels: the dtypes each part computes in do not depend on the size)
TOLERANCE = 5.0


def _sample(tiny_family_model, tmp_path, family_name: str, parts: dict) -> np.ndarray:
    config = train_config(tiny_family_model(family_name), tmp_path, tmp_path, {
        "model": {"family": family_name, "parts": parts}, "train_dtype": "bfloat16"})
    family = get_family_class(family_name)(config)
    family.load()
    prompt = PROMPT
    if family.declaration is not None and family.declaration.prompt_images[0]:  # it samples from an image
        from modules.data.synthetic_images import write_shape_images

        write_shape_images(tmp_path / "prompt", count=1, width=64, height=64)
        prompt = PROMPT.model_copy(update={"control_images": [str(next((tmp_path / "prompt").glob("*.png")))]})
    return np.asarray(family.sample(prompt, torch.device("cpu")), dtype=np.float32)


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


# text encoders, denoiser, VAE
LAYOUTS = {
    "SD-presets": ("bfloat16", "bfloat16", "float32"),
    "FLUX-and-Z-Image-presets": ("float8", "bfloat16", "bfloat16"),  # embeddings reach the denoiser in bf16, not fp8
    "float16": ("float16", "float16", "float16"),  # SDXL's pipeline decodes a force_upcast VAE in float32
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family_name", family_names())
def test_each_part_in_its_own_dtype_samples(tmp_path, tiny_family_model, family_name, layout):
    text, denoiser, vae = LAYOUTS[layout]
    parts = {name: {"weight_dtype": text} for name in _text_parts(family_name)}
    parts[get_family_class(family_name).denoiser_part] = {"weight_dtype": denoiser}
    parts["vae"] = {"weight_dtype": vae}
    image = _sample(tiny_family_model, tmp_path, family_name, parts)
    _assert_near_reference(image, _reference(tiny_family_model, tmp_path, family_name))


def test_casts_reach_nested_inputs_and_leave_timesteps_alone():
    from modules.sampling.part_dtypes import cast_floats

    latents, timesteps, ids = torch.randn(1, 4, 8, 8), torch.tensor([979.0]), torch.tensor([[1, 2]])
    args, kwargs = cast_floats(((latents,), {"added": {"time_ids": torch.zeros(1, 6)}, "x": [latents],
                                              "timestep": timesteps, "ids": ids}), torch.bfloat16)
    assert args[0].dtype == kwargs["added"]["time_ids"].dtype == kwargs["x"][0].dtype == torch.bfloat16
    # a bf16 timestep 979 would read as 980: models embed timesteps at their own precision
    assert kwargs["timestep"] is timesteps and kwargs["ids"] is ids
