"""`sampling.vae_tiling` (modules/sampling/vae_tiling.py): a sample decoded in tiles is close to the
whole decode, the tiled path really ran (the tiny VAEs get tiles smaller than their 64/128 px
samples: 32 px for the AutoencoderKL ones, 32 px at stride 16 for Wan's), and the VAE is untiled
again after the sample (the cache build must not tile). Measured on these tiny random models: mean
absolute pixel difference (0..255) SD1.5 / SDXL / Wan 4.24 / 5.38 / 4.38 (`pytest -s` prints it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import train_config

from modules.config.families import get_family_class
from modules.config.train_config import SamplePromptConfig

PROMPT = SamplePromptConfig(prompt="a red circle", steps=2, cfg=2.0, width=128, height=128, seed=3)
TOLERANCE = 8.0  # mean absolute pixel difference from the whole decode (tile seams are blended, not gone)


def _family(tiny_family_model, tmp_path, name: str, tiling: bool):
    config = train_config(tiny_family_model(name), tmp_path, tmp_path, {
        "model": {"family": name}, "sampling": {"vae_tiling": tiling}})
    family = get_family_class(name)(config)
    family.load()
    return family


@pytest.mark.parametrize("name", ["sd15", "sdxl", "wan"])
def test_a_tiled_sample_is_close_to_the_whole_decode(name, tiny_family_model, tmp_path, monkeypatch):
    from modules.sampling import vae_tiling

    monkeypatch.setattr(vae_tiling, "KL_TILE_PIXELS", 32)
    images, tiled_calls = {}, []
    for tiling in (False, True):
        family = _family(tiny_family_model, tmp_path, name, tiling)
        vae = family.parts["vae"]
        if hasattr(vae, "tile_sample_min_height"):  # Wan: its class's own tiles, made small for a tiny sample
            vae.tile_sample_min_height = vae.tile_sample_min_width = 32
            vae.tile_sample_stride_height = vae.tile_sample_stride_width = 16
        original = vae.tiled_decode
        monkeypatch.setattr(vae, "tiled_decode", lambda *a, **k: (tiled_calls.append(tiling), original(*a, **k))[1])
        images[tiling] = np.asarray(family.sample(PROMPT, torch.device("cpu")), dtype=np.float32)
        assert vae.use_tiling is False  # off again after the sample
    assert tiled_calls and set(tiled_calls) == {True}  # the tiled path ran, and only with tiling on
    difference = float(np.abs(images[True] - images[False]).mean())
    print(name, "mean pixel difference tiled/whole", round(difference, 2))
    assert difference < TOLERANCE
    assert images[True].std() > 1.0  # an image, not a flat colour


def test_the_kl_tile_is_512_pixels_and_restored(tiny_family_model, tmp_path):
    """SDXL's VAE tiles at its sample_size (1024 px), which never tiles a 1024 px sample: inside the
    block the tile is 512 px (64 latents at SDXL's 8x); after it, what it was."""
    from modules.sampling.vae_tiling import tiled_decoding

    vae = _family(tiny_family_model, tmp_path, "sdxl", True).parts["vae"]
    before = (vae.tile_sample_min_size, vae.tile_latent_min_size)
    downscale = 2 ** (len(vae.config.block_out_channels) - 1)
    with tiled_decoding([vae], True):
        assert vae.use_tiling and vae.tile_sample_min_size == 512
        assert vae.tile_latent_min_size == 512 // downscale
    assert (vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size) == (False, *before)


def test_the_plan_tiles_the_pipelines_own_encode_too(tiny_family_model, shape_images, tmp_path, monkeypatch):
    """The sampler's switch holds for the whole pipeline, so an image-to-video prompt's image is
    encoded tiled in the run (diffusers' use_tiling covers encode): the plan's sampling phase encodes
    it inside the same switch. Tiny Wan 2.1 I2V at a 64 px sample, in 32 px tiles."""
    from diffusers import AutoencoderKLWan

    from modules.plan.run_plan import plan_run

    enable, original, tiled = AutoencoderKLWan.enable_tiling, AutoencoderKLWan.tiled_encode, []
    monkeypatch.setattr(AutoencoderKLWan, "enable_tiling", lambda self: enable(self, 32, 32, 16, 16))
    monkeypatch.setattr(AutoencoderKLWan, "tiled_encode", lambda self, *a, **k: (tiled.append(1), original(self, *a, **k))[1])
    for tiling in (False, True):
        config = train_config(tiny_family_model("wan_i2v"), shape_images, tmp_path, {
            "model": {"family": "wan_i2v"}, "sampling": {"vae_tiling": tiling, "prompts": [
                {"prompt": "a red circle", "steps": 2, "width": 64, "height": 64, "frames": 5}]}})
        plan_run(config, None, None)
        assert bool(tiled) is tiling
