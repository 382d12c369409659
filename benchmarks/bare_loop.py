"""The bare LoRA training loop: the trainer's math with nothing extra, as a speed and memory floor.

    python -m benchmarks.bare_loop --model DIR --images DIR --resolution R --steps 40 --batch 2 [--t0 EPOCH_S]

Everything the trainer does per step that is not here (data loader, hooks, guards, events,
logging) shows up as the gap between this loop's timings and the trainer's. Prints one JSON line.
"""

import time

# Fallback start time when the harness gives no --t0: it misses interpreter start-up (~tens of ms),
# but includes the torch/diffusers imports, which the trainer pays too.
_T_MODULE = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import CLIPTextModel, CLIPTokenizer  # noqa: E402

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out", "ff.net")  # attention projections and feed-forward
RANK, ALPHA = 16, 16


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """Resize the short side to `resolution`, center-crop to a square, scale to [-1, 1], CHW."""
    image = Image.open(path).convert("RGB")
    scale = resolution / min(image.size)
    width, height = max(resolution, round(image.width * scale)), max(resolution, round(image.height * scale))
    image = image.resize((width, height), Image.BICUBIC)
    left, top = (width - resolution) // 2, (height - resolution) // 2
    image = image.crop((left, top, left + resolution, top + resolution))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
    return pixels.permute(2, 0, 1)


def add_lora(unet: torch.nn.Module) -> torch.nn.ModuleList:
    """Attach rank-16 LoRA to matching nn.Linear layers through forward hooks; return the LoRA modules."""
    scale = ALPHA / RANK
    modules = torch.nn.ModuleList()
    for name, layer in unet.named_modules():
        if not isinstance(layer, torch.nn.Linear) or not any(t in name for t in LORA_TARGETS):
            continue
        down = torch.nn.Linear(layer.in_features, RANK, bias=False)
        up = torch.nn.Linear(RANK, layer.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(down.weight, a=math.sqrt(5))  # as nn.Linear / peft
        torch.nn.init.zeros_(up.weight)  # the adapter starts as a no-op

        # scaled at rank width, as the trainer's LoRA does: scaling the full-width output instead
        # adds one activation-sized temporary per layer, ~150 MB of peak RSS on the small model,
        # a floor the trainer would beat by 5% (measured at 138d817: 2644 MB against 2522 MB)
        def hook(module, inputs, output, down=down, up=up):
            return output + up(down(inputs[0]) * scale)

        layer.register_forward_hook(hook)
        modules.append(torch.nn.Sequential(down, up))
    return modules


class BareLoop:
    """The loop's state after set-up: the model with LoRA hooked, the encoded data set, the optimizer.
    `step(index)` is one optimizer step on the images at `index`; `batches()` yields the indices of
    each step, epoch after epoch (benchmarks/step_work.py drives the same steps to count their work)."""

    def __init__(self, model: Path, images: Path, resolution: int, batch: int):
        torch.manual_seed(0)
        text_encoder = CLIPTextModel.from_pretrained(model / "text_encoder", dtype=torch.float32, local_files_only=True)
        vae = AutoencoderKL.from_pretrained(model / "vae", torch_dtype=torch.float32, local_files_only=True)
        self.unet = UNet2DConditionModel.from_pretrained(model / "unet", torch_dtype=torch.float32,
                                                         local_files_only=True)
        tokenizer = CLIPTokenizer.from_pretrained(model / "tokenizer", local_files_only=True)
        self.scheduler = DDPMScheduler.from_pretrained(model / "scheduler", local_files_only=True)
        for part in (text_encoder, vae, self.unet):
            part.requires_grad_(False)
        # kept resident, as a trainer that samples keeps them (dropping them would make the bare
        # loop's peak RSS the UNet's alone, and the RSS comparison unfair by their size)
        self.text_encoder, self.vae = text_encoder, vae

        # Encode every image and caption once, up front: the trainer's latent/text cache, in memory.
        paths = sorted(p for p in images.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
        captions = [p.with_suffix(".txt").read_text(encoding="utf-8").strip() for p in paths]
        with torch.no_grad():
            pixels = torch.stack([load_image(p, resolution) for p in paths])
            self.latents = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
            ids = tokenizer(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
            self.hidden = text_encoder(ids)[0]  # last hidden state

        self.lora = add_lora(self.unet)
        self.unet.train()  # no dropout in this UNet, but match a trainer's mode
        self.params = list(self.lora.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=3e-4, weight_decay=0.01)
        self.shuffle = torch.Generator().manual_seed(0)
        self.count, self.batch = len(paths), batch

    def batches(self):
        while True:
            order = torch.randperm(self.count, generator=self.shuffle)
            for start in range(0, len(order) - self.batch + 1, self.batch):  # drop a ragged last batch
                yield order[start:start + self.batch]

    def step(self, index: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns the (detached) loss without reading it back."""
        x0, text = self.latents[index], self.hidden[index]
        noise = torch.randn_like(x0)
        timesteps = torch.randint(0, self.scheduler.config.num_train_timesteps, (x0.shape[0],))
        noisy = self.scheduler.add_noise(x0, noise, timesteps)
        loss = F.mse_loss(self.unet(noisy, timesteps, encoder_hidden_states=text).sample, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--images", required=True, type=Path)
    parser.add_argument("--resolution", type=int, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--t0", type=float, default=None, help="epoch seconds taken by the harness just before spawning")
    args = parser.parse_args()
    t0 = args.t0 if args.t0 is not None else _T_MODULE

    loop = BareLoop(args.model, args.images, args.resolution, args.batch)
    step_ends, losses = [], []
    setup_end_wall = time.time()
    previous = time.perf_counter()
    for index in loop.batches():
        loss = loop.step(index)
        step_ends.append(time.perf_counter())
        losses.append(loss.item())
        if len(step_ends) == 1:
            first_step_end_wall = time.time()
        if len(step_ends) == args.steps:
            break

    durations = [b - a for a, b in zip([previous] + step_ends[:-1], step_ends)]
    later = durations[1:] or durations
    print(json.dumps({
        "steps": [round(d, 5) for d in durations],
        "first_step_end_s": round(first_step_end_wall - t0, 4),
        "setup_s": round(setup_end_wall - t0, 4),  # t0 to the first step's start: imports, loads, caching
        "median_step_s": round(statistics.median(later), 5),
        "mean_step_s": round(statistics.fmean(later), 5),
        "min_step_s": round(min(later), 5),  # the least disturbed step, when the box is shared
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "lora_params": sum(p.numel() for p in loop.params),
        "lora_layers": len(loop.lora),
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
