"""modules/config: validation messages, overlays and `--set`, migrations, files.

Every bad input must give exactly one ConfigError line per problem, starting with the dotted
path the user wrote (`concepts[0].repeats: must be >= 1`), and never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.config import migrations
from modules.config.errors import ConfigError
from modules.config.loading import (
    build_config,
    deep_merge,
    load_config_file,
    parse_dotted,
    read_json_file,
    set_override,
)
from modules.config.migrations import migrate
from modules.config.train_config import CURRENT_VERSION


@pytest.fixture(autouse=True)
def _isolated_user_dir(tmp_path, monkeypatch):
    """User presets live under DIFFTRAINER_HOME; never read or write the real one."""
    monkeypatch.setenv("DIFFTRAINER_HOME", str(tmp_path / "home"))


def problems_of(*layers: dict, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build_config(list(layers), overrides)
    return caught.value.problems


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


# --- one problem, one line, named by its dotted path -----------------------------------------

ONE_PROBLEM = [
    pytest.param({"rnak": 4}, "rnak: unknown key", id="unknown-top-level"),
    pytest.param({"adapter": {"rnak": 4}}, "adapter.rnak: unknown key", id="unknown-nested"),
    pytest.param({"model": {"parts": {"unet": {"learnin_rate": 1e-4}}}},
                 "model.parts.unet.learnin_rate: unknown key", id="unknown-in-part"),
    pytest.param({"schedule": {"epochs": "ten"}}, "schedule.epochs: must be a whole number", id="wrong-type-int"),
    pytest.param({"adapter": {"alpha": "high"}}, "adapter.alpha: must be a number", id="wrong-type-float"),
    pytest.param({"data": {"aspect_buckets": "maybe"}}, "data.aspect_buckets: must be true or false", id="wrong-type-bool"),
    pytest.param({"adapter": {"layer_filter": "attn"}}, "adapter.layer_filter: must be a list", id="wrong-type-list"),
    pytest.param({"schedule": 5}, "schedule: must be an object", id="wrong-type-object"),
    pytest.param({"concepts": [{"path": "x", "repeats": 0}]}, "concepts[0].repeats: must be >= 1", id="range-repeats"),
    pytest.param({"concepts": [{"path": "a"}, {"path": "b", "repeats": -2}]},
                 "concepts[1].repeats: must be >= 1", id="range-second-item"),
    pytest.param({"adapter": {"dropout": 1.0}}, "adapter.dropout: must be < 1", id="range-upper"),
    pytest.param({"sampling": {"prompts": [{"prompt": "p", "width": 100}]}},
                 "sampling.prompts[0].width: must be a multiple of 8", id="multiple-of"),
    pytest.param({"concepts": [{}]}, "concepts[0].path: required", id="required"),
    pytest.param({"lr_scheduler": {"type": "exponential"}}, "lr_scheduler.type: must be one of", id="bad-literal"),
    pytest.param({"optimizer": {"type": "sgd"}}, "optimizer.type: unknown type 'sgd'", id="unknown-optimizer"),
    pytest.param({"optimizer": {"type": "adamw", "lr": 0}}, "optimizer.lr: must be > 0", id="optimizer-field-typed"),
    pytest.param({"optimizer": {"lr": -1}}, "optimizer.lr: must be > 0", id="optimizer-field-type-defaulted"),
    pytest.param({"optimizer": {"lr": 1e-4, "momentum": 0.9}}, "optimizer.momentum: unknown key",
                 id="optimizer-unknown-key-type-defaulted"),
    pytest.param({"model": {"parts": {"foo": {"train": True}}}}, "model.parts.foo: unknown part", id="unknown-part"),
    pytest.param({"model": {"parts": []}}, "model.parts: must be an object", id="parts-not-object"),
    pytest.param({"model": {"parts": {"unet": 0}}}, "model.parts.unet: must be an object", id="part-not-object"),
    pytest.param({"model": {"family": "sd99"}}, "model.family: unknown family 'sd99'", id="unknown-family"),
    pytest.param({"train_device": "gpu0"}, "train_device: 'gpu0' is not a torch device", id="bad-device"),
    pytest.param({"adapter": {"layer_filter": ["attn", "to_(q|k"]}},
                 "adapter.layer_filter: entry 1 ('to_(q|k') is not a valid regex", id="bad-regex"),
    pytest.param({"schedule": {"sample_every": "every ten steps"}},
                 "schedule.sample_every: 'every ten steps' is not like", id="bad-cadence-text"),
    pytest.param({"schedule": {"backup_every": "5 hours"}}, "schedule.backup_every: '5 hours' is not like",
                 id="bad-cadence-unit-text"),
    pytest.param({"schedule": {"save_every": {"value": 2, "unit": "hours"}}},
                 "schedule.save_every.unit: must be one of", id="bad-cadence-unit-object"),
]


@pytest.mark.parametrize("layer, expected", ONE_PROBLEM)
def test_each_bad_input_gives_one_line_naming_its_path(layer, expected):
    problems = problems_of(layer)
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems
    assert "Traceback" not in problems[0] and "pydantic" not in problems[0].lower()


def test_repeats_message_reads_like_the_design():
    (problem,) = problems_of({"concepts": [{"path": "imgs", "repeats": 0}]})
    assert problem == "concepts[0].repeats: must be >= 1 (got 0)"


def test_the_optimizer_path_never_shows_the_union_tag():
    for layer in ({"optimizer": {"lr": "fast"}}, {"optimizer": {"type": "adamw", "lr": "fast"}}):
        (problem,) = problems_of(layer)
        assert problem.startswith("optimizer.lr: must be a number"), problem
        assert "adamw" not in problem.split(":")[0]


def test_several_problems_give_several_lines():
    problems = problems_of({
        "rnak": 1,
        "schedule": {"epochs": 0, "batch_size": "two"},
        "concepts": [{"path": "x", "repeats": 0}],
        "lr_scheduler": {"type": "nope"},
    })
    paths = sorted(p.split(":")[0] for p in problems)
    assert paths == ["concepts[0].repeats", "lr_scheduler.type", "rnak", "schedule.batch_size", "schedule.epochs"]


def test_config_error_text_lists_every_problem_and_the_source(tmp_path):
    path = write_json(tmp_path / "cfg.json", {"adapter": {"rank": 0}, "seed": "x"})
    with pytest.raises(ConfigError) as caught:
        load_config_file(path)
    assert len(caught.value.problems) == 2
    # launch.py prints str(error): it must carry every line
    for problem in caught.value.problems:
        assert problem in str(caught.value)


def test_good_values_pass():
    config = build_config([{
        "adapter": {"layer_filter": [r"attn\d\.to_(q|k|v)$"]},
        "schedule": {"sample_every": "2 epochs", "backup_every": "30 minute", "save_every": "250 steps"},
        "train_device": "cuda:1",
        "concepts": [{"path": "x", "repeats": 3}],
    }])
    assert config.schedule.sample_every.value == 2 and config.schedule.sample_every.unit == "epochs"
    assert config.schedule.backup_every.unit == "minutes"
    assert config.schedule.save_every.value == 250 and config.schedule.save_every.unit == "steps"
    assert config.train_device == "cuda:1"
    assert config.optimizer.type == "adamw"


# --- overlays -------------------------------------------------------------------------------

def test_deep_merge_merges_objects_and_replaces_lists():
    base = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "l": [1, 2, 3], "x": 1}
    merged = deep_merge(base, {"a": {"c": {"e": 30}, "f": 4}, "l": [9], "x": {"now": "object"}})
    assert merged == {"a": {"b": 1, "c": {"d": 2, "e": 30}, "f": 4}, "l": [9], "x": {"now": "object"}}
    assert base == {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "l": [1, 2, 3], "x": 1}  # input untouched


def test_later_layers_win_and_lists_are_replaced_whole():
    config = build_config([
        {"schedule": {"epochs": 3, "batch_size": 4}, "concepts": [{"path": "a"}, {"path": "b"}]},
        {"schedule": {"epochs": 7}, "concepts": [{"path": "c"}]},
    ])
    assert config.schedule.epochs == 7 and config.schedule.batch_size == 4
    assert [c.path for c in config.concepts] == ["c"]


def test_partial_part_override_keeps_the_family_default():
    config = build_config([{"model": {"parts": {"unet": {"learning_rate": 1e-4}}}}])
    assert config.model.parts["unet"].learning_rate == 1e-4
    assert config.model.parts["unet"].train is True  # sd15 trains the unet by default
    assert config.model.parts["text_encoder"].train is False
    assert set(config.model.parts) == {"text_encoder", "unet", "vae"}


def test_part_overrides_in_two_layers_merge():
    config = build_config([
        {"model": {"parts": {"text_encoder": {"train": True}}}},
        {"model": {"parts": {"text_encoder": {"learning_rate": 5e-5}}}},
    ])
    assert config.model.parts["text_encoder"].train is True
    assert config.model.parts["text_encoder"].learning_rate == 5e-5


def test_set_indexes_into_lists_and_appends_to_an_empty_one():
    assert set_override({"concepts": [{"path": "a"}]}, "concepts[0].repeats=3") == {
        "concepts": [{"path": "a", "repeats": 3}]
    }
    assert set_override({"concepts": []}, "concepts[0].path=x") == {"concepts": [{"path": "x"}]}
    assert set_override({}, "concepts[0].path=x") == {"concepts": [{"path": "x"}]}
    original = {"schedule": {"epochs": 1}}
    set_override(original, "schedule.epochs=5")
    assert original == {"schedule": {"epochs": 1}}  # returns a new dict


def test_set_values_are_json_when_they_parse_else_text():
    assert set_override({}, "schedule.epochs=5") == {"schedule": {"epochs": 5}}
    assert set_override({}, "tensorboard=false") == {"tensorboard": False}
    assert set_override({}, "cache_dir=null") == {"cache_dir": None}
    assert set_override({}, 'adapter.layer_filter=["a", "b"]') == {"adapter": {"layer_filter": ["a", "b"]}}
    assert set_override({}, "workspace_dir=/tmp/my ws") == {"workspace_dir": "/tmp/my ws"}
    assert set_override({}, 'output.path="5"') == {"output": {"path": "5"}}  # quoted: text
    assert set_override({}, "train_device=cuda:1") == {"train_device": "cuda:1"}
    assert set_override({}, "model.base=a=b") == {"model": {"base": "a=b"}}  # split at the first '='


def test_set_through_build_config():
    config = build_config([{"concepts": [{"path": "a"}]}],
                          ["concepts[0].repeats=3", "concepts[1].path=b", "schedule.sample_every=2 epochs"])
    assert [(c.path, c.repeats) for c in config.concepts] == [("a", 3), ("b", 1)]
    assert config.schedule.sample_every.unit == "epochs"


def test_parse_dotted():
    assert parse_dotted("concepts[0].repeats") == ["concepts", 0, "repeats"]
    assert parse_dotted("model.parts.unet.train") == ["model", "parts", "unet", "train"]
    assert parse_dotted("a[1][2]") == ["a", 1, 2]


@pytest.mark.parametrize("assignment", [
    "no_equals_sign", "=1", "a..b=1", "a.=1", ".a=1", "a.[0]=1", "[0]=1", "a[x]=1", "a]=1", "a[0=1",
    "concepts[2].path=x",  # no item 0 or 1 to put it after
    "seed.value=1",        # seed is a number, not an object
])
def test_set_bad_keys_are_config_errors(assignment):
    base = {"seed": 1, "concepts": []}
    with pytest.raises(ConfigError) as caught:
        set_override(base, assignment)
    (problem,) = caught.value.problems
    assert problem.startswith("--set ")


def test_set_to_an_unknown_key_is_reported_by_validation():
    assert problems_of({}, overrides=("schedule.epoch=5",)) == ["schedule.epoch: unknown key; did you mean 'epochs'?"]
    assert problems_of({}, overrides=("concepts[0].repeats=0",)) == [
        "concepts[0].path: required", "concepts[0].repeats: must be >= 1 (got 0)"
    ]


# --- migrations -----------------------------------------------------------------------------

V0_FILE = {
    "version": 0,
    "model_family": "sd15",
    "base_model": "/models/sd15",
    "prediction_type": "v_prediction",
    "lora_rank": 8,
    "lora_alpha": 4,
    "lora_dropout": 0.1,
    "learning_rate": 2e-4,
    "weight_decay": 0.0,
    "lr_scheduler": "cosine",
    "lr_warmup_steps": 10,
    "epochs": 3,
    "max_steps": 100,
    "batch_size": 2,
    "gradient_accumulation_steps": 4,
    "resolution": 256,
    "output_path": "out/x.safetensors",
    "output_dtype": "bfloat16",
    "workspace": "ws",
    "cache": "cache",
    "device": "cpu",
    "seed": 7,
    "train_text_encoder": True,
    "text_encoder_learning_rate": 1e-5,
    "weight_dtype": "bfloat16",
    "sample_every_n_steps": 50,
    "save_every_n_steps": 20,
    "concepts": [{"folder": "images/dog", "repeats": 2, "caption_source": "filename"}],
}


def test_every_v0_flat_key_is_in_the_sample_file():
    assert set(migrations._V0_FLAT_KEYS) <= set(V0_FILE)


def test_a_real_v0_file_loads_as_v1(tmp_path):
    path = write_json(tmp_path / "old.json", V0_FILE)
    data = read_json_file(path)
    assert data["version"] == CURRENT_VERSION
    config = build_config([data])
    assert config.version == CURRENT_VERSION
    assert config.model.family == "sd15" and config.model.base == "/models/sd15"
    assert config.model.prediction_type == "v_prediction"
    assert (config.adapter.rank, config.adapter.alpha, config.adapter.dropout) == (8, 4.0, 0.1)
    assert config.optimizer.lr == 2e-4 and config.optimizer.weight_decay == 0.0
    assert config.lr_scheduler.type == "cosine" and config.lr_scheduler.warmup_steps == 10
    assert (config.schedule.epochs, config.schedule.max_steps, config.schedule.batch_size) == (3, 100, 2)
    assert config.schedule.gradient_accumulation == 4
    assert config.data.resolution == 256
    assert config.output.path == "out/x.safetensors" and config.output.dtype == "bfloat16"
    assert config.workspace_dir == "ws" and config.cache_dir == "cache"
    assert config.train_device == "cpu" and config.seed == 7
    parts = config.model.parts
    assert parts["text_encoder"].train is True and parts["text_encoder"].learning_rate == 1e-5
    assert parts["unet"].train is True  # the family default survives the migration
    assert {p.weight_dtype for p in parts.values()} == {"bfloat16"}
    assert (config.schedule.sample_every.value, config.schedule.sample_every.unit) == (50, "steps")
    assert (config.schedule.save_every.value, config.schedule.save_every.unit) == (20, "steps")
    assert config.schedule.backup_every.value == 0  # not in the file: never
    (concept,) = config.concepts
    assert (concept.path, concept.repeats, concept.caption_source) == ("images/dog", 2, "filename")


def test_migration_does_not_change_its_input():
    data = json.loads(json.dumps(V0_FILE))
    migrate(data)
    assert data == V0_FILE


def test_a_current_file_passes_migration_unchanged():
    data = {"version": CURRENT_VERSION, "adapter": {"rank": 4}}
    assert migrate(data) == data
    assert migrate({"adapter": {"rank": 4}}) == data  # no version: taken to be current


def test_a_future_version_is_refused_naming_version(tmp_path):
    path = write_json(tmp_path / "new.json", {"version": CURRENT_VERSION + 1, "seed": 1})
    with pytest.raises(ConfigError) as caught:
        read_json_file(path)
    (problem,) = caught.value.problems
    assert problem.startswith("version:") and "newer" in problem
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("version", ["1", 1.0, True, -1])
def test_a_bad_version_is_refused_naming_version(version):
    with pytest.raises(ConfigError) as caught:
        migrate({"version": version})
    (problem,) = caught.value.problems
    assert problem.startswith("version:")


def test_a_v0_file_with_a_key_v0_never_had_fails_naming_it(tmp_path):
    path = write_json(tmp_path / "old.json", {**V0_FILE, "lora_rnak": 4})
    assert problems_of(read_json_file(path)) == ["lora_rnak: unknown key"]


def test_a_bad_value_in_a_v0_file_is_named_by_its_v1_path(tmp_path):
    path = write_json(tmp_path / "old.json", {**V0_FILE, "lora_rank": 0})
    (problem,) = problems_of(read_json_file(path))
    assert problem.startswith("adapter.rank: must be >= 1")


# --- files ----------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path / "nope.json")
    (problem,) = caught.value.problems
    assert "not found" in problem and "nope.json" in problem


def test_invalid_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "seed": 1,\n  "adapter": {"rank": 4,}\n}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        read_json_file(path)
    (problem,) = caught.value.problems
    assert str(path) in problem and "line 3" in problem


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "3", "null"])
def test_a_non_object_top_level_is_refused(tmp_path, content):
    path = tmp_path / "list.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        read_json_file(path)
    (problem,) = caught.value.problems
    assert str(path) in problem and "object" in problem


def test_a_binary_file_is_a_config_error_not_a_crash(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b'{"seed": "\xff\xfe"}')
    with pytest.raises(ConfigError) as caught:
        read_json_file(path)
    assert str(path) in caught.value.problems[0]


def test_a_folder_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError) as caught:
        read_json_file(tmp_path)
    assert str(tmp_path) in caught.value.problems[0]
