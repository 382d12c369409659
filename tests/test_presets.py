"""Presets (built-in and user, list, show, save) and the config commands of launch.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.config.presets import (
    find_preset,
    list_presets,
    load_preset_overlay,
    save_preset,
)
from modules.config.train_config import CURRENT_VERSION, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_user_dir(tmp_path, monkeypatch):
    """User presets live under DIFFTRAINER_HOME; never read or write the real one."""
    monkeypatch.setenv("DIFFTRAINER_HOME", str(tmp_path / "home"))


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


# --- presets --------------------------------------------------------------------------------

def test_builtin_presets_are_listed_under_their_family():
    presets = {p.name: p for p in list_presets()}
    for name in ("demo", "SD1.5 LoRA"):
        assert presets[name].builtin and presets[name].family == "sd15"
        assert presets[name].path.is_file()


@pytest.mark.parametrize("name", ["demo", "SD1.5 LoRA"])
def test_builtin_presets_build_a_valid_config(name):
    overlay = load_preset_overlay(name)
    config = build_config([overlay])  # what `presets show NAME` prints
    assert config.model.family == "sd15"
    # the merged config round-trips through its JSON
    assert TrainConfig.model_validate_json(config.model_dump_json()) == config


def test_the_demo_preset_says_what_the_demo_needs():
    config = build_config([load_preset_overlay("demo")])
    assert config.data.resolution == 64 and config.train_device == "cpu"
    assert config.schedule.max_steps == 50


def test_save_writes_only_what_differs_plus_version_and_family(tmp_path):
    config = build_config([{
        "adapter": {"rank": 4},
        "seed": 3,
        "model": {"parts": {"text_encoder": {"train": True}}},
        "schedule": {"sample_every": "100 steps"},
    }])
    path = save_preset(config, "mine")
    assert path == tmp_path / "home" / "presets" / "mine.json"
    assert json.loads(path.read_text(encoding="utf-8")) == {
        "version": CURRENT_VERSION,
        "model": {"family": "sd15", "parts": {"text_encoder": {"train": True}}},
        "adapter": {"rank": 4},
        "schedule": {"sample_every": {"value": 100.0}},
        "seed": 3,
    }


def test_saving_the_defaults_writes_only_version_and_family():
    path = save_preset(build_config([]), "plain")
    assert json.loads(path.read_text(encoding="utf-8")) == {"version": CURRENT_VERSION, "model": {"family": "sd15"}}


def test_a_saved_preset_loads_back_equal(tmp_path):
    config = build_config([load_preset_overlay("SD1.5 LoRA")], [
        "concepts[0].path=/data/me", "concepts[0].repeats=4", "model.base=/models/sd15", "optimizer.lr=3e-4",
    ])
    save_preset(config, "my sd15")
    assert find_preset("my sd15").builtin is False
    assert build_config([load_preset_overlay("my sd15")]) == config
    assert not list((tmp_path / "home" / "presets").glob("*.tmp"))  # written atomically


def test_a_user_preset_shadows_a_builtin_of_the_same_name(tmp_path):
    folder = tmp_path / "home" / "presets"
    folder.mkdir(parents=True)
    write_json(folder / "demo.json", {"version": 1, "model": {"family": "sd15"}, "seed": 5})
    names = [(p.name, p.builtin) for p in list_presets()]
    assert ("demo", True) in names and ("demo", False) in names
    for spelling in ("demo", "DEMO"):
        preset = find_preset(spelling)
        assert preset.builtin is False and preset.path == folder / "demo.json"
    config = build_config([load_preset_overlay("demo")])
    assert config.seed == 5 and config.data.resolution == 512  # the user's preset, not the built-in


@pytest.fixture
def _unwarned(monkeypatch):
    """Each test sees the renamed presets' first use (the warning is once per process)."""
    from modules.config import preset_aliases

    monkeypatch.setattr(preset_aliases, "_warned", set())


def test_every_renamed_preset_names_a_builtin_and_no_old_name_is_one():
    from modules.config.preset_aliases import RENAMED_PRESETS

    builtins = {p.name for p in list_presets() if p.builtin}
    assert set(RENAMED_PRESETS.values()) <= builtins
    assert not set(RENAMED_PRESETS) & builtins  # an old name still on disk would never reach its alias


