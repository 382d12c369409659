"""A tiny random FLUX.2-architecture pipeline: [klein] (a Qwen3ForCausalLM deep enough for the
hidden states Flux2KleinPipeline stacks, layers 9, 18, 27) or [dev] (a Mistral3ForConditionalGeneration
with a tiny Pixtral vision tower, its language model deep enough for layers 10, 20, 30, a guidance
embedding, Flux2Pipeline), with Flux2Transformer2DModel and an AutoencoderKLFlux2 with non-trivial
batch-norm statistics (so the latent normalisation is exercised)."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer
from modules.model.tiny.z_image import TINY_CHAT_TEMPLATE


def tiny_flux2_vae():
    """A random AutoencoderKLFlux2: 2 down blocks (latents at half the image size), 8 channels
    (32 after 2x2 patches), a running mean and variance that are not 0 and 1."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=8, norm_num_groups=32, sample_size=64,
    )
    generator = torch.Generator().manual_seed(7)
    vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=generator) * 0.1)
    vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=generator) + 0.5)
    return vae


# a Mistral-style chat template over the char tokenizer: the system and user turns Flux2Pipeline's
# format_input writes (content as a list of text parts), no generation prompt
TINY_MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}<|im_end|>{% endif %}"
    "{% endfor %}"
)


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0, variant: str = "klein") -> Path:
    """A random FLUX.2-architecture pipeline in diffusers layout, built offline; `variant` "klein"
    or "dev"."""
    if variant == "dev":
        return _make_tiny_dev_model(Path(out), transformer, seed)
    if variant != "klein":
        raise ValueError(f"variant: 'klein' or 'dev', not {variant!r}")
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from modules.model.flux2 import TEXT_ENCODER_OUT_LAYERS

    out = Path(out)
    torch.manual_seed(seed)
    vocab_size = write_char_bpe_tokenizer(out / "tokenizer", max_length=32, chat_template=TINY_CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    hidden = 16
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=32,
        num_hidden_layers=max(TEXT_ENCODER_OUT_LAYERS) + 1,  # the last layer is never read, as in Qwen3-4B's 36
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    ))
    vae = tiny_flux2_vae()
    transformer_config = dict(patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1,
                              num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                              joint_attention_dim=len(TEXT_ENCODER_OUT_LAYERS) * hidden, timestep_guidance_channels=32,
                              axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    transformer_config.update(transformer or {})
    # as resources/model_configs/flux2/scheduler: the pipeline always passes its own mu, so it shifts dynamically
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=Flux2Transformer2DModel(**transformer_config), is_distilled=False)
    pipe.save_pretrained(str(out))
    return out


def _make_tiny_dev_model(out: Path, transformer: dict | None, seed: int) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import AutoTokenizer, Mistral3Config, Mistral3ForConditionalGeneration

    from modules.model.flux2 import DEV_TEXT_ENCODER_OUT_LAYERS

    torch.manual_seed(seed)
    # long enough for the pipeline's system message (~190 bytes) and a caption after it
    vocab_size = write_char_bpe_tokenizer(out / "tokenizer", max_length=256, chat_template=TINY_MISTRAL_CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    hidden = 16
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=vocab_size, hidden_size=hidden, intermediate_size=32,
                         num_hidden_layers=max(DEV_TEXT_ENCODER_OUT_LAYERS) + 1,  # as Mistral-Small's 40: one unread
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=vocab_size - 1, spatial_merge_size=2,
    ))
    vae = tiny_flux2_vae()
    transformer_config = dict(patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1,
                              num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                              joint_attention_dim=len(DEV_TEXT_ENCODER_OUT_LAYERS) * hidden,
                              timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
    transformer_config.update(transformer or {})
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=Flux2Transformer2DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    return out
