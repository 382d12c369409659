"""The generated form in a real window (Xvfb): every leaf of the config's JSON schema has a widget,
and a value set through that widget reaches the exported config; per-part fields stay bound across
tabs and reach a run's config.json; the run bar stays on screen at the smallest size and at 150%;
the loss curve and gallery come back on resume and on reopen; presets keep the model and concepts.

The leaves are read from `TrainConfig.model_json_schema()` (what `launch.py schema` prints), not
from the GUI, so a config field added without a widget fails here. One window serves the module.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from gui_driver import FAKE_RUN, TABS, pump, run_to_end
from gui_driver import screenshot as grab

FAMILY = "sd15"


# --- the schema's leaves ------------------------------------------------------------------------------

def _resolve(node: dict, defs: dict) -> dict:
    while "$ref" in node:
        node = {**defs[node["$ref"].split("/")[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def schema_leaves() -> list[tuple[str, str | None, dict]]:
    """(dotted path, the union member it needs as 'union.type=kind' or None, schema node) for every
    leaf of the schema: list items at [0], dict entries at the family's parts, tuples by index, each
    union member's (optimizer's, method's, adapter algorithm's) own fields under its union. The adapter
    algorithms share most fields through their configs' common bases: such a field is walked
    under the first algorithm that has it."""
    from modules.config.train_config import TrainConfig
    from modules.config.families import get_family_class

    schema = TrainConfig.model_json_schema()
    defs = schema.get("$defs", {})
    parts = list(get_family_class(FAMILY).default_parts())
    leaves = []

    def walk(node: dict, path: str, tag: str | None) -> None:
        node = _resolve(node, defs)
        members = node.get("oneOf") or node.get("anyOf") or []
        models = [_resolve(m, defs) for m in members]
        if members and all(m.get("type") == "object" and "properties" in m for m in models):
            for member in models:  # a discriminated union (optimizer, adapter): each member's fields
                kind = f"{path}.type={member['properties']['type']['const']}"
                for name, sub in member["properties"].items():
                    walk(sub, f"{path}.{name}", tag if name == "type" else kind)
            return
        if node.get("type") == "object" and "properties" in node:
            for name, sub in node["properties"].items():
                walk(sub, f"{path}.{name}" if path else name, tag)
            return
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            for part in parts:  # model.parts / adapter.parts: keyed by the family's parts
                walk(node["additionalProperties"], f"{path}.{part}", tag)
            return
        if node.get("type") == "array" and "prefixItems" in node:
            for index, item in enumerate(node["prefixItems"]):
                walk(item, f"{path}[{index}]", tag)
            return
        items = _resolve(node.get("items") or {}, defs) if node.get("type") == "array" else {}
        if items.get("type") == "object" and "properties" in items:
            walk(items, f"{path}[0]", tag)
            return
        leaves.append((path, tag, node))

    walk(schema, "", None)
    unique: dict[tuple, dict] = {}
    for path, tag, node in leaves:
        shared = path.startswith("adapter.") and any(p == path and n == node for (p, _), n in unique.items())
        if path != "version" and not shared:  # version: not a setting
            unique[(path, tag)] = node
    return [(path, tag, node) for (path, tag), node in unique.items()]


LEAVES = schema_leaves()

# what must be set first for a field to apply (it is hidden until then) or for its value to be valid
NEEDS = {
    "adapter.dora_axis": {"adapter.dora": True},
    "concepts[0].caption_file": {"concepts[0].caption_source": "file"},
    "concepts[0].unmasked_weight": {"concepts[0].masked_loss": True},
    "loss.huber_delta": {"loss.type": "huber"},
    "loss.logit_mean": {"loss.timesteps": "logit_normal"},
    "loss.logit_std": {"loss.timesteps": "logit_normal"},
    "lr_scheduler.cycles": {"lr_scheduler.type": "cosine_with_restarts"},
    "lr_scheduler.power": {"lr_scheduler.type": "polynomial"},
    "ema.decay": {"ema.enabled": True},
    "ema.update_every": {"ema.enabled": True},
    "ema.device": {"ema.enabled": True},
    "embeddings[0].train": {"embeddings[0].path": "/embeddings/my-style.safetensors"},  # frozen: from a file
    "data.crop_jitter": {"data.cache_latents": False},
    "data.color_jitter": {"data.cache_latents": False},
    "distributed.shard_parts": {"distributed.gpus": 2},  # sharding splits over 2 or more GPUs
    "sampling.prompts[0].control_images": {"model.family": "flux2"},  # shown where prompts take images
}
for _part in ("unet", "text_encoder", "vae"):
    NEEDS[f"model.parts.{_part}.nf4_double_quant"] = {f"model.parts.{_part}.weight_dtype": "nf4"}
    NEEDS[f"model.parts.{_part}.learning_rate"] = {f"model.parts.{_part}.train": True}
    NEEDS[f"model.parts.{_part}.activation_offloading"] = {f"model.parts.{_part}.gradient_checkpointing": True}
    NEEDS[f"model.parts.{_part}.offload_fraction"] = {f"model.parts.{_part}.gradient_checkpointing": True}

# values the schema alone cannot pick (free strings with rules, choices from the registry)
VALUES = {"model.family": "sdxl", "adapter.layer_preset": "attn", "train_device": "cpu", "temp_device": "meta",
          "adapter.factor": 4, "concepts[0].captions.separator": ";", "data.resolution": [256, 512],
          "distributed.shard_parts": ["unet"]}


def new_value(path: str, node: dict, current):
    """A valid value different from `current`, from the field's schema (type, enum, bounds)."""
    if path in VALUES:
        return VALUES[path]
    options = node.get("anyOf") or [node]
    types = {o.get("type") for o in options}
    choices = [v for o in options for v in (o.get("enum") or ([o["const"]] if "const" in o else []))]
    if choices and types <= {None, "string", "null"}:
        return next(c for c in choices if c != current)
    if "boolean" in types:
        return not current
    if "array" in types:
        return ["edited.*"]
    bounded = next((o for o in options if o.get("type") in ("integer", "number")), None)
    if bounded is not None:
        low = bounded.get("minimum", bounded.get("exclusiveMinimum"))
        high = bounded.get("maximum", bounded.get("exclusiveMaximum"))
        if bounded["type"] == "integer":
            step = bounded.get("multipleOf", 1)
            return (current if isinstance(current, int) else (low or 0)) + step
        if high is not None and (low is not None or high <= 0):
            low = low if low is not None else high - 2
            value = (low + high) / 2
            return value if value != current else (low + 3 * high) / 4
        return (current if isinstance(current, (int, float)) and not isinstance(current, bool) else 1.0) * 2 + 0.25
    return f"edited-{path.replace('.', '-')}"


