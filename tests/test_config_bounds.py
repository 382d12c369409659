"""Every number a user can type into a config has a lower and an upper bound (pydantic Field
constraints), or a reason here why it needs none: an unbounded size or count takes the machine down
(issue 26: `data.resolution=1000000` filled 18.6 GB, `repeats=1e9` ran out of memory, a seed of
2**70 killed the run). The walk starts at TrainConfig and goes into nested models, lists, dicts,
tuples and every member of the tagged unions (optimizers, methods, registered adapters)."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from modules.config.tagged import TaggedUnion
from modules.config.train_config import TrainConfig

# dotted field path (list items as [], dict values as {}, tuple items as [i]) -> why it has no bounds
NO_BOUNDS_NEEDED = {
    "version": "must equal CURRENT_VERSION (TrainConfig._current_version); older versions are migrated first",
}

_LOWER = (annotated_types.Ge, annotated_types.Gt)
_UPPER = (annotated_types.Le, annotated_types.Lt)


def _constraints(metadata: list) -> list:
    found = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            found += _constraints(item.metadata)
        elif isinstance(item, annotated_types.Interval):  # (a Field's ge/le come as single constraints)
            found += [c for c in (annotated_types.Ge(item.ge) if item.ge is not None else None,
                                  annotated_types.Le(item.le) if item.le is not None else None) if c]
        else:
            found.append(item)
    return found


def _numbers(annotation: Any, path: str, constraints: list, seen: set) -> list[tuple[str, list]]:
    """(path, constraints) of every int/float reachable from `annotation`."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *metadata = typing.get_args(annotation)
        return _numbers(inner, path, constraints + _constraints(metadata), seen)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in seen:
            return []  # each model once (shared option groups: LowRankOptions in several adapters)
        seen.add(annotation)
        found = []
        for name, field in annotation.model_fields.items():
            at = f"{path}.{name}" if path else name
            union = next((item for item in field.metadata if isinstance(item, TaggedUnion)), None)
            if union is not None:  # a tagged section: every registered member's fields
                found += [f for m in union.members().values() for f in _numbers(m.config_class, at, [], seen)]
                continue
            found += _numbers(field.annotation, at, _constraints(field.metadata), seen)
        seen.discard(annotation)
        return found
    if origin in (Union, types.UnionType):
        return [found for arg in typing.get_args(annotation) for found in _numbers(arg, path, constraints, seen)]
    if origin is list:
        return _numbers(typing.get_args(annotation)[0], path + "[]", [], seen)
    if origin is dict:
        return _numbers(typing.get_args(annotation)[1], path + "{}", [], seen)
    if origin is tuple:
        return [found for index, arg in enumerate(typing.get_args(annotation))
                for found in _numbers(arg, f"{path}[{index}]", [], seen)]
    if annotation in (int, float):
        return [(path, constraints)]
    if annotation in (bool, str, type(None)) or origin is Literal:
        return []
    raise AssertionError(f"{path}: the walk does not know {annotation!r}; teach it")


def _unbounded() -> list[str]:
    problems = []
    for path, constraints in _numbers(TrainConfig, "", [], set()):
        lower = any(isinstance(c, _LOWER) for c in constraints)
        upper = any(isinstance(c, _UPPER) for c in constraints)
        if not (lower and upper) and path not in NO_BOUNDS_NEEDED:
            problems.append(f"{path}: {'no lower bound' if not lower else ''}"
                            f"{' and ' if not lower and not upper else ''}{'no upper bound' if not upper else ''}")
    return sorted(set(problems))


def test_every_number_in_the_config_has_bounds_or_a_reason_for_none():
    assert _unbounded() == []


def test_the_walk_sees_the_unions_members_and_nested_numbers():
    paths = {path for path, _ in _numbers(TrainConfig, "", [], set())}
    # an optimizer's own field, a method's, each registered adapter's, a list item's, a dict value's
    assert {"optimizer.d0", "adapter.block_size", "adapter.factor", "concepts[].repeats",
            "model.parts{}.offload_fraction", "optimizer.betas[0]", "sampling.prompts[].seed"} <= paths
    assert set(NO_BOUNDS_NEEDED) <= paths  # no stale reason


# --- the cases of issue 26, each refused with the field and the limit named -----------------------

def _problems(*overrides: str) -> str:
    import pytest

    from modules.config.errors import ConfigError
    from modules.config.loading import build_config

    with pytest.raises(ConfigError) as caught:
        build_config([{"concepts": [{"path": "images"}],
                       "sampling": {"prompts": [{"prompt": "a cat"}]}}], list(overrides))
    return "\n".join(caught.value.problems)


