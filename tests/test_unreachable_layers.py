"""Layers whose output never reaches the loss get no adapter: SDXL reads CLIP-L at
hidden_states[-2] and Z-Image reads Qwen3 there, so their last text-encoder block is left out (and
the run says so); FLUX reads both encoders' last outputs, so nothing is. With every text encoder
trained, each family trains to the end under the unchanged first-step guard."""

from __future__ import annotations

import importlib

import pytest
from conftest import train_config
from safetensors import safe_open

from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer

FAMILIES = {  # family -> (module, class, text parts, the part whose last block is left out, or None)
    "sdxl": ("modules.model.sdxl", "SDXLFamily", ["text_encoder", "text_encoder_2"], "text_encoder"),
    "flux": ("modules.model.flux", "FluxFamily", ["text_encoder", "text_encoder_2"], None),
    "z_image": ("modules.model.z_image", "ZImageFamily", ["text_encoder"], "text_encoder"),
    # the tiny Krea-2 taps hidden states 1 and 2 of its three layers (the released one 2..35 of 36)
    "krea2": ("modules.model.krea2", "Krea2Family", ["text_encoder"], "text_encoder"),
    "anima": ("modules.model.anima", "AnimaFamily", ["text_encoder"], None),
}


class Warnings(TrainCallbacks):
    def __init__(self):
        self.messages = []

    def on_warning(self, message):
        self.messages.append(message)


@pytest.mark.parametrize("name", FAMILIES)
def test_training_every_text_encoder_runs_to_the_end(tmp_path, one_image, name):
    module, cls, text_parts, left_out = FAMILIES[name]
    family_class = getattr(importlib.import_module(module), cls)
    model = family_class.make_tiny_model(tmp_path / "model")
    parts = {part: {"train": True} for part in text_parts}
    config = train_config(model, one_image, tmp_path, {
        "model": {"family": name, "parts": parts}, "adapter": {"layer_preset": "attn-mlp"},
        "schedule": {"epochs": 2, "batch_size": 1},
    })
    warnings = Warnings()
    trainer = GenericTrainer(config, callbacks=warnings)
    trainer.start()
    trainer.train()  # the first step's guard: every adapter got a gradient and changed
    path = trainer.end()
    assert trainer.step == 2
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
    said = [m for m in warnings.messages if m.startswith("adapter: no adapters on")]
    if left_out is None:
        assert not trainer.adapters.left_out and not said
        return
    part, last = left_out, len(trainer.family.checkpoint_blocks(left_out)) - 1
    names = list(trainer.adapters.left_out)
    assert names and all(n.startswith(part + ".") and f".layers.{last}." in n for n in names), names
    block = names[0].removeprefix(part + ".").split(f"layers.{last}.")[0] + "layers"
    assert len(said) == 1 and f"{part}.{block}.{last}" in said[0], warnings.messages
    # the block before it does carry adapters, the left-out one none
    family = trainer.family

    def stem(layer: str) -> str:  # a block's key prefix in the saved (kohya) file
        path = family.comfy_text_encoder_stem(part, layer)  # ComfyUI's own path for LLM encoders
        return path + "." if path else family.adapter_name(part, layer) + "_"

    assert not any(k.startswith(stem(f"{block}.{last}")) for k in keys)
    assert any(k.startswith(stem(f"{block}.{last - 1}")) for k in keys)
