"""`launch.py plan`: sizes as users write them, one clear error for a bad one, and the plan of a
tiny model as a table and as JSON with the agreed keys (the GUI and preflight read them)."""

from __future__ import annotations

import json

import pytest

from modules.cli.plan_command import SizeError, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("16GiB", 16 * 2**30), ("12GB", 12 * 10**9), ("24000MB", 24 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
    ("512", 512), ("8 gib", 8 * 2**30)])
def test_sizes(text, expected):
    assert parse_size(text, "--vram") == expected


@pytest.mark.parametrize("text", ["16 gigs", "GiB", "-3GB", "1e9", ""])
def test_bad_size_names_the_option(text):
    with pytest.raises(SizeError, match=r"^--vram: .* is not a size"):
        parse_size(text, "--vram")


def test_plan_json_of_a_tiny_model(tiny_model, capsys):
    import launch

    assert launch.main(["plan", "--set", f"model.base={tiny_model}", "--set", "data.resolution=64",
                        "--vram", "1GiB", "--ram", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) >= {"family", "budget", "parts", "device", "host", "transfer", "fits", "fixes", "auto"}
    assert plan["budget"] == {"vram": 2**30, "ram": 4 * 2**30}
    unet = plan["parts"]["unet"]
    assert set(unet["device"]) == {"weights", "trained", "gradients", "optimizer_state", "activations",
                                   "offload_window", "total"}
    assert unet["device"]["trained"] > 0 and unet["device"]["activations"] > 0
    assert plan["device"]["peak"] == sum(p["device"]["total"] for p in plan["parts"].values())
    assert plan["transfer"]["estimated"] is True and plan["fits"] is True


def test_plan_table_says_which_phase_sets_the_peak(tiny_model, capsys):
    import launch

    args = ["plan", "--set", f"model.base={tiny_model}", "--set", "data.resolution=64", "--set",
            'sampling.prompts=[{"prompt": "a", "width": 256, "height": 256}]']
    assert launch.main([*args, "--json"]) == 0
    device = json.loads(capsys.readouterr().out)["device"]
    # a sample at 256 px (SD's guidance batch of 2, then the VAE decode) holds more than the 64 px step
    assert set(device["outside_step_phases"]) == {"caching", "sampling"}
    assert device["peak"] == device["outside_step"] == device["outside_step_phases"]["sampling"] > device["step"]
    assert launch.main(args) == 0
    assert ": set by sampling)" in capsys.readouterr().out


def test_plan_table_and_bad_size(tiny_model, capsys):
    import launch

    assert launch.main(["plan", "--set", f"model.base={tiny_model}", "--set", "data.resolution=64",
                        "--vram", "1KiB", "--ram", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "unet" in out and "verdict: does not fit" in out
    assert launch.main(["plan", "--set", f"model.base={tiny_model}", "--vram", "lots"]) == 1
    assert "error: --vram: 'lots' is not a size" in capsys.readouterr().err


def test_a_fix_is_verified_by_replanning(tiny_model):
    """The fix for a budget the plan misses is the first change whose own plan fits it."""
    from modules.config.loading import build_config
    from modules.plan.run_plan import plan_run

    config = build_config([{"model": {"base": str(tiny_model)}, "data": {"resolution": 64}}])
    peak = plan_run(config, None, None).device_peak
    plan = plan_run(config, int(peak * 0.9), None)
    assert plan.fits is False and plan.fixes
    fixed = build_config([config.model_dump(mode="json")], [line.removeprefix("--set ") for line in plan.fixes])
    assert plan_run(fixed, int(peak * 0.9), None, fix=False).fits is True


def test_weight_dtype_auto_is_the_densest_storage_that_fits(tiny_model):
    from modules.config.loading import build_config
    from modules.plan.run_plan import plan_run

    # (a quantized part computes in train_dtype: bfloat16, as the dense pick does, so only storage differs)
    config = build_config([{"model": {"base": str(tiny_model), "parts": {"unet": {"weight_dtype": "auto"}}},
                            "data": {"resolution": 64}, "train_dtype": "bfloat16"}])
    dense = plan_run(config, None, None)
    assert dense.auto["model.parts.unet.weight_dtype"]["value"] == "bfloat16"
    tight = plan_run(config, dense.device_peak - 1, None)  # (the tiny UNet keeps most layers dense: 8-bit saves little)
    choice = tight.auto["model.parts.unet.weight_dtype"]
    assert choice["value"] != "bfloat16" and tight.parts["unet"].weight_dtype == choice["value"]
    assert tight.fits is True


def test_a_planner_reused_across_train_dtypes_sizes_each_as_a_fresh_one(tiny_model):
    """The layers a quantized mode leaves dense are stored in train_dtype: a planner that sized int8
    at float32 (the fixes' search does) must not hand those sizes to a bfloat16 plan."""
    from modules.config.loading import build_config
    from modules.plan.run_plan import Planner, plan_run

    def config(train_dtype):
        return build_config([{"model": {"base": str(tiny_model), "parts": {"unet": {"weight_dtype": "int8"}}},
                              "data": {"resolution": 64}, "train_dtype": train_dtype}])

    reused = Planner(None)
    float32 = plan_run(config("float32"), None, None, planner=reused).parts["unet"].device["weights"]
    bfloat16 = plan_run(config("bfloat16"), None, None, planner=reused).parts["unet"].device["weights"]
    assert bfloat16 == plan_run(config("bfloat16"), None, None).parts["unet"].device["weights"] < float32


def test_a_family_that_selects_caption_tokens_by_mask_plans(tiny_family_model):
    """Z-Image picks each caption's real tokens with a boolean mask, an op fake tensors cannot size:
    its planning conditioning has every token real (it crashed on aten.nonzero)."""
    from modules.config.loading import build_config
    from modules.plan.run_plan import plan_run

    config = build_config([{"model": {"family": "z_image", "base": str(tiny_family_model("z_image"))},
                            "data": {"resolution": 64}}])
    plan = plan_run(config, None, None)
    assert plan.parts["transformer"].device["activations"] > 0 and plan.flops > 0


@pytest.mark.parametrize(("family", "shared"), [("flux_kontext", "flux"), ("qwen_image_edit", "qwen_image"),
                                                ("qwen_image_edit_plus", "qwen_image")])
def test_an_edit_family_plans_on_the_released_parts_it_shares(family, shared):
    """FLUX.1 Kontext and Qwen-Image-Edit(-Plus) are planned (model.base empty: their presets) on the
    parts of the model they share them with; there is no resources/model_configs/<family>."""
    from modules.config.families import get_family_class
    from modules.config.loading import build_config
    from modules.plan.architecture import released_config

    folder = get_family_class(family).released_config_folder()
    assert folder.name == shared and (folder / "transformer" / "config.json").is_file()
    config = released_config(build_config([{"model": {"family": family}}]))
    assert config.model.base == str(folder)


@pytest.fixture(scope="module")
def shared_planner():
    from modules.plan.run_plan import Planner

    return Planner(None)  # one tiny model: its architecture and fake steps are planned once


@pytest.mark.parametrize("adapter", sorted(__import__("modules.config.adapter_configs", fromlist=["x"])
                                           .adapter_config_classes()))
def test_every_adapter_type_plans(adapter, tiny_model, shared_planner):
    """Each registered adapter is built of fake tensors in the plan's step: none may read a tensor's
    value while it is made (OFT's constraint did: `launch.py plan --preset "SD1.5 OFT"` crashed)."""
    from modules.config.loading import build_config
    from modules.plan.run_plan import plan_run

    config = build_config([{"model": {"base": str(tiny_model)}, "data": {"resolution": 64},
                            "adapter": {"type": adapter}}])
    plan = plan_run(config, None, None, planner=shared_planner)
    assert plan.parts["unet"].device["trained"] > 0 and plan.parts["unet"].device["activations"] > 0
