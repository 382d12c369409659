"""Anima on a tiny offline modular pipeline (Qwen3 + byte-level tokenizer, a T5-style tokenizer for
the LLM adapter's queries, AnimaTextConditioner, CosmosTransformer3DModel, AutoencoderKLQwenImage):
the text conditioning, the denoiser's prediction and a sample are AnimaModularPipeline's own; a LoRA
on the transformer and the LLM adapter learns, resumes and offloads as it trains plain; the diffusers
file loads in the modular pipeline with every adapter and the same outputs; the folder is told an
Anima model by its modular_model_index.json before any weight loads, and ComfyUI's one-file Anima
(DiT + llm_adapter) loads to the folder's tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    MODES,
    blocks_run_in_listed_order,
    initializes_and_steps,
    loads_beside_a_skeleton_denoiser,
    offloaded_training_matches,
    perturbed_adapters,
    resumed_training_matches,
)

from modules.adapters.formats.files import format_warnings, save_adapter_file
from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay
from modules.config.train_config import SamplePromptConfig
from modules.trainer.generic_trainer import GenericTrainer

CAPTIONS = ["a red circle on a blue background", "", "x", "two green squares, one large and one small, on white"]


@pytest.fixture(scope="session")
def tiny_anima(tiny_family_model):
    return tiny_family_model("anima")  # the session's, shared with the preset and guard tests


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_anima, shape_images):
    from modules.model.anima import AnimaFamily

    family = AnimaFamily(train_config(tiny_anima, shape_images, tmp_path_factory.mktemp("anima"),
                                      {"model": {"family": "anima"}}))
    family.load()
    return family


def _disk_pipeline(folder, guidance_scale: float = 4.0):
    """AnimaModularPipeline as a user loads it from the folder (ModularPipeline picks the class)."""
    from diffusers import AnimaModularPipeline, ClassifierFreeGuidance, ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder))
    assert isinstance(pipe, AnimaModularPipeline)
    pipe.load_components(torch_dtype=torch.float32)
    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_embeds(pipe, caption: str, length: int) -> torch.Tensor:
    from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    cpu = torch.device("cpu")
    out = AnimaTextEncoderStep.encode_prompt(pipe, caption, prepare_unconditional_embeds=False,
                                             max_sequence_length=length, device=cpu)
    return AnimaTextConditioningStep._condition_prompt_embeds(
        pipe, out["qwen_prompt_embeds"], out["qwen_attention_mask"], out["t5_input_ids"], out["t5_attention_mask"],
        cpu, torch.float32, torch.float32)


def test_the_text_conditioning_is_the_pipelines_for_each_caption_in_a_padded_batch(family, tiny_anima):
    """Padded to the window in one batch, each caption's embeddings equal the pipeline's for it alone
    (padded to its own length): the empty caption (an all-masked Qwen3 source) included."""
    text = family.encode_text(family.tokenize(CAPTIONS))
    pipe = family.pipeline()
    for i, caption in enumerate(CAPTIONS):
        theirs = _pipeline_embeds(pipe, caption, family.max_sequence_length)
        assert theirs.shape == text["prompt_embeds"][i:i + 1].shape
        torch.testing.assert_close(text["prompt_embeds"][i:i + 1], theirs, atol=1e-5, rtol=0)
    assert text["prompt_embeds"][0].abs().sum() > 0 and not text["prompt_embeds"].isnan().any()


def test_the_prediction_is_what_the_pipelines_denoise_loop_computes(family, tiny_anima):
    """The transformer call of the pipeline's first step (latents, sigma, embeddings, padding mask)
    is family.denoise of the same latents at the same sigma with the family's text encoding."""
    pipe = _disk_pipeline(tiny_anima, guidance_scale=1.0)  # CFG off: one transformer call per step
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda module, args, kwargs, out: calls.append((kwargs, out[0])),
                                                  with_kwargs=True)
    try:
        pipe(prompt=CAPTIONS[0], num_inference_steps=2, height=32, width=32, max_sequence_length=32,
             generator=torch.Generator().manual_seed(0), output_type="pt")
    finally:
        hook.remove()
    kwargs, theirs = calls[0]
    sigma = kwargs["timestep"]
    assert torch.allclose(sigma, torch.tensor([1.0]))  # the first of linspace(1, 1/N, N), shifted: 1
    text = family.encode_text(family.tokenize([CAPTIONS[0]]))
    with torch.no_grad():
        ours = family.denoise(kwargs["hidden_states"].squeeze(2), sigma, text)
        # the second step's sigma is shifted by the scheduler config (shift 3: 0.5 -> 0.75)
        second_kwargs, second = calls[1]
        assert torch.allclose(second_kwargs["timestep"], torch.tensor([0.75]))
        ours_second = family.denoise(second_kwargs["hidden_states"].squeeze(2), second_kwargs["timestep"], text)
    torch.testing.assert_close(ours, theirs.squeeze(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_second, second.squeeze(2), atol=1e-5, rtol=0)


def test_training_sigmas_are_shifted_as_the_pipelines_schedule():
    from modules.model.components.flow_matching import flow_sigmas

    config = {"shift": 3.0, "use_dynamic_shifting": False}
    assert torch.allclose(flow_sigmas(config, torch.tensor([0.5]), 64), torch.tensor([0.75]))


def test_a_sample_is_the_pipelines_image(family, tiny_anima, capsys):
    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=3.0, width=48,
                                height=32, seed=5)
    ours = np.asarray(family.sample(prompt, torch.device("cpu")))
    assert "it/s" not in capsys.readouterr().err  # no progress bar of the denoise loop in the run's log
    theirs = _disk_pipeline(tiny_anima, guidance_scale=3.0)(
        prompt="a red circle", negative_prompt="blurry", num_inference_steps=2, height=32, width=48,
        max_sequence_length=32, generator=torch.Generator().manual_seed(5), output_type="np").images[0]
    assert ours.shape == (32, 48, 3) and ours.std() > 0
    assert np.abs(ours.astype(np.float32) - np.round(theirs * 255)).max() <= 1


