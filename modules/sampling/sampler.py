"""Sample images from the live model (adapters hooked) into workspace/samples/."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.saving.atomic import write_with


@torch.no_grad()
def sample_prompts(family, prompts, out_dir: Path, step: int, device: torch.device,
                   names: list[str] | None = None, write: bool = True) -> list[Path]:
    """One PNG per prompt, `step<step>-<name>.png`; a name is the prompt's index in
    sampling.prompts by default (the GUI's gallery reads the prompt back from it). `write` False:
    the images are made and dropped (a rank other than 0 joining a sharded part's forward passes)."""
    modes = {name: module.training for name, module in family.parts.items()}
    for module in family.parts.values():
        module.eval()
    paths = []
    try:
        for index, prompt in enumerate(prompts):
            image = family.sample(prompt, device)
            if not write:
                continue
            path = Path(out_dir) / f"step{step:07d}-{names[index] if names else index}.png"
            write_with(path, lambda temp, image=image: image.save(temp, format="PNG"))
            paths.append(path)
    finally:
        for name, module in family.parts.items():
            module.train(modes[name])
    return paths