def test_a_resolution_of_a_million_is_refused_naming_the_limit():
    from modules.config.limits import MAX_RESOLUTION

    assert _problems("data.resolution=1000000") == (
        f"data.resolution: must be a whole number of pixels from 8 to {MAX_RESOLUTION}, or a list of them "
        "(got 1000000)")
    assert f"to {MAX_RESOLUTION}" in _problems("data.resolution=[512, 100000]")


def test_a_billion_repeats_is_refused_before_the_epoch_list_is_built():
    assert _problems("concepts[0].repeats=1e9") == "concepts[0].repeats: must be <= 10000 (got 1000000000.0)"
    assert _problems("concepts[0].samples_per_epoch=1e12").startswith("concepts[0].samples_per_epoch: must be <=")


def test_a_seed_beyond_64_bits_is_refused_in_the_config_and_in_a_sample_prompt():
    assert _problems("seed=1180591620717411303424") == "seed: must be <= 4294967295 (got 1180591620717411303424)"
    assert _problems("sampling.prompts[0].seed=-1") == "sampling.prompts[0].seed: must be >= 0 (got -1)"
    assert _problems("sampling.prompts[0].width=65536") == "sampling.prompts[0].width: must be <= 4096 (got 65536)"


def test_the_largest_seed_accepted_draws_every_epoch_order():
    """The data order derives seeds from the run's seed (x 1,000,003, x 7,919): at the largest
    seed the config accepts they must stay within what torch's generators take."""
    from pathlib import Path

    from modules.config.limits import MAX_SEED
    from modules.data.concepts import ConceptItem
    from modules.data.dataset import Entry, TrainDataset

    entries = [Entry(ConceptItem(Path(f"{i}.png"), "c", concept=0), (64, 64), f"l{i}", None, 1,
                     samples_per_epoch=3) for i in range(2)]
    dataset = TrainDataset(entries, {}, {}, batch_size=1, seed=MAX_SEED)
    assert sorted(i for batch in dataset.epoch_batches(5) for i in batch) in ([0, 0, 1], [0, 1, 1])


def test_an_epoch_of_more_than_ten_million_images_is_refused_naming_the_concept():
    """repeats (<= 10000) times images can still ask for billions of list entries."""
    from pathlib import Path

    import pytest

    from modules.config.train_config import ConceptConfig
    from modules.data.concepts import ConceptItem, DataError
    from modules.data.dataset import Entry
    from modules.data.epoch_size import check_epoch_size

    concepts = [ConceptConfig(path="small", repeats=2), ConceptConfig(path="many", repeats=10_000)]

    def entries(count: int) -> list[Entry]:
        return ([Entry(ConceptItem(Path("s.png"), "c", 0), (64, 64), "s", None, 2)]
                + [Entry(ConceptItem(Path(f"{i}.png"), "c", 1), (64, 64), f"k{i}", None, 10_000) for i in range(count)])

    check_epoch_size(entries(999), concepts)  # 9,990,002 images: fine
    with pytest.raises(DataError) as refused:
        check_epoch_size(entries(1000), concepts)
    assert str(refused.value).startswith("concepts[1].repeats: one epoch would train 10,000,002 images "
                                         "(10,000,000 of them from many), more than 10,000,000")


def test_the_epoch_size_is_checked_before_any_image_is_encoded(tmp_path, shape_images, monkeypatch):
    import pytest

    from modules.config import limits
    from modules.config.loading import build_config
    from modules.data.concepts import DataError
    from modules.data.dataset import prepare_dataset

    class NoEncoder:  # a family that must not be asked to encode: the check comes first
        image_parts, text_parts, bucket_quantum = ("vae",), ("text_encoder",), 64

        def fingerprint(self, *parts):
            return "f"

        def encode_images(self, pixels):
            raise AssertionError("encoded before the epoch size was checked")

    monkeypatch.setattr(limits, "MAX_EPOCH_IMAGES", 30)  # 4 images x 10 repeats = 40
    config = build_config([{"concepts": [{"path": str(shape_images), "repeats": 10}]}])
    with pytest.raises(DataError, match=r"^concepts\[0\]\.repeats: one epoch would train 40 images"):
        prepare_dataset(config, NoEncoder(), "cpu", tmp_path / "cache", print, cache_text=False)
