"""What is wrong with the control images of the sample prompts, for a family: more than its
prompts take, fewer than it samples from (an image-to-video model's first frame), files that are
not there. One function, torch-free: the run's preflight (modules/trainer/preflight.py) and the
GUI (ui/state.py, each edit) report the same lines, each naming its prompt's field.

A family whose declaration allows a range may take an exact count with the model's files (Wan 2.1
I2V takes one or two images; its I2V transformer one, its FLF2V transformer two, told by the
transformer's config before any weight loads): the preflight, which has the model's files, passes
that count (`ExactPromptImages`, from `ModelFamily.exact_prompt_images`); the GUI, which has only the
config, checks the declaration's range."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modules.config.family_declaration import FamilyDeclaration
from modules.config.sampling_config import SamplePromptConfig


@dataclass(frozen=True)
class ExactPromptImages:
    """Each sample prompt takes exactly `count` images with this model; `takes` says so after the count
    given ("Wan 2.1 I2V 14B with this transformer samples from two images, its first and last frames")."""

    count: int
    takes: str


def exact_count_problems(prompts: list[SamplePromptConfig], exact: ExactPromptImages,
                         none_too: bool = True) -> list[str]:
    """A line for each prompt whose images are not `exact.count` (a prompt with none only where `none_too`)."""
    problems = [_exact_count_problem(index, prompt, exact, none_too) for index, prompt in enumerate(prompts)]
    return [problem for problem in problems if problem]


def _exact_count_problem(index: int, prompt: SamplePromptConfig, exact: ExactPromptImages,
                         none_too: bool) -> str | None:
    given = len(prompt.control_images)
    # as the declaration's range: too many is named on any prompt, too few only on one that is sampled
    short = given < exact.count and prompt.enabled and (given > 0 or none_too)
    if given > exact.count or short:
        return f"sampling.prompts[{index}].control_images: {given or 'none'} given; {exact.takes}"
    return None


def prompt_control_problems(prompts: list[SamplePromptConfig], family: FamilyDeclaration,
                            exact: ExactPromptImages | None = None) -> list[str]:
    """`exact`: the model's own count, checked instead of the declaration's range."""
    fewest, most = family.prompt_images
    problems = []
    for index, prompt in enumerate(prompts):
        where = f"sampling.prompts[{index}].control_images"
        if exact is not None:
            problem = _exact_count_problem(index, prompt, exact, none_too=True)
            problems += [problem] if problem else []
        elif len(prompt.control_images) > most:
            problems.append(f"{where}: {len(prompt.control_images)} given; {family.label} takes {most or 'none'}")
        elif len(prompt.control_images) < fewest and prompt.enabled:
            problems.append(f"{where}: {len(prompt.control_images) or 'none'} given; {family.label} samples from "
                            f"{fewest} image(s) (the first frame of its video)")
        problems += [f"{where}: {path} not found" for path in prompt.control_images if not Path(path).is_file()]
    return problems
