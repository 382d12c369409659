"""LayerOffloadConductor: keeps a part's parked blocks on the temp device and brings each to the
train device just before it runs, following schedule.py.

Parked blocks are chosen once (choose_parked: `offload_fraction` of the offloadable bytes, spread
over the stack). Their frozen base tensors get a permanent copy on the temp device (pinned host
memory on CUDA); bringing a block in copies it to the train device, and sending it away just
points the tensors back at that copy, so eviction costs no transfer for frozen base weights. A
block whose trained weights (a full fine-tune) may have been stepped since it came writes them
home first, and its optimizer state travels with it (trained_tensors.py says where and why).

Every layer of a block gets a forward pre-hook (the block's own hooks would not fire when a
checkpoint recomputes its forward); the first layer of a block to run arranges the window, the
rest find it arranged. The pass is read from autograd: inside the backward pass (gradient
checkpointing recomputes a block there) the blocks come in reverse; a forward with grad enabled
is a training step whose backward follows; without grad, another forward follows.

Where the train device has streams (CUDA, or a test device that registers as one:
modules/util/async_devices.py) the home copies sit in pinned arenas (pinned_arenas.py), the
rest of the window (`offload_prefetch` blocks) is prefetched on a side stream and the compute
stream waits on its event before using it, and a stepped block's write-back home runs on the side stream too: the
next copy out of that home waits on its event, and the host waits for every write-back before a
backward pass returns (a save or sample reads the homes) and before an eviction. Elsewhere moves
are plain synchronous copies.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from modules.offload.layer_tensors import LayerTensor, block_bytes, layer_tensors
from modules.offload.pinned_arenas import pinned_homes
from modules.offload.trained_tensors import ParkedOptimizerState, write_home
from modules.util.async_devices import async_device
from modules.offload.schedule import (
    DEFAULT_PREFETCH,
    Pass,
    choose_parked,
    resident_after,
    resident_when_running,
)


def _fits_arena(value: torch.Tensor) -> bool:
    return type(value) in (torch.Tensor, nn.Parameter) and value.is_contiguous()


def current_pass() -> Pass:
    if torch._C._current_graph_task_id() != -1:  # we are inside autograd's backward
        return Pass.BACKWARD
    return Pass.FORWARD_THEN_BACKWARD if torch.is_grad_enabled() else Pass.FORWARD_ONLY


class LayerOffloadConductor:
    def __init__(self, blocks: list[nn.Module], fraction: float, train_device: torch.device,
                 temp_device: torch.device, name: str = "part", prefetch: int = DEFAULT_PREFETCH):
        self.blocks = blocks
        self.window = 1 + prefetch  # the block that runs and those prefetched after it
        self.name = name
        self.train_device, self.temp_device = torch.device(train_device), torch.device(temp_device)
        self.kit = async_device(self.train_device)  # streams and pinned memory, or None
        self.streams = self.kit.streams if self.kit else None
        self.pin = self.kit is not None and self.temp_device.type == "cpu"
        self.parked = choose_parked([block_bytes(b) for b in blocks], fraction, self.window)
        self.parked_set = set(self.parked)
        self._tensors: dict[int, list[LayerTensor]] = {i: list(layer_tensors(blocks[i])) for i in self.parked}
        self._home: dict[int, list[torch.Tensor]] = {}  # block -> its tensors' copies on the temp device
        self.resident: set[int] = set()
        self._events: dict[int, object] = {}  # block -> event of its prefetch on the side stream
        self._landing: dict[int, object] = {}  # block -> event of its write-back home on the side stream
        self._sync_queued = False
        self._stream = self.streams.Stream(self.train_device) if self.kit else None
        self._handles = []
        self.moves = 0  # blocks brought to the train device (for tests and benchmarks)
        self.trace: list[tuple[Pass, int, tuple[int, ...]]] = []  # (pass, block, resident) when recording
        self.recording = False
        self._arranged_for: tuple[int, Pass] | None = None
        # parked blocks on the train device whose trained tensors may have changed since they came,
        # written home on leaving: stepped in their backward, or brought outside a training step's
        # forward (a resumed run loads into them; around sampling the EMA is swapped in and out).
        # Only a training step's forward brings blocks that are sure to stay as their home copy.
        self._changed: set[int] = set()
        self.optimizer_state = ParkedOptimizerState(self.train_device, self.temp_device,
                                                    self.kit if self.pin else None)

    # --- set-up ----------------------------------------------------------------------------

    def owned_modules(self) -> set[int]:
        """ids of the modules whose tensors this conductor moves (the rest of the part is moved
        to the train device once, by the trainer)."""
        return {id(t.module) for tensors in self._tensors.values() for t in tensors}

    def start(self) -> None:
        """Park the chosen blocks on the temp device (each keeps that copy) and hook every block."""
        entries = [(index, tensor) for index in self.parked for tensor in self._tensors[index]]
        homes: list[torch.Tensor | None] = [None] * len(entries)

        def park(i: int, home: torch.Tensor) -> None:
            entries[i][1].put(home)
            homes[i] = home

        # async host-to-device copies need pinned memory: plain contiguous tensors go into arenas
        in_arena = [i for i, (_, t) in enumerate(entries) if self.pin and _fits_arena(t.get())]
        if in_arena:
            values = [entries[i][1].get().detach() for i in in_arena]
            pinned_homes(values, self.kit, lambda k, home: park(in_arena[k], home))
        for i, (_, tensor) in enumerate(entries):
            if homes[i] is None:  # a tensor subclass (torchao), or no pinning: a copy of its own
                value = tensor.get().detach().to(self.temp_device)
                park(i, self.kit.pin(value) if self.pin else value)
        for (index, _), home in zip(entries, homes):
            self._home.setdefault(index, []).append(home)
        for index, block in enumerate(self.blocks):
            hook = self._make_hook(index)
            layers = {id(t.module): t.module for t in layer_tensors(block)}
            self._handles += [layer.register_forward_pre_hook(hook) for layer in layers.values()]
        self._arrange(resident_after(len(self.blocks), self.parked, Pass.BACKWARD, self.window), written=True)

    def carry_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose state of trained parked tensors moves with their blocks."""
        self.optimizer_state.optimizer = optimizer

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, index: int):
        def before_block(module, args):
            kind = current_pass()
            if self._arranged_for == (index, kind):
                return  # another layer of the same block, same pass
            self._arranged_for = (index, kind)
            target = resident_when_running(len(self.blocks), self.parked, index, kind, self.window)
            if self.recording:
                self.trace.append((kind, index, target))
            self._arrange(target, needed=index, written=kind is not Pass.FORWARD_THEN_BACKWARD,
                          prefetch=kind is not Pass.FORWARD_ONLY)
            if kind is Pass.BACKWARD and self.kit is not None and not self._sync_queued:
                # the backward's write-backs land before it returns: what follows reads the homes
                self._sync_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._landed)
            if kind is Pass.BACKWARD and index in self.parked_set:
                # this block's weights are stepped in this backward (the fused step), here
                self._changed.add(index)
                self.optimizer_state.bring(self._trained(index))
        return before_block

    def _trained(self, index: int) -> list[torch.Tensor]:
        # read when needed: a method makes weights trainable after the conductor has started
        return [value for value in (t.get() for t in self._tensors[index]) if value.requires_grad]

    # --- moves -------------------------------------------------------------------------------

    def _arrange(self, target: tuple[int, ...], needed: int | None = None, written: bool = False,
                 prefetch: bool = False) -> None:
        """`written`: the blocks brought now may be written while resident, so they go home on leaving.
        `prefetch`: blocks not needed now come on the side stream, and write-backs land later. Only
        inside a training step, whose backward ends by waiting for both: a copy still running
        when a forward-only pass or an arrangement between steps ends could be overtaken by the
        host's next move (an EMA swapped out, a resumed state loaded) and then overwrite it."""
        for index in sorted(self.resident - set(target)):
            self._send_away(index)
        for index in target:
            if index not in self.resident:
                self._bring(index, prefetch=prefetch and index != needed)
                if written:
                    self._changed.add(index)
        if needed in self._events:
            self.streams.current_stream(self.train_device).wait_event(self._events.pop(needed))
        if not prefetch and self.kit is not None:
            self._landed()

    def _bring(self, index: int, prefetch: bool) -> None:
        tensors, home = self._tensors[index], self._home[index]
        if self.kit is not None:
            compute = self.streams.current_stream(self.train_device)
            stream = self._stream if prefetch else compute
            landing = self._landing.pop(index, None)
            if landing is not None:  # its home is still being written: copy out of it after that
                stream.wait_event(landing)
                compute.wait_event(landing)  # the optimizer state comes out of its home on this stream
            with self.streams.stream(stream):
                values = [h.to(self.train_device, non_blocking=True) for h in home]
            for tensor, value in zip(tensors, values):
                value.record_stream(compute)  # freed only after the compute stream is done with it
                tensor.put(value)
            if prefetch:
                event = self.streams.Event()
                event.record(stream)
                self._events[index] = event
        else:
            for tensor, value in zip(tensors, home):
                tensor.put(value.to(self.train_device))
        self.resident.add(index)
        self.moves += 1

    def _send_away(self, index: int) -> None:
        if index in self._events:  # a prefetch never waited for: finish it before dropping its memory
            self.streams.current_stream(self.train_device).wait_event(self._events.pop(index))
        changed = index in self._changed
        trained = [(t, h) for t, h in zip(self._tensors[index], self._home[index]) if changed and t.get().requires_grad]
        if trained:
            with self._writing_home():
                for tensor, home in trained:
                    # the step was made on the train device's copy
                    write_home(tensor.get(), home, self._stream if self.kit else None)
                self.optimizer_state.park([tensor.get() for tensor, _ in trained])
                self._mark_landing(index)
        for tensor, value in zip(self._tensors[index], self._home[index]):
            tensor.put(value)
        self._changed.discard(index)
        self.resident.discard(index)

    def _writing_home(self):
        """Where write-backs are issued: the side stream, after the compute stream's step."""
        if self.kit is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(self.streams.current_stream(self.train_device))
        return self.streams.stream(self._stream)

    def _mark_landing(self, index: int) -> None:
        if self.kit is not None:
            event = self.streams.Event()
            event.record(self._stream)
            self._landing[index] = event

    def _landed(self) -> None:
        """Between steps: the host waits for every write-back home (it reads or writes the homes
        next), and the compute stream for every prefetch (what follows may touch those blocks)."""
        self._sync_queued = False
        for event in self._landing.values():
            event.synchronize()
        self._landing.clear()
        compute = self.streams.current_stream(self.train_device) if self.kit else None
        for event in self._events.values():
            compute.wait_event(event)
        self._events.clear()

    # --- around sampling and saving ---------------------------------------------------------------

    def evict(self) -> None:
        """Every parked block back on the temp device (before sampling or saving)."""
        self._arranged_for = None
        self._arrange(())

    def materialize(self) -> None:
        """The blocks the next training step starts with back on the train device (after)."""
        self._arranged_for = None
        self._arrange(resident_after(len(self.blocks), self.parked, Pass.BACKWARD, self.window), written=True)

    def describe(self) -> str:
        parked_bytes = sum(block_bytes(self.blocks[i]) for i in self.parked)
        total = sum(block_bytes(b) for b in self.blocks)
        return (f"model.parts.{self.name}: {len(self.parked)} of {len(self.blocks)} blocks parked on "
                f"{self.temp_device} ({parked_bytes / 2**20:.1f} of {total / 2**20:.1f} MiB)")