def test_an_old_preset_name_loads_the_renamed_one_and_warns_once(_unwarned):
    import warnings

    with pytest.warns(FutureWarning, match="'Flux embedding 24GB'"):
        preset = find_preset("flux EMBEDDING")  # matched case-insensitively, as names are
    assert preset.builtin and preset.name == "Flux embedding 24GB"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use does not warn again
        assert load_preset_overlay("Flux embedding") == load_preset_overlay("Flux embedding 24GB")


def test_a_user_preset_with_an_old_name_shadows_the_alias(tmp_path, _unwarned):
    import warnings

    folder = tmp_path / "home" / "presets"
    folder.mkdir(parents=True)
    write_json(folder / "Flux embedding.json", {"version": 1, "model": {"family": "sd15"}, "seed": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preset = find_preset("Flux embedding")
    assert preset.builtin is False and preset.path == folder / "Flux embedding.json"


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError) as caught:
        find_preset("no such preset")
    (problem,) = caught.value.problems
    assert "no such preset" in problem and "demo" in problem


def test_a_broken_user_preset_is_listed_and_named_when_loaded(tmp_path):
    folder = tmp_path / "home" / "presets"
    folder.mkdir(parents=True)
    (folder / "broken.json").write_text("{", encoding="utf-8")
    assert "broken" in [p.name for p in list_presets()]
    with pytest.raises(ConfigError) as caught:
        load_preset_overlay("broken")
    assert "broken.json" in caught.value.problems[0]


@pytest.mark.parametrize("name", ["", "a/b", "..\\up", ".hidden", "what?", 'say "hi"', "c:d", "x|y", "a*"])
def test_bad_preset_names_are_refused(tmp_path, name):
    config = build_config([])
    with pytest.raises(ConfigError) as caught:
        save_preset(config, name)
    assert caught.value.problems[0].startswith("preset name")
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.json"))


# --- the command line -----------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def cli_runs(tmp_path_factory):
    """launch.py runs in child processes, started before this module's first test so that their
    imports (torch, diffusers) overlap with the tests that run in this process."""
    folder = tmp_path_factory.mktemp("cli")
    bad = write_json(folder / "bad.json", {"adapter": {"rnak": 4}, "concepts": [{"path": "x", "repeats": 0}]})
    env = {**os.environ, "DIFFTRAINER_HOME": str(folder / "home"), "PYTHONPATH": str(ROOT)}
    commands = {"schema": ["schema"], "train": ["train", "--config", str(bad)]}
    started = {
        key: subprocess.Popen([sys.executable, str(ROOT / "launch.py"), *args], cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for key, args in commands.items()
    }
    results: dict[str, tuple[int, str, str]] = {}

    def result(key: str) -> tuple[int, str, str]:
        if key not in results:
            stdout, stderr = started[key].communicate(timeout=120)
            results[key] = (started[key].returncode, stdout, stderr)
        return results[key]

    yield result
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_cli_schema_prints_the_json_schema(cli_runs):
    code, stdout, stderr = cli_runs("schema")
    assert code == 0, stderr
    schema = json.loads(stdout)
    assert schema["type"] == "object"
    assert {"concepts", "model", "adapter", "optimizer", "schedule"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False  # unknown keys are errors for editors too


def test_cli_train_with_a_bad_config_prints_the_problems_not_a_traceback(cli_runs):
    code, stdout, stderr = cli_runs("train")
    assert code == 1
    assert "Traceback" not in stderr
    assert "error:" in stderr
    assert "adapter.rnak: unknown key" in stderr
    assert "concepts[0].repeats: must be >= 1" in stderr


def _launch_main(argv: list[str]) -> int:
    """launch.main in this process (the model family is imported here already; a child would
    pay for importing it again)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_under_test", ROOT / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_cli_presets_show_prints_the_merged_json(capsys):
    assert _launch_main(["presets", "show", "demo"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["data"]["resolution"] == 64  # from the preset
    assert shown["model"]["parts"]["unet"]["train"] is True  # from the defaults
    assert TrainConfig.model_validate(shown) == build_config([load_preset_overlay("demo")])


def test_cli_presets_show_of_an_unknown_preset_is_one_error(capsys):
    assert _launch_main(["presets", "show", "no such preset"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no such preset" in err


def test_cli_presets_lists_builtins(capsys):
    assert _launch_main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "SD1.5 LoRA" in out and "built-in" in out
