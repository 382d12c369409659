"""An ONNX Runtime session for a labelling model (the WD14 taggers, background removal): CUDA where
asked for and the installed runtime has it, the CPU otherwise; a missing runtime or an unreadable
file is one message naming the model."""

from __future__ import annotations

from pathlib import Path

from modules.autolabel.model_folder import LabelModelError


def onnx_session(path: Path, device: str, what: str):
    """`what`: the kind of model, for the message ("a WD14 tagger", "background removal")."""
    try:
        import onnxruntime
    except ImportError:
        raise LabelModelError(f"{path.parent}: {what} runs with ONNX Runtime, which is not installed "
                              "(pip install onnxruntime, or onnxruntime-gpu for CUDA)", field="--model") from None
    wanted = ["CUDAExecutionProvider"] if str(device).startswith("cuda") else []
    providers = [p for p in wanted if p in onnxruntime.get_available_providers()] + ["CPUExecutionProvider"]
    try:
        return onnxruntime.InferenceSession(str(path), providers=providers)
    except Exception as error:  # noqa: BLE001  (onnxruntime raises its own classes for a bad file)
        raise LabelModelError(f"{path} cannot be loaded by ONNX Runtime ({error})", field="--model") from None
