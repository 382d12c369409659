"""Auto-captioning and generated masks (issue 30, items 2 and 3) with tiny random models built
offline (modules/autolabel/tiny_models.py): BLIP, BLIP-2 and a LLaVA chat captioner (Qwen2-VL and
Qwen2.5-VL: tests/test_autolabel_qwen2vl.py), and a CLIPSeg masker."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from forked_launch import launch_popen, launch_run

from modules.autolabel.caption_folder import caption_images
from modules.autolabel.captioners import kind_for
from modules.autolabel.images import folder_images, read_caption
from modules.autolabel.model_folder import LabelModelError
from modules.data.synthetic_images import write_shape_images

ROOT = Path(__file__).resolve().parent.parent


def images_in(folder: Path, count: int = 5, captions: bool = False) -> list[Path]:
    paths = write_shape_images(folder, count=count, width=48, height=40)
    if not captions:
        for path in paths:
            path.with_suffix(".txt").unlink()
    return paths


@pytest.fixture(scope="module")
def blip(tiny_labellers):
    folder = tiny_labellers("blip")
    kind = kind_for(folder)
    return kind, kind.load(folder, "cpu", "float32")


def no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]


def test_blip_captions_every_image_and_each_mode_keeps_or_replaces(blip, tmp_path):
    kind, captioner = blip
    assert kind.name == "blip"
    images = images_in(tmp_path, count=5)
    images[0].with_suffix(".txt").write_text("my own caption\n", encoding="utf-8")
    progress = []
    report = caption_images(images, captioner, "", "skip-existing", batch_size=2, max_new_tokens=6,
                            on_progress=lambda r, path: progress.append((r.done, path)))
    assert read_caption(images[0]) == "my own caption" and report.skipped == [images[0]]
    assert report.written == images[1:] and all(read_caption(image) for image in images[1:])
    assert [done for done, _ in progress] == [1, 2, 3, 4, 5]
    generated = read_caption(images[1])

    report = caption_images(images, captioner, "", "append", batch_size=3, max_new_tokens=6)
    assert read_caption(images[0]).startswith("my own caption, ") and len(report.written) == 5
    assert read_caption(images[1]) == f"{generated}, {generated}"  # (a random model, but the same each time)

    caption_images(images, captioner, "a photo of", "overwrite", batch_size=2, max_new_tokens=6)
    assert all(read_caption(image).startswith("a photo of") for image in images)  # BLIP keeps its prompt
    assert images[0].with_suffix(".txt").read_text(encoding="utf-8").endswith("\n") and no_temp_files(tmp_path)


def test_blip2_captions_after_its_prompt(tiny_labellers, tmp_path):
    folder = tiny_labellers("blip2")
    kind = kind_for(folder)
    assert kind.name == "blip"
    captioner = kind.load(folder, "cpu", "float32")
    images = images_in(tmp_path, count=3)
    report = caption_images(images, captioner, "a photo of", "overwrite", batch_size=2, max_new_tokens=4)
    assert report.written == images and all(read_caption(image).startswith("a photo of ") for image in images)


def test_a_chat_model_answers_the_prompt_for_every_image(tiny_labellers, tmp_path):
    folder = tiny_labellers("llava")
    kind = kind_for(folder)
    assert kind.name == "chat"
    images = images_in(tmp_path, count=3)
    report = caption_images(images, kind.load(folder, "cpu", "float32"), "describe this {name} image", "overwrite",
                            batch_size=2, max_new_tokens=5)
    assert report.written == images
    for image in images:
        assert read_caption(image) and "ASSISTANT" not in read_caption(image)  # the answer only, not the prompt


def test_a_stop_between_batches_keeps_what_is_written_and_writes_nothing_half(blip, tmp_path):
    _, captioner = blip
    images = images_in(tmp_path, count=6)

    def written():
        return [image for image in images if image.with_suffix(".txt").exists()]

    report = caption_images(images, captioner, "", "overwrite", batch_size=2, max_new_tokens=4,
                            stop_requested=lambda: len(written()) >= 2)

    assert report.stopped and report.written == images[:2] == written()
    assert all(read_caption(image) for image in images[:2]) and no_temp_files(tmp_path)
    assert "stopped after 2 of 6 images" in report.summary()


def test_a_bad_model_folder_is_one_clear_message(tmp_path):
    with pytest.raises(LabelModelError, match=r"^--model: .*nowhere is not a folder"):
        kind_for(tmp_path / "nowhere")
    with pytest.raises(LabelModelError, match="has no config.json"):
        kind_for(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(LabelModelError, match=r"no captioner takes a 'bert' model \(architectures: BertModel\); "
                                              r"known kinds: blip: .*; chat: "):
        kind_for(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LabelModelError, match="cannot be read as JSON"):
        kind_for(tmp_path)


def test_a_chat_model_without_its_weights_is_named(tiny_labellers, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_labellers("llava"), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(LabelModelError, match=r"^--model: .*broken: its model does not load"):
        kind_for(folder).load(folder, "cpu", "float32")


def test_prompt_template_placeholders():
    from modules.autolabel.prompt_template import check_template, fill
    from modules.errors import UserError

    assert fill(check_template("{name}: {caption} {{x}}"), Path("a/cat.png"), "old") == "cat: old {x}"
    with pytest.raises(UserError, match=r"--prompt: unknown placeholder \{file\}.*known: \{name\}, \{caption\}"):
        check_template("a {file}")
    with pytest.raises(UserError, match="--prompt: .*literal braces"):
        check_template("a {")


def launch(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return launch_run(args, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def events_of(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_the_caption_command_speaks_jsonl_and_stops_on_the_stop_command(tiny_labellers, tmp_path):
    images = images_in(tmp_path / "images", count=3)
    model = str(tiny_labellers("blip"))
    # a stop sent once the run has started arrives before its first batch or while the model loads for it
    # (which comes first is the machine's): one batch is captioned at most
    process = launch_popen(["caption", "--folder", str(tmp_path / "images"), "--model", model, "--batch-size", "1",
                            "--max-new-tokens", "4", "--protocol", "jsonl"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        first = process.stdout.readline()
        assert json.loads(first)["event"] == "started"
        process.stdin.write('{"command": "sample"}\n{"command": "stop"}\n')
        process.stdin.flush()
        out, err = process.communicate(timeout=120)
        out = first + out
    finally:
        process.kill()
    assert process.returncode == 0, err
    events = events_of(out)  # (a whole run's events: tests/test_gui_autolabel.py)
    assert events[0] == {"event": "started", "total": 3, "model": "blip"}
    finished = events[-1]
    written = finished["written"]
    assert finished == {"event": "finished", "written": written, "skipped": 0, "failed": 0, "stopped": True, "total": 3}
    assert written in (0, 1) and [e["done"] for e in events if e["event"] == "progress"] == [1] * written
    assert ({"event": "loaded", "device": "cpu", "dtype": "float32"} in events) == (written == 1)  # loaded on first use
    assert any(e["event"] == "warning" and "takes only stop" in e["message"] for e in events)
    assert [image.with_suffix(".txt").exists() for image in images] == [True] * written + [False] * (3 - written)
    assert all(read_caption(image) for image in images[:written]) and no_temp_files(tmp_path / "images")


def test_the_caption_command_names_a_bad_folder_in_one_line(tmp_path):
    images_in(tmp_path, count=1)
    result = launch("caption", "--folder", str(tmp_path), "--model", str(tmp_path / "no-model"))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"error: --model: {tmp_path / 'no-model'} is not a folder"]
    result = launch("caption", "--folder", str(tmp_path / "missing"), "--model", str(tmp_path), "--protocol", "jsonl")
    assert result.returncode == 1
    assert events_of(result.stdout) == [{"event": "error", "message": f"--folder: {tmp_path / 'missing'} is not a folder"}]


# --- masks ------------------------------------------------------------------------------------

def test_clipseg_masks_are_written_as_masked_training_reads_them(tiny_labellers, tmp_path):
    import numpy as np
    from PIL import Image

    from modules.autolabel.mask_folder import mask_images
    from modules.autolabel.maskers.clipseg import ClipSegMasker
    from modules.data.masks import load_mask, mask_path

    images = images_in(tmp_path, count=3, captions=True)
    masker = ClipSegMasker(tiny_labellers("clipseg"))
    report = mask_images(images, masker, "a circle", threshold=0.3, batch_size=2)
    assert report.written == images and folder_images(tmp_path) == images  # (masks are not images to train)
    for image in images:
        path = mask_path(image)
        assert path == image.with_name(f"{image.stem}-masklabel.png")
        with Image.open(path) as mask:
            assert mask.mode == "L" and mask.size == (48, 40)
            assert set(np.unique(np.asarray(mask))) <= {0, 255}
        loaded = load_mask(path, 48, 40)
        assert loaded.shape == (1, 40, 48) and 0.0 < float(loaded.mean()) < 1.0  # (random: some white, some black)
    first = np.asarray(Image.open(mask_path(images[0])))

    Image.new("L", (48, 40), 0).save(mask_path(images[0]))
    mask_images(images, masker, "a circle", threshold=0.3, mode="skip-existing")
    assert not np.asarray(Image.open(mask_path(images[0]))).any()  # kept

    corner = Image.new("L", (48, 40), 0)
    corner.paste(255, (0, 0, 4, 4))
    corner.save(mask_path(images[0]))
    mask_images(images[:1], masker, "a circle", threshold=0.3, mode="add")
    united = np.asarray(Image.open(mask_path(images[0])))
    assert united[:4, :4].all() and (united[4:] == first[4:]).all()  # the corner and the generated area
    assert no_temp_files(tmp_path)


def test_the_mask_command_refuses_a_captioner_before_loading_anything(tiny_labellers, tmp_path):
    images_in(tmp_path / "images", count=1)  # (the command's run with CLIPSeg: tests/test_gui_autolabel.py)
    result = launch("mask", "--folder", str(tmp_path / "images"), "--model", str(tiny_labellers("blip")),
                    "--prompt", "x")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: --model: {tiny_labellers('blip')} holds a 'blip' model, which no masker takes; known kinds: "
        f"clipseg: CLIPSeg (model_type clipseg, CLIPSegForImageSegmentation; masks what --prompt names); "
        f"background: background removal (an ONNX model, onnx/model.onnx or model.onnx, with "
        f"preprocessor_config.json: RMBG-1.4/2.0, BiRefNet, ISNet exports; masks the foreground, no prompt)"]


def test_the_mask_command_runs_background_removal_without_a_prompt(tiny_labellers, tmp_path):
    from test_autolabel_background import red_square_on_blue

    (tmp_path / "images").mkdir()
    image = red_square_on_blue(tmp_path / "images" / "a.png")  # (the masks themselves: test_autolabel_background.py)
    result = launch("mask", "--folder", str(tmp_path / "images"), "--model", str(tiny_labellers("background")),
                    "--protocol", "jsonl")
    assert result.returncode == 0, result.stderr
    events = events_of(result.stdout)
    assert events[0]["event"] == "started" and events[-1]["event"] == "finished" and events[-1]["written"] == 1
    assert image.with_name("a-masklabel.png").is_file()
