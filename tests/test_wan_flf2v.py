"""Wan 2.1 FLF2V (first-last-frame to video, issue 28) as wan_i2v's variant, on the tiny model
(`make_tiny_model(variant="flf2v")`: the I2V transformer with a position embedding over two frames'
CLIP tokens, flow_shift 16): the condition (first and last frames kept, both marked in the mask) and
the image embeddings (both frames') are WanImageToVideoPipeline's with `last_image`; the last frame
changes the prediction and the frames between do not; a LoRA trains on a clip and the loss falls; a
sample from a first and last frame writes a video that another last frame changes; its single file
(`img_emb.emb_pos`) is told before weights load, picks the FLF2V config and loads the folder's
tensors, with FLF2V's shift."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy
import pytest
import torch
from conftest import fixed_loss, train_config
from PIL import Image
from sliding_clips import sliding_clip_concept, sliding_frame

from modules.errors import UserError

SIDE = 16


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return sliding_clip_concept(tmp_path_factory, "flf2v", 32)


@pytest.fixture(scope="module")
def tiny(tiny_family_model):
    return tiny_family_model("wan_i2v", variant="flf2v")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny, clips):
    from modules.model.wan_i2v import WanI2VFamily

    family = WanI2VFamily(train_config(tiny, clips[0], tmp_path_factory.mktemp("flf2v"),
                                       {"model": {"family": "wan_i2v"}}))
    family.load()
    return family


def _clip(seed: int, last: int | None = None, middle: int | None = None) -> torch.Tensor:
    """(1, 3, 5, 16, 16) frames in [-1, 1] on 8-bit levels; `last` / `middle`: the last frame / the
    frames between from the clip of that seed."""
    def frames(s):
        return torch.randint(0, 256, (1, 3, 5, SIDE, SIDE), generator=torch.Generator().manual_seed(s)).float() / 127.5 - 1

    pixels = frames(seed)
    if last is not None:
        pixels[:, :, -1] = frames(last)[:, :, -1]
    if middle is not None:
        pixels[:, :, 1:-1] = frames(middle)[:, :, 1:-1]
    return pixels


def _picture(frame: torch.Tensor) -> Image.Image:
    return Image.fromarray(((frame + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())


def _prediction(family, pixels: torch.Tensor) -> torch.Tensor:
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        conditioning = {**family.encode_text(family.tokenize(["a red circle"])),
                        **family.encode_pixel_conditioning(pixels)}
        return family.denoise(latents, torch.tensor([0.5]), conditioning)


def test_the_condition_and_image_embeddings_are_the_pipelines_for_the_same_first_and_last_frames(family):
    pixels = _clip(0)
    first, last = pixels[:, :, 0], pixels[:, :, -1]
    with torch.no_grad():
        ours = family.encode_pixel_conditioning(pixels)
        pipe = family.pipeline()
        _, condition = pipe.prepare_latents(first, 1, 16, SIDE, SIDE, 5, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(0), last_image=last)
        embeds = pipe.encode_image([_picture(first[0]), _picture(last[0])], torch.device("cpu"))  # (2, 17, 32)
    assert family.image_frames == 2 and family.noise_scheduler.config.flow_shift == 16.0
    assert condition.shape == ours["image_condition"].shape == (1, 20, 2, 4, 4)
    assert (condition - ours["image_condition"]).abs().max() < 1e-5
    mask = ours["image_condition"][0, :4, :, 0, 0]  # the first frame over its 4 slots; the last in its slot 3
    assert mask.t().tolist() == [[1, 1, 1, 1], [0, 0, 0, 1]]
    assert ours["image_embeds"].shape == (1, 34, 32) == (1, *family.pixel_conditioning_shapes((16, 2, 4, 4))["image_embeds"])
    assert (embeds.reshape(1, 34, 32) - ours["image_embeds"]).abs().max() < 1e-5
    # the transformer takes them as the pipeline hands them, (2, 17, 32), and adds its positions
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        text = family.encode_text(family.tokenize(["a red circle"]))
        theirs = family.transformer(hidden_states=torch.cat([latents, condition], 1), timestep=torch.tensor([500.0]),
                                    encoder_hidden_states=text["hidden_states"], encoder_hidden_states_image=embeds,
                                    return_dict=False)[0]
        ours_out = family.denoise(latents, torch.tensor([0.5]), {**text, **ours})
    assert (theirs - ours_out).abs().max() < 1e-5


def test_the_last_frame_changes_the_prediction_and_the_frames_between_do_not(family):
    plain = _prediction(family, _clip(0))
    assert torch.equal(_prediction(family, _clip(0, middle=1)), plain)
    assert (_prediction(family, _clip(0, last=2)) - plain).abs().max() > 1e-3
    # a still is its own first and last frame: the I2V condition, the frame's embeddings twice
    with torch.no_grad():
        still = family.encode_pixel_conditioning(_clip(0)[:, :, 0])
    assert still["image_condition"].shape == (1, 20, 4, 4) and still["image_condition"][:, :4].eq(1).all()
    assert torch.equal(still["image_embeds"][:, :17], still["image_embeds"][:, 17:])


def test_a_lora_trains_on_a_clip_conditioned_on_its_first_and_last_frames_and_the_loss_falls(tmp_path, tiny, clips):
    from modules.data.video import load_entry_pixels
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny, clips[0], tmp_path, {
        "model": {"family": "wan_i2v"}, "data": {"resolution": SIDE},
        "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}],
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 12, "batch_size": 1}, "optimizer": {"lr": 2e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    batch = trainer.dataset.collate([0], trainer.device)
    with torch.no_grad():
        fresh = trainer.family.encode_pixel_conditioning(load_entry_pixels(trainer.dataset.entries[0], SIDE, SIDE)[None])
    assert {k: v.shape for k, v in batch.pixel_conditioning.items()} == {
        "image_condition": (1, 20, 2, 4, 4), "image_embeds": (1, 34, 32)}
    assert all(torch.allclose(batch.pixel_conditioning[k], fresh[k], atol=1e-5) for k in fresh)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard: every adapter learned
    after = fixed_loss(trainer, draws=8)
    trainer.end()
    assert after < before * 0.8, (before, after)
    # the planner's fake step draws the two frames' conditioning shapes (the transformer's view needs them)
    from modules.plan.run_plan import plan_run

    assert plan_run(config, None, None, fix=False).flops > 0


def test_a_sample_from_a_first_and_last_frame_is_a_video_another_last_frame_changes(family, tmp_path):
    from modules.config.train_config import SamplePromptConfig

    paths = []
    for i, colour in ((0, 255), (4, 255), (4, 0)):
        paths.append(tmp_path / f"frame-{i}-{colour}.png")
        sliding_frame(i, 32, colour).save(paths[-1])

    def sample(*images, frames=5):
        prompt = SamplePromptConfig(prompt="a square sliding", steps=2, cfg=1.0, width=SIDE, height=SIDE, seed=3,
                                    frames=frames, control_images=[str(p) for p in images])
        return torch.stack([torch.from_numpy(numpy.array(f)).float() for f in
                            family.sample_frames(prompt, torch.device("cpu"), frames)])

    video = sample(paths[0], paths[1])
    assert video.shape == (5, SIDE, SIDE, 3)
    assert (sample(paths[0], paths[2]) - video).abs().max() > 1
    assert sample(paths[0], paths[1], frames=1).shape == (1, SIDE, SIDE, 3)  # its own last frame
    with pytest.raises(UserError, match=r"has 1 image\(s\); .* samples from a first and a last frame"):
        sample(paths[0])
    # a config's prompt with one image is named before any weight loads, and an I2V transformer's with two
    from modules.model.wan_i2v import WanI2VFamily

    tiny = Path(family.config.model.base)
    for transformer, images in ((None, paths[:1]), (_i2v_transformer_config(tiny, tmp_path), paths[:2])):
        config = train_config(tiny, tmp_path, tmp_path, {"model": {"family": "wan_i2v", "parts": {
            "transformer": {"path": str(transformer) if transformer else None}}}, "sampling": {
            "prompts": [{"prompt": "a", "frames": 5, "control_images": [str(p) for p in images]}]}})
        with pytest.raises(UserError, match=rf"^sampling\.prompts\[0\]\.control_images: {len(images)} given; "
                                            r"Wan 2\.1 I2V 14B with this transformer samples from"):
            WanI2VFamily(config).load()


def _i2v_transformer_config(tiny, tmp_path):
    """The tiny transformer's config folder as an I2V's (no image positions), weights left out."""
    folder = tmp_path / "i2v" / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((tiny / "transformer" / "config.json").read_text(encoding="utf-8"))
    (folder / "config.json").write_text(json.dumps({**config, "pos_embed_seq_len": None}), encoding="utf-8")
    return folder

def test_its_single_file_is_told_before_weights_load_and_loads_the_folders_tensors(tiny, tmp_path, clips):
    from safetensors.torch import load_file, save_file
    from test_wan_single_file import transformer_to_original

    from modules.model.detect import detect_family
    from modules.model.wan_i2v import WanI2VFamily

    folder = load_file(str(tiny / "transformer" / "diffusion_pytorch_model.safetensors"))
    state = transformer_to_original(folder)
    state["img_emb.emb_pos"] = state.pop("condition_embedder.image_embedder.pos_embed")
    path = tmp_path / "wan2.1_flf2v_720p_tiny_fp32.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()}, str(path))
    assert detect_family(path) == "wan_i2v"
    # its configs with the I2V's shift (3.0), as resources/model_configs/wan_i2v/ ships them
    configs = tmp_path / "configs"
    shutil.copytree(tiny, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    scheduler = configs / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "flow_shift": 3.0}))
    parts = {part: {"path": str(tiny / part)} for part in ("text_encoder", "image_encoder", "vae")}
    family = WanI2VFamily(train_config(path, clips[0], tmp_path, {"model": {"family": "wan_i2v", "parts": parts}}))
    family.model_configs_dir = configs
    assert family.image_frames == 2  # from its header, before any weight loads
    family.load()
    loaded = family.transformer.state_dict()
    assert set(loaded) == set(folder) and all(torch.equal(loaded[k], folder[k]) for k in folder)
    assert family.noise_scheduler.config.flow_shift == 16.0


def test_the_released_flf2v_header_picks_its_config_and_keeps_caches_apart_from_the_i2vs(tmp_path, tiny, clips):
    """A header-only file of the released FLF2V 14B (the I2V 14B's with `img_emb.emb_pos` (1, 514, 1280))
    is built from resources/model_configs/wan_i2v/transformer_flf2v/; the image parts' identity (the
    pixel conditioning's cache key) differs from the I2V's on the same image parts."""
    from safetensors.torch import save_file

    from modules.model.wan_i2v import WanI2VFamily

    prefix = "model.diffusion_model."
    released = tmp_path / "wan2.1_flf2v_720p_14B_fp8_e4m3fn.safetensors"
    save_file({prefix + "patch_embedding.weight": torch.zeros(5120, 36, 1, 2, 2, dtype=torch.float8_e4m3fn),
               **{f"{prefix}blocks.{i}.self_attn.norm_q.weight": torch.zeros(1) for i in range(40)},
               prefix + "img_emb.proj.1.weight": torch.zeros(1280, 1280, dtype=torch.float8_e4m3fn),
               prefix + "img_emb.emb_pos": torch.zeros(1, 514, 1280, dtype=torch.float8_e4m3fn)}, str(released))
    parts = {part: {"path": str(tiny / part)} for part in ("text_encoder", "image_encoder", "vae")}
    family = WanI2VFamily(train_config(released, clips[0], tmp_path, {"model": {"family": "wan_i2v", "parts": parts}}))
    folder = family.part_folder("transformer")
    assert (folder.parent.name, folder.name) == ("wan_i2v", "transformer_flf2v") and family.image_frames == 2

    def identity(transformer):
        parts = {"transformer": {"path": str(transformer)}} if transformer else {}
        config = train_config(tiny, clips[0], tmp_path, {"model": {"family": "wan_i2v", "parts": parts}})
        return WanI2VFamily(config).fingerprint("vae", "image_encoder")

    assert identity(None) != identity(_i2v_transformer_config(tiny, tmp_path))


@pytest.mark.parametrize("variant, takes", [("flf2v", 2), ("i2v", 1)])
def test_the_preflight_names_a_prompt_of_other_than_the_images_its_transformer_takes_before_loading(
        variant, takes, tiny_family_model, clips, tmp_path, monkeypatch):
    """FLF2V samples from two images (first and last frame), the I2V from one: told by the transformer's
    config (pos_embed_seq_len) in the preflight, with the run's other problems, not by the load."""
    from modules.model.wan_i2v import WanI2VFamily
    from modules.trainer.preflight import preflight_problems

    def load(self):
        raise AssertionError("the preflight loaded the model")

    monkeypatch.setattr(WanI2VFamily, "load", load)
    images = [tmp_path / "first.png", tmp_path / "last.png"]
    for i, path in enumerate(images):
        sliding_frame(4 * i, 32, 255).save(path)
    model = tiny_family_model("wan_i2v", variant=variant)

    def problems(*given):
        config = train_config(model, clips[0], tmp_path, {
            "model": {"family": "wan_i2v"}, "data": {"resolution": SIDE},
            # (a video concept: its clips are frame folders, which a still concept does not read)
            "concepts": [{"path": str(clips[0]), "video": {"frames": 5}}],
            "sampling": {"prompts": [{"prompt": "a", "frames": 5, "control_images": [str(p) for p in given]}]}})
        return preflight_problems(config)

    assert problems(*images[:takes]) == []
    wanted = {2: "two images, its first and last frames (a Wan 2.1 FLF2V transformer)",
              1: "one image, its first frame (a second, the last frame, is for a Wan 2.1 FLF2V transformer)"}[takes]
    other = images[:3 - takes]  # FLF2V: one image; I2V: two
    assert problems(*other) == [f"sampling.prompts[0].control_images: {len(other)} given; "
                                f"Wan 2.1 I2V 14B with this transformer samples from {wanted}"]
    assert problems() == [f"sampling.prompts[0].control_images: none given; "
                          f"Wan 2.1 I2V 14B with this transformer samples from {wanted}"]


def test_the_planner_builds_an_flf2v_model_whatever_its_prompts_images(tiny, clips, tmp_path):
    """The planner's build (also the preflight's fit check on a GPU) samples nothing: a one-image
    prompt is the preflight's to name with the run's other problems, not a load error out of the plan."""
    from modules.plan.architecture import build_architecture

    config = train_config(tiny, clips[0], tmp_path, {"model": {"family": "wan_i2v"}, "sampling": {
        "prompts": [{"prompt": "a", "frames": 5, "control_images": [str(tmp_path / "first.png")]}]}})
    modes = {part: "float32" for part in config.model.parts}
    assert build_architecture(config, modes).family.parts["transformer"].config.pos_embed_seq_len == 34
