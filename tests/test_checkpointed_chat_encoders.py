"""A chat-model text encoder with its layers checkpointed recomputes each layer in the backward pass
(a trained encoder, or an embedding run that checkpoints it): its forward must not keep a KV cache,
or the recompute appends to the cache a second time and fails. Every family whose text encoder is a
decoder LLM passes `use_cache=False` (Z-Image's and Qwen-Image's are covered in test_plan_text_in_step)."""

from __future__ import annotations

import pytest
from conftest import train_config

from modules.config.families import get_family_class
from modules.offload.checkpointing import checkpoint_blocks_


@pytest.mark.parametrize("name", ["anima", "krea2", "qwen_image_edit", "fibo2", "flux2"])
def test_a_checkpointed_chat_encoder_runs_its_backward(name, tiny_family_model, shape_images, tmp_path):
    family = get_family_class(name)(train_config(tiny_family_model(name), shape_images, tmp_path,
                                                 {"model": {"family": name}}))
    family.load()
    encoder = family.parts["text_encoder"]
    checkpoint_blocks_(family.checkpoint_blocks("text_encoder"))
    table = encoder.get_input_embeddings().weight
    table.requires_grad_(True)  # as an embedding run's gradient reaches its new rows through the encoder
    text = family.encode_text(family.tokenize(["a red circle"]))
    sum(v.float().sum() for v in text.values() if v.is_floating_point()).backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
