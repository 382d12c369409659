"""The planner plans a video family's step on clips of the longest video concept's frame count
(the fake step encodes (B, 3, F, H, W) pixels as a video concept's windows are), and says so;
Wan plans at all (its scheduler is read before the tokenizer a config folder lacks)."""

from __future__ import annotations

from conftest import train_config


def test_a_video_concept_plans_its_clips_frames(tmp_path, tiny_family_model, shape_images):
    from modules.plan.run_plan import plan_run

    def planned(frames):
        config = train_config(tiny_family_model("wan"), shape_images, tmp_path, {
            "model": {"family": "wan"}, "data": {"resolution": 32},
            "concepts": [{"path": str(shape_images), "video": {"frames": frames}}]})
        return plan_run(config, None, None, fix=False)

    still, clip = planned(1), planned(9)  # 9 frames: 3 latent frames, 3x the tokens of one
    assert not any("frames" in note for note in still.notes)
    assert "the step is planned on clips of 9 frames at 32x32 (the longest video concept's video.frames)" in clip.notes
    assert clip.flops > 2.5 * still.flops
    assert clip.parts["transformer"].device["activations"] > 2 * still.parts["transformer"].device["activations"]


def test_the_released_wan_plans_without_a_tokenizer():
    """resources/model_configs/wan has no tokenizer/: the architecture builder's load stops there,
    after the parts and the scheduler the training shift comes from."""
    from modules.config.loading import build_config
    from modules.plan.architecture import build_architecture

    config = build_config([{"model": {"family": "wan"}}])
    family = build_architecture(config, {"text_encoder": "float8", "transformer": "bfloat16", "vae": "bfloat16"}).family
    assert family.noise_scheduler.config.flow_shift == 3.0 and set(family.parts) == {"text_encoder", "transformer", "vae"}
