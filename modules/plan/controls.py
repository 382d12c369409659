"""How many control (reference) images each training sample carries, for the plan of an edit model:
their latents join the denoiser's sequence after the target's (up to (1 + N)x its tokens), so the
step's activations and FLOPs grow with them.

The count is the concepts' own (modules/data/pairs.py: a `folders` concept's `control/`,
`control_2/`, ... folders, a `manifest` concept's longest `control` list); a paired concept whose
folder or manifest cannot be read yet is planned at the most the family takes. A config whose
concepts carry none trains none; one without any concept (a preset) is planned with the family's
`planned_control_images`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlannedControls:
    count: int  # control images per sample the step is planned with
    source: str  # where that count comes from, for the plan's note


def planned_controls(config, family) -> PlannedControls:
    if family.control_images == 0:
        return PlannedControls(0, "")
    concepts = [(index, concept) for index, concept in enumerate(config.concepts) if concept.enabled]
    if not concepts:
        return PlannedControls(family.planned_control_images, f"{family.label}'s usual count: no concept says")
    paired = [(index, concept) for index, concept in concepts if concept.controls.source != "none"]
    if not paired:
        return PlannedControls(0, "no concept has controls")
    counts = [(_concept_controls(concept, family.control_images), index) for index, concept in paired]
    count, index = max(counts)
    return PlannedControls(min(count, family.control_images), f"concepts[{index}].controls")


def _concept_controls(concept, most: int) -> int:
    """The controls per sample of one paired concept, as its folders or manifest show; `most` where
    they cannot be read (the data's own checks name what is wrong when the run starts)."""
    from modules.data.pairs import control_folders

    folder = Path(concept.path)
    try:
        if concept.controls.source == "folders":
            return len(control_folders(folder)) or most
        lines = (folder / concept.controls.manifest).read_text(encoding="utf-8-sig").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        lists = [r.get("control") for r in records if isinstance(r, dict)]
        return max((1 if isinstance(c, str) else len(c) for c in lists if isinstance(c, (str, list))), default=most)
    except (OSError, ValueError):  # (json's decode error is a ValueError)
        return most
