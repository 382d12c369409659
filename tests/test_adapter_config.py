"""The adapter's config fields: defaults that keep old files meaning what they meant, messages that
name the dotted path, presets that carry every adapter option."""

from __future__ import annotations

import pytest

from modules.config.errors import ConfigError
from modules.config.loading import build_config


def test_defaults_are_a_plain_lora_saved_as_kohya():
    config = build_config([{}])
    adapter = config.adapter
    assert (adapter.type, adapter.rank, adapter.alpha, adapter.dora, adapter.parts, adapter.init_from) == (
        "lora", 16, 16.0, False, {}, None)
    assert (adapter.rank_dropout, adapter.module_dropout) == (0, 0)
    assert (build_config([{"adapter": {"type": "lokr"}}]).adapter.factor,
            build_config([{"adapter": {"type": "oft"}}]).adapter.block_size) == (-1, 32)
    assert config.output.format == "kohya"


@pytest.mark.parametrize("overlay, message", [
    ({"adapter": {"type": "dora"}}, "adapter.type: unknown type 'dora'; dora is an option of type 'lora' (adapter.dora) (known: lora, loha, lokr, oft)"),
    ({"adapter": {"type": "oft", "dora": True}}, "adapter.dora: unknown key"),  # each algorithm has its own options
    ({"adapter": {"type": "loha", "dora": True}}, "adapter.dora: unknown key"),
    ({"adapter": {"type": "oft", "rank": 4}}, "adapter.rank: unknown key"),
    ({"adapter": {"factor": 4}}, "adapter.factor: unknown key"),  # lora's: no LoKr option
    ({"adapter": {"type": "lokr", "factor": 0}}, "adapter.factor: must be -1 (as square as possible) or a positive factor"),
    ({"adapter": {"type": "oft", "block_size": 1}}, "adapter.block_size: must be >= 2"),
    ({"adapter": {"rank_dropout": 1}}, "adapter.rank_dropout: must be < 1"),
    ({"adapter": {"dora_axis": "row"}}, "adapter.dora_axis: must be one of 'auto', 'output' or 'input'"),
    ({"adapter": {"parts": {"unet": {"rank": 0}}}}, "adapter.parts.unet.rank: must be >= 1"),
    ({"adapter": {"parts": {"unet": {"alpah": 2}}}}, "adapter.parts.unet.alpah: unknown key"),
    ({"output": {"format": "a1111"}}, "output.format: must be one of 'kohya', 'comfy' or 'diffusers'"),
])
def test_bad_adapter_settings_name_their_dotted_path(overlay, message):
    with pytest.raises(ConfigError) as error:
        build_config([overlay])
    assert any(problem.startswith(message) for problem in error.value.problems), error.value.problems


def test_per_part_sizes_fall_back_to_the_adapter_size():
    adapter = build_config([{"adapter": {"rank": 8, "alpha": 4, "parts": {"text_encoder": {"rank": 2}}}}]).adapter
    assert adapter.size_for("text_encoder") == (2, 4.0) and adapter.size_for("unet") == (8, 4.0)


@pytest.mark.parametrize("name, expected", [("SD1.5 LoKr", ("lokr", True)), ("SD1.5 OFT", ("oft", False))])
def test_adapter_presets_build_a_valid_config(name, expected):
    from modules.config.presets import load_preset_overlay

    adapter = build_config([load_preset_overlay(name)]).adapter
    assert (adapter.type, getattr(adapter, "dora", False)) == expected


def test_dora_axis_auto_is_the_axis_the_format_s_consumers_apply_exactly():
    """auto: input for kohya/comfy files (ComfyUI, Forge and A1111 divide by the merged weight's
    norm per input column), output for diffusers files (peft's magnitude is per output row)."""
    from modules.config.train_config import AdapterConfig

    config = AdapterConfig(dora=True)
    assert config.dora_axis == "auto"
    assert config.resolved_dora_axis("kohya") == "input" and config.resolved_dora_axis("comfy") == "input"
    assert config.resolved_dora_axis("diffusers") == "output"
    assert AdapterConfig(dora=True, dora_axis="output").resolved_dora_axis("kohya") == "output"


