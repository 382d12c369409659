"""Layer offloading and gradient checkpointing: the schedule, what moves, and that training is
unchanged by it. The train device is the fake second device (tests/fake_device.py), so a tensor
left on the wrong side raises as it would on CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from torch import nn

from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.offload.checkpointing import checkpointed_call
from modules.offload.conductor import LayerOffloadConductor
from modules.offload.layer_tensors import layer_tensors
from modules.offload.planning import auto_offload_fraction
from modules.offload.schedule import Pass, choose_parked, schedule_table
from modules.quantization.base import QuantizedLinear
from modules.quantization.replace import quantize_model_
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer

F, B, O = Pass.FORWARD_THEN_BACKWARD, Pass.BACKWARD, Pass.FORWARD_ONLY  # noqa: E741 (the schedule tables read as letters)


# --- the schedule, as tables ---------------------------------------------------------------------

def test_schedule_tables_for_six_blocks_with_every_other_one_parked():
    # (block running, parked blocks on the train device meanwhile); -1: after the pass
    assert schedule_table(6, [1, 3, 5], F) == [
        (0, (1, 3)), (1, (1, 3)), (2, (3, 5)), (3, (3, 5)), (4, (3, 5)), (5, (3, 5)), (-1, (3, 5))]
    assert schedule_table(6, [1, 3, 5], B) == [
        (5, (3, 5)), (4, (1, 3)), (3, (1, 3)), (2, (1, 3)), (1, (1, 3)), (0, (1, 3)), (-1, (1, 3))]
    assert schedule_table(6, [1, 3, 5], O) == [
        (0, (1, 3)), (1, (1, 3)), (2, (3, 5)), (3, (3, 5)), (4, (1, 5)), (5, (1, 5)), (-1, (1, 3))]


def test_every_parked_block_is_resident_while_it_runs_and_two_stay_resident():
    for parked in ([0], [0, 1], [2, 5, 6], list(range(8))):
        for kind in Pass:
            for block, resident in schedule_table(8, parked, kind):
                if block in parked:
                    assert block in resident, (parked, kind, block)
                assert len(resident) == min(2, len(parked))


@pytest.mark.parametrize("sizes, fraction, expected", [
    ([1] * 8, 0.5, [1, 3, 5, 7]),
    ([1] * 8, 0.25, [2, 6]),
    ([1] * 8, 0.01, [0]),
    ([1] * 8, 1.0, list(range(8))),
    ([1] * 8, 0.0, []),
    ([10, 1, 1, 1], 0.5, [0]),  # by bytes: the big one alone is past half
    ([1, 1, 2, 2, 1, 1], 0.5, [1, 3, 5]),
])
def test_parked_blocks_reach_the_fraction_spread_over_the_stack(sizes, fraction, expected):
    assert choose_parked(sizes, fraction) == expected


@pytest.mark.parametrize("part, offloadable, other, free, expected", [
    (100, 90, 0, 1000, 0.0),  # fits
    (100, 90, 0, None, 0.0),  # free memory unknown
    (100, 90, 0, 100, 0.25),  # budget 80: 20 of 90 over -> 0.222 -> rounded up to 0.25
    (100, 90, 30, 100, 0.6),  # other parts take 30 of the budget
    (100, 90, 0, 10, 1.0),  # cannot fit: everything offloadable
])
def test_auto_offload_fraction(part, offloadable, other, free, expected):
    assert auto_offload_fraction(part, offloadable, other, free) == pytest.approx(expected)


# --- the conductor on a toy stack ---------------------------------------------------------------

class Checkpointed(nn.Module):
    """A block whose forward is recomputed in the backward pass, as the model libraries do."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpointed_call(self.block, x) if torch.is_grad_enabled() else self.block(x)


def toy_stack(quantized: bool) -> tuple[nn.Sequential, list[nn.Module]]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)) for _ in range(6)]
    model = nn.Sequential(*[Checkpointed(b) for b in blocks])
    if quantized:
        quantize_model_(model, "toy", "float8", torch.float32)
        blocks = [c.block for c in model]
    return model.requires_grad_(False), blocks


def start(model, blocks, fake_device, fraction=0.5, prefetch=1):
    conductor = LayerOffloadConductor(blocks, fraction, fake_device, torch.device("cpu"), "toy", prefetch)
    conductor.start()
    owned = conductor.owned_modules()
    for child in model.modules():
        if id(child) not in owned:
            child._apply(lambda t: t.to(fake_device), recurse=False)
    return conductor


def devices_of(block) -> set[str]:
    return {t.get().device.type for t in layer_tensors(block)}


