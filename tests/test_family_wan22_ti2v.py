"""Wan 2.2 TI2V 5B on a tiny offline model (UMT5, a 48-channel WanTransformer3DModel, the Wan 2.2
kind of AutoencoderKLWan: residual blocks, 2x2-patchified frames, z_dim 48): a LoRA trains on a
clip and an image, text- and image-to-video, and the loss falls; the transformer gets the
timesteps WanPipeline and WanImageToVideoPipeline give it (`expand_timesteps`: one per token, the
condition frame's 0); the latents are normalised as the pipelines normalise them; files load in
`WanPipeline.load_lora_weights` with equal outputs and through ComfyUI's key map; the model class's
skip and keep-in-fp32 lists hold; sample videos (from a prompt, and from a prompt image) are
written at 24 fps; its folder is told apart from Wan 2.1's; a resumed run and one with half the
transformer parked train the adapter of a plain run; fp8 and nf4 base weights train; a full
fine-tune saves a folder diffusers loads."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    initializes_and_steps,
    offloaded_training_matches,
    perturbed_adapters,
    prediction_with,
    resumed_training_matches,
)
from test_video_data import write_clip

from modules.adapters.formats.files import format_warnings, save_adapter_file
from modules.trainer.generic_trainer import GenericTrainer

CHANNELS = 48


@pytest.fixture(scope="session")
def tiny_ti2v(tiny_family_model):
    return tiny_family_model("wan22_ti2v")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_ti2v, shape_images):
    from modules.model.wan22_ti2v import Wan22TI2VFamily

    family = Wan22TI2VFamily(train_config(tiny_ti2v, shape_images, tmp_path_factory.mktemp("ti2v"),
                                          {"model": {"family": "wan22_ti2v"}}))
    family.load()
    return family


@pytest.fixture(scope="module")
def clip_and_image(tmp_path_factory, shape_images):
    """A concept of one 5-frame clip, and one of one still image."""
    clips, images = tmp_path_factory.mktemp("ti2v-clip"), tmp_path_factory.mktemp("ti2v-image")
    write_clip(clips / "walk.mp4", 5, fps=24)
    (clips / "walk.txt").write_text("a square moving right")
    first = sorted(shape_images.glob("*.png"))[0]
    shutil.copy(first, images / first.name)
    shutil.copy(first.with_suffix(".txt"), images / first.with_suffix(".txt").name)
    return clips, images


def _captured(module, calls: list):
    return module.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)


def test_a_lora_trains_on_a_clip_and_an_image_and_the_loss_falls(tmp_path, tiny_ti2v, clip_and_image):
    """Half the clip steps image-to-video (model.image_to_video 0.5), the image's text-to-video."""
    from safetensors import safe_open

    clips, images = clip_and_image
    config = train_config(tiny_ti2v, images, tmp_path, {
        "model": {"family": "wan22_ti2v", "image_to_video": 0.5}, "data": {"resolution": 32},
        "concepts": [{"path": str(clips), "video": {"frames": 5}}, {"path": str(images)}],
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 12, "batch_size": 1},
        "optimizer": {"lr": 2e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    shapes = sorted(tuple(trainer.dataset.collate([i], trainer.device).latents.shape) for i in range(2))
    assert shapes == [(1, CHANNELS, 2, 4, 4), (1, CHANNELS, 4, 4)]  # 5 frames -> 2 latent frames; 32 px / 8

    def losses():
        return [fixed_loss_of(trainer, i) for i in range(2)]

    before = losses()
    trainer.train()  # the first step's guard checks every adapter learned
    after = losses()
    path = trainer.end()
    assert all(a < b * 0.8 for a, b in zip(after, before)), (before, after)
    with safe_open(str(path), "pt") as file:
        assert file.metadata()["ss_base_model_version"] == "wan_2.2_ti2v_5b"
        assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in set(file.keys())


def fixed_loss_of(trainer, index: int) -> float:
    original = trainer.dataset.collate
    trainer.dataset.collate = lambda indices, device: original([index], device)
    try:
        return fixed_loss(trainer, draws=4)
    finally:
        trainer.dataset.collate = original


@pytest.mark.parametrize("prompt_image", [False, True], ids=["text-to-video", "image-to-video"])
def test_the_transformer_gets_the_pipelines_timesteps_and_condition(family, tmp_path, prompt_image):
    """WanPipeline (expand_timesteps) hands the transformer (B, F x h/2 x w/2) timesteps; with a prompt
    image WanImageToVideoPipeline puts the image's latents in the first frame with timestep 0. The
    family's training pass gives the same at the pipeline's sigma; its image-to-video step keeps the
    clip's first latent frame clean and its loss leaves that frame out."""
    from PIL import Image

    from modules.config.train_config import SamplePromptConfig

    calls = []
    image = tmp_path / "first.png"
    Image.effect_noise((32, 32), 60).convert("RGB").save(image)
    prompt = SamplePromptConfig(prompt="a red circle", steps=2, cfg=1.0, width=32, height=32, seed=3, frames=5,
                                control_images=[str(image)] if prompt_image else [])
    handle = _captured(family.transformer, calls)
    try:
        with torch.no_grad():
            family.sample_video(prompt, torch.device("cpu"))
    finally:
        handle.remove()
    seen = calls[0]
    latents = seen["hidden_states"]
    assert latents.shape == (1, CHANNELS, 2, 4, 4) and seen["timestep"].shape == (1, 2 * 2 * 2)
    sigma = seen["timestep"].max() / 1000
    text = {"hidden_states": seen["encoder_hidden_states"]}
    mine = []
    handle = _captured(family.transformer, mine)
    try:
        with torch.no_grad():
            family.denoise(latents, sigma.view(1), text, clean_first_frame=prompt_image)
    finally:
        handle.remove()
    assert torch.allclose(mine[0]["timestep"], seen["timestep"].float(), atol=1e-3)
    first_frame_tokens = seen["timestep"][0, :4]
    assert (first_frame_tokens == 0).all() if prompt_image else (first_frame_tokens > 0).all()
    if prompt_image:  # the condition is the image's latents, as the family encodes a clip's first frame
        pixels = torch.from_numpy(np.array(Image.open(image), dtype=np.float32)).permute(2, 0, 1)[None] / 127.5 - 1
        with torch.no_grad():
            assert torch.allclose(latents[:, :, 0], family.encode_images(pixels), atol=1e-4)

        # the image-to-video training step: first latent frame clean, timestep 0 there, loss after it
        clip = torch.randn(1, CHANNELS, 2, 4, 4)
        config = family.config
        family.config = config.model_copy(update={"model": config.model.model_copy(update={"image_to_video": 1.0})})
        steps = []
        handle = _captured(family.transformer, steps)
        try:
            with torch.no_grad():
                out = family.predict(clip, text, torch.Generator().manual_seed(0))
        finally:
            handle.remove()
            family.config = config
        assert torch.equal(steps[0]["hidden_states"][:, :, 0], clip[:, :, 0])
        assert not torch.equal(steps[0]["hidden_states"][:, :, 1], clip[:, :, 1])
        assert (steps[0]["timestep"][0, :4] == 0).all() and (steps[0]["timestep"][0, 4:] > 0).all()
        assert out.prediction.shape == out.target.shape == (1, CHANNELS, 1, 4, 4)


def test_the_latents_are_normalised_as_the_pipeline_normalises_them(family):
    """WanImageToVideoPipeline.prepare_latents encodes its image and normalises it by the VAE config's
    latents_mean / latents_std: the family's latents of that image, and of a clip starting with it
    (the causal VAE encodes the first frame alone), are those."""
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=family.parts["vae"], scheduler=None,
                                   transformer=None, expand_timesteps=True)
    clip = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        _, condition, mask = pipe.prepare_latents(clip[:, :, 0], 1, CHANNELS, 32, 32, 5, torch.float32,
                                                  torch.device("cpu"), torch.Generator().manual_seed(0))
        image_latents = family.encode_images(clip[:, :, 0])
        clip_latents = family.encode_images(clip)
    raw = family.parts["vae"].encode(clip[:, :, :1]).latent_dist.mean
    assert (raw - condition).abs().max() > 0.1  # the statistics are not 0 and 1: the normalisation is seen
    assert torch.allclose(condition[:, :, 0], image_latents, atol=1e-5)
    assert torch.allclose(condition[:, :, 0], clip_latents[:, :, 0], atol=1e-5)
    assert mask[0, 0, :, 0, 0].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("fmt, preset", [("comfy", "attn"), ("kohya", "attn-mlp"), ("diffusers", "all-linear")])
def test_load_lora_weights_matches_the_hooked_model(family, tiny_ti2v, tmp_path, fmt, preset):
    """The Wan layouts (ComfyUI's `diffusion_model.<original name>`, musubi-tuner's
    `lora_unet_blocks_N_*`, diffusers' `transformer.<module>`) land on every layer of the 5B's
    transformer in WanPipeline and compute what the hooked model computes."""
    from diffusers import WanPipeline

    adapters = perturbed_adapters(family, ["transformer"], layer_preset=preset)
    try:
        path = tmp_path / f"ti2v-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours = prediction_with(family, family.transformer, CHANNELS)
        wanted = {adapters.module_name_of[n] for n in adapters.modules}
        assert [w for w in format_warnings(fmt, adapters, family) if "load_lora_weights" in w] == []
    finally:
        adapters.unhook()
    plain = prediction_with(family, family.transformer, CHANNELS)
    pipe = WanPipeline.from_pretrained(str(tiny_ti2v), local_files_only=True)
    assert pipe.config.expand_timesteps
    pipe.load_lora_weights(str(path))
    assert wanted <= {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}  # no key dropped
    theirs = prediction_with(family, pipe.transformer, CHANNELS)
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])  # kohya: musubi-tuner's names, which ComfyUI also maps
def test_comfyui_applies_every_module_of_a_comfy_or_kohya_file(family, tmp_path, fmt):
    from modules.saving.consumers.check import check_file

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    try:
        save_adapter_file(tmp_path / f"{fmt}.safetensors", adapters, family, fmt, torch.float32, {})
        count = len(adapters)
    finally:
        adapters.unhook()
    assert check_file(tmp_path / f"{fmt}.safetensors", family)["ComfyUI"] == {"applied": count, "total": count,
                                                                             "dropped": []}


