"""kohya/LyCORIS LoRA files: `<stem>.lora_down.weight`, `<stem>.lora_up.weight`, `<stem>.alpha`
with stems like `lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q` and
`lora_te_text_model_encoder_layers_0_self_attn_q_proj`. diffusers' load_lora_weights, ComfyUI,
Forge and A1111 read these. The metadata follows kohya's `ss_*` names where one exists.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.saving.atomic import write_with


def save_kohya_lora(path: str | Path, state: dict[str, torch.Tensor], dtype: torch.dtype,
                    metadata: dict[str, str]) -> Path:
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    write_with(path, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    return Path(path)


def load_kohya_lora(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))
