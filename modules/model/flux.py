"""FLUX.1 (dev / schnell): CLIP-L pooled embedding + T5 sequence, FluxTransformer2DModel on packed
2x2 latent patches with image/text position ids, guidance embedding (dev), 16-channel VAE with
shift and scale; rectified-flow training (target = noise - latents) with logit-normal sigmas
shifted by the image's sequence length as the model's scheduler config says.

Adapter key names (kohya layout): LoRA on the transformer is written as kohya's sd-scripts
writes FLUX files, on the original layers (`lora_unet_double_blocks_0_img_attn_qkv`,
`lora_unet_single_blocks_0_linear1`, ...; q/k/v(/mlp) stacked block-diagonally into one LoRA,
formats/fused.py): the one transformer layout diffusers' `load_lora_weights` converts for every
layer (its converter for OneTrainer's `lora_transformer_<diffusers module>` names knows attention
layers only), and ComfyUI and Forge read it too. Other algorithms keep the per-module
`lora_transformer_...` names (ComfyUI, Forge). Text encoders: `lora_te1_...` (CLIP-L),
`lora_te2_...` (T5, OneTrainer's name, which ComfyUI maps for FLUX). ComfyUI's own layout fuses
q/k/v as these names do, so output.format `comfy` writes this kohya layout (file_layout). The
layout is declared in modules/model/keys/flux.py.
"""

from __future__ import annotations

import torch

from modules.config.families.flux import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.clip import (
    clip_encoder_layers,
    clip_window,
    ldm_clip_single_file,
    load_clip_text_encoder,
    load_clip_tokenizer,
)
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.components.vae import encode_latents, ldm_vae_single_file, load_vae
from modules.model.keys.flux import FLUX_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


TRAINING_GUIDANCE = 1.0  # the guidance embedding's input while training dev (kohya's and OneTrainer's default)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4): the transformer's 2x2 patches."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    b, _, d = packed.shape
    c = d // 4
    return packed.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def image_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of the packed latent patches: (0, row, column)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device, dtype)


