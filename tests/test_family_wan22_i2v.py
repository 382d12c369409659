"""Wan 2.2 I2V A14B on a tiny offline model (tiny/wan22_i2v.py: two tiny 36-channel experts, no image
encoder, boundary_ratio 0.9): a low-noise LoRA trains on a clip conditioned on its first frame and
the loss falls while the high-noise expert rests, as it does on a still image; a sample from a
control image writes a video; the condition is WanImageToVideoPipeline's own and another first frame
changes the prediction; each expert's file loads into its own transformer of WanImageToVideoPipeline
with no key dropped and equal outputs (and through ComfyUI's key map); a resumed run equals an
uninterrupted one; half the expert parked trains the same adapter; fp8 and nf4 base weights train;
the skip and keep-in-fp32 lists hold on both experts; the folder is told from Wan 2.1 I2V and Wan
2.2 T2V before any weight loads; the planner steps with the conditioning; a full fine-tune of both
experts on a clip saves folders WanTransformer3DModel loads with the trained weights."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import initializes_and_steps, offloaded_training_matches, perturbed_adapters, resumed_training_matches
from sliding_clips import sliding_clip_concept

from modules.adapters.formats.files import format_warnings, save_adapter_file

EXPERTS = ("transformer", "transformer_2")
LOW_NOISE_ONLY = {"model": {"family": "wan22_i2v", "parts": {"transformer": {"train": False}}}}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """A video concept (one captioned 5-frame clip as a frame folder) and a still image elsewhere."""
    return sliding_clip_concept(tmp_path_factory, "wan22-i2v", 16)


@pytest.fixture(scope="module")
def tiny(tiny_family_model):
    return tiny_family_model("wan22_i2v")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny, clips):
    from modules.model.wan22_i2v import Wan22I2VFamily

    family = Wan22I2VFamily(train_config(tiny, clips[0], tmp_path_factory.mktemp("wan22-i2v"),
                                         {"model": {"family": "wan22_i2v"}}))  # both experts train by default
    family.load()
    return family


def _clip(seed: int, first: int | None = None) -> torch.Tensor:
    """(1, 3, 5, 16, 16) frames in [-1, 1]; `first`: the first frame of the clip of that seed."""
    def frames(s):
        return torch.randint(0, 256, (1, 3, 5, 16, 16), generator=torch.Generator().manual_seed(s)).float() / 127.5 - 1

    pixels = frames(seed)
    if first is not None:
        pixels[:, :, 0] = frames(first)[:, :, 0]
    return pixels


def _conditioning(family, seed: int = 0, first: int | None = None) -> dict:
    with torch.no_grad():
        return {**family.encode_text(family.tokenize(["a red circle"])),
                **family.encode_pixel_conditioning(_clip(seed, first))}


def _outputs(family, transformers: dict, text: dict) -> dict:
    """Each expert's velocity on fixed latents, with `transformers` in place of the family's own."""
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    original = {e: family.parts[e] for e in EXPERTS}
    family.parts.update(transformers)
    try:
        with torch.no_grad():
            return {e: family.run_transformer(e, latents, torch.tensor([0.5]), text) for e in EXPERTS}
    finally:
        family.parts.update(original)


def test_a_low_noise_lora_trains_on_a_clip_and_samples_a_video_from_an_image(tmp_path, tiny, clips, fake_device):
    import av
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[0], tmp_path, LOW_NOISE_ONLY, {
        "data": {"resolution": 16}, "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}],
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 12, "batch_size": 1}, "optimizer": {"lr": 3e-2},
        "train_device": str(fake_device),
        "sampling": {"prompts": [{"prompt": "a square sliding", "steps": 2, "cfg": 1.0, "width": 16, "height": 16,
                                  "frames": 5, "control_images": [str(clips[1])]}]},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    family = trainer.family
    assert family.denoiser_part == "transformer_2" and family.resting_parts() == ("transformer",)
    assert {p.device.type for p in family.parts["transformer"].parameters()} == {"cpu"}
    batch = trainer.dataset.collate([0], trainer.device)
    assert {k: v.shape for k, v in batch.pixel_conditioning.items()} == {"image_condition": (1, 20, 2, 4, 4)}
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard: every adapter learned
    after = fixed_loss(trainer, draws=8)
    assert after < before * 0.8, (before, after)
    (poster,) = trainer.sample()  # both experts, the resting one streamed in for its steps
    with av.open(str(poster.with_suffix(".mp4"))) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    assert {p.device.type for p in family.parts["transformer"].parameters()} == {"cpu"}
    path = trainer.end()
    assert path.name == "lora-low_noise.safetensors"
    with safe_open(str(path), "pt") as file:
        assert file.metadata()["ss_base_model_version"] == "wan_2.2_i2v_a14b"
        assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in set(file.keys())


def test_a_low_noise_lora_trains_on_a_still_image_and_the_loss_falls(tmp_path, tiny, clips):
    """A still image: a one-frame video, its own first frame the condition."""
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[1].parent, tmp_path, LOW_NOISE_ONLY, {
        "data": {"resolution": 16}, "adapter": {"layer_preset": "attn-mlp"},
        "schedule": {"epochs": 12, "batch_size": 1}, "optimizer": {"lr": 3e-2}})
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).latents.shape == (1, 16, 4, 4)
    before = fixed_loss(trainer, draws=8)
    trainer.train()
    after = fixed_loss(trainer, draws=8)
    assert after < before * 0.8, (before, after)

def test_the_condition_is_the_pipelines_and_only_the_first_frame_conditions(family):
    """WanImageToVideoPipeline.prepare_latents' condition ([mask (4), condition latents (16)]) for the
    clip's first frame is the family's (no image embeddings: the pipeline has no image encoder and
    its experts no image_dim); another first frame changes each expert's prediction."""
    pixels = _clip(0)
    with torch.no_grad():
        ours = family.encode_pixel_conditioning(pixels)
        _, condition = family.pipeline().prepare_latents(pixels[:, :, 0], 1, 16, 16, 16, 5, torch.float32,
                                                         torch.device("cpu"), torch.Generator().manual_seed(0))
    assert set(ours) == {"image_condition"} and family.pipeline().image_encoder is None
    assert condition.shape == ours["image_condition"].shape == (1, 20, 2, 4, 4)
    assert (condition - ours["image_condition"]).abs().max() < 1e-5
    plain = _outputs(family, {}, _conditioning(family, 0))
    same_first = _outputs(family, {}, _conditioning(family, 1, first=0))
    other_first = _outputs(family, {}, _conditioning(family, 0, first=2))
    for expert in EXPERTS:
        assert torch.equal(same_first[expert], plain[expert]), expert
        assert (other_first[expert] - plain[expert]).abs().max() > 1e-3, expert
    with pytest.raises(ValueError, match="first-frame conditioning"):
        family.denoise(torch.zeros(1, 16, 2, 4, 4), torch.tensor([0.5]), family.encode_text(family.tokenize(["a"])))


