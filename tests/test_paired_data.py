"""Paired samples for edit models (modules/data/pairs.py): targets with control images from sibling
folders or a JSONL manifest, skipped with a warning where a control is missing or unreadable, the
controls at their target's bucket, mirrored with it, and cached like targets."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import train_config

from modules.data.concepts import DataError
from modules.data.dataset import FLIPPED, prepare_dataset
from modules.data.images import load_cropped
from modules.data.pairs import check_controls
from modules.data.synthetic_images import write_edit_pairs


@pytest.fixture(scope="module")
def kontext(tiny_family_model, tmp_path_factory, shape_images):
    from modules.model.flux_kontext import FluxKontextFamily

    model = tiny_family_model("flux_kontext")
    family = FluxKontextFamily(train_config(model, shape_images, tmp_path_factory.mktemp("kontext"),
                                            {"model": {"family": "flux_kontext"}}))
    family.load()
    return model, family


def _dataset(kontext, folder, workspace, controls=None, **data):
    model, family = kontext
    config = train_config(model, folder, workspace, {
        "model": {"family": "flux_kontext"}, "data": data,
        "concepts": [{"path": str(folder), "controls": controls or {"source": "folders"}}]})
    warnings = []
    dataset = prepare_dataset(config, family, torch.device("cpu"), workspace / "cache", warnings.append,
                              cache_text=False)
    return dataset, warnings


def test_a_sample_without_its_control_is_skipped_and_named(kontext, tmp_path):
    targets = write_edit_pairs(tmp_path / "pairs", count=3)
    (tmp_path / "pairs" / "control" / "001.png").unlink()
    dataset, warnings = _dataset(kontext, tmp_path / "pairs", tmp_path)
    assert sorted(e.item.image.name for e in dataset.entries) == ["000.png", "002.png"]
    said = [w for w in warnings if str(targets[1]) in w]
    assert len(said) == 1 and "no control image 001.*" in said[0] and "skipping" in said[0]
    assert all(len(e.control_keys) == 1 for e in dataset.entries)


def test_an_unreadable_control_skips_its_sample(kontext, tmp_path):
    write_edit_pairs(tmp_path / "pairs", count=2)
    (tmp_path / "pairs" / "control" / "000.png").write_bytes(b"not a png")
    dataset, warnings = _dataset(kontext, tmp_path / "pairs", tmp_path)
    assert [e.item.image.name for e in dataset.entries] == ["001.png"]
    assert any("unreadable control image" in w and "000.png" in w for w in warnings)


def test_a_control_of_another_size_trains_at_its_targets_bucket(kontext, tmp_path):
    _, family = kontext
    write_edit_pairs(tmp_path / "pairs", count=1, control_size=(96, 48))
    dataset, _ = _dataset(kontext, tmp_path / "pairs", tmp_path)
    batch = dataset.collate([0], torch.device("cpu"))
    assert batch.controls.shape == (1, 1, *batch.latents.shape[1:])
    entry = dataset.entries[0]
    expected = family.encode_images(load_cropped(entry.item.controls[0], *entry.bucket)[None]).float()
    torch.testing.assert_close(batch.controls[:, 0], expected, atol=1e-5, rtol=0)


def test_more_controls_than_the_model_takes_is_refused_by_name(kontext, tmp_path):
    write_edit_pairs(tmp_path / "pairs", count=1)
    shutil.copytree(tmp_path / "pairs" / "control", tmp_path / "pairs" / "control_2")
    with pytest.raises(DataError, match=r"concepts\[0\]: .*000\.png has 2 control images; FLUX\.1 Kontext takes "
                                        r"at most 1"):
        _dataset(kontext, tmp_path / "pairs", tmp_path)


def test_a_family_without_controls_refuses_paired_concepts(kontext, tmp_path):
    model, _ = kontext
    config = train_config(model, tmp_path, tmp_path, {"concepts": [{"path": str(tmp_path),
                                                                     "controls": {"source": "folders"}}]})
    plain = SimpleNamespace(control_images=0, prompt_images=(0, 0), label="SD1.5")
    with pytest.raises(DataError, match=r"concepts\[0\]\.controls\.source: SD1\.5 takes no control images"):
        check_controls(config, plain, list(enumerate(config.concepts)))
    from modules.config.families import get_family_declaration

    prompts_only = get_family_declaration("wan22_ti2v")  # a prompt image starts its video; clips condition themselves
    with pytest.raises(DataError, match=r"Wan 2\.2 TI2V 5B takes control images in sample prompts only"):
        check_controls(config, prompts_only, list(enumerate(config.concepts)))


def _manifest(folder, lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_manifest_lists_targets_controls_and_captions(kontext, tmp_path):
    write_edit_pairs(tmp_path / "pairs", count=2)
    _manifest(tmp_path / "pairs", [
        json.dumps({"target": "target/000.png", "control": ["control/000.png"], "caption": "make it red"}),
        "",
        json.dumps({"target": "target/001.png", "control": "control/001.png", "caption": "make it green"}),
        json.dumps({"target": "target/001.png", "control": "control/404.png", "caption": "gone"}),
    ])
    dataset, warnings = _dataset(kontext, tmp_path / "pairs", tmp_path, {"source": "manifest"})
    assert [(e.item.image.name, e.item.controls[0].name, e.item.caption) for e in dataset.entries] == [
        ("000.png", "000.png", "make it red"), ("001.png", "001.png", "make it green")]
    assert any("line 4" in w and "404.png" in w for w in warnings)


@pytest.mark.parametrize("line, problem", [
    ('{"target": "target/000.png", "control": ', r"line 2 is not JSON"),
    ('{"target": "target/000.png", "controls": ["control/000.png"]}', r"line 2: unknown key 'controls'"),
    ('{"target": "target/000.png", "control": []}', r"line 2: \"control\" must be"),
    ('["target/000.png"]', r"line 2: expected an object"),
])
def test_a_bad_manifest_line_is_named_by_its_number(kontext, tmp_path, line, problem):
    write_edit_pairs(tmp_path / "pairs", count=1)
    _manifest(tmp_path / "pairs", [json.dumps({"target": "target/000.png", "control": "control/000.png"}), line])
    with pytest.raises(DataError, match=r"concepts\[0\]\.controls\.manifest: .*pairs\.jsonl " + problem):
        _dataset(kontext, tmp_path / "pairs", tmp_path, {"source": "manifest"})


def test_flip_mirrors_the_target_and_its_controls_together(kontext, tmp_path):
    _, family = kontext
    write_edit_pairs(tmp_path / "pairs", count=1)
    dataset, _ = _dataset(kontext, tmp_path / "pairs", tmp_path, flip=True)
    entry = dataset.entries[0]
    pixels = load_cropped(entry.item.controls[0], *entry.bucket)
    plain = family.encode_images(pixels[None]).float()[0]
    mirrored = family.encode_images(pixels.flip(-1)[None]).float()[0]
    assert (plain - mirrored).abs().max() > 1e-2  # the control is not symmetric
    seen = set()
    for batch_index in range(16):
        batch = dataset.collate([0], torch.device("cpu"), batch_index=batch_index)
        flipped = torch.equal(batch.latents[0], dataset.latents[entry.latent_key + FLIPPED])
        assert flipped or torch.equal(batch.latents[0], dataset.latents[entry.latent_key])
        torch.testing.assert_close(batch.controls[0, 0], mirrored if flipped else plain, atol=1e-5, rtol=0)
        seen.add(flipped)
    assert seen == {True, False}


def test_control_latents_are_cached_and_reused(kontext, tmp_path):
    write_edit_pairs(tmp_path / "pairs", count=2)
    first, _ = _dataset(kontext, tmp_path / "pairs", tmp_path)
    assert first.cache_stats["latents"][1] == 4  # two targets and two controls encoded
    again, _ = _dataset(kontext, tmp_path / "pairs", tmp_path)
    assert again.cache_stats["latents"][1] == 0
    batch, replay = first.collate([0, 1], torch.device("cpu")), again.collate([0, 1], torch.device("cpu"))
    assert torch.equal(batch.controls, replay.controls) and torch.equal(batch.latents, replay.latents)


def test_preflight_names_control_problems_before_the_model_loads(kontext, tmp_path):
    from modules.trainer.preflight import preflight_problems

    model, _ = kontext
    write_edit_pairs(tmp_path / "pairs", count=1)
    _manifest(tmp_path / "pairs", ['{"target": "target/000.png"}'])
    prompts = [{"prompt": "x", "control_images": [str(tmp_path / "a.png"), str(tmp_path / "b.png")]}]
    kontext_run = train_config(model, tmp_path, tmp_path, {
        "model": {"family": "flux_kontext"}, "sampling": {"prompts": prompts},
        "concepts": [{"path": str(tmp_path / "pairs"), "controls": {"source": "manifest"}}]})
    problems = preflight_problems(kontext_run)
    assert any("pairs.jsonl line 1: \"control\" must be" in p for p in problems)
    assert "sampling.prompts[0].control_images: 2 given; FLUX.1 Kontext takes 1" in problems
    assert any(p.startswith("sampling.prompts[0].control_images: ") and "a.png not found" in p for p in problems)
    flux_run = kontext_run.model_copy(update={"model": kontext_run.model.model_copy(update={"family": "flux"})})
    assert any(p.startswith("concepts[0].controls.source: FLUX.1 takes no control images")
               for p in preflight_problems(flux_run))


def test_crop_and_colour_jitter_move_the_controls_with_their_target(kontext, tmp_path):
    """Uncached latents: with a control that is a copy of its target, every jittered draw (crop,
    mirror, colour) gives the control exactly the target's latents."""
    write_edit_pairs(tmp_path / "pairs", count=1, width=96, height=64)
    shutil.copy(tmp_path / "pairs" / "target" / "000.png", tmp_path / "pairs" / "control" / "000.png")
    dataset, _ = _dataset(kontext, tmp_path / "pairs", tmp_path, cache_latents=False, crop_jitter=True,
                          color_jitter=0.3, flip=True, aspect_buckets=False)
    draws = [dataset.collate([0], torch.device("cpu"), batch_index=i) for i in range(4)]
    for batch in draws:
        torch.testing.assert_close(batch.controls[:, 0], batch.latents, atol=1e-5, rtol=0)
    assert (draws[0].latents - draws[1].latents).abs().max() > 1e-3  # the draws do differ
