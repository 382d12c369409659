"""The tagged sections (method, adapter, optimizer) follow one rule when their `type` changes
(modules/config/tagged.py retype), in the loader's layers, in `--set` and in the GUI's choices."""

from __future__ import annotations

import json
import sys

import pytest

from modules.config.loading import build_config, load_config_file
from modules.config.train_config import TAGGED_SECTIONS


def test_set_method_type_over_a_fine_tune_file_drops_the_fine_tune_options(tmp_path):
    # issue 31's bug: the loader's retype knew adapter and optimizer only, so the file's
    # fused_backward stayed under the adapter method: "method.fused_backward: unknown key"
    path = tmp_path / "ft.json"
    path.write_text(json.dumps({"method": {"type": "fine_tune", "fused_backward": False,
                                           "save_format": "diffusers"}}))
    config = load_config_file(path, ["method.type=adapter"])
    assert config.method.type == "adapter"


def test_a_layer_that_changes_the_method_type_drops_the_options_below():
    config = build_config([{"method": {"type": "fine_tune", "fused_backward": False}}, {"method": {"type": "embedding"}},
                           {"embeddings": [{"placeholder": "<x>"}]}])
    assert config.method.type == "embedding"


def test_settings_declared_alike_survive_a_change_of_type_and_the_others_do_not():
    adapter = build_config([{"adapter": {"rank": 8, "dropout": 0.1}}], ["adapter.type=lokr"]).adapter
    assert (adapter.type, adapter.rank, adapter.dropout) == ("lokr", 8, 0.1)  # LowRankOptions' rank in both
    oft = build_config([{"adapter": {"rank": 8, "dropout": 0.1}}], ["adapter.type=oft"]).adapter
    assert oft.dropout == 0.1 and not hasattr(oft, "rank")
    # AdamW's lr is not Prodigy's (a multiplier, default 1.0); the betas are declared alike
    prodigy = build_config([{"optimizer": {"lr": 3e-4, "betas": [0.8, 0.99]}}], ["optimizer.type=prodigy"]).optimizer
    assert prodigy.lr == 1.0 and prodigy.betas == (0.8, 0.99)


def test_every_tagged_section_of_the_config_is_retyped():
    from modules.config.train_config import TrainConfig
    from modules.config.tagged import TaggedUnion

    declared = {name for name, field in TrainConfig.model_fields.items()
                if any(isinstance(item, TaggedUnion) for item in field.metadata)}
    assert declared == set(TAGGED_SECTIONS) == {"method", "adapter", "optimizer"}


def test_the_gui_choice_keeps_what_the_loader_keeps():
    from ui.union_section import retyped

    for key, below, kind in [("optimizer", {"type": "adamw", "lr": 3e-4, "betas": [0.8, 0.99]}, "prodigy"),
                             ("adapter", {"type": "lora", "rank": 8, "dora": True}, "lokr"),
                             ("method", {"type": "fine_tune", "fused_backward": False}, "adapter")]:
        loaded = build_config([{key: below}], [f"{key}.type={kind}"])
        chosen = retyped(TAGGED_SECTIONS[key], below, kind)
        assert chosen == getattr(loaded, key).model_dump(mode="json")


def test_importing_the_config_does_not_import_torch():
    import subprocess

    code = "import sys, modules.config.train_config, modules.config.loading; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_an_unknown_type_names_the_type_key():
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"method\.type: unknown type 'dreambooth' \(known: adapter, "):
        build_config([{"method": {"type": "dreambooth"}}])
