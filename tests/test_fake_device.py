"""The fake ``fakegpu`` device: same numbers as CPU, and CUDA's errors when devices are mixed."""

from __future__ import annotations

import gc
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

MIXED = "Expected all tensors to be on the same device"


def _same(fake: torch.Tensor, cpu: torch.Tensor, atol: float = 0.0) -> None:
    assert fake.device.type == "fakegpu"
    back = fake.cpu()
    assert back.dtype == cpu.dtype and back.shape == cpu.shape
    torch.testing.assert_close(back, cpu, atol=atol, rtol=0 if atol == 0 else 1e-5)


def test_enable_is_idempotent_and_strings_work(fake_device):
    from fake_device import enable_fake_device

    assert enable_fake_device() == fake_device == torch.device("fakegpu")
    assert torch.zeros(2, device="fakegpu").device == torch.device("fakegpu:0")
    assert torch.ones(2).to("fakegpu:0").device.type == "fakegpu"
    assert torch.get_device_module("fakegpu").device_count() == 1
    assert torch.ones(1).to(fake_device).is_fakegpu


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8, torch.int64, torch.bool],
)
def test_round_trip_keeps_values(fake_device, dtype):
    src = (torch.randn(5, 7) * 20).to(dtype)
    back = src.to(fake_device).to("cpu")
    assert back.dtype == dtype
    # Compare bytes: equality kernels for float8 are not guaranteed on CPU.
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    strided = src.t().to(fake_device)  # non-contiguous source keeps its layout and values
    assert torch.equal(strided.cpu().contiguous().view(torch.uint8), src.t().contiguous().view(torch.uint8))


def test_memory_outlives_cpu_source_and_views_share_it(fake_device):
    base = torch.arange(12.0).to(fake_device)
    row = base.view(3, 4)[1]
    row.mul_(10)  # writes through a view land in the base
    assert base.cpu()[4:8].tolist() == [40.0, 50.0, 60.0, 70.0]
    del base
    gc.collect()
    junk = [torch.full((4096,), 7.0) for _ in range(32)]  # reuse any memory freed by mistake
    assert row.cpu().tolist() == [40.0, 50.0, 60.0, 70.0]
    del junk


def test_math_matches_cpu(fake_device):
    torch.manual_seed(0)
    a, b, w, bias = torch.randn(6, 8), torch.randn(8, 5), torch.randn(3, 8), torch.randn(3)
    fa, fb, fw, fbias = (t.to(fake_device) for t in (a, b, w, bias))
    _same(fa * 2 + fa.exp() - 1, a * 2 + a.exp() - 1, atol=1e-6)
    _same(fa @ fb, a @ b, atol=1e-6)
    _same(F.linear(fa, fw, fbias), F.linear(a, w, bias), atol=1e-6)
    _same(fa.softmax(-1).sum(0), a.softmax(-1).sum(0), atol=1e-6)
    _same(fa[fa > 0], a[a > 0])
    _same(torch.cat([fa, fa]).t().contiguous(), torch.cat([a, a]).t().contiguous())
    assert fa.sum().item() == pytest.approx(a.sum().item(), abs=1e-5)


def test_in_place_on_strided_view_keeps_layout(fake_device):
    x = torch.arange(6.0).view(2, 3)
    fx = x.to(fake_device)
    x.t().add_(torch.arange(2.0))
    view = fx.t()
    view.add_(torch.arange(2.0).to(fake_device))
    assert view.stride() == (1, 3)
    _same(fx, x)


def test_conv2d_forward_backward_matches_cpu(fake_device):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, stride=2)
    fconv = nn.Conv2d(3, 4, 3, padding=1, stride=2)
    fconv.load_state_dict(conv.state_dict())
    fconv.to(fake_device)
    img = torch.randn(2, 3, 9, 9, requires_grad=True)
    fimg = img.detach().to(fake_device).requires_grad_()
    out, fout = conv(img), fconv(fimg)
    _same(fout.detach(), out.detach(), atol=1e-6)
    out.sin().sum().backward()
    fout.sin().sum().backward()
    _same(fimg.grad, img.grad, atol=1e-6)
    _same(fconv.weight.grad, conv.weight.grad, atol=1e-5)
    _same(fconv.bias.grad, conv.bias.grad, atol=1e-5)


