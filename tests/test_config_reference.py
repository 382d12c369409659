"""docs/config.md is generated from the config's schema (tools/config_reference.py) and kept current."""

from __future__ import annotations

import copy

from modules.config.train_config import TrainConfig
from tools.config_reference import REFERENCE, render


def test_docs_config_md_is_the_schema_rendered():
    # A stale file means a config field was added, changed or removed without regenerating it.
    assert REFERENCE.read_text(encoding="utf-8") == render(TrainConfig.model_json_schema()), (
        "docs/config.md is stale: run python -m tools.config_reference --write"
    )


def leaf_paths(reference_text: str) -> set[str]:
    return {line.split("`")[1] for line in reference_text.splitlines() if line.startswith("| `")}


def test_every_field_is_listed_with_its_dotted_path():
    paths = leaf_paths(render(TrainConfig.model_json_schema()))
    # one leaf of each nesting: top level, object, map of objects, list of objects, tagged union
    for path in ("seed", "schedule.batch_size", "model.parts.<part>.weight_dtype", "concepts[].repeats",
                 "adapter.rank", "optimizer.type", "method.fused_backward", "sampling.prompts[].prompt"):
        assert path in paths, path
    for name in TrainConfig.model_fields:
        assert any(p == name or p.startswith((f"{name}.", f"{name}[")) for p in paths), name


def test_a_new_field_appears_in_the_reference():
    schema = copy.deepcopy(TrainConfig.model_json_schema())
    schema["$defs"]["DataConfig"]["properties"]["new_option"] = {
        "type": "integer", "default": 3, "minimum": 1, "description": "A field added later."}
    row = next(line for line in render(schema).splitlines() if "`data.new_option`" in line)
    assert row == "| `data.new_option` | integer (>= 1) | `3` | A field added later. |"
