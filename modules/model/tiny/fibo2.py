"""A tiny random FIBO-2 pipeline (BriaFibo2Pipeline): a BriaFibo2Transformer2DModel with a Perceiver
and injection blocks, a Qwen3VLForConditionalGeneration whose language model is deep enough for the
hidden states the pipeline reads (layers up to 35) with a one-block vision tower, a byte-level
tokenizer with Qwen3-VL's vision tokens and the pipeline's chat turn, the processor's image half in
processor/ (as the released folders ship Qwen3VLProcessor there), FLUX.2's tiny VAE with non-trivial
batch-norm statistics, and a dynamically shifting flow scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.model.tiny.char_tokenizers import write_char_bpe_tokenizer
from modules.model.tiny.flux2 import tiny_flux2_vae

_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_TEXT_WIDTH = 16


def _tokenizer(folder: Path):
    """Byte-level, with each quoted key of FIBO's structured caption (its edit and text-render keys too)
    and the chat turn's words one token (as Qwen's tokenizer splits them into few), so the pipeline's
    null caption, and a caption with the markers of its text images, fit a short window."""
    import re

    from diffusers.pipelines.bria_fibo2.pipeline_bria_fibo2 import DEFAULT_NEGATIVE_PROMPT
    from transformers import AutoTokenizer

    write_char_bpe_tokenizer(folder, max_length=160)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    keys = set(re.findall(r'"[a-z_]+"', DEFAULT_NEGATIVE_PROMPT)) | {'"text_render"', '"text"', '"image_tokens"',
                                                                      '"image"', '"edit_instruction"', '"structured_caption"'}
    tokenizer.add_tokens(sorted(keys | {'""', "user", "assistant"}))
    tokenizer.add_special_tokens({"additional_special_tokens": _VISION_TOKENS})
    tokenizer.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def make_tiny_model(out: str | Path, transformer: dict | None = None, seed: int = 0) -> Path:
    """A random FIBO-2-architecture pipeline in diffusers layout, built offline."""
    from diffusers import BriaFibo2Pipeline, BriaFibo2Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.bria_fibo2.pipeline_bria_fibo2 import TEXT_ENCODER_OUT_LAYERS
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = _tokenizer(out / "processor")
    ids = tokenizer.convert_tokens_to_ids(_VISION_TOKENS)
    layers = max(max(bundle) for bundle in TEXT_ENCODER_OUT_LAYERS) + 1  # 36: the last one is never read
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=_TEXT_WIDTH,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[]),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
        tie_word_embeddings=True,
    ))
    vae = tiny_flux2_vae()
    transformer_config = dict(
        in_channels=vae.config.latent_channels, patch_size=2, dim=32, n_layers=6, n_refiner_layers=1, n_heads=2,
        cap_feat_dim=3 * _TEXT_WIDTH, injection_layer_ids=(0, 1, 2, 3, 5), perceiver_num_layers=1,
        min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4, gist_min_text_len=16, gist_max_text_len=64,
        axes_dims=(4, 6, 6), axes_lens=(32, 64, 64))
    transformer_config.update(transformer or {})
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = BriaFibo2Pipeline(transformer=BriaFibo2Transformer2DModel(**transformer_config), scheduler=scheduler,
                             vae=vae, text_encoder=text_encoder, processor=None)
    pipe.save_pretrained(str(out))
    # the released processor/ folder (Qwen3VLProcessor: the tokenizer and the image processor's config),
    # named in model_index as released; that class needs torchvision, so the family reads the tokenizer
    # (and a pipeline loads here with processor=None)
    Qwen2VLImageProcessorPil(patch_size=16).save_pretrained(str(out / "processor"))
    tokenizer.save_pretrained(str(out / "processor"))
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
