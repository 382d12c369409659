"""ComfyUI's weight patch of a saved file equals the trainer's merge (max abs diff <= 1e-5), for
Chroma, SD3, Qwen-Image and FLUX.2 (klein and dev), LoRA / LoHa / LoKr / DoRA (kohya files, the
transformer's every linear layer, tiny models), and for the text encoders' adapters (T5, CLIP,
Qwen2.5-VL, Qwen3, Mistral-3: each key one ComfyUI maps, patching the one weight it names).

ComfyUI's side is rebuilt from its source (Comfy-Org a125cd84 and pollockjj 618b803d): which
weight of its model a key patches and at which row offset (comfy/lora.py model_lora_keys_unet,
comfy/utils.py flux_to_diffusers / mmdit_to_diffusers, with `swap_scale_shift` on the final adaLN),
and how each algorithm patches it (comfy/weight_adapter/: lora `up @ down * alpha / rank`; loha
`(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rank`; lokr `kron(w1, w2)`, times alpha / rank when a
factor is low-rank; DoRA `weight_decompose`: W' = (W + dW) * dora_scale / ||W + dW|| per input
column, on the narrowed rows where the key has an offset). The trainer's side is each adapter's
merged weight, laid out in ComfyUI's row order."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import file_state
from modules.config.train_config import AdapterConfig
from modules.saving.consumers import comfyui


def _swap(tensor: torch.Tensor) -> torch.Tensor:
    """comfy/utils.py swap_scale_shift: the two halves of the rows exchanged."""
    shift, scale = tensor.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def _targets(family) -> tuple[dict[str, tuple[str, int | None, bool]], dict[str, list[str]]]:
    """(key stem -> (ComfyUI weight, row offset or None, swapped), ComfyUI weight -> its diffusers
    modules in row order), for the transformer, from ComfyUI's maps."""
    transformer = family.transformer
    present = {n for n, m in transformer.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    members: dict[str, list[str]] = {}
    via: dict[str, str] = {}  # diffusers module -> ComfyUI weight
    swapped: set[str] = set()
    if family.name == "qwen_image":  # ComfyUI's model has diffusers' module names
        via = {name: name for name in present}
    elif family.name == "sd3":
        via = comfyui.mmdit_to_diffusers(transformer)
        last = len(transformer.transformer_blocks) - 1
        swapped = {via["norm_out.linear"]}
        if transformer.transformer_blocks[last].context_pre_only:
            swapped.add(via[f"transformer_blocks.{last}.norm1_context.linear"])
    elif family.name == "flux2":
        # ComfyUI's Flux2 holds BFL's weights; which diffusers module each is: diffusers'
        # convert_flux2_transformer_checkpoint_to_diffusers (ComfyUI keeps no FLUX.2 diffusers map)
        top = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
               "norm_out.linear": "final_layer.adaLN_modulation.1",
               **{f"time_guidance_embed.{d}.linear_{n}": f"{o}.{layer}"
                  for d, o in (("timestep_embedder", "time_in"), ("guidance_embedder", "guidance_in"))
                  for n, layer in ((1, "in_layer"), (2, "out_layer"))},
               **{f"{m}.linear": f"{m}.lin" for m in ("double_stream_modulation_img", "double_stream_modulation_txt",
                                                      "single_stream_modulation")}}
        via = dict(top)
        for i in range(len(transformer.transformer_blocks)):
            b, o = f"transformer_blocks.{i}", f"double_blocks.{i}"
            via |= {f"{b}.attn.{p}": f"{o}.img_attn.qkv" for p in ("to_q", "to_k", "to_v")}
            via |= {f"{b}.attn.{p}": f"{o}.txt_attn.qkv" for p in ("add_q_proj", "add_k_proj", "add_v_proj")}
            via |= {f"{b}.attn.to_out.0": f"{o}.img_attn.proj", f"{b}.attn.to_add_out": f"{o}.txt_attn.proj",
                    f"{b}.ff.linear_in": f"{o}.img_mlp.0", f"{b}.ff.linear_out": f"{o}.img_mlp.2",
                    f"{b}.ff_context.linear_in": f"{o}.txt_mlp.0", f"{b}.ff_context.linear_out": f"{o}.txt_mlp.2"}
        for i in range(len(transformer.single_transformer_blocks)):
            b, o = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
            via |= {f"{b}.attn.to_qkv_mlp_proj": f"{o}.linear1", f"{b}.attn.to_out": f"{o}.linear2"}
        via = {d: o for d, o in via.items() if d in present}
        swapped = {"final_layer.adaLN_modulation.1"}  # flux_to_diffusers' swap_scale_shift
    else:  # chroma: its Flux map, and the distilled guidance layer under its original names
        own = set(comfyui.chroma_original_keys(transformer))
        flux = comfyui.flux1_diffusers_names(len(transformer.transformer_blocks),
                                             len(transformer.single_transformer_blocks))
        via = {d: o for d, o in flux.items() if o in own and d in present}
        approximator = "distilled_guidance_layer"
        via |= {f"{approximator}.in_proj": f"{approximator}.in_proj", f"{approximator}.out_proj": f"{approximator}.out_proj"}
        for i in range(len(transformer.distilled_guidance_layer.layers)):
            via |= {f"{approximator}.layers.{i}.linear_1": f"{approximator}.layers.{i}.in_layer",
                    f"{approximator}.layers.{i}.linear_2": f"{approximator}.layers.{i}.out_layer"}
    order = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "proj_mlp")  # qkv, then linear1's MLP
    for module in sorted(via, key=lambda d: next((i for i, p in enumerate(order) if d.endswith(p)), -1)):
        members.setdefault(via[module], []).append(module)
    widths = {n: m.weight.shape[0] for n, m in transformer.named_modules() if n in present}
    stems: dict[str, tuple[str, int | None, bool]] = {}
    for own, modules in members.items():
        stems[f"lora_unet_{own.replace('.', '_')}"] = (own, None, False)
        offset = 0
        for module in modules:
            rows = offset if len(modules) > 1 else None
            stems[f"lora_transformer_{module.replace('.', '_')}"] = (own, rows, own in swapped)
            stems[f"transformer.{module}"] = (own, rows, own in swapped)
            offset += widths[module]
    return stems, members


