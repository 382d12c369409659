"""modules/data: the tensor cache, epoch order and batching, prepare_dataset with a stand-in family."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest
import torch

from modules.config.train_config import ConceptConfig, DataConfig
from modules.data import cache as cache_module
from modules.data.cache import TensorCache, cache_key
from modules.data.concepts import ConceptItem, DataError
from modules.data.dataset import Entry, TrainDataset, prepare_dataset
from modules.data.synthetic_images import draw_shape, write_shape_images

# --- the tensor cache -----------------------------------------------------------------------

def test_cache_round_trip(tmp_path):
    cache = TensorCache(tmp_path / "cache")
    key = cache_key("latent", "abc")
    tensors = {"latents": torch.randn(4, 8, 8), "mask": torch.ones(2, dtype=torch.bfloat16)}
    cache.put(key, tensors)
    loaded = cache.get(key)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert (cache.hits, cache.misses) == (1, 0)
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == [f"{key}.safetensors"]


def test_cache_put_does_not_keep_views_or_grad(tmp_path):
    cache = TensorCache(tmp_path)
    base = torch.randn(4, 4, requires_grad=True)
    cache.put("k" * 32, {"t": base[:, 1]})  # a non-contiguous view with autograd history
    assert torch.equal(cache.get("k" * 32)["t"], base[:, 1].detach())


def test_cache_miss_on_an_absent_key(tmp_path):
    cache = TensorCache(tmp_path / "nothing-here-yet")
    assert cache.get(cache_key("absent")) is None
    assert (cache.hits, cache.misses) == (0, 1)


@pytest.mark.parametrize("garbage", [b"", b"abc", bytes(range(256)) * 4, b"\x10" + b"\x00" * 7 + b'{"x": 1}       '])
def test_an_unreadable_cache_file_is_a_miss_and_is_rewritten(tmp_path, garbage):
    cache = TensorCache(tmp_path)
    key = cache_key("latent", "garbage")
    cache.path(key).parent.mkdir(parents=True)
    cache.path(key).write_bytes(garbage)
    assert cache.get(key) is None
    assert cache.misses == 1
    cache.put(key, {"latents": torch.zeros(2)})
    assert torch.equal(cache.get(key)["latents"], torch.zeros(2))


def test_a_truncated_cache_file_is_a_miss(tmp_path):
    cache = TensorCache(tmp_path)
    key = cache_key("latent", "cut")
    cache.put(key, {"latents": torch.randn(64)})
    data = cache.path(key).read_bytes()
    cache.path(key).write_bytes(data[: len(data) - 16])
    assert cache.get(key) is None


def test_cache_key_changes_with_each_fact(monkeypatch):
    facts = ["latent", "sha1-of-image", (512, 384), "vae-fingerprint", "center-crop"]
    key = cache_key(*facts)
    assert key == cache_key(*facts) and len(key) == 32
    keys = {key}
    for index in range(len(facts)):
        changed = list(facts)
        changed[index] = f"{facts[index]}-other"
        keys.add(cache_key(*changed))
    keys.add(cache_key(*facts[:-1]))
    keys.add(cache_key(*facts, "extra"))
    keys.add(cache_key("latent", "sha1-of-image", (384, 512), "vae-fingerprint", "center-crop"))
    assert len(keys) == len(facts) + 4
    monkeypatch.setattr(cache_module, "CACHE_FORMAT", "999")
    assert cache_key(*facts) != key  # a new cache format invalidates every entry


def test_cache_key_does_not_collide_by_joining():
    assert cache_key("ab", "c") != cache_key("a", "bc")
    assert cache_key("a b") != cache_key("a", "b")


# --- epoch order ----------------------------------------------------------------------------

def make_dataset(buckets: list[tuple[int, int]], repeats: list[int] | None = None,
                 batch_size: int = 2, seed: int = 1) -> TrainDataset:
    repeats = repeats or [1] * len(buckets)
    entries = [
        Entry(ConceptItem(Path(f"{i}.png"), f"caption {i}", 0), bucket, f"latent-{i}", f"text-{i}", count)
        for i, (bucket, count) in enumerate(zip(buckets, repeats))
    ]
    latents = {e.latent_key: torch.full((4, e.bucket[1] // 8, e.bucket[0] // 8), float(i)) for i, e in enumerate(entries)}
    texts = {e.text_key: {"hidden": torch.full((3, 5), float(i))} for i, e in enumerate(entries)}
    return TrainDataset(entries, latents, texts, batch_size, seed)


MIXED = [(64, 64)] * 5 + [(96, 64)] * 4 + [(64, 96)] * 3


def test_epoch_order_is_a_function_of_seed_and_epoch():
    first, second = make_dataset(MIXED), make_dataset(MIXED)
    for epoch in range(3):
        assert first.epoch_batches(epoch) == second.epoch_batches(epoch)
    assert first.epoch_batches(0) == first.epoch_batches(0)  # asking twice changes nothing


def test_epoch_order_differs_across_epochs_and_seeds():
    dataset = make_dataset(MIXED)
    orders = [dataset.epoch_batches(epoch) for epoch in range(4)]
    assert all(orders[i] != orders[j] for i in range(4) for j in range(i + 1, 4))
    assert make_dataset(MIXED, seed=2).epoch_batches(0) != orders[0]


def test_every_batch_shares_one_bucket_and_every_image_appears_once():
    dataset = make_dataset(MIXED, batch_size=2)
    for epoch in range(5):
        batches = dataset.epoch_batches(epoch)
        for batch in batches:
            assert 1 <= len(batch) <= 2
            assert len({dataset.entries[i].bucket for i in batch}) == 1
        assert sorted(i for batch in batches for i in batch) == list(range(len(MIXED)))


def test_buckets_are_interleaved_not_served_one_after_another():
    dataset = make_dataset([(64, 64)] * 8 + [(96, 64)] * 8, batch_size=1)
    for epoch in range(3):
        order = [dataset.entries[batch[0]].bucket for batch in dataset.epoch_batches(epoch)]
        assert order != sorted(order) and order != sorted(order, reverse=True)


def test_repeats_expand_the_counts():
    dataset = make_dataset([(64, 64)] * 3 + [(96, 64)] * 2, repeats=[1, 3, 2, 1, 4], batch_size=3)
    for epoch in range(3):
        batches = dataset.epoch_batches(epoch)
        assert Counter(i for batch in batches for i in batch) == {0: 1, 1: 3, 2: 2, 3: 1, 4: 4}
        assert all(len({dataset.entries[i].bucket for i in batch}) == 1 for batch in batches)


def test_an_incomplete_final_batch_is_kept():
    dataset = make_dataset([(64, 64)] * 5 + [(96, 64)] * 3, batch_size=2)
    batches = dataset.epoch_batches(0)
    sizes_by_bucket: dict[tuple[int, int], list[int]] = {}
    for batch in batches:
        sizes_by_bucket.setdefault(dataset.entries[batch[0]].bucket, []).append(len(batch))
    assert sorted(sizes_by_bucket[(64, 64)]) == [1, 2, 2]
    assert sorted(sizes_by_bucket[(96, 64)]) == [1, 2]
    assert sum(len(b) for b in batches) == 8


def test_a_batch_larger_than_the_set_is_one_short_batch():
    dataset = make_dataset([(64, 64)] * 3, batch_size=8)
    assert [sorted(b) for b in dataset.epoch_batches(0)] == [[0, 1, 2]]


def test_collate_stacks_latents_text_and_captions():
    dataset = make_dataset(MIXED, batch_size=2)
    batch = dataset.collate([6, 5], torch.device("cpu"))
    assert batch.latents.shape == (2, 4, 8, 12)
    assert batch.latents[:, 0, 0, 0].tolist() == [6.0, 5.0]
    assert batch.text["hidden"].shape == (2, 3, 5) and batch.text["hidden"][:, 0, 0].tolist() == [6.0, 5.0]
    assert batch.captions == ["caption 6", "caption 5"]


# --- prepare_dataset, with a stand-in family --------------------------------------------------

class FakeFamily:
    """What prepare_dataset asks of a model family, without a model: latents are the mean colour."""

    bucket_quantum = 32
    pixel_conditioning = ()  # nothing drawn from the pixels besides the latents
    text_sees_controls = False  # its text is encoded from the caption alone
    masked_text_padding = MappingProxyType({})  # text entries stored whole
    one_frame_note = None
    label = "Fake"
    image_parts = ("vae",)
    text_parts = ("text_encoder",)

    def caption_windows(self) -> list:
        return []  # no tokenizer: no caption is cut

    def __init__(self, identity: str = "v1"):
        self.identity = identity
        self.encoded_images = 0
        self.encoded_texts = 0

    def fingerprint(self, *parts: str) -> str:
        return f"{self.identity}:{','.join(parts)}"

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded_images += len(pixels)
        return torch.nn.functional.avg_pool2d(pixels, 8)

    def tokenize(self, captions: list[str]) -> list[str]:
        return captions

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        self.encoded_texts += len(captions)
        return {"hidden": torch.tensor([[float(len(c))] * 4 for c in captions])}


def fake_config(*folders: Path, resolution: int = 64, **concept_fields):
    return SimpleNamespace(
        concepts=[ConceptConfig(path=str(folder), **concept_fields) for folder in folders],
        data=DataConfig(resolution=resolution, aspect_buckets=True),
        schedule=SimpleNamespace(batch_size=2),
        seed=3,
    )


def prepare(config, family, cache_dir: Path, cache_text: bool = True):
    warnings: list[str] = []
    dataset = prepare_dataset(config, family, torch.device("cpu"), cache_dir, warnings.append, cache_text)
    return dataset, warnings


def test_prepare_encodes_once_then_serves_from_the_cache(tmp_path):
    images = tmp_path / "images"
    write_shape_images(images, count=3, width=64, height=64)
    draw_shape("circle", "red", "blue", 96, 48).save(images / "wide.png")
    (images / "wide.txt").write_text("a wide red circle", encoding="utf-8")
    family = FakeFamily()
    dataset, warnings = prepare(fake_config(images), family, tmp_path / "cache")
    assert not warnings and len(dataset.entries) == 4
    assert (family.encoded_images, family.encoded_texts) == (4, 4)
    assert {e.bucket for e in dataset.entries} == {(64, 64), (64, 32)}
    wide = next(e for e in dataset.entries if e.item.image.name == "wide.png")
    assert dataset.latents[wide.latent_key].shape == (3, 4, 8)

    again = FakeFamily()
    cached, _ = prepare(fake_config(images), again, tmp_path / "cache")
    # nothing but the probes: one blank image and one caption, whose shapes the cached entries must have
    assert (again.encoded_images, again.encoded_texts) == (1, 1)
    for key, latent in dataset.latents.items():
        assert torch.equal(cached.latents[key], latent)

    other_model = FakeFamily("v2")  # other weights: nothing cached applies
    prepare(fake_config(images), other_model, tmp_path / "cache")
    assert (other_model.encoded_images, other_model.encoded_texts) == (4, 4)


def test_prepare_reencodes_what_changed(tmp_path):
    images = tmp_path / "images"
    paths = write_shape_images(images, count=3, width=64, height=64)
    prepare(fake_config(images), FakeFamily(), tmp_path / "cache")
    draw_shape("square", "green", "white", 64, 64).save(paths[0])  # new pixels
    paths[1].with_suffix(".txt").write_text("a new caption", encoding="utf-8")
    family = FakeFamily()
    prepare(fake_config(images), family, tmp_path / "cache")
    assert (family.encoded_images, family.encoded_texts) == (1 + 1, 1 + 1)  # (and the layout probes)
    family = FakeFamily()
    prepare(fake_config(images, resolution=96), family, tmp_path / "cache")  # other bucket sizes
    assert family.encoded_images == 3


def test_prepare_without_text_caching_leaves_text_to_the_trainer(tmp_path):
    images = tmp_path / "images"
    write_shape_images(images, count=2, width=64, height=64)
    family = FakeFamily()
    dataset, _ = prepare(fake_config(images), family, tmp_path / "cache", cache_text=False)
    assert family.encoded_texts == 0 and dataset.texts == {}
    assert dataset.collate([0, 1], torch.device("cpu")).text is None


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_image_is_skipped_and_named(tmp_path, damage):
    images = tmp_path / "images"
    paths = write_shape_images(images, count=3, width=64, height=64)
    broken = paths[1]
    if damage == "garbage":
        broken.write_bytes(b"this is not a png")
    else:  # the header reads, the pixels do not
        broken.write_bytes(broken.read_bytes()[:60])
    dataset, warnings = prepare(fake_config(images), FakeFamily(), tmp_path / "cache")
    assert sorted(e.item.image.name for e in dataset.entries) == sorted(p.name for p in paths if p != broken)
    (warning,) = warnings
    assert str(broken) in warning and "skipping" in warning
    assert all(e.latent_key in dataset.latents for e in dataset.entries)


def test_a_concept_without_a_usable_image_is_an_error_naming_its_folder(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_shape_images(good, count=2, width=64, height=64)
    bad.mkdir()
    (bad / "only.png").write_bytes(b"broken")
    with pytest.raises(DataError) as caught:
        prepare(fake_config(good, bad), FakeFamily(), tmp_path / "cache")
    assert str(caught.value).startswith("concepts[1].path:") and str(bad) in str(caught.value)


def test_no_enabled_concept_is_an_error(tmp_path):
    images = tmp_path / "images"
    write_shape_images(images, count=1, width=64, height=64)
    with pytest.raises(DataError) as caught:
        prepare(fake_config(images, enabled=False), FakeFamily(), tmp_path / "cache")
    assert str(caught.value).startswith("concepts:")


def test_prepare_keeps_concept_indices_and_repeats(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    write_shape_images(first, count=2, width=64, height=64)
    write_shape_images(second, count=1, width=64, height=64)
    config = fake_config(first, second)
    config.concepts[1] = ConceptConfig(path=str(second), repeats=3)
    dataset, _ = prepare(config, FakeFamily(), tmp_path / "cache")
    assert sorted((e.item.concept, e.repeats) for e in dataset.entries) == [(0, 1), (0, 1), (1, 3)]
    assert sum(len(b) for b in dataset.epoch_batches(0)) == 5