@pytest.mark.parametrize("quantized, prefetch", [(False, 1), (True, 1), (False, 2)])
def test_the_conductor_follows_the_schedule_in_a_training_step_and_a_forward_only_pass(fake_device, quantized,
                                                                                       prefetch):
    model, blocks = toy_stack(quantized)
    conductor = start(model, blocks, fake_device, prefetch=prefetch)
    window = 1 + prefetch
    assert conductor.parked == [1, 3, 5]
    x = torch.randn(4, 32, device=fake_device, requires_grad=True)
    conductor.recording = True
    model(x).sum().backward()
    with torch.no_grad():
        model(x)
    # the checkpointed recomputation brings each block back, in reverse, inside the backward pass
    expected = ([(F, b, r) for b, r in schedule_table(6, [1, 3, 5], F, window)[:-1]]
                + [(B, b, r) for b, r in schedule_table(6, [1, 3, 5], B, window)[:-1]]
                + [(O, b, r) for b, r in schedule_table(6, [1, 3, 5], O, window)[:-1]])
    assert conductor.trace == expected
    for index, block in enumerate(blocks):
        resident = index not in conductor.parked or index in conductor.resident
        assert devices_of(block) == ({fake_device.type} if resident else {"cpu"}), index


def test_exactly_each_layers_offload_tensors_move_and_parameters_keep_their_identity(fake_device):
    model, blocks = toy_stack(quantized=True)
    identities = {name: id(p) for name, p in model.named_parameters()}
    conductor = start(model, blocks, fake_device)
    layer = blocks[5][0]
    assert isinstance(layer, QuantizedLinear)
    conductor.evict()
    assert {name: t.device.type for name, t in layer.offload_tensors().items()} == dict.fromkeys(
        ["bias", "weight", "scale"], "cpu")
    model(torch.randn(2, 32, device=fake_device, requires_grad=True)).sum().backward()
    conductor.materialize()
    assert 5 not in conductor.resident and devices_of(blocks[5]) == {"cpu"}
    with torch.no_grad():
        model[:5](torch.randn(2, 32, device=fake_device))
        assert 5 in conductor.resident  # prefetched while block 4 ran
    assert {name: t.device.type for name, t in layer.offload_tensors().items()} == dict.fromkeys(
        ["bias", "weight", "scale"], fake_device.type)
    assert {name: id(p) for name, p in model.named_parameters()} == identities


def test_a_parked_block_that_never_came_back_would_fail_loudly(fake_device):
    # the guard the fake device gives these tests: with a hook removed, the parked block's
    # weights stay on the CPU and the first forward raises instead of silently computing there
    model, blocks = toy_stack(quantized=False)
    conductor = start(model, blocks, fake_device)
    conductor.evict()
    conductor.stop()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        model(torch.randn(2, 32, device=fake_device))


def test_activation_offloading_keeps_block_inputs_on_the_temp_device(fake_device, monkeypatch):
    import torch.utils.checkpoint as checkpoint_module

    held = []
    original = checkpoint_module.checkpoint

    def recording(function, *args, **kwargs):
        held.extend(a.device.type for a in args if isinstance(a, torch.Tensor) and a.numel())  # not the marker
        return original(function, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "checkpoint", recording)
    torch.manual_seed(0)
    layer = nn.Linear(16, 16).to(fake_device)
    x = torch.randn(3, 16, device=fake_device, requires_grad=True)
    checkpointed_call(layer, x, offload_to=torch.device("cpu")).sum().backward()
    grad_offloaded = x.grad.clone()
    x.grad = None
    checkpointed_call(layer, x).sum().backward()
    assert held == ["cpu", fake_device.type]
    assert torch.equal(grad_offloaded.cpu(), x.grad.cpu())


# --- config -------------------------------------------------------------------------------------

def test_offloading_a_trained_part_without_checkpointing_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.parts\.unet\.offload_fraction: layer offloading of a trained "
                                          r"part needs gradient_checkpointing"):
        build_config([{"model": {"parts": {"unet": {"offload_fraction": 0.5}}}}])
    # a frozen part only runs forward: offloading it needs no recomputation
    build_config([{"model": {"parts": {"text_encoder": {"offload_fraction": 0.5}}}}])


