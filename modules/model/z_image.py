"""Z-Image (Tongyi-MAI): a Qwen3 text encoder (its chat-templated prompt, the penultimate hidden
states of the prompt's real tokens), ZImageTransformer2DModel (single-stream DiT over 2x2
patches; noise and caption refiners, then the main layers), the FLUX.1 VAE with its shift and
scale; rectified-flow training. The transformer's timestep is 1 - sigma and its output is the
negative flow velocity (as ZImagePipeline reads it); predict() returns the velocity, so the
target is noise - latents as for Flux.

Adapter key names follow ComfyUI's Z-Image (Lumina2 / NextDiT) model, whose attention is one fused
`attention.qkv` and whose output projection is `attention.out` (original_layers). kohya files
write LoRA on those original layers, `lora_unet_layers_0_attention_qkv` (q/k/v stacked
block-diagonally, formats/fused.py), which ComfyUI maps from its own weights and diffusers'
Z-Image converter splits back; other algorithms, which do not stack, and the `comfy` format use
ComfyUI's diffusers-name keys `diffusion_model.layers.0.attention.to_q` (ComfyUI applies them to
rows of the fused weight). The Qwen3 encoder keeps `lora_te_<module>` (ComfyUI maps it for a
single llama-style encoder). musubi-style `lora_unet_<diffusers module>` files are still read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.base import ModelFamily, OriginalLayer, PartSpec
from modules.model.flux import flow_sigmas
from modules.model.noise import Prediction
from modules.model.sd15 import _vae_key
from modules.model.tiny_tokenizers import write_char_bpe_tokenizer
from modules.util.torch_utils import make_generator

_DIT_ATTN = r"^transformer\..*\.attention\.(to_q|to_k|to_v|to_out\.0)$"
_DIT_MLP = r"^transformer\..*\.feed_forward\.(w1|w2|w3)$"
_TE_ATTN = r"^text_encoder\..*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"
_TE_MLP = r"^text_encoder\..*\.mlp\.(gate_proj|up_proj|down_proj)$"

# Qwen3's chat template reduced to what Z-Image's prompt uses, for tiny tokenizers only
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _text_encoder_key(key: str) -> str:
    # a Qwen3ForCausalLM export keeps its `model.` level; the encoder is the Qwen3Model inside
    return key.removeprefix("model.")


class ZImageFamily(ModelFamily):
    flow_matching = True
    name = "z_image"
    label = "Z-Image"
    pipeline_classes = ("ZImagePipeline",)
    denoiser_config = {"_class_name": "ZImageTransformer2DModel"}
    single_file_signature = (r"^(model\.diffusion_model\.)?(noise_refiner|context_refiner)\.", None)
    part_specs = (
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("transformer", "transformer", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    )
    bucket_quantum = 64
    kohya_base_version = "z_image"
    modelspec_architecture = "z-image/lora"
    penultimate_parts = ("text_encoder",)  # Qwen3 is read at hidden_states[-2]
    layer_presets = {
        "attn": ([_DIT_ATTN, _TE_ATTN], False),
        "attn-mlp": ([_DIT_ATTN, _DIT_MLP, _TE_ATTN, _TE_MLP], False),
        "all-linear": ([r"^(transformer|text_encoder)\."], False),
        "all": ([r"^(transformer|text_encoder)\."], True),
    }
    denoiser_part = "transformer"
    nominal_part_parameters = {"text_encoder": 4_022_468_096, "transformer": 6_154_908_736, "vae": 83_819_683}
    text_parts = ("text_encoder",)
    image_parts = ("vae",)
    # the final projection (and its modulation) stays dense, as `final_layer` does in other DiTs
    quantize_skip_patterns = {"transformer": (r"^all_final_layer\.",)}

    def load(self) -> None:
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            ZImageTransformer2DModel,
        )
        from transformers import AutoTokenizer, Qwen3Model

        self.parts["text_encoder"] = self.load_part("text_encoder", Qwen3Model, rename=_text_encoder_key,
                                                    ignore_unexpected=[r"^lm_head\."])
        self.parts["transformer"] = self.load_part("transformer", ZImageTransformer2DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKL, rename=_vae_key)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)
        self.noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
            str(self.support_folder("scheduler")), local_files_only=True)

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
        vae = self.parts["vae"]
        latents = vae.encode(pixels.to(self.compute_dtype("vae"))).latent_dist.mean
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

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
        mask = tokens["attention_mask"].to(encoder.device)
        hidden = encoder(input_ids=tokens["input_ids"].to(encoder.device), attention_mask=mask.bool(),
                         output_hidden_states=True).hidden_states[-2]
        # padded to a fixed length so captions batch and cache; the mask picks the real tokens
        return {"hidden_states": hidden, "attention_mask": mask}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow velocity (noise - clean) the transformer predicts for (B, C, H, W) latents."""
        dtype = self.compute_dtype("transformer")
        captions = [h[m.bool()].to(dtype) for h, m in zip(text["hidden_states"], text["attention_mask"])]
        out = self.transformer(list(noisy.to(dtype).unsqueeze(2).unbind(0)), (1 - sigmas).to(dtype), captions,
                               return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def predict(self, latents, text, generator):
        noise = self.training_noise(latents, generator)
        sequence_length = (latents.shape[-2] // 2) * (latents.shape[-1] // 2)
        sigmas = flow_sigmas(self.noise_scheduler.config, self.training_times(latents.shape[0], generator),
                             sequence_length, self.config.loss.flow_shift).to(latents.device)
        expanded = sigmas.view(-1, 1, 1, 1).to(latents.dtype)
        noisy = (1 - expanded) * latents + expanded * noise
        return Prediction(self.denoise(noisy, sigmas, text), noise - latents)

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
            prompt=prompt.prompt, negative_prompt=prompt.negative_prompt or None,
            num_inference_steps=prompt.steps, guidance_scale=prompt.cfg, width=prompt.width, height=prompt.height,
            generator=generator, max_sequence_length=self.max_sequence_length,
        ).images[0]

    # --- adapters ----------------------------------------------------------------------------

    # ComfyUI's names for the transformer's layers: comfy/utils.py `z_image_to_diffusers` maps
    # each diffusers weight onto them (q/k/v as row offsets 0, dim, 2*dim of `attention.qkv`), and
    # comfy/lora.py `model_lora_keys_unet` keys LoRAs by `lora_unet_<its name with _>` and, for
    # Lumina2 models, by `diffusion_model.<diffusers name>` (Comfy-Org/ComfyUI)
    _BLOCK_LAYERS = (("attention.qkv", ("attention.to_q", "attention.to_k", "attention.to_v")),
                     ("attention.out", ("attention.to_out.0",)), ("feed_forward.w1", ("feed_forward.w1",)),
                     ("feed_forward.w2", ("feed_forward.w2",)), ("feed_forward.w3", ("feed_forward.w3",)),
                     ("adaLN_modulation.0", ("adaLN_modulation.0",)))
    _TOP_LAYERS = (("x_embedder", "all_x_embedder.2-1"), ("final_layer.linear", "all_final_layer.2-1.linear"),
                   ("final_layer.adaLN_modulation.1", "all_final_layer.2-1.adaLN_modulation.1"),
                   ("t_embedder.mlp.0", "t_embedder.mlp.0"), ("t_embedder.mlp.2", "t_embedder.mlp.2"),
                   ("cap_embedder.1", "cap_embedder.1"))
    # diffusers' Z-Image converter reads these original names as no module (it knows only
    # `all_x_embedder`/`all_final_layer`): from a kohya file it loads the rest
    _DIFFUSERS_DROPS = ("all_x_embedder.", "all_final_layer.")

    def original_layers(self, part: str) -> list[OriginalLayer] | None:
        if part != "transformer":
            return None
        modules = dict(self.transformer.named_modules())
        pairs = list(self._TOP_LAYERS)
        for stack in ("noise_refiner", "context_refiner", "layers"):
            for i in range(len(getattr(self.transformer, stack))):
                pairs += [(f"{stack}.{i}.{original}", tuple(f"{stack}.{i}.{m}" for m in members))
                          for original, members in self._BLOCK_LAYERS]
        layers = []
        for original, members in pairs:
            members = (members,) if isinstance(members, str) else members
            if all(m in modules for m in members):
                layers.append(OriginalLayer(f"lora_unet_{original.replace('.', '_')}", members,
                                            tuple(modules[m].out_features for m in members)))
        return layers

    def comfy_module_name(self, part: str, module_name: str) -> str:
        if part == "transformer":
            return f"diffusion_model.{module_name}"
        return self.adapter_name(part, module_name)  # lora_te_: ComfyUI's single-encoder map

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

    def comfyui_skips_diffusers_key(self, part: str, module_name: str) -> str | None:
        if part == "text_encoder":
            return "it reads Qwen3 adapters only under lora_te_ or text_encoders. names"
        return None

    # --- tiny model --------------------------------------------------------------------------

    @classmethod
    def make_tiny_model(cls, out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
        """A random Z-Image-architecture pipeline in diffusers layout, built offline."""
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            ZImagePipeline,
            ZImageTransformer2DModel,
        )
        from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

        out = Path(out)
        torch.manual_seed(seed)
        vocab_size = write_char_bpe_tokenizer(out / "tokenizer", max_length=64, chat_template=TINY_CHAT_TEMPLATE)
        tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        ))
        transformer_config = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                                  n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6],
                                  axes_lens=[256, 64, 64])
        transformer_config.update(transformer or {})
        vae = AutoencoderKL(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=16, norm_num_groups=32, sample_size=64,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        )
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
        pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=ZImageTransformer2DModel(**transformer_config))
        pipe.save_pretrained(str(out))
        return out
