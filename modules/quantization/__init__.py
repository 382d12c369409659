"""Quantized base weights: layer classes (one file each), replacement at load, precision policy."""
