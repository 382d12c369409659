"""A labelling model's processor where torchvision is not installed: the processor class
transformers maps the folder's model type to, with its video processor left out.

Why: transformers (5.x) provides video processors only with torchvision (`AutoVideoProcessor` on a
Qwen2-VL folder: "Qwen2VLVideoProcessor requires the Torchvision library"), and a processor whose
class takes one (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) neither loads nor can be built without it:
`ProcessorMixin.__init__` checks every sub-processor it names, `video_processor` against
`VideoProcessorMixin`, which transformers does not export without torchvision. Captions need no
video: the same class, told that its sub-processors are the others (`get_attributes`, which both
`from_pretrained` and `__init__` ask), loads the image processor (transformers picks its PIL/numpy
variant, Qwen2VLImageProcessorPil, where torchvision is missing) and the tokenizer from the folder
and runs its own `__call__` and chat template unchanged; with no video processor set, it never
processes videos. With torchvision installed the folder's processor loads as it is
(AutoProcessor), video processor included."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from modules.autolabel.model_folder import model_config
from modules.autolabel.transformers_models import load_pretrained

VIDEO = "video_processor"


def processor_class_for(model_type: str):
    """The processor class transformers maps `model_type` to, or None where it maps none."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return processor_class_from_name(name) if name else None


@cache
def without_video(processor_class):
    """`processor_class` with its video processor left out of its sub-processors (same name, same code)."""

    @classmethod
    def get_attributes(cls):
        return [name for name in super(image_only, cls).get_attributes() if name != VIDEO]

    image_only = type(processor_class.__name__, (processor_class,), {
        "get_attributes": get_attributes, "__module__": __name__,
        "__doc__": f"{processor_class.__name__} for images alone (no video processor: torchvision is not installed)"})
    return image_only


def load_processor(folder: Path):
    """The folder's processor: as transformers loads it (AutoProcessor), or, where torchvision is
    missing and its class takes a video processor, that class without one."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return load_pretrained(AutoProcessor, folder, "processor")
    processor_class = processor_class_for(model_config(folder)["model_type"])
    if processor_class is None or VIDEO not in processor_class.get_attributes():
        return load_pretrained(AutoProcessor, folder, "processor")
    return load_pretrained(without_video(processor_class), folder, "processor")
