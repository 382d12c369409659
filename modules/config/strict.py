"""The base of every config model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors: a typo in a preset must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
