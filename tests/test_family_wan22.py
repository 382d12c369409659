"""Wan 2.2 A14B on a tiny offline model (two tiny experts, boundary_ratio 0.875): a low-noise LoRA
trains, the loss falls and its timesteps stay below the boundary, while the high-noise expert rests
on the temp device (untouched, no adapter, streamed in only for samples, planned at nothing on the
train device), and a high-noise one above it into its own file; with both experts trained each
sample goes to the expert owning its timestep; each expert's saved file loads into its own
transformer of diffusers' WanPipeline with no key dropped
and equal outputs (comfy, kohya, diffusers layouts; ComfyUI's key map applies every module); a
resumed two-expert run equals an uninterrupted one; the skip and keep-in-fp32 lists hold on both
experts; the folder is told from a Wan 2.1 one before weights load; both experts train on a clip
and an image and a sample video is written; half of each expert parked trains the same
adapters; fp8 and nf4 experts train; a full fine-tune of both saves folders diffusers loads."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import perturbed_adapters, resumed_training_matches

from modules.adapters.formats.files import format_warnings, save_adapter_file
from modules.trainer.generic_trainer import GenericTrainer

EXPERTS = ("transformer", "transformer_2")


@pytest.fixture(scope="session")
def tiny_wan22(tiny_family_model):
    return tiny_family_model("wan22")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_wan22, shape_images):
    from modules.model.wan22 import Wan22Family

    family = Wan22Family(train_config(tiny_wan22, shape_images, tmp_path_factory.mktemp("wan22"),
                                      {"model": {"family": "wan22"}}))  # both experts train by default
    family.load()
    return family


def _timesteps_seen(family):
    seen = {expert: [] for expert in EXPERTS}
    handles = [family.parts[e].register_forward_pre_hook(
        lambda m, a, k, e=e: seen[e].append(k["timestep"].detach().cpu()), with_kwargs=True) for e in EXPERTS]
    return seen, handles


def test_a_low_noise_lora_trains_below_the_boundary_while_the_high_noise_expert_rests(
        tmp_path, tiny_wan22, one_image, fake_device):
    from safetensors import safe_open

    config = train_config(tiny_wan22, one_image, tmp_path, {
        "model": {"family": "wan22", "parts": {"transformer": {"train": False}}},
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 12, "batch_size": 1},
        "optimizer": {"lr": 2e-2}, "train_device": str(fake_device),
        "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "cfg": 1.0, "width": 32, "height": 32}]},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    family = trainer.family
    assert family.denoiser_part == "transformer_2" and family.resting_parts() == ("transformer",)
    assert {p.device.type for p in family.parts["transformer"].parameters()} == {"cpu"}  # costs the device nothing
    assert {p.device.type for p in family.parts["transformer_2"].parameters()} == {fake_device.type}
    high_before = {k: v.clone() for k, v in family.parts["transformer"].state_dict().items()}
    seen, handles = _timesteps_seen(family)
    try:
        before = fixed_loss(trainer, draws=8)
        trainer.train()  # the first step's guard checks every adapter learned
        after = fixed_loss(trainer, draws=8)
    finally:
        for handle in handles:
            handle.remove()
    assert after < before * 0.8, (before, after)
    assert seen["transformer"] == [] and len(seen["transformer_2"]) > 12
    assert max(t.max().item() for t in seen["transformer_2"]) < 875 <= family.boundary_timestep
    assert all(name.startswith("lora_unet2_") for name in trainer.adapters.modules)  # the low-noise expert's only
    high_seen, handles = _timesteps_seen(family)
    try:
        (sample,) = trainer.sample()  # the resting expert is streamed in for the first steps, then back
    finally:
        for handle in handles:
            handle.remove()
    assert sample.is_file() and high_seen["transformer"] and high_seen["transformer_2"]
    assert {p.device.type for p in family.parts["transformer"].parameters()} == {"cpu"}
    assert all(torch.equal(high_before[k], v) for k, v in family.parts["transformer"].state_dict().items())
    path = trainer.end()
    assert path.name == "lora-low_noise.safetensors" and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
    assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in keys  # a lone Wan transformer's (musubi) names
    assert not any(k.startswith("lora_unet2_") for k in keys)


def test_each_sample_goes_to_the_expert_that_owns_its_timestep(family):
    """Both trained: the draws cover both ranges, the high-noise expert sees t >= 875 only and the
    low-noise one t < 875 (WanPipeline's split), each sample's velocity is its owner's; one trained
    expert draws only in its range, right up to the boundary."""
    from modules.model.wan22 import Wan22Family

    latents = torch.randn(16, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a red circle"] * 16))
    seen, handles = _timesteps_seen(family)
    try:
        with torch.no_grad():
            prediction, *_ = family.predict(latents, text, torch.Generator().manual_seed(2))
    finally:
        for handle in handles:
            handle.remove()
    high, low = torch.cat(seen["transformer"]), torch.cat(seen["transformer_2"])
    assert len(high) and len(low) and len(high) + len(low) == 16
    assert high.min() >= 875 > low.max()
    noisy = torch.randn(2, 16, 8, 8)
    pair = torch.tensor([0.95, 0.3])
    with torch.no_grad():
        both = family.denoise(noisy, pair, {k: v[:2] for k, v in text.items()})
        for row, expert in enumerate(EXPERTS):
            own = family.run_transformer(expert, noisy[row:row + 1], pair[row:row + 1], {k: v[:1] for k, v in text.items()})
            assert torch.allclose(both[row:row + 1], own, atol=1e-6), expert
    def only(trained: str, timesteps: str) -> Wan22Family:
        config, model = family.config, family.config.model
        parts = {**model.parts, **{e: model.parts[e].model_copy(update={"train": e == trained}) for e in EXPERTS}}
        one = Wan22Family(config.model_copy(update={"model": model.model_copy(update={"parts": parts}),
                                                    "loss": config.loss.model_copy(update={"timesteps": timesteps})}))
        one.noise_scheduler, one.boundary_ratio = family.noise_scheduler, family.boundary_ratio
        return one

    for trained, inside in (("transformer_2", lambda t: t < 875), ("transformer", lambda t: t >= 875)):
        for distribution in ("default", "uniform"):
            timesteps = only(trained, distribution).sample_sigmas(4096, 0, torch.Generator().manual_seed(5)) * 1000
            assert bool(inside(timesteps.float()).all()), (trained, distribution)
            near = timesteps.max() if trained == "transformer_2" else timesteps.min()
            assert abs(near.item() - 875) < 25, (trained, distribution)  # the range reaches the boundary
    # a draw at the top of the low-noise range rounds onto the boundary in float32: held below it
    low = only("transformer_2", "default")
    low.training_times = lambda batch, generator: torch.full((batch,), 1 - 1e-7)
    assert (low.sample_sigmas(1, 0, None).float() * 1000).item() < 875


@pytest.mark.parametrize("fmt, preset", [("comfy", "attn"), ("kohya", "attn-mlp"), ("diffusers", "all-linear")])
def test_each_experts_file_loads_into_its_own_transformer_with_equal_outputs(family, tiny_wan22, tmp_path, fmt, preset):
    """Both experts' adapters, saved as the run saves them (one file per expert under a lone Wan
    transformer's names): WanPipeline.load_lora_weights puts the high-noise file on `transformer`
    and, with load_into_transformer_2, the low-noise file on `transformer_2`; no key is dropped and
    each transformer computes what the trainer's hooked expert computes. ComfyUI's key map applies
    every module of each comfy and kohya file."""
    from diffusers import WanPipeline

    from modules.saving.consumers.check import check_file

    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    text = family.encode_text(family.tokenize(["a red circle on a blue background"]))

    def outputs(transformers):
        original = {e: family.parts[e] for e in EXPERTS}
        family.parts.update(transformers)
        try:
            with torch.no_grad():
                return {e: family.run_transformer(e, latents, torch.tensor([0.5]), text) for e in EXPERTS}
        finally:
            family.parts.update(original)

    adapters = perturbed_adapters(family, list(EXPERTS), layer_preset=preset)
    files = []
    try:
        for suffix, parts in family.adapter_files(list(EXPERTS)):
            written = adapters.written_as(parts, family)
            path = tmp_path / f"lora{suffix}.safetensors"
            save_adapter_file(path, written, family, fmt, torch.float32, {})
            assert [w for w in format_warnings(fmt, written, family) if "load_lora_weights" in w] == []
            files.append((suffix, path, {written.module_name_of[n] for n in written.modules}))
        ours = outputs({})
    finally:
        adapters.unhook()
    plain = outputs({})
    assert [suffix for suffix, *_ in files] == ["-high_noise", "-low_noise"]
    pipe = WanPipeline.from_pretrained(str(tiny_wan22), local_files_only=True)
    for (suffix, path, wanted), expert in zip(files, EXPERTS):
        pipe.load_lora_weights(str(path), adapter_name=expert, **family.diffusers_load_options(suffix))
        loaded = {n for n, m in getattr(pipe, expert).named_modules() if hasattr(m, "lora_A")}
        assert wanted <= loaded, sorted(wanted - loaded)[:3]  # no key dropped, and into its own expert
        if fmt != "diffusers":
            report = check_file(path, family)["ComfyUI"]
            assert report["applied"] == report["total"] == len(wanted), report["dropped"][:3]
    theirs = outputs({"transformer": pipe.transformer, "transformer_2": pipe.transformer_2})
    for expert in EXPERTS:
        assert (ours[expert] - plain[expert]).abs().max() > 1e-3, expert
        assert (ours[expert] - theirs[expert]).abs().max() < 1e-5, expert


def test_a_resumed_two_expert_run_ends_with_the_adapters_of_an_uninterrupted_one(tmp_path, tiny_wan22, shape_images):
    """The backup holds both experts' adapters (lora_unet_ and lora_unet2_) and the random state
    that routes each sample: the resumed run continues exactly."""
    resumed_training_matches(tiny_wan22, shape_images, tmp_path, "wan22")


def test_the_skip_and_keep_in_fp32_lists_hold_on_both_experts(tmp_path, tiny_wan22, shape_images):
    """WanTransformer3DModel's `_keep_in_fp32_modules` and `_skip_layerwise_casting_patterns` (their
    union) hold on each expert as on Wan 2.1's transformer, quantized or not."""
    from modules.model.wan22 import Wan22Family
    from modules.quantization.base import QuantizedLinear

    kept = ("scale_shift_table", "blocks.0.scale_shift_table", "blocks.1.norm2.weight",
            "condition_embedder.time_embedder.linear_1.weight")
    family = Wan22Family(train_config(tiny_wan22, shape_images, tmp_path, {
        "model": {"family": "wan22", "parts": {"transformer": {"weight_dtype": "float8"},
                                               "transformer_2": {"weight_dtype": "bfloat16"}}},
        "train_dtype": "bfloat16"}))
    family.load()
    for expert in EXPERTS:
        state = family.parts[expert].state_dict()
        assert {name: state[name].dtype for name in kept} == dict.fromkeys(kept, torch.float32), expert
        assert state["condition_embedder.text_embedder.linear_1.weight"].dtype == torch.bfloat16, expert
    report = family.quantization_reports["transformer"]
    for name in ("condition_embedder.text_embedder.linear_1", "condition_embedder.time_proj"):
        assert "_skip_layerwise_casting_patterns" in report.skipped[name], report.skipped[name]
        assert not isinstance(family.parts["transformer"].get_submodule(name), QuantizedLinear)
    assert isinstance(family.parts["transformer"].get_submodule("blocks.0.attn1.to_q"), QuantizedLinear)


