"""The GUI finds a model of another family as soon as it is chosen (a field error on model.base),
not ~30 s into the load; the line is the preflight's own (modules/model/detect.py)."""

from __future__ import annotations

from ui.state import ConfigState, default_data


def _problems(base, family: str) -> list[str]:
    state = ConfigState(default_data(family))
    state.set("model.base", str(base))
    return [line for line in state.validate() if line.startswith("model.base")]


def test_a_model_of_another_family_is_a_field_error_at_once(tiny_model, tmp_path):
    problems = _problems(tiny_model, "sdxl")
    assert len(problems) == 1, problems
    assert "Stable Diffusion 1.5" in problems[0] or "sd15" in problems[0], problems[0]
    assert "set model.family to 'sd15'" in problems[0]


def test_the_right_family_and_an_unreadable_folder_are_not_flagged(tiny_model, tmp_path):
    assert _problems(tiny_model, "sd15") == []
    assert _problems(tmp_path, "sd15") == []  # says nothing about itself: the loader names it later
