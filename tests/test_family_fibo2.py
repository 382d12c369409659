"""Bria FIBO-2 on a tiny offline model (Qwen3-VL with a 36-layer language model, a byte-level
tokenizer with the vision tokens, BriaFibo2Transformer2DModel with a Perceiver and injection
blocks, FLUX.2's VAE): the caption, text and latent encodings are BriaFibo2Pipeline's own, padding
changes nothing, training learns under the flow target at the pipeline's shift, a sample is the
pipeline's own image for the same prompt (CFG against its null caption), the diffusers file loads in
`BriaFibo2Pipeline.load_lora_weights` with every adapter used and equal outputs, and the shared
checks (quantized bases, offloading half the transformer on the fake device, resume, block order) hold."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    MODES,
    blocks_run_in_listed_order,
    initializes_and_steps,
    loads_beside_a_skeleton_denoiser,
    perturbed_adapters,
    resumed_training_matches,
)

from modules.adapters.formats.files import format_warnings, save_adapter_file


@pytest.fixture(scope="session")
def tiny_fibo2(tiny_family_model):
    return tiny_family_model("fibo2")  # the session's, shared with the preset and guard tests


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_fibo2, shape_images):
    from modules.model.fibo2 import Fibo2Family

    family = Fibo2Family(train_config(tiny_fibo2, shape_images, tmp_path_factory.mktemp("fibo2"),
                                      {"model": {"family": "fibo2"}}))
    family.load()
    return family


@pytest.fixture(scope="module")
def pipe(tiny_fibo2, family):
    """The released pipeline on the tiny folder, its tokenizer standing in for Qwen3VLProcessor (which
    needs torchvision; for a text prompt the processor is its tokenizer)."""
    from diffusers import BriaFibo2Pipeline

    pipe = BriaFibo2Pipeline.from_pretrained(str(tiny_fibo2), processor=None, local_files_only=True)
    pipe.processor = family.tokenizer
    pipe.set_progress_bar_config(disable=True)
    return pipe


CAPTION = {"short_description": "a red circle", "objects": [], "lighting": {"conditions": "soft", "direction": ""},
           "aesthetics": {"mood": "calm", "aesthetic_score": "high"}, "preference_score": 0.9}


def test_a_json_caption_is_cleaned_as_the_pipeline_cleans_it_and_other_text_stays():
    from modules.model.fibo2 import trained_caption

    spaced = json.dumps(CAPTION, indent=2)
    assert trained_caption(spaced) == ('{"short_description":"a red circle","lighting":{"conditions":"soft"},'
                                       '"aesthetics":{"mood":"calm"}}')
    assert trained_caption("a photo of sks dog, {not json}") == "a photo of sks dog, {not json}"
    assert trained_caption("[1, 2]") == "[1, 2]"  # JSON, but no caption object: as given


def test_encodings_are_the_pipelines(family, pipe):
    """Six bundles of three RMS-normalised Qwen3-VL layers of the caption in the pipeline's chat turn
    (real tokens; the family pads to a fixed window), and latents normalised by the VAE's batch norm."""
    from modules.model.fibo2 import trained_caption

    captions = [json.dumps(CAPTION), "a blue square on green"]
    text = family.encode_text(family.tokenize(captions))
    with torch.no_grad():
        theirs, mask = pipe.encode_prompt([trained_caption(c) for c in captions], device=torch.device("cpu"))
    ours = text["hidden_states"]
    assert ours.shape == (2, 6, family.max_sequence_length, 3 * 16) and theirs.shape[:2] == (2, 6)
    for i in range(2):
        real = int(mask[i].sum())
        assert int(text["attention_mask"][i].sum()) == real
        assert torch.allclose(ours[i, :, :real], theirs[i, :, :real], atol=1e-6)
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents = family.encode_images(pixels)
        expected = pipe.prepare_image_latents([pixels], 1, torch.device("cpu"), torch.float32)[0]
    assert latents.shape == (2, 8, 32, 32)
    assert torch.allclose(latents, expected, atol=1e-6)


