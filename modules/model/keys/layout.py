"""The shape of a family's adapter key layout: a table per part that adapter_keys.py turns into
the key stems kohya/LyCORIS, ComfyUI and diffusers files use. A family file declares one
`KeyLayout` (modules/model/keys/<family>.py) and writes no naming code of its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

# (the part's module, a diffusers module name inside it) -> that module's name in another layout
ModuleNamer = Callable[[nn.Module, str], str]


@dataclass(frozen=True)
class OriginalLayer:
    """One layer of a family's original (non-diffusers) checkpoint layout that holds several
    diffusers modules stacked along its output rows, e.g. FLUX's `single_blocks.0.linear1` =
    to_q, to_k, to_v, proj_mlp. kohya files name adapters by such layers (`stem`)."""

    stem: str  # the kohya key stem: lora_unet_single_blocks_0_linear1
    members: tuple[str, ...]  # diffusers module names inside the part, in row order
    rows: tuple[int, ...]  # output rows of each member
    swap_halves: bool = False  # the original stores the two halves of the rows swapped (FLUX's final adaLN)


@dataclass(frozen=True)
class FusedLayer:
    """An original layer as a template: in a block, `{i}` is the block's index and `{block}` its
    diffusers path (`transformer_blocks.3`)."""

    stem: str  # without the kohya prefix: "double_blocks_{i}_img_attn_qkv"
    members: tuple[str, ...]  # "{block}.attn.to_q", ...
    swap_halves: bool = False


@dataclass(frozen=True)
class OriginalLayout:
    """A part's original layers: the ones outside repeated blocks, then per block list (the
    part's ModuleList attribute) the layers of each block. A layer whose members the model lacks
    (no guidance embedder in schnell) is left out."""

    prefix: str  # kohya's prefix: "lora_unet"
    top: tuple[FusedLayer, ...] = ()
    blocks: Mapping[str, tuple[FusedLayer, ...]] = field(default_factory=dict)

    def layers(self, part_module: nn.Module) -> list[OriginalLayer]:
        modules = dict(part_module.named_modules())

        def layer(template: FusedLayer, **names) -> OriginalLayer | None:
            members = tuple(m.format(**names) for m in template.members)
            if not all(m in modules for m in members):
                return None
            return OriginalLayer(f"{self.prefix}_{template.stem.format(**names)}", members,
                                 tuple(modules[m].out_features for m in members), template.swap_halves)

        layers = [layer(template) for template in self.top]
        for attribute, templates in self.blocks.items():
            for i in range(len(getattr(part_module, attribute))):
                layers += [layer(template, i=i, block=f"{attribute}.{i}") for template in templates]
        return [x for x in layers if x is not None]


@dataclass(frozen=True)
class ComfyStems:
    """How ComfyUI's own adapter layout names a part's modules: `prefix` + the module's name
    (through `namer` where ComfyUI keeps the original checkpoint's names). `kohya=True`: the
    kohya stem (lora_te_...), which ComfyUI maps and Forge requires."""

    prefix: str = ""
    namer: ModuleNamer | None = None
    kohya: bool = False


KOHYA_STEMS = ComfyStems(kohya=True)


@dataclass(frozen=True)
class KeyLayout:
    """Per part (the config's part names), how other tools spell a module's adapter key."""

    # parts whose model dropped the `text_model.` level other tools keep (transformers 5 CLIPTextModel)
    text_model_parts: tuple[str, ...] = ()
    # the module name inside kohya's `<prefix>_<name>` stem, where it is not the diffusers name
    # (SDXL's UNet: sd-scripts uses the original sgm names)
    kohya_names: Mapping[str, ModuleNamer] = field(default_factory=dict)
    # ComfyUI's own layout; a part not listed has none (its adapters save as kohya or diffusers)
    comfy: Mapping[str, ComfyStems] = field(default_factory=dict)
    # modules ComfyUI would not load from a diffusers-format file: (regex searched in the module
    # name, None for every module of the part, why)
    comfyui_skips: Mapping[str, tuple[str | None, str]] = field(default_factory=dict)
    # modules kohya's sd-scripts would not load from a kohya file (its networks/lora.py LoRANetwork
    # builds modules only inside its target module classes and loads non-strictly): as comfyui_skips
    sd_scripts_skips: Mapping[str, tuple[str | None, str]] = field(default_factory=dict)
    # more stems read when loading (never written): prefix + the canonical module name
    other_stem_prefixes: Mapping[str, str] = field(default_factory=dict)
    # original-layout layers kohya files name fused adapters by (sd-scripts' FLUX files)
    original_layers: Mapping[str, OriginalLayout] = field(default_factory=dict)
    # parts whose unstacked adapters (LoHa/LoKr/OFT/DoRA) on a module that is a whole original layer
    # keep that layer's kohya name (ComfyUI maps `lora_unet_<original name>` for every weight)
    whole_layer_original_names: tuple[str, ...] = ()
    # ComfyUI reads the family's kohya layout as its own (it fuses q/k/v the same way): a `comfy`
    # file is written as the kohya one
    comfy_is_kohya: bool = False
    # parts ComfyUI reads only under its own weight paths, `text_encoders.<encoder>.transformer.model.<module>`
    # (comfy/lora.py model_lora_keys_clip maps no kohya-style name for llama-style encoders such as
    # Qwen3, Mistral3, Qwen2.5-VL): kohya and comfy files write those stems, the old `lora_te_` ones
    # still load. part -> ComfyUI's name for the encoder (its SD1ClipModel `name`), or a function of
    # the loaded part module where the checkpoint decides (FLUX.2: qwen3_4b, qwen3_8b, mistral3_24b)
    comfy_text_encoders: Mapping[str, str | Callable[[nn.Module], str]] = field(default_factory=dict)
    # the same for an encoder whose ComfyUI path is not `transformer.model.` (T5 keeps transformers'
    # module tree: Wan's UMT5 is `text_encoders.umt5xxl.transformer.<module>`): part -> the full prefix
    comfy_text_encoder_prefixes: Mapping[str, str] = field(default_factory=dict)
    # the prefix of a kohya file's per-module stem where it is not the part's adapter prefix (adapter
    # names, and so backups, keep the part's): FLUX.2's transformer `lora_transformer`, the name
    # ComfyUI's FLUX diffusers map reads (comfy/utils.py flux_to_diffusers), as for FLUX.1
    unstacked_kohya_prefixes: Mapping[str, str] = field(default_factory=dict)
    # output formats whose files diffusers' load_lora_weights refuses whole: format -> why
    diffusers_refuses: Mapping[str, str] = field(default_factory=dict)
