"""Wan 2.1 I2V on a tiny offline model (tiny/wan_i2v.py: Wan 2.1's pieces with a 36-channel
transformer, image cross-attention and a tiny CLIPVisionModel): a LoRA trains on a clip, its first
frame the condition, and the loss falls, as it does on a still image; the transformer's condition
(mask and condition latents) and image embeddings are WanImageToVideoPipeline's own for the same
first frame, and cached with the clip's latents; another first frame changes the prediction; the
saved layouts load in `WanImageToVideoPipeline.load_lora_weights` with no key dropped and equal
outputs, and through ComfyUI's key map; the model class's skip and keep-in-fp32 lists hold for the
image layers; a sample prompt with an image writes a video, and one without is refused before the
run; a resumed run and one with half the transformer parked train the adapter of a plain run; fp8
and nf4 base weights train; a full fine-tune on a clip saves a folder whose transformer
WanTransformer3DModel loads with the trained weights."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import initializes_and_steps, offloaded_training_matches, perturbed_adapters, resumed_training_matches
from sliding_clips import sliding_clip_concept
from PIL import Image

from modules.adapters.formats.files import format_warnings, save_adapter_file


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """A video concept (one captioned 5-frame clip as a frame folder) and a still image elsewhere."""
    return sliding_clip_concept(tmp_path_factory, "i2v", 32)


@pytest.fixture(scope="module")
def tiny(tiny_family_model):
    return tiny_family_model("wan_i2v")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny, clips):
    from modules.model.wan_i2v import WanI2VFamily

    family = WanI2VFamily(train_config(tiny, clips[0], tmp_path_factory.mktemp("i2v"), {"model": {"family": "wan_i2v"}}))
    family.load()
    return family


def _clip(seed: int, first: int | None = None) -> torch.Tensor:
    """(1, 3, 5, 16, 16) frames in [-1, 1] on 8-bit levels, as decoded clips are; `first`: the
    first frame of the clip of that seed instead of its own."""
    def frames(s):
        return torch.randint(0, 256, (1, 3, 5, 16, 16), generator=torch.Generator().manual_seed(s)).float() / 127.5 - 1

    pixels = frames(seed)
    if first is not None:
        pixels[:, :, 0] = frames(first)[:, :, 0]
    return pixels


_CONDITIONING: dict[tuple, dict] = {}


def _prediction(family, transformer, seed: int, first: int | None = None) -> torch.Tensor:
    """The family's velocity on fixed latents and prompt, conditioned on _clip(seed, first), with
    `transformer` in place of its own (a diffusers pipeline's, with a file loaded)."""
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    original = family.parts["transformer"]
    family.parts["transformer"] = transformer
    try:
        with torch.no_grad():
            if (seed, first) not in _CONDITIONING:
                _CONDITIONING[seed, first] = {**family.encode_text(family.tokenize(["a red circle"])),
                                              **family.encode_pixel_conditioning(_clip(seed, first))}
            return family.denoise(latents, torch.tensor([0.5]), _CONDITIONING[seed, first])
    finally:
        family.parts["transformer"] = original


def test_a_lora_trains_on_a_clip_conditioned_on_its_first_frame_and_the_loss_falls(tmp_path, tiny, clips):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[0], tmp_path, {
        "model": {"family": "wan_i2v"}, "data": {"resolution": 16},
        "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}],
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 15, "batch_size": 1}, "optimizer": {"lr": 2e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    batch = trainer.dataset.collate([0], trainer.device)
    assert batch.latents.shape == (1, 16, 2, 4, 4)
    # the first frame's condition and CLIP embeddings came from the latent cache, as encoded from the window
    from modules.data.video import load_entry_pixels

    with torch.no_grad():
        fresh = trainer.family.encode_pixel_conditioning(load_entry_pixels(trainer.dataset.entries[0], 16, 16)[None])
    assert {k: v.shape for k, v in batch.pixel_conditioning.items()} == {
        "image_condition": (1, 20, 2, 4, 4), "image_embeds": (1, 17, 32)}
    assert all(torch.allclose(batch.pixel_conditioning[k], fresh[k], atol=1e-5) for k in fresh)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard: every adapter learned, the image cross-attention's too
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = set(file.keys())
        assert file.metadata()["ss_base_model_version"] == "wan_2.1_i2v"
    for stem in ("lora_unet_blocks_0_cross_attn_k_img", "lora_unet_blocks_1_cross_attn_v_img",
                 "lora_unet_blocks_0_self_attn_q", "lora_unet_blocks_1_ffn_2"):
        assert f"{stem}.lora_down.weight" in keys, stem


def test_the_transformer_input_is_the_pipelines_for_the_same_first_frame(family):
    """WanImageToVideoPipeline.prepare_latents' condition ([mask (4), condition latents (16)]) and
    encode_image's embeddings, for the clip's first frame, are the family's; a still image is a
    one-frame clip (its condition 4-D like its latents)."""
    pixels = _clip(0)
    with torch.no_grad():
        ours = family.encode_pixel_conditioning(pixels)
        pipe = family.pipeline()
        _, condition = pipe.prepare_latents(pixels[:, :, 0], 1, 16, 16, 16, 5, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(0))
        first = Image.fromarray(((pixels[0, :, 0] + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
        embeds = pipe.encode_image(first, torch.device("cpu"))
        still = family.encode_pixel_conditioning(pixels[:, :, 0])
    assert condition.shape == ours["image_condition"].shape == (1, 20, 2, 4, 4)
    assert (condition - ours["image_condition"]).abs().max() < 1e-5
    assert ours["image_condition"][:, :4, 0].eq(1).all() and ours["image_condition"][:, :4, 1:].eq(0).all()
    assert (embeds - ours["image_embeds"]).abs().max() < 1e-5
    assert still["image_condition"].shape == (1, 20, 4, 4)
    assert torch.allclose(still["image_embeds"], ours["image_embeds"])


def test_another_first_frame_changes_the_prediction(family):
    plain = _prediction(family, family.transformer, 0)
    # only the first frame conditions: clip 1 with clip 0's first frame is clip 0 to the transformer
    assert torch.equal(_prediction(family, family.transformer, 1, first=0), plain)
    assert (_prediction(family, family.transformer, 0, first=2) - plain).abs().max() > 1e-3
    with pytest.raises(ValueError, match="first-frame conditioning"):
        family.denoise(torch.zeros(1, 16, 2, 4, 4), torch.tensor([0.5]), family.encode_text(family.tokenize(["a"])))


@pytest.mark.parametrize("fmt, preset", [("comfy", "attn"), ("kohya", "attn-mlp"), ("diffusers", "all-linear")])
def test_load_lora_weights_matches_the_hooked_model(family, tiny, tmp_path, fmt, preset):
    """comfy `diffusion_model.blocks.N.cross_attn.k_img`, kohya (musubi-tuner) `lora_unet_blocks_N_cross_attn_k_img`,
    diffusers `transformer.<module>`: every adapter, the image cross-attention's too, lands on a layer
    of WanImageToVideoPipeline and computes what the trainer's hooked model computes."""
    from diffusers import WanImageToVideoPipeline

    adapters = perturbed_adapters(family, ["transformer"], layer_preset=preset)
    try:
        path = tmp_path / f"i2v-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours = _prediction(family, family.transformer, 0)
        wanted = {adapters.module_name_of[n] for n in adapters.modules}
        assert [w for w in format_warnings(fmt, adapters, family) if "load_lora_weights" in w] == []
    finally:
        adapters.unhook()
    assert {"blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj"} <= wanted
    plain = _prediction(family, family.transformer, 0)
    pipe = WanImageToVideoPipeline.from_pretrained(str(tiny), local_files_only=True)
    pipe.load_lora_weights(str(path))
    assert wanted <= {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}  # no key dropped
    theirs = _prediction(family, pipe.transformer, 0)
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5
    if fmt != "diffusers":  # ComfyUI's key map applies every module of the file (the Wan family's save check)
        from modules.saving.consumers.check import check_file

        report = check_file(path, family)["ComfyUI"]
        assert report == {"applied": len(wanted), "total": len(wanted), "dropped": []}


def test_the_model_classes_skip_and_keep_in_fp32_lists_hold_for_the_image_layers(tmp_path, tiny, clips):
    """In float8, the image embedder stays dense (`_skip_layerwise_casting_patterns`: condition_embedder)
    with its norms in float32 (`_keep_in_fp32_modules`: norm1, norm2), and so do the blocks' image
    cross-attention norms; the image cross-attention projections are quantized like the others.
    The CLIP image encoder takes its own weight mode."""
    from modules.model.wan_i2v import WanI2VFamily
    from modules.quantization.base import QuantizedLinear

    family = WanI2VFamily(train_config(tiny, clips[0], tmp_path, {"model": {"family": "wan_i2v", "parts": {
        "transformer": {"weight_dtype": "float8"}, "image_encoder": {"weight_dtype": "bfloat16"}}},
        "train_dtype": "bfloat16"}))
    family.load()
    state = family.transformer.state_dict()
    kept = ("condition_embedder.image_embedder.norm1.weight", "condition_embedder.image_embedder.norm2.weight",
            "blocks.0.scale_shift_table", "condition_embedder.time_embedder.linear_1.weight")
    assert {name: state[name].dtype for name in kept} == dict.fromkeys(kept, torch.float32)
    report = family.quantization_reports["transformer"]
    for name in ("condition_embedder.image_embedder.ff.net.0.proj", "condition_embedder.image_embedder.ff.net.2"):
        assert "_skip_layerwise_casting_patterns" in report.skipped[name], report.skipped[name]
        assert not isinstance(family.transformer.get_submodule(name), QuantizedLinear)
    assert isinstance(family.transformer.get_submodule("blocks.0.attn2.add_k_proj"), QuantizedLinear)
    assert family.parts["image_encoder"].encoder.layers[0].mlp.fc1.weight.dtype == torch.bfloat16


def test_a_prompt_with_an_image_samples_a_video_and_one_without_is_refused(family, tmp_path, clips):
    import av

    from modules.config.train_config import SamplePromptConfig
    from modules.sampling.sampler import sample_prompts
    from modules.trainer.preflight import preflight_problems

    prompt = SamplePromptConfig(prompt="a square sliding", steps=2, cfg=2.0, width=16, height=16, seed=3, frames=5,
                                control_images=[str(clips[1])])
    (poster,) = sample_prompts(family, [prompt], tmp_path, 7, torch.device("cpu"))
    with av.open(str(poster.with_suffix(".mp4"))) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    assert Image.open(poster).size == (16, 16)
    config = train_config(family.config.model.base, clips[0], tmp_path, {"model": {"family": "wan_i2v"}, "sampling": {
        "prompts": [{"prompt": "a", "frames": 5}]}})
    assert any(p.startswith("sampling.prompts[0].control_images: none given; Wan 2.1 I2V 14B with this transformer "
                            "samples from one image, its first frame")
               for p in map(str, preflight_problems(config))), preflight_problems(config)


def test_its_folder_is_told_from_wan_2_2s_of_the_same_pipeline_class(tiny, tmp_path):
    import json
    import shutil

    from modules.model.detect import detect_family

    assert detect_family(tiny) == "wan_i2v"
    assert detect_family(tiny / "transformer") == "wan_i2v"  # a bare transformer folder: its 36 input channels
    two_experts = tmp_path / "a14b"
    shutil.copytree(tiny, two_experts, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((two_experts / "model_index.json").read_text())
    (two_experts / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.9}))
    assert detect_family(two_experts) != "wan_i2v"


def test_the_planner_steps_with_the_first_frame_conditioning_and_the_released_parts_build(tmp_path, tiny, clips):
    """The planner's fake step draws the pixel conditioning as training does (the transformer refuses
    to step without it); the released architecture (resources/model_configs/wan_i2v, no tokenizer)
    builds every part on meta with the parameter counts the family states."""
    from modules.config.loading import build_config
    from modules.plan.architecture import build_architecture
    from modules.plan.run_plan import plan_run

    config = train_config(tiny, clips[0], tmp_path, {"model": {"family": "wan_i2v"}, "data": {"resolution": 16},
                                                     "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}]})
    plan = plan_run(config, None, None, fix=False)
    assert plan.flops > 0 and plan.parts["transformer"].device["activations"] > 0
    released = build_architecture(build_config([{"model": {"family": "wan_i2v"}}]),
                                  dict.fromkeys(("text_encoder", "image_encoder", "transformer", "vae"), "bfloat16")).family
    counted = {part: sum(p.numel() for p in released.parts[part].parameters()) for part in ("image_encoder", "transformer")}
    assert counted == {part: released.nominal_part_parameters[part] for part in counted}
    assert set(released.parts) == {"text_encoder", "image_encoder", "transformer", "vae"}


def test_a_still_image_trains_as_a_one_frame_video_conditioned_on_itself_and_the_run_says_so(family, tmp_path, clips):
    from modules.data.dataset import prepare_dataset

    warnings: list[str] = []
    config = train_config(family.config.model.base, clips[1].parent, tmp_path, {
        "model": {"family": "wan_i2v"}, "data": {"resolution": 16}})
    dataset = prepare_dataset(config, family, torch.device("cpu"), tmp_path / "cache", warnings.append, cache_text=True)
    batch = dataset.collate([0], torch.device("cpu"))
    assert batch.latents.shape == (1, 16, 4, 4) and batch.pixel_conditioning["image_condition"].shape == (1, 20, 4, 4)
    assert torch.equal(batch.pixel_conditioning["image_condition"][:, 4:], batch.latents)  # its own condition
    assert [w for w in warnings if "one-frame sample(s)" in w] == [
        f"concepts[0] ({clips[1].parent}): 1 one-frame sample(s) (still images or one-frame clips, e.g. start.png): "
        f"{family.one_frame_note}"]


def test_a_lora_trains_on_a_still_image_and_the_loss_falls(tmp_path, tiny, clips):
    """A still image: a one-frame video, its own first frame the condition."""
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[1].parent, tmp_path, {
        "model": {"family": "wan_i2v"}, "data": {"resolution": 16}, "adapter": {"layer_preset": "attn-mlp"},
        "schedule": {"epochs": 15, "batch_size": 1}, "optimizer": {"lr": 2e-2}})
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).latents.shape == (1, 16, 4, 4)
    before = fixed_loss(trainer, draws=8)
    trainer.train()
    after = fixed_loss(trainer, draws=8)
    assert after < before * 0.8, (before, after)

def test_the_preflight_sizes_the_cache_with_the_first_frame_conditioning(family, tmp_path, clips):
    from modules.data.dataset import prepare_dataset
    from modules.trainer.video_preflight import BLOCK, cache_folder, estimate_video_cache

    config = train_config(family.config.model.base, clips[0], tmp_path, {
        "model": {"family": "wan_i2v"}, "data": {"resolution": 16, "flip": True},
        "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}]})
    estimate = estimate_video_cache(config, family)
    folder = cache_folder(config)[0]
    prepare_dataset(config, family, torch.device("cpu"), folder, lambda _: None, cache_text=True)
    written = [-(-entry.stat().st_size // BLOCK) * BLOCK for entry in (folder / "latents").rglob("*.safetensors")]
    assert len(written) == 1 and estimate.cache_bytes == written[0] > 2 * BLOCK  # (its latents alone: two blocks)


def test_a_resumed_run_ends_with_the_adapter_of_an_uninterrupted_one(tmp_path, tiny, clips):
    """A clip conditioned on its first frame and a still conditioned on itself, their conditions
    read from the cache by both runs."""
    resumed_training_matches(tiny, clips[0], tmp_path, "wan_i2v", {
        "data": {"resolution": 16},
        "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}, {"path": str(clips[1].parent)}]})


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny, one_image):
    offloaded_training_matches(tiny, one_image, tmp_path, "wan_i2v", "transformer", fake_device)


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_quantized_base_weights_initialize_and_step(tmp_path, tiny, one_image, mode):
    initializes_and_steps(tiny, one_image, tmp_path, "wan_i2v", "transformer", mode, dora=mode == "float8")


def test_a_full_fine_tune_on_a_clip_saves_a_transformer_diffusers_loads(tmp_path, tiny, clips):
    """`save_format` auto, as the full fine-tune preset saves: the pipeline folder, whose transformer/
    WanTransformer3DModel loads with the trained weights (the image cross-attention's too) and whose
    whole WanImageToVideoPipeline (CLIP image encoder included) loads."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[0], tmp_path, {
        "model": {"family": "wan_i2v"}, "data": {"resolution": 16},
        "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}],
        "method": {"type": "fine_tune", "save_format": "auto"}, "optimizer": {"lr": 1e-3},
        "schedule": {"max_steps": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    saved = trainer.end()
    assert saved == tmp_path / "out" / "lora" and saved.is_dir()
    trained = {k: v.float() for k, v in trainer.family.transformer.state_dict().items()}
    loaded = WanTransformer3DModel.from_pretrained(str(saved / "transformer")).state_dict()
    original = WanTransformer3DModel.from_pretrained(str(tiny / "transformer")).state_dict()
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[k].float(), trained[k]) for k in trained)
    changed = {k for k in original if not torch.equal(loaded[k], original[k])}
    assert any(".attn2.add_k_proj." in k for k in changed), sorted(changed)[:5]  # the image cross-attention trained
    pipe = WanImageToVideoPipeline.from_pretrained(str(saved), local_files_only=True)
    assert pipe.image_encoder is not None and pipe.transformer.config.in_channels == 36
