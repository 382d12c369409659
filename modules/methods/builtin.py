"""Imports the built-in training methods so each registers itself (one line per method file)."""

import modules.methods.adapter  # noqa: F401
import modules.methods.embedding  # noqa: F401
import modules.methods.fine_tune  # noqa: F401
