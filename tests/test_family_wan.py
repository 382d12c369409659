"""Wan 2.1 on a tiny offline model (UMT5 encoder, WanTransformer3DModel, AutoencoderKLWan with 4x
temporal compression): a LoRA trains on still images (one-frame videos) and the loss falls; the
prompt embeddings are WanPipeline's own; the model class's skip and keep-in-fp32 lists hold in
every weight mode; files in the comfy, kohya (musubi-tuner) and diffusers layouts load in
`WanPipeline.load_lora_weights` and compute what the trainer's hooked model computes; ComfyUI's
key map applies every module of a comfy file; quantized base weights train; offloading half the
blocks and a resumed run train the same adapter; the first-step guard fires on a block wrapped as
issue 4 describes."""

from __future__ import annotations

import re

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
    prediction_with,
)

from modules.adapters.formats.files import format_warnings, save_adapter_file
from modules.trainer.generic_trainer import GenericTrainer


@pytest.fixture(scope="session")
def tiny_wan(tiny_family_model):
    return tiny_family_model("wan")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_wan, shape_images):
    from modules.model.wan import WanFamily

    family = WanFamily(train_config(tiny_wan, shape_images, tmp_path_factory.mktemp("wan"),
                                    {"model": {"family": "wan"}}))
    family.load()
    return family


def test_wan_trains_a_lora_on_still_images_and_the_loss_falls(tmp_path, tiny_wan, one_image):
    from safetensors import safe_open

    config = train_config(tiny_wan, one_image, tmp_path, {
        "model": {"family": "wan", "parts": {"transformer": {"gradient_checkpointing": True}}},
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 40, "batch_size": 1},
        "optimizer": {"lr": 1e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).latents.shape == (1, 16, 16, 16)  # one frame, 4x smaller
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
        assert file.metadata()["ss_base_model_version"] == "wan_2.1_t2v"
    for stem in ("lora_unet_blocks_0_self_attn_q", "lora_unet_blocks_1_cross_attn_o", "lora_unet_blocks_0_ffn_0",
                 "lora_unet_blocks_1_ffn_2"):  # musubi-tuner's names
        assert f"{stem}.lora_down.weight" in keys, stem


def test_the_embeddings_are_the_pipelines_and_predict_targets_the_flow(family):
    """WanPipeline.encode_prompt on the same modules gives the family's embeddings (zeros after the
    real tokens); the transformer sees sigma * 1000; the target is noise - latents; sigmas are
    shifted by the scheduler's flow_shift."""
    from diffusers import WanPipeline

    from modules.model.components.flow_matching import flow_sigmas

    captions = ["a red  circle", "a small blue square"]
    text = family.encode_text(family.tokenize(captions))
    pipe = WanPipeline(tokenizer=family.tokenizer, text_encoder=family.parts["text_encoder"], vae=None,
                       scheduler=None, transformer=None)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device=torch.device("cpu"),
                                       max_sequence_length=family.max_sequence_length)
    assert (embeds - text["hidden_states"]).abs().max() < 1e-6
    real = text["hidden_states"].abs().sum(-1) > 0
    assert real[0].sum() < real[1].sum() < real.shape[1]  # padding zeroed, lengths differ

    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    seen = []
    handle = family.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["timestep"]), with_kwargs=True)
    try:
        with torch.no_grad():
            prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(3))
    finally:
        handle.remove()
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=generator)
    sigmas = flow_sigmas({}, family.training_times(2, generator), 0, 3.0)
    assert family.noise_scheduler.config.flow_shift == 3.0
    assert torch.allclose(target, noise - latents) and prediction.shape == latents.shape
    assert torch.allclose(seen[0], sigmas * 1000)


def test_a_clip_encodes_to_one_latent_frame_per_four_and_the_transformer_takes_it(family):
    clip = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        latents = family.encode_images(clip)
        assert latents.shape == (1, 16, 3, 8, 8)
        velocity = family.denoise(latents, torch.tensor([0.5]), family.encode_text(family.tokenize(["a"])))
    assert velocity.shape == latents.shape


