"""README's consumer table is tools/consumer_table.py's output over the kept key maps, never
edited by hand: regenerate it with `python -m tools.consumer_table --write`."""

from __future__ import annotations

from pathlib import Path

from conftest import train_config

from tools.consumer_table import ROWS, layer_kind, readme_block, table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_consumer_table_is_the_generated_one(tiny_family_model, shape_images, tmp_path):
    from modules.config.families import get_family_class

    families = []
    for name, options, _ in ROWS:
        cls = get_family_class(name)
        family = cls(train_config(tiny_family_model(name, **options), shape_images, tmp_path / name,
                                  {"model": {"family": name}}))
        family.load()
        families.append(family)
    generated = table(families)
    assert "ComfyUI 0.8.0" in generated and "Forge commit dfdcbab6" in generated  # the versions it reflects
    assert readme_block((ROOT / "README.md").read_text(encoding="utf-8")) == generated, \
        "README's consumer table is stale: run python -m tools.consumer_table --write"


def test_a_layer_kind_is_its_stem_without_block_numbers():
    assert layer_kind("lora_unet_double_blocks_12_img_attn_qkv") == "lora_unet_double_blocks_N_img_attn_qkv"
    assert layer_kind("text_encoders.qwen3_4b.transformer.model.layers.3.mlp.up_proj") == \
        "text_encoders.qwen3_4b.transformer.model.layers.N.mlp.up_proj"
    assert layer_kind("lora_te1_text_projection") == "lora_te1_text_projection"
