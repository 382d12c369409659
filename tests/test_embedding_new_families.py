"""Textual-inversion embeddings for Anima (Qwen3 0.6B), FIBO-2 and Krea-2 (Qwen3-VL-4B's language
model) and FIBO Edit (SmolLM3): on each tiny model the embedding trains (the loss on its caption
falls), its placeholder reaches the encoder (the trained vector changes the encoding, a caption
without it encodes as before), the file holds the key the family's consumers read (ComfyUI's
`qwen3_06b` for Anima, `qwen3vl_4b` for Krea-2; FIBO has no ComfyUI model: `qwen3vl_4b` for the same
language model in FIBO-2, `smollm3_3b` for FIBO Edit), and the file reloads to equal encodings and
sample conditioning."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import fixed_loss, train_config
from safetensors.torch import load_file

from modules.config.errors import ConfigError
from modules.config.families import get_family_class
from modules.methods.embedding import EmbeddingMethod
from modules.model.components.embedding_tokens import token_embedding
from modules.trainer.generic_trainer import GenericTrainer

PLACEHOLDER = "<shape>"
PROMPT = f"a {PLACEHOLDER} circle"
KEYS = {"anima": "qwen3_06b", "fibo2": "qwen3vl_4b", "fibo_edit": "smollm3_3b", "krea2": "qwen3vl_4b"}


def overlay(images, **embedding) -> dict:
    return {"embeddings": [{"placeholder": PLACEHOLDER, "init_text": "ab", "vectors": 2, **embedding}],
            "concepts": [{"path": str(images), "captions": {"prefix": f"{PLACEHOLDER} "}}]}


@torch.no_grad()
def encoded(family, method, prompt: str) -> dict[str, torch.Tensor]:
    """The prompt's conditioning in eval mode, leaving each part's mode as it was."""
    modes = {part: family.parts[part].training for part in family.text_parts}
    for part in family.text_parts:
        family.parts[part].eval()
    try:
        return family.encode_text(family.tokenize(method.expand_captions([prompt])))
    finally:
        for part, mode in modes.items():
            family.parts[part].train(mode)


def frozen_method(family, config) -> EmbeddingMethod:
    method = EmbeddingMethod(SimpleNamespace(config=config, family=family, device=torch.device("cpu"), step=0))
    method.setup()
    return method


def training_run(family_name, model, images, workspace):
    """An embedding of 2 vectors trained alone for 8 steps on one image; the table, the encodings and
    the loss (at fixed draws) from before training."""
    config = train_config(model, images, workspace, {"model": {"family": family_name}, "method": {"type": "embedding"},
                                                     "schedule": {"epochs": 8, "batch_size": 1},
                                                     "optimizer": {"lr": 5e-2}}, overlay(images))
    trainer = GenericTrainer(config)
    trainer.start()
    family, method = trainer.family, trainer.methods[0]
    before = SimpleNamespace(table=token_embedding(family.parts["text_encoder"]).weight.detach().clone(),
                             with_token=encoded(family, method, PROMPT), without=encoded(family, method, "a red circle"),
                             loss=fixed_loss(trainer, draws=4))
    trainer.train()
    loss = fixed_loss(trainer, draws=4)
    path = trainer.end()
    return SimpleNamespace(trainer=trainer, family=family, method=method, path=path, before=before, loss=loss)


@pytest.fixture(scope="module", params=list(KEYS))
def run(request, tiny_family_model, one_image, tmp_path_factory):
    family_name = request.param
    model = tiny_family_model(family_name)
    trained = training_run(family_name, model, one_image, tmp_path_factory.mktemp(f"{family_name}-embedding"))
    # the saved file, used frozen in a freshly loaded model
    config = train_config(model, one_image, tmp_path_factory.mktemp(f"{family_name}-reload"),
                          {"model": {"family": family_name}}, overlay(one_image, train=False, path=str(trained.path)))
    fresh = get_family_class(family_name)(config)
    fresh.load()
    return SimpleNamespace(**vars(trained), name=family_name, fresh=fresh, fresh_method=frozen_method(fresh, config))


def test_the_embedding_trains_and_the_loss_falls(run):
    assert run.loss < run.before.loss, (run.before.loss, run.loss)
    assert torch.equal(token_embedding(run.family.parts["text_encoder"]).weight, run.before.table)  # never written


def test_the_placeholder_reaches_the_encoder(run):
    """Both of its tokens are in the encoder's input; the trained vectors change the encoding of a
    caption with the placeholder and leave one without it as it was."""
    family, method = run.family, run.method
    first = family.tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    assert (family.tokenize(method.expand_captions([PROMPT]))["input_ids"] >= first).sum() == 2
    after = encoded(family, method, PROMPT)
    key = next(iter(after))  # the conditioning the denoiser reads
    assert not torch.allclose(after[key], run.before.with_token[key])
    assert all(torch.equal(v, run.before.without[k]) for k, v in encoded(family, method, "a red circle").items())


def test_the_file_holds_the_consumers_key_and_reloads_to_the_same_encodings(run):
    width = run.before.table.shape[1]
    assert {k: tuple(v.shape) for k, v in load_file(str(run.path)).items()} == {KEYS[run.name]: (2, width)}
    ours = encoded(run.family, run.method, PROMPT)
    reloaded = encoded(run.fresh, run.fresh_method, PROMPT)
    for key in ours:
        torch.testing.assert_close(reloaded[key], ours[key], atol=1e-6, rtol=0)


@torch.no_grad()
def sampled_text(family, prompt: str) -> torch.Tensor:
    """The text conditioning run_sampling_pipeline hands the transformer for `prompt` (its first call)."""
    from modules.config.train_config import SamplePromptConfig

    if family.name == "krea2":
        return family._prompt_conditioning(prompt, torch.device("cpu"))[0]
    if family.name == "fibo2":
        return family._prompt_embeds(prompt, torch.device("cpu"))
    seen = []  # Anima's and FIBO Edit's pipelines encode the prompt themselves
    handle = family.transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(kwargs["encoder_hidden_states"]), with_kwargs=True)
    try:
        family.run_sampling_pipeline(SamplePromptConfig(prompt=prompt, steps=1, cfg=1.0, width=32, height=32),
                                     torch.device("cpu"))
    finally:
        handle.remove()
    return seen[0]


def test_a_sample_prompt_is_conditioned_as_training_encodes_it(run):
    """The placeholder in a sample prompt is written out and encoded as in training's captions."""
    family = run.fresh
    ours = encoded(family, run.fresh_method, PROMPT)
    sampled = sampled_text(family, PROMPT)
    if family.name == "fibo2":  # the pipeline takes one prompt's real tokens
        expected = ours["hidden_states"][:, :, :int(ours["attention_mask"].sum())]
    elif family.name == "fibo_edit":  # the joint text: the last two hidden states of the real tokens
        real = int(ours["attention_mask"].sum())
        expected = torch.cat([ours["hidden_states"][:, -1], ours["hidden_states"][:, -2]], dim=-1)[:, :real]
        sampled = sampled[:, :real]
    else:
        expected = next(iter(ours.values()))
    torch.testing.assert_close(sampled, expected, atol=1e-5, rtol=0)


