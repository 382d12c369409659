"""The "did you mean" of an error about a name the user typed (a config key, a preset)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(typed: str, known: Iterable[str]) -> str | None:
    """The known name nearest to `typed` (case ignored, as a typo often flips one), or None when
    none is near enough to be worth suggesting."""
    by_lower = {name.lower(): name for name in known}
    match = difflib.get_close_matches(typed.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def did_you_mean(typed: str, known: Iterable[str]) -> str:
    """'; did you mean 'x'?' to append to a message, or '' when nothing is close."""
    match = closest(typed, known)
    return f"; did you mean {match!r}?" if match else ""
