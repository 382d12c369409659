"""How a family's adapters are named in files other tools read, computed from the family's
declared `key_layout` (modules/model/keys/<family>.py). ModelFamily mixes this in; the adapter
formats (modules/adapters/formats) call these methods and know no family by name."""

from __future__ import annotations

import re
from typing import ClassVar

from modules.model.keys.layout import KeyLayout, OriginalLayer


class AdapterKeyNames:
    """The key-naming part of ModelFamily (it reads `spec`, `parts` and `label` from the family)."""

    key_layout: ClassVar[KeyLayout] = KeyLayout()

    def adapter_name(self, part: str, module_name: str) -> str:
        """The kohya/LyCORIS key stem for a module: lora_unet_down_blocks_0_..."""
        prefix = self.spec(part).adapter_prefix
        name = self.canonical_module_name(part, module_name)
        namer = self.key_layout.kohya_names.get(part)
        if namer is not None:
            name = namer(self.parts[part], name)
        return f"{prefix}_{name.replace('.', '_')}"

    def canonical_module_name(self, part: str, module_name: str) -> str:
        """The module's name as other tools spell it (library versions may rename modules)."""
        if part in self.key_layout.text_model_parts and not module_name.startswith("text_model."):
            return "text_model." + module_name
        return module_name

    def comfyui_skips_diffusers_key(self, part: str, module_name: str) -> str | None:
        """Why ComfyUI's loader would not load this module's adapter from a diffusers-format file
        (its key map has no such name: "lora key not loaded"), or None."""
        return _skipped(self.key_layout.comfyui_skips.get(part), module_name)

    def sd_scripts_skips_key(self, part: str, module_name: str) -> str | None:
        """Why kohya's sd-scripts would leave this module's adapter out of a kohya file it loads, or None."""
        return _skipped(self.key_layout.sd_scripts_skips.get(part), module_name)

    def diffusers_skips_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        """Why diffusers' `load_lora_weights` drops this module's adapter from a `fmt` file
        (stacked: written on an original layer, fused.py), or None."""
        return None

    def diffusers_refuses_key(self, fmt: str, part: str, module_name: str, stacked: bool) -> str | None:
        """Why diffusers' `load_lora_weights` refuses a whole `fmt` file that holds this module's
        adapter (its converter raises on a key it has no rule for), or None."""
        return None

    def diffusers_refuses(self, fmt: str) -> str | None:
        """Why diffusers' `load_lora_weights` refuses a whole `fmt` file of this family, or None."""
        return self.key_layout.diffusers_refuses.get(fmt)

    def unstacked_kohya_stem(self, part: str, module_name: str) -> str | None:
        """A kohya file's stem for an adapter not on an original layer; None: its adapter name."""
        if part in self.key_layout.whole_layer_original_names:
            whole = self._whole_layer_stems(part).get(module_name)
            if whole:
                return whole
        prefix = self.key_layout.unstacked_kohya_prefixes.get(part)
        if prefix is not None:
            return f"{prefix}_{self.canonical_module_name(part, module_name).replace('.', '_')}"
        return None

    def kohya_file_stem(self, part: str, module_name: str) -> str | None:
        """The stem a kohya file writes for an adapter not stacked on an original layer (None: its
        adapter name)."""
        return self.comfy_text_encoder_stem(part, module_name) or self.unstacked_kohya_stem(part, module_name)

    def comfy_text_encoder_stem(self, part: str, module_name: str) -> str | None:
        """ComfyUI's own path of a text-encoder module (`text_encoders.qwen3_4b.transformer.model.
        layers.0.self_attn.q_proj`), for the parts it reads under no other name; else None."""
        prefix = self.key_layout.comfy_text_encoder_prefixes.get(part)
        if prefix is not None:
            return prefix + self.canonical_module_name(part, module_name)
        encoder = self.key_layout.comfy_text_encoders.get(part)
        if encoder is None:
            return None
        if callable(encoder):
            encoder = encoder(self.parts[part])
        return f"text_encoders.{encoder}.transformer.model.{self.canonical_module_name(part, module_name)}"

    def _whole_layer_stems(self, part: str, written: bool = True) -> dict[str, str]:
        """module name -> original layer stem, for the modules that are a whole original layer
        (built once per loaded part module). Written: without the layers whose original stores
        the rows' halves swapped (FLUX's final adaLN), which an unstacked adapter cannot follow;
        they are written under their diffusers name, which ComfyUI swaps (flux_to_diffusers), and
        older files that named them by the original layer still load."""
        cache = self.__dict__.setdefault("_whole_layer_stem_cache", {})
        module = self.parts[part]
        if part not in cache or cache[part][0] is not module:
            layers = [layer for layer in self.original_layers(part) or () if len(layer.members) == 1]
            cache[part] = (module, {layer.members[0]: layer.stem for layer in layers if not layer.swap_halves},
                           {layer.members[0]: layer.stem for layer in layers})
        return cache[part][1 if written else 2]

    def file_layout(self, fmt: str) -> str:
        """The key layout a file of output.format `fmt` is written in."""
        return "kohya" if fmt == "comfy" and self.key_layout.comfy_is_kohya else fmt

    def other_stems(self, part: str, module_name: str) -> tuple[str, ...]:
        """More key stems other tools write for the module (read when loading, never written),
        e.g. ComfyUI's own `text_encoders.clip_l.transformer...` paths, or the original layer name
        an unstacked adapter was written under (`unstacked_kohya_stem`)."""
        prefix = self.key_layout.other_stem_prefixes.get(part)
        stems = () if prefix is None else (prefix + self.canonical_module_name(part, module_name),)
        if part in self.key_layout.whole_layer_original_names:
            whole = self._whole_layer_stems(part, written=False).get(module_name)
            stems += (whole,) if whole else ()
        written = self.kohya_file_stem(part, module_name)
        return stems + ((written,) if written and written not in stems else ())

    def original_layers(self, part: str) -> list[OriginalLayer] | None:
        """The part's layers in the original checkpoint layout, where kohya LoRA files for this
        family use those names (sd-scripts' FLUX files): None where kohya names are the diffusers
        module names (`adapter_name`)."""
        layout = self.key_layout.original_layers.get(part)
        return None if layout is None else layout.layers(self.parts[part])

    def comfy_module_name(self, part: str, module_name: str) -> str:
        """The module's key stem in ComfyUI's own adapter layout (`diffusion_model.<its module
        path>`, `text_encoders.<its text encoder path>`), where the family declares one."""
        text_encoder = self.comfy_text_encoder_stem(part, module_name)
        if text_encoder is not None:
            return text_encoder
        stems = self.key_layout.comfy.get(part)
        if stems is None:
            raise NotImplementedError(f"{self.label} has no ComfyUI key layout")
        if stems.kohya:
            return self.adapter_name(part, module_name)
        name = stems.namer(self.parts[part], module_name) if stems.namer else module_name
        return stems.prefix + name


def _skipped(skip: tuple[str | None, str] | None, module_name: str) -> str | None:
    """The reason of a (regex or None for all, why) skip that matches the module, else None."""
    if skip is None:
        return None
    pattern, why = skip
    return why if pattern is None or re.search(pattern, module_name) else None
