"""The planner's step runs on plain meta tensors with each op's meta kernel run once per shape
(modules/plan/meta_ops.py), activation offloading too (its copies to the CPU stand on meta,
uncounted: LiveBytes.copy_elsewhere). Both passes must give the same plan to the byte: compared here
on tiny models of the kinds of architecture the presets plan (a UNet, FLUX's two kinds of block,
SD3's positional table kept on the CPU by the skeleton, a video transformer), with adapters, a
fine-tune, checkpointing, activation offloading (positional, keyword and tuple inputs, a tensor
every block shares) and nf4 weights; and the steps that run the text encoders (an embedding, a trained
encoder), whose transformers mask helpers take on meta the branch they take on fake tensors
(modules/plan/traced_meta.py): CLIP, T5, UMT5, Qwen3, Qwen3-VL, SmolLM3, Qwen2.5-VL."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from modules.config.loading import build_config
from modules.plan import fake_pass
from modules.plan.meta_ops import MetaOpCache, MetaValueRead

CASES = {
    "sd15 nf4 lora, checkpointing, batch 2": ("sd15", {"model": {"parts": {"unet": {
        "weight_dtype": "nf4", "gradient_checkpointing": True}}}, "schedule": {"batch_size": 2}}),
    "flux lora, checkpointing": ("flux", {"model": {"parts": {"transformer": {"gradient_checkpointing": True}}}}),
    "sd3 fine-tune": ("sd3", {"method": {"type": "fine_tune"}}),
    "wan clips": ("wan", {"concepts": [{"path": "{images}", "video": {"frames": 5}}], "data": {"resolution": 32}}),
}
OFFLOADED = {"gradient_checkpointing": True, "activation_offloading": True}
CASES |= {  # activation offloading: each block's inputs wait on the CPU (the 720P Wan presets)
    "sd15 lora, activation offloading": ("sd15", {"model": {"parts": {"unet": OFFLOADED}}}),
    "flux lora, activation offloading": ("flux", {"model": {"parts": {"transformer": OFFLOADED}}}),
    "wan clips, activation offloading": ("wan", {"model": {"parts": {"transformer": OFFLOADED}},
                                                 "concepts": [{"path": "{images}", "video": {"frames": 5}}],
                                                 "data": {"resolution": 32}}),
}
EMBEDDING = {"method": {"type": "embedding"}, "embeddings": [{"placeholder": "<tok>", "vectors": 2}]}
TEXT_LORA = {"model": {"parts": {"text_encoder": {"train": True}}}}
TEXT_IN_STEP = {  # family: the encoder it runs in the step
    "sd15 text-encoder lora": ("sd15", TEXT_LORA),  # CLIP
    "chroma embedding": ("chroma", EMBEDDING),  # T5
    "anima embedding": ("anima", EMBEDDING),  # Qwen3 (and its LLM adapter)
    "krea2 embedding": ("krea2", EMBEDDING),  # Qwen3-VL's language model
    "fibo2 embedding": ("fibo2", EMBEDDING),  # Qwen3-VL
    "fibo_edit embedding": ("fibo_edit", EMBEDDING),  # SmolLM3
    "qwen_image_edit embedding": ("qwen_image_edit", EMBEDDING),  # Qwen2.5-VL
    "qwen_image_edit_plus embedding": ("qwen_image_edit_plus", EMBEDDING),
    "wan text-encoder lora": ("wan", TEXT_LORA),  # UMT5
}


def _no_fake_tensors(*args, **kwargs):
    raise AssertionError("the pass made a FakeTensorMode where the meta pass should have run")


def _plan(config, fake: bool, monkeypatch) -> dict:
    """fake: the pass on fake tensors; else the pass as measure_step picks it, which must be meta."""
    from modules.plan.run_plan import plan_run

    with monkeypatch.context() as patch:
        if fake:
            patch.setattr(fake_pass, "measure_step", functools.partial(fake_pass.measure_step, fake=True))
        else:
            patch.setattr(fake_pass, "FakeTensorMode", _no_fake_tensors)
        return plan_run(config, 2**30, 2**34, fix=False).as_dict()


@pytest.mark.parametrize("case", list(CASES))
def test_the_meta_pass_plans_what_the_fake_pass_plans(case, tiny_family_model, shape_images, monkeypatch):
    family, overlay = CASES[case]
    overlay = json.loads(json.dumps(overlay).replace("{images}", str(shape_images)))
    config = build_config([{"model": {"family": family, "base": str(tiny_family_model(family))},
                            "data": {"resolution": 64}}, overlay])
    on_meta = _plan(config, False, monkeypatch)
    assert on_meta == _plan(config, True, monkeypatch)
    assert on_meta["flops_per_step"] > 0 and max(p["device"]["activations"] for p in on_meta["parts"].values()) > 0


@pytest.mark.parametrize("case", list(TEXT_IN_STEP))
def test_the_text_encoders_in_the_step_plan_on_meta_as_on_fake_tensors(case, tiny_family_model, monkeypatch):
    family, overlay = TEXT_IN_STEP[case]
    config = build_config([{"model": {"family": family, "base": str(tiny_family_model(family))},
                            "data": {"resolution": 64}}, overlay])
    from transformers.utils import import_utils

    is_fake_tensor = import_utils.is_fake_tensor
    on_meta = _plan(config, False, monkeypatch)
    assert import_utils.is_fake_tensor is is_fake_tensor, "the pass left transformers treating meta tensors as traced"
    assert any("run in every step" in note for note in on_meta["notes"])
    assert on_meta == _plan(config, True, monkeypatch)


def test_a_value_read_on_meta_names_the_line_that_read_it():
    mask = torch.empty(2, 7, dtype=torch.bool, device="meta")
    with MetaOpCache(), pytest.raises(MetaValueRead, match=r"test_plan_meta_pass\.py:\d+"):
        bool(mask.all())


def test_a_repeated_op_gets_a_fresh_storage_of_the_kernels_metadata():
    x = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    weight = torch.nn.Parameter(torch.empty(7, 5, device="meta"))
    with MetaOpCache() as cache:
        first = torch.nn.functional.linear(x.float(), weight)
        again = torch.nn.functional.linear(x.float(), weight)
        transposed = x.t().contiguous(), x.t().contiguous()
    assert cache.hits >= 2
    for made, kernel in ((again, first), (transposed[1], transposed[0])):
        assert (made.shape, made.stride(), made.dtype, made.untyped_storage().nbytes()) == \
            (kernel.shape, kernel.stride(), kernel.dtype, kernel.untyped_storage().nbytes())
    storages = {t.untyped_storage()._cdata for t in (x, first, again, *transposed)}
    assert len(storages) == 5


def test_views_and_in_place_ops_keep_their_inputs_storage():
    x = torch.empty(4, 6, device="meta")
    with MetaOpCache():
        views = [x.view(6, 4) for _ in range(2)]
        in_place = [x.mul_(2) for _ in range(2)]
    assert all(t.untyped_storage()._cdata == x.untyped_storage()._cdata for t in views + in_place)


@pytest.mark.parametrize("made", [lambda: torch.empty(8, device="meta")[:4], lambda: torch.empty(8, device="meta")[4:]],
                         ids=["a storage larger than the tensor", "an offset into its storage"])
def test_an_output_an_empty_tensor_would_not_replicate_runs_its_kernel(made):
    """(called as an op is: the kernel a plain function)"""
    cache = MetaOpCache()
    outputs = [cache.__torch_dispatch__(made, (), ()) for _ in range(2)]
    assert cache.hits == 0 and outputs[1].untyped_storage().nbytes() == 32


def test_tensors_off_meta_run_their_kernel():
    with MetaOpCache() as cache:
        values = [torch.arange(4.0) * 2 for _ in range(2)]
    assert cache.hits == 0 and values[1].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_an_nf4_layer_on_meta_dequantizes_to_the_dense_weights_shape():
    pytest.importorskip("bitsandbytes")
    from modules.quantization.linear_nf4 import LinearNf4

    real = LinearNf4(64, 32, False, torch.bfloat16)
    real.quantize_weight(torch.randn(32, 64))
    dense = real.unquantized_weight(torch.bfloat16, "cpu")
    planned = LinearNf4(64, 32, False, torch.bfloat16, device="meta").unquantized_weight(torch.bfloat16, "meta")
    assert planned.is_meta and (planned.shape, planned.stride(), planned.dtype) == \
        (dense.shape, dense.stride(), dense.dtype)
