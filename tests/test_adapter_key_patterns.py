"""resources/adapter_key_patterns.json is what the released architectures give, and naming a refused
adapter.init_from file's family from it builds only the families that can win, with the answer the
exhaustive count gives (modules/trainer/init_from_family.py, modules/adapters/formats/key_patterns.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from modules.adapters.formats.file_model import keys_naming
from modules.config.families import family_names, get_family_class
from modules.trainer import init_from_family
from tools import adapter_key_patterns as tool


@pytest.fixture(scope="module")
def released_stems() -> dict[str, set[str]]:
    return tool.released_stems()  # every family on meta: ~15 s


def test_the_patterns_file_is_what_the_released_architectures_give(released_stems):
    assert tool.PATTERNS_FILE.read_text() == tool.render(tool.patterns_of(released_stems)), (
        "resources/adapter_key_patterns.json is stale: run python -m tools.adapter_key_patterns --write")


def _exhaustive(keys, families, stems):
    """The family naming the most keys, the first declared on a tie: what every family built says."""
    best, named = None, 0
    for family in families:
        count = len(keys_naming(keys, stems[family.name]))
        if count > named:
            best, named = family, count
    return best, named


def _files(stems) -> dict[str, list[str]]:
    """Two files per family (its first 40 stems sorted: a few layers of its first blocks; and every
    97th: all over it), and a mix of two families' (more of SDXL's than of Wan's)."""
    files = {}
    for name, found in stems.items():
        files[name] = [f"{stem}.alpha" for stem in sorted(found)[:40]]
        files[name + " spread"] = [f"{stem}.lora_down.weight" for stem in sorted(found)[::97]]
    files["sdxl+wan"] = files["sdxl"] + files["wan"][:10]
    return files


def test_naming_from_the_patterns_is_the_exhaustive_count(released_stems, monkeypatch):
    monkeypatch.setattr(init_from_family, "built_on_meta",
                        lambda config: _Stems(released_stems[config.model.family]))
    monkeypatch.setattr(init_from_family, "model_stems", lambda built: built.stems)
    families = [get_family_class(name) for name in family_names()]
    for name, keys in _files(released_stems).items():
        for own in ("sd15", "flux"):
            others = [family for family in families if family.name != own]
            best, named = _exhaustive(keys, others, released_stems)
            got, why = init_from_family._family_by_keys(keys, others)
            assert (got, why) == (best, f"{named} of its keys name that model's layers" if best else ""), (name, own)


class _Stems:
    def __init__(self, stems):
        self.stems = stems


def test_a_flux_lora_is_named_by_building_flux_alone(monkeypatch):
    built = []
    real = init_from_family.built_on_meta
    monkeypatch.setattr(init_from_family, "built_on_meta", lambda config: built.append(config.model.family) or real(config))
    keys = [f"{stem}.{name}" for stem in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_3_linear1")
            for name in ("lora_down.weight", "lora_up.weight", "alpha")]
    others = [get_family_class(name) for name in family_names() if name != "sd15"]
    family, why = init_from_family._family_by_keys(keys, others)
    assert (family.name, why) == ("flux", "6 of its keys name that model's layers")
    assert built == ["flux"]  # Kontext shares its layers: at best a tie, which FLUX.1 keeps


def test_a_file_no_family_names_builds_none(monkeypatch):
    monkeypatch.setattr(init_from_family, "built_on_meta", lambda config: pytest.fail("built " + config.model.family))
    families = [get_family_class(name) for name in family_names()]
    assert init_from_family._family_by_keys(["lora_unet_not_a_layer_anywhere.alpha"], families) == (None, "")


def test_a_tie_goes_to_the_first_declared_family_even_when_a_later_one_promised_more(monkeypatch):
    # b's patterns promise both keys, a's one; each names one: the tie is a's, as the exhaustive count says
    a, b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    monkeypatch.setattr(init_from_family, "family_key_patterns", lambda: {"a": {"x_#"}, "b": {"x_#", "y_#"}})
    monkeypatch.setattr(init_from_family, "built_on_meta", lambda config: _Stems({"x_1"}))
    monkeypatch.setattr(init_from_family, "model_stems", lambda built: built.stems)
    monkeypatch.setattr(init_from_family.TrainConfig, "model_validate",
                        lambda data: SimpleNamespace(model=SimpleNamespace(family=data["model"]["family"])))
    assert init_from_family._family_by_keys(["x_1.alpha", "y_1.alpha"], [a, b]) == (a, "1 of its keys name that model's layers")