def test_the_folder_is_told_from_wan_2_1_before_weights_load_and_the_plan_counts_the_resting_expert(
        tmp_path, tiny_wan22, tiny_family_model, shape_images):
    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.detect import detect_family, family_mismatch
    from modules.model.wan22 import Wan22Family
    from modules.plan.run_plan import plan_run

    wan21 = tiny_family_model("wan")
    assert detect_family(tiny_wan22) == "wan22" and detect_family(wan21) == "wan"
    assert "set model.family to 'wan22'" in family_mismatch(tiny_wan22, "wan")
    with pytest.raises(ModelLoadError, match="boundary_ratio None.*model.family 'wan'"):
        Wan22Family(train_config(wan21, shape_images, tmp_path, {"model": {"family": "wan22"}}))._boundary_ratio()
    config = train_config(tiny_wan22, shape_images, tmp_path, {
        "model": {"family": "wan22", "parts": {"transformer": {"train": False}}}})
    plan = plan_run(config, 2**30, 2**34, fix=False)
    resting, trained = plan.parts["transformer"], plan.parts["transformer_2"]
    assert sum(resting.device.values()) == 0 and resting.parked > 0
    assert trained.device["weights"] > 0 and trained.device["trained"] > 0 and trained.device["activations"] > 0
    # `auto` parks none of the trained expert where the whole step fits with it on the device: the
    # resting one is not counted (a budget of the step's peak, less half the resting expert's bytes)
    auto = train_config(tiny_wan22, shape_images, tmp_path, {"model": {"family": "wan22", "parts": {
        "transformer": {"train": False},
        "transformer_2": {"offload_fraction": "auto", "gradient_checkpointing": True}}}})
    step = plan_run(auto, None, None, fix=False).device_peak
    planned = plan_run(auto, step + resting.parked // 2, 2**34, fix=False)
    assert planned.auto["model.parts.transformer_2.offload_fraction"]["value"] == 0.0
    assert planned.device_peak <= step + resting.parked // 2


def test_a_resumed_run_saves_over_its_own_expert_files(tmp_path, tiny_wan22, one_image):
    """The workspace records the first expert's file as the run's output; the resumed run's final
    save writes both experts' files under their own names again (no doubled suffix)."""
    overlay = {"model": {"family": "wan22"}, "schedule": {"max_steps": 1, "batch_size": 1}}
    config = train_config(tiny_wan22, one_image, tmp_path, overlay)
    first = GenericTrainer(config)
    first.start()
    first.train()
    first.backup()
    assert first.end().name == "lora-high_noise.safetensors"
    resumed = GenericTrainer(config.model_copy(update={
        "backup": config.backup.model_copy(update={"resume": True}),
        "schedule": config.schedule.model_copy(update={"max_steps": 2})}))
    resumed.start()
    resumed.train()
    assert resumed.end().name == "lora-high_noise.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lora-high_noise.safetensors",
                                                                     "lora-low_noise.safetensors"]


