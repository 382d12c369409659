"""Labelling models fetched from the hub only when asked, the size shown first (issue 30 item 2):
`launch.py download-model` against a stand-in hub (tests/fake_hub.py, the real huggingface_hub
client): which files a folder needs (one set of weights), nothing fetched by `--list` or without
a yes, a stop between files that the next download resumes, a clear line for a model that is not
there, and `caption --model owner/name` reading the downloaded tagger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tagger_files(tmp_path_factory) -> dict[str, bytes]:
    from modules.autolabel.tiny_models import make_tiny_wd14

    folder = make_tiny_wd14(tmp_path_factory.mktemp("wd14") / "tagger")
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.fixture(scope="module")
def hub(tagger_files):
    blip = {"config.json": b'{"model_type": "blip"}', "model.safetensors": b"s" * 3000,
            "pytorch_model.bin": b"b" * 2900, "tf_model.h5": b"t" * 2800, "flax_model.msgpack": b"f" * 2700,
            "tokenizer.json": b"{}", "onnx/model.onnx": b"o" * 100, ".gitattributes": b"*"}
    served = FakeHub({"someone/tagger": tagger_files, "someone/blip": blip, "someone/readme-only": {"README.md": b"#"}})
    yield served
    served.close()


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch) -> dict:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "DIFFTRAINER_HOME": str(tmp_path / "home"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **env}


def launch(env, *argv, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *argv], env=env, cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_a_listing_takes_one_set_of_weights_and_says_its_size(hub_env):
    from modules.autolabel.hub_download import listing

    found = listing("someone/blip")
    assert dict(found.files) == {"config.json": 22, "model.safetensors": 3000, "tokenizer.json": 2}
    assert found.total_bytes == 3024
    assert set(found.skipped) == {"pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "onnx/model.onnx",
                                  ".gitattributes"}


def test_list_and_no_yes_fetch_nothing(hub, hub_env, tmp_path):
    listed = launch(hub_env, "download-model", "someone/blip", "--list")
    assert listed.returncode == 0, listed.stderr
    assert "someone/blip @ 0123456789ab: 3 files, 3.0 KB ->" in listed.stderr
    refused = launch(hub_env, "download-model", "someone/blip")  # stdin is not a terminal: no one said yes
    assert refused.returncode == 1
    assert "error: --yes: downloads 3.0 KB only when told: pass --yes" in refused.stderr
    assert not hub.fetched and not (tmp_path / "home" / "models").exists()


def test_a_model_that_is_not_there_is_one_line_naming_it(hub_env):
    missing = launch(hub_env, "download-model", "nobody/nothing", "--list")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == ("error: --model: nobody/nothing: no such model on the hub "
                                                      "(or it is private: set HF_TOKEN)")
    not_a_model = launch(hub_env, "download-model", "someone/readme-only", "--list", "--protocol", "jsonl")
    events = [json.loads(line) for line in not_a_model.stdout.splitlines()]
    assert [e["event"] for e in events] == ["error"]
    assert "someone/readme-only holds no config.json or ONNX model" in events[0]["message"]


def test_a_stopped_download_is_not_whole_and_the_next_one_finishes_it(hub, hub_env, tmp_path):
    from modules.autolabel.hub_download import download, downloaded, listing, local_model, target_folder

    found = listing("someone/blip")
    folder = target_folder("someone/blip")
    seen = []
    assert download(found, folder, lambda done, total, name: seen.append((done, total, name)),
                    stopping=lambda: len(seen) == 1) is False
    assert seen == [(22, 3024, "config.json")] and not downloaded(folder)
    assert local_model("someone/blip") == "someone/blip"  # not whole: caption would not take it
    assert download(found, folder) is True and downloaded(folder)
    assert (folder / "model.safetensors").read_bytes() == b"s" * 3000 and not (folder / "pytorch_model.bin").exists()
    assert local_model("someone/blip") == str(folder)
    assert folder == tmp_path / "home" / "models" / "someone--blip"


def test_a_downloaded_tagger_captions_by_its_hub_id(hub, hub_env, tagger_files, shape_images, tmp_path):
    import shutil

    done = launch(hub_env, "download-model", "someone/tagger", "--yes", "--protocol", "jsonl")
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stderr
    assert [e["event"] for e in events] == ["listing"] + ["progress"] * len(tagger_files) + ["finished"]
    assert events[0]["total_bytes"] == sum(map(len, tagger_files.values())) == events[-2]["done"]
    assert events[-1] == {"event": "finished", "folder": str(tmp_path / "home" / "models" / "someone--tagger"),
                          "stopped": False}
    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    for caption in folder.glob("*.txt"):
        caption.unlink()
    captioned = launch(hub_env, "caption", "--folder", str(folder), "--model", "someone/tagger")
    assert captioned.returncode == 0, captioned.stderr
    assert all(image.with_suffix(".txt").read_text().strip() for image in folder.glob("*.png"))
