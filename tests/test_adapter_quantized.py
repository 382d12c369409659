"""Every adapter type on every quantized Linear: exact at init, gradients to the adapter only,
state round trip, merged weight = hooked output, unhooked = base; and adapters built on the train
device while the quantized base layer is parked elsewhere (DoRA and weight-decomposed LoKr read
its norm through `unquantized_weight(.., train_device)`)."""

from __future__ import annotations

import pytest
import torch
from test_adapter_modules import DECOMPOSED, KINDS, perturb
from torch import nn

from modules.quantization.base import unquantized_weight
from modules.quantization.replace import QUANTIZED_MODES, quantize_model_

# W8A8 also rounds its input per token: the base output differs from x @ W^T by that rounding,
# which a dense merge (or input-axis DoRA, which recomputes from the dense weight) does not have
TOLERANCE = {"w8a8_int8": 3e-2, "w8a8_fp8": 6e-2}


def quantized_linear(mode: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(32, 48))
    quantize_model_(holder, "test", mode, torch.float32)
    return holder[0], torch.randn(5, 32)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_adapter_on_a_quantized_layer(kind, mode):
    base, x = quantized_linear(mode)
    plain = base(x)
    adapter = KINDS[kind](base)
    adapter.hook()
    tolerance = TOLERANCE.get(mode, 1e-5)
    start = base(x)
    if kind in DECOMPOSED:
        assert (start - plain).abs().max() < max(tolerance, 1e-5), (kind, mode)
    else:
        assert torch.equal(start, plain)

    perturb(adapter)
    base(x).square().sum().backward()
    assert all(p.grad is not None for p in adapter.parameters())
    assert not any(t.requires_grad for t in base.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor))
    hooked = base(x).detach()
    assert (hooked - plain).abs().max() > 1e-2

    fresh = KINDS[kind](base)  # state round trip: a fresh adapter with the saved state
    adapter.unhook()
    fresh.load_state_dict(adapter.state_dict())
    fresh.hook()
    assert torch.equal(base(x).detach(), hooked)
    fresh.unhook()

    dense = nn.Linear(32, 48)
    with torch.no_grad():
        dense.weight.copy_(fresh.merged_weight())
        dense.bias.copy_(base.bias.float())
        merged = dense(x)
    scale = hooked.abs().max()
    assert (merged - hooked).abs().max() <= max(tolerance * scale, 1e-5), (kind, mode)
    assert torch.equal(base(x), plain)  # unhooked: the base again


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("kind", sorted(DECOMPOSED))
def test_decomposed_adapters_initialise_on_the_train_device_from_a_parked_layer(kind, mode, fake_device):
    base, x = quantized_linear(mode)  # stored on the CPU, as a parked layer is
    adapter = KINDS[kind](base, device=fake_device)
    assert all(p.device.type == fake_device.type for p in adapter.parameters())
    magnitude = next(p for name, p in adapter.named_parameters() if "magnitude" in name or "dora" in name)
    weight = unquantized_weight(base, torch.float32, "cpu")
    norms = {weight.norm(dim=1).shape: weight.norm(dim=1), weight.norm(dim=0).shape: weight.norm(dim=0)}
    expected = norms[magnitude.reshape(-1).shape]
    torch.testing.assert_close(magnitude.detach().cpu().reshape(-1), expected, atol=1e-4, rtol=1e-4)