def flux_transformer_to_diffusers(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original (BFL / ComfyUI) FLUX.1 transformer layout -> diffusers' names: what diffusers'
    convert_flux_transformer_checkpoint_to_diffusers does, with the widths read from the tensors
    instead of fixed at the released 3072 (so any size converts; tests compare the two on the
    released shapes). Keys it does not know are passed through, for the strict load to name."""
    state = {k.removeprefix("model.diffusion_model."): v for k, v in checkpoint.items()}
    out: dict[str, torch.Tensor] = {}

    def take(source: str, target: str) -> None:
        for attr in ("weight", "bias"):
            if f"{source}.{attr}" in state:
                out[f"{target}.{attr}"] = state.pop(f"{source}.{attr}")

    def norm(source: str, target: str) -> None:
        if f"{source}.scale" in state:
            out[f"{target}.weight"] = state.pop(f"{source}.scale")

    def split(source: str, targets: list[str], sizes: list[int]) -> None:
        for attr in ("weight", "bias"):
            if f"{source}.{attr}" in state:
                for target, piece in zip(targets, torch.split(state.pop(f"{source}.{attr}"), sizes, dim=0)):
                    out[f"{target}.{attr}"] = piece

    take("img_in", "x_embedder")
    take("txt_in", "context_embedder")
    for source, target in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                           ("guidance_in", "guidance_embedder")):
        take(f"{source}.in_layer", f"time_text_embed.{target}.linear_1")
        take(f"{source}.out_layer", f"time_text_embed.{target}.linear_2")
    for i in sorted({int(k.split(".")[1]) for k in state if k.startswith("double_blocks.")}):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        take(f"{b}.img_mod.lin", f"{d}.norm1.linear")
        take(f"{b}.txt_mod.lin", f"{d}.norm1_context.linear")
        inner = state[f"{b}.img_attn.proj.weight"].shape[0]
        split(f"{b}.img_attn.qkv", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"], [inner] * 3)
        split(f"{b}.txt_attn.qkv", [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"],
              [inner] * 3)
        norm(f"{b}.img_attn.norm.query_norm", f"{d}.attn.norm_q")
        norm(f"{b}.img_attn.norm.key_norm", f"{d}.attn.norm_k")
        norm(f"{b}.txt_attn.norm.query_norm", f"{d}.attn.norm_added_q")
        norm(f"{b}.txt_attn.norm.key_norm", f"{d}.attn.norm_added_k")
        take(f"{b}.img_attn.proj", f"{d}.attn.to_out.0")
        take(f"{b}.txt_attn.proj", f"{d}.attn.to_add_out")
        take(f"{b}.img_mlp.0", f"{d}.ff.net.0.proj")
        take(f"{b}.img_mlp.2", f"{d}.ff.net.2")
        take(f"{b}.txt_mlp.0", f"{d}.ff_context.net.0.proj")
        take(f"{b}.txt_mlp.2", f"{d}.ff_context.net.2")
    for i in sorted({int(k.split(".")[1]) for k in state if k.startswith("single_blocks.")}):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        take(f"{b}.modulation.lin", f"{d}.norm.linear")
        inner = state[f"{b}.linear2.weight"].shape[0]
        mlp = state[f"{b}.linear1.weight"].shape[0] - 3 * inner
        split(f"{b}.linear1", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"],
              [inner, inner, inner, mlp])
        norm(f"{b}.norm.query_norm", f"{d}.attn.norm_q")
        norm(f"{b}.norm.key_norm", f"{d}.attn.norm_k")
        take(f"{b}.linear2", f"{d}.proj_out")
    take("final_layer.linear", "proj_out")
    for attr in ("weight", "bias"):  # the original's (shift, scale) is diffusers' (scale, shift)
        key = f"final_layer.adaLN_modulation.1.{attr}"
        if key in state:
            shift, scale = state.pop(key).chunk(2, dim=0)
            out[f"norm_out.linear.{attr}"] = torch.cat([scale, shift], dim=0)
    out.update(state)
    return out


class FluxFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("FluxPipeline",)
    denoiser_config = {"_class_name": "FluxTransformer2DModel"}
    # a Chroma file has the same blocks, and its distilled guidance layer (chroma.py); a FLUX.2 file
    # its shared modulations (flux2.py)
    single_file_signature = (r"^(model\.diffusion_model\.)?double_blocks\.",
                             r"^(model\.diffusion_model\.)?(distilled_guidance_layer|single_stream_modulation)\.")
    kohya_base_version = "flux1"
    modelspec_architecture = "flux-1-dev/lora"
    key_layout = FLUX_KEYS
    nominal_part_parameters = {"text_encoder": 123_060_480, "text_encoder_2": 4_893_906_944,
                               "transformer": 11_901_408_320, "vae": 83_819_683}
    text_parts = ("text_encoder", "text_encoder_2")
    image_parts = ("vae",)
    # ComfyUI's FLUX tokenizers read embedding files under these keys (its flux.py / sd1_clip.py)
    embedding_slots = {"text_encoder": ("tokenizer", "clip_l"), "text_encoder_2": ("tokenizer_2", "t5xxl")}

    def load(self) -> None:
        from diffusers import FluxTransformer2DModel
        from transformers import AutoTokenizer, T5EncoderModel

        self.parts["text_encoder"] = load_clip_text_encoder(self, "text_encoder")
        self.parts["text_encoder_2"] = self.load_part("text_encoder_2", T5EncoderModel,
                                                      ignore_unexpected=[r"^decoder\.", r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", FluxTransformer2DModel)
        self.parts["vae"] = load_vae(self)
        self.load_flow_scheduler()
        self.tokenizer = load_clip_tokenizer(self)
        self.tokenizer_2 = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer_2")),
                                                         local_files_only=True)

    def single_file_part(self, part: str):
        # BFL / ComfyUI files: the transformer (bare or under model.diffusion_model.); ComfyUI's
        # all-in-one checkpoints also carry vae., text_encoders.clip_l. and text_encoders.t5xxl.
        from diffusers.loaders import single_file_utils as convert

        from modules.loading.single_file import SingleFilePart

        return {
            "transformer": SingleFilePart(
                ("model.diffusion_model.", "double_blocks.", "single_blocks.", "img_in.", "txt_in.", "time_in.",
                 "vector_in.", "guidance_in.", "final_layer."),
                lambda sd, model: flux_transformer_to_diffusers(sd)),
            "vae": ldm_vae_single_file("vae."),
            "text_encoder": ldm_clip_single_file("text_encoders.clip_l.transformer.",
                                                 remove_prefix="text_encoders.clip_l.transformer."),
            "text_encoder_2": SingleFilePart(("text_encoders.t5xxl.transformer.",),
                                             lambda sd, model: convert.convert_sd3_t5_checkpoint_to_diffusers(sd)),
        }.get(part)

    @property
    def transformer(self):
        return self.parts["transformer"]

    def caption_windows(self) -> list[tuple[object, int]]:
        return [(self.tokenizer_2, self.max_sequence_length)]  # T5 reads up to here (CLIP: pooled)

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer_2.model_max_length, 512)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]
        if part == "text_encoder":
            return clip_encoder_layers(self.parts[part])
        if part == "text_encoder_2":
            return list(self.parts[part].encoder.block)
        return []

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_latents(self.parts["vae"], pixels, self.compute_dtype("vae"), shifted=True)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        clip = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids
        t5 = self.tokenizer_2(captions, padding="max_length", max_length=self.max_sequence_length,
                              truncation=True, return_tensors="pt").input_ids
        return {"input_ids": clip, "input_ids_2": t5}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # as FluxPipeline.encode_prompt: CLIP's pooled output, T5's last hidden states
        clip, t5 = self.parts["text_encoder"], self.parts["text_encoder_2"]
        pooled = clip(tokens["input_ids"].to(compute_device(clip)), output_hidden_states=False).pooler_output
        hidden = t5(tokens["input_ids_2"].to(compute_device(t5)), output_hidden_states=False)[0]
        return {"pooled": pooled, "hidden_states": hidden}

    def planning_tokens(self, batch, device):
        clip = clip_window(getattr(self, "tokenizer", None), self.parts["text_encoder"])
        return {"input_ids": self.planning_ids(batch, clip, device),
                "input_ids_2": self.planning_ids(batch, self.planning_length(512), device)}

    def planning_conditioning(self, batch, device):
        clip, t5 = self.parts["text_encoder"], self.parts["text_encoder_2"]
        return {"pooled": torch.empty(batch, clip.config.hidden_size, dtype=self.compute_dtype("text_encoder"),
                                      device=device),
                "hidden_states": torch.empty(batch, self.planning_length(512), t5.config.d_model,
                                             dtype=self.compute_dtype("text_encoder_2"), device=device)}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction for (B, C, H, W) latents at `sigmas`."""
        height, width = noisy.shape[-2:]
        ids = image_ids(height, width, noisy.device, self.compute_dtype("transformer"))
        return unpack_latents(self.run_transformer(pack_latents(noisy), ids, sigmas, text), height, width)

    def run_transformer(self, packed: torch.Tensor, ids: torch.Tensor, sigmas: torch.Tensor,
                        text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer on packed image tokens (B, L, C * 4) with their position ids (L, 3)."""
        dtype = self.compute_dtype("transformer")
        hidden = text["hidden_states"].to(dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((packed.shape[0],), TRAINING_GUIDANCE, device=packed.device, dtype=torch.float32)
        return self.transformer(
            hidden_states=packed.to(dtype), timestep=sigmas.to(dtype), guidance=guidance,
            pooled_projections=text["pooled"].to(dtype), encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, device=packed.device, dtype=dtype),
            img_ids=ids.to(dtype), return_dict=False,
        )[0]

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            text_encoder_2=self.parts["text_encoder_2"], tokenizer_2=self.tokenizer_2, transformer=self.transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        generator = make_generator(device, prompt.seed)
        return self.pipeline()(
            prompt=prompt.prompt, num_inference_steps=prompt.steps, guidance_scale=prompt.cfg,
            width=prompt.width, height=prompt.height, generator=generator,
            max_sequence_length=self.max_sequence_length,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/flux.py) ------

    # diffusers' kohya-FLUX converter keys these layers' LoRAs without the `transformer.` prefix,
    # so load_lora_weights drops them (diffusers 0.42)
    _DIFFUSERS_DROPS = ("x_embedder", "context_embedder", "time_text_embed.", "proj_out", "norm_out.")

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder_2":
            return "FluxPipeline.load_lora_weights loads no T5 adapters (model.parts.text_encoder_2.train)"
        if stacked and module_name.startswith(self._DIFFUSERS_DROPS):
            return ("its kohya-FLUX converter drops the embedders and the final layer (adapter.layer_preset 'attn' "
                    "or 'attn-mlp' avoids them; output.format 'diffusers' keeps them)")
        return None