@pytest.mark.parametrize("fmt, preset", [("comfy", "attn"), ("kohya", "attn-mlp"), ("diffusers", "all-linear")])
def test_each_experts_file_loads_into_its_own_transformer_with_equal_outputs(family, tiny, tmp_path, fmt, preset):
    """Each expert's file (a lone Wan transformer's names): WanImageToVideoPipeline.load_lora_weights
    puts the high-noise file on `transformer` and, with load_into_transformer_2, the low-noise file
    on `transformer_2`, dropping no key; each computes what the trainer's hooked expert computes."""
    from diffusers import WanImageToVideoPipeline

    from modules.saving.consumers.check import check_file

    text = _conditioning(family, 0)
    adapters = perturbed_adapters(family, list(EXPERTS), layer_preset=preset)
    files = []
    try:
        for suffix, parts in family.adapter_files(list(EXPERTS)):
            written = adapters.written_as(parts, family)
            path = tmp_path / f"lora{suffix}.safetensors"
            save_adapter_file(path, written, family, fmt, torch.float32, {})
            assert [w for w in format_warnings(fmt, written, family) if "load_lora_weights" in w] == []
            files.append((suffix, path, {written.module_name_of[n] for n in written.modules}))
        ours = _outputs(family, {}, text)
    finally:
        adapters.unhook()
    plain = _outputs(family, {}, text)
    assert [suffix for suffix, *_ in files] == ["-high_noise", "-low_noise"]
    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny), local_files_only=True)
    for (suffix, path, wanted), expert in zip(files, EXPERTS):
        pipe.load_lora_weights(str(path), adapter_name=expert, **family.diffusers_load_options(suffix))
        loaded = {n for n, m in getattr(pipe, expert).named_modules() if hasattr(m, "lora_A")}
        assert wanted <= loaded, sorted(wanted - loaded)[:3]
        if fmt != "diffusers":
            report = check_file(path, family)["ComfyUI"]
            assert report["applied"] == report["total"] == len(wanted), report["dropped"][:3]
    theirs = _outputs(family, {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}, text)
    for expert in EXPERTS:
        assert (ours[expert] - plain[expert]).abs().max() > 1e-3, expert
        assert (ours[expert] - theirs[expert]).abs().max() < 1e-5, expert