# --- the window ---------------------------------------------------------------------------------------

INFO = {"families": {}, "devices": {"cpu": {}}}  # no `launch.py info` child: the schema's choices


@pytest.fixture(scope="module")
def app(display, home):
    from ui.app import App

    window = App(machine_info=INFO, restore=False)
    pump(window, timeout=0.2)
    yield window
    try:
        if window.client is not None:
            window.client.kill()
        window.destroy()
    except Exception:  # already closed
        pass


def base_data() -> dict:
    """Defaults with one concept, one prompt and one embedding, so their fields exist."""
    from modules.config.loading import build_config

    return build_config([{"concepts": [{"path": "/images"}], "sampling": {"prompts": [{"prompt": "a cat"}]},
                          "embeddings": [{"placeholder": "<my-style>"}]}]).model_dump(mode="json")


def through_widget(app, path: str, value) -> None:
    """Set `path` the way the user does: the bound widget's variable changes."""
    from ui.state import to_text

    tab, widget = app.field_for(path)
    assert widget is not None, f"{path}: no widget is bound to it"
    app.tabview.set(tab)
    binding = next(b for b in widget.bindings if b.path == path)  # a cadence's value or its unit
    binding.var.set(to_text(binding.kind, value))
    pump(app, timeout=0)  # one pass of the event loop: the trace has set the config already; no timer to wait for


def exported(app, tmp_path) -> dict:
    assert app.cfg.config is not None, app.cfg.problems
    target = tmp_path / "exported.json"
    app.export_config(str(target))
    return json.loads(target.read_text())


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


@pytest.mark.parametrize("path,member,node", LEAVES, ids=[f"{p}<{t.split('=')[1]}>" if t else p for p, t, _ in LEAVES])
def test_every_schema_leaf_is_set_through_its_widget(app, tmp_path, path, member, node):
    from ui.state import get_path

    app.cfg.load(base_data())
    pump(app, timeout=0)
    if member:
        union_type, kind = member.split("=")
        through_widget(app, union_type, kind)
    for needed, value in NEEDS.get(path, {}).items():
        through_widget(app, needed, value)
    _tab, widget = app.field_for(path)
    assert widget is not None, f"{path}: no widget is bound to it (a config field the GUI cannot reach)"
    assert widget.is_visible(), f"{path}: its widget is hidden"
    assert widget.tooltip_text, f"{path}: no tooltip (give the field a description in train_config.py)"
    value = new_value(path, node, app.cfg.get(path))
    through_widget(app, path, value)
    data = exported(app, tmp_path)
    assert _same(get_path(data, path), value), f"{path}: exported {get_path(data, path)!r}, set {value!r}"
    assert app.callback_errors == []