def test_output_if_exists_looks_at_each_expert_file_the_run_writes(tmp_path, tiny_wan22, one_image):
    """Another run's `lora-low_noise.safetensors` beside output.path: a low-noise run refuses before
    the model loads (refuse), or versions to a name none of whose expert files exists (version); a
    high-noise run, which writes only `lora-high_noise`, keeps output.path."""
    from modules.saving.output_target import OutputExistsError, resolve_output
    from modules.trainer.outputs import saved_suffixes

    low = {"model": {"family": "wan22", "parts": {"transformer": {"train": False}}}}
    high = {"model": {"family": "wan22", "parts": {"transformer_2": {"train": False}}}}
    config = train_config(tiny_wan22, one_image, tmp_path, low, {"output": {"if_exists": "refuse"}})
    out = config.output_path.parent
    out.mkdir(parents=True)
    (out / "lora-low_noise.safetensors").write_bytes(b"another run's")
    trainer = GenericTrainer(config)
    with pytest.raises(OutputExistsError, match="lora-low_noise.safetensors already exists"):
        trainer.start()
    assert trainer.family is None  # refused before the model was built
    (out / "lora-2-low_noise.safetensors").write_bytes(b"and another's")
    warnings = []
    assert saved_suffixes(config) == ["-low_noise"]
    assert resolve_output(config.output_path, "version", tmp_path / "ws", False, warnings.append,
                          saved_suffixes(config)) == out / "lora-3.safetensors"
    assert "saves to " + str(out / "lora-3-low_noise.safetensors") in warnings[0]
    high_config = train_config(tiny_wan22, one_image, tmp_path, high)
    assert resolve_output(high_config.output_path, "refuse", tmp_path / "ws", False, warnings.append,
                          saved_suffixes(high_config)) == high_config.output_path