@pytest.mark.parametrize(
    "mix",
    [
        lambda f, c: F.linear(f, c),  # activation on the device, weight left on CPU
        lambda f, c: f * c[0],  # weight on the device, scale vector left on CPU
        lambda f, c: c * f,  # CPU tensor first
        lambda f, c: torch.cat([f, c]),
        lambda f, c: F.conv2d(f.view(1, 1, 4, 4), c.view(1, 1, 4, 4)),
    ],
    ids=["linear", "mul_scale", "mul_cpu_first", "cat", "conv2d"],
)
def test_mixing_non_scalar_cpu_raises(fake_device, mix):
    with pytest.raises(RuntimeError, match=MIXED):
        mix(torch.randn(4, 4).to(fake_device), torch.randn(4, 4))


def test_scalar_and_index_cpu_tensors_may_join(fake_device):
    x = torch.arange(6.0)
    fx = x.to(fake_device)
    _same(fx * torch.tensor(3.0), x * 3)
    _same(fx[torch.tensor([4, 1])], x[torch.tensor([4, 1])])
    fx[torch.tensor([0])] = torch.tensor(9.0)
    assert fx.cpu()[0].item() == 9.0


def test_module_to_keeps_parameter_identity(fake_device):
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.BatchNorm1d(8))
    params = list(model.parameters())
    model.to(fake_device)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(p.device.type == "fakegpu" for p in params)
    assert model[2].running_mean.device.type == "fakegpu"
    model.to("cpu")
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(p.device.type == "cpu" for p in params)


def test_param_data_assignment_moves_in_place(fake_device):
    param = nn.Parameter(torch.randn(3, 2))
    values = param.detach().clone()
    param.data = param.data.to(fake_device)
    assert param.device.type == "fakegpu" and isinstance(param, nn.Parameter)
    _same(param.detach(), values)
    param.data = param.data.to("cpu")
    assert param.device.type == "cpu"


def _pair(make, device):
    torch.manual_seed(0)
    cpu = make()
    fake = make()
    fake.load_state_dict(cpu.state_dict())
    return cpu, fake.to(device)


def test_autograd_sequential_matches_cpu(fake_device):
    cpu, fake = _pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2)), fake_device)
    x = torch.randn(5, 8)
    cpu(x).square().mean().backward()
    fake(x.to(fake_device)).square().mean().backward()
    for p, q in zip(cpu.parameters(), fake.parameters()):
        _same(q.grad, p.grad, atol=1e-6)


@pytest.mark.parametrize("foreach", [False, None], ids=["for_loop", "default"])
def test_adamw_step_matches_cpu(fake_device, foreach):
    cpu, fake = _pair(lambda: nn.Linear(6, 3), fake_device)
    x = torch.randn(4, 6)
    steps = []
    for model, data in ((cpu, x), (fake, x.to(fake_device))):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, foreach=foreach)
        for _ in range(2):
            opt.zero_grad()
            model(data).square().sum().backward()
            opt.step()
        steps.append(opt)
    for p, q in zip(cpu.parameters(), fake.parameters()):
        _same(q.detach(), p.detach(), atol=1e-6)
        assert steps[1].state[q]["exp_avg"].device.type == "fakegpu"


UNET_CONFIG = dict(
    sample_size=8,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=32,
)


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_unet_forward_backward_matches_cpu(fake_device, use_checkpoint):
    from diffusers import UNet2DConditionModel

    cpu, fake = _pair(lambda: UNet2DConditionModel(**UNET_CONFIG), fake_device)
    calls = []
    if use_checkpoint:
        block = fake.down_blocks[0]
        inner = block.forward
        block.forward = lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k)
        block.resnets[0].register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(1)
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 7, 32)
    out = cpu(x, t, ctx).sample
    fout = fake(x.to(fake_device), t.to(fake_device), ctx.to(fake_device)).sample
    _same(fout.detach(), out.detach(), atol=1e-5)
    out.square().mean().backward()
    fout.square().mean().backward()
    for (name, p), q in zip(cpu.named_parameters(), fake.parameters()):
        assert q.grad is not None, name
        _same(q.grad, p.grad, atol=1e-5)
    if use_checkpoint:
        assert len(calls) == 2  # forward, then the recompute during backward


def test_checkpoint_replays_fake_device_rng(fake_device):
    # Dropout on fakegpu draws from the device's own stream; the recompute only matches the
    # forward if checkpointing saves and restores it through torch.fakegpu.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 4)).to(fake_device)
    x = torch.randn(16, 8).to(fake_device)

    def grads(use_checkpoint):
        model.zero_grad()
        torch.manual_seed(1)
        y = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
        y.square().sum().backward()
        return [p.grad.cpu() for p in model.parameters()]

    for plain, replayed in zip(grads(False), grads(True)):
        assert torch.equal(plain, replayed)