def _patch(weight: torch.Tensor, local: dict[str, torch.Tensor], swapped: bool) -> torch.Tensor:
    """One key's patch of `weight` (its narrowed rows), as comfy/weight_adapter/ computes it."""
    alpha = float(local["alpha"]) if "alpha" in local else None
    if "lora_up.weight" in local:
        up, down = local["lora_up.weight"], local["lora_down.weight"]
        delta, rank = up.flatten(1) @ down.flatten(1), down.shape[0]
    elif "hada_w1_a" in local:
        delta = (local["hada_w1_a"] @ local["hada_w1_b"]) * (local["hada_w2_a"] @ local["hada_w2_b"])
        rank = local["hada_w1_b"].shape[0]
    else:
        rank = None
        w1 = local.get("lokr_w1")
        if w1 is None:
            rank, w1 = local["lokr_w1_b"].shape[0], local["lokr_w1_a"] @ local["lokr_w1_b"]
        w2 = local.get("lokr_w2")
        if w2 is None:
            rank, w2 = local["lokr_w2_b"].shape[0], local["lokr_w2_a"] @ local["lokr_w2_b"]
        delta = torch.kron(w1, w2.flatten(1))
    scale = alpha / rank if alpha is not None and rank else 1.0
    delta = delta.reshape(weight.shape)
    if swapped:
        delta = _swap(delta)
    if "dora_scale" not in local:
        return weight + delta * scale
    calc = weight + delta * scale
    dora = local["dora_scale"]
    if dora.shape[0] == calc.shape[0]:
        norm = weight.norm(dim=1, keepdim=True)
    else:
        norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True).transpose(0, 1)
    return calc * (dora / (norm + torch.finfo(weight.dtype).eps))


@pytest.fixture(scope="module", params=["chroma", "sd3", "qwen_image", "flux2", "flux2-dev"])
def family(request, tiny_family_model, tmp_path_factory, shape_images):
    from modules.config.families import get_family_class

    name, _, variant = request.param.partition("-")
    cls = get_family_class(name)
    model = tiny_family_model(name, **({"variant": variant} if variant else {}))
    loaded = cls(train_config(model, shape_images, tmp_path_factory.mktemp(request.param),
                              {"model": {"family": name}}))
    loaded.load()
    return loaded


