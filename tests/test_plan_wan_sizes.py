"""The planner's sizes of Wan's parts: a built-in preset is planned on the released model it is
made for (Wan 2.1 comes as a 1.3B and a 14B: the preset's name says which; the 720P presets are
the 14B's, T2V and I2V, whose 480P and 720P checkpoints share one architecture; an FLF2V preset is
planned on the FLF2V transformer), and UMT5's tied
`shared` / `encoder.embed_tokens` embedding is one tensor in the plan as it is in a loaded model."""

from __future__ import annotations

import pytest

from modules.config.families import get_family_class
from modules.config.train_config import TrainConfig
from modules.offload.layer_tensors import block_bytes
from modules.plan.architecture import build_architecture, released_config

DENSE = {"text_encoder": "bfloat16", "transformer": "bfloat16", "vae": "bfloat16"}


def _transformer_parameters(preset: str) -> int:
    """The planned transformer's parameters (only that part built on meta, as build_architecture
    builds it from the released config of the preset's variant)."""
    from diffusers import WanTransformer3DModel

    from modules.loading.streamed_load import empty_model
    from tools.preset_plans import preset_config

    config = preset_config(preset)
    family_class = get_family_class(config.model.family)
    planned = released_config(config, family_class.released_variant(preset))
    folder = family_class(planned, DENSE).part_folder("transformer")
    return sum(p.numel() for p in empty_model(WanTransformer3DModel, folder, "transformer").parameters())


@pytest.mark.parametrize("preset, parameters", [("Wan 2.1 14B LoRA 24GB", 14_288_491_584),
                                                ("Wan 2.1 14B 720P LoRA 24GB", 14_288_491_584),
                                                ("Wan 2.1 1.3B LoRA 8GB", 1_418_996_800),
                                                ("Wan 2.1 I2V 14B 720P LoRA 24GB", 16_394_878_784),
                                                # the I2V 14B's plus FLF2V's image positions, (1, 514, 1280)
                                                ("Wan 2.1 FLF2V 14B 720P LoRA 24GB", 16_394_878_784 + 514 * 1280)])
def test_a_wan_preset_is_planned_on_the_transformer_its_name_says(preset, parameters):
    # (resources/model_configs/wan/SOURCES.md: the 1.3B's transformer/ and the 14B's transformer_14b/)
    assert _transformer_parameters(preset) == parameters


@pytest.mark.parametrize("mode", ["float8", "bfloat16"])
def test_a_tied_embedding_is_planned_once_as_it_loads(tiny_family_model, mode):
    config = TrainConfig.model_validate({"model": {"family": "wan", "base": str(tiny_family_model("wan"))},
                                         "train_dtype": "bfloat16"})
    modes = {**DENSE, "text_encoder": mode}
    planned = build_architecture(config, modes).family.parts["text_encoder"]
    loaded_family = get_family_class("wan")(config, modes)
    loaded_family.load()
    loaded = loaded_family.parts["text_encoder"]
    assert loaded.shared.weight is loaded.encoder.embed_tokens.weight
    assert planned.shared.weight is planned.encoder.embed_tokens.weight
    assert block_bytes(planned) == block_bytes(loaded)
    # (the embedding once: the encoder's embed_tokens is the shared one)
    assert block_bytes(loaded) == block_bytes(loaded.encoder) + block_bytes(loaded.shared) - block_bytes(
        loaded.encoder.embed_tokens)
