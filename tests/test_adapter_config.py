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
    assert (adapter.rank_dropout, adapter.module_dropout, adapter.lokr_factor, adapter.oft_block_size) == (0, 0, -1, 32)
    assert config.output.format == "kohya"


@pytest.mark.parametrize("overlay, message", [
    ({"adapter": {"type": "dora"}}, "adapter.type: must be one of 'lora', 'loha', 'lokr' or 'oft' (got 'dora')"),
    ({"adapter": {"type": "oft", "dora": True}}, "adapter.dora: only lora and lokr have a weight-decomposed form"),
    ({"adapter": {"type": "loha", "dora": True}}, "adapter.dora: only lora and lokr have a weight-decomposed form"),
    ({"adapter": {"lokr_factor": 0}}, "adapter.lokr_factor: must be -1 (as square as possible) or a positive factor"),
    ({"adapter": {"oft_block_size": 1}}, "adapter.oft_block_size: must be >= 2"),
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
    assert (adapter.type, adapter.dora) == expected


def test_dora_axis_auto_is_the_axis_the_format_s_consumers_apply_exactly():
    """auto: input for kohya/comfy files (ComfyUI, Forge and A1111 divide by the merged weight's
    norm per input column), output for diffusers files (peft's magnitude is per output row)."""
    from modules.config.train_config import AdapterConfig

    config = AdapterConfig(dora=True)
    assert config.dora_axis == "auto"
    assert config.resolved_dora_axis("kohya") == "input" and config.resolved_dora_axis("comfy") == "input"
    assert config.resolved_dora_axis("diffusers") == "output"
    assert AdapterConfig(dora=True, dora_axis="output").resolved_dora_axis("kohya") == "output"
