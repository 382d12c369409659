"""Bria FIBO Edit on a tiny offline model (SmolLM3 with SmolLM3's vocabulary, a byte-level tokenizer,
BriaFiboTransformer2DModel with joint and single blocks, the Wan 2.2 kind of VAE), trained on edit
pairs (tests/test_paired_data.py has the data side): the text and latent encodings are
BriaFiboEditPipeline's own, the references join the sequence on their RoPE time planes as the
pipeline puts them and the transformer's output is cut to the target, a different control changes
the prediction and the sample, the loss falls, the diffusers file loads in
`BriaFiboEditPipeline.load_lora_weights` with every adapter used and equal outputs, and the shared
checks (fp8 base, offloading half the transformer on the fake device, resume) hold."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    blocks_run_in_listed_order,
    initializes_and_steps,
    offloaded_training_matches,
    perturbed_adapters,
    resumed_training_matches,
)

from modules.adapters.formats.files import format_warnings, save_adapter_file
from modules.data.synthetic_images import write_edit_pairs

PAIRED = {"model": {"family": "fibo_edit"}}
INSTRUCTION = json.dumps({"edit_instruction": "make the circle red", "subject": "a circle"})


@pytest.fixture(scope="session")
def tiny_fibo_edit(tiny_family_model):
    return tiny_family_model("fibo_edit")  # the session's, shared with the preset and guard tests


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edit-pairs")
    write_edit_pairs(folder, count=2)
    return folder


def paired(folder) -> dict:
    return {**PAIRED, "concepts": [{"path": str(folder), "controls": {"source": "folders"}}]}


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_fibo_edit, shape_images):
    from modules.model.fibo_edit import FiboEditFamily

    family = FiboEditFamily(train_config(tiny_fibo_edit, shape_images, tmp_path_factory.mktemp("fibo-edit"), PAIRED))
    family.load()
    return family


@pytest.fixture(scope="module")
def pipe(tiny_fibo_edit):
    from diffusers import BriaFiboEditPipeline

    pipe = BriaFiboEditPipeline.from_pretrained(str(tiny_fibo_edit), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _controls(seed: int, count: int = 1) -> torch.Tensor:
    return torch.randn(1, count, 16, 4, 6, generator=torch.Generator().manual_seed(seed))


def test_edit_json_stays_as_given_and_other_text_becomes_the_edit_instruction():
    from modules.model.fibo_edit import edit_caption

    spaced = json.dumps({"edit_instruction": "make it red", "notes": ""}, indent=2)
    assert edit_caption(spaced) == spaced and edit_caption("") == ""  # the pipeline's prompt, not cleaned
    assert edit_caption("make the circle red") == '{"edit_instruction": "make the circle red"}'
    assert json.loads(edit_caption('{"short_description": "x"}')) == {"edit_instruction": '{"short_description": "x"}'}


def test_encodings_are_the_pipelines(family, pipe):
    """SmolLM3's last two hidden states side by side and every hidden state a block reads (real tokens;
    the family pads to a fixed window), the empty caption as the begin-of-text token, and latents
    normalised by the VAE's latents_mean / latents_std."""
    from PIL import Image

    for caption, theirs in ((INSTRUCTION, INSTRUCTION), ("", ""),
                            ("make the circle red", {"edit_instruction": "make the circle red"})):
        text = family.encode_text(family.tokenize([caption]))
        if isinstance(theirs, dict):  # as BriaFiboEditPipeline.__call__ turns a dict prompt into text
            theirs = json.dumps(theirs)
        with torch.no_grad():
            embeds, _, _, mask, _, layers, _ = pipe.encode_prompt([theirs], device=torch.device("cpu"),
                                                                  guidance_scale=1)
        real = int(mask[0].sum())
        assert int(text["attention_mask"][0].sum()) == real and (real == 1) == (caption == "")
        hidden = text["hidden_states"][:, :, :real]
        assert torch.allclose(torch.cat([hidden[:, -1], hidden[:, -2]], dim=-1), embeds, atol=1e-6)
        for kept, index in zip(hidden.unbind(1), family._kept_layers, strict=True):
            assert torch.allclose(kept, layers[index], atol=1e-6)
    image = Image.fromarray((torch.rand(64, 96, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    with torch.no_grad():
        theirs, ids = pipe.prepare_reference_latents(image, 16, torch.float32, torch.device("cpu"), reference_index=2)
        pixels = pipe.image_processor.preprocess(image, height=64, width=96)
        latents = family.encode_images(pixels)
        ours, our_ids = family._packed(latents, 2, torch.float32)
    assert latents.shape == (1, 16, 4, 6)
    assert torch.allclose(ours, theirs, atol=1e-6) and torch.equal(our_ids, ids)


def test_denoise_is_the_pipelines_transformer_call_and_predicts_the_target_alone(family, pipe):
    """The pipeline's inputs for one unpadded prompt (its layers fitted to the blocks) and two
    references after the target on planes 1 and 2: the family's padded window predicts the same,
    for the target's tokens only; a different control changes it."""
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    controls = _controls(2, count=2)
    text = family.encode_text(family.tokenize([INSTRUCTION]))
    with torch.no_grad():
        ours = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": controls})
        embeds, _, text_ids, _, _, layers, _ = pipe.encode_prompt(INSTRUCTION, device=torch.device("cpu"),
                                                                  guidance_scale=1.0)
        blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
        assert len(layers) > blocks  # the tiny encoder has more hidden states than blocks: the first dropped
        layers = layers[len(layers) - blocks:]
        tokens = [pipe._pack_latents_no_patch(latents, 1, 16, 4, 4)]
        ids = [pipe._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)]
        for plane in (1, 2):
            control = controls[:, plane - 1]
            tokens.append(pipe._pack_latents_no_patch(control, 1, 16, 4, 6))
            ids.append(pipe._prepare_latent_image_ids(1, 4, 6, "cpu", torch.float32))
            ids[-1][..., 0] = plane
        theirs = pipe.transformer(hidden_states=torch.cat(tokens, dim=1), timestep=torch.tensor([500.0]),
                                  encoder_hidden_states=embeds, text_encoder_layers=layers, txt_ids=text_ids[0],
                                  img_ids=torch.cat(ids, dim=0), return_dict=False)[0]
        other = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": _controls(3, count=2)})
        alone = family.denoise(latents, torch.tensor([0.5]), text)
    assert ours.shape == latents.shape and theirs.shape[1] == 16 + 2 * 24
    assert torch.allclose(ours, pipe._unpack_latents_no_patch(theirs[:, :16], 4, 4, 1), atol=1e-5)
    assert (ours - other).abs().max() > 1e-4 and (ours - alone).abs().max() > 1e-4


def test_a_transformer_taking_four_times_the_latent_channels_reads_2x2_patches(family, pipe):
    """As the pipeline's `do_patching=True`: the target's and the references' 2x2 patches (FLUX's
    packing), position ids per patch, the target's tokens unpacked back to latent cells."""
    from diffusers import BriaFiboTransformer2DModel

    torch.manual_seed(0)
    patched = BriaFiboTransformer2DModel(**{**family.transformer.config, "in_channels": 64}).eval()
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    control = _controls(2)[:, 0, :, :, :4]
    text = family.encode_text(family.tokenize([INSTRUCTION]))
    original = family.parts["transformer"]
    family.parts["transformer"] = patched
    try:
        assert family.patching and family.sequence_length(latents) == 4
        with torch.no_grad():
            ours = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": control[:, None]})
    finally:
        family.parts["transformer"] = original
    with torch.no_grad():
        embeds, _, text_ids, _, _, layers, _ = pipe.encode_prompt(INSTRUCTION, device=torch.device("cpu"),
                                                                  guidance_scale=1.0)
        ids = [pipe._prepare_latent_image_ids(1, 2, 2, "cpu", torch.float32) for _ in range(2)]
        ids[1][..., 0] = 1
        tokens = torch.cat([pipe._pack_latents(latents, 1, 16, 4, 4), pipe._pack_latents(control, 1, 16, 4, 4)], dim=1)
        theirs = patched(hidden_states=tokens, timestep=torch.tensor([500.0]), encoder_hidden_states=embeds,
                         text_encoder_layers=layers[len(layers) - 3:], txt_ids=text_ids[0], img_ids=torch.cat(ids),
                         return_dict=False)[0]
    assert torch.allclose(ours, pipe._unpack_latents(theirs[:, :4], 4, 4, 1), atol=1e-5)


def test_a_sample_is_the_pipelines_own_edit_and_another_control_changes_it(family, pipe, pairs):
    from modules.config.train_config import SamplePromptConfig
    from modules.util.torch_utils import make_generator

    first, second = sorted(str(p) for p in (pairs / "control").glob("*.png"))

    def sample(controls, prompt=INSTRUCTION):
        config = SamplePromptConfig(prompt=prompt, steps=2, cfg=3.0, width=64, height=64, seed=3,
                                    control_images=controls)
        return family.sample(config, torch.device("cpu"))

    ours = sample([first])
    from PIL import Image

    theirs = pipe(prompt=INSTRUCTION, image=[Image.open(first).convert("RGB")], num_inference_steps=2,
                  guidance_scale=3.0, width=64, height=64, generator=make_generator(torch.device("cpu"), 3),
                  max_sequence_length=family.max_sequence_length).images[0]
    assert ours.size == (64, 64) and ours.tobytes() == theirs.tobytes()
    assert ours.tobytes() != sample([second]).tobytes() and ours.tobytes() != sample([]).tobytes()
    # a plain instruction samples as its edit object (the pipeline refuses plain text)
    plain = sample([first], prompt="make the circle red").tobytes()
    assert plain == sample([first], prompt=json.dumps({"edit_instruction": "make the circle red"})).tobytes()


def test_fibo_edit_trains_a_lora_on_pairs_and_the_loss_falls(tmp_path, tiny_fibo_edit, pairs):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_fibo_edit, pairs, tmp_path, paired(pairs), {
        "model": {"parts": {"transformer": {"gradient_checkpointing": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 15, "batch_size": 1},
        "optimizer": {"lr": 3e-3}, "output": {"format": "diffusers"}})
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).controls.shape == (1, 1, 16, 4, 4)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = set(file.keys())
        assert file.metadata()["modelspec.architecture"] == "bria-fibo-edit/lora"
    for stem in ("transformer.transformer_blocks.0.attn.add_q_proj", "transformer.single_transformer_blocks.1.proj_mlp",
                 "transformer.caption_projection.0.linear", "transformer.proj_out"):
        assert f"{stem}.lora_A.weight" in keys, stem


def test_resume_on_pairs_training_smollm3_too_equals_an_uninterrupted_run(tmp_path, tiny_fibo_edit, pairs):
    """With every Linear layer of the text encoder trained but its head (no adapter: its logits are never
    read), each run's first-step guard checks every adapter, SmolLM3's too, learned."""
    resumed_training_matches(tiny_fibo_edit, pairs, tmp_path, "fibo_edit", {
        **paired(pairs), "model": {"family": "fibo_edit", "parts": {"text_encoder": {"train": True}}},
        "adapter": {"layer_preset": "all-linear"}})


def test_offloading_half_the_transformer_trains_the_same_adapter_on_pairs(fake_device, tmp_path, tiny_fibo_edit,
                                                                          pairs):
    offloaded_training_matches(tiny_fibo_edit, pairs, tmp_path, "fibo_edit", "transformer", fake_device, paired(pairs))


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_a_quantized_transformer_trains_on_pairs(tmp_path, tiny_fibo_edit, pairs, mode):
    initializes_and_steps(tiny_fibo_edit, pairs, tmp_path, "fibo_edit", "transformer", mode, False, paired(pairs))


def test_load_lora_weights_loads_every_adapter_and_matches_the_hooked_model(family, tiny_fibo_edit, tmp_path):
    from diffusers import BriaFiboEditPipeline

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))

    def prediction(transformer, text_encoder):
        originals = family.parts["transformer"], family.parts["text_encoder"]
        family.parts["transformer"], family.parts["text_encoder"] = transformer, text_encoder
        try:
            with torch.no_grad():
                text = family.encode_text(family.tokenize([INSTRUCTION]))
                return family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": _controls(5)})
        finally:
            family.parts["transformer"], family.parts["text_encoder"] = originals

    try:
        path = tmp_path / "fibo_edit.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        assert format_warnings("diffusers", adapters, family) == []
        ours = prediction(family.transformer, family.parts["text_encoder"])
        hooked = {part: sum(1 for p in adapters.part_of.values() if p == part)
                  for part in ("transformer", "text_encoder")}
        pipe = BriaFiboEditPipeline.from_pretrained(str(tiny_fibo_edit), local_files_only=True)
        pipe.load_lora_weights(str(path))
        loaded = {"transformer": sum(hasattr(m, "lora_A") for m in pipe.transformer.modules()),
                  "text_encoder": sum(hasattr(m, "lora_A") for m in pipe.text_encoder.modules())}
        assert loaded == hooked and hooked["text_encoder"] > 0  # no key dropped
        theirs = prediction(pipe.transformer, pipe.text_encoder)
        adapters.unhook()
        plain = prediction(family.transformer, family.parts["text_encoder"])
        assert (ours - plain).abs().max() > 1e-3
        assert (ours - theirs).abs().max() < 1e-5
    finally:
        adapters.unhook()


