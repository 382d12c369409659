"""Aspect buckets: each image trains at the largest size of its aspect ratio whose area fits
resolution^2, with both sides multiples of the family's quantum (64 for SD: 8 latent pixels
times the UNet's downsampling)."""

from __future__ import annotations

import math

MAX_ASPECT = 4.0  # beyond this, crop to 4:1 rather than train a sliver


def bucket_for(width: int, height: int, resolution: int, quantum: int, aspect_buckets: bool = True) -> tuple[int, int]:
    """(bucket width, bucket height) for an image of width x height."""
    if not aspect_buckets:
        side = max(quantum, resolution // quantum * quantum)
        return side, side
    aspect = min(max(width / height, 1 / MAX_ASPECT), MAX_ASPECT)
    bucket_width = int(resolution * math.sqrt(aspect)) // quantum * quantum
    bucket_height = int(resolution / math.sqrt(aspect)) // quantum * quantum
    return max(quantum, bucket_width), max(quantum, bucket_height)
