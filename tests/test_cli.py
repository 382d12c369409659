"""The headless commands as a user runs them: real child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import ROOT, train_config
from forked_launch import launch_popen, launch_run


def launch(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return launch_run(args, capture_output=True, text=True, timeout=600, cwd=kwargs.pop("cwd", ROOT), **kwargs)


def test_demo_trains_and_prints_where_the_file_went(tmp_path):
    result = launch("demo", "--workspace", str(tmp_path / "demo"), "--set", "schedule.max_steps=3",
                    "--set", "schedule.sample_every=3 steps")
    assert result.returncode == 0, result.stderr
    output = tmp_path / "demo" / "output" / "demo-lora.safetensors"
    assert f"demo LoRA written to {output}" in result.stdout
    assert output.is_file()
    assert list((tmp_path / "demo" / "run" / "samples").glob("*.png"))
    assert "Traceback" not in result.stderr


def test_sigterm_stops_at_the_next_step_with_a_backup_and_exit_0(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"epochs": 500}})
    config_file = tmp_path / "run.json"
    config_file.write_text(config.model_dump_json())
    process = launch_popen(["train", "--config", str(config_file)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    deadline = time.monotonic() + 300
    for line in process.stderr:
        lines.append(line)
        if line.startswith("step 1/") or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGTERM)
    stdout, rest = process.communicate(timeout=300)
    stderr = "".join(lines) + rest
    assert process.returncode == 0, stderr
    backups = list((Path(config.workspace_dir) / "backup").iterdir())
    assert len(backups) == 1 and (backups[0] / "state.pt").is_file(), stderr
    assert Path(config.output.path).is_file()
    assert "SIGTERM: stopping at the next step" in stderr
    assert stdout.strip() == config.output.path


def test_bad_config_is_one_message_not_a_traceback(tmp_path, tiny_model, shape_images):
    config_file = tmp_path / "bad.json"
    config_file.write_text(json.dumps({"concepts": [{"path": str(shape_images), "repeats": 0}], "schedule": {"epochs": "ten"}}))
    result = launch("train", "--config", str(config_file))
    assert result.returncode == 1
    assert "concepts[0].repeats: must be >= 1" in result.stderr
    assert "schedule.epochs: must be a whole number" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_is_one_message(tmp_path, shape_images):
    result = launch("train", "--preset", "demo", "--set", f"model.base={tmp_path / 'nope'}",
                    "--set", f"concepts[0].path={shape_images}", "--set", f"workspace_dir={tmp_path / 'ws'}")
    assert result.returncode == 1
    assert f"error: model.base: {tmp_path / 'nope'} is not a folder" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_tiny_model_writes_a_diffusers_folder(tmp_path):
    result = launch("make-tiny-model", "--family", "sd15", "--out", str(tmp_path / "m"),
                    env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (tmp_path / "m" / part).is_dir()
    assert json.loads((tmp_path / "m" / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"


def test_jsonl_protocol_round_trip(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {
        "schedule": {"epochs": 60},  # long enough for the commands; ends on its own if they are ignored
        "sampling": {"prompts": [{"prompt": "a circle", "steps": 2, "width": 64, "height": 64}]},
    })
    config_file = tmp_path / "run.json"
    config_file.write_text(config.model_dump_json())
    process = launch_popen(
        ["train", "--config", str(config_file), "--protocol", "jsonl"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    events = []
    sent = []
    for line in process.stdout:
        event = json.loads(line)  # every stdout line is an event
        events.append(event)
        if event["event"] == "progress" and not sent:
            for command in ("sample", "backup", "save", "not-a-command"):
                process.stdin.write(json.dumps({"command": command}) + "\n")
            process.stdin.flush()
            sent.append(event["step"])
        kinds = [e["event"] for e in events]
        if {"sample", "backup"} <= set(kinds) and kinds.count("saved") == 1 and len(sent) == 1:
            process.stdin.write('{"command": "stop"}\n')
            process.stdin.flush()
            sent.append("stop")
    process.wait(timeout=300)
    stderr = process.stderr.read()
    assert process.returncode == 0, stderr
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    progress = next(e for e in events if e["event"] == "progress")
    assert {"step", "epoch", "loss", "lr", "it_per_s", "eta_s"} <= set(progress)
    for kind in ("sample", "backup", "saved"):
        assert Path(next(e for e in events if e["event"] == kind)["path"]).exists()
    assert any(e["event"] == "warning" and "not-a-command" in e["message"] for e in events)
    assert kinds.count("saved") == 2 and events[-2]["path"] == config.output.path  # save now, then the final save


def test_jsonl_protocol_reports_errors_as_events(tmp_path):
    result = launch("train", "--protocol", "jsonl", "--config", str(tmp_path / "missing.json"))
    assert result.returncode == 1
    (event,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert event["event"] == "error" and "missing.json" in event["message"]