def test_fields_that_do_not_apply_are_hidden(app):
    app.cfg.load(base_data())
    pump(app, timeout=0.05)
    hidden = ["concepts[0].caption_file", "model.parts.unet.nf4_double_quant", "loss.huber_delta"]
    for path in hidden:
        assert not app.field_for(path)[1].is_visible(), f"{path} shows under the defaults"
        assert not app.field_for(path)[1].winfo_ismapped()
    # only the chosen adapter algorithm's own options exist; the ones both have are kept on a switch
    adapter_tab = app.tabs["Adapter"]
    assert app.field_for("adapter.factor")[1] is None and app.field_for("adapter.block_size")[1] is None
    through_widget(app, "adapter.rank", 8)
    through_widget(app, "adapter.type", "lokr")
    assert app.field_for("adapter.block_size")[1] is None and app.cfg.get("adapter.rank") == 8
    through_widget(app, "adapter.type", "oft")
    assert app.field_for("adapter.factor")[1] is None and app.field_for("adapter.rank")[1] is None
    assert app.field_for("adapter.block_size")[1].winfo_manager() == "pack"
    assert not adapter_tab.parts_frame.winfo_manager()  # OFT has no per-part rank/alpha
    assert app.cfg.config is not None, app.cfg.problems
    through_widget(app, "adapter.type", "lokr")
    assert adapter_tab.parts_frame.winfo_manager() == "pack"
    through_widget(app, "concepts[0].caption_source", "file")
    pump(app, timeout=0.1)
    for path in ("adapter.factor", "concepts[0].caption_file"):
        field = app.field_for(path)[1]
        assert field.is_visible() and field.winfo_manager() == "pack", path


def test_per_part_fields_stay_bound_and_reach_the_run(app, tmp_path, monkeypatch):
    """Model tab (weight_dtype, path) and Training tab (train, learning_rate) edits land in the
    config and in the config.json of a run started with Start, after the family changed twice."""
    app.cfg.load(base_data())
    from modules.config.families import get_family_class

    for family in ("sdxl", FAMILY):
        app._family_chosen(get_family_class(family).label)  # what picking it in the selector calls
        pump(app, timeout=0.05)
    text_encoder = tmp_path / "te"
    text_encoder.mkdir()
    edits = {"model.parts.unet.weight_dtype": "nf4", "model.parts.text_encoder.path": str(text_encoder),
             "model.parts.text_encoder.train": True, "model.parts.text_encoder.learning_rate": 3e-5}
    for path, value in edits.items():
        through_widget(app, path, value)
        assert app.cfg.get(path) == value, path
    assert app.field_for("model.parts.unet.weight_dtype")[0] == "Model"
    assert app.field_for("model.parts.text_encoder.learning_rate")[0] == "Training"
    # a run started from the window uses them (a child that only speaks the protocol)
    images = tmp_path / "images"
    images.mkdir()
    base = tmp_path / "model"
    base.mkdir()
    through_widget(app, "model.base", str(base))
    through_widget(app, "concepts[0].path", str(images))
    through_widget(app, "workspace_dir", str(tmp_path / "ws"))
    monkeypatch.setattr(app, "run_argv", lambda _config: [sys.executable, "-c", FAKE_RUN, "ok", "0",
                                                           str(tmp_path / "marker")])
    assert app.start(), app.refused
    run_to_end(app, timeout=30)
    config = json.loads((app.client.run_dir / "config.json").read_text())
    parts = config["model"]["parts"]
    assert parts["unet"]["weight_dtype"] == "nf4"
    assert parts["text_encoder"]["train"] is True and parts["text_encoder"]["learning_rate"] == 3e-5
    assert parts["text_encoder"]["path"] == str(text_encoder)
    # the Model tab shows what a loaded config trains with
    data = base_data()
    data["model"]["parts"]["unet"]["weight_dtype"] = "bfloat16"
    app.cfg.load(data)
    pump(app, timeout=0.02)
    assert app.field_for("model.parts.unet.weight_dtype")[1].var.get() == "bfloat16"


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_run_bar_visible_at_the_smallest_size(app, tmp_path, scale):
    """At 900x600 (the minimum size) and 150% scale, on every tab: Start/Stop, the commands, the
    progress and the status are shown and inside the window."""
    app.cfg.load(base_data())  # a concept and a prompt: the Concepts and Sampling tabs are long
    app.set_ui_scale(f"{round(scale * 100)}%")
    try:
        app.geometry("900x600")
        for tab in TABS:
            app.tabview.set(tab)
            pump(app, timeout=0.3)
            if tab == "Run":
                print(f"screenshot: {grab(app, tmp_path / f'run-bar-{round(scale * 100)}.png')}")
            window_bottom = app.winfo_rooty() + app.winfo_height()
            window_right = app.winfo_rootx() + app.winfo_width()
            for widget in [app.start_button, *app.command_buttons.values(), app.progress, app.status_label]:
                assert widget.winfo_ismapped(), f"{tab}: {widget} is not shown"
                assert widget.winfo_rooty() + widget.winfo_height() <= window_bottom, f"{tab}: {widget} below the window"
                assert widget.winfo_rootx() + widget.winfo_width() <= window_right, f"{tab}: {widget} right of the window"
    finally:
        app.set_ui_scale("100%")
        pump(app, timeout=0.2)