def test_the_unet_blocks_are_listed_in_the_order_the_unet_runs_them(tiny_model, shape_images, tmp_path):
    from modules.model.sd15 import SD15Family

    family = SD15Family(train_config(tiny_model, shape_images, tmp_path))
    family.load()
    blocks = family.checkpoint_blocks("unet")
    ran = []
    for block in blocks:
        block.register_forward_pre_hook(lambda module, args: ran.append(module))
    unet = family.parts["unet"]
    with torch.no_grad():
        unet(torch.randn(1, 4, 8, 8), torch.tensor([10]), encoder_hidden_states=torch.randn(1, 77, 32))
    assert [id(b) for b in ran] == [id(b) for b in blocks]
    assert len(blocks) == len({id(b) for b in blocks}) > 6


# --- training -----------------------------------------------------------------------------------


def offload_run(tmp_path, tiny_model, images, device, unet: dict, steps=3, adapter=None, text=None):
    config = train_config(tiny_model, images, tmp_path, {
        "model": {"parts": {"unet": {"gradient_checkpointing": True, **unet}, **({"text_encoder": text} if text else {})}},
        "schedule": {"epochs": steps, "batch_size": 1},
        "adapter": adapter or {},
        "train_device": str(device),
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    trainer.train()
    return trainer


def test_training_with_half_the_unet_offloaded_gives_the_same_adapter_as_without(fake_device, tmp_path, tiny_model,
                                                                                 one_image):
    # two steps: the second already runs on the optimizer state the first left, offloaded or not
    plain = offload_run(tmp_path / "plain", tiny_model, one_image, fake_device, {"offload_fraction": 0.0}, steps=2)
    offloaded = offload_run(tmp_path / "half", tiny_model, one_image, fake_device, {"offload_fraction": 0.5}, steps=2)
    conductor = offloaded.conductors["unet"]
    assert conductor.parked and conductor.moves > len(conductor.parked)
    assert conductor.kit is not None  # CUDA's path: side-stream prefetch, pinned arenas (tests/fake_device_streams.py)
    ours, theirs = offloaded.adapters.state_dict(), plain.adapters.state_dict()
    assert set(ours) == set(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key].cpu(), theirs[key].cpu(), atol=1e-5, rtol=0)
    assert not torch.equal(ours[next(k for k in ours if k.endswith("lora_up.weight"))].cpu(),
                           torch.zeros_like(ours[next(k for k in ours if k.endswith("lora_up.weight"))].cpu()))


def test_a_frozen_text_encoder_offloads_through_caching_and_sampling(fake_device, tmp_path, tiny_model, one_image):
    trainer = offload_run(tmp_path, tiny_model, one_image, fake_device,
                          {"offload_fraction": 0.9, "offload_prefetch": 2}, text={"offload_fraction": 1.0}, steps=1)
    # its text cached, the encoder is idle in the step (trainer/idle_parts.py): its conductor leaves the
    # step's, and it comes back through that conductor for samples
    assert "text_encoder" not in trainer.conductors and trainer.conductors["unet"].window == 3
    (idle,) = [part for part in trainer.idle_parts if part.name == "text_encoder"]
    assert idle.conductor.parked == [0, 1] and idle.conductor.window == 2
    encoder = trainer.family.parts["text_encoder"]
    assert all(p.device.type != fake_device.type for p in encoder.parameters())
    trainer.config.sampling.prompts = [{"prompt": "a red circle", "steps": 2, "width": 64, "height": 64}]
    assert len(trainer.sample()) == 1
    assert all(p.device.type != fake_device.type for p in encoder.parameters())  # home again after sampling


def test_info_reports_the_auto_offload_fraction_the_family_would_need():
    from modules.cli.info import _auto_offload

    sizes = {"text_encoder": 123_060_480, "unet": 859_520_964, "vae": 83_653_863}
    modes = dict.fromkeys(sizes, "bfloat16")
    assert _auto_offload(modes, sizes, 64 * 2**30) == dict.fromkeys(sizes, 0.0)
    tight = _auto_offload(modes, sizes, 2 * 2**30)  # 1.6 GiB budget for ~2.1 GB of weights
    assert 0 < tight["unet"] < 1 and tight["unet"] * 100 % 5 == pytest.approx(0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("quantized", [False, True])
def test_on_cuda_pinned_prefetched_blocks_give_the_same_step_as_no_offloading(quantized):
    device = torch.device("cuda")
    model, blocks = toy_stack(quantized)
    reference, _ = toy_stack(quantized)
    reference.to(device)
    conductor = start(model, blocks, device)
    assert all(home.is_pinned() for index in conductor.parked for home in conductor._home[index])
    x = torch.randn(8, 32, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    for _ in range(3):  # several steps: the second block of each window arrives by the side stream
        out, expected = model(x), reference(x_ref)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, x_ref.grad)
    torch.cuda.synchronize()
    assert conductor.moves > len(conductor.parked)