def embedded_family(family_name, tiny_family_model, images, workspace, placeholder=PLACEHOLDER):
    """A freshly loaded tiny model with an untrained 2-vector embedding set up (as a run sets it up)."""
    config = train_config(tiny_family_model(family_name), images, workspace, {"model": {"family": family_name}},
                          {"embeddings": [{"placeholder": placeholder, "init_text": "ab", "vectors": 2}]})
    family = get_family_class(family_name)(config)
    family.load()
    return family, frozen_method(family, config)


def test_a_fibo2_placeholder_survives_the_json_caption_cleaning(tiny_family_model, shape_images, tmp_path):
    """A JSON caption is cleaned (empty values and scores dropped) and reserialized as the pipeline does;
    the placeholder inside one of its values reaches Qwen3-VL as both its tokens, in training and in a
    sample prompt."""
    family, method = embedded_family("fibo2", tiny_family_model, shape_images, tmp_path)
    caption = json.dumps({"short_description": f"a {PLACEHOLDER} circle", "style_medium": "", "aesthetic_score": 7})
    first = family.tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    ids = family.tokenize(method.expand_captions([caption]))["input_ids"]
    assert (ids >= first).sum() == 2
    cleaned = json.dumps({"short_description": f"a {PLACEHOLDER} {PLACEHOLDER}_1 circle"}, separators=(",", ":"))
    assert torch.equal(ids, family._tokenize_as_given([cleaned])["input_ids"])
    ours = encoded(family, method, caption)
    sampled = sampled_text(family, caption)
    torch.testing.assert_close(sampled, ours["hidden_states"][:, :, :int(ours["attention_mask"].sum())],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("family_name, placeholder", [("fibo_edit", "<form-é>"), ("fibo2", '<say"so>')])
def test_a_placeholder_the_caption_handling_rewrites_is_refused(family_name, placeholder, tiny_family_model,
                                                                shape_images, tmp_path):
    """FIBO Edit puts a plain caption in a JSON object serialized ASCII-only, so `é` becomes `\\u00e9`;
    FIBO-2 reserializes a JSON caption, so a quote in a value comes back as `\\"`. Such a placeholder
    would never reach the encoder (and never train, unseen by the first-step guard)."""
    label = get_family_class(family_name).label
    with pytest.raises(ConfigError, match=rf"embeddings\[0\]\.placeholder '{placeholder}': the {label} caption"):
        embedded_family(family_name, tiny_family_model, shape_images, tmp_path, placeholder=placeholder)


def test_anima_reads_an_embedding_token_as_one_t5_pad_id_as_comfyui_does(tiny_family_model, shape_images, tmp_path):
    """The LLM adapter's T5 queries: ComfyUI's Anima tokenizer gives an embedding's vectors on its T5
    side too, and AnimaTEModel turns each into the T5 pad id; the text around it is tokenized apart.
    A caption without a placeholder is the tokenizer's own, as the pipeline's."""
    family, method = embedded_family("anima", tiny_family_model, shape_images, tmp_path)
    t5 = family.t5_tokenizer
    tokens = family.tokenize(method.expand_captions([PROMPT]))
    words = [t5(word, add_special_tokens=False).input_ids for word in ("a", "circle")]
    expected = words[0] + [t5.pad_token_id] * 2 + words[1] + [t5.eos_token_id]
    assert tokens["t5_input_ids"][0, :len(expected)].tolist() == expected
    assert tokens["t5_attention_mask"][0].sum() == len(expected)
    plain = family.tokenize(["a red circle"])["t5_input_ids"]
    assert torch.equal(plain, t5(["a red circle"], padding="max_length", max_length=family.max_sequence_length,
                                 truncation=True, return_tensors="pt").input_ids)
