"""Textual-inversion embeddings (modules/methods/embedding.py): only the new tokens' vectors train
(the embedding table stays bit-identical), the trained token changes the text encoder's output for
prompts that use it and no other, the saved file loads in diffusers' `load_textual_inversion` with
the same text-encoder output as the trainer's (and as the sampling pipeline's), LoRA + embedding in
one run saves both, and resume equals an uninterrupted run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.config.errors import ConfigError
from modules.methods.base import split_state
from modules.saving.backup import read_backup
from modules.trainer.commands import TrainCommands
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.callbacks import TrainCallbacks

PLACEHOLDER = "<shape>"


def embedding_overlay(images, **embedding) -> dict:
    return {"embeddings": [{"placeholder": PLACEHOLDER, "init_text": "ab", "vectors": 2, **embedding}],
            "concepts": [{"path": str(images), "captions": {"prefix": f"{PLACEHOLDER} "}}],
            "optimizer": {"lr": 5e-2}}


def encoded(trainer, prompt: str) -> dict[str, torch.Tensor]:
    family = trainer.family
    with torch.no_grad():
        return family.encode_text(family.tokenize([expand(trainer, prompt)]))


def expand(trainer, prompt: str) -> str:
    return trainer.captions(SimpleNamespace(captions=[prompt]))[0]


def test_embedding_trains_only_its_vectors_and_loads_in_diffusers(tmp_path, tiny_model, shape_images):
    from diffusers import StableDiffusionPipeline

    config = train_config(tiny_model, shape_images, tmp_path, {"method": {"type": "embedding"},
                                                               "schedule": {"max_steps": 2}},
                          embedding_overlay(shape_images))
    trainer = GenericTrainer(config)
    trainer.start()
    table = trainer.family.parts["text_encoder"].get_input_embeddings().weight
    table_before = table.detach().clone()
    with_token, without = encoded(trainer, f"a {PLACEHOLDER} circle"), encoded(trainer, "a red circle")
    assert expand(trainer, f"a {PLACEHOLDER}") == f"a {PLACEHOLDER} {PLACEHOLDER}_1"  # diffusers' multi-vector names
    trainer.train()
    path = trainer.end()

    assert path == config.output_path  # trained alone: the embedding is the output
    assert torch.equal(table, table_before) and not table.requires_grad  # the old rows never change
    assert not torch.equal(encoded(trainer, f"a {PLACEHOLDER} circle")["hidden_states"], with_token["hidden_states"])
    assert torch.equal(encoded(trainer, "a red circle")["hidden_states"], without["hidden_states"])
    saved = load_file(str(path))
    assert list(saved) == ["emb_params"] and saved["emb_params"].shape == (2, 32)  # A1111's SD1 layout

    ours = encoded(trainer, f"a {PLACEHOLDER} circle")["hidden_states"]
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None, requires_safety_checker=False)
    pipe.load_textual_inversion(str(path), token=PLACEHOLDER)
    theirs = pipe.encode_prompt(f"a {PLACEHOLDER} circle", "cpu", 1, False)[0]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    # samples: the trainer's own pipeline writes the placeholder out and reads the trained vectors
    with torch.no_grad():
        sampled = trainer.family.pipeline().encode_prompt(f"a {PLACEHOLDER} circle", "cpu", 1, False)[0]
    torch.testing.assert_close(sampled, ours, atol=1e-6, rtol=0)


def test_lora_and_sdxl_embedding_train_together_and_save_both(tmp_path, tiny_family_model, shape_images):
    from diffusers import StableDiffusionXLPipeline

    model = tiny_family_model("sdxl")
    config = train_config(model, shape_images, tmp_path, {"model": {"family": "sdxl"}, "schedule": {"max_steps": 2}},
                          embedding_overlay(shape_images, vectors=1, init_text="a"))
    trainer = GenericTrainer(config)
    trainer.start()
    assert [m.name for m in trainer.methods] == ["adapter", "embedding"]
    assert {g["name"] for g in trainer.optimizer.param_groups} == {"unet", f"embedding {PLACEHOLDER}"}
    trainer.train()
    # a backup holds both (the embedding under its prefix) and gives each method its own back
    weights = read_backup(trainer.backup())[0]
    assert {f"embedding.{PLACEHOLDER}.text_encoder", f"embedding.{PLACEHOLDER}.text_encoder_2"} < set(weights)
    adapter_state, embedding_state = split_state(trainer.methods, weights)
    assert adapter_state.keys() == trainer.adapters.state_dict().keys()
    trainer.methods[1].load_state_dict(embedding_state, "backup")
    path = trainer.end()

    lora = load_file(str(path))
    assert lora and all(k.startswith("lora_unet_") for k in lora)
    embedding_file = path.with_name(f"{path.stem}.shape.safetensors")
    saved = load_file(str(embedding_file))
    assert {k: tuple(v.shape) for k, v in saved.items()} == {"clip_l": (1, 32), "clip_g": (1, 32)}

    pipe = StableDiffusionXLPipeline.from_pretrained(str(model))
    pipe.load_textual_inversion(saved["clip_l"], token=PLACEHOLDER, text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(saved["clip_g"], token=PLACEHOLDER, text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    prompt = f"a {PLACEHOLDER} on a red background"
    theirs, _, pooled, _ = pipe.encode_prompt(prompt, device="cpu", num_images_per_prompt=1,
                                              do_classifier_free_guidance=False)
    ours = encoded(trainer, prompt)
    torch.testing.assert_close(theirs, ours["hidden_states"], atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, ours["pooled"], atol=1e-5, rtol=0)
    initial = pipe.text_encoder.get_input_embeddings().weight[pipe.tokenizer("a", add_special_tokens=False).input_ids]
    assert not torch.allclose(saved["clip_l"], initial)  # it trained, starting from "a"


class StopAt(TrainCallbacks):
    def __init__(self, step: int, commands: TrainCommands):
        self.step, self.commands = step, commands

    def on_progress(self, progress):
        if progress.step == self.step:
            self.commands.stop()


def test_resume_equals_an_uninterrupted_run(tmp_path, tiny_model, one_image):
    overlay = [{"method": {"type": "embedding"}, "schedule": {"epochs": 2, "batch_size": 1}},
               embedding_overlay(one_image)]
    straight = GenericTrainer(train_config(tiny_model, one_image, tmp_path / "a", *overlay))
    straight.start()
    straight.train()

    config = train_config(tiny_model, one_image, tmp_path / "b", *overlay)
    commands = TrainCommands()
    first = GenericTrainer(config, StopAt(1, commands), commands)
    first.start()
    first.train()  # stopped at step 1: writes a backup
    halfway = first.methods[0].state_dict()
    assert first.step == 1 and list(halfway) == [f"{PLACEHOLDER}.text_encoder"]
    resumed = GenericTrainer(config.model_copy(update={"backup": config.backup.model_copy(update={"resume": True})}))
    resumed.start()
    resumed.train()
    assert resumed.step == straight.step == 2
    expected, actual = straight.methods[0].state_dict(), resumed.methods[0].state_dict()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0)
        assert not torch.allclose(halfway[key], expected[key])  # the comparison is not vacuous


def test_a_family_without_embedding_slots_refuses_embeddings(tiny_model, shape_images, tmp_path):
    from modules.methods.embedding import EmbeddingMethod
    from modules.model.sd15 import SD15Family

    class NoEmbeddings(SD15Family):  # a family that declares no text encoder to take embeddings
        label = "No-embeddings"
        embedding_slots = {}

    config = train_config(tiny_model, shape_images, tmp_path, embedding_overlay(shape_images))
    trainer = SimpleNamespace(config=config, family=NoEmbeddings(config), device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"embeddings: the No-embeddings family takes no textual-inversion "
                                          r"embeddings here \(families that do: .*FLUX\.1.*Chroma"):
        EmbeddingMethod(trainer)


def test_bad_embeddings_are_refused_naming_the_field(tmp_path, tiny_model, shape_images):
    cases = [
        ({"method": {"type": "embedding"}, "embeddings": []}, r"embeddings: method.type is embedding"),
        ({"embeddings": [{"placeholder": "<Shape>"}]}, r"embeddings\[0\]\.placeholder: .*capitals"),
        ({"embeddings": [{"placeholder": "my shape"}]}, r"embeddings\[0\]\.placeholder: .*space"),
        ({"embeddings": [{"placeholder": "<x>", "train": False}]}, r"embeddings\[0\]\.path: .*from a file"),
        ({"embeddings": [{"placeholder": "<x>"}, {"placeholder": "<x>2"}]}, r"embeddings\[0\]\.placeholder: .*apart"),
    ]
    for overlay, message in cases:
        with pytest.raises(ConfigError, match=message):
            train_config(tiny_model, shape_images, tmp_path, overlay)


def test_a_placeholder_the_tokenizer_knows_or_a_long_init_text_is_refused(tmp_path):
    from transformers import CLIPTokenizer

    from modules.model.components.embedding_tokens import add_tokens, init_vectors
    from modules.model.tiny.clip_tokenizer import write_char_clip_tokenizer

    write_char_clip_tokenizer(tmp_path)
    tokenizer = CLIPTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="already has the token"):
        add_tokens(tokenizer, ["a", "a_1"], "embeddings[0].placeholder")
    table = torch.randn(len(tokenizer), 4)
    with pytest.raises(ValueError, match=r"embeddings\[0\]\.init_text: 'abc' is 3 tokens, more than"):
        init_vectors(tokenizer, table, "abc", 2, "embeddings[0].init_text")
    ids = tokenizer("ab", add_special_tokens=False).input_ids
    assert torch.equal(init_vectors(tokenizer, table, "ab", 3, "x"), table[[ids[0], ids[1], ids[0]]])


def test_a_placeholder_in_no_caption_or_a_missing_file_is_refused_before_the_model_loads(
        tmp_path, tiny_model, shape_images):
    from modules.errors import UserError

    config = train_config(tiny_model, shape_images, tmp_path, {"embeddings": [
        {"placeholder": PLACEHOLDER}, {"placeholder": "<gone>", "path": str(tmp_path / "gone.safetensors")}]})
    trainer = GenericTrainer(config)
    with pytest.raises(UserError) as error:
        trainer.start()
    assert f"embeddings[0].placeholder: '{PLACEHOLDER}' is in no caption" in str(error.value)
    assert "embeddings[1].path: " in str(error.value) and "gone.safetensors is not a file" in str(error.value)
    assert trainer.family is None  # nothing was loaded


def test_a_remote_run_sends_the_embedding_files(tmp_path, tiny_model, shape_images):
    from safetensors.torch import save_file

    from modules.remote.run import RemoteRun

    start = tmp_path / "style.safetensors"
    save_file({"emb_params": torch.zeros(1, 32)}, str(start))
    config = train_config(tiny_model, shape_images, tmp_path, embedding_overlay(shape_images, path=str(start)))
    pairs, data = RemoteRun(None, tmp_path / "ws", tmp_path / "out.safetensors", "/box")._plan(config, False)
    assert data["embeddings"][0]["path"] == "/box/data/embeddings/0-style.safetensors"
    assert (str(start), "data/embeddings/0-style.safetensors") in [(p, rel) for p, rel, _, _ in pairs]


def test_a_frozen_embedding_from_a_file_stands_for_its_vectors(tmp_path, tiny_model, shape_images):
    from safetensors.torch import save_file

    from modules.methods.embedding import EmbeddingMethod
    from modules.model.sd15 import SD15Family

    config = train_config(tiny_model, shape_images, tmp_path)
    family = SD15Family(config)
    family.load()
    table = family.parts["text_encoder"].get_input_embeddings().weight
    row = table[family.tokenizer("a", add_special_tokens=False).input_ids].detach()  # the word "a"
    save_file({"emb_params": torch.cat([row, row])}, str(tmp_path / "aa.safetensors"))
    config = train_config(tiny_model, shape_images, tmp_path, {"embeddings": [
        {"placeholder": PLACEHOLDER, "train": False, "path": str(tmp_path / "aa.safetensors")}]})
    trainer = SimpleNamespace(config=config, family=family, device=torch.device("cpu"), step=0)
    method = EmbeddingMethod(trainer)
    method.setup()
    assert method.trained_parts() == [] and method.named_parameters() == [] and not method.text_cache_allowed()
    trainer.captions = lambda batch: method.expand_captions(batch.captions)
    torch.testing.assert_close(encoded(trainer, f"x {PLACEHOLDER} y")["hidden_states"],
                               encoded(trainer, "x a a y")["hidden_states"], atol=1e-6, rtol=0)
    from modules.methods.embedding_files import read_embedding_file

    keys, dims = {"text_encoder": "emb_params"}, {"text_encoder": 16}
    with pytest.raises(ValueError, match=r"^embeddings\[0\]\.path: aa\.safetensors's emb_params is \[2, 32\], "
                                         r"the text_encoder takes \[vectors, 16\]"):
        read_embedding_file(tmp_path / "aa.safetensors", keys, dims, "embeddings[0].path")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"^embeddings\[0\]\.path: bad\.safetensors is not a readable"):
        read_embedding_file(tmp_path / "bad.safetensors", keys, dims, "embeddings[0].path")


def test_an_embedding_its_first_step_did_not_look_up_passes_the_first_step_guard(tmp_path, tiny_model, one_image):
    """Every caption dropped: the placeholder's vectors get a zero gradient and (no weight decay)
    rightly stay put, which the guard must not call "not learning"."""
    overlay = embedding_overlay(one_image)
    overlay["concepts"][0]["captions"]["caption_dropout"] = 1.0
    overlay["optimizer"]["weight_decay"] = 0.0
    config = train_config(tiny_model, one_image, tmp_path, {"method": {"type": "embedding"},
                                                            "schedule": {"max_steps": 1}}, overlay)
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    assert trainer.step == 1
    assert trainer.methods[0].guarded_parameters() == []  # nothing looked up, nothing held to the guard
    trainer.release()


def test_an_embedding_beside_a_fused_fine_tune_is_stepped_too(tmp_path, tiny_model, one_image):
    """The fine-tune steps its weights inside the backward pass; the trainer still steps the rest."""
    config = train_config(tiny_model, one_image, tmp_path, {"method": {"type": "fine_tune", "fused_backward": True},
                                                            "schedule": {"max_steps": 1}}, embedding_overlay(one_image))
    trainer = GenericTrainer(config)
    trainer.start()
    embedding = next(m for m in trainer.methods if m.name == "embedding")
    before = {name: p.detach().clone() for name, p in embedding.named_parameters()}
    trainer.train()  # the first-step guard also holds both methods' weights to having moved
    assert trainer.step == 1
    assert all(not torch.equal(p, before[name]) for name, p in embedding.named_parameters())
    trainer.release()
