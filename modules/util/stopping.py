"""Stopping inside a long phase: caching a data set or a many-step sample can take minutes, so a
stop (Ctrl-C, SIGTERM, the GUI's Stop) is checked between its units of work (a batch of cached
images, a sampler step) rather than only between training steps."""

from __future__ import annotations

from typing import Callable

StopCheck = Callable[[], bool]  # whether a stop has been asked for


class StopRequested(Exception):
    """A stop asked for during a phase that checks for it: the phase ends there, keeping what it
    finished (written cache entries, saved samples)."""


def raise_if_stopping(stop: StopCheck | None) -> None:
    if stop is not None and stop():
        raise StopRequested
