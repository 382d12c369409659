"""The language model of a Mistral3ForConditionalGeneration folder (FLUX.2 [dev]'s text encoder,
Mistral-Small-3.1-24B) read as a plain MistralModel: Flux2Pipeline only ever calls the encoder
with input_ids and reads its hidden states, so the Pixtral vision tower, the projector and the LM
head are never loaded (about 0.9 B parameters and the 1.3 B lm_head saved)."""

from __future__ import annotations


class Mistral3TextConfig:
    """`from_pretrained` of a Mistral3 config.json answering its text_config (a MistralConfig)."""

    @staticmethod
    def from_pretrained(folder: str, **kwargs):
        from transformers import Mistral3Config

        return Mistral3Config.from_pretrained(folder, **kwargs).text_config


class Mistral3LanguageModel:
    """What modules.loading.streamed_load.empty_model builds for the folder: a MistralModel from
    the Mistral3 config's text_config (the class is a factory: instances are MistralModels)."""

    config_class = Mistral3TextConfig

    def __new__(cls, config):
        from transformers import MistralModel

        return MistralModel(config)


# where the language model's weights sit in the saved files: transformers' checkpoint layout
# (`language_model.model.`) and its in-memory one (`model.language_model.`), both met in the wild
_LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
# what the pipeline never runs
UNUSED_KEYS = [r"^(model\.)?(vision_tower|multi_modal_projector)\.", r"^(language_model\.)?lm_head\."]


def language_model_key(key: str) -> str:
    for prefix in _LANGUAGE_MODEL_PREFIXES:
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return key


def is_mistral3_config(config: dict) -> bool:
    return config.get("model_type") == "mistral3" or "Mistral3ForConditionalGeneration" in config.get(
        "architectures", [])
