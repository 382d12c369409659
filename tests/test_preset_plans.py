"""The presets say what they need (issue 25 item 4): every built-in preset's plan is kept in
resources/preset_plans.json by tools/preset_plans.py, README's preset table is rendered from it, a
preset whose name has a VRAM tier plans within that tier, and the kept figures are the planner's
own (a preset edited since, or the planner changed since, fails here until they are re-planned)."""

from __future__ import annotations

import pytest

from tools.preset_plans import GiB, builtin_presets, digest, plan_preset, preset_config, read_plans, readme_block, \
    render


@pytest.fixture(scope="module")
def plans() -> list[dict]:
    return read_plans()


def test_every_builtin_preset_is_planned_as_it_is_now(plans):
    kept = {entry["preset"]: entry for entry in plans}
    assert sorted(kept) == sorted(builtin_presets()), "re-plan: python -m tools.preset_plans --write"
    stale = [name for name, entry in kept.items() if entry["digest"] != digest(preset_config(name))]
    assert not stale, f"edited since planned: {stale}; re-plan: python -m tools.preset_plans --write --preset NAME"


def test_a_preset_with_a_vram_tier_plans_within_it(plans):
    over = [f"{e['preset']}: {e['device_peak'] / GiB:.2f} GiB" for e in plans
            if e["tier_gib"] and not (e["fits"] and e["device_peak"] <= e["tier_gib"] * GiB)]
    assert not over, over


def test_readme_table_is_the_rendered_one(plans):
    from tools.preset_plans import README

    assert readme_block(README.read_text(encoding="utf-8")) == render(plans), \
        "README's preset table is stale: python -m tools.preset_plans --render"


def test_the_quickest_presets_plan_is_the_kept_one(plans):
    """The planner re-run on one preset (the one that planned quickest) gives the figures kept."""
    quickest = min((e for e in plans if e["tier_gib"]), key=lambda e: e["plan_seconds"])
    again = plan_preset(quickest["preset"])
    fields = ("device_peak", "host_peak", "fits", "fixes", "auto", "seconds_per_step")
    assert {k: again[k] for k in fields} == {k: quickest[k] for k in fields}, quickest["preset"]
