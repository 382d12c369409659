"""A tiny random Wan-2.1-architecture pipeline: a two-layer UMT5 encoder with a character
tokenizer, WanTransformer3DModel and AutoencoderKLWan with two spatial and two temporal
downsamples (4x each: 1 + 4n frames become 1 + n latent frames, as in the released VAE's 4x), and
the released UniPC scheduler config. The UMT5 half and the transformer's widths are shared with the
other Wan families' tiny models (tiny/wan22.py, tiny/wan22_ti2v.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_sentencepiece_tokenizer

_CONFIGS = Path(__file__).resolve().parents[3] / "resources" / "model_configs" / "wan"

# the tiny transformer's widths (in/out channels: the tiny VAE's z_dim)
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                   out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)

def tiny_umt5(out: Path):
    """(tokenizer, text encoder): a character tokenizer written to out/tokenizer and a two-layer UMT5."""
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    vocab = write_char_sentencepiece_tokenizer(out / "tokenizer", max_length=32)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    return tokenizer, text_encoder


def tiny_wan_components(out: Path, transformer: dict | None = None) -> tuple[dict, dict]:
    """The tiny tokenizer (written under `out`), UMT5 encoder, VAE and scheduler as WanPipeline
    arguments, and the tiny transformer's config (with `transformer`'s entries): what the Wan 2.1
    architecture's tiny models share (tiny/wan22.py's two experts too)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    tokenizer, text_encoder = tiny_umt5(out)
    transformer_config = {**TRANSFORMER, **(transformer or {})}
    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4)
    scheduler = UniPCMultistepScheduler.from_pretrained(str(_CONFIGS / "scheduler"))
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}, transformer_config


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random Wan-2.1-architecture pipeline in diffusers layout, built offline."""
    from diffusers import WanPipeline, WanTransformer3DModel

    out = Path(out)
    torch.manual_seed(seed)
    components, transformer_config = tiny_wan_components(out, transformer)
    pipe = WanPipeline(**components, transformer=WanTransformer3DModel(**transformer_config))
    pipe.save_pretrained(str(out))
    return out