def test_anima_trains_a_lora_and_the_loss_falls(tmp_path, tiny_anima, one_image):
    config = train_config(tiny_anima, one_image, tmp_path, {
        "model": {"family": "anima", "parts": {"transformer": {"gradient_checkpointing": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 10, "batch_size": 1},
        "optimizer": {"lr": 1e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    before = fixed_loss(trainer, draws=4)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=4)
    trainer.end()
    assert after < before * 0.8, (before, after)


def test_the_llm_adapter_trains_beside_the_transformer_under_comfyuis_names(tmp_path, tiny_anima, one_image):
    """Its adapters learn (the first-step guard) with the text cache off, and the file names both
    parts as ComfyUI does: the Cosmos layers and the diffusion model's llm_adapter."""
    config = train_config(tiny_anima, one_image, tmp_path, {
        "model": {"family": "anima", "parts": {"text_conditioner": {"train": True}}},
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"max_steps": 1, "batch_size": 1},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    path = trainer.end()
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        keys = set(file.keys())
    assert "lora_unet_blocks_0_self_attn_q_proj.lora_down.weight" in keys
    assert "lora_unet_blocks_1_mlp_layer2.lora_up.weight" in keys
    assert "lora_unet_llm_adapter_blocks_0_cross_attn_k_proj.alpha" in keys


def _outputs(family, transformer, conditioner):
    """The prediction on fixed latents, with these modules in place of the family's own."""
    original = family.parts["transformer"], family.parts["text_conditioner"]
    family.parts["transformer"], family.parts["text_conditioner"] = transformer, conditioner
    try:
        with torch.no_grad():
            text = family.encode_text(family.tokenize([CAPTIONS[0]]))
            latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
            return family.denoise(latents, torch.tensor([0.5]), text)
    finally:
        family.parts["transformer"], family.parts["text_conditioner"] = original


def test_a_diffusers_file_loads_in_the_modular_pipeline_with_every_adapter(family, tiny_anima, tmp_path):
    adapters = perturbed_adapters(family, ["transformer", "text_conditioner"], layer_preset="all-linear")
    try:
        path = tmp_path / "anima.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        assert format_warnings("diffusers", adapters, family) == [w for w in format_warnings(
            "diffusers", adapters, family) if "ComfyUI will not load" in w]  # diffusers itself drops nothing
        ours = _outputs(family, family.transformer, family.parts["text_conditioner"])
        pipe = _disk_pipeline(tiny_anima)
        pipe.load_lora_weights(str(path))
        theirs = _outputs(family, pipe.transformer, pipe.text_conditioner)
        loaded = {f"{part}.{n}" for part in ("transformer", "text_conditioner")
                  for n, m in getattr(pipe, part).named_modules() if hasattr(m, "lora_A")}
        assert {f"{adapters.part_of[n]}.{adapters.module_name_of[n]}" for n in adapters.modules} == loaded
        adapters.unhook()
        plain = _outputs(family, family.transformer, family.parts["text_conditioner"])
        assert (ours - plain).abs().max() > 1e-3
        assert (ours - theirs).abs().max() < 1e-5
    finally:
        adapters.unhook()


def test_what_diffusers_makes_of_kohya_and_comfy_files_is_what_the_run_says(family, tiny_anima, tmp_path):
    """kohya: its Anima loader finds no key it reads and loads nothing; comfy: refused (the `.alpha`
    keys); both said before training."""
    adapters = perturbed_adapters(family, ["transformer", "text_conditioner"], layer_preset="attn")
    try:
        for fmt in ("kohya", "comfy"):
            save_adapter_file(tmp_path / f"{fmt}.safetensors", adapters, family, fmt, torch.float32, {})
        kohya, comfy = (format_warnings(fmt, adapters, family) for fmt in ("kohya", "comfy"))
        count = len(adapters)
    finally:
        adapters.unhook()
    assert any(f"will not load {count} of these" in w and "lora_unet_" in w for w in kohya), kohya
    assert any("refuses ComfyUI-layout Anima files" in w for w in comfy), comfy
    pipe = _disk_pipeline(tiny_anima)
    pipe.load_lora_weights(str(tmp_path / "kohya.safetensors"))
    assert not any(hasattr(m, "lora_A") for m in [*pipe.transformer.modules(), *pipe.text_conditioner.modules()])
    with pytest.raises(ValueError, match="lora"):
        pipe.load_lora_weights(str(tmp_path / "comfy.safetensors"))


def test_comfyui_applies_every_module_of_kohya_and_comfy_files_and_none_of_a_diffusers_one(family, tmp_path):
    """ComfyUI's key map (modules/saving/consumers/comfyui.py: the Cosmos names, `llm_adapter.`,
    `text_encoders.qwen3_06b.`) applies every adapter of an all-linear kohya or comfy file, and it has
    no diffusers names for Anima."""
    from modules.saving.consumers.check import check_file

    parts = ["transformer", "text_conditioner", "text_encoder"]
    adapters = perturbed_adapters(family, parts, layer_preset="all-linear")
    try:
        for fmt in ("kohya", "comfy", "diffusers"):
            save_adapter_file(tmp_path / f"{fmt}.safetensors", adapters, family, fmt, torch.float32, {})
        count = len(adapters)
        said = format_warnings("diffusers", adapters, family)
    finally:
        adapters.unhook()
    for fmt in ("kohya", "comfy"):
        assert check_file(tmp_path / f"{fmt}.safetensors", family)["ComfyUI"] == {
            "applied": count, "total": count, "dropped": []}, fmt
    assert check_file(tmp_path / "diffusers.safetensors", family)["ComfyUI"]["applied"] == 0
    assert {part for part in parts if any(f"e.g. {part}." in w and "ComfyUI will not load" in w for w in said)} == set(parts)


def test_the_folder_is_told_anima_by_its_modular_index(tiny_anima):
    from modules.model.detect import detect_model, family_mismatch

    assert not (tiny_anima / "model_index.json").exists()
    detected = detect_model(tiny_anima)
    assert (detected.family, detected.kind) == ("anima", "AnimaModularPipeline")
    assert "AnimaModularPipeline" in family_mismatch(tiny_anima, "qwen_image")


def test_checkpoint_blocks_follow_the_forward_order(family):
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))
    blocks_run_in_listed_order(family, "text_conditioner", lambda: family.encode_text(family.tokenize(["a"])))
    blocks_run_in_listed_order(family, "text_encoder", lambda: family.encode_text(family.tokenize(["a"])))


# bfloat16: the Anima LoRA 12GB and 24GB presets train on it (tests/test_builtin_presets.py)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "bfloat16"])
def test_each_base_precision_initializes_and_steps(tmp_path, tiny_anima, one_image, mode):
    initializes_and_steps(tiny_anima, one_image, tmp_path, "anima", "transformer", mode, dora=mode == "float8")


def test_the_modulation_and_final_layers_stay_dense_when_the_transformer_is_quantized(tmp_path, tiny_anima,
                                                                                      shape_images):
    from modules.model.anima import AnimaFamily
    from modules.quantization.base import QuantizedLinear

    family = AnimaFamily(train_config(tiny_anima, shape_images, tmp_path, {
        "model": {"family": "anima", "parts": {"transformer": {"weight_dtype": "float8"}}}}))
    family.load()
    skipped = family.quantization_reports["transformer"].skipped
    # CosmosTransformer3DModel._skip_layerwise_casting_patterns ("patch_embed", "norm"), the default final projection
    assert "_skip_layerwise_casting_patterns" in skipped["transformer_blocks.0.norm1.linear_1"]
    assert "_skip_layerwise_casting_patterns" in skipped["patch_embed.proj"]
    assert "proj_out" in skipped
    assert isinstance(family.transformer.get_submodule("transformer_blocks.0.attn1.to_q"), QuantizedLinear)
    assert not isinstance(family.transformer.get_submodule("proj_out"), QuantizedLinear)


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_anima, one_image):
    offloaded_training_matches(tiny_anima, one_image, tmp_path, "anima", "transformer", fake_device)


