"""Shared fixtures: a tiny SD1.5-architecture model and captioned shape images, built offline once;
the fake second device; for GUI tests, the X display and the user folder."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Under pytest -n (README's test command), the workers share the cores: give each its share of
# threads, before torch starts its pool (and for the runs tests start, which inherit it), so the
# processes do not oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from modules.util.library_logs import quiet_library_logs  # noqa: E402
from longest_files_first import pytest_xdist_make_scheduler  # noqa: E402,F401 (the hook: slowest files first)

quiet_library_logs()


def pytest_configure(config):
    # The fake device must be registered before the first backward pass of the process: autograd
    # sizes its per-device queues then (tests/fake_device.py).
    from fake_device import enable_fake_device

    enable_fake_device()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from modules.model.sd15 import SD15Family

    return SD15Family.make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sd15")


@pytest.fixture(scope="session")
def tiny_family_model(tmp_path_factory, tiny_model):
    """family name (and make_tiny_model options, such as FLUX.2's variant "dev") -> a tiny random
    model folder of that family, built once per session on first use."""
    from modules.config.families import get_family_class

    built = {"sd15": tiny_model}

    def get(family: str, **options) -> Path:
        key = "-".join([family, *(f"{k}={v}" for k, v in sorted(options.items()))])
        if key not in built:
            folder = tmp_path_factory.mktemp("models") / f"tiny-{key}"
            built[key] = get_family_class(family).make_tiny_model(folder, **options)
        return built[key]

    return get


@pytest.fixture(scope="session")
def shape_images(tmp_path_factory) -> Path:
    from modules.data.synthetic_images import write_shape_images

    folder = tmp_path_factory.mktemp("images")
    write_shape_images(folder, count=4, width=64, height=64)
    return folder


@pytest.fixture(scope="session")
def tiny_labellers(tmp_path_factory):
    """Tiny random labelling models (modules/autolabel/tiny_models.py), each built once: get("blip"),
    get("llava"), get("qwen2_vl"), get("clipseg")."""
    from modules.autolabel import tiny_models

    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = getattr(tiny_models, f"make_tiny_{kind}")(tmp_path_factory.mktemp("labellers") / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def one_image(tmp_path_factory, shape_images) -> Path:
    """A concept folder with one image and its caption, for short overfitting runs."""
    import shutil

    folder = tmp_path_factory.mktemp("one-image")
    for path in sorted(shape_images.iterdir())[:2]:  # the first png and its caption
        shutil.copy(path, folder / path.name)
    return folder


def train_config(model: Path, images: Path, workspace: Path, *overlays: dict):
    """A small, fast config on the tiny model; overlays deep-merge on top."""
    from modules.config.loading import build_config

    base = {
        "model": {"base": str(model)},
        "concepts": [{"path": str(images)}],
        "data": {"resolution": 64},
        "adapter": {"rank": 4, "alpha": 2},
        "optimizer": {"lr": 5e-3},
        "schedule": {"epochs": 1, "batch_size": 2},
        "workspace_dir": str(workspace / "ws"),
        "output": {"path": str(workspace / "out" / "lora.safetensors"), "dtype": "float32"},
        "tensorboard": False,
        "train_device": "cpu",
    }
    return build_config([base, *overlays])


@pytest.fixture(scope="session")
def fake_device():
    """A fake second device, ``torch.device("fakegpu")``, backed by CPU memory (tests/fake_device.py).

    Mixing its tensors with non-scalar CPU tensors raises as CUDA does, so placement bugs show here.
    """
    from fake_device import enable_fake_device

    return enable_fake_device()


@torch.no_grad()
def fixed_loss(trainer, draws: int = 16) -> float:
    """Loss on the first item at fixed noise and timesteps, comparable before and after training."""
    batch = trainer.dataset.collate([0], trainer.device)
    generator = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(draws):
        prediction, target, *_ = trainer.family.predict(batch.latents, trainer.conditioning(batch), generator)
        total += torch.nn.functional.mse_loss(prediction, target).item()
    return total / draws


# --- GUI tests: the X display and the user folder the windows use ------------------------------------

def _die_with_parent() -> None:
    """In the Xvfb child: get SIGTERM when the test process dies, however it dies (Linux)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@pytest.fixture(scope="session")
def display():
    """The X display the windows open on: $DISPLAY, or an Xvfb started here for the whole session
    (Tk keeps its connection to the display for the life of the process, so the server must
    outlive every test that opened a window)."""
    if os.environ.get("DISPLAY"):
        yield os.environ["DISPLAY"]
        return
    if shutil.which("Xvfb") is None:
        pytest.skip("GUI tests need a display: DISPLAY is unset and Xvfb is not installed (apt-get install xvfb)")
    # -displayfd: Xvfb picks a free display and writes its number when it is ready, so test
    # processes started side by side (pytest -n) never race for the same number.
    read_end, write_end = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1280x900x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_end,),
                              preexec_fn=_die_with_parent)
    os.close(write_end)
    with os.fdopen(read_end) as ready:
        ready_fds = select.select([ready], [], [], 20)[0]
        number = ready.readline().strip() if ready_fds else ""
    if not number.isdigit():
        server.kill()
        pytest.fail("Xvfb did not start (no display number within 20 s)")
    os.environ["DISPLAY"] = f":{number}"
    try:
        yield os.environ["DISPLAY"]
    finally:
        del os.environ["DISPLAY"]
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """DIFFTRAINER_HOME for the app and the runs it starts (user presets, last config, run folders)."""
    folder = tmp_path_factory.mktemp("difftrainer-home")
    old = os.environ.get("DIFFTRAINER_HOME")
    os.environ["DIFFTRAINER_HOME"] = str(folder)
    yield folder
    if old is None:
        del os.environ["DIFFTRAINER_HOME"]
    else:
        os.environ["DIFFTRAINER_HOME"] = old


@pytest.fixture(autouse=True)
def _background_plan_only_where_marked(request, monkeypatch):
    """A run on the fake device without a capacity surely fits, so it plans beside its load in a child
    process (modules/trainer/background_plan.py): measured +10 s and +6 s of CPU per run on a busy
    2-core box, most of it the memory event waiting for the child. Only the tests marked
    `background_plan` start one; elsewhere no plan is made, as before that child existed."""
    if request.node.get_closest_marker("background_plan") is None:
        from modules.trainer import background_plan

        monkeypatch.setattr(background_plan, "start_background_plan", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True, scope="module")
def _tk_garbage_collected_on_the_main_thread(request):
    """After a GUI test file: collect its leftover Tk objects here, on the main thread. Left to a
    later collection, one can run on another test's worker thread (a command reader), where each
    tkinter Variable's __del__ waits ~1 s for a main loop that never comes."""
    yield
    if request.module.__name__.startswith("test_gui"):
        import gc

        gc.collect()


@pytest.fixture(scope="session")
def quick_tiny_model(tmp_path_factory) -> Path:
    """The tiny SD1.5 with its two blocks swapped, so attention runs on the half-resolution latents
    (256 tokens at 64 px, not 1024): the same layer kinds and adapter count (40), a training step
    about 4x cheaper (8 steps at batch 2: 4.0 s -> 1.0 s CPU). For tests of what a run does (resume,
    guards, placement, files), not of how far the loss falls (their thresholds were measured on
    tiny_model)."""
    from modules.model.sd15 import SD15Family

    return SD15Family.make_tiny_model(tmp_path_factory.mktemp("models") / "quick-tiny-sd15", unet={
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D")})
