"""Each adapter type on Linear and Conv2d: exact at init, gradients to the adapter only, unhook and
re-hook, merged weight = hooked output, dropouts, any base layer (a packed quantized one too),
and the forward math against peft's implementation of the same method given the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from modules.adapters.loha import LoHaModule
from modules.adapters.base import InertAdapter
from modules.adapters.lokr import LoKrModule, factorize
from modules.adapters.lora import LoRAModule
from modules.adapters.oft import OFTModule
from modules.quantization.base import QuantizedLinear

KINDS = {
    "lora": lambda base, **kw: LoRAModule("x", base, rank=4, alpha=2, **kw),
    "dora": lambda base, **kw: LoRAModule("x", base, rank=4, alpha=2, dora=True, **kw),
    "dora-input": lambda base, **kw: LoRAModule("x", base, rank=4, alpha=2, dora=True, dora_axis="input", **kw),
    "loha": lambda base, **kw: LoHaModule("x", base, rank=4, alpha=2, **kw),
    "lokr": lambda base, **kw: LoKrModule("x", base, rank=2, alpha=1, **kw),
    "lokr-both-wd": lambda base, **kw: LoKrModule("x", base, rank=1, alpha=1, decompose_both=True,
                                                  weight_decompose=True, **kw),
    "lokr-full": lambda base, **kw: LoKrModule("x", base, rank=2, alpha=2, full_matrix=True, factor=4, **kw),
    "oft": lambda base, **kw: OFTModule("x", base, block_size=4, **kw),
}
DECOMPOSED = {"dora", "dora-input", "lokr-both-wd"}


def linear():
    return nn.Linear(16, 24).requires_grad_(False), torch.randn(3, 16)


def conv():
    return nn.Conv2d(8, 12, 3, padding=1, stride=2).requires_grad_(False), torch.randn(2, 8, 10, 10)


BASES = {"linear": linear, "conv": conv}


def perturb(adapter, std=0.2):
    with torch.no_grad():
        for parameter in adapter.parameters():
            parameter.add_(torch.randn_like(parameter) * std)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("base_kind", BASES)
@pytest.mark.parametrize("kind", KINDS)
def test_starts_as_the_base_unhooks_and_rehooks(kind, base_kind):
    base, x = BASES[base_kind]()
    plain = base(x)
    adapter = KINDS[kind](base)
    adapter.hook()
    start = base(x)
    if kind in DECOMPOSED:  # m / ||W|| is 1 up to the rounding of the norm
        assert torch.allclose(start, plain, atol=1e-5, rtol=0)
    else:
        assert torch.equal(start, plain)
    perturb(adapter)
    changed = base(x)
    assert (changed - plain).abs().max() > 1e-2
    adapter.unhook()
    assert torch.equal(base(x), plain)
    adapter.hook()
    assert torch.equal(base(x), changed)
    adapter.unhook()


@pytest.mark.parametrize("base_kind", BASES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_the_adapter_only(kind, base_kind):
    base, x = BASES[base_kind]()
    base.bias.requires_grad_(False)
    adapter = KINDS[kind](base)
    adapter.hook()
    base(x).square().sum().backward()
    grads = {name: p.grad for name, p in adapter.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for p in base.parameters())


@pytest.mark.parametrize("base_kind", BASES)
@pytest.mark.parametrize("kind", KINDS)
def test_merged_weight_in_a_dense_copy_gives_the_hooked_output(kind, base_kind):
    base, x = BASES[base_kind]()
    dense = copy.deepcopy(base)  # before hooking: a copy of a hooked layer carries the hook along
    adapter = KINDS[kind](base)
    adapter.hook()
    perturb(adapter)
    with torch.no_grad():
        dense.weight.copy_(adapter.merged_weight())
        hooked = base(x)
    assert (hooked - dense(x)).abs().max() < 1e-5
    assert (hooked - copy.deepcopy(dense).requires_grad_(False)(x)).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "oft"])
def test_dropouts_act_only_while_the_base_model_trains(kind):
    base, x = linear()
    adapter = KINDS[kind](base, dropout=0.3, rank_dropout=0.5)
    adapter.hook()
    perturb(adapter)
    base.eval()
    assert torch.equal(base(x), base(x))
    base.train()
    assert not torch.equal(base(x), base(x))


@pytest.mark.parametrize("kind", KINDS)
def test_module_dropout_skips_the_whole_adapter(kind):
    base, x = linear()
    plain = base(x)
    adapter = KINDS[kind](base, module_dropout=0.5)
    adapter.hook()
    perturb(adapter)
    base.train()
    outputs = [base(x) for _ in range(24)]
    skipped = sum(torch.equal(out, plain) for out in outputs)
    assert 0 < skipped < 24  # p = 0.5: all or none in 24 draws has odds 2 * 2**-24
    base.eval()
    assert not torch.equal(base(x), plain)


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr", "oft"])
def test_created_on_the_given_device_in_the_given_dtype(kind):
    base, x = linear()
    adapter = KINDS[kind](base, device="cpu", dtype=torch.bfloat16)
    adapter.hook()
    perturb(adapter)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in adapter.parameters())
    out = base(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


class PackedLinear(QuantizedLinear):
    """A stand-in for nf4 and friends: no `weight` attribute, storage in another shape."""

    mode = "test-packed"

    def __init__(self, in_features, out_features, bias, compute_dtype, device=None):
        super().__init__(in_features, out_features, bias, compute_dtype, device)
        self.register_buffer("packed", torch.zeros(out_features * in_features // 2, 2, device=device))

    def quantize_weight(self, weight):
        self.packed.copy_(weight.detach().reshape(-1, 2).to(self.packed))

    def unquantized_weight(self, dtype, device):
        return self.packed.reshape(self.out_features, self.in_features).to(device=device, dtype=dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_works_on_a_quantized_layer_without_a_weight_attribute(kind):
    dense, x = linear()
    packed = PackedLinear.from_linear(dense, torch.float32)
    assert not hasattr(packed, "weight")
    adapter = KINDS[kind](packed)
    adapter.hook()
    perturb(adapter)
    with torch.no_grad():
        hooked = packed(x)
        dense.weight.copy_(adapter.merged_weight())
    assert (hooked - dense(x)).abs().max() < 1e-5
    packed(x).sum().backward()
    assert all(p.grad is not None for p in adapter.parameters())


def test_dora_magnitude_is_the_norm_of_the_base_weight_on_its_axis():
    base, _ = conv()
    out_axis = KINDS["dora"](base)
    in_axis = KINDS["dora-input"](base)
    assert out_axis.dora_scale.shape == (12, 1, 1, 1) and in_axis.dora_scale.shape == (1, 8, 1, 1)
    assert torch.allclose(out_axis.dora_scale.flatten(), base.weight.flatten(1).norm(dim=1))
    assert torch.allclose(in_axis.dora_scale.flatten(), base.weight.transpose(0, 1).flatten(1).norm(dim=1))
    assert isinstance(out_axis.dora_scale, nn.Parameter) and out_axis.dora_scale.requires_grad


def test_lokr_structure_follows_rank_factor_and_options():
    base = nn.Linear(64, 128)
    small = LoKrModule("x", base, rank=2, alpha=1)  # 128 = 8 x 16, 64 = 8 x 8
    assert small.lokr_w1.shape == (8, 8) and small.lokr_w2_a.shape == (16, 2) and small.lokr_w2_b.shape == (2, 8)
    assert small.scale == 0.5
    both = LoKrModule("x", base, rank=2, alpha=1, decompose_both=True)
    assert both.lokr_w1_a.shape == (8, 2) and both.lokr_w1_b.shape == (2, 8)
    full = LoKrModule("x", base, rank=2, alpha=1, full_matrix=True, factor=4)
    assert full.lokr_w1.shape == (4, 4) and full.lokr_w2.shape == (32, 16)
    assert full.scale == 1.0 and float(full.alpha) == 2.0  # both full: no scaling, alpha stored = rank


def test_lokr_factorization_is_lycoris_own():
    """LyCORIS owns the format and its loader re-derives every split by this rule (peft keeps a
    dividing factor first, unsorted: 320 with 32 is (32, 10) there and (10, 32) in LyCORIS)."""
    from lycoris.functional import factorization

    for dimension in (1, 12, 127, 128, 250, 320, 360, 640, 768, 1280, 3072, 12288):
        for factor in (-1, 2, 4, 8, 16, 32, 64, 100):
            assert factorize(dimension, factor) == tuple(factorization(dimension, factor)), (dimension, factor)
    assert factorize(320, 32) == (10, 32)


def test_oft_rotation_is_orthogonal_and_blocks_fit_the_channels():
    base = nn.Linear(16, 24)
    oft = OFTModule("x", base, block_size=5)  # 24 has no divisor 5: the largest below is 4
    assert oft.oft_blocks.shape == (6, 4, 4)
    perturb(oft, std=1.0)
    rotation = oft.rotation_t()
    eye = torch.eye(4).expand_as(rotation)
    assert torch.allclose(rotation @ rotation.transpose(1, 2), eye, atol=1e-5)
    with pytest.raises(InertAdapter, match=r"adapter\.block_size 4 splits their output channels into 1-wide"):
        OFTModule("x", nn.Linear(4, 7), block_size=4)  # 7 = 1 x 7: LyCORIS's layout is 1x1 blocks


# --- peft as the reference -------------------------------------------------------------------

def _peft_model(config, base):
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(config, nn.Sequential(copy.deepcopy(base)))


def _load_peft(model, tensors):
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, {f"0.{k}": v for k, v in tensors.items()})
    assert not result.unexpected_keys, result.unexpected_keys


PEFT_CASES = ["lora", "dora", "loha", "lokr", "lokr-both-wd-free", "lokr-full"]


@pytest.mark.parametrize("base_kind", BASES)
@pytest.mark.parametrize("case", PEFT_CASES)
def test_forward_matches_peft_given_the_same_weights(case, base_kind):
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    base, x = BASES[base_kind]()
    clean = copy.deepcopy(base)
    if case in ("lora", "dora"):
        ours = LoRAModule("x", base, rank=4, alpha=2, dora=case == "dora")
        config = LoraConfig(r=4, lora_alpha=2, target_modules=["0"], use_dora=case == "dora")
    elif case == "loha":
        ours = LoHaModule("x", base, rank=4, alpha=2)
        config = LoHaConfig(r=4, alpha=2, target_modules=["0"])
    elif case == "lokr":  # alpha = r: on the conv both factors are full, where LyCORIS does not scale
        ours = LoKrModule("x", base, rank=2, alpha=2)
        config = LoKrConfig(r=2, alpha=2, target_modules=["0"])
    elif case == "lokr-both-wd-free":
        ours = LoKrModule("x", base, rank=1, alpha=3, decompose_both=True)
        config = LoKrConfig(r=1, alpha=3, decompose_both=True, target_modules=["0"])
    else:  # both factors full: LyCORIS does not scale; peft scales alpha / r, so alpha = r here
        ours = LoKrModule("x", base, rank=6, alpha=6, full_matrix=True)
        config = LoKrConfig(r=6, alpha=6, target_modules=["0"])
    ours.hook()
    perturb(ours)
    peft_model = _peft_model(config, clean)
    local = {k: v for k, v in ours.state_dict().items() if k != "alpha"}
    names = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight",
             "dora_scale": "lora_magnitude_vector"}
    tensors = {names.get(k, k): v for k, v in local.items()}
    if "lora_magnitude_vector" in tensors:
        tensors["lora_magnitude_vector"] = tensors["lora_magnitude_vector"].reshape(
            (1, -1, 1, 1) if base_kind == "conv" else (-1,))
    peft_params = {k.replace(".default", "").removeprefix("0.").replace("magnitude_vector.weight", "magnitude_vector")
                   for k, _ in peft_model.named_parameters() if "default" in k}
    assert set(tensors) == peft_params
    _load_peft(peft_model, tensors)
    peft_model.eval()
    with torch.no_grad():
        expected, actual = peft_model(x), base(x)
    assert (expected - clean(x)).abs().max() > 1e-2  # the comparison is not between two no-ops
    assert (actual - expected).abs().max() < 1e-5


@pytest.mark.parametrize("base_kind", BASES)
def test_oft_rotation_matches_peft_on_the_transposed_layer(base_kind):
    """LyCORIS's OFT rotates a layer's output channels, peft's its input features. Given the same
    skew-symmetric blocks, peft applied to the transposed weight must give the transpose of ours."""
    from peft import OFTConfig

    base, x = BASES[base_kind]()
    ours = OFTModule("x", base, block_size=4)
    ours.hook()
    perturb(ours, std=0.3)
    size = ours.block_size  # LyCORIS's layout (3 for 12 channels with 4); peft is given the same
    flat = base.weight.detach().flatten(1)  # (out, in * kh * kw)
    transposed = nn.Linear(flat.shape[0], flat.shape[1], bias=False)
    with torch.no_grad():
        transposed.weight.copy_(flat.t())
    config = OFTConfig(oft_block_size=size, r=0, target_modules=["0"], use_cayley_neumann=False)
    peft_model = _peft_model(config, transposed)
    skew = ours.oft_blocks.detach() - ours.oft_blocks.detach().transpose(1, 2)
    rows, cols = torch.triu_indices(size, size, 1)
    _load_peft(peft_model, {"oft_R.weight": skew[:, rows, cols]})
    with torch.no_grad():
        theirs = peft_model(torch.eye(flat.shape[0]))  # row i: the rotated weight's row i
        assert (ours.merged_weight().flatten(1) - theirs).abs().max() < 1e-5
        assert (theirs - flat).abs().max() > 1e-2
        assert (base(x) - nn.functional.linear(x, theirs, base.bias) if base_kind == "linear"
                else base(x) - nn.functional.conv2d(x, theirs.view_as(base.weight), base.bias, 2, 1)).abs().max() < 1e-5