FAKE_STEPS = """
import json, sys
first, last = int(sys.argv[1]), int(sys.argv[2])
def emit(**event):
    print(json.dumps(event), flush=True)
emit(event="started", total_steps=last)
for step in range(first, last + 1):
    emit(event="progress", step=step, total_steps=last, epoch=0, epochs=1, loss=1.0 / step, lr=1e-4,
         it_per_s=1.0, eta_s=0.0)
emit(event="sample", path=sys.argv[3] + f"/step{last:07d}-0.png")
emit(event="finished")
"""


def test_resume_and_reopen_restore_the_loss_curve_and_gallery(app, home, tmp_path, monkeypatch):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    base = tmp_path / "model"
    base.mkdir()
    data = base_data()
    data["model"]["base"], data["concepts"][0]["path"] = str(base), str(images)
    data["workspace_dir"] = str(tmp_path / "ws")
    app.cfg.load(data)
    samples = tmp_path / "samples"
    samples.mkdir()
    for step in (3, 5):
        Image.new("RGB", (16, 16), "red").save(samples / f"step{step:07d}-0.png")
    steps = iter([("1", "3"), ("4", "5")])  # the second run resumes from a backup at step 3
    monkeypatch.setattr(app, "run_argv", lambda _config: [sys.executable, "-c", FAKE_STEPS, *next(steps),
                                                           str(samples)])
    assert app.start(), app.refused
    run_to_end(app, timeout=30)
    through_widget(app, "backup.resume", True)
    assert app.start(), app.refused
    pump(app, timeout=0.05)
    run_tab = app.tabs["Run"]
    run_to_end(app, timeout=30)
    assert run_tab.steps == [1, 2, 3, 4, 5]
    assert run_tab.losses[:2] == [1.0, 0.5]
    assert [run_tab.caption(p) for p in run_tab.samples] == ["step 3: a cat", "step 5: a cat"]
    # reopened (what App.__init__ does with restore=True; a second Tk root cannot share this
    # process's images): the last run and the one it resumed
    run_tab.clear()
    app._show_last_run()
    pump(app, timeout=0.3)
    assert run_tab.steps == [1, 2, 3, 4, 5] and len(run_tab.samples) == 2


def test_status_says_stopped_failed_finished_and_clears_a_refusal(app, tmp_path, monkeypatch):
    app.cfg.load(base_data())  # /images is not a folder: refused
    assert not app.start()
    assert app.status_label.cget("text").startswith("Training cannot start")
    dialog = app.dialogs[-1]
    assert dialog.message.startswith(app.refused[0])  # the dialog leads with the error line
    images = tmp_path / "images"
    images.mkdir()
    base = tmp_path / "model"
    base.mkdir()
    through_widget(app, "model.base", str(base))
    through_widget(app, "concepts[0].path", str(images))
    assert app.cfg.problems == []
    assert not app.status_label.cget("text").startswith("Training cannot start")
    dialog.destroy()
    slow = ("import json, sys, time\nprint(json.dumps({'event': 'started', 'total_steps': 9}), flush=True)\n"
            "print(json.dumps({'event': 'progress', 'step': 1, 'total_steps': 9, 'epoch': 0, 'epochs': 1, "
            "'loss': 0.5}), flush=True)\nsys.stdin.readline()\n"
            "print(json.dumps({'event': 'backup', 'path': 'b'}), flush=True)\n"
            "print(json.dumps({'event': 'finished'}), flush=True)\n")
    monkeypatch.setattr(app, "run_argv", lambda _config: [sys.executable, "-c", slow])
    assert app.start()
    pump(app, lambda: any(e["event"] == "progress" for e in app.run_events), timeout=30, what="progress")
    app.stop()
    run_to_end(app, timeout=30)
    assert app.status_label.cget("text") == "Stopped at step 1/9; a backup was written."
    assert app.progress.get() < 1.0