def test_random_stream_is_its_own_and_seeded(fake_device):
    torch.manual_seed(3)
    first = torch.randn(4, device=fake_device).cpu()
    torch.manual_seed(3)
    torch.randn(100)  # CPU draws must not advance the device stream
    assert torch.equal(torch.randn(4, device=fake_device).cpu(), first)
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(4, device=fake_device, generator=torch.Generator())


def test_out_variants_and_resize_grow_the_tensor(fake_device):
    out = torch.empty(0, device=fake_device)
    torch.add(torch.ones(3, device=fake_device), 1, out=out)
    _same(out, torch.full((3,), 2.0))
    grown = torch.ones(2, device=fake_device).resize_(5)
    assert grown.shape == (5,) and grown.cpu()[:2].tolist() == [1.0, 1.0]
    same = torch.zeros(2, 3, device=fake_device).t().resize_(3, 2)  # same size: strides stay, as on CPU
    assert same.stride() == torch.zeros(2, 3).t().resize_(3, 2).stride() == (1, 3)


def test_storage_allocation_on_device_is_refused_not_crashing(fake_device):
    buf = io.BytesIO()
    torch.save(torch.ones(2), buf)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="no storage allocator"):
        torch.load(buf, map_location=fake_device)


def test_group_norm_on_a_channels_last_batch(fake_device):
    # A VAE mid-block attention hands the next GroupNorm a channels-last tensor; torch's fallback
    # kernel for devices without their own cannot view that layout at batch >= 2.
    torch.manual_seed(0)
    norm = nn.GroupNorm(4, 16)
    x = torch.randn(2, 16, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
    fx = x.detach().to(fake_device).to(memory_format=torch.channels_last).requires_grad_()
    fake_norm = nn.GroupNorm(4, 16).to(fake_device)
    fake_norm.load_state_dict(norm.state_dict())
    expected, got = norm(x), fake_norm(fx)
    _same(got, expected, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    _same(fx.grad, x.grad, atol=1e-4)
    _same(fake_norm.weight.grad, norm.weight.grad, atol=1e-4)


def test_tiny_vae_encodes_a_batch_of_two(fake_device, tiny_model):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_model / "vae")
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = vae.encode(pixels).latent_dist.mean
        got = vae.to(fake_device).encode(pixels.to(fake_device)).latent_dist.mean
    _same(got, expected, atol=1e-4)


@pytest.mark.parametrize("compute", [
    lambda x: x % 2,
    lambda x: torch.remainder(x, 2),
    lambda x: torch.fmod(x, 1.5),
    lambda x: torch.xlogy(2, x.abs()),  # the number in the first argument
    lambda x: x.double() % 0.1,  # 0.1 reaches a float64 kernel unrounded
    lambda x: x[0].half() % 0.7,  # a 0-dim tensor with a number computes in its own dtype
    lambda x: x.long() % 2.5,  # a float number makes an integer tensor's result float
    lambda x: x.long() & 3,
])
def test_a_python_number_where_the_op_takes_a_tensor_matches_cpu(fake_device, compute):
    """torch hands the fallback a wrapped number (`x % 2` calls remainder with `2` as a Tensor) as
    a Python number, which the CPU op refused for its Tensor argument."""
    x = torch.randn(6, generator=torch.Generator().manual_seed(0)) * 10
    _same(compute(x.to(fake_device)), compute(x))


def test_complex_rotary_backward_matches_cpu(fake_device):
    """A rotary embedding in complex numbers (FIBO-2's): its backward multiplies by a lazily
    conjugated view, whose copy onto the device once recursed until the process crashed."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    freqs = torch.polar(torch.ones(5, 4), torch.randn(5, 4))

    def rotate(x, freqs):
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs).flatten(-2)

    cpu_x = x.clone().requires_grad_(True)
    rotate(cpu_x, freqs).square().sum().backward()
    fake_x = x.to(fake_device).requires_grad_(True)
    rotate(fake_x, freqs.to(fake_device)).square().sum().backward()
    _same(fake_x.grad, cpu_x.grad, atol=1e-6)
    lazy = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
    _same(lazy.to(fake_device).conj().clone(), lazy.conj().clone())
    _same(torch._neg_view(x.to(fake_device)).clone(), -x)