def test_padding_changes_nothing_in_a_batch_of_different_lengths(family):
    """The mask sets each prompt's gist-token count and masks the padding out: a caption alone and in a
    batch with a longer one (another gist count) predict the same, and the same as it unpadded."""
    long = json.dumps({"short_description": "a much longer caption " * 3, "background_setting": "a field"})
    tokens = family.tokenize(["a", long])
    assert tokens["attention_mask"][0].sum() < tokens["attention_mask"][1].sum()
    text = family.encode_text(tokens)
    latents = torch.randn(2, 8, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = family.denoise(latents, torch.tensor([0.5, 0.5]), text)[:1]
        alone = family.denoise(latents[:1], torch.tensor([0.5]), family.encode_text(family.tokenize(["a"])))
        real = int(text["attention_mask"][0].sum())
        unpadded = family.transformer(hidden_states=latents[:1], timestep=torch.tensor([0.5]),
                                      encoder_hidden_states=text["hidden_states"][:1, :, :real], return_dict=False)[0]
    assert torch.allclose(alone, batched, atol=1e-5)
    assert torch.allclose(alone, unpadded, atol=1e-5)


def test_predict_targets_the_flow_at_the_pipelines_shift(family):
    import math

    from diffusers.pipelines.bria_fibo2.pipeline_bria_fibo2 import calculate_shift

    latents = torch.randn(2, 8, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a", "b"]))
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(3))
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    assert prediction.shape == latents.shape and torch.allclose(target, noise - latents)
    # the median draw sits where the pipeline's mu for 4 x 6 tokens puts it
    config = family.noise_scheduler.config
    mu = calculate_shift(24, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift)
    family.training_times = lambda batch, generator: torch.full((1,), 0.5)
    try:
        sigma = family.sample_sigmas(1, family.sequence_length(latents), torch.Generator())
    finally:
        del family.training_times
    assert math.isclose(float(sigma), math.exp(mu) / (math.exp(mu) + 1), rel_tol=1e-6)


def test_a_sample_is_the_pipelines_own_image_with_cfg_against_its_null_caption(family, pipe):
    from modules.config.train_config import SamplePromptConfig
    from modules.util.torch_utils import make_generator

    caption = json.dumps(CAPTION)
    prompt = SamplePromptConfig(prompt=caption, steps=2, cfg=3.0, width=64, height=64, seed=3)
    ours = family.sample(prompt, torch.device("cpu"))
    theirs = pipe(prompt=caption, num_inference_steps=2, guidance_scale=3.0, width=64, height=64,
                  generator=make_generator(torch.device("cpu"), 3), render_text_images=False).images[0]
    unguided = pipe(prompt=caption, num_inference_steps=2, guidance_scale=1.0, width=64, height=64,
                    generator=make_generator(torch.device("cpu"), 3)).images[0]
    assert ours.size == (64, 64)
    # the same image up to float rounding (the family encodes in a padded window, the pipeline unpadded)
    difference = (torch.tensor(list(ours.getdata())) - torch.tensor(list(theirs.getdata()))).abs().float()
    assert difference.max() <= 1 and difference.mean() < 0.01, (difference.max(), difference.mean())
    assert ours.tobytes() != unguided.tobytes()  # the guidance pass is there


def test_fibo2_trains_a_lora_and_the_loss_falls(tmp_path, tiny_fibo2, one_image):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_fibo2, one_image, tmp_path, {
        "model": {"family": "fibo2", "parts": {"transformer": {"gradient_checkpointing": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 16, "batch_size": 1},
        "optimizer": {"lr": 1e-2}, "output": {"format": "diffusers"},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = set(file.keys())
    for stem in ("transformer.layers.0.attention.to_q", "transformer.layers.0.cross_attention.to_k",
                 "transformer.perceiver.layers.0.self_attention.to_v", "transformer.perceiver.layers.0.ffn.w1",
                 "transformer.noise_refiner.0.feed_forward.w2", "transformer.final_layer.linear"):
        assert f"{stem}.lora_A.weight" in keys, stem


def test_a_resumed_run_training_qwen3_vl_too_equals_an_uninterrupted_one(tmp_path, tiny_fibo2, one_image):
    """With the text encoder trained (its layers from the 36th on get no adapter: never read), each run's
    first-step guard checks every adapter, Qwen3-VL's too, learned."""
    resumed_training_matches(tiny_fibo2, one_image, tmp_path, "fibo2", {
        "model": {"parts": {"text_encoder": {"train": True}}}, "adapter": {"layer_preset": "attn"}})


def _output(family, transformer):
    text = family.encode_text(family.tokenize(["a red circle on a blue background"]))
    latents = torch.randn(1, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    original = family.parts["transformer"]
    family.parts["transformer"] = transformer
    try:
        with torch.no_grad():
            return family.denoise(latents, torch.tensor([0.5]), text)
    finally:
        family.parts["transformer"] = original


def test_load_lora_weights_matches_the_hooked_model(family, pipe, tmp_path):
    """The diffusers file on every Linear layer of the transformer loads with no adapter left out."""
    from peft.tuners.lora import LoraLayer

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="all-linear")
    try:
        path = tmp_path / "fibo2.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        assert format_warnings("diffusers", adapters, family) == []
        ours, count = _output(family, family.transformer), len(adapters)
    finally:
        adapters.unhook()
    plain = _output(family, family.transformer)
    pipe.load_lora_weights(str(path))
    try:
        assert sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules()) == count
        theirs = _output(family, pipe.transformer)
    finally:
        pipe.unload_lora_weights()
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


def test_the_run_says_what_diffusers_and_comfyui_cannot_read(family):
    from modules.adapters.formats.files import AdapterFileError, check_output_format

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="attn")
    try:
        said = format_warnings("kohya", adapters, family)
        assert any("has no converter for kohya names" in w for w in said), said
        assert any("model.parts.text_encoder.train" in w for w in format_warnings("diffusers", adapters, family))
        with pytest.raises(AdapterFileError, match="no ComfyUI key layout"):
            check_output_format("comfy", adapters, family)
    finally:
        adapters.unhook()


def test_the_final_layer_stays_dense_when_the_transformer_is_quantized(tmp_path, tiny_fibo2, shape_images):
    from modules.model.fibo2 import Fibo2Family
    from modules.quantization.base import QuantizedLinear

    family = Fibo2Family(train_config(tiny_fibo2, shape_images, tmp_path, {
        "model": {"family": "fibo2", "parts": {"transformer": {"weight_dtype": "float8"}}}}))
    family.load()
    assert "final_layer.linear" in family.quantization_reports["transformer"].skipped  # the default skip list's
    assert not isinstance(family.transformer.get_submodule("final_layer.linear"), QuantizedLinear)
    assert isinstance(family.transformer.get_submodule("layers.0.cross_attention.to_q"), QuantizedLinear)


@pytest.mark.parametrize(("mode", "dora"), [(mode, False) for mode in MODES if mode != "bfloat16"] + [("bfloat16", True)],
                         ids=lambda value: {False: "lora", True: "dora"}.get(value, value))
def test_quantized_bases_and_dora_initialize_and_step(tmp_path, tiny_fibo2, one_image, mode, dora):
    initializes_and_steps(tiny_fibo2, one_image, tmp_path, "fibo2", "transformer", mode, dora)


def test_qwen3_vl_layers_after_the_deepest_one_read_get_no_adapters(family):
    # hidden_states[35]: layer 34's output; the vision tower sees no image in a plain caption
    assert family.unreachable_prefixes("text_encoder") == ("visual.", "language_model.layers.35.")
    assert family.unreachable_prefixes("transformer") == ()


def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    latents = torch.randn(1, 8, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads


def test_fibo2_presets_are_listed_and_valid_and_its_folder_is_told_by_its_pipeline(tiny_fibo2):
    from modules.config.loading import build_config
    from modules.config.presets import list_presets, load_preset_overlay
    from modules.model.detect import detect_family

    assert detect_family(tiny_fibo2) == "fibo2"  # model_index's BriaFibo2Pipeline

    names = [p.name for p in list_presets() if p.family == "fibo2"]
    assert {"FIBO-2 LoRA 16GB", "FIBO-2 LoRA 24GB", "FIBO-2 embedding 16GB", "FIBO-2 full fine-tune 8GB",
            "FIBO-2 full fine-tune 12GB", "FIBO-2 full fine-tune 16GB", "FIBO-2 full fine-tune 24GB"} <= set(names)
    for name in names:
        config = build_config([load_preset_overlay(name)])
        # an adapter file in diffusers' names (ComfyUI has no FIBO model); an embedding has its own layout
        assert config.model.family == "fibo2" and (config.method.type != "adapter"
                                                   or config.output.format == "diffusers")


def test_the_cross_attention_behind_a_zero_gate_is_named_and_one_behind_a_trained_gate_is_not(family):
    """diffusers starts cross_attn_gate at zero (the tiny model keeps it so): the first step gives the
    cross-attention and its norms no gradient, which the first-step guard must not call "not learning";
    the released weights' gates are trained, and then nothing is left out."""
    blocks = family.transformer.layers
    injection = [i for i, block in enumerate(blocks) if block.cross_attention is not None]
    parts = ("cross_attention.", "cross_attn_norm1.", "cross_attn_norm2.")
    assert family.zero_gated_prefixes("transformer") == tuple(f"layers.{i}.{n}" for i in injection for n in parts)
    assert family.zero_gated_prefixes("text_encoder") == ()
    gate = blocks[injection[0]].cross_attn_gate
    try:
        with torch.no_grad():
            gate.fill_(0.5)
        assert family.zero_gated_prefixes("transformer") == tuple(f"layers.{i}.{n}" for i in injection[1:] for n in parts)
    finally:
        with torch.no_grad():
            gate.zero_()


class _RealArithmeticAttention:
    """BriaFibo2AttnProcessor's computation with its rotary embedding in real products: the fake device
    cannot run the complex view the processor's rotation makes."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query, key, value = (projection(x).unflatten(-1, (attn.heads, -1)) for projection, x in
                             ((attn.to_q, hidden_states), (attn.to_k, context), (attn.to_v, context)))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if freqs_cis is not None:
            query, key = _rotated(query, freqs_cis), _rotated(key, freqs_cis)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        return attn.to_out[0](out.flatten(2, 3))


def _rotated(x, freqs_cis):
    cos, sin = freqs_cis.real.unsqueeze(2), freqs_cis.imag.unsqueeze(2)
    even, odd = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(3).type_as(x)


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_fibo2, one_image, family,
                                                                 monkeypatch):
    from diffusers.models.transformers import transformer_bria_fibo2 as fibo2
    from family_cross import offloaded_training_matches

    latents = torch.randn(1, 8, 8, 8, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a"]))
    with torch.no_grad():
        expected = family.denoise(latents, torch.tensor([0.5]), text)
        family.transformer.set_attn_processor(_RealArithmeticAttention())
        try:
            assert torch.allclose(family.denoise(latents, torch.tensor([0.5]), text), expected, atol=1e-5)
        finally:
            family.transformer.set_attn_processor(fibo2.BriaFibo2AttnProcessor())
    monkeypatch.setattr(fibo2.BriaFibo2Attention, "_default_processor_cls", _RealArithmeticAttention)
    offloaded_training_matches(tiny_fibo2, one_image, tmp_path, "fibo2", "transformer", fake_device)