def test_the_model_classes_skip_and_keep_in_fp32_lists_hold_in_every_weight_mode(tmp_path, tiny_wan, shape_images):
    """Both class attributes of WanTransformer3DModel count (their union): `_keep_in_fp32_modules`
    keeps the time embedder, the norms and the `scale_shift_table` parameters (matched by name, as
    diffusers does) in float32 storage; `_skip_layerwise_casting_patterns` is the reason the
    condition embedder stays dense when the blocks are quantized."""
    from modules.model.wan import WanFamily
    from modules.quantization.base import QuantizedLinear

    kept = ("scale_shift_table", "blocks.0.scale_shift_table", "blocks.1.norm2.weight",
            "condition_embedder.time_embedder.linear_1.weight")
    for mode in ("bfloat16", "float8"):
        family = WanFamily(train_config(tiny_wan, shape_images, tmp_path, {
            "model": {"family": "wan", "parts": {"transformer": {"weight_dtype": mode}}}, "train_dtype": "bfloat16"}))
        family.load()
        state = family.transformer.state_dict()
        assert {name: state[name].dtype for name in kept} == dict.fromkeys(kept, torch.float32), mode
        assert state["condition_embedder.text_embedder.linear_1.weight"].dtype == torch.bfloat16
        if mode == "float8":
            report = family.quantization_reports["transformer"]
            for name in ("condition_embedder.text_embedder.linear_1", "condition_embedder.time_proj"):
                assert "_skip_layerwise_casting_patterns" in report.skipped[name], report.skipped[name]
                assert not isinstance(family.transformer.get_submodule(name), QuantizedLinear)
            assert isinstance(family.transformer.get_submodule("blocks.0.attn1.to_q"), QuantizedLinear)


@pytest.mark.parametrize("emptied, alone", [("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules"),
                                            ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns")])
def test_either_class_list_alone_keeps_the_time_embedder_dense(family, monkeypatch, emptied, alone):
    """On Wan the two lists overlap (the time embedder sits in the condition embedder), so the
    quantized-load test above passes on either alone: emptying one here shows the other still
    keeps the time embedder's Linear layers dense for its own reason, which fails when either
    attribute is dropped from skip_rules.skip_reason's union."""
    from modules.quantization.replace import plan_layers

    model_class = type(family.transformer)
    monkeypatch.setattr(model_class, emptied, [])
    targets, skipped = plan_layers(family.transformer, "transformer", [])
    for name in ("condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"):
        assert skipped.get(name, "").startswith(f"{model_class.__name__}.{alone}"), (name, skipped.get(name))
    assert "blocks.0.attn1.to_q" in targets  # the blocks are still quantized


@pytest.mark.parametrize("fmt, preset", [("comfy", "attn"), ("kohya", "attn-mlp"), ("diffusers", "all-linear")])
def test_load_lora_weights_matches_the_hooked_model(family, tiny_wan, tmp_path, fmt, preset):
    """comfy: ComfyUI's `diffusion_model.<original name>`; kohya: musubi-tuner's
    `lora_unet_blocks_N_*`; diffusers: `transformer.<module>` (every Linear layer). Every adapter
    lands on a layer, and the run warned of nothing diffusers drops."""
    from diffusers import WanPipeline

    adapters = perturbed_adapters(family, ["transformer"], layer_preset=preset)
    try:
        path = tmp_path / f"wan-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours = prediction_with(family, family.transformer, 16)
        wanted = {adapters.module_name_of[n] for n in adapters.modules}
        assert [w for w in format_warnings(fmt, adapters, family) if "load_lora_weights" in w] == []
    finally:
        adapters.unhook()
    plain = prediction_with(family, family.transformer, 16)
    pipe = WanPipeline.from_pretrained(str(tiny_wan), local_files_only=True)
    pipe.load_lora_weights(str(path))
    assert wanted <= {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}  # no key dropped
    theirs = prediction_with(family, pipe.transformer, 16)
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("fmt", ["kohya", "comfy"])
def test_a_file_diffusers_refuses_is_named_before_training(family, tmp_path, fmt):
    """diffusers' Wan converters refuse a kohya file with any layer outside the blocks and a comfy
    file with an alpha outside them (they raise): the run says so, naming the preset that loads."""
    from diffusers import WanPipeline

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="all-linear")
    try:
        warnings = format_warnings(fmt, adapters, family)
        save_adapter_file(tmp_path / "all.safetensors", adapters, family, fmt, torch.float32, {})
    finally:
        adapters.unhook()
    (warning,) = [w for w in warnings if "load_lora_weights" in w]
    assert "head.head" in warning or "proj_out" in warning or "embedd" in warning
    assert "adapter.layer_preset 'attn" in warning
    pipe = WanPipeline.from_pretrained(str(family.config.model.base), local_files_only=True)
    with pytest.raises((ValueError, IndexError)):  # comfy: "`state_dict` should be empty"; kohya: a key without a block
        pipe.load_lora_weights(str(tmp_path / "all.safetensors"))


def test_text_encoder_adapters_are_named_as_dropped_by_diffusers(family):
    adapters = perturbed_adapters(family, ["text_encoder"], layer_preset="attn")
    try:
        warnings = format_warnings("diffusers", adapters, family)
    finally:
        adapters.unhook()
    assert any("model.parts.text_encoder.train" in w for w in warnings)


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])  # kohya: musubi-tuner's names, which ComfyUI also maps
def test_comfyui_applies_every_module_of_a_comfy_or_kohya_file(family, tmp_path, fmt):
    from modules.saving.consumers.check import check_file

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    try:
        save_adapter_file(tmp_path / f"{fmt}.safetensors", adapters, family, fmt, torch.float32, {})
        save_adapter_file(tmp_path / "diffusers.safetensors", adapters, family, "diffusers", torch.float32, {})
        count = len(adapters)
    finally:
        adapters.unhook()
    report = check_file(tmp_path / f"{fmt}.safetensors", family)["ComfyUI"]
    assert report == {"applied": count, "total": count, "dropped": []}
    # ComfyUI has no diffusers-name map for Wan: a diffusers file applies nothing there
    assert check_file(tmp_path / "diffusers.safetensors", family)["ComfyUI"]["applied"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_each_base_precision_initializes_and_steps(tmp_path, tiny_wan, one_image, mode):
    initializes_and_steps(tiny_wan, one_image, tmp_path, "wan", "transformer", mode, dora=mode == "float8")


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_wan, one_image):
    offloaded_training_matches(tiny_wan, one_image, tmp_path, "wan", "transformer", fake_device)