def test_the_model_classes_skip_and_keep_in_fp32_lists_hold(tmp_path, tiny_ti2v, shape_images):
    """With fp8 blocks, WanTransformer3DModel's `_keep_in_fp32_modules` (time embedder, norms,
    `scale_shift_table`) stay float32 and its `_skip_layerwise_casting_patterns` keep the condition
    embedder dense, on the 5B's transformer as on Wan 2.1's."""
    from modules.model.wan22_ti2v import Wan22TI2VFamily
    from modules.quantization.base import QuantizedLinear

    family = Wan22TI2VFamily(train_config(tiny_ti2v, shape_images, tmp_path, {
        "model": {"family": "wan22_ti2v", "parts": {"transformer": {"weight_dtype": "float8"}}},
        "train_dtype": "bfloat16"}))
    family.load()
    state = family.transformer.state_dict()
    kept = ("scale_shift_table", "blocks.0.scale_shift_table", "blocks.1.norm2.weight",
            "condition_embedder.time_embedder.linear_1.weight")
    assert {name: state[name].dtype for name in kept} == dict.fromkeys(kept, torch.float32)
    report = family.quantization_reports["transformer"]
    for name in ("condition_embedder.text_embedder.linear_1", "condition_embedder.time_proj"):
        assert "_skip_layerwise_casting_patterns" in report.skipped[name], report.skipped[name]
        assert not isinstance(family.transformer.get_submodule(name), QuantizedLinear)
    assert isinstance(family.transformer.get_submodule("blocks.0.attn1.to_q"), QuantizedLinear)