def test_preset_keeps_the_model_and_concepts_it_does_not_set(app, tmp_path):
    from modules.config.presets import list_presets

    data = base_data()
    data["model"]["base"] = str(tmp_path / "my-model")
    app.cfg.load(data)
    preset = next(p.name for p in list_presets() if p.builtin and p.family == FAMILY)
    app.load_preset(preset)
    assert app.cfg.get("model.base") == str(tmp_path / "my-model")
    assert app.cfg.get("concepts")[0]["path"] == "/images"
    assert "kept your base model and concepts" in app.status_label.cget("text")


def test_internal_error_dialog_leads_with_the_error_line(app):
    try:
        raise ValueError("the thing that went wrong")
    except ValueError:
        app.report_callback_exception(*sys.exc_info())
    dialog = app.dialogs[-1]
    assert dialog.message.startswith("ValueError: the thing that went wrong\n\nTraceback")
    dialog.destroy()
    app.callback_errors.clear()


def test_tensorboard_button_serves_the_workspace_logs(app, tmp_path, monkeypatch):
    import urllib.request
    import webbrowser

    opened = []
    monkeypatch.setattr(webbrowser, "open", lambda url: opened.append(url))
    through_widget(app, "workspace_dir", str(tmp_path / "ws"))
    app.tensorboard_button.invoke()
    assert app.status_label.cget("text").startswith("No TensorBoard logs yet")
    (tmp_path / "ws" / "tensorboard").mkdir(parents=True)
    try:
        app.tensorboard_button.invoke()
        assert opened and opened[0] == app.tensorboard.url

        def answers():
            try:
                with urllib.request.urlopen(opened[0], timeout=1) as response:
                    return response.status == 200
            except OSError:
                return False

        pump(app, answers, timeout=60, what="tensorboard to answer")
        assert app.tensorboard.logdir == (tmp_path / "ws" / "tensorboard").resolve()
    finally:
        app.tensorboard.stop()


ECHO_COMMAND = """
import json, sys
print(json.dumps({"event": "started", "total_steps": 1}), flush=True)
line = sys.stdin.readline()
open(sys.argv[1], "w").write(line)
print(json.dumps({"event": "finished"}), flush=True)
"""


def test_sample_now_sends_the_prompt_as_edited_to_the_run(app, tmp_path, monkeypatch):
    """The prompt editor's "Sample now" sends that prompt, with its edits, over the run protocol
    (what the trainer does with it: tests/test_sample_now.py); without a run it says to start one."""
    app.cfg.load(base_data())
    for name in ("images", "model"):
        (tmp_path / name).mkdir()
    through_widget(app, "model.base", str(tmp_path / "model"))
    through_widget(app, "concepts[0].path", str(tmp_path / "images"))
    through_widget(app, "workspace_dir", str(tmp_path / "ws"))
    through_widget(app, "sampling.prompts[0].prompt", "a red square")
    through_widget(app, "sampling.prompts[0].seed", 7)
    sampling = app.tabs["Sampling"]
    assert not sampling.sample_now(0)  # no run yet
    received = tmp_path / "received.json"
    monkeypatch.setattr(app, "run_argv", lambda _config: [sys.executable, "-c", ECHO_COMMAND, str(received)])
    assert app.start(), app.refused
    assert sampling.sample_now(0)
    run_to_end(app, timeout=30)
    message = json.loads(received.read_text())
    assert message["command"] == "sample"
    assert message["prompt"]["prompt"] == "a red square" and message["prompt"]["seed"] == 7


def test_embeddings_are_added_and_removed_on_their_tab(app):
    data = base_data()
    data["embeddings"] = []
    app.cfg.load(data)
    pump(app, timeout=0.02)
    tab = app.tabs["Embeddings"]
    tab.add()  # the "Add embedding" button
    tab.add()
    pump(app, timeout=0.05)
    assert [e["placeholder"] for e in app.cfg.get("embeddings")] == ["<embedding-1>", "<embedding-2>"]
    assert not any(p.startswith("embeddings") for p in app.cfg.problems), app.cfg.problems
    assert app.field_for("embeddings[1].init_text")[0] == "Embeddings"
    tab.remove(0)
    pump(app, timeout=0.05)
    assert [e["placeholder"] for e in app.cfg.get("embeddings")] == ["<embedding-2>"]
    assert app.field_for("embeddings[1].init_text")[1] is None  # its fields went with it
    assert app.callback_errors == []
