"""Which Linear layers stay dense when a part's weights are quantized, and why.

A layer stays dense when any of these says so (the union, so no source is forgotten; InvokeAI's
fp8 storage honoured the first list and not the second, and quantized layers a model needs in
high precision):
0. a weight the model ties to another (tied_weights.py: SmolLM3's head is its token table where
   `tie_word_embeddings` is true): the tie makes them one tensor, which a quantized layer cannot
   share with an embedding, so a quantized head would be a second, quantized copy of the table
   (transformers' own quantizers leave tied weights dense, `get_keys_to_not_convert`),
1. the model class's `_skip_layerwise_casting_patterns` (diffusers: regexes searched in the
   module name; layers too sensitive to store in low precision),
2. the model class's `_keep_in_fp32_modules` (diffusers and transformers: module names that must
   stay float32; these also keep float32 storage, see `keeps_float32`),
3. DEFAULT_SKIP_PATTERNS: norms, embeddings, and the part's final projection, which are small
   and hurt quality most when quantized; and the model family's own patterns for the part
   (set on the model as FAMILY_SKIP_ATTRIBUTE, e.g. Z-Image's `all_final_layer`),
4. shapes the 8-bit matmul kernels cannot take (both dimensions must be multiples of 16),
5. the user's `model.parts.<part>.quantize_skip` regexes, searched in "part.module.name".
"""

from __future__ import annotations

import re

from torch import nn

from modules.quantization.tied_weights import tied_weight_keys

DEFAULT_SKIP_PATTERNS = (r"norm", r"emb", r"^proj_out$", r"^final_layer(\.|$)")
# a model instance may carry its family's extra skip regexes (searched in the module name) here
FAMILY_SKIP_ATTRIBUTE = "_family_quantize_skip"
KERNEL_MULTIPLE = 16


def _class_list(model: nn.Module, attribute: str) -> list[str]:
    value = getattr(type(model), attribute, None) or getattr(model, attribute, None) or []
    # a bare string is one entry (diffusers and transformers accept it so); list() would split it
    # into characters, and a one-letter regex matches nearly every module name
    return [value] if isinstance(value, str) else list(value)


def keeps_float32(model: nn.Module, module_name: str) -> bool:
    """The model class asks for this module or tensor (or a parent) to stay float32: an entry is
    matched against the name's dot-separated components, as diffusers matches it against a
    parameter name (so an entry may name a parameter, such as Wan's `scale_shift_table`)."""
    components = module_name.split(".")
    for entry in _class_list(model, "_keep_in_fp32_modules"):
        entry_parts = entry.split(".")
        width = len(entry_parts)
        if any(components[i:i + width] == entry_parts for i in range(len(components) - width + 1)):
            return True
    return False


def skip_reason(model: nn.Module, part: str, module_name: str, layer: nn.Linear,
                user_patterns: list[str]) -> str | None:
    """Why this Linear stays dense, or None when it is quantized."""
    tied = tied_weight_keys(model)
    weight = f"{module_name}.weight"
    if weight in tied or weight in tied.values():
        other = tied.get(weight) or next(alias for alias, source in tied.items() if source == weight)
        return f"its weight is tied to {other} ({type(model).__name__}'s tied weights)"
    for pattern in _class_list(model, "_skip_layerwise_casting_patterns"):
        if re.search(pattern, module_name):
            return f"{type(model).__name__}._skip_layerwise_casting_patterns ({pattern!r})"
    if keeps_float32(model, module_name):
        return f"{type(model).__name__}._keep_in_fp32_modules"
    for pattern in DEFAULT_SKIP_PATTERNS:
        if re.search(pattern, module_name):
            return f"default skip list ({pattern!r})"
    for pattern in getattr(model, FAMILY_SKIP_ATTRIBUTE, None) or ():
        if re.search(pattern, module_name):
            return f"the model family's skip list ({pattern!r})"
    if layer.in_features % KERNEL_MULTIPLE or layer.out_features % KERNEL_MULTIPLE:
        return f"shape {layer.out_features}x{layer.in_features} is not a multiple of {KERNEL_MULTIPLE}"
    qualified = f"{part}.{module_name}"
    for index, pattern in enumerate(user_patterns):
        if re.search(pattern, qualified):
            return f"model.parts.{part}.quantize_skip[{index}] ({pattern!r})"
    return None
