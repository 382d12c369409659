"""Textual-inversion embeddings on T5 (FLUX.1's CLIP-L + T5; Chroma's and SD3's T5 the same way),
Z-Image's Qwen3, and the chat-template Qwen encoders of FLUX.2 [klein] (Qwen3, hidden layers 9/18/27
stacked, padded to 512) and Qwen-Image (Qwen2.5-VL's language model, the template's first 34 tokens
dropped, padding masked): the T5 vectors train through a hook on the token embedding T5's forward runs, its table stays
bit-identical, the file holds ComfyUI's keys (`clip_l`, `t5xxl`), reloads to the same encodings, and
the placeholder works in sample prompts (FluxPipeline writes it out itself; for Chroma and
Z-Image, FLUX.2 and Qwen-Image the family writes it out). ComfyUI's keys for the Qwen encoders:
`qwen3_4b` (Z-Image, FLUX.2 klein 4B), `qwen3_8b` (klein 9B), `qwen25_7b` (Qwen-Image)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.config.errors import ConfigError
from modules.methods.embedding import EmbeddingMethod
from modules.model.components.embedding_tokens import token_embedding
from modules.config.families import get_family_class
from modules.trainer.generic_trainer import GenericTrainer

PLACEHOLDER = "<shape>"
PROMPT = f"a {PLACEHOLDER} circle"


def overlay(images, **embedding) -> dict:
    return {"embeddings": [{"placeholder": PLACEHOLDER, "init_text": "ab", "vectors": 2, **embedding}],
            "concepts": [{"path": str(images), "captions": {"prefix": f"{PLACEHOLDER} "}}],
            "optimizer": {"lr": 5e-2}}


@torch.no_grad()
def encoded(family, method, prompt: str) -> dict[str, torch.Tensor]:
    """The prompt's conditioning in eval mode (T5 has dropout), leaving each part's mode as it was."""
    modes = {part: family.parts[part].training for part in family.text_parts}
    for part in family.text_parts:
        family.parts[part].eval()
    try:
        return family.encode_text(family.tokenize(method.expand_captions([prompt])))
    finally:
        for part, mode in modes.items():
            family.parts[part].train(mode)


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, tiny_family_model, shape_images):
    """A FLUX.1 embedding trained alone for 2 steps; the T5 table and encodings from before."""
    model = tiny_family_model("flux")
    workspace = tmp_path_factory.mktemp("flux-embedding")
    config = train_config(model, shape_images, workspace, {"model": {"family": "flux"}, "method": {"type": "embedding"},
                                                           "schedule": {"max_steps": 2}}, overlay(shape_images))
    trainer = GenericTrainer(config)
    trainer.start()
    method = trainer.methods[0]
    t5 = trainer.family.parts["text_encoder_2"]
    before = SimpleNamespace(table=t5.encoder.embed_tokens.weight.detach().clone(),
                             with_token=encoded(trainer.family, method, PROMPT),
                             without=encoded(trainer.family, method, "a red circle"))
    trainer.train()
    path = trainer.end()
    return SimpleNamespace(trainer=trainer, method=method, path=path, before=before, model=model, config=config)


def test_a_flux_embedding_trains_in_clip_and_t5_and_saves_comfyui_keys(flux_run):
    trainer, method = flux_run.trainer, flux_run.method
    family = trainer.family
    t5 = family.parts["text_encoder_2"]
    assert trainer.dataset.cache_stats["text"] == (0, 0)  # no text cached while an embedding trains
    assert torch.equal(t5.encoder.embed_tokens.weight, flux_run.before.table)  # bit-identical, never trained
    assert not t5.encoder.embed_tokens.weight.requires_grad
    after = encoded(family, method, PROMPT)
    for key in ("hidden_states", "pooled"):  # T5's and CLIP's outputs both moved
        assert not torch.allclose(after[key], flux_run.before.with_token[key]), key
    without = encoded(family, method, "a red circle")
    assert all(torch.equal(without[k], flux_run.before.without[k]) for k in without)

    saved = load_file(str(flux_run.path))
    clip_width = family.parts["text_encoder"].get_input_embeddings().embedding_dim
    assert {k: tuple(v.shape) for k, v in saved.items()} == {"clip_l": (2, clip_width), "t5xxl": (2, 32)}


def test_the_t5_lookup_is_the_hook_on_the_embedding_the_forward_runs(flux_run):
    """T5 on the placeholder's ids equals T5 on embeddings whose placeholder rows are the trained
    vectors: without the hook on encoder.embed_tokens (transformers 5's `shared` is another module
    that never runs) the new ids would index past the table, or read untrained rows."""
    family, method = flux_run.trainer.family, flux_run.method
    t5 = family.parts["text_encoder_2"]
    ids = family.tokenize(method.expand_captions([PROMPT]))["input_ids_2"]
    first = family.tokenizer_2.convert_tokens_to_ids(PLACEHOLDER)
    vectors = load_file(str(flux_run.path))["t5xxl"]
    assert (ids >= first).sum() == 2  # both vectors of the placeholder are in the prompt
    table = t5.encoder.embed_tokens.weight.detach()
    rows = table[ids.clamp(max=table.shape[0] - 1)]
    rows[ids >= first] = vectors[(ids[ids >= first] - first)]
    with torch.no_grad():
        t5.eval()
        by_hook = t5(input_ids=ids)[0]
        by_hand = t5(inputs_embeds=rows)[0]
    torch.testing.assert_close(by_hook, by_hand, atol=1e-6, rtol=0)


def test_the_flux_file_reloads_to_the_same_encodings_and_samples_read_it(flux_run, shape_images, tmp_path):
    from modules.model.flux import FluxFamily

    config = train_config(flux_run.model, shape_images, tmp_path, {"model": {"family": "flux"}},
                          overlay(shape_images, train=False, path=str(flux_run.path)))
    family = FluxFamily(config)
    family.load()
    method = EmbeddingMethod(SimpleNamespace(config=config, family=family, device=torch.device("cpu"), step=0))
    method.setup()
    ours = encoded(flux_run.trainer.family, flux_run.method, PROMPT)
    reloaded = encoded(family, method, PROMPT)
    for key in ours:
        torch.testing.assert_close(reloaded[key], ours[key], atol=1e-6, rtol=0)
    # sample prompts: FluxPipeline writes the placeholder out for both tokenizers (maybe_convert_prompt)
    with torch.no_grad():
        hidden, pooled, _ = family.pipeline().encode_prompt(PROMPT, None, device="cpu",
                                                            max_sequence_length=family.max_sequence_length)
    torch.testing.assert_close(hidden, ours["hidden_states"], atol=1e-6, rtol=0)
    torch.testing.assert_close(pooled, ours["pooled"], atol=1e-6, rtol=0)


def test_diffusers_loads_the_flux_file_per_text_encoder_to_the_same_encodings(flux_run):
    """load_textual_inversion once per text encoder, as for SDXL: `clip_l` into CLIP, `t5xxl` into T5."""
    from diffusers import FluxPipeline

    saved = load_file(str(flux_run.path))
    pipe = FluxPipeline.from_pretrained(str(flux_run.model), local_files_only=True)
    pipe.load_textual_inversion(saved["clip_l"], token=PLACEHOLDER, text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(saved["t5xxl"], token=PLACEHOLDER, text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    family = flux_run.trainer.family
    with torch.no_grad():
        hidden, pooled, _ = pipe.encode_prompt(PROMPT, None, device="cpu",
                                               max_sequence_length=family.max_sequence_length)
    ours = encoded(family, flux_run.method, PROMPT)
    torch.testing.assert_close(hidden, ours["hidden_states"], atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, ours["pooled"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family_name, key", [("chroma", "t5xxl"), ("z_image", "qwen3_4b")])
def test_a_single_encoder_embedding_from_a_file_works_in_captions_and_sample_prompts(
        family_name, key, tiny_family_model, shape_images, tmp_path):
    """Chroma (T5 alone) and Z-Image (Qwen3): a file under ComfyUI's key stands for its vectors, and
    the sample prompt is written out as training writes captions out (Chroma's sampling encodes
    through the family, ZImagePipeline does not write placeholders out)."""
    from modules.methods.embedding_files import write_embedding_file
    from modules.model.components.embedding_tokens import init_vectors, token_embedding
    from modules.config.families import get_family_class

    model = tiny_family_model(family_name)
    config = train_config(model, shape_images, tmp_path, {"model": {"family": family_name}})
    family = get_family_class(family_name)(config)
    family.load()
    table = token_embedding(family.parts["text_encoder"]).weight
    vectors = init_vectors(family.tokenizer, table, "xy", 2, "test")
    path = write_embedding_file(tmp_path / "xy.safetensors", {"text_encoder": vectors}, {"text_encoder": key},
                                torch.float32, {})
    config = train_config(model, shape_images, tmp_path, {"model": {"family": family_name}},
                          overlay(shape_images, train=False, path=str(path)))
    method = EmbeddingMethod(SimpleNamespace(config=config, family=family, device=torch.device("cpu"), step=0))
    method.setup()
    assert family.written_out_prompt(PROMPT) == f"a {PLACEHOLDER} {PLACEHOLDER}_1 circle"
    assert family.written_out_prompt(family.written_out_prompt(PROMPT)) == family.written_out_prompt(PROMPT)
    trained = encoded(family, method, PROMPT)
    unexpanded = family.encode_text(family.tokenize([PROMPT]))["hidden_states"]  # one vector, not both
    assert not torch.allclose(unexpanded, trained["hidden_states"])
    with torch.no_grad():  # what run_sampling_pipeline hands the transformer for the prompt
        if family_name == "chroma":
            sampled, expected = family._prompt_conditioning(PROMPT, torch.device("cpu"))[0], trained["hidden_states"]
        else:
            sampled = family.pipeline().encode_prompt(family.written_out_prompt(PROMPT), "cpu", False,
                                                      max_sequence_length=family.max_sequence_length)[0][0]
            expected = trained["hidden_states"][0][trained["attention_mask"][0].bool()]
    torch.testing.assert_close(sampled, expected, atol=1e-6, rtol=0)


QWEN_KEYS = {"flux2": "qwen3_4b", "qwen_image": "qwen25_7b"}


def sampled_conditioning(family, prompt: str) -> torch.Tensor:
    """What run_sampling_pipeline hands the transformer for `prompt`."""
    with torch.no_grad():
        if family.name == "flux2":
            return family._prompt_embeds(prompt, torch.device("cpu"))
        return family._prompt_conditioning(prompt, torch.device("cpu"))[0]


def frozen_method(family, config) -> EmbeddingMethod:
    method = EmbeddingMethod(SimpleNamespace(config=config, family=family, device=torch.device("cpu"), step=0))
    method.setup()
    return method


@pytest.mark.parametrize("family_name", ["flux2", "qwen_image"])
def test_a_qwen_encoder_embedding_trains_saves_comfyui_keys_reloads_and_samples(
        family_name, tiny_family_model, shape_images, tmp_path):
    model = tiny_family_model(family_name)
    config = train_config(model, shape_images, tmp_path, {"model": {"family": family_name},
                                                         "method": {"type": "embedding"}, "schedule": {"max_steps": 2}},
                          overlay(shape_images))
    trainer = GenericTrainer(config)
    trainer.start()
    family, method = trainer.family, trainer.methods[0]
    table = token_embedding(family.parts["text_encoder"]).weight
    before_table = table.detach().clone()
    before, without = encoded(family, method, PROMPT), encoded(family, method, "a red circle")
    trainer.train()
    path = trainer.end()

    # the placeholder's tokens sit inside the caption part of the template, not cut off or dropped
    ids = family.tokenize(method.expand_captions([PROMPT]))
    first = family.tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    assert (ids["input_ids"] >= first).sum() == 2
    if family_name == "qwen_image":  # the 34 dropped tokens are still exactly the template's head
        real = ids["input_ids"][0][ids["attention_mask"][0].bool()]
        caption = family.tokenizer(method.expand_captions([PROMPT])[0], add_special_tokens=False).input_ids
        assert real[34:34 + len(caption)].tolist() == caption

    assert torch.equal(table, before_table)  # the table is never written
    after = encoded(family, method, PROMPT)
    assert not torch.allclose(after["hidden_states"], before["hidden_states"])
    assert all(torch.equal(v, without[k]) for k, v in encoded(family, method, "a red circle").items())

    width = table.shape[1]
    assert {k: tuple(v.shape) for k, v in load_file(str(path)).items()} == {QWEN_KEYS[family_name]: (2, width)}

    # reloaded frozen in a fresh model: the same encodings; a sample prompt is written out as captions are
    config = train_config(model, shape_images, tmp_path, {"model": {"family": family_name}},
                          overlay(shape_images, train=False, path=str(path)))
    fresh = get_family_class(family_name)(config)
    fresh.load()
    reloaded_method = frozen_method(fresh, config)
    reloaded = encoded(fresh, reloaded_method, PROMPT)
    for key in after:
        torch.testing.assert_close(reloaded[key], after[key], atol=1e-6, rtol=0)
    torch.testing.assert_close(sampled_conditioning(fresh, PROMPT), after["hidden_states"], atol=1e-6, rtol=0)


def test_flux2_files_use_comfyuis_key_for_the_encoders_size():
    from modules.model.flux2 import embedding_key

    assert (embedding_key(2560), embedding_key(4096)) == ("qwen3_4b", "qwen3_8b")


def test_a_placeholder_that_would_split_a_template_word_is_refused(tiny_family_model, shape_images, tmp_path):
    """`ser` is no token of the tiny tokenizer, but a new token `ser` would cut the template's `user`
    in two and shift every position after it."""
    model = tiny_family_model("flux2")
    config = train_config(model, shape_images, tmp_path, {"model": {"family": "flux2"}},
                          {"embeddings": [{"placeholder": "ser", "init_text": "a", "vectors": 1}]})
    family = get_family_class("flux2")(config)
    family.load()
    with pytest.raises(ConfigError, match=r"embeddings\[0\]\.placeholder 'ser'.*prompt template"):
        frozen_method(family, config)


def test_flux2_dev_refuses_embeddings_once_the_load_shows_it_is_dev(tiny_family_model, shape_images, tmp_path):
    """The config says flux2 (klein takes embeddings); only the loaded folder tells [dev] (Mistral) apart."""
    model = tiny_family_model("flux2", variant="dev")
    config = train_config(model, shape_images, tmp_path, {"model": {"family": "flux2"}},
                          {"embeddings": [{"placeholder": "<shape>", "init_text": "a", "vectors": 1}]})
    family = get_family_class("flux2")(config)
    # as the trainer does it: the method is built from the config, the model loads, then the setup
    method = EmbeddingMethod(SimpleNamespace(config=config, family=family, device=torch.device("cpu"), step=0))
    family.load()
    with pytest.raises(ConfigError, match=r"embeddings: this FLUX\.2 model .* takes no textual-inversion embeddings"):
        method.setup()
