"""Sample images (and a video family's videos, video_writer.py) from the live model (adapters
hooked) into workspace/samples/."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from modules.sampling.video_writer import write_sample_video
from modules.util.atomic import write_with
from modules.util.stopping import StopCheck, StopRequested, raise_if_stopping


def out_of_memory(error: BaseException) -> bool:
    """A failed allocation: torch's OutOfMemoryError (CUDA and other devices), or the CPU
    allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


@torch.no_grad()
def sample_prompts(family, prompts, out_dir: Path, step: int, device: torch.device,
                   names: list[str] | None = None, write: bool = True, stop: StopCheck | None = None,
                   on_made: Callable[[str, object], None] | None = None) -> list[Path]:
    """One PNG per prompt, `step<step>-<name>.png` (a prompt with `frames` > 1 on a video family:
    the poster of `step<step>-<name>.mp4` beside it); a name is the prompt's index in
    sampling.prompts by default (the GUI's gallery reads the prompt back from it). `write` False:
    the images are made and dropped (a rank other than 0 joining a sharded part's forward passes).
    `stop` is asked before each pass of the denoiser (every sampler step, whatever the family's
    pipeline): once it says stop, the sample in progress and the rest are dropped. `on_made(name, made)`
    is given each written sample (the image, or a video's frames): the trainer's TensorBoard log."""
    modes = {name: module.training for name, module in family.parts.items()}
    for module in family.parts.values():
        module.eval()
    paths = []
    # a pre-hook on the denoiser sees every step of every family's pipeline
    hook = family.parts[family.denoiser_part].register_forward_pre_hook(lambda *_: raise_if_stopping(stop))
    try:
        for index, prompt in enumerate(prompts):
            video = prompt.frames > 1 and family.temporal_quantum is not None
            image = family.sample_video(prompt, device) if video else family.sample(prompt, device)
            if not write:
                continue
            name = names[index] if names else str(index)
            path = Path(out_dir) / f"step{step:07d}-{name}.png"
            if video:  # the .mp4 (or .webp) beside its poster, which is what the run reports
                write_sample_video(path, image, family.video_fps)
            else:
                write_with(path, lambda temp, image=image: image.save(temp, format="PNG"))
            paths.append(path)
            if on_made is not None:
                on_made(name, image)
    except StopRequested:
        pass  # the samples already written stay; the run stops at this boundary
    finally:
        hook.remove()
        for name, module in family.parts.items():
            module.train(modes[name])
    return paths
