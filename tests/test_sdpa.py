"""Training pins the attention kernels (flash, memory-efficient, math as the fallback) and gives the
process its own choice back afterwards, also when training raises."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from torch.nn.attention import SDPBackend

from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.sdpa import PINNED, SdpaState, current_state, pinned_sdpa, restore_state


@pytest.fixture
def unusual_state():
    """A state no pin would produce: flash off, cuDNN on and first; the test's own state comes back after."""
    original = current_state()
    enabled = dict(original.enabled)
    enabled.update({SDPBackend.FLASH_ATTENTION: False, SDPBackend.CUDNN_ATTENTION: True})
    cudnn = int(SDPBackend.CUDNN_ATTENTION)
    priority = [cudnn] + [b for b in original.priority if b != cudnn]
    state = SdpaState(tuple(enabled.items()), tuple(priority))
    restore_state(state)
    assert current_state() == state
    yield state
    restore_state(original)


def assert_pinned(state: SdpaState) -> None:
    assert {backend for backend, on in state.enabled if on} == set(PINNED)
    assert state.priority[:len(PINNED)] == tuple(int(b) for b in PINNED)


def test_the_pin_is_undone_exactly_also_after_an_error(unusual_state):
    with pinned_sdpa():
        assert_pinned(current_state())
        q = torch.randn(1, 2, 8, 4)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)  # some kernel still serves the CPU
    assert current_state() == unusual_state
    with pytest.raises(KeyError), pinned_sdpa():
        raise KeyError("boom")
    assert current_state() == unusual_state


class Spy(TrainCallbacks):
    def __init__(self, fail: bool = False):
        self.seen: list[SdpaState] = []
        self.fail = fail

    def on_started(self, total_steps):
        self.seen.append(current_state())
        if self.fail:
            raise RuntimeError("callback failed")

    def on_progress(self, progress):
        self.seen.append(current_state())


def test_training_runs_pinned_and_restores_the_state_after_a_run_and_after_an_error(unusual_state, tiny_model,
                                                                                    one_image, tmp_path):
    spy = Spy()
    trainer = GenericTrainer(train_config(tiny_model, one_image, tmp_path, {"schedule": {"max_steps": 1}}), spy)
    trainer.start()
    assert current_state() == unusual_state  # loading and caching leave it alone
    trainer.train()
    assert trainer.step == 1 and len(spy.seen) == 2
    for seen in spy.seen:
        assert_pinned(seen)
    assert current_state() == unusual_state
    trainer.callbacks = Spy(fail=True)
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train()
    assert_pinned(trainer.callbacks.seen[0])
    assert current_state() == unusual_state
