"""The text cache of a family whose padding is masked (ModelFamily.masked_text_padding: FIBO-2,
FIBO Edit, Krea-2 and Qwen-Image (its edit models too), whose own tests show the padding changes nothing) holds each caption's real tokens only,
and training on it equals training on the whole padded encodings: the adapter after two steps is
the same, entries written whole are not read as trimmed ones (their keys differ), and a second run
reuses the trimmed entries."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from safetensors import safe_open

from modules.data.text_padding import padded, real_tokens

FAMILIES = {"fibo2": "modules.model.fibo2:Fibo2Family", "krea2": "modules.model.krea2:Krea2Family",
            "fibo_edit": "modules.model.fibo_edit:FiboEditFamily", "qwen_image": "modules.model.qwen_image:QwenImageFamily"}


def _family_class(name):
    import importlib

    module, cls = FAMILIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _entries(cache_dir):
    return sorted((cache_dir / "text").rglob("*.safetensors"))


def _entry_bytes(path) -> dict[str, tuple[tuple[int, ...], int]]:
    with safe_open(str(path), "pt") as file:
        names = list(file.keys())  # (safe_open is not iterable)
        return {name: (tuple(file.get_slice(name).get_shape()), file.get_tensor(name).nbytes) for name in names}


def _train(model, images, workspace, family, steps: int = 2):
    from modules.trainer.generic_trainer import GenericTrainer

    trainer = GenericTrainer(train_config(model, images, workspace, {
        "model": {"family": family}, "schedule": {"epochs": max(steps, 1), "batch_size": 1}}))
    trainer.start()  # builds (or reads) the caches
    if steps:
        trainer.train()
    return trainer


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_cache_holds_the_real_tokens_and_trains_as_the_padded_encoding(name, tiny_family_model, one_image,
                                                                            tmp_path, monkeypatch):
    model = tiny_family_model(name)
    family_class = _family_class(name)
    spec = family_class.masked_text_padding
    assert spec
    # the first trimmed tensor; any further one (FIBO-2's caption without its text images) is empty here
    (tensor_name, (mask_name, axis)), *others = spec.items()

    with monkeypatch.context() as whole_cache:  # the untrimmed path: entries stored whole, as before
        whole_cache.setattr(family_class, "masked_text_padding", {})
        whole = _train(model, one_image, tmp_path, name)
    cache_dir = whole.cache_dir
    (written_whole,) = _entries(cache_dir)
    trimmed = _train(model, one_image, tmp_path, name)  # the same workspace and cache folder
    assert trimmed.dataset.cache_stats["text"] == (0, 1)  # the whole entry is not read: another key
    assert trimmed.dataset.cache_stats["latents"][1] == 0
    (written,) = [path for path in _entries(cache_dir) if path != written_whole]

    # the entry holds the caption's real tokens only (its mask, whole, says where they go)
    caption = next(one_image.glob("*.txt")).read_text(encoding="utf-8").strip()
    encoded = trimmed.family.encode_text(trimmed.family.tokenize([caption]))
    full_shape = tuple(encoded[tensor_name].shape[1:])
    real = int(encoded[mask_name][0].bool().sum())
    assert 0 < real < full_shape[axis], (real, full_shape)
    stored = _entry_bytes(written)
    real_shape = full_shape[:axis] + (real,) + full_shape[axis + 1:]
    assert stored[tensor_name] == (real_shape, 4 * torch.Size(real_shape).numel())  # float32, as all entries
    assert _entry_bytes(written_whole)[tensor_name] == (full_shape, 4 * torch.Size(full_shape).numel())
    mask_bytes = stored[mask_name][1] + sum(stored[other_mask][1] for _, (other_mask, _) in others)
    assert all(stored[other][0][other_axis] == 0 for other, (_, other_axis) in others)  # no text images: no tokens
    assert sum(size for _, size in stored.values()) == 4 * torch.Size(real_shape).numel() + mask_bytes

    ours, theirs = trimmed.adapters.state_dict(), whole.adapters.state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-6, rtol=0)

    again = _train(model, one_image, tmp_path, name, steps=0)  # reused: nothing encoded again
    assert again.dataset.cache_stats["text"] == (1, 0)
    batch = again.dataset.collate([0], torch.device("cpu"))
    assert batch.text[tensor_name].shape[1:] == full_shape  # back in its window where batches are assembled
    real_here = encoded[mask_name][0].bool().reshape([-1 if i == axis else 1 for i in range(len(full_shape))])
    expected = torch.where(real_here, encoded[tensor_name][0].float(), 0.0)  # zeros at the padding
    torch.testing.assert_close(batch.text[tensor_name][0], expected, atol=1e-6, rtol=0)


def test_padding_puts_the_real_tokens_back_where_the_mask_says():
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])  # Krea-2's kind: padding before the suffix
    states = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    spec = {"hidden_states": ("attention_mask", 1)}
    stored = real_tokens({"hidden_states": states, "attention_mask": mask}, spec)
    assert stored["hidden_states"].shape == (2, 3, 3)
    back = padded(stored, spec)
    assert torch.equal(back["hidden_states"][:, mask.bool()], states[:, mask.bool()])
    assert not back["hidden_states"][:, ~mask.bool()].any()
    assert torch.equal(back["attention_mask"], mask)