def test_the_run_says_what_diffusers_and_comfyui_cannot_read(family):
    from modules.adapters.formats.files import AdapterFileError, check_output_format

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="attn")
    try:
        assert any("FLUX.1's original layers" in w for w in format_warnings("kohya", adapters, family))
        with pytest.raises(AdapterFileError, match="no ComfyUI key layout"):
            check_output_format("comfy", adapters, family)
    finally:
        adapters.unhook()


def test_the_language_model_head_gets_no_adapters_and_blocks_run_in_order(family):
    assert family.unreachable_prefixes("text_encoder") == ("lm_head",)
    latents = torch.randn(1, 16, 4, 4)
    text = family.encode_text(family.tokenize([INSTRUCTION]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))


def test_fibo_edit_presets_are_listed_and_valid_and_its_folder_is_told_by_its_pipeline(tiny_fibo_edit):
    from modules.config.loading import build_config
    from modules.config.presets import list_presets, load_preset_overlay
    from modules.model.detect import detect_family

    assert detect_family(tiny_fibo_edit) == "fibo_edit"  # model_index's BriaFiboEditPipeline
    names = sorted(p.name for p in list_presets() if p.family == "fibo_edit")
    assert names == ["FIBO Edit LoRA 16GB", "FIBO Edit LoRA 24GB", "FIBO Edit embedding 12GB",
                     "FIBO Edit embedding 8GB", "FIBO Edit full fine-tune 12GB"]
    for name in names:
        config = build_config([load_preset_overlay(name)])
        # an adapter file in diffusers' names (ComfyUI has no FIBO model); a fine-tune saves a folder
        assert config.model.family == "fibo_edit" and (config.method.type != "adapter"
                                                       or config.output.format == "diffusers")


