"""Qwen-Image-Edit (Qwen/Qwen-Image-Edit): Qwen-Image's transformer and VAE (qwen_image.py), conditioned
on a control image twice, as QwenImageEditPipeline (diffusers 0.42, pipeline_qwenimage_edit.py) does:

- the text encoder is the whole Qwen2.5-VL (vision tower and language model; no lm_head): the prompt
  template asks it to describe the input image and apply the instruction, and the control image sits
  in the user turn as `<|vision_start|><|image_pad|><|vision_end|>`, the pad token repeated once per
  merged 2x2 patch of the image (what Qwen2VLProcessor does: image grid t*h*w / merge_size^2 tokens;
  done here with the tokenizer and Qwen2VLImageProcessorPil, as that processor needs torchvision).
  The conditioning is the last hidden states of the real tokens less the template's first 64 (its
  system line and user header): the image tokens and the caption, zero-padded to the image tokens
  plus `max_sequence_length` caption tokens (fixed per bucket, so a batch of one bucket stacks).
- the control's VAE latents are packed into 2x2 patches like the target's and concatenated after
  them along the sequence, `img_shapes` listing the target's grid and then each control's; the
  transformer's output is cut back to the target's tokens, so the loss is on the target alone.
  A transformer with `zero_cond_t` (Qwen-Image-Edit-2511) gives the control tokens timestep 0 itself.

Training shows the control at its target's bucket (modules/data/pairs.py) to both the VAE and the VL
encoder; the pipeline resizes the control to ~1 MP first, which a 1024 px bucket matches. Because the
text conditioning depends on the control image, it is cached per (caption, control images, bucket,
mirrored or not): pairs.py keys the text cache on the controls' contents, and a mirrored pair gets
its own encoding of the mirrored control. Where the text is not cached (a trained text encoder,
embeddings, varying captions), each batch carries its controls as the encoder is shown them
(Batch.text_controls) and the step's tokenize takes them.

Sampling: `sampling.prompts[].control_images` are fitted to the sample's size (covered and
centre-cropped, as training brings a control to its target's bucket) and shown to both encoders at
that size, with true CFG against the negative prompt (empty if none) with the same images, as the
pipeline does; the loop is the pipeline's (its scheduler shift, noise draw, CFG norm rescale and
decode) run here, because the pipeline always resizes the control to ~1 MP. A prompt without a
control image conditions on the text alone (the template without the image block).
Adapter keys, single files and consumers are Qwen-Image's: an Edit LoRA is a Qwen-Image LoRA for
ComfyUI (one QwenImage model class for both) and for QwenImageEditPipeline.load_lora_weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from modules.config.families.qwen_image_edit import DECLARATION
from modules.errors import UserError
from modules.loading.diffusers_folder import ModelLoadError
from modules.model.flux import pack_latents, unpack_latents
from modules.model.qwen_image import MAX_TEXT_TOKENS, QwenImageFamily, latent_normalisation
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator

# QwenImageEditPipeline.prompt_template_encode, with the image block taken out into image_prompt()
SYSTEM_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
EDIT_TEMPLATE = SYSTEM_PREFIX + "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_TOKENS_DROPPED = 64  # prompt_template_encode_start_idx
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def _vl_key(key: str) -> str:
    """A Qwen2_5_VLForConditionalGeneration checkpoint key as Qwen2_5_VLModel names it: transformers 5
    files keep `model.visual.` and `model.language_model.`, transformers 4 files `visual.` and `model.`."""
    if key.startswith(("model.visual.", "model.language_model.")):
        return key.removeprefix("model.")
    if key.startswith("model."):
        return "language_model." + key.removeprefix("model.")
    return key


def open_control(path: str | Path, width: int, height: int):
    """A sample's control image as both encoders see it: covered to width x height and centre-cropped
    (as pairs.py brings a training control to its target's bucket)."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except (OSError, ValueError) as error:
        raise UserError(f"sampling: control image {path} cannot be read ({error})") from None
    return ImageOps.fit(image, (width, height), Image.Resampling.LANCZOS)


def pixels_of(image) -> torch.Tensor:
    """(3, H, W) in [-1, 1], as the data pipeline hands images to encode_images."""
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()


class QwenImageEditFamily(QwenImageFamily):
    declaration = DECLARATION
    pipeline_classes = ("QwenImageEditPipeline",)
    single_file_signature = None  # an Edit file holds Qwen-Image's tensors: name the family (model.family)
    modelspec_architecture = "qwen-image-edit/lora"
    text_sees_controls = True
    # Qwen2.5-VL-7B less its lm_head (8.29 B - 0.55 B): the vision tower is loaded too
    nominal_part_parameters = {**QwenImageFamily.nominal_part_parameters, "text_encoder": 7_747_103_744}

    released_configs_of = "qwen_image"  # the same parts

    def load(self) -> None:
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLModel
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.parts["text_encoder"] = self.load_part("text_encoder", Qwen2_5_VLModel, rename=_vl_key,
                                                    ignore_unexpected=[r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", QwenImageTransformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLQwenImage)
        self.load_flow_scheduler()
        folder = self.support_folder("tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        # the image half of the pipeline's Qwen2VLProcessor (its preprocessor_config.json)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(self.support_folder("processor")),
                                                                        local_files_only=True)
        self._check_edit_template(folder)

    def _check_edit_template(self, folder) -> None:
        count = len(self.tokenizer(SYSTEM_PREFIX, add_special_tokens=False).input_ids)
        pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if count != EDIT_TOKENS_DROPPED or pad is None or pad == self.tokenizer.unk_token_id:
            raise ModelLoadError(
                f"model.base: the tokenizer in {folder} splits {self.label}'s system prompt into {count} tokens "
                f"(the pipeline drops {EDIT_TOKENS_DROPPED}) or has no {IMAGE_PAD} token: not Qwen2.5-VL's tokenizer")

    @property
    def max_sequence_length(self) -> int:
        """Caption tokens kept after the template's drop and the image tokens."""
        return min(self.tokenizer.model_max_length - EDIT_TOKENS_DROPPED, MAX_TEXT_TOKENS)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "text_encoder":
            return list(self.parts[part].language_model.layers)
        return super().checkpoint_blocks(part)

    # --- text: the caption with its control images ------------------------------------------------

    def image_prompt(self, count: int) -> str:
        """The template's image block for `count` control images (QwenImageEditPipeline: one)."""
        return IMAGE_BLOCK if count else ""

    def vl_images(self, images: list) -> list:
        """The control images as the VL encoder is shown them (Edit: as given, at the bucket's size)."""
        return images

    def vl_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the VL encoder is shown a control of this size at (as vl_images does)."""
        return width, height

    def _vl_processor(self):
        """The loaded image processor; planning a folder without one: the class's defaults (14 px
        patches, 2x2 merge, what the released processor/ folders hold)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return getattr(self, "image_processor", None) or Qwen2VLImageProcessorPil()

    def _expanded_image_prompt(self, per_image: list[int]) -> str:
        """The template's image block for these controls, each pad token repeated once per merged patch."""
        pieces = self.image_prompt(len(per_image)).split(IMAGE_PAD)
        return pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(per_image, pieces[1:]))

    def image_block_tokens(self, controls: int, width: int, height: int) -> int:
        """The tokens the image block of `controls` controls at width x height adds to the conditioning:
        the tokenizer's count where one is loaded, else the pad tokens and each image's two vision
        markers, its "Picture N:" label (Plus) counted as its characters at most."""
        processor = self._vl_processor()
        shown_width, shown_height = self.vl_size(width, height)
        pads = processor.get_number_of_image_patches(shown_height, shown_width) // processor.merge_size ** 2
        prompt = self._expanded_image_prompt([pads] * controls)
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is not None:
            return len(tokenizer(prompt, add_special_tokens=False).input_ids)
        labels = prompt.replace(IMAGE_PAD, "").replace("<|vision_start|>", "").replace("<|vision_end|>", "")
        return controls * (pads + 2) + len(labels)

    def tokenize(self, captions: list[str], controls: list[list] | None = None) -> dict[str, torch.Tensor]:
        """Token ids of each caption in the edit template with its control images (PIL, one list per
        caption, the same count and sizes for all: one bucket); their pixel patches and grids."""
        controls = controls or [[] for _ in captions]
        count = len(controls[0])
        tokens: dict[str, torch.Tensor] = {}
        prompt = self.image_prompt(count)
        if count:
            shown = [image for row in controls for image in self.vl_images(row)]
            processed = self.image_processor(images=shown, return_tensors="pt")
            grids = processed["image_grid_thw"]
            merge = self.image_processor.merge_size ** 2
            per_image = [int(grid.prod()) // merge for grid in grids[:count]]  # the same in every row
            prompt = self._expanded_image_prompt(per_image)
            tokens = {"pixel_values": processed["pixel_values"], "image_grid_thw": grids}
        # the image block (its tokens and, for Plus, the "Picture N:" labels) comes on top of the caption's budget
        image_tokens = len(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        texts = [EDIT_TEMPLATE.format(prompt + c) for c in captions]
        encoded = self.tokenizer(texts, padding="max_length", truncation=True, padding_side="right",
                                 max_length=EDIT_TOKENS_DROPPED + image_tokens + self.max_sequence_length,
                                 return_tensors="pt")
        return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask, **tokens}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        device = compute_device(encoder)
        mask = tokens["attention_mask"].to(device)
        images = {}
        if "pixel_values" in tokens:
            images = {"pixel_values": tokens["pixel_values"].to(device, self.compute_dtype("text_encoder")),
                      "image_grid_thw": tokens["image_grid_thw"].to(device)}
        hidden = encoder(input_ids=tokens["input_ids"].to(device), attention_mask=mask, **images,
                         use_cache=False).last_hidden_state  # no KV cache: a checkpointed layer recomputes
        # as QwenImageEditPipeline._get_qwen_prompt_embeds: the real tokens past the template's first 64
        # (image tokens and caption), at the front, zero-padded to a length fixed by the image tokens.
        # tokenize pads on the right, so they are already at the front past the drop: a slice and the
        # mask select them (no selection by value: the planner runs this on tensors without data)
        kept_mask = mask[:, EDIT_TOKENS_DROPPED:].contiguous()
        embeds = torch.where(kept_mask.bool().unsqueeze(-1), hidden[:, EDIT_TOKENS_DROPPED:], 0)
        return {"hidden_states": embeds, "attention_mask": kept_mask}

    def planning_tokens(self, batch, device):
        # a caption without control images
        length = EDIT_TOKENS_DROPPED + self.planning_length(MAX_TEXT_TOKENS)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_tokens_with_controls(self, batch, device, controls, width, height):
        # a caption with its controls' image block as plain tokens of the same count: the language model's
        # pass over the same sequence, which holds what the backward keeps (their pixel patches and the VL
        # model's image positions need real values, which the planner has not; the vision tower's pass,
        # whose activations no gradient keeps, is left out)
        if not controls:
            return self.planning_tokens(batch, device)
        length = EDIT_TOKENS_DROPPED + self.planning_length(MAX_TEXT_TOKENS) + self.image_block_tokens(
            controls, width, height)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        return self.planning_conditioning_with_controls(batch, device, 0, 0, 0)

    def planning_conditioning_with_controls(self, batch, device, controls, width, height):
        # the caption window and, on top, the controls' image block (their tokens depend on the bucket)
        length = self.planning_length(MAX_TEXT_TOKENS) + (self.image_block_tokens(controls, width, height)
                                                           if controls else 0)
        width = self.parts["text_encoder"].config.text_config.hidden_size
        return {"hidden_states": torch.empty(batch, length, width, dtype=self.compute_dtype("text_encoder"),
                                             device=device),
                "attention_mask": torch.empty(batch, length, dtype=torch.long, device=device)}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity for (B, C, H, W) latents; `text["control_latents"]` (B, N, C, h, w), when the
        samples have control images, joins the sequence after the target's tokens."""
        controls = text.get("control_latents")
        if controls is None:  # no control: the text alone (img_shapes nested all the same: zero_cond_t reads them so)
            controls = noisy.new_zeros(noisy.shape[0], 0, *noisy.shape[1:])
        dtype = self.compute_dtype("transformer")
        batch, _, height, width = noisy.shape
        target = pack_latents(noisy)
        tokens, shapes = [target], [(1, height // 2, width // 2)]
        for index in range(controls.shape[1]):
            control = controls[:, index].to(noisy.device, noisy.dtype)
            tokens.append(pack_latents(control))
            shapes.append((1, control.shape[-2] // 2, control.shape[-1] // 2))
        out = self.transformer(
            hidden_states=torch.cat(tokens, dim=1).to(dtype), timestep=sigmas.to(dtype),
            encoder_hidden_states=text["hidden_states"].to(dtype),
            encoder_hidden_states_mask=text["attention_mask"].to(noisy.device).bool(),
            img_shapes=[shapes] * batch, return_dict=False,
        )[0]
        return unpack_latents(out[:, :target.shape[1]], height, width)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        """QwenImageEditPipeline on the live modules (for its helpers; no processor: see run_sampling_pipeline)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

        return self._edit_pipeline(QwenImageEditPipeline, FlowMatchEulerDiscreteScheduler)

    def _edit_pipeline(self, cls, scheduler_cls):
        pipe = cls(scheduler=scheduler_cls.from_config(self.noise_scheduler.config), vae=self.parts["vae"],
                   text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer, processor=None,
                   transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _sample_text(self, prompt: str, images: list, device) -> dict[str, torch.Tensor]:
        text = self.encode_text(self.tokenize([self.written_out_prompt(prompt)], [images] if images else None))
        return {"hidden_states": text["hidden_states"].to(device, self.sampling_dtype("transformer")),
                "attention_mask": text["attention_mask"].to(device)}

    @torch.no_grad()
    def run_sampling_pipeline(self, prompt, device):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift, retrieve_timesteps
        from diffusers.utils.torch_utils import randn_tensor
        import numpy as np

        if len(prompt.control_images) > self.control_images:
            raise UserError(f"sampling: {len(prompt.control_images)} control images given "
                            f"({', '.join(prompt.control_images)}); {self.label} takes {self.control_images}")
        images = [open_control(path, prompt.width, prompt.height) for path in prompt.control_images]
        text = self._sample_text(prompt.prompt, images, device)
        negative = self._sample_text(prompt.negative_prompt or "", images, device) if prompt.cfg > 1 else None
        dtype = self.sampling_dtype("transformer")
        if images:
            pixels = torch.stack([pixels_of(image) for image in images]).to(device)
            text["control_latents"] = self.encode_images(pixels).unsqueeze(0)
            if negative is not None:
                negative["control_latents"] = text["control_latents"]
        vae = self.parts["vae"]
        scale = 2 ** len(vae.temperal_downsample)
        height, width = prompt.height // (scale * 2) * 2, prompt.width // (scale * 2) * 2
        # the pipeline's draw: (B, 1, C, h, w) noise in the embeddings' dtype, packed
        noise = randn_tensor((1, 1, vae.config.z_dim, height, width), generator=make_generator(device, prompt.seed),
                             device=device, dtype=dtype)
        latents = noise[:, 0]
        scheduler = type(self.noise_scheduler).from_config(self.noise_scheduler.config)
        config = scheduler.config
        mu = calculate_shift((height // 2) * (width // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / prompt.steps, prompt.steps)
        timesteps, _ = retrieve_timesteps(scheduler, prompt.steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        for t in timesteps:
            sigma = (t / 1000).expand(1).to(dtype)
            velocity = pack_latents(self.denoise(latents, sigma, text).to(dtype))
            if negative is not None:  # true CFG with the pipeline's norm rescale
                uncond = pack_latents(self.denoise(latents, sigma, negative).to(dtype))
                combined = uncond + prompt.cfg * (velocity - uncond)
                velocity = combined * (velocity.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
            packed = scheduler.step(velocity, t, pack_latents(latents), return_dict=False)[0]
            latents = unpack_latents(packed, height, width)
        decoded = latents.unsqueeze(2).to(vae.dtype)
        mean, std = latent_normalisation(vae, decoded)
        image = vae.decode(decoded * std + mean, return_dict=False)[0][:, :, 0]
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=scale * 2).postprocess(image.float(), output_type="pil")[0]
