"""torch.compile: the gate finds real blockers (a graph break, a device inductor cannot generate
code for), the trainer compiles each repeated block (one graph reused, dynamic shapes) and turns
compile off with the reason where it cannot work, and `info` says per weight mode whether it can."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import train_config
from torch import nn

import modules.trainer.regional_compile as regional_compile
from modules.quantization.compile_gate import compile_blocker, device_blocker, graph_blocker
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class DataDependentBlock(Block):
    def forward(self, x):
        hidden = self.up(x)
        if hidden.mean().item() > 0:  # Python control flow on a tensor's value: dynamo must break the graph
            hidden = hidden * 2
        return x + self.down(hidden)


class Log(TrainCallbacks):
    def __init__(self):
        self.status, self.warnings = [], []

    def on_status(self, message):
        self.status.append(message)

    def on_warning(self, message):
        self.warnings.append(message)


# --- the gate --------------------------------------------------------------------------------------


def test_the_gate_finds_a_graph_break_and_passes_a_block_that_traces():
    x = torch.randn(4, 16)
    assert graph_blocker(Block(), x) is None
    blocker = graph_blocker(DataDependentBlock(), x)
    assert blocker and "graph break" in blocker


def test_the_gate_refuses_a_device_without_a_code_generator(fake_device):
    assert device_blocker(torch.device("cpu")) is None
    assert device_blocker(fake_device) == "torch.compile (inductor) has no code generator for fakegpu devices"
    # dynamo alone traces a fakegpu layer; only the device check sees what the first compiled call would hit
    assert graph_blocker(nn.Linear(8, 8).to(fake_device), torch.randn(2, 8, device=fake_device)) is None
    assert compile_blocker("float32", str(fake_device), torch.float32) == device_blocker(fake_device)
    assert compile_blocker("float32", "cpu", torch.float32) is None


# --- regional compile ------------------------------------------------------------------------------


def test_repeated_blocks_compile_once_and_reuse_the_graph_at_every_shape(monkeypatch):
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    monkeypatch.setattr(regional_compile, "BACKEND", counting_backend)
    torch.manual_seed(0)
    part = nn.Sequential(*[Block() for _ in range(4)])
    eager = copy.deepcopy(part)
    compiled = regional_compile.compile_regions_(part, list(part))
    assert compiled == list(part) and all(block._compiled_call_impl is not None for block in part)
    assert part._compiled_call_impl is None  # the blocks, not the whole part
    for batch in (3, 5):  # a second batch size reuses the graph: dynamic=True
        x = torch.randn(batch, 16, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, expected = part(x), eager(x_eager)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
        for ours, theirs in zip(part.parameters(), eager.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad)
    assert len(graphs) == 1


def test_a_part_without_blocks_compiles_whole():
    part = Block()
    assert regional_compile.compile_regions_(part, []) == [part] and part._compiled_call_impl is not None


def test_a_real_family_block_with_its_adapter_compiles_and_matches_eager(monkeypatch, tiny_model, shape_images,
                                                                        tmp_path):
    """One transformer block of the tiny SD1.5 UNet, with a LoRA hooked on a layer inside it, through
    dynamo and AOT autograd (inductor's front half; its C++ code generation is too slow for the suite)."""
    from modules.adapters.lora import LoRAModule
    from modules.model.sd15 import SD15Family

    monkeypatch.setattr(regional_compile, "BACKEND", "aot_eager")
    family = SD15Family(train_config(tiny_model, shape_images, tmp_path))
    family.load()
    block = next(b for b in family.checkpoint_blocks("unet") if type(b).__name__ == "Transformer2DModel")
    torch.manual_seed(0)
    adapter = LoRAModule("lora_q", block.transformer_blocks[0].attn1.to_q, 4, 4, device=torch.device("cpu"),
                         dtype=torch.float32)
    nn.init.normal_(adapter.lora_up.weight)  # a trained adapter: its output reaches the block's
    adapter.hook()
    x = torch.randn(2, block.config.in_channels, 8, 8)
    text = torch.randn(2, 77, block.config.cross_attention_dim)

    def run():
        out = block(x, encoder_hidden_states=text).sample
        grads = torch.autograd.grad(out.square().sum(), list(adapter.parameters()))
        return out.detach(), grads

    expected, expected_grads = run()
    regional_compile.compile_regions_(family.parts["unet"], [block])
    out, grads = run()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# --- the trainer -----------------------------------------------------------------------------------


def _start(tiny_model, images, tmp_path, overlay) -> tuple[GenericTrainer, Log]:
    log = Log()
    trainer = GenericTrainer(train_config(tiny_model, images, tmp_path, {"compile": True}, overlay), log)
    trainer.start()
    return trainer, log


def test_the_trainer_compiles_each_repeated_block_of_the_denoiser(tiny_model, shape_images, tmp_path):
    trainer, log = _start(tiny_model, shape_images, tmp_path, {})
    blocks = trainer.family.checkpoint_blocks("unet")
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    assert trainer.family.parts["unet"]._compiled_call_impl is None
    assert f"compile: model.parts.unet: {len(blocks)} block(s) compile on first use" in log.status
    assert not log.warnings


@pytest.mark.parametrize("offload", [0.5, 0.0], ids=["offloaded", "device"])
def test_the_trainer_turns_compile_off_with_the_reason(offload, fake_device, tiny_model, shape_images, tmp_path):
    trainer, log = _start(tiny_model, shape_images, tmp_path, {
        "train_device": str(fake_device),
        "model": {"parts": {"unet": {"gradient_checkpointing": True, "offload_fraction": offload}}}})
    reason = ("layer offloading moves weights between blocks" if offload
              else "torch.compile (inductor) has no code generator for fakegpu devices")
    assert any(w.startswith("compile: off for model.parts.unet (") and reason in w for w in log.warnings), log.warnings
    unet = trainer.family.parts["unet"]
    assert all(module._compiled_call_impl is None for module in unet.modules())


# --- info --------------------------------------------------------------------------------------------


def test_info_says_per_weight_mode_whether_compile_works(fake_device):
    from modules.cli.info import format_info, machine_info

    here = machine_info("cpu")["weight_dtypes"]
    for mode in ("float32", "bfloat16", "float8"):
        assert here[mode]["supports_compile"] is True and here[mode]["compile_blocker"] is None, (mode, here[mode])
    fake = machine_info(str(fake_device))
    for mode, support in fake["weight_dtypes"].items():
        assert support["supports_compile"] is False, mode
        assert support["compile_blocker"], mode
    assert fake["weight_dtypes"]["float32"]["compile_blocker"] == device_blocker(fake_device)
    assert "compile: no (torch.compile (inductor) has no code generator for fakegpu devices)" in format_info(fake)
