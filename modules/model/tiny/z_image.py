"""A tiny random Z-Image-architecture pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer
from modules.model.tiny.parts import tiny_flux_vae

# Qwen3's chat template reduced to what Z-Image's prompt uses, for tiny tokenizers only
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random Z-Image-architecture pipeline in diffusers layout, built offline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
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
    vae = tiny_flux_vae()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=ZImageTransformer2DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    return out
