"""The plan's notes (RunPlan.notes): what the figures of run_plan.Planner.plan rest on that the
numbers alone do not say (which parts wait on the host, the phases outside the step and what they
are planned on, the token tables on the host, the released architecture, the clips and control
images the step is planned with, the text encoders in the step), in that order.
"""

from __future__ import annotations

from pathlib import Path

from modules.config.train_config import TrainConfig


def plan_notes(config: TrainConfig, family, sized: dict, accounts, phases: dict[str, int], phase_notes: list[str],
               idle: set[str], side: int, text_counted: bool, controls, text_in_step: bool) -> list[str]:
    """`accounts`: the per-part sums (part_accounting.PartAccounts); `phases`: phase -> its peak;
    `phase_notes`: the phase pass's own; `side`: the square the step is planned at; `controls`: the
    control images planned (controls.py); `text_in_step`: the text encoders run in every step
    (run_plan.text_in_step)."""
    from modules.plan.fake_pass import planned_frames

    placed = accounts.placed
    notes = []
    if idle:
        notes.append(f"not in the training step ({', '.join(n for n in config.model.parts if n in idle)}): "
                     f"on the host while training, on the device as placed while caching and sampling "
                     f"({placed / 2**30:.2f} GiB of weights then)")
    if phases:
        notes.append("outside the training step: " + ", ".join(
            f"{name} {peak / 2**30:.2f} GiB ({(peak - placed) / 2**30:.2f} of activations)"
            for name, peak in phases.items()) + _sample_what(config, family))
    notes.extend(phase_notes)
    if accounts.table_total:
        notes.append(f"token tables on the host ({', '.join(accounts.table_parts)}): "
                     f"frozen, looked up there, the rows sent over ({accounts.table_total / 2**30:.2f} GiB off the "
                     f"device)")
    if sized["released"]:
        notes.append(_released_note(config, sized))
    frames = planned_frames(config, family)
    if frames > 1:
        notes.append(f"the step is planned on clips of {frames} frames at {side}x{side} (the longest video "
                     "concept's video.frames)")
    if controls.count:
        notes.append(f"the step is planned with {controls.count} control image(s) per sample at {side}x{side} "
                     f"({controls.source}): their tokens join the denoiser's sequence")
        if family.text_sees_controls:
            notes.append("the text encoder sees the control images too: their image tokens lengthen the "
                         "conditioning the denoiser reads" + (
                             "; where the encoder runs in the step, its language model is planned over "
                             "as many tokens (the vision tower's pass, which no gradient keeps, is not)"
                             if text_in_step else
                             "; the encoder itself is not in the step (its encodings of each caption "
                             "with its controls are cached)"))
    if text_in_step:
        notes.append(f"the text encoders ({', '.join(family.text_parts)}) run in every step (the text is not "
                     "cached: " + ("an embedding changes what a caption encodes to" if config.embeddings else
                                   "a text encoder trains" if any(config.model.parts[p].train
                                                                  for p in family.text_parts)
                                   else "the captions vary") + ")" + (
            "" if text_counted else "; their activations are not counted: " + (
                "the family cannot plan its text encoder's pass over the control images "
                "(planning_tokens_with_controls)" if controls.count and family.text_sees_controls
                else "the family's text encoding cannot run on shapes alone (planning_tokens)")))
    return notes


def _released_note(config: TrainConfig, sized: dict) -> str:
    from modules.config.families import get_family_class

    folder = get_family_class(config.model.family).released_config_folder()
    # a variant's own folders (FLUX.2 klein 9B's `*_klein_9b`) named, so the plan says which model it sized
    variant_folders = sorted(Path(part.path).name for part in sized["config"].model.parts.values()
                             if part.path and Path(part.path).parent == folder)
    also = f": {', '.join(variant_folders)}" if variant_folders else ""
    return f"planned on the released architecture (resources/model_configs/{folder.name}{also})"


def _sample_what(config: TrainConfig, family) -> str:
    """What the sampling phase is planned on (its largest prompt), for the notes."""
    from modules.plan.phase_pass import guidance_batch, largest_prompt, sample_frames

    prompt = largest_prompt(config, family)
    if prompt is None:
        return ""
    frames = sample_frames(prompt, family)
    return (f"; sampling planned at {prompt.width}x{prompt.height}" + (f", {frames} frames" if frames > 1 else "")
            + (", the guidance batch of 2" if guidance_batch(prompt, family) == 2 else "")
            + ", then the VAE decode")
