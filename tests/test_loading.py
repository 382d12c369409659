"""Strict loading: a checkpoint whose keys do not fit the architecture is refused, never re-initialised."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file, save_file

from modules.loading.diffusers_folder import ModelLoadError
from modules.model.sd15 import SD15Family


def _rewrite(path, change):
    tensors = load_file(str(path))
    save_file(change(tensors), str(path), metadata={"format": "pt"})


def _family(tmp_path, model, shape_images):
    family = SD15Family(train_config(model, shape_images, tmp_path))
    family.load()
    return family


def test_loads_a_good_folder(tmp_path, tiny_model, shape_images):
    family = _family(tmp_path, tiny_model, shape_images)
    assert set(family.parts) == {"text_encoder", "unet", "vae"}
    assert all(not p.requires_grad for m in family.parts.values() for p in m.parameters())


def test_text_encoder_with_foreign_key_layout_is_refused(tmp_path, tiny_model, shape_images):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    # keys under a prefix the architecture does not have: loading them "successfully" would
    # leave every weight at its random initialisation
    _rewrite(model / "text_encoder" / "model.safetensors", lambda t: {f"transformer.{k}": v for k, v in t.items()})
    with pytest.raises(ModelLoadError) as error:
        _family(tmp_path, model, shape_images)
    message = str(error.value)
    assert "model.parts.text_encoder" in message and "CLIPTextModel" in message
    assert "missing keys: embeddings." in message and "unexpected keys: transformer." in message


def test_unet_missing_a_key_is_refused_naming_it(tmp_path, tiny_model, shape_images):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    _rewrite(model / "unet" / "diffusion_pytorch_model.safetensors",
             lambda t: {k: v for k, v in t.items() if k != "conv_in.bias"} | {"bogus.weight": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match=r"missing keys: conv_in\.bias.*unexpected keys: bogus\.weight"):
        _family(tmp_path, model, shape_images)


def test_missing_base_folder_names_the_config_path(tmp_path, tiny_model, shape_images):
    with pytest.raises(ModelLoadError, match=r"^model\.base: .*nowhere is not a folder"):
        _family(tmp_path, tmp_path / "nowhere", shape_images)


def test_part_path_override_is_used_and_named_when_wrong(tmp_path, tiny_model, shape_images):
    from modules.config.loading import build_config

    config = train_config(tiny_model, shape_images, tmp_path)
    data = config.model_dump(mode="json")
    data["model"]["parts"]["vae"]["path"] = str(tmp_path / "no-vae")
    family = SD15Family(build_config([data]))
    with pytest.raises(ModelLoadError, match=r"^model\.parts\.vae\.path: "):
        family.load()
