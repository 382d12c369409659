"""The run's plan made beside it, for the `memory` event, where preflight did not plan (issue 25).

Preflight skips the plan on a device that surely fits (fit_check.SURELY_FITS: an H100 training
SDXL), where it could refuse nothing, so as not to hold the start up for it; the memory event then
had no planned figure beside the measured one, on exactly the GPUs the plan is checked on. Here
the plan is made while the model loads, in a child process started just before the load
(`python -m modules.trainer.background_plan`), and the memory event after step 2 reads it.

A process, not a thread: planning builds the model's skeleton under library context managers
that patch module globals for every thread (diffusers' and transformers' `no_init_weights` make
torch.nn.init's functions no-ops: an adapter initialised meanwhile on the training thread would
start from uninitialised memory; transformers' init guard saves and restores the same functions,
so two threads interleaving can leave them patched for good), and the fake pass routes
F.scaled_dot_product_attention for the whole process (plan/attention.py). Apart from that, the
plan's Python-heavy dispatch would take the GIL from the training thread. A child shares none of
that, runs at a lower priority on one thread, never starts CUDA (a context would take ~500 MiB of
the card from the run: it sees no GPU, and any CUDA start there is the plan's error), and stops
at once: killed on Stop or at the end of the run, and it exits by itself when its parent goes (its
stdin closes). A plan that fails is
said as a warning; the run goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from modules.config.train_config import TrainConfig

_PROJECT_ROOT = Path(__file__).resolve().parents[2]  # what `-m modules.trainer.background_plan` imports from
_PRIVATEUSE1_DEFAULT = "privateuseone"


class BackgroundPlan:
    """The child process planning `config` against `free` device bytes and `ram` host bytes."""

    def __init__(self, config: TrainConfig, device: torch.device, free: int, ram: int | None):
        # the child resolves nothing: the device as this process resolved it ("auto" -> "cuda:0")
        payload = {"config": {**config.model_dump(mode="json"), "train_device": str(device)},
                   "vram": free, "ram": ram, "privateuse1": torch._C._get_privateuse1_backend_name()}
        # no GPU visible to the child (a library that finds one starts CUDA on import: bitsandbytes,
        # imported with diffusers, asks each device's capability); the plan reads the device's type alone
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
               "CUDA_VISIBLE_DEVICES": ""}
        self.started = time.monotonic()
        self._plan: dict | None = None
        self._error: str | None = None
        self._done = threading.Event()
        self._closed = False
        self._process = None
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: the libraries' warnings never block the child
        try:
            self._process = subprocess.Popen([sys.executable, "-m", "modules.trainer.background_plan"], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
            self._process.stdin.write((json.dumps(payload) + "\n").encode())
            self._process.stdin.flush()  # stdin stays open: the child exits when it closes (this process gone)
        except OSError as error:  # no process to be had (or it died at once): said at the memory event
            self._error = f"the planning process did not start ({error})"
            if self._process is not None:
                self._process.kill()
                self._process.wait()
                self._process = None
            self._stderr.close()
            self._done.set()
            return
        # the reader waits on the pipes (no GIL held meanwhile); the training thread only looks
        self._reader = threading.Thread(target=self._read, name="background-plan", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self._process.stdout.read()
        code = self._process.wait()
        self._stderr.seek(0)
        err = self._stderr.read()
        self._stderr.close()
        try:
            answer = json.loads(out.decode() or "{}")
        except ValueError:
            answer = {}
        if "plan" in answer:
            self._plan = answer["plan"]
        elif self._closed:  # killed by close()
            self._error = "stopped"
        else:
            lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
            self._error = answer.get("error") or (lines[-1] if lines else f"the planning process exited with {code}")
        self._done.set()

    def result(self, wait_s: float = 0.0) -> tuple[dict | None, str | None]:
        """(the plan, None), or (None, why there is none): not ready after `wait_s` seconds, or its error."""
        if not self._done.wait(wait_s):
            return None, f"was not ready after {time.monotonic() - self.started:.0f} s"
        if self._plan is not None:
            return self._plan, None
        if self._error == "stopped":
            return None, "was stopped before it was made"
        return None, f"failed: {self._error}"

    def close(self) -> None:
        """Stop the child if it still plans (Stop, the end of the run, an error); returns at once."""
        self._closed = True
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()
        try:
            self._process.stdin.close()
        except OSError:
            pass
        self._reader.join(timeout=5)


def start_background_plan(config: TrainConfig, device: torch.device, planned: bool) -> BackgroundPlan | None:
    """The plan beside the run where the run was not `planned` before loading because its device
    surely fits (fit_check.surely_fits); None elsewhere (the CPU says no free figure: nothing to
    read a plan against)."""
    from modules.trainer.fit_check import available_ram, free_device_memory, surely_fits

    if planned:
        return None
    free = free_device_memory(device)
    if free is None or not surely_fits(config, free):
        return None
    return BackgroundPlan(config, device, free, available_ram())


# --- the child ------------------------------------------------------------------------------------

def _exit_when_parent_goes() -> None:
    """Blocks on stdin until the parent closes it (or dies), then ends this process at once (the raw
    descriptor: a daemon thread holding sys.stdin's lock would make the interpreter's exit fail)."""
    while os.read(0, 1 << 16):
        pass
    os._exit(0)


def _name_the_parents_backend(name: str) -> None:
    """A train device on a PrivateUse1 backend that this process has not registered (one defined in
    the parent's Python: the tests' fakegpu) gets its name, so the config's device string parses;
    the plan reads only the device's type. After diffusers is imported: its import asks the
    accelerator's device module, which only the parent has. (An installed out-of-tree backend
    registers itself here as it does there: torch loads it on import.)"""
    import diffusers  # noqa: F401

    if name != _PRIVATEUSE1_DEFAULT and torch._C._get_privateuse1_backend_name() == _PRIVATEUSE1_DEFAULT:
        torch.utils.rename_privateuse1_backend(name)


CUDA_STARTED = ("the plan made beside the run started CUDA ({how}): a CUDA context in this child would take "
                "~500 MiB of the card the run trains on; the plan needs meta and fake tensors only")


def _refuse_cuda() -> None:
    """Any CUDA start in this process is an error (the plan fails, said as the parent's warning): torch
    starts CUDA through torch.cuda._lazy_init, from Python calls and from C++ (a tensor made on, or
    moved to, a CUDA device) alike."""

    def refuse(*args, **kwargs):
        raise RuntimeError(CUDA_STARTED.format(how="torch.cuda._lazy_init"))

    torch.cuda._lazy_init = refuse


def _read_payload() -> dict:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1 << 16)
        if not chunk:
            os._exit(0)  # the parent went before it asked anything
        line += chunk
    return json.loads(line)


def _plan_in_child() -> None:
    answer_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library's print goes to stderr, never into the answer
    payload = _read_payload()
    threading.Thread(target=_exit_when_parent_goes, daemon=True).start()
    try:
        os.nice(10)  # behind the training process's own threads (loading, data) on a busy host
    except (OSError, AttributeError):  # (no os.nice on Windows: the child plans at the parent's priority)
        pass
    torch.set_num_threads(1)  # the plan runs on meta and fake tensors: nothing for a thread pool
    _refuse_cuda()
    try:
        from modules.util.planning_imports import import_model_libraries_for_planning

        import_model_libraries_for_planning()  # this process only plans (modules/util/planning_imports.py)
        from modules.config.loading import build_config
        from modules.plan.run_plan import plan_run

        _name_the_parents_backend(payload["privateuse1"])

        plan = plan_run(build_config([payload["config"]]), payload["vram"], payload["ram"]).as_dict()
    except Exception as error:  # noqa: BLE001  (said by the parent as a warning; the run goes on)
        traceback.print_exc()  # the whole story on stderr, for whoever debugs the planner
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        answer = {"error": f"{type(error).__name__}: {first}" if first else type(error).__name__}
    else:
        answer = {"plan": plan}
    answer_to.write(json.dumps(answer))
    answer_to.close()
    os._exit(0)  # no interpreter shutdown: nothing is left to flush, and the stdin watcher may still block


if __name__ == "__main__":
    _plan_in_child()
