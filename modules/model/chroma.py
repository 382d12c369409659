"""Chroma (lodestones/Chroma1-HD, ...): FLUX.1-schnell's transformer pruned of its per-block
modulation layers. One T5-XXL encoder (no CLIP, no pooled vector, no guidance embedding); a
"distilled guidance layer" (ChromaApproximator) turns the timestep into every block's modulation;
16-channel FLUX.1 VAE; packed 2x2 latent patches and rectified-flow training as FLUX.1 (target =
noise - latents, logit-normal sigmas shifted as the scheduler config shifts, by the sequence
length).

Padding: as ChromaPipeline._get_t5_prompt_embeds, T5 runs with the tokenizer's attention mask,
and the transformer attends to the real tokens, the end token and the first padding token only.
diffusers' pipeline hands that mask on as 0/1 floats, which scaled_dot_product_attention adds to
the scores rather than masking (a prompt's image then depends on how far it is padded); this
family passes it as booleans, in training and to the pipeline when sampling, so more padding
changes nothing (tests/test_family_chroma.py).

Adapter key names (modules/model/keys/chroma.py): kohya files on the original layers as for
FLUX.1 (`lora_unet_double_blocks_0_img_attn_qkv`, ...), the T5 encoder as `lora_te1_` (ComfyUI's
number for a T5 with no CLIP beside it); diffusers files as `transformer.<module>` /
`text_encoder.<module>`; ChromaPipeline (FluxLoraLoaderMixin) loads the transformer's for every
layer and refuses T5 adapters (its text-encoder loader knows CLIP's names only), which the run
says before training.
"""

from __future__ import annotations

import torch

from modules.config.families.chroma import DECLARATION
from modules.model.base import ModelFamily
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.components.vae import encode_latents, load_vae
from modules.model.flux import flux_transformer_to_diffusers, image_ids, pack_latents, unpack_latents
from modules.model.keys.chroma import CHROMA_KEYS
from modules.util.compute_device import compute_device
from modules.util.torch_utils import make_generator


def transformer_text_mask(tokenizer_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) tokenizer attention mask -> the (B, L) bool mask of the text tokens the transformer
    attends to: the real ones (with the end token) and the first padding token, as
    ChromaPipeline._get_t5_prompt_embeds (`mask_indices <= seq_lengths`)."""
    lengths = tokenizer_mask.sum(dim=1, keepdim=True)
    return torch.arange(tokenizer_mask.shape[1], device=tokenizer_mask.device)[None, :] <= lengths


def chroma_transformer_to_diffusers(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original (lodestone's / ComfyUI's) Chroma transformer layout -> diffusers' names: what
    diffusers' convert_chroma_transformer_checkpoint_to_diffusers does, with the widths read from the
    tensors instead of fixed at the released 3072 (tests compare the two on the released shapes).
    The blocks and embedders are FLUX's; the distilled guidance layer renames its MLPs and norms."""
    state = {k.removeprefix("model.diffusion_model."): v for k, v in checkpoint.items()}
    approximator = "distilled_guidance_layer."
    renamed = {}
    for key in [k for k in state if k.startswith(approximator)]:
        new = (key.replace(".in_layer.", ".linear_1.").replace(".out_layer.", ".linear_2.")
               .removesuffix(".scale") + (".weight" if key.endswith(".scale") else ""))
        renamed[new] = state.pop(key)
    return {**flux_transformer_to_diffusers(state), **renamed}


