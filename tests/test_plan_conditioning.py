"""The planner feeds each denoiser what `planning_conditioning` describes instead of running the
text encoders (no tokenizer needed, modules/plan/fake_pass.py): it must be what encode_text
returns, key for key, in shape and dtype. Checked on every family's tiny model (both FLUX.2
variants), and the released architectures (resources/model_configs) build every part without a
tokenizer folder, which needs every family to load its parts before its tokenizers."""

from __future__ import annotations

import pytest
import torch

from modules.config.families import family_names, get_family_class
from modules.config.loading import build_config

CASES = [(name, {}) for name in family_names()] + [("flux2", {"variant": "dev"})]


@pytest.mark.parametrize(("family_name", "options"), CASES, ids=[f"{n}-{o.get('variant', '')}" for n, o in CASES])
def test_planning_conditioning_is_what_encode_text_gives(tiny_family_model, family_name, options):
    config = build_config([{"model": {"family": family_name, "base": str(tiny_family_model(family_name, **options))}}])
    family = get_family_class(family_name)(config)
    family.load()
    with torch.no_grad():
        encoded = family.encode_text(family.tokenize(["a red square", "a much longer caption about a blue circle"]))
    planned = family.planning_conditioning(2, torch.device("cpu"))
    assert set(planned) == set(encoded)
    # None: every token real (Z-Image's caption mask: its boolean select has no fake shape)
    assert {k: (tuple(v.shape), v.dtype) for k, v in planned.items() if v is not None} == \
        {k: (tuple(v.shape), v.dtype) for k, v in encoded.items() if planned[k] is not None}


@pytest.mark.parametrize("family_name", ["flux2"])
def test_released_architecture_builds_every_part_without_tokenizers(family_name):
    from modules.plan.architecture import build_architecture

    config = build_config([{"model": {"family": family_name}}])
    planned = build_architecture(config, {part: "bfloat16" for part in config.model.parts}, variant="dev")
    assert set(planned.family.parts) == set(config.model.parts)
    assert all(p.is_meta for module in planned.family.parts.values() for p in module.parameters())