@pytest.mark.parametrize("mode", ["float8", "int8"])
def test_smollm3s_tied_head_stays_its_token_table_in_the_load_and_the_plan(tmp_path, tiny_fibo_edit, shape_images,
                                                                           mode):
    """SmolLM3's config ties its head to its token table (`tie_word_embeddings` true), so in a
    quantized mode the head stays dense and is the table (skip_rules.py), in the load and in the
    plan's skeleton alike: one full-precision tensor, counted once, the same bytes in both; before,
    the load quantized the head and then re-tied it to the table (streamed_load._tie_weights), so
    its quantized layer held the full table while the plan counted a quantized head apart. The
    encoding never reads the head: it is that of the same model with the head quantized apart."""
    from modules.model.components.embedding_tokens import token_embedding
    from modules.model.fibo_edit import FiboEditFamily
    from modules.offload.layer_tensors import block_bytes
    from modules.plan.run_plan import Planner
    from modules.quantization.replace import load_dense_weight, new_quantized_layer

    config = train_config(tiny_fibo_edit, shape_images, tmp_path,
                          {**PAIRED, "model": {"family": "fibo_edit", "parts": {"text_encoder": {"weight_dtype": mode}}}})
    family = FiboEditFamily(config)
    family.load()
    encoder = family.parts["text_encoder"]
    table = token_embedding(encoder).weight
    assert type(encoder.lm_head) is torch.nn.Linear and encoder.lm_head.weight is table
    assert table.dtype == family.compute_dtype("text_encoder")
    assert "lm_head" in family.quantization_reports["text_encoder"].skipped
    assert family.quantization_reports["text_encoder"].quantized  # the rest of SmolLM3 is quantized

    planner = Planner(None)
    planned = planner.sizes(config, planner.weight_modes(config))["family"].parts["text_encoder"]
    assert type(planned.lm_head) is torch.nn.Linear and planned.lm_head.weight is token_embedding(planned).weight
    assert block_bytes(planned) == block_bytes(encoder)

    tokens = family.tokenize([INSTRUCTION])
    with torch.no_grad():
        reference = family.encode_text(tokens)
        apart = new_quantized_layer(mode, encoder.lm_head, family.compute_dtype("text_encoder"))
        load_dense_weight(apart, "weight", table.detach().clone(), family.compute_dtype("text_encoder"))
        encoder.lm_head = apart
        quantized_apart = family.encode_text(tokens)
    for key, value in reference.items():
        if value is not None:
            assert torch.equal(quantized_apart[key], value), key
