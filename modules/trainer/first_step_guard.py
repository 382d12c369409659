"""The first-step guard as the training loop uses it: a snapshot of the trained tensors before the
run's first optimizer step, the check after it (guards.check_first_step: a trained tensor that got no
gradient, is not in the optimizer, or did not move stops the run), then the tensors it could not yet
judge watched step by step until they move or their deadline passes (guards.PendingMoves).

The trainer calls `after_step()` after each optimizer step the scaler did not skip, and
`unresolved()` once the loop ends (a run shorter than the deadline warns instead of stopping).
"""

from __future__ import annotations

import torch

from modules.trainer.guards import SETTLE_STEPS, PendingMoves, check_first_step, snapshot


class FirstStepGuard:
    def __init__(self, trainer):
        self.trainer = trainer
        self.before: dict[str, torch.Tensor] | None = snapshot(trainer.named_trained_parameters())
        self.pending: PendingMoves | None = None  # the watched tensors, until they move

    def after_step(self) -> None:
        """After an optimizer step that was taken (trainer.step: the steps before it)."""
        if self.before is not None:
            self.pending = self.first_step(self.before)
            self.before = None
        elif self.pending is not None:  # tensors the first step could not show moving
            self.pending.check(self.guarded_parameters(), self.trainer.step + 1, self.recorded_moves())
            self.pending = None if self.pending.done else self.pending
            if self.pending is not None:
                self.watch(self.pending)

    def unresolved(self) -> str | None:
        """The warning for tensors still watched when the run ended, if any."""
        return self.pending.unresolved() if self.pending is not None else None

    def first_step(self, before: dict[str, torch.Tensor]) -> PendingMoves | None:
        """The check after the run's first optimizer step; what it watches on is judged by the end of
        the warm-up plus SETTLE_STEPS (a resumed run: from its first step)."""
        trainer = self.trainer
        in_optimizer = set().union(*(method.stepped_parameters(trainer.optimizer) for method in trainer.methods))
        deadline = max(trainer.config.lr_scheduler.warmup_steps, trainer.step) + SETTLE_STEPS
        seen = {}
        for method in trainer.methods:
            seen.update({method.state_prefix + n: v for n, v in (method.gradients_seen() or {}).items()})
        pending = check_first_step(self.guarded_parameters(), before, seen, self.recorded_moves(),
                                   in_optimizer=in_optimizer, deadline=deadline)
        if pending is not None:
            self.watch(pending)
        return pending

    def guarded_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(m.state_prefix + n, p) for m in self.trainer.methods for n, p in m.guarded_parameters()]

    def recorded_moves(self) -> dict[str, bool]:
        """What the methods recorded of the last step: whether each watched tensor moved."""
        return {method.state_prefix + n: v for method in self.trainer.methods
                for n, v in (method.recorded_moves() or {}).items()}

    def watch(self, pending: PendingMoves) -> None:
        """Has the methods record, in the next step, whether the watched tensors move."""
        for method in self.trainer.methods:
            prefix = method.state_prefix
            method.record_moves({name[len(prefix):] for name in pending.names if name.startswith(prefix)})