def test_both_experts_train_on_a_clip_and_an_image_and_a_sample_video_is_written(tmp_path, tiny_wan22, one_image):
    """A clip written by PyAV's encoder beside a still image: both experts' LoRAs train (each its
    own file), the loss falls on the clip, and a sample prompt of 5 frames writes a 5-frame video
    with its poster."""
    import av
    from test_video_data import write_clip

    clips = tmp_path / "clips"
    clips.mkdir()
    write_clip(clips / "walk.mp4", 9, fps=16)
    (clips / "walk.txt").write_text("a square moving right")
    config = train_config(tiny_wan22, clips, tmp_path, {
        "model": {"family": "wan22"}, "data": {"resolution": 32},
        "concepts": [{"path": str(clips), "video": {"frames": 5}}, {"path": str(one_image)}],
        "adapter": {"layer_preset": "attn-mlp"}, "schedule": {"epochs": 12, "batch_size": 1}, "optimizer": {"lr": 2e-2},
        "sampling": {"prompts": [{"prompt": "a square moving", "steps": 2, "cfg": 1.0, "width": 32, "height": 32,
                                  "frames": 5}]},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    clip = next(i for i, e in enumerate(trainer.dataset.entries) if e.clip is not None)
    collate = trainer.dataset.collate
    trainer.dataset.collate = lambda indices, device: collate([clip], device)  # fixed_loss reads the clip
    try:
        assert trainer.dataset.collate([0], trainer.device).latents.shape == (1, 16, 2, 8, 8)
        before = fixed_loss(trainer, draws=8)
    finally:
        trainer.dataset.collate = collate
    trainer.train()  # the first step's guard checks every adapter learned
    assert trainer.family.trained_parts_not_run() == set()  # both experts were stepped
    trainer.dataset.collate = lambda indices, device: collate([clip], device)
    try:
        after = fixed_loss(trainer, draws=8)
    finally:
        trainer.dataset.collate = collate
    assert after < before * 0.8, (before, after)
    (poster,) = trainer.sample()
    with av.open(str(poster.with_suffix(".mp4"))) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    path = trainer.end()
    assert sorted(p.name for p in path.parent.iterdir()) == ["lora-high_noise.safetensors", "lora-low_noise.safetensors"]


def test_offloading_half_of_each_expert_trains_the_same_adapters(fake_device, tmp_path, tiny_wan22, shape_images):
    """Both experts trained, each with half its blocks parked (4 images: both experts are stepped)."""
    from family_cross import offloaded_training_matches

    trainer = offloaded_training_matches(tiny_wan22, shape_images, tmp_path, "wan22", "transformer_2", fake_device,
                                         {"data": {"resolution": 32}}, also=("transformer",))
    assert trainer.family.trained_parts_not_run() == set()


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_quantized_experts_initialize_and_step(tmp_path, tiny_wan22, one_image, mode):
    """Both experts stored in `mode` (as the A14B preset stores them), both trained."""
    from family_cross import initializes_and_steps

    initializes_and_steps(tiny_wan22, one_image, tmp_path, "wan22", "transformer_2", mode, dora=mode == "float8",
                          overlay={"model": {"parts": {"transformer": {"weight_dtype": mode}}}})


def test_a_full_fine_tune_of_both_experts_saves_transformers_diffusers_loads(tmp_path, tiny_wan22, one_image):
    """Each expert's trained weights in its own folder of the saved pipeline (model_index.json's
    boundary_ratio copied as a setting, not a component), loaded by WanTransformer3DModel and
    WanPipeline."""
    from diffusers import WanPipeline, WanTransformer3DModel

    config = train_config(tiny_wan22, one_image, tmp_path, {
        "model": {"family": "wan22"}, "method": {"type": "fine_tune", "save_format": "diffusers"},
        "optimizer": {"lr": 1e-3}, "schedule": {"epochs": 8, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()  # the first step reached one expert: the guard holds only that one to having learned
    assert trainer.family.trained_parts_not_run() == set()  # by the end both have been stepped
    trainer.end()
    for expert in EXPERTS:
        trained = {k: v.float() for k, v in trainer.family.parts[expert].state_dict().items()}
        loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "out" / "lora" / expert)).state_dict()
        original = WanTransformer3DModel.from_pretrained(str(tiny_wan22 / expert)).state_dict()
        assert set(loaded) == set(trained), expert
        assert all(torch.equal(loaded[k].float(), trained[k]) for k in trained), expert
        assert any(not torch.equal(loaded[k], original[k]) for k in original), expert  # it trained
    pipe = WanPipeline.from_pretrained(str(tmp_path / "out" / "lora"), local_files_only=True)
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None


def test_a_high_noise_lora_trains_above_the_boundary_into_its_own_file(tmp_path, tiny_wan22, one_image):
    """The other expert alone: every training timestep at or above the boundary, the low-noise
    expert never run while training, one file `lora-high_noise.safetensors`."""
    config = train_config(tiny_wan22, one_image, tmp_path, {
        "model": {"family": "wan22", "parts": {"transformer_2": {"train": False}}},
        "schedule": {"epochs": 4, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.family.denoiser_part == "transformer" and trainer.family.resting_parts() == ("transformer_2",)
    seen, handles = _timesteps_seen(trainer.family)
    try:
        trainer.train()
    finally:
        for handle in handles:
            handle.remove()
    assert trainer.step == 4 and seen["transformer_2"] == []
    assert min(t.min().item() for t in seen["transformer"]) >= 875
    path = trainer.end()
    assert sorted(p.name for p in path.parent.iterdir()) == ["lora-high_noise.safetensors"] == [path.name]