# --- v1's flat adapter options (lokr_factor, oft_block_size, ...) --------------------------------

V1_LOKR_PRESET = {"version": 1, "adapter": {"type": "lokr", "rank": 8, "lokr_factor": 16, "lokr_full_matrix": True,
                                            "lokr_decompose_both": False, "oft_block_size": 32, "dora": True}}


def test_a_v1_config_with_flat_options_loads_with_the_algorithm_s_own(tmp_path):
    import json

    from modules.config.loading import load_config_file

    path = tmp_path / "old.json"
    path.write_text(json.dumps(V1_LOKR_PRESET), encoding="utf-8")
    adapter = load_config_file(path).adapter
    assert (adapter.type, adapter.rank, adapter.factor, adapter.full_matrix, adapter.decompose_both, adapter.dora) == (
        "lokr", 8, 16, True, False, True)


def test_a_v1_full_dump_drops_the_options_its_algorithm_ignored():
    """A v1 backup or export held every algorithm's options; each algorithm keeps its own."""
    oft = {"type": "oft", "rank": 16, "alpha": 16.0, "parts": {}, "dora": False, "dora_axis": "auto",
           "lokr_factor": -1, "lokr_decompose_both": False, "lokr_full_matrix": False, "oft_block_size": 8,
           "oft_constraint": 0.5, "layer_preset": "attn"}
    adapter = build_config([{"version": 1, "adapter": oft}]).adapter
    assert (adapter.type, adapter.block_size, adapter.constraint, adapter.layer_preset) == ("oft", 8, 0.5, "attn")
    lora = {**oft, "type": "lora", "lokr_factor": 4, "rank": 4}
    adapter = build_config([{"version": 1, "adapter": lora}]).adapter
    assert (adapter.type, adapter.rank) == ("lora", 4) and not hasattr(adapter, "factor")


def test_a_v1_overlay_without_type_keeps_its_options_for_the_layer_below():
    """An overlay (or a file without "version" in the old names) tweaking a LoKr preset's factor."""
    base = {"adapter": {"type": "lokr", "rank": 4}}
    assert build_config([base, {"version": 1, "adapter": {"lokr_factor": 8}}]).adapter.factor == 8
    assert build_config([base, {"adapter": {"lokr_factor": 8}}]).adapter.factor == 8  # no version: v1 by its keys


def test_a_layer_that_changes_the_type_keeps_from_below_what_the_new_type_has():
    base = {"adapter": {"rank": 4, "alpha": 2, "layer_preset": "attn"}}
    oft = build_config([base, {"adapter": {"type": "oft", "block_size": 8}}]).adapter
    assert (oft.type, oft.block_size, oft.layer_preset) == ("oft", 8, "attn")
    lokr = build_config([base], overrides=("adapter.type=lokr",)).adapter
    assert (lokr.type, lokr.rank, lokr.alpha, lokr.layer_preset) == ("lokr", 4, 2.0, "attn")
    with pytest.raises(ConfigError, match=r"adapter\.rank: unknown key"):  # in the layer that sets the type: an error
        build_config([{"adapter": {"type": "oft", "rank": 4}}])


def test_a_v1_backup_resumes_compared_by_the_migrated_names():
    import json

    from modules.trainer.resume import resume_changes

    current = build_config([{"adapter": {"type": "lokr", "rank": 8, "factor": 16}}])
    backup = json.loads(current.model_dump_json())
    v1 = {**backup, "version": 1}
    v1["adapter"] = {**{k: v for k, v in backup["adapter"].items() if k not in ("factor", "decompose_both",
                                                                               "full_matrix")},
                     "lokr_factor": 4, "lokr_decompose_both": False, "lokr_full_matrix": False,
                     "oft_block_size": 32, "oft_constraint": 0.0}
    assert resume_changes(v1, current) == ["adapter.factor: 4 in the backup, 16 now"]
    assert resume_changes({**v1, "adapter": {**v1["adapter"], "lokr_factor": 16}}, current) == []