def test_a_resumed_two_expert_run_ends_with_the_adapters_of_an_uninterrupted_one(tmp_path, tiny, shape_images):
    resumed_training_matches(tiny, shape_images, tmp_path, "wan22_i2v")


def test_offloading_half_the_low_noise_expert_trains_the_same_adapter(fake_device, tmp_path, tiny, one_image):
    offloaded_training_matches(tiny, one_image, tmp_path, "wan22_i2v", "transformer_2", fake_device, LOW_NOISE_ONLY)


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_quantized_base_weights_initialize_and_step(tmp_path, tiny, one_image, mode):
    initializes_and_steps(tiny, one_image, tmp_path, "wan22_i2v", "transformer_2", mode, False, LOW_NOISE_ONLY)


def test_the_skip_and_keep_in_fp32_lists_hold_on_both_36_channel_experts(tmp_path, tiny, one_image):
    """WanTransformer3DModel's `_keep_in_fp32_modules` and `_skip_layerwise_casting_patterns` (their
    union) on each expert stored in float8, as the I2V A14B LoRA preset stores them: the time embedder,
    norms and modulation tables float32, the condition embedder dense, the blocks quantized."""
    from modules.model.wan22_i2v import Wan22I2VFamily
    from modules.quantization.base import QuantizedLinear

    kept = ("scale_shift_table", "blocks.0.scale_shift_table", "blocks.1.norm2.weight",
            "condition_embedder.time_embedder.linear_1.weight")
    parts = dict.fromkeys(EXPERTS, {"weight_dtype": "float8"})
    family = Wan22I2VFamily(train_config(tiny, one_image, tmp_path, {
        "model": {"family": "wan22_i2v", "parts": parts}, "train_dtype": "bfloat16"}))
    family.load()
    for expert in EXPERTS:
        state = family.parts[expert].state_dict()
        assert {name: state[name].dtype for name in kept} == dict.fromkeys(kept, torch.float32), expert
        assert state["condition_embedder.text_embedder.linear_1.weight"].dtype == torch.bfloat16, expert
        report = family.quantization_reports[expert]
        for name in ("condition_embedder.text_embedder.linear_1", "condition_embedder.time_proj"):
            assert "_skip_layerwise_casting_patterns" in report.skipped[name], (expert, report.skipped[name])
            assert not isinstance(family.parts[expert].get_submodule(name), QuantizedLinear), expert
        assert isinstance(family.parts[expert].get_submodule("blocks.0.attn1.to_q"), QuantizedLinear), expert