def test_a_resumed_run_ends_with_the_adapter_of_an_uninterrupted_one(tmp_path, tiny_wan, shape_images):
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.commands import TrainCommands

    class StopAt(TrainCallbacks):
        def __init__(self, commands):
            self.commands = commands

        def on_progress(self, progress):
            if progress.step == 2:
                self.commands.stop()

    overlay = {"model": {"family": "wan"}, "schedule": {"epochs": 2, "batch_size": 2}}  # 4 images: 4 steps
    straight = GenericTrainer(train_config(tiny_wan, shape_images, tmp_path / "straight", overlay))
    straight.start()
    straight.train()
    config = train_config(tiny_wan, shape_images, tmp_path / "stopped", overlay)
    commands = TrainCommands()
    first = GenericTrainer(config, StopAt(commands), commands)
    first.start()
    first.train()
    assert first.step == 2
    halfway = {k: v.clone() for k, v in first.adapters.state_dict().items()}
    resumed = GenericTrainer(config.model_copy(update={"backup": config.backup.model_copy(update={"resume": True})}))
    resumed.start()
    resumed.train()
    assert resumed.step == straight.step == 4
    expected, actual = straight.adapters.state_dict(), resumed.adapters.state_dict()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    assert any(not torch.equal(halfway[k], expected[k]) for k in expected)  # not vacuous


def test_the_guard_stops_a_run_whose_block_trains_a_copy(tmp_path, tiny_wan, one_image, monkeypatch):
    """A Wan block wrapped as issue 4 describes (an fp16 block run as a deep fp32 copy each forward)
    with the naive hook: the guard stops the run naming the block's adapters; ours trains."""
    from test_adapter_guard import CastingWrapper, naive_hook

    from modules.adapters.base import AdapterModule
    from modules.model.wan import WanFamily
    from modules.trainer.guards import TrainingError

    real_load = WanFamily.load

    def load_and_wrap(family):
        real_load(family)
        family.transformer.blocks[0] = CastingWrapper(family.transformer.blocks[0])

    monkeypatch.setattr(WanFamily, "load", load_and_wrap)
    config = train_config(tiny_wan, one_image, tmp_path, {"model": {"family": "wan"}, "schedule": {"max_steps": 1}})
    ours = GenericTrainer(config)
    ours.start()
    wrapped = [a.name for a in ours.adapters if a.name.startswith("lora_unet_blocks_0_")]
    assert wrapped
    ours.train()
    assert ours.step == 1
    monkeypatch.setattr(AdapterModule, "hook", naive_hook)
    naive = GenericTrainer(config.model_copy(update={"workspace_dir": str(tmp_path / "naive")}))
    naive.start()
    with pytest.raises(TrainingError, match="received no gradient") as error:
        naive.train()
    assert naive.step == 0 and all(name in str(error.value) for name in wrapped)


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))


def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads


