"""Z-Image (Tongyi-MAI): a Qwen3 text encoder (its chat-templated prompt, the penultimate hidden
states of the prompt's real tokens), ZImageTransformer2DModel (single-stream DiT over 2x2
patches; noise and caption refiners, then the main layers), the FLUX.1 VAE with its shift and
scale; rectified-flow training. The transformer's timestep is 1 - sigma and its output is the
negative flow velocity (as ZImagePipeline reads it); predict() returns the velocity, so the
target is noise - latents as for Flux.

Adapter key names follow ComfyUI's Z-Image (Lumina2 / NextDiT) model, whose attention is one fused
`attention.qkv` (kohya files stack q/k/v there; the comfy format uses ComfyUI's diffusers-name
keys): declared, with their sources, in modules/model/keys/z_image.py.
"""

from __future__ import annotations

import torch

from modules.config.families.z_image import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.components.vae import encode_latents, load_vae
from modules.model.keys.z_image import Z_IMAGE_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


def _text_encoder_key(key: str) -> str:
    # a Qwen3ForCausalLM export keeps its `model.` level; the encoder is the Qwen3Model inside
    return key.removeprefix("model.")


class ZImageFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("ZImagePipeline",)
    denoiser_config = {"_class_name": "ZImageTransformer2DModel"}
    single_file_signature = (r"^(model\.diffusion_model\.)?(noise_refiner|context_refiner)\.", None)
    kohya_base_version = "z_image"
    batched_guidance_above = 0.0  # ZImagePipeline batches cond and uncond for any guidance above 0
    modelspec_architecture = "z-image/lora"
    key_layout = Z_IMAGE_KEYS
    penultimate_blocks = {"text_encoder": "layers"}  # Qwen3 is read at hidden_states[-2]
    nominal_part_parameters = {"text_encoder": 4_022_468_096, "transformer": 6_154_908_736, "vae": 83_819_683}
    text_parts = ("text_encoder",)
    image_parts = ("vae",)
    embedding_slots = {"text_encoder": ("tokenizer", "qwen3_4b")}  # ComfyUI's Z-Image embedding key
    # the final projection (and its modulation) stays dense, as `final_layer` does in other DiTs
    quantize_skip_patterns = {"transformer": (r"^all_final_layer\.",)}

    def load(self) -> None:
        from diffusers import ZImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen3Model

        self.parts["text_encoder"] = self.load_part("text_encoder", Qwen3Model, rename=_text_encoder_key,
                                                    ignore_unexpected=[r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", ZImageTransformer2DModel)
        self.parts["vae"] = load_vae(self)
        self.load_flow_scheduler()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)

    def single_file_part(self, part: str):
        # ComfyUI / original Z-Image transformer files (fused q/k/v); text encoder and VAE ship apart
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        if part != "transformer":
            return None
        return SingleFilePart(
            ("model.diffusion_model.", "layers.", "noise_refiner.", "context_refiner.", "x_embedder.",
             "final_layer.", "t_embedder.", "cap_embedder.", "x_pad_token", "cap_pad_token", "norm_final."),
            lambda sd, model: convert.convert_z_image_transformer_checkpoint_to_diffusers(sd))

    @property
    def transformer(self):
        return self.parts["transformer"]

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer.model_max_length, 512)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":  # in the order forward() runs them
            return [*self.transformer.noise_refiner, *self.transformer.context_refiner, *self.transformer.layers]
        if part == "text_encoder":
            return list(self.parts[part].layers)
        return []

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_latents(self.parts["vae"], pixels, self.compute_dtype("vae"), shifted=True)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        # as ZImagePipeline._encode_prompt: the caption as a user turn, with the generation prompt
        prompts = [self.tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=True)
                   for caption in captions]
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(compute_device(encoder))
        # (no KV cache: a checkpointed layer recomputed in the backward would append to it a second time)
        hidden = encoder(input_ids=tokens["input_ids"].to(compute_device(encoder)), attention_mask=mask.bool(),
                         output_hidden_states=True, use_cache=False).hidden_states[-2]
        # padded to a fixed length so captions batch and cache; the mask picks the real tokens
        return {"hidden_states": hidden, "attention_mask": mask}

    def planning_tokens(self, batch, device):
        length = self.planning_length(512)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(512)
        return {"hidden_states": torch.empty(batch, length, self.parts["text_encoder"].config.hidden_size,
                                             dtype=self.compute_dtype("text_encoder"), device=device),
                "attention_mask": None}  # every token real: a boolean mask's selection has no fake shape

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) the transformer predicts for (B, C, H, W) latents."""
        dtype = self.compute_dtype("transformer")
        masks = text["attention_mask"]
        captions = [(h if masks is None else h[masks[i].bool()]).to(dtype) for i, h in enumerate(text["hidden_states"])]
        out = self.transformer(list(noisy.to(dtype).unsqueeze(2).unbind(0)), (1 - sigmas).to(dtype), captions,
                               return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

        pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
                              vae=self.parts["vae"], text_encoder=self.parts["text_encoder"],
                              tokenizer=self.tokenizer, transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        generator = make_generator(device, prompt.seed)
        return self.pipeline()(
            prompt=self.written_out_prompt(prompt.prompt),
            negative_prompt=self.written_out_prompt(prompt.negative_prompt) or None,
            num_inference_steps=prompt.steps, guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=generator, max_sequence_length=self.max_sequence_length,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/z_image.py) ---

    # diffusers' Z-Image converter reads these original names as no module (it knows only
    # `all_x_embedder`/`all_final_layer`): from a kohya file it loads the rest
    _DIFFUSERS_DROPS = ("all_x_embedder.", "all_final_layer.")

    def unstacked_kohya_stem(self, part: str, module_name: str) -> str | None:
        # ComfyUI has no `lora_unet_` name for one of q/k/v (they are one layer there)
        return self.comfy_module_name(part, module_name) if part == "transformer" else None

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            return ("ZImagePipeline.load_lora_weights loads the transformer's adapters only "
                    "(model.parts.text_encoder.train)")
        if stacked and module_name.startswith(self._DIFFUSERS_DROPS):
            return ("its Z-Image converter has no module for the original names of the embedder and final layer "
                    "(adapter.layer_preset 'attn' or 'attn-mlp' avoids them)")
        return None
