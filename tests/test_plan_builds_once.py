"""One plan builds its meta architecture once (issue 25): the step and the phase passes both change
the parts they run, so the phase passes get a copy kept from before the step, not a second build."""

from __future__ import annotations

from modules.config.loading import build_config
from modules.plan import run_plan


def test_a_plan_builds_the_architecture_once(tiny_family_model, monkeypatch):
    builds = []
    build = run_plan.Planner._architecture

    def counted(self, config, modes):
        builds.append(modes)
        return build(self, config, modes)

    monkeypatch.setattr(run_plan.Planner, "_architecture", counted)
    config = build_config([{"model": {"family": "sd15", "base": str(tiny_family_model("sd15"))},
                            "data": {"resolution": 64}}])
    plan = run_plan.plan_run(config, None, None, fix=False)
    assert plan.device_peak > 0
    assert len(builds) == 1
