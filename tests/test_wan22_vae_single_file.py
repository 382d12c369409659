"""The Wan 2.2 VAE from its own file (issue 28): the tiny TI2V 5B's 48-channel VAE written in the
original layout (Wan2.2_VAE.pth's keys, ComfyUI's wan2.2_vae: each stage's resnets and resample in
one nested list) as model.parts.vae.path loads the folder's tensors; it is told apart from a Wan 2.1
VAE file by its keys, and either VAE given where the other is wanted is named before any weight
loads. On the released Wan 2.2 VAE (meta tensors) the conversion gives the model's own keys."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config
from test_wan_single_file import vae_to_original

from modules.loading.diffusers_folder import ModelLoadError


def vae22_to_original(state: dict, per_stage: int) -> dict:
    """AutoencoderKLWan (`is_residual`) names -> the original Wan 2.2 VAE's: a stage's `resnets.J`
    is its list's entry J, its `downsampler` / `upsampler` the entry after the `per_stage` resnets
    (encoder stages hold `per_stage`, decoder stages `per_stage + 1`)."""
    nested = {}
    for key, tensor in state.items():
        new = key
        if match := re.match(r"^(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(?:resnets\.(\d+)|(?:down|up)sampler)\.",
                             key):
            coder, direction, stage, index = match.groups()
            index = index if index is not None else per_stage + (direction == "up")
            new = f"{coder}.{direction}samples.{stage}.{direction}samples.{index}.{key[match.end():]}"
        nested[new] = tensor
    return vae_to_original(nested, per_stage)  # the resnets' inner names, the middle, heads and quant convs


def _folder_state(folder, part):
    from safetensors.torch import load_file

    return load_file(str(next((folder / part).glob("*.safetensors"))))


@pytest.fixture(scope="module")
def tiny_ti2v(tiny_family_model):
    return tiny_family_model("wan22_ti2v")


@pytest.fixture(scope="module")
def vae_files(tiny_ti2v, tiny_family_model, tmp_path_factory):
    """(the tiny Wan 2.2 VAE's file, the tiny Wan 2.1 VAE's file), in the original layouts."""
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("wan-vae-files")
    wan22, wan21 = folder / "wan2.2_vae.safetensors", folder / "wan_2.1_vae.safetensors"
    resnets = len(AutoencoderKLWan.from_pretrained(str(tiny_ti2v / "vae")).encoder.down_blocks[0].resnets)
    original = vae22_to_original(_folder_state(tiny_ti2v, "vae"), resnets)
    # the released file's names: stage 0's first resnet, its resample after the resnets
    assert {"encoder.downsamples.0.downsamples.0.residual.0.gamma", f"encoder.downsamples.0.downsamples.{resnets}."
            "resample.1.weight", f"decoder.upsamples.0.upsamples.{resnets + 1}.resample.1.weight", "conv2.weight",
            "decoder.middle.0.residual.0.gamma"} <= set(original)
    save_file({k: v.contiguous() for k, v in original.items()}, str(wan22))
    tiny_wan = tiny_family_model("wan")
    per_stage = len(AutoencoderKLWan.from_pretrained(str(tiny_wan / "vae")).decoder.up_blocks[0].resnets) + 1
    save_file({k: v.contiguous() for k, v in vae_to_original(_folder_state(tiny_wan, "vae"), per_stage).items()},
              str(wan21))
    return wan22, wan21


def _family(name, folder, vae_file, images, tmp_path):
    from modules.config.families import get_family_class

    config = train_config(folder, images, tmp_path, {"model": {"family": name, "parts": {"vae": {"path": str(vae_file)}}}})
    family = get_family_class(name)(config)
    family.model_configs_dir = folder  # the tiny model's vae/config.json stands for the released one
    return family


def test_the_wan22_vae_file_is_told_from_wan21s_and_loads_the_folders_tensors(tmp_path, tiny_ti2v, shape_images,
                                                                             vae_files):
    from diffusers import AutoencoderKLWan

    from modules.model.detect import detect_model, family_mismatch

    wan22, wan21 = vae_files
    assert [(detect_model(p).family, detect_model(p).part) for p in vae_files] == [("wan22_ti2v", "vae"), ("wan", "vae")]
    assert "give this file as model.parts.vae.path" in family_mismatch(wan22, "wan22_ti2v")
    family = _family("wan22_ti2v", tiny_ti2v, wan22, shape_images, tmp_path)
    assert family.from_single_file("vae") and not family.from_single_file("transformer")
    loaded, folder = family.load_part("vae", AutoencoderKLWan).state_dict(), _folder_state(tiny_ti2v, "vae")
    assert set(loaded) == set(folder)
    assert all(torch.equal(loaded[k], folder[k]) for k in folder)


def test_the_other_wan_vae_is_named_before_any_weight_loads(tmp_path, tiny_ti2v, tiny_family_model, shape_images,
                                                            vae_files, monkeypatch):
    """A Wan 2.1 VAE file as the TI2V 5B's VAE, and the Wan 2.2 VAE's file as Wan 2.1's, are named
    by the preflight, and by the load before any part loads (the transformer from its single file)."""
    from safetensors.torch import save_file
    from test_wan_single_file import transformer_to_original

    from modules.model.wan22_ti2v import Wan22TI2VFamily
    from modules.trainer.preflight import _model_problems

    wan22, wan21 = vae_files
    wanted_22 = (r"^model\.parts\.vae\.path: wan_2\.1_vae\.safetensors holds the Wan 2\.1 VAE \(16 latent channels\); "
                 r"Wan 2\.2 TI2V 5B decodes with the Wan 2\.2 VAE \(48 latent channels, residual stages\)")
    family = _family("wan22_ti2v", tiny_ti2v, wan21, shape_images, tmp_path)
    with pytest.raises(ModelLoadError, match=wanted_22):
        family.single_file_stream("vae")  # as the preflight opens it
    problems, _ = _model_problems(family.config)
    assert [str(p) for p in problems if re.match(wanted_22, str(p))], problems
    transformer = tmp_path / "wan2.2_ti2v_5B_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in transformer_to_original(_folder_state(tiny_ti2v, "transformer")).items()},
              str(transformer))
    config = train_config(transformer, shape_images, tmp_path, {"model": {"family": "wan22_ti2v", "parts": {
        "text_encoder": {"path": str(tiny_ti2v / "text_encoder")}, "vae": {"path": str(wan21)}}}})
    loaded = []
    monkeypatch.setattr(Wan22TI2VFamily, "load_part", lambda self, part, *a, **k: loaded.append(part))
    from_file = Wan22TI2VFamily(config)
    from_file.model_configs_dir = tiny_ti2v
    with pytest.raises(ModelLoadError, match=wanted_22):
        from_file.load()
    assert loaded == []
    tiny_wan = tiny_family_model("wan")
    with pytest.raises(ModelLoadError, match=r"^model\.parts\.vae\.path: wan2\.2_vae\.safetensors holds the Wan 2\.2 "
                                             r"VAE \(48 latent channels, residual stages\); Wan 2\.1 decodes with the "
                                             r"Wan 2\.1 VAE \(16 latent channels\)"):
        _family("wan", tiny_wan, wan22, shape_images, tmp_path).single_file_stream("vae")


def test_the_conversion_builds_the_released_wan22_vae():
    """On the released Wan 2.2 VAE (resources/model_configs/wan22_ti2v/vae, meta tensors) the original
    layout's 196 tensors convert to exactly the model's keys."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    from modules.model.wan_single_file import wan22_vae_to_diffusers

    folder = Path(__file__).resolve().parents[1] / "resources" / "model_configs" / "wan22_ti2v" / "vae"
    with init_empty_weights():
        model = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(str(folder)))
    state = model.state_dict()
    original = vae22_to_original(state, len(model.encoder.down_blocks[0].resnets))
    assert len(original) == len(state) == 196
    assert "decoder.upsamples.0.upsamples.3.resample.1.weight" in original  # 2 + 1 resnets, then the upsample
    converted = wan22_vae_to_diffusers(dict(original))
    assert set(converted) == set(state)
    assert all(converted[k].shape == state[k].shape for k in state)
