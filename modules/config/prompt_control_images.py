"""What is wrong with the control images of the sample prompts, for a family: more than its
prompts take, fewer than it samples from (an image-to-video model's first frame), files that are
not there. One function, torch-free: the run's preflight (modules/trainer/preflight.py) and the
GUI (ui/state.py, each edit) report the same lines, each naming its prompt's field."""

from __future__ import annotations

from pathlib import Path

from modules.config.family_declaration import FamilyDeclaration
from modules.config.sampling_config import SamplePromptConfig


def prompt_control_problems(prompts: list[SamplePromptConfig], family: FamilyDeclaration) -> list[str]:
    fewest, most = family.prompt_images
    problems = []
    for index, prompt in enumerate(prompts):
        where = f"sampling.prompts[{index}].control_images"
        if len(prompt.control_images) > most:
            problems.append(f"{where}: {len(prompt.control_images)} given; {family.label} takes {most or 'none'}")
        elif len(prompt.control_images) < fewest and prompt.enabled:
            problems.append(f"{where}: {len(prompt.control_images) or 'none'} given; {family.label} samples from "
                            f"{fewest} image(s) (the first frame of its video)")
        problems += [f"{where}: {path} not found" for path in prompt.control_images if not Path(path).is_file()]
    return problems
