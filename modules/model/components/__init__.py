"""Pieces several model families share: CLIP text encoders, the AutoencoderKL VAE, the DDPM and
flow-matching training schedules, the UNet2DConditionModel's blocks and original (ldm) key names.
A family file composes these; no family imports another family's private names."""