ALGORITHMS = {"lora": {"type": "lora", "rank": 2, "alpha": 3}, "dora": {"type": "lora", "rank": 2, "dora": True},
              "loha": {"type": "loha", "rank": 2, "alpha": 3}, "lokr": {"type": "lokr", "rank": 2, "factor": 4},
              "lokr-full": {"type": "lokr", "rank": 2, "full_matrix": True}}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_comfyui_patches_the_weights_the_trainer_merges(family, algorithm):
    stems, members = _targets(family)
    transformer = family.transformer
    modules = dict(transformer.named_modules())
    adapters = build_adapter_set(family, AdapterConfig(layer_preset="all-linear", **ALGORITHMS[algorithm]),
                                 ["transformer"], torch.device("cpu"))
    try:
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, parameter in adapters.named_parameters():
                if "dora" in name or "magnitude" in name:
                    parameter.mul_(1 + 0.1 * torch.rand(parameter.shape, generator=generator))
                else:
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
            merged = {adapters.module_name_of[a.name]: a.merged_weight().detach().clone() for a in adapters}
        state = file_state(adapters, family, "kohya")
    finally:
        adapters.unhook()
    base = {name: modules[name].weight.detach() for module_list in members.values() for name in module_list}
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        stem, _, tensor_name = key.partition(".")
        if not stem.startswith("lora_te"):
            grouped.setdefault(stem, {})[tensor_name] = tensor.float()
    assert grouped and not set(grouped) - set(stems), sorted(set(grouped) - set(stems))[:5]
    assert not set(grouped) - comfyui.stems(family)  # every key one ComfyUI maps (test_consumer_keys.py)
    patched = {}
    for own, module_list in members.items():
        weight = torch.cat([base[m] for m in module_list])
        patched[own] = _swap(weight) if own in {stems[s][0] for s in stems if stems[s][2]} else weight.clone()
    for stem, local in grouped.items():
        own, offset, swapped = stems[stem]
        weight = patched[own]
        rows = local.get("lora_up.weight", local.get("hada_w1_a", local.get("lokr_w1", local.get("lokr_w1_a"))))
        size = weight.shape[0] if offset is None else _rows(local, rows)
        start = offset or 0
        weight[start:start + size] = _patch(weight[start:start + size], local, swapped)
    worst = 0.0
    for own, module_list in members.items():
        expected = torch.cat([merged.get(m, base[m]) for m in module_list])
        if own in {stems[s][0] for s in stems if stems[s][2]}:
            expected = _swap(expected)
        worst = max(worst, (patched[own] - expected).abs().max().item())
    assert worst <= 1e-5, worst
    assert any(not torch.equal(merged[m], base[m]) for m in merged)  # the adapters change something


@pytest.mark.parametrize("algorithm", ["lora", "dora", "lokr"])
def test_comfyui_patches_the_text_encoders_as_the_trainer_merges(family, algorithm):
    from modules.adapters.formats.files import stems as file_stems

    parts = [spec.name for spec in family.part_specs if spec.adapter_prefix and spec.name != family.denoiser_part]
    adapters = build_adapter_set(family, AdapterConfig(layer_preset="attn-mlp", **ALGORITHMS[algorithm]), parts,
                                 torch.device("cpu"))
    try:
        generator = torch.Generator().manual_seed(12)
        with torch.no_grad():
            for name, parameter in adapters.named_parameters():
                if "dora" in name or "magnitude" in name:
                    parameter.mul_(1 + 0.1 * torch.rand(parameter.shape, generator=generator))
                else:
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        named = file_stems(adapters, family, "kohya")
        expected = {named[a.name]: a.merged_weight().detach().clone() for a in adapters}
        base = {named[a.name]: a.base_weight().detach().clone() for a in adapters}
        state = file_state(adapters, family, "kohya")
    finally:
        adapters.unhook()
    assert expected, "no text-encoder adapters"
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        stem = next(s for s in expected if key.startswith(s + "."))
        grouped.setdefault(stem, {})[key[len(stem) + 1:]] = tensor.float()
    assert set(grouped) == set(expected) and not set(grouped) - comfyui.stems(family)  # every key ComfyUI maps
    worst = max((_patch(base[stem].float(), local, False) - expected[stem].float()).abs().max().item()
                for stem, local in grouped.items())
    assert worst <= 1e-5, worst
    assert any(not torch.equal(expected[s], base[s]) for s in expected)


def _rows(local: dict[str, torch.Tensor], first: torch.Tensor) -> int:
    """The rows a key's delta has: up's, w1_a's (LoHa), or LoKr's w1 rows times w2's."""
    if "lora_up.weight" in local or "hada_w1_a" in local:
        return first.shape[0]
    w2_rows = local["lokr_w2"].shape[0] if "lokr_w2" in local else local["lokr_w2_a"].shape[0]
    return first.shape[0] * w2_rows