class ChromaFamily(FlowMatchingTraining, ModelFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/
    pipeline_classes = ("ChromaPipeline",)
    denoiser_config = {"_class_name": "ChromaTransformer2DModel"}
    # the original transformer has FLUX's blocks and, unlike FLUX, the distilled guidance layer
    single_file_signature = (r"^(model\.diffusion_model\.)?distilled_guidance_layer\.", None)
    kohya_base_version = "chroma"
    modelspec_architecture = "chroma/lora"
    key_layout = CHROMA_KEYS
    # the distilled guidance layer makes every block's modulation (FLUX's per-block `norm*.linear`,
    # which the default skip list keeps dense); ~0.28B of 8.9B parameters
    quantize_skip_patterns = {"transformer": (r"^distilled_guidance_layer\.",)}
    # Chroma1-HD: 19 double and 38 single blocks at 3072 wide, the 5-layer 5120-wide approximator
    nominal_part_parameters = {"text_encoder": 4_893_906_944, "transformer": 8_899_983_424, "vae": 83_819_683}
    text_parts = ("text_encoder",)
    image_parts = ("vae",)
    embedding_slots = {"text_encoder": ("tokenizer", "t5xxl")}  # ComfyUI's T5-XXL embedding key

    def load(self) -> None:
        from diffusers import ChromaTransformer2DModel
        from transformers import AutoTokenizer, T5EncoderModel

        self.parts["text_encoder"] = self.load_part("text_encoder", T5EncoderModel,
                                                    ignore_unexpected=[r"^decoder\.", r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", ChromaTransformer2DModel)
        self.parts["vae"] = load_vae(self)
        self.load_flow_scheduler()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)

    def single_file_part(self, part: str):
        # Chroma ships as one original-layout transformer file (bare or under model.diffusion_model.);
        # the T5 encoder and the FLUX.1 VAE come as folders
        from modules.loading.single_file import SingleFilePart

        if part != "transformer":
            return None
        return SingleFilePart(
            ("model.diffusion_model.", "double_blocks.", "single_blocks.", "img_in.", "txt_in.",
             "distilled_guidance_layer.", "final_layer."),
            lambda sd, model: chroma_transformer_to_diffusers(sd))

    @property
    def transformer(self):
        return self.parts["transformer"]

    def caption_windows(self) -> list[tuple[object, int]]:
        return [(self.tokenizer, self.max_sequence_length)]  # T5 reads up to here

    @property
    def max_sequence_length(self) -> int:
        return min(self.tokenizer.model_max_length, 512)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "transformer":
            return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]
        if part == "text_encoder":
            return list(self.parts[part].encoder.block)
        return []

    # --- data --------------------------------------------------------------------------------

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_latents(self.parts["vae"], pixels, self.compute_dtype("vae"), shifted=True)

    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # as ChromaPipeline._get_t5_prompt_embeds: unlike FLUX, T5 sees the attention mask
        encoder = self.parts["text_encoder"]
        mask = tokens["attention_mask"].to(compute_device(encoder))
        hidden = encoder(tokens["input_ids"].to(compute_device(encoder)), attention_mask=mask, output_hidden_states=False)[0]
        return {"hidden_states": hidden, "attention_mask": mask}

    def planning_tokens(self, batch, device):
        length = self.planning_length(512)
        return {"input_ids": self.planning_ids(batch, length, device),
                "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device)}

    def planning_conditioning(self, batch, device):
        length = self.planning_length(512)
        return {"hidden_states": torch.empty(batch, length, self.parts["text_encoder"].config.d_model,
                                             dtype=self.compute_dtype("text_encoder"), device=device),
                "attention_mask": torch.empty(batch, length, dtype=torch.long, device=device)}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's velocity prediction for (B, C, H, W) latents at `sigmas`."""
        dtype = self.compute_dtype("transformer")
        height, width = noisy.shape[-2:]
        hidden = text["hidden_states"].to(dtype)
        packed = pack_latents(noisy).to(dtype)
        text_mask = transformer_text_mask(text["attention_mask"].to(noisy.device))
        mask = torch.cat([text_mask, text_mask.new_ones(packed.shape[:2])], dim=1)  # image tokens: all seen
        out = self.transformer(
            hidden_states=packed, timestep=sigmas.to(dtype), encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=image_ids(height, width, noisy.device, dtype), attention_mask=mask, return_dict=False,
        )[0]
        return unpack_latents(out, height, width)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

        pipe = ChromaPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            transformer=self.transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _prompt_conditioning(self, prompt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 hidden states, the transformer's bool text mask) as training computes them."""
        text = self.encode_text(self.tokenize([self.written_out_prompt(prompt)]))
        # on the sampling device: the pipeline moves prompts it encodes itself, not given embeddings
        return text["hidden_states"].to(device), transformer_text_mask(text["attention_mask"]).to(device)

    def run_sampling_pipeline(self, prompt, device):
        # the pipeline's own prompt encoding would hand the mask on as floats (module docstring)
        embeds, mask = self._prompt_conditioning(prompt.prompt, device)
        negative, negative_mask = self._prompt_conditioning(prompt.negative_prompt or "", device)
        return self.pipeline()(
            prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=negative,
            negative_prompt_attention_mask=negative_mask, num_inference_steps=prompt.steps,
            guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length,
        ).images[0]

    # --- adapters: what other tools do with the files (the key layout itself: keys/chroma.py) ----

    def diffusers_refuses_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        if part == "text_encoder":
            # diffusers 0.42: its text-encoder LoRA loader converts CLIP's layer names only and raises
            # ("Could not automatically infer state dict type") on T5's, kohya or diffusers names alike
            return ("ChromaPipeline.load_lora_weights reads CLIP text-encoder adapters only and raises on T5 ones "
                    "(model.parts.text_encoder.train false for a file diffusers loads)")
        if stacked and module_name.startswith("distilled_guidance_layer."):
            return ("its kohya-FLUX converter knows no distilled guidance layer and raises "
                    "(adapter.layer_preset 'attn' or 'attn-mlp' avoids it; output.format 'diffusers' keeps it)")
        return None