@pytest.mark.parametrize("prompt_image", [False, True], ids=["text-to-video", "image-to-video"])
def test_a_video_prompt_writes_a_24_fps_video(family, tmp_path, prompt_image):
    import av
    from PIL import Image

    from modules.config.train_config import SamplePromptConfig
    from modules.sampling.sampler import sample_prompts

    image = tmp_path / "first.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(image)
    prompt = SamplePromptConfig(prompt="a red circle", steps=2, cfg=2.0, width=32, height=32, seed=3, frames=5,
                                control_images=[str(image)] if prompt_image else [])
    (poster,) = sample_prompts(family, [prompt], tmp_path, 7, torch.device("cpu"))
    assert Image.open(poster).size == (32, 32)
    with av.open(str(poster.with_suffix(".mp4"))) as container:
        stream = container.streams.video[0]
        assert float(stream.average_rate) == 24.0
        assert len(list(container.decode(stream))) == 5


def test_its_folder_is_told_apart_from_wan_21s_and_its_options_are_checked(tmp_path, tiny_ti2v, shape_images):
    """model_index.json's expand_timesteps (or, for a transformer folder, its 48 input channels) says
    TI2V; without them the same files read as Wan 2.1. model.image_to_video is refused where the
    family has no such mode, training control images where the family takes them only to sample."""
    from modules.model.detect import detect_family, family_mismatch
    from modules.trainer.preflight import preflight_problems

    assert detect_family(tiny_ti2v) == detect_family(tiny_ti2v / "transformer") == "wan22_ti2v"
    wan21 = tmp_path / "wan21"
    (wan21 / "transformer").mkdir(parents=True)
    index = json.loads((tiny_ti2v / "model_index.json").read_text())
    (wan21 / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": False}))
    transformer = json.loads((tiny_ti2v / "transformer" / "config.json").read_text())
    (wan21 / "transformer" / "config.json").write_text(json.dumps({**transformer, "in_channels": 16}))
    assert detect_family(wan21) == detect_family(wan21 / "transformer") == "wan"
    assert "set model.family to 'wan22_ti2v'" in family_mismatch(tiny_ti2v, "wan")

    wan = train_config(tiny_ti2v, shape_images, tmp_path, {"model": {"family": "wan", "image_to_video": 0.5}})
    assert any(p.startswith("model.image_to_video: Wan 2.1 has no image-to-video") for p in preflight_problems(wan))
    paired = train_config(tiny_ti2v, shape_images, tmp_path, {
        "model": {"family": "wan22_ti2v"}, "concepts": [{"path": str(shape_images), "controls": {"source": "folders"}}]})
    assert any("sample prompts only" in p for p in preflight_problems(paired)), preflight_problems(paired)


def test_a_transformer_single_file_is_told_apart_by_its_channels_and_loads(family, tiny_ti2v, tiny_family_model,
                                                                         shape_images, tmp_path):
    """The TI2V transformer in ComfyUI's layout (Wan 2.1's key names) is this family's by its patch
    embedding's 48 input channels and loads the folder's tensors; a VAE file that is not a whole VAE is
    refused with its missing keys named."""
    from safetensors.torch import load_file, save_file
    from test_wan_single_file import transformer_to_original

    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.detect import detect_family, family_mismatch
    from modules.model.wan22_ti2v import Wan22TI2VFamily

    def original_file(model, name):
        state = transformer_to_original(load_file(str(next((model / "transformer").glob("*.safetensors")))))
        save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()}, str(tmp_path / name))
        return tmp_path / name

    ours, wan21 = original_file(tiny_ti2v, "ti2v.safetensors"), original_file(tiny_family_model("wan"), "t2v.safetensors")
    assert (detect_family(ours), detect_family(wan21)) == ("wan22_ti2v", "wan")
    assert "set model.family to 'wan22_ti2v'" in family_mismatch(ours, "wan")

    def from_file(vae):
        parts = {"text_encoder": {"path": str(tiny_ti2v / "text_encoder")}, "vae": {"path": str(vae)}}
        loaded = Wan22TI2VFamily(train_config(ours, shape_images, tmp_path, {"model": {"family": "wan22_ti2v",
                                                                                          "parts": parts}}))
        loaded.model_configs_dir = tiny_ti2v  # the tiny model's part configs
        loaded.load()
        return loaded

    loaded = from_file(tiny_ti2v / "vae")
    expected = family.transformer.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in loaded.transformer.state_dict().items())
    # a VAE file (read in the original layout: tests/test_wan22_vae_single_file.py) that is not a whole VAE
    vae_file = tmp_path / "wan2.2_vae.safetensors"
    save_file({"decoder.middle.0.residual.0.gamma": torch.ones(4, 1, 1, 1)}, str(vae_file))
    with pytest.raises(ModelLoadError, match=r"^model\.parts\.vae: the checkpoint in .*wan2\.2_vae\.safetensors does "
                                             r"not fit AutoencoderKLWan .*missing keys: decoder\.conv_in\.bias"):
        from_file(vae_file)


