"""The data pipeline at scale: cached tensors read lazily through a bounded LRU, a resumable cache
build, `launch.py cache`, and background loading that serves exactly the synchronous batches."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import train_config
from test_dataset import FakeFamily

from modules.config.train_config import CaptionConfig, ConceptConfig, DataConfig
from modules.data.dataset import prepare_dataset
from modules.data.prefetch import BatchPrefetcher
from modules.data.synthetic_images import draw_shape, write_shape_images

CPU = torch.device("cpu")


def config_for(images: Path, batch_size: int = 2, concept: dict | None = None, **data):
    return SimpleNamespace(concepts=[ConceptConfig(path=str(images), **(concept or {}))],
                           data=DataConfig(resolution=64, **data), schedule=SimpleNamespace(batch_size=batch_size),
                           seed=5)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """14 captioned images in two buckets."""
    folder = tmp_path_factory.mktemp("pipeline-images")
    write_shape_images(folder, count=10, width=64, height=64)
    for index, color in enumerate(("red", "green", "blue", "yellow")):
        draw_shape("circle", color, "white", 96, 48).save(folder / f"wide{index}.png")
        (folder / f"wide{index}.txt").write_text(f"a wide circle, number {index}, {color}", encoding="utf-8")
    return folder


def test_the_in_memory_lru_stays_within_its_bound_over_an_epoch_of_more_entries(tmp_path, images):
    # a latent file of a 64x64 image is 3x8x8 float32 (768 bytes) here: room for two of them
    budget_mb = 2 * 768 / 2**20
    dataset = prepare_dataset(config_for(images, cache_memory_mb=budget_mb, flip=True), FakeFamily(), CPU,
                              tmp_path / "cache", lambda m: None, cache_text=True)
    reader = dataset.reader
    assert len(dataset.entries) == 14 and reader.reads == 0  # building keeps nothing in memory
    for epoch in range(2):
        for position, indices in enumerate(dataset.epoch_batches(epoch)):
            dataset.collate(indices, CPU, epoch, position)
            assert reader.held_bytes <= budget_mb * 2**20
    assert 0 < reader.peak_held_bytes <= budget_mb * 2**20
    assert reader.reads >= 2 * 14  # each epoch read its files again: they did not all stay in memory
    assert len(reader) <= 4  # two latent files (or a few small text entries beside one)


def test_an_interrupted_cache_build_resumes_with_the_entries_written(tmp_path, images):
    class Interrupted(FakeFamily):
        def encode_images(self, pixels):
            if self.encoded_images >= 4:  # the second VAE call: after one batch of 4 was encoded
                raise KeyboardInterrupt
            return super().encode_images(pixels)

    config = config_for(images)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(config, Interrupted(), CPU, tmp_path / "cache", lambda m: None, cache_text=True)
    written = list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert len(written) == 4 and not list((tmp_path / "cache").rglob("*.tmp"))

    family = FakeFamily()
    dataset = prepare_dataset(config, family, CPU, tmp_path / "cache", lambda m: None, cache_text=True)
    assert family.encoded_images == 14 - 4 + 1  # the four written are reused (and one blank image probes their shape)
    assert dataset.cache_stats["latents"] == (4, 10)
    again = FakeFamily()
    prepare_dataset(config, again, CPU, tmp_path / "cache", lambda m: None, cache_text=True)
    assert (again.encoded_images, again.encoded_texts) == (1, 1)  # the layout probes alone


def _same(first, second) -> None:
    assert torch.equal(first.latents, second.latents)
    assert first.captions == second.captions
    assert torch.equal(first.image_info, second.image_info)
    assert (first.text is None) == (second.text is None)
    if first.text is not None:
        assert first.text.keys() == second.text.keys()
        assert all(torch.equal(first.text[k], second.text[k]) for k in first.text)


@pytest.mark.parametrize("fresh", [False, True], ids=["cached", "fresh-latents"])
def test_background_loading_serves_exactly_the_synchronous_batches(tmp_path, images, fresh):
    # every per-batch draw at once: flip, varying captions, and (fresh) crop and colour jitter
    data = {"flip": True} | ({"cache_latents": False, "crop_jitter": True, "color_jitter": 0.2} if fresh else {})
    captions = CaptionConfig(shuffle_tags=True, tag_dropout=0.3)
    config = config_for(images, batch_size=3, concept={"captions": captions}, **data)
    dataset = prepare_dataset(config, FakeFamily(), CPU, tmp_path / "cache", lambda m: None, cache_text=False)
    expected = {(epoch, position): dataset.collate(indices, CPU, epoch, position)
                for epoch in range(3) for position, indices in enumerate(dataset.epoch_batches(epoch))}

    for depth, start in ((2, (0, 0)), (5, (1, 2))):  # a resume starts the loader in the middle of an epoch
        prefetcher = BatchPrefetcher(dataset, depth)
        asked = [key for key in expected if key >= start]
        for epoch, position in asked:
            _same(prefetcher.collate(dataset.epoch_batches(epoch)[position], CPU, epoch, position),
                  expected[(epoch, position)])
        assert prefetcher.prefetched == len(asked)  # all made by the loader thread, in order across epochs
        prefetcher.close()

    prefetcher = BatchPrefetcher(dataset, 2)
    own = [0, 1]  # a batch not in the epoch order is made on the spot, the same as without the loader
    _same(prefetcher.collate(own, CPU, 0, 0), dataset.collate(own, CPU, 0, 0))
    prefetcher.close()


def test_a_loader_error_is_raised_on_the_training_thread(tmp_path, images):
    dataset = prepare_dataset(config_for(images), FakeFamily(), CPU, tmp_path / "cache", lambda m: None, True)
    for path in (tmp_path / "cache" / "latents").rglob("*.safetensors"):
        path.unlink()  # the cache changed under the run
    prefetcher = BatchPrefetcher(dataset, 2)
    with pytest.raises(Exception, match="cannot be read now"):
        prefetcher.collate(dataset.epoch_batches(0)[0], CPU, 0, 0)
    prefetcher.close()


@pytest.fixture
def parts_read(monkeypatch):
    """The parts whose weights a load reads, and the parts each family.load() built."""
    from modules.loading import streamed_load
    from modules.model.sd15 import SD15Family

    read, built = [], []
    stream, load = streamed_load.load_streamed, SD15Family.load

    def spied_stream(model, folder, **kwargs):
        read.append(kwargs["part"])
        return stream(model, folder, **kwargs)

    def spied_load(family):
        load(family)
        built.append(dict(family.parts))

    monkeypatch.setattr(streamed_load, "load_streamed", spied_stream)
    monkeypatch.setattr(SD15Family, "load", spied_load)
    return SimpleNamespace(read=read, built=built)


def test_launch_cache_fills_the_caches_so_training_encodes_nothing(tmp_path, tiny_model, shape_images, capsys,
                                                                    parts_read):
    import launch
    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_model, shape_images, tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json(), encoding="utf-8")
    assert launch.main(["cache", "--config", str(config_file)]) == 0
    assert "4 latents and 4 captions encoded" in capsys.readouterr().out
    # the encoders only: the UNet is its architecture on meta, none of its weights read
    assert sorted(parts_read.read) == ["text_encoder", "vae"]
    unet = parts_read.built[0]["unet"]
    assert unet.config.cross_attention_dim and all(p.is_meta for p in unet.parameters())
    assert len(list((tmp_path / "ws" / "cache").rglob("*.safetensors"))) == 8

    trainer = GenericTrainer(config)
    try:
        trainer.start()
        assert trainer.dataset.cache_stats == {"latents": (4, 0), "text": (4, 0)}  # nothing encoded
    finally:
        trainer.release()
    assert json.loads(config_file.read_text())["data"]["prefetch_batches"] == 2


def test_launch_cache_reads_no_text_encoder_when_captions_vary(tmp_path, tiny_model, shape_images, parts_read):
    from modules.cli.cache_command import build_caches

    config = train_config(tiny_model, shape_images, tmp_path, {"concepts": [
        {"path": str(shape_images), "captions": {"shuffle_tags": True}}]})
    report = build_caches(config)
    assert (report.latents_encoded, report.texts_encoded) == (4, 0)
    assert parts_read.read == ["vae"]  # each drawn caption is encoded while training, not here
    assert all(p.is_meta for part in ("text_encoder", "unet") for p in parts_read.built[0][part].parameters())
