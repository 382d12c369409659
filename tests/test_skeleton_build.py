"""A skeleton part (modules/loading/skeleton_build.py: built on the meta device, no initialiser run)
is the architecture the streamed load builds: the same modules, parameter and buffer names, shapes
and dtypes, the same tied weights, on real-size shipped configs (meta only, no weight read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CONFIGS = Path(__file__).resolve().parents[1] / "resources" / "model_configs"

# a computed buffer (SD3's positional table), tied weights (T5), rotary buffers (Wan; Qwen2.5-VL's
# language model and vision tower), rotary tables held as plain attributes (Qwen-Image)
CASES = {
    "qwen_image/transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "sd3/transformer_sd3_medium": ("diffusers", "SD3Transformer2DModel"),
    "sd3/text_encoder_3": ("transformers", "T5EncoderModel"),
    "wan/transformer": ("diffusers", "WanTransformer3DModel"),
    "qwen_image/text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
}


def _class(folder: str):
    import importlib

    package, name = CASES[folder]
    return getattr(importlib.import_module(package), name)


def _architecture(model: torch.nn.Module) -> dict:
    """What a plan reads of a part: every module's class, every tensor's name, shape and dtype, which
    names share one tensor, and where a tensor held as a plain attribute is (it stays there when
    the part moves to the device, and is copied there by the forward that reads it)."""
    named = list(model.named_parameters(remove_duplicate=False))
    first = {}
    return {
        "modules": [(name, type(module)) for name, module in model.named_modules()],
        "parameters": [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in named],
        "tied": [(name, first.setdefault(id(p), name)) for name, p in named],
        "buffers": [(name, tuple(b.shape), b.dtype) for name, b in model.named_buffers()],
        "plain": [(name, key, tuple(v.shape), v.dtype, v.device) for name, module in model.named_modules()
                  for key, v in vars(module).items() if isinstance(v, torch.Tensor)],
        "training": model.training,
    }


@pytest.mark.parametrize("folder", list(CASES))
def test_a_skeleton_is_the_architecture_of_the_load_build(folder):
    from modules.loading.skeleton_build import skeleton_model, tie_skeleton_weights
    from modules.loading.streamed_load import empty_model

    cls = _class(folder)
    built = tie_skeleton_weights(empty_model(cls, CONFIGS / folder, "t")).requires_grad_(False).eval()
    skeleton = skeleton_model(cls, CONFIGS / folder, "t")
    assert _architecture(skeleton) == _architecture(built)
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])


def test_a_skeleton_runs_no_initialiser(monkeypatch):
    """Each torch.nn.init call would run its meta kernel (~3 ms in torch._refs) to fill nothing."""
    from modules.loading.skeleton_build import skeleton_model

    calls = []
    original = torch.nn.init.kaiming_uniform_
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    skeleton_model(_class("wan/transformer"), CONFIGS / "wan/transformer", "t")
    assert not calls
