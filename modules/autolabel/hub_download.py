"""A labelling model fetched from the Hugging Face hub, only when the user asks and after the size is
shown: `listing` says which files a model folder needs and how many bytes they are (one request,
nothing downloaded), `download` fetches exactly those into a folder under the user's directory with
huggingface_hub, one file at a time, so a stop ends it between files (a file cut off stays in the
hub's own partial-download form, resumed next time) and a folder only counts as whole once its last
file is in.

Of the weights a repository carries in several formats only one set is taken: safetensors, else
PyTorch's .bin/.pt, else ONNX (WD14-style taggers ship ONNX only); TensorFlow, Flax, Rust, Core ML
and OpenVINO copies are never fetched. `HF_ENDPOINT` (a mirror) and `HF_TOKEN` are honoured as
huggingface_hub honours them."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from modules.autolabel.model_folder import LabelModelError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# files that are never a transformers or ONNX model's (other frameworks' weights, repository metadata)
NEVER = re.compile(r"(^|/)(\.git\w*|tf_model\.h5|flax_model\.msgpack|rust_model\.ot|.*\.(h5|msgpack|ot|tflite|mlmodel"
                   r"|mlpackage|ckpt\.index|gguf))$|(^|/)(coreml|openvino|tf|flax)/")
# one set of weights, in this order of preference
WEIGHTS = (re.compile(r"\.safetensors(\.index\.json)?$"), re.compile(r"\.(bin|pt|pth)(\.index\.json)?$"),
           re.compile(r"\.onnx(_data)?$|\.onnx\.data$"))
DONE_MARK = ".download-complete"  # written last: the folder is whole


@dataclass(frozen=True)
class Listing:
    repo_id: str
    revision: str  # the commit the files are from (downloaded from the same one)
    files: tuple[tuple[str, int], ...]  # (path in the repository, bytes), what the folder needs
    skipped: tuple[str, ...]  # what the repository holds besides (other formats)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def is_hub_id(text: str) -> bool:
    """`owner/name`, not an existing path: what the user means as a hub model."""
    return bool(HUB_ID.match(text.strip())) and not Path(text.strip()).expanduser().exists()


def models_dir() -> Path:
    from modules.config.presets import user_dir

    return user_dir() / "models"


def target_folder(repo_id: str, root: Path | None = None) -> Path:
    return (root or models_dir()) / repo_id.replace("/", "--")


def downloaded(folder: Path) -> bool:
    return (folder / DONE_MARK).is_file()


def _online() -> None:
    """The user asked for this download: lift the hub libraries' offline switch (launch.py sets it
    for everything else) for this process's requests."""
    import huggingface_hub.constants as constants

    os.environ["HF_HUB_OFFLINE"] = "0"
    constants.HF_HUB_OFFLINE = False


def _api():
    from huggingface_hub import HfApi

    _online()
    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)


def listing(repo_id: str, revision: str | None = None) -> Listing:
    """The files a model folder of `repo_id` needs, with their sizes; one LabelModelError naming the
    repository when it cannot be listed (not found, gated, offline)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if not HUB_ID.match(repo_id):
        raise LabelModelError(f"{repo_id!r} is not a hub model id (owner/name)", field="--model")
    try:
        info = _api().model_info(repo_id, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise LabelModelError(f"{repo_id} is gated on the hub: accept its terms there and set HF_TOKEN",
                              field="--model") from None
    except RepositoryNotFoundError:
        raise LabelModelError(f"{repo_id}: no such model on the hub (or it is private: set HF_TOKEN)",
                              field="--model") from None
    except RevisionNotFoundError:
        raise LabelModelError(f"{repo_id}: no revision {revision!r} on the hub", field="--revision") from None
    except (HfHubHTTPError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LabelModelError(f"{repo_id}: the hub could not be reached ({first})", field="--model") from None
    everything = [(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    kept = [(name, size) for name, size in everything if not NEVER.search(name)]
    for pattern in WEIGHTS:
        if any(pattern.search(name) for name, _ in kept):
            others = [p for p in WEIGHTS if p is not pattern]
            kept = [(n, s) for n, s in kept if pattern.search(n) or not any(p.search(n) for p in others)]
            break
    names = {name for name, _ in kept}
    if not any(name.rsplit("/", 1)[-1] in ("config.json", "model.onnx") or name.endswith(".onnx") for name in names):
        raise LabelModelError(f"{repo_id} holds no config.json or ONNX model: not a model to label with",
                              field="--model")
    return Listing(repo_id, info.sha or revision or "main", tuple(sorted(kept)),
                   tuple(sorted(name for name, _ in everything if name not in names)))


def download(found: Listing, folder: Path, progress: Callable[[int, int, str], None] = lambda *_: None,
             stopping: Callable[[], bool] = lambda: False) -> bool:
    """Fetch `found`'s files into `folder`; `progress(bytes done, bytes in all, file)` after each file.
    True when every file is in (the folder is marked whole), False when `stopping()` ended it first."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    _online()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DONE_MARK).unlink(missing_ok=True)
    done = 0
    for name, size in found.files:
        if stopping():
            return False
        try:
            hf_hub_download(found.repo_id, name, revision=found.revision, local_dir=str(folder),
                            endpoint=os.environ.get("HF_ENDPOINT") or None)
        except (HfHubHTTPError, OSError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise LabelModelError(f"{found.repo_id}: {name} could not be downloaded ({first}); what came "
                                  f"is kept in {folder} and the next download resumes it", field="--model") from None
        done += size
        progress(done, found.total_bytes, name)
    (folder / DONE_MARK).write_text(f"{found.repo_id}@{found.revision}\n", encoding="utf-8")
    return True


def human_size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def local_model(text: str) -> str:
    """What `--model TEXT` reads: a hub id whose download is whole is its folder; anything else as given."""
    text = text.strip()
    if is_hub_id(text) and downloaded(target_folder(text)):
        return str(target_folder(text))
    return text
