"""The memory plan in the window (issue 25 item 3): the Offload tab's plan panel (ui/plan_panel.py)
plans the config as it stands with the real `launch.py plan --json` (a child process, off the Tk
thread), shows a bar per part and the verdict, follows edits, and shows a run's measured `memory`
event beside the plan. The default config (SD1.5, no base model: its released architecture) is
planned at real width, no weights read."""

from __future__ import annotations

import pytest

from gui_driver import edit, fresh, pump

PLAN_TIMEOUT = 180  # one `launch.py plan` child: seconds; a busy 2-core machine is slower


@pytest.fixture(scope="module")
def app(display, home):
    from ui.app import App

    window = App(machine_info={"families": {}, "devices": {"cpu": {}}}, restore=False)
    yield window
    window.destroy()


def wait_for_plan(app, accept=lambda plan: True, what="a plan") -> dict:
    panel = app.plan_panel
    pump(app, lambda: (panel._asked_for is not None and not panel.worker.busy and panel.plan is not None
                       and accept(panel.plan)), timeout=PLAN_TIMEOUT,
         what=f"{what} (panel says {panel.state_label.cget('text')!r})")
    return panel.plan


def test_the_default_config_is_planned_once_the_panel_is_in_view(app):
    fresh(app)
    panel = app.plan_panel
    pump(app, timeout=1.0)  # past the debounce
    assert panel.worker.requested == 0, "a panel out of view planned"
    app.tabview.set("Offload")
    plan = wait_for_plan(app)
    parts = list(app.cfg.data["model"]["parts"])
    assert list(plan["parts"]) == parts
    assert [name for name, _, _ in panel.rows] == parts
    device = plan["device"]
    assert device["step"] == sum(part["device"]["total"] for part in plan["parts"].values()) > 0
    assert device["peak"] == max(device["step"], *device["outside_step_phases"].values())
    assert "planned device peak" in panel.verdict.cget("text")
    # (the default SD1.5 run's peak is its step's: the bars' total)
    assert device["peak"] == device["step"] and "(while" not in panel.verdict.cget("text")
    assert panel.state_label.cget("text") == "of the config as it stands"
    drawn = [panel.canvas.itemcget(item, "text") for item in panel.canvas.find_all()
             if panel.canvas.type(item) == "text"]
    assert [*parts, "total"] == [text for text in drawn if text in (*parts, "total")]
    assert app.callback_errors == []


def test_offloading_a_part_moves_its_bytes_off_the_device(app):
    panel = app.plan_panel
    app.tabview.set("Offload")
    before = wait_for_plan(app)["parts"]["unet"]
    assert before["parked"] == 0
    edit(app, "Offload", "model.parts.unet.gradient_checkpointing", True)
    edit(app, "Offload", "model.parts.unet.offload_fraction", "0.5")
    after = wait_for_plan(app, lambda plan: plan["parts"]["unet"]["offload_fraction"] == 0.5,
                          "the plan with unet half offloaded")["parts"]["unet"]
    assert after["parked"] > 0
    assert after["device"]["weights"] < before["device"]["weights"]
    unet_row = next(row for row in panel.rows if row[0] == "unet")
    assert unet_row == ("unet", after["device"]["total"], after["parked"])


def test_a_runs_measured_memory_shows_beside_the_plan(app):
    # beside the plan the previous test waited for (before the budget's test, whose cleanup edit would
    # start one more `launch.py plan` child just for this)
    panel = app.plan_panel
    app.tabview.set("Offload")
    plan = wait_for_plan(app)
    event = {"event": "memory", "step": 2,
             "measured": {"device": "cuda:0", "device_peak_allocated": plan["device"]["peak"] // 2,
                          "device_peak_reserved": None, "host_peak_rss": 3 * 2**30, "host_rss": 2 * 2**30},
             "planned": {"device_peak": plan["device"]["peak"], "host_train_peak": plan["host"]["train_peak"]}}
    app._event(event)  # what the run's reader delivers (the jsonl form: tests/test_memory_report.py)
    pump(app, timeout=0.2)
    line = app.tabs["Run"].memory_line.cget("text")
    assert line.startswith("Memory after step 2: cuda:0 peak ") and "(planned " in line
    total_label = [panel.canvas.itemcget(item, "text") for item in panel.canvas.find_all()
                   if panel.canvas.type(item) == "text" and "measured" in panel.canvas.itemcget(item, "text")]
    assert len(total_label) == 1
    assert app.callback_errors == []


def test_the_verdict_and_the_fixes_for_a_budget(app, tiny_model):
    from ui.components import ERROR_COLOR

    panel = app.plan_panel
    edit(app, "Model", "model.base", str(tiny_model))
    batch_tab, _ = app.field_for("schedule.batch_size")
    edit(app, batch_tab, "schedule.batch_size", "auto")  # the plan picks it, and says so
    app.tabview.set("Offload")
    panel.budget.set("0.0001")  # GiB: under the tiny model's planned peak
    plan = wait_for_plan(app, lambda plan: plan["fits"] is False and plan["device"]["budget"] == int(0.0001 * 2**30),
                         "a plan that does not fit 0.0001 GiB")
    assert panel.verdict.cget("text").startswith("Does not fit: planned device peak ")
    assert panel.verdict.cget("text_color") == ERROR_COLOR
    if plan["fixes"]:
        assert panel.fixes.cget("text").startswith("To fit, change:\n  --set ")
    assert "auto: schedule.batch_size = 1 (nothing fits the budget)" in panel.details.cget("text").splitlines()
    edit(app, batch_tab, "schedule.batch_size", "2")
    panel.budget.set("lots")
    pump(app, lambda: "not 'lots'" in panel.state_label.cget("text"), timeout=5, what="the budget refused")
    panel.budget.set("")


def test_the_verdict_says_which_phase_outside_the_step_sets_the_peak():
    from ui.plan_panel import verdict_text

    device = {"peak": 7 * 2**30, "step": 5 * 2**30, "budget": 8 * 2**30,
              "outside_step_phases": {"caching": 6 * 2**30, "sampling": 7 * 2**30}}
    assert verdict_text({"fits": True, "device": device}) == \
        "Fits: planned device peak 7.00 GiB (while sampling) of a 8.00 GiB budget."
    device.update(peak=5 * 2**30, outside_step_phases={"caching": 4 * 2**30})
    assert "(while" not in verdict_text({"fits": True, "device": device})
