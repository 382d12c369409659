"""Textual-inversion embeddings on the edit families, trained on edit pairs: FLUX.1 Kontext (FLUX.1's
CLIP-L and T5), FIBO Edit (SmolLM3) and Qwen-Image-Edit / -Plus (Qwen2.5-VL, which reads the
instruction with the control images). On each tiny model an embedding trained alone moves its vectors (the loss finite, the
encoders' tables bit-identical), the file holds the keys ComfyUI reads (`clip_l` and `t5xxl` for
Kontext, as for FLUX.1; `qwen25_7b` for both Qwen edit models, ComfyUI's Qwen-Image text encoder;
FIBO Edit has no ComfyUI model: `smollm3_3b`, as test_embedding_new_families.py names it),
reloads to the same encodings, and a sample prompt's placeholder is encoded as training encodes it.
For the Qwen edit models, whose conditioning depends on the controls and so is encoded in the step
while an embedding trains, the step shows the VL encoder each sample's controls as the text cache
would."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.config.families import get_family_class
from modules.data.pairs import text_controls
from modules.data.synthetic_images import write_edit_pairs
from modules.methods.embedding import EmbeddingMethod
from modules.model.components.embedding_tokens import token_embedding
from modules.trainer.generic_trainer import GenericTrainer

PLACEHOLDER = "<shape>"
PROMPT = f"make the {PLACEHOLDER} red"
# family -> its file's keys, one per text encoder (the encoder part each is read into)
KEYS = {"flux_kontext": {"clip_l": "text_encoder", "t5xxl": "text_encoder_2"}, "fibo_edit": {"smollm3_3b": "text_encoder"},
        "qwen_image_edit": {"qwen25_7b": "text_encoder"}, "qwen_image_edit_plus": {"qwen25_7b": "text_encoder"}}


def overlay(pairs, **embedding) -> dict:
    return {"embeddings": [{"placeholder": PLACEHOLDER, "init_text": "ab", "vectors": 2, **embedding}],
            "concepts": [{"path": str(pairs), "controls": {"source": "folders"},
                          "captions": {"prefix": f"{PLACEHOLDER} "}}]}


@torch.no_grad()
def encoded(family, method, prompt: str, controls=None) -> dict[str, torch.Tensor]:
    """The prompt's conditioning (with these control images) in eval mode, leaving the modes as they were."""
    modes = {part: family.parts[part].training for part in family.text_parts}
    for part in family.text_parts:
        family.parts[part].eval()
    try:
        extra = {"controls": [controls]} if controls else {}
        return family.encode_text(family.tokenize(method.expand_captions([prompt]), **extra))
    finally:
        for part, mode in modes.items():
            family.parts[part].train(mode)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edit-pairs")
    write_edit_pairs(folder, count=2)
    return folder


@pytest.fixture(scope="module", params=list(KEYS))
def run(request, tiny_family_model, pairs, tmp_path_factory):
    """A 2-vector embedding trained alone for 2 steps on the pairs; its vectors and tables before; its
    file reloaded, frozen, into a freshly loaded model."""
    name = request.param
    model = tiny_family_model(name, **({"variant": "2511"} if name == "qwen_image_edit_plus" else {}))
    config = train_config(model, pairs, tmp_path_factory.mktemp(f"{name}-embedding"),
                          {"model": {"family": name}, "method": {"type": "embedding"},
                           "schedule": {"epochs": 1, "batch_size": 1}, "optimizer": {"lr": 5e-2},
                           "data": {"flip": True}}, overlay(pairs))
    trainer = GenericTrainer(config)
    trainer.start()
    method, family = trainer.methods[0], trainer.family
    before = SimpleNamespace(vectors={p: v.detach().clone() for p, v in method.vectors[0].items()},
                             tables={p: token_embedding(family.parts[p]).weight.detach().clone()
                                     for p in method.slots})
    trainer.train()
    path = trainer.end()
    fresh_config = train_config(model, pairs, tmp_path_factory.mktemp(f"{name}-reload"), {"model": {"family": name}},
                                overlay(pairs, train=False, path=str(path)))
    fresh = get_family_class(name)(fresh_config)
    fresh.load()
    fresh_method = EmbeddingMethod(SimpleNamespace(config=fresh_config, family=fresh, device=torch.device("cpu"),
                                                   step=0))
    fresh_method.setup()
    return SimpleNamespace(name=name, trainer=trainer, method=method, path=path, before=before, fresh=fresh,
                           fresh_method=fresh_method)


