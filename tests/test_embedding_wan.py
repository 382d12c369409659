"""Textual-inversion embeddings on the Wan families' UMT5 (Wan 2.1 T2V and I2V, Wan 2.2 A14B T2V and
I2V, Wan 2.2 TI2V 5B: one UMT5-XXL encoder in all five): on each tiny model an embedding trained
alone moves its vectors (the loss finite, UMT5's table bit-identical), the file holds ComfyUI's key
for its Wan text encoder (`umt5xxl`, its UMT5XXlTokenizer's embedding_key), reloads to the same
encodings, and a sample prompt's placeholder is encoded as training encodes a caption's."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.config.families import get_family_class
from modules.methods.embedding import EmbeddingMethod
from modules.model.components.embedding_tokens import token_embedding
from modules.trainer.generic_trainer import GenericTrainer

PLACEHOLDER = "<shape>"
PROMPT = f"a {PLACEHOLDER} circle"
WAN_FAMILIES = ["wan", "wan_i2v", "wan22", "wan22_i2v", "wan22_ti2v"]


def overlay(images, **embedding) -> dict:
    return {"embeddings": [{"placeholder": PLACEHOLDER, "init_text": "ab", "vectors": 2, **embedding}],
            "concepts": [{"path": str(images), "captions": {"prefix": f"{PLACEHOLDER} "}}]}


@torch.no_grad()
def encoded(family, method, prompt: str) -> dict[str, torch.Tensor]:
    """The prompt's conditioning in eval mode (UMT5 has dropout), leaving the encoder's mode as it was."""
    encoder = family.parts["text_encoder"]
    mode = encoder.training
    encoder.eval()
    try:
        return family.encode_text(family.tokenize(method.expand_captions([prompt])))
    finally:
        encoder.train(mode)


@pytest.fixture(scope="module", params=WAN_FAMILIES)
def run(request, tiny_family_model, one_image, tmp_path_factory):
    """A 2-vector embedding trained alone for 2 steps; its vectors before; its file reloaded, frozen,
    into a freshly loaded model."""
    name = request.param
    model = tiny_family_model(name)
    config = train_config(model, one_image, tmp_path_factory.mktemp(f"{name}-embedding"),
                          {"model": {"family": name}, "method": {"type": "embedding"},
                           "schedule": {"epochs": 2, "batch_size": 1}, "optimizer": {"lr": 5e-2}},
                          overlay(one_image))
    trainer = GenericTrainer(config)
    trainer.start()
    method = trainer.methods[0]
    before = SimpleNamespace(vectors=method.vectors[0]["text_encoder"].detach().clone(),
                             table=token_embedding(trainer.family.parts["text_encoder"]).weight.detach().clone())
    trainer.train()
    path = trainer.end()
    fresh_config = train_config(model, one_image, tmp_path_factory.mktemp(f"{name}-reload"), {"model": {"family": name}},
                                overlay(one_image, train=False, path=str(path)))
    fresh = get_family_class(name)(fresh_config)
    fresh.load()
    fresh_method = EmbeddingMethod(SimpleNamespace(config=fresh_config, family=fresh, device=torch.device("cpu"),
                                                   step=0))
    fresh_method.setup()
    return SimpleNamespace(trainer=trainer, method=method, path=path, before=before, fresh=fresh,
                           fresh_method=fresh_method)


def test_the_embedding_trains_and_umt5s_table_stays_as_it_was(run):
    trainer = run.trainer
    assert trainer.step == 2 and math.isfinite(trainer.last_loss)
    assert trainer.dataset.cache_stats["text"] == (0, 0)  # encoded in the step, never cached
    assert not torch.equal(run.method.vectors[0]["text_encoder"].detach(), run.before.vectors)
    assert torch.equal(token_embedding(trainer.family.parts["text_encoder"]).weight, run.before.table)


def test_the_file_holds_comfyuis_umt5_key_and_reloads_to_the_same_encodings(run):
    width = run.before.table.shape[1]
    saved = load_file(str(run.path))
    assert {k: tuple(v.shape) for k, v in saved.items()} == {"umt5xxl": (2, width)}
    torch.testing.assert_close(saved["umt5xxl"], run.method.vectors[0]["text_encoder"].detach())
    ours = encoded(run.trainer.family, run.method, PROMPT)["hidden_states"]
    reloaded = encoded(run.fresh, run.fresh_method, PROMPT)["hidden_states"]
    torch.testing.assert_close(reloaded, ours, atol=1e-6, rtol=0)
    plain = run.fresh.encode_text(run.fresh.tokenize([PROMPT]))["hidden_states"]  # the placeholder not written out
    assert not torch.allclose(plain, reloaded)


def test_a_sample_prompt_is_conditioned_as_training_encodes_it(run):
    """What sample_frames hands WanPipeline as prompt_embeds: the placeholder written out as both tokens."""
    family = run.fresh
    family.parts["text_encoder"].eval()
    with torch.no_grad():
        sampled = family._prompt_embeds(PROMPT, torch.device("cpu"))
    torch.testing.assert_close(sampled, encoded(family, run.fresh_method, PROMPT)["hidden_states"],
                               atol=1e-6, rtol=0)
