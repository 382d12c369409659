"""The size of one epoch's order list, checked before it is built: repeats (<= 10000 each) times
images times resolutions can still ask for billions of entries, which would run out of memory
building the list (issue 26: `repeats=1e9`) rather than say so."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from modules.config import limits
from modules.data.concepts import DataError

if TYPE_CHECKING:
    from modules.config.train_config import ConceptConfig
    from modules.data.dataset import Entry


def check_epoch_size(entries: list[Entry], concepts: list[ConceptConfig]) -> None:
    """A DataError naming the concept that adds the most, when an epoch would pass MAX_EPOCH_IMAGES."""
    per_concept: Counter[int] = Counter()
    for entry in entries:
        if entry.samples_per_epoch is None:
            per_concept[entry.item.concept] += entry.repeats
    for index in {entry.item.concept for entry in entries if entry.samples_per_epoch is not None}:
        per_concept[index] += concepts[index].samples_per_epoch or 0
    total = sum(per_concept.values())
    if total <= limits.MAX_EPOCH_IMAGES:
        return
    index, count = per_concept.most_common(1)[0]
    field = "samples_per_epoch" if concepts[index].samples_per_epoch is not None else "repeats"
    raise DataError(f"concepts[{index}].{field}: one epoch would train {total:,} images ({count:,} of them from "
                    f"{concepts[index].path}), more than {limits.MAX_EPOCH_IMAGES:,}; lower the repeats or "
                    "samples_per_epoch, or train more epochs")
