"""Starting from adapter files (`adapter.init_from`) written per part: a family that saves one file
per part (Wan 2.2 A14B: one per expert, each under a lone Wan transformer's names) says which of the
run's parts each start file holds (ModelFamily.init_from_files), and each file loads, strictly, into
those parts' adapters under the names it was written with (AdapterSet.written_as, as it was saved).
Any other file holds the run's adapters under their own names (formats/files.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from modules.adapters.adapter_set import AdapterSet
from modules.adapters.formats.files import load_adapter_file

if TYPE_CHECKING:
    from modules.model.base import ModelFamily


def load_per_part_files(plan: list[tuple[Path, dict[str, str]]], adapters: AdapterSet, family: ModelFamily) -> str:
    """Load each (file, {part: the part it is written as}) of `plan` into those parts' adapters; the
    line that tells the run which file started which part."""
    for path, parts in plan:
        load_adapter_file(path, adapters.written_as(parts, family), family)
    started = "; ".join(f"{path.name} -> {', '.join(parts)}" for path, parts in plan)
    return f"adapter.init_from: started {started}"