@pytest.mark.parametrize("fmt", ["kohya", "comfy", "diffusers"])
def test_a_saved_file_reads_back_into_the_trainers_adapters(family, tmp_path, fmt):
    """Transformer and UMT5 adapters (ComfyUI's `text_encoders.umt5xxl.transformer.` names in kohya
    and comfy files) load back into a fresh adapter set unchanged."""
    from modules.adapters.adapter_set import build_adapter_set
    from modules.adapters.formats.files import load_adapter_file
    from modules.config.train_config import AdapterConfig

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    try:
        save_adapter_file(tmp_path / "a.safetensors", adapters, family, fmt, torch.float32, {})
        state = adapters.state_dict()
    finally:
        adapters.unhook()
    if fmt != "diffusers":
        from safetensors import safe_open

        with safe_open(str(tmp_path / "a.safetensors"), "pt") as file:
            assert any(k.startswith("text_encoders.umt5xxl.transformer.encoder.block.0.") for k in file.keys())  # noqa: SIM118
    again = build_adapter_set(family, AdapterConfig(rank=4, alpha=2, layer_preset="all-linear"),
                              ["transformer", "text_encoder"], torch.device("cpu"))
    try:
        load_adapter_file(tmp_path / "a.safetensors", again, family)
        assert all(torch.allclose(tensor, state[key], atol=1e-7) for key, tensor in again.state_dict().items())
    finally:
        again.unhook()


@pytest.mark.parametrize("mp4", [True, False], ids=["mp4", "webp-fallback"])
def test_a_video_prompt_writes_a_video_with_a_poster(family, tmp_path, monkeypatch, mp4):
    """sampling.prompts[i].frames > 1: the sample is an H.264 .mp4 (an animated .webp where PyAV's
    encoder is missing) of that many frames at Wan's 16 fps, its first frame as the .png the run reports."""
    from PIL import Image

    from modules.config.train_config import SamplePromptConfig
    from modules.sampling import video_writer
    from modules.sampling.sampler import sample_prompts

    if not mp4:
        monkeypatch.setattr(video_writer, "mp4_encoder_available", lambda: False)
    prompt = SamplePromptConfig(prompt="a red circle", steps=2, cfg=1.0, width=32, height=32, seed=3, frames=5)
    (poster,) = sample_prompts(family, [prompt], tmp_path, 7, torch.device("cpu"))
    assert poster.name == "step0000007-0.png" and Image.open(poster).size == (32, 32)
    if mp4:
        import av

        with av.open(str(poster.with_suffix(".mp4"))) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and float(stream.average_rate) == 16.0
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    else:
        with Image.open(poster.with_suffix(".webp")) as video:
            frames = [np.asarray(video.seek(i) or video.convert("RGB")) for i in range(video.n_frames)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    def luma(rgb):  # (H.264 halves the colour resolution: compare brightness)
        return np.asarray(rgb, dtype=np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)

    first = luma(Image.open(poster).convert("RGB"))
    assert np.abs(luma(frames[0]) - first).mean() < 4 < np.abs(luma(frames[0]) - luma(frames[0][::-1])).mean()


@pytest.mark.parametrize("family_name, frames, message", [
    ("wan", 6, r"sampling\.prompts\[0\]\.frames: 6 is not 1 \+ 4 x n.*\(e\.g\. 5 or 9\)"),
    ("sd15", 5, r"sampling\.prompts\[0\]\.frames: 5, but Stable Diffusion 1\.5 trains and samples still images only"),
])
def test_the_preflight_refuses_a_frame_count_the_family_cannot_take(tmp_path, shape_images, family_name, frames,
                                                                     message):
    from modules.trainer.preflight import preflight_problems

    config = train_config(tmp_path, shape_images, tmp_path, {"model": {"family": family_name}, "sampling": {
        "prompts": [{"prompt": "a", "frames": frames}]}})
    assert any(re.match(message, problem) for problem in preflight_problems(config)), preflight_problems(config)


def test_a_full_fine_tune_saves_a_transformer_diffusers_loads(tmp_path, tiny_wan, one_image):
    from diffusers import WanTransformer3DModel

    config = train_config(tiny_wan, one_image, tmp_path, {
        "model": {"family": "wan"}, "method": {"type": "fine_tune", "save_format": "diffusers"},
        "optimizer": {"lr": 1e-3}, "schedule": {"max_steps": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    trainer.end()
    trained = {k: v.float() for k, v in trainer.family.transformer.state_dict().items()}
    loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "out" / "lora" / "transformer")).state_dict()
    original = WanTransformer3DModel.from_pretrained(str(tiny_wan / "transformer")).state_dict()
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[k].float(), trained[k]) for k in trained)
    assert any(not torch.equal(loaded[k], original[k]) for k in original)  # it trained
