"""What trains otherwise than the config reads is said, once per case with a count: a resolution the
bucket step changes, images upscaled far past their size, captions the text encoder cuts, images
two concepts hold, image files that are not read, a warmup longer than the run."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from conftest import train_config
from PIL import Image

from modules.cli.train_command import run_training
from modules.config.loading import build_config
from modules.data.dataset import prepare_dataset
from modules.model.sd15 import SD15Family
from modules.optim.schedulers import warmup_note
from modules.trainer.event_protocol import JsonlEvents


@pytest.fixture(scope="module")
def family(tiny_model, tmp_path_factory):
    loaded = SD15Family(train_config(tiny_model, tiny_model, tmp_path_factory.mktemp("family")))
    loaded.load()
    return loaded


@pytest.fixture
def concept(tmp_path, shape_images):
    folder = tmp_path / "concept"
    shutil.copytree(shape_images, folder)
    return folder


def _warnings(tmp_path, family, concepts, data=None) -> list[str]:
    overlay = {"model": {"family": family.config.model.family}, "concepts": concepts, "data": data or {}}
    config = train_config(family.config.model.base, tmp_path, tmp_path, overlay)
    family.config = config
    warnings = []
    prepare_dataset(config, family, torch.device("cpu"), tmp_path / "cache", warnings.append, True)
    return warnings


def test_a_good_data_set_has_no_warnings(tmp_path, family, concept):
    assert _warnings(tmp_path, family, [{"path": str(concept)}]) == []


@pytest.mark.parametrize("resolution, said", [(32, "is below Stable Diffusion 1.5's bucket step of 64 px; images "
                                                    "train at 64x64"),
                                               (100, "is not a multiple of Stable Diffusion 1.5's bucket step of "
                                                     "64 px; square images train at 64x64")])
def test_a_resolution_the_bucket_step_changes_is_said(tmp_path, family, concept, resolution, said):
    (warning,) = _warnings(tmp_path, family, [{"path": str(concept)}], {"resolution": resolution})
    assert warning == f"data.resolution: {resolution} {said}" + (
        " (the same latents, and cache entries, as resolution 64)" if resolution < 64 else "")


def test_images_far_smaller_than_the_resolution_are_counted_once(tmp_path, family, concept):
    for path in sorted(concept.glob("*.png"))[:3]:
        Image.open(path).resize((20, 20)).save(path)
    (warning,) = _warnings(tmp_path, family, [{"path": str(concept)}])
    assert warning.startswith(f"concepts[0] ({concept}): 3 image(s) are smaller than half their training size "
                              "and will be upscaled (e.g. ") and "20x20 to 64x64" in warning


def test_captions_longer_than_the_token_window_are_counted_once(tmp_path, family, concept):
    window = family.tokenizer.model_max_length
    for path in sorted(concept.glob("*.txt"))[:2]:
        path.write_text(" ".join(["red square"] * window))
    (warning,) = _warnings(tmp_path, family, [{"path": str(concept)}])
    assert warning.startswith(f"concepts[0] ({concept}): 2 caption(s) are longer than the text encoder's "
                              f"{window}-token window and are cut to it")


def test_one_folder_given_as_two_concepts_is_said(tmp_path, family, concept):
    (warning,) = _warnings(tmp_path, family, [{"path": str(concept)}, {"path": str(concept) + "/"}])
    assert warning.startswith(f"concepts[0] ({concept}) and concepts[1] ({concept}/) hold the same 4 image(s)")
    assert "each trains 2 times per epoch" in warning


def test_gif_files_in_a_concept_are_said_not_read(tmp_path, family, concept):
    for name in ("a.gif", "b.gif"):
        Image.new("RGB", (64, 64)).save(concept / name)
    (warning,) = _warnings(tmp_path, family, [{"path": str(concept)}])
    assert warning.startswith(f"concepts[0]: 2 .gif file(s) in {concept} are not read")


def test_a_warmup_longer_than_the_run_is_said():
    config = build_config([{"lr_scheduler": {"warmup_steps": 1000}}]).lr_scheduler
    assert warmup_note(config, 40) == ("lr_scheduler.warmup_steps: 1000 is longer than the whole run (40 step(s)): the "
                                       "learning rate never reaches optimizer.lr (it ends at 4% of it); lower "
                                       "warmup_steps")
    assert warmup_note(config, 1000) is None


def test_the_warnings_reach_the_protocol_as_warning_events(tmp_path, tiny_model, one_image):
    # the trainer gives them to its callbacks' on_warning, as every other warning: the jsonl protocol
    # writes a warning event, the console a "warning:" line on stderr
    Image.new("RGB", (64, 64)).save(tmp_path / "anim.gif")
    for path in one_image.iterdir():
        shutil.copy(path, tmp_path / path.name)
    config = train_config(tiny_model, tmp_path, tmp_path, {"lr_scheduler": {"warmup_steps": 50},
                                                         "schedule": {"max_steps": 1}})
    stream = io.StringIO()
    run_training(config, JsonlEvents(stream))
    warnings = [e["message"] for e in map(json.loads, stream.getvalue().splitlines()) if e["event"] == "warning"]
    assert sum(w.startswith("concepts[0]: 1 .gif file(s)") for w in warnings) == 1
    assert sum(w.startswith("lr_scheduler.warmup_steps: 50 is longer than the whole run (1 step(s))")
               for w in warnings) == 1


@pytest.mark.parametrize("name", ["flux", "sd3", "chroma"])
def test_a_caption_longer_than_t5_s_window_is_said_for_the_t5_families(tmp_path, tiny_family_model, name, concept):
    """CLIP cuts at 77 there too, but T5 reads on (to 256 or 512 tokens): its cut is the one that loses text."""
    from modules.config.families import get_family_class

    model = tiny_family_model(name)
    loaded = get_family_class(name)(train_config(model, concept, tmp_path / "family", {"model": {"family": name}}))
    loaded.load()
    ((tokenizer, window),) = loaded.caption_windows()
    assert window == loaded.max_sequence_length  # (the tiny T5's 32 tokens here)
    first, *others = sorted(concept.glob("*.txt"))
    first.write_text(" ".join(["red square"] * window))
    for path in others:
        path.write_text("a red square")
    (warning,) = _warnings(tmp_path, loaded, [{"path": str(concept)}])
    assert f"1 caption(s) are longer than the text encoder's {window}-token window" in warning