def test_a_clip_run_that_trains_image_to_video_in_part_plans(tmp_path, tiny_ti2v, shape_images):
    """The step's image-to-video draw is data on the planner's fake tensors: the plan still runs."""
    from modules.plan.run_plan import plan_run

    config = train_config(tiny_ti2v, shape_images, tmp_path, {
        "model": {"family": "wan22_ti2v", "image_to_video": 0.5}, "data": {"resolution": 32},
        "concepts": [{"path": str(shape_images), "video": {"frames": 5}}]})
    assert plan_run(config, None, None, fix=False).as_dict()["device"]["peak"] > 0


def test_a_resumed_run_ends_with_the_adapter_of_an_uninterrupted_one(tmp_path, tiny_ti2v, clip_and_image):
    """A clip and an image, half the clip's steps image-to-video: the backup holds the random state
    that draws which."""
    clips, images = clip_and_image
    resumed_training_matches(tiny_ti2v, images, tmp_path, "wan22_ti2v", {
        "model": {"image_to_video": 0.5}, "data": {"resolution": 32},
        "concepts": [{"path": str(clips), "video": {"frames": 5}}, {"path": str(images)}]})


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_ti2v, one_image):
    offloaded_training_matches(tiny_ti2v, one_image, tmp_path, "wan22_ti2v", "transformer", fake_device)


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_quantized_base_weights_initialize_and_step(tmp_path, tiny_ti2v, one_image, mode):
    initializes_and_steps(tiny_ti2v, one_image, tmp_path, "wan22_ti2v", "transformer", mode, dora=mode == "float8")


def test_a_full_fine_tune_saves_a_pipeline_folder_diffusers_loads(tmp_path, tiny_ti2v, one_image):
    """The trained transformer loads in WanTransformer3DModel, and the folder in WanPipeline with
    model_index.json's expand_timesteps kept (a setting there, not a component to copy)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    config = train_config(tiny_ti2v, one_image, tmp_path, {
        "model": {"family": "wan22_ti2v"}, "method": {"type": "fine_tune", "save_format": "diffusers"},
        "optimizer": {"lr": 1e-3}, "schedule": {"max_steps": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    trainer.end()
    trained = {k: v.float() for k, v in trainer.family.transformer.state_dict().items()}
    loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "out" / "lora" / "transformer")).state_dict()
    original = WanTransformer3DModel.from_pretrained(str(tiny_ti2v / "transformer")).state_dict()
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k].float(), trained[k]) for k in trained)
    assert any(not torch.equal(loaded[k], original[k]) for k in original)  # it trained
    assert WanPipeline.from_pretrained(str(tmp_path / "out" / "lora"), local_files_only=True).config.expand_timesteps