def test_the_folder_is_told_apart_before_weights_load_and_the_planner_steps_with_the_condition(
        tmp_path, tiny, tiny_family_model, clips):
    from modules.config.loading import build_config
    from modules.model.detect import detect_family, family_mismatch
    from modules.plan.architecture import build_architecture
    from modules.plan.run_plan import plan_run
    from modules.trainer.preflight import preflight_problems

    assert detect_family(tiny) == "wan22_i2v"
    assert detect_family(tiny_family_model("wan_i2v")) == "wan_i2v"
    assert detect_family(tiny_family_model("wan22")) == "wan22"
    assert "set model.family to 'wan22_i2v'" in family_mismatch(tiny, "wan_i2v")
    assert detect_family(tiny / "transformer") != "wan22_i2v"  # one expert alone is not the model
    config = train_config(tiny, clips[0], tmp_path, LOW_NOISE_ONLY, {
        "data": {"resolution": 16}, "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}]})
    plan = plan_run(config, 2**30, 2**34, fix=False)
    assert sum(plan.parts["transformer"].device.values()) == 0 and plan.parts["transformer"].parked > 0
    assert plan.parts["transformer_2"].device["activations"] > 0
    released = build_architecture(build_config([{"model": {"family": "wan22_i2v"}}]),
                                  dict.fromkeys(("text_encoder", *EXPERTS, "vae"), "bfloat16")).family
    counted = {e: sum(p.numel() for p in released.parts[e].parameters()) for e in EXPERTS}
    assert counted == {e: released.nominal_part_parameters[e] for e in EXPERTS}
    assert released.boundary_ratio == 0.9 and released.noise_scheduler.config.flow_shift == 3.0
    no_image = train_config(tiny, clips[0], tmp_path, {"model": {"family": "wan22_i2v"},
                                                       "sampling": {"prompts": [{"prompt": "a", "frames": 5}]}})
    assert any(p.startswith("sampling.prompts[0].control_images: none given; Wan 2.2 I2V A14B samples from 1")
               for p in map(str, preflight_problems(no_image))), preflight_problems(no_image)


def test_a_full_fine_tune_of_both_experts_saves_transformers_diffusers_loads(tmp_path, tiny, clips):
    """`save_format` auto, as the full fine-tune preset saves: the pipeline folder with each trained
    expert in its own transformer/ or transformer_2/, each loaded by WanTransformer3DModel with the
    trained weights, and the whole WanImageToVideoPipeline (no image encoder, boundary_ratio 0.9)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[0], tmp_path, {
        "model": {"family": "wan22_i2v"}, "data": {"resolution": 16},  # both experts train by default
        "concepts": [{"path": str(clips[0]), "video": {"frames": 5}, "repeats": 4}],
        "method": {"type": "fine_tune", "save_format": "auto"}, "optimizer": {"lr": 1e-3},
        # noise levels drawn about evenly either side of the boundary, so both experts meet samples in two steps
        "loss": {"logit_mean": 1.0}, "schedule": {"max_steps": 2, "batch_size": 4}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    assert trainer.family.trained_parts_not_run() == set()  # each expert met a sample of its timesteps
    saved = trainer.end()
    assert saved == tmp_path / "out" / "lora" and saved.is_dir()
    for expert in EXPERTS:
        trained = {k: v.float() for k, v in trainer.family.parts[expert].state_dict().items()}
        loaded = WanTransformer3DModel.from_pretrained(str(saved / expert)).state_dict()
        original = WanTransformer3DModel.from_pretrained(str(tiny / expert)).state_dict()
        assert set(loaded) == set(trained), expert
        assert all(torch.equal(loaded[k].float(), trained[k]) for k in trained), expert
        assert any(not torch.equal(loaded[k], original[k]) for k in original), expert  # it trained
    pipe = WanImageToVideoPipeline.from_pretrained(str(saved), local_files_only=True)
    assert pipe.image_encoder is None and pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.9
