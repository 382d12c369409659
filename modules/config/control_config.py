"""A concept's control (reference) images, for edit models (`concepts[].controls`): each training
sample is a target image, 1..N control images and a caption (the edit instruction). Torch-free;
the scan is modules/data/pairs.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.strict import StrictModel


class ControlConfig(StrictModel):
    source: Literal["none", "folders", "manifest"] = Field(
        "none",
        description="none: a plain image concept; folders: the concept folder holds `target/` and "
        "`control/` (`control_2/`, ... for more), matched by file stem, captions beside the targets; "
        "manifest: a JSON Lines file, one {\"target\": ..., \"control\": [...], \"caption\": ...} per line.",
    )
    manifest: str = Field("pairs.jsonl", description="For source 'manifest': the file, relative to the concept "
                          "folder; the paths in it are relative to the manifest's folder.")
