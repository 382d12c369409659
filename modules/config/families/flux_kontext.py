"""The FLUX.1 Kontext family (an edit model: FLUX.1's architecture conditioned on a reference
image), as the config and the GUI see it (torch-free); its implementation:
modules/model/flux_kontext.py."""

from __future__ import annotations

from dataclasses import replace

from modules.config.families.flux import DECLARATION as FLUX

# FLUX.1's parts, layer presets and bucket size: the same transformer, text encoders and VAE
DECLARATION = replace(
    FLUX,
    name="flux_kontext",
    label="FLUX.1 Kontext",
    control_images=1,  # FluxKontextPipeline conditions on one reference image
    planned_control_images=1,  # an edit pair: a preset is planned with its reference
    implementation="modules.model.flux_kontext:FluxKontextFamily",
)
