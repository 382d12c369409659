"""`offload_fraction: auto` counts what is really on the train device when a part is placed: a part
parked wholly holds only its non-block layers and a window of blocks there, and a part already
there is in the device's free memory already. The train device is the fake second device with a
capacity: its free memory is the capacity less the bytes of the model's tensors on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import modules.trainer.offload_fraction as offload_fraction_module
from modules.trainer.offload_fraction import bytes_on
from modules.trainer.part_setup import setup_train_device

LINEAR = 64 * 64 * 4 + 64 * 4  # bytes of one float32 Linear(64, 64)


class Stack(nn.Module):
    def __init__(self, blocks: int, extra: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(blocks))
        self.embed = nn.Linear(64, 64) if extra else None


class Encoder(nn.Module):
    """A text encoder whose token table (frozen) stays on the host: host_tables.py finds it."""

    def __init__(self, blocks: int, rows: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(blocks))
        self.table = nn.Embedding(rows, 64)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.table


def toy_trainer(device, capacity: int, fractions: dict[str, float | str], table_rows: int = 0):
    parts = {name: Encoder(4, table_rows) if table_rows and name == "text_encoder" else
             Stack(8 if name == "transformer" else 4, extra=name == "text_encoder") for name in fractions}
    config = SimpleNamespace(
        temp_device="cpu", tf32=True, method=SimpleNamespace(type="adapter"), embeddings=[],
        distributed=SimpleNamespace(shard_parts=[]), model=SimpleNamespace(parts={name: SimpleNamespace(offload_fraction=f, offload_prefetch=1, train=False)
                                     for name, f in fractions.items()}))
    family = SimpleNamespace(name="toy", parts=parts, checkpoint_blocks=lambda name: list(parts[name].blocks),
                             resting_parts=lambda: (), text_parts=("text_encoder",) if table_rows else (),
                             embedding_slots={}, never_run={})
    statuses = []
    trainer = SimpleNamespace(config=config, family=family, device=device, trained_parts=[],
                              callbacks=SimpleNamespace(on_status=statuses.append))
    return trainer, statuses


@pytest.fixture
def capacity(monkeypatch, fake_device):
    """Set the fake device's capacity: detect_capabilities then reports it less what the model has there."""
    state = {}

    def detect(device):
        held = sum(bytes_on(m, torch.device(device)) for m in state["trainer"].family.parts.values())
        return SimpleNamespace(free_memory=state["capacity"] - held)

    monkeypatch.setattr(offload_fraction_module, "detect_capabilities", detect)

    def make(total: int, fractions: dict, before=None, table_rows: int = 0):
        trainer, statuses = toy_trainer(fake_device, total, fractions, table_rows)
        state.update(trainer=trainer, capacity=total)
        if before:
            before(trainer)
        return trainer, statuses, setup_train_device(trainer)

    return make


def test_a_part_parked_wholly_counts_only_what_it_leaves_on_the_train_device(capacity):
    # the text encoder (5 Linears) at 1.0 leaves its embedding and two resident blocks: 3 Linears.
    # 0.8 x 240000 holds those and the 8-Linear transformer whole; counting the encoder whole
    # as well, the transformer parked half its blocks
    trainer, statuses, conductors = capacity(240_000, {"text_encoder": 1.0, "transformer": "auto"})
    assert "model.parts.transformer.offload_fraction: auto -> 0" in statuses
    assert "transformer" not in conductors and conductors["text_encoder"].parked == [0, 1, 2, 3]


def test_a_part_already_on_the_train_device_is_not_counted_twice(capacity):
    # quantized on the device, say: its bytes are already out of the free memory
    def already_there(trainer):
        trainer.family.parts["transformer"].to(trainer.device)

    trainer, statuses, conductors = capacity(240_000, {"text_encoder": 1.0, "transformer": "auto"}, already_there)
    assert "model.parts.transformer.offload_fraction: auto -> 0" in statuses and "transformer" not in conductors


def test_auto_still_parks_what_does_not_fit_and_sees_the_fixed_parts_placed_before_it(capacity):
    # listed first, the auto part is still placed after the fixed one, so it counts the 3 Linears
    # the encoder leaves: 0.8 x 200000 - 3 x 16640 leaves room for 6.6 of its 8 Linears, and the
    # two parked blocks it holds at once must fit too: 3.4 of 8 parked -> 0.45, 4 blocks
    trainer, statuses, conductors = capacity(200_000, {"transformer": "auto", "text_encoder": 1.0})
    assert "model.parts.transformer.offload_fraction: auto -> 0.45" in statuses
    assert len(conductors["transformer"].parked) == 4
    held = sum(bytes_on(m, trainer.device) for m in trainer.family.parts.values())
    assert held == (3 + 4 + 2) * LINEAR <= 0.8 * 200_000


def test_a_token_table_on_the_host_is_not_counted_as_unparkable(capacity):
    # the encoder's 1000 x 64 float32 table (256000 bytes) stays on the host; its 4 blocks and the
    # 8-block transformer fit 0.8 x 250000 whole. Counting the table among the encoder's bytes that
    # cannot be parked (it is placed after the transformer), the transformer parked every block
    trainer, statuses, conductors = capacity(250_000, {"transformer": "auto", "text_encoder": "auto"},
                                             table_rows=1000)
    assert trainer.family.parts["text_encoder"].table.weight.device.type == "cpu"
    assert "model.parts.transformer.offload_fraction: auto -> 0" in statuses, statuses
    assert "model.parts.text_encoder.offload_fraction: auto -> 0" in statuses and not conductors
