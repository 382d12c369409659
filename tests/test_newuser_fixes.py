"""Defects a new user meets on the CLI's first runs (the README's recipes, then typos)."""

import io

from modules.cli.console import ConsoleCallbacks
from modules.trainer.callbacks import Progress


def test_the_last_step_of_the_last_epoch_reads_epoch_n_of_n():
    # the trainer counts the epoch done before it reports the step that finished it
    stream = io.StringIO()
    ConsoleCallbacks(stream).on_progress(Progress(step=4, total_steps=4, epoch=1, epochs=1, loss=0.5, lr=1e-4,
                                                  it_per_s=1.0, eta_s=0.0))
    assert "step 4/4 epoch 1/1 " in stream.getvalue(), stream.getvalue()
