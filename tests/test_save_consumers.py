"""Each save proves it: after writing the adapter file the trainer checks it through the kept
consumer key maps (modules/saving/consumers/), logs per tool "N/N modules applied" or what it
drops, and the `saved` event carries the counts; a drop in the format's own tool is warned at the
first backup."""

from __future__ import annotations

import io
import json

from conftest import train_config

from modules.cli.console import ConsoleCallbacks
from modules.saving.consumers import comfyui
from modules.trainer.callbacks import FanOut
from modules.trainer.event_protocol import JsonlEvents
from modules.trainer.generic_trainer import GenericTrainer


def test_a_save_reports_each_consumer_and_the_first_backup_warns_of_its_drops(tmp_path, tiny_model, shape_images,
                                                                             monkeypatch):
    full = comfyui.MAPS["sd15"]

    def without_to_q(family):  # a ComfyUI that has no self-attention query projections
        return {stem for stem in full(family) if not stem.replace(".", "_").endswith("attn1_to_q")}

    monkeypatch.setitem(comfyui.MAPS, "sd15", without_to_q)
    events, log = io.StringIO(), io.StringIO()
    config = train_config(tiny_model, shape_images, tmp_path, {"output": {"format": "comfy"},
                                                               "schedule": {"max_steps": 2, "backup_every": "1 steps"}})
    trainer = GenericTrainer(config, FanOut(JsonlEvents(events), ConsoleCallbacks(log)))
    trainer.start()
    trainer.train()
    trainer.end()

    lines = [json.loads(line) for line in events.getvalue().splitlines()]
    saved = [e for e in lines if e["event"] == "saved"]
    assert len(saved) == 1
    consumers = saved[0]["consumers"]
    assert set(consumers) == {"ComfyUI", "Forge", "diffusers"}
    assert consumers["diffusers"]["applied"] == 0  # diffusers reads no ComfyUI-layout SD1.5 file
    total = consumers["Forge"]["total"]
    assert total > 1 and consumers["Forge"] == {"applied": total, "total": total, "dropped": []}
    dropped = consumers["ComfyUI"]["dropped"]
    assert dropped and all(stem.replace(".", "_").endswith("attn1_to_q") for stem in dropped)
    assert consumers["ComfyUI"]["applied"] == total - len(dropped)
    text = log.getvalue()
    assert f"Forge: {total}/{total} modules applied" in text
    assert f"ComfyUI: {total - len(dropped)}/{total} modules applied; drops {len(dropped)}: {dropped[0]}" in text
    warned = [e["message"] for e in lines if e["event"] == "warning" and "will not load whole" in e["message"]]
    assert len(warned) == 1 and warned[0].startswith("output.format: 'comfy': ")  # once, at the first backup
    backups = [i for i, e in enumerate(lines) if e["event"] == "backup"]
    assert len(backups) >= 2 and backups[0] < lines.index(next(e for e in lines if e.get("message") == warned[0])) < backups[1]


def test_the_gui_shows_the_counts_beside_the_file_and_ignores_a_malformed_field():
    from ui.run_control import consumer_counts

    event = {"event": "saved", "path": "a.safetensors",
             "consumers": {"ComfyUI": {"applied": 40, "total": 42, "dropped": ["x", "y"]},
                           "Forge": {"applied": 42, "total": 42, "dropped": []}}}
    assert consumer_counts(event) == " (ComfyUI 40/42, Forge 42/42)"
    assert consumer_counts({"event": "saved", "path": "a"}) == ""
    assert consumer_counts({"event": "saved", "path": "a", "consumers": ["ComfyUI"]}) == ""
    assert consumer_counts({"event": "saved", "path": "a", "consumers": {"ComfyUI": 3}}) == ""


def test_a_remote_run_relays_the_counts_to_the_local_console():
    from modules.remote.cli import dispatch

    log = io.StringIO()
    consumers = {"ComfyUI": {"applied": 2, "total": 3, "dropped": ["lora_unet_x"]}}
    dispatch({"event": "saved", "path": "a.safetensors", "consumers": consumers}, ConsoleCallbacks(log))
    dispatch({"event": "saved", "path": "b.safetensors", "consumers": "garbled"}, ConsoleCallbacks(log))
    dispatch({"event": "saved", "path": "c.safetensors", "consumers": {"ComfyUI": 3}}, ConsoleCallbacks(log))
    assert log.getvalue().splitlines() == ["saved: a.safetensors", "  ComfyUI: 2/3 modules applied; drops 1: lora_unet_x",
                                           "saved: b.safetensors", "saved: c.safetensors"]