def test_the_embedding_trains_on_pairs_and_the_tables_stay_as_they_were(run):
    trainer, method = run.trainer, run.method
    assert trainer.step == 2 and math.isfinite(trainer.last_loss)
    assert trainer.dataset.collate([0], trainer.device).controls is not None  # it trained on the pairs
    assert trainer.dataset.cache_stats["text"] == (0, 0)  # encoded in the step, never cached
    for part, vectors in method.vectors[0].items():
        assert not torch.equal(vectors.detach(), run.before.vectors[part]), part
        assert torch.equal(token_embedding(trainer.family.parts[part]).weight, run.before.tables[part]), part


def test_the_file_holds_comfyuis_keys_and_reloads_to_the_same_encodings(run):
    saved = load_file(str(run.path))
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        key: (2, run.before.tables[part].shape[1]) for key, part in KEYS[run.name].items()}
    for key, part in KEYS[run.name].items():
        torch.testing.assert_close(saved[key], run.method.vectors[0][part].detach())
    ours = encoded(run.trainer.family, run.method, PROMPT)
    reloaded = encoded(run.fresh, run.fresh_method, PROMPT)
    for key in ours:
        torch.testing.assert_close(reloaded[key], ours[key], atol=1e-6, rtol=0)


def test_the_step_shows_the_text_encoders_each_samples_controls_where_they_see_them(run):
    """The step's conditioning (the text not cached) is the caption encoded as the text cache would
    have encoded it: for the Qwen edit models with its sample's control images (mirrored with the
    target), the image block's tokens in front of the caption's; for Kontext and FIBO Edit the caption
    alone."""
    trainer = run.trainer
    family = trainer.family
    for part in family.text_parts:
        family.parts[part].eval()
    seen = set()
    # (data.flip: each draw mirrors a sample or not)
    for (index, entry), batch_index in itertools.product(enumerate(trainer.dataset.entries), range(4)):
        batch = trainer.dataset.collate([index], trainer.device, 0, batch_index)
        caption = trainer.captions(batch)
        flipped = not torch.equal(batch.latents, trainer.dataset.latents[entry.latent_key].unsqueeze(0))
        seen.add(flipped)
        with torch.no_grad():
            stepped = trainer.conditioning(batch)
            without = family.encode_text(family.tokenize(caption))
            expected = without
            if family.text_sees_controls:
                expected = family.encode_text(family.tokenize(caption, controls=[text_controls(entry, flipped)]))
                assert stepped["hidden_states"].shape[1] > without["hidden_states"].shape[1]  # the image block
        assert "control_latents" in stepped and set(expected) <= set(stepped)
        for key in expected:
            torch.testing.assert_close(stepped[key], expected[key], atol=1e-6, rtol=0)
    assert seen == {False, True}


def test_a_sample_prompt_is_conditioned_as_training_encodes_it(run, pairs):
    """Kontext: FluxKontextPipeline writes the placeholder out itself (maybe_convert_prompt), for both
    tokenizers; FIBO Edit and the Qwen edit models: the family writes it out (the Qwen ones with the
    prompt's control image)."""
    family, method = run.fresh, run.fresh_method
    for part in family.text_parts:
        family.parts[part].eval()
    if run.name == "flux_kontext":
        ours = encoded(family, method, PROMPT)
        with torch.no_grad():
            hidden, pooled, _ = family.pipeline().encode_prompt(PROMPT, None, device="cpu",
                                                                max_sequence_length=family.max_sequence_length)
        torch.testing.assert_close(hidden, ours["hidden_states"], atol=1e-6, rtol=0)
        torch.testing.assert_close(pooled, ours["pooled"], atol=1e-6, rtol=0)
        return
    if run.name == "fibo_edit":  # the joint text the transformer is handed: the last two hidden states
        from modules.config.train_config import SamplePromptConfig

        ours = encoded(family, method, PROMPT)
        real = int(ours["attention_mask"].sum())
        seen = []
        handle = family.transformer.register_forward_pre_hook(
            lambda _module, _args, kwargs: seen.append(kwargs["encoder_hidden_states"]), with_kwargs=True)
        try:
            family.run_sampling_pipeline(SamplePromptConfig(prompt=PROMPT, steps=1, cfg=1.0, width=32, height=32),
                                         torch.device("cpu"))
        finally:
            handle.remove()
        expected = torch.cat([ours["hidden_states"][:, -1], ours["hidden_states"][:, -2]], dim=-1)[:, :real]
        torch.testing.assert_close(seen[0][:, :real], expected, atol=1e-5, rtol=0)
        return
    from modules.model.qwen_image_edit import open_control

    control = open_control(sorted((pairs / "control").glob("*.png"))[0], 64, 64)
    ours = encoded(family, method, PROMPT, [control])
    with torch.no_grad():
        sampled = family._sample_text(PROMPT, [control], torch.device("cpu"))
    for key in ours:
        torch.testing.assert_close(sampled[key].float(), ours[key].float(), atol=1e-6, rtol=0)
