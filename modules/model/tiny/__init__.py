"""Tiny random models of each family, in diffusers layout and built offline, for tests, the demo,
benchmarks and `launch.py make-tiny-model`: one file per family (`make_tiny_model(out, ...)`,
reached through ModelFamily.make_tiny_model), shared pieces in parts.py, offline tokenizers."""