def test_a_resumed_run_ends_with_the_adapter_of_an_uninterrupted_one(tmp_path, tiny_anima, shape_images):
    resumed_training_matches(tiny_anima, shape_images, tmp_path, "anima")


def test_a_fine_tune_saves_a_modular_pipeline_folder_that_loads_whole(tmp_path, tiny_anima, one_image):
    """The saved folder carries the modular index (no model_index.json) and the tokenizers, and
    AnimaModularPipeline loads every component of it, the trained transformer's weights included."""
    config = train_config(tiny_anima, one_image, tmp_path, {
        "model": {"family": "anima", "parts": {"transformer": {"weight_dtype": "float32"}}},
        "method": {"type": "fine_tune", "save_format": "diffusers"}, "optimizer": {"lr": 1e-4},
        "schedule": {"max_steps": 1, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    saved = trainer.end()
    assert (saved / "modular_model_index.json").is_file() and (saved / "t5_tokenizer").is_dir()
    pipe = _disk_pipeline(saved)
    trained = trainer.family.transformer.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in pipe.transformer.state_dict().items())


# diffusers' CosmosTransformer3DModel names -> the original Cosmos-Predict2 names (the inverse of diffusers' converter)
_TO_ORIGINAL = (("transformer_blocks.", "blocks."), (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."),
                (".to_q.", ".q_proj."), (".to_k.", ".k_proj."), (".to_v.", ".v_proj."), (".to_out.0.", ".output_proj."),
                (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm."), (".ff.net.0.proj.", ".mlp.layer1."),
                (".ff.net.2.", ".mlp.layer2."), (".norm1.linear_", ".adaln_modulation_self_attn."),
                (".norm2.linear_", ".adaln_modulation_cross_attn."), (".norm3.linear_", ".adaln_modulation_mlp."),
                ("patch_embed.proj.", "x_embedder.proj.1."), ("norm_out.linear_", "final_layer.adaln_modulation."),
                ("proj_out.", "final_layer.linear."), ("time_embed.t_embedder.", "t_embedder.1."),
                ("time_embed.norm.", "t_embedding_norm."))


def _anima_file(folder, path, prefix: str):
    """The tiny folder's transformer and LLM adapter as ComfyUI's one Anima file (original names)."""
    from safetensors.torch import load_file, save_file

    out = {}
    for key, tensor in load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")).items():
        for old, new in _TO_ORIGINAL:
            key = key.replace(old, new)
        out[prefix + key] = tensor
    for key, tensor in load_file(str(folder / "text_conditioner" / "diffusion_pytorch_model.safetensors")).items():
        out[f"{prefix}llm_adapter.{key}"] = tensor
    save_file(out, str(path))
    return path


@pytest.mark.parametrize("prefix", ["net.", "model.diffusion_model."])
def test_comfyuis_anima_file_loads_the_same_tensors_as_the_folder(tmp_path, tiny_anima, shape_images, family,
                                                                  prefix):
    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.anima import AnimaFamily
    from modules.model.detect import detect_model

    file = _anima_file(tiny_anima, tmp_path / "anima-tiny.safetensors", prefix)
    assert detect_model(file).family == "anima"
    lacking = AnimaFamily(train_config(file, shape_images, tmp_path, {"model": {"family": "anima"}}))
    lacking.model_configs_dir = tiny_anima
    with pytest.raises(ModelLoadError, match=r"model\.parts\.text_encoder\.path.*model\.parts\.vae\.path"):
        lacking.load()
    config = train_config(file, shape_images, tmp_path, {"model": {"family": "anima", "parts": {
        "text_encoder": {"path": str(tiny_anima / "text_encoder")}, "vae": {"path": str(tiny_anima / "vae")}}}})
    from_file = AnimaFamily(config)
    from_file.model_configs_dir = tiny_anima
    from_file.load()  # the tokenizers from beside the text encoder's folder
    for part, module in family.parts.items():
        ours, theirs = from_file.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def test_a_cosmos_predict2_file_is_not_taken_for_anima(tmp_path, tiny_anima):
    from safetensors.torch import load_file, save_file

    from modules.model.detect import detect_model

    file = _anima_file(tiny_anima, tmp_path / "anima.safetensors", "net.")
    save_file({k: v for k, v in load_file(str(file)).items() if ".llm_adapter." not in k},
              str(tmp_path / "cosmos.safetensors"))
    assert (detect_model(tmp_path / "cosmos.safetensors") or type("none", (), {"family": None})).family != "anima"


def test_anima_presets_are_listed_and_valid():
    names = [p.name for p in list_presets() if p.family == "anima"]
    assert {"Anima LoRA 8GB", "Anima LoRA 12GB", "Anima LoRA 24GB"} <= set(names)
    for name in names:
        config = build_config([load_preset_overlay(name)])
        assert config.model.family == "anima"
        assert set(config.model.parts) == {"text_encoder", "text_conditioner", "transformer", "vae"}


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
