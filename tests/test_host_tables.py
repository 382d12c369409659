"""A frozen text encoder's token table stays on the host (modules/offload/host_tables.py): the lookup
runs on the CPU and only its rows go to the train device, and the plan counts it the same way
(modules/plan/run_plan.py, through the same host_table_parts; auto's offload too, plan/auto.py).

On the fake device, tiny Wan (UMT5) and FLUX.1 (CLIP-L and T5): after placement the table is on
the CPU and the rest of the encoder on the device; a caption encodes to exactly what it encodes to
with the table on the device; the measured peak of start (load, placement, caching) drops by the
tables' bytes and so does the plan's `outside_step`; with the encoder's blocks parked
(offload_fraction 1) it still encodes the same and trains; a trained encoder and a trained
embedding keep their table on the device, an embedding loaded from a file (frozen) does not."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import train_config
from modules.config.families import family_names, get_family_class
from modules.model.components.embedding_tokens import token_embedding
from modules.util.compute_device import compute_device

STEPS = {"schedule": {"epochs": 1, "batch_size": 2, "max_steps": 2},
         "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "width": 64, "height": 64, "seed": 1}]}}
CAPTION = "a red circle on a blue square"


def start(config, inspect, train: bool = False):
    """Start `config` on its (fake) train device: (the peak of start over what the device held
    before, what `inspect(trainer)` returned while the idle parts were woken for samples)."""
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    memory = torch.get_device_module(config.train_device)
    gc.collect()
    before = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    trainer = GenericTrainer(config, TrainCallbacks())
    try:
        trainer.start()
        peak = memory.max_memory_allocated() - before
        with torch.no_grad(), trainer.offload_paused():
            inspected = inspect(trainer)
        if train:
            trainer.train()
            assert trainer.step == 2 and all(path.exists() for path in trainer.sample())
    finally:
        trainer.release()
    return peak, inspected


def encoded(trainer) -> dict[str, torch.Tensor]:
    family = trainer.family
    return {key: value.cpu() for key, value in family.encode_text(family.tokenize([CAPTION])).items()}


def tables(trainer) -> dict[str, torch.Tensor]:
    return {name: token_embedding(trainer.family.parts[name]).weight for name in trainer.family.text_parts}


def without_host_tables(patch) -> None:
    """The trainer and the plan as they were: every table goes where its encoder goes."""
    import modules.offload.host_tables as host_tables
    import modules.plan.run_plan as run_plan

    patch.setattr(host_tables, "host_table_parts", lambda config, family, trained: ())
    patch.setattr(run_plan, "host_table_parts", lambda config, family, trained: ())


def placed(trainer) -> dict:
    """Where the tables went and the encoders compute, the tables' bytes and a caption's encoding."""
    encoders = {name: trainer.family.parts[name] for name in trainer.family.text_parts}
    return {"tables": {name: table.device.type for name, table in tables(trainer).items()},
            "computes": {name: compute_device(module).type for name, module in encoders.items()},
            "table_bytes": sum(table.nbytes for table in tables(trainer).values()),
            "encoded": encoded(trainer)}


@pytest.fixture(scope="module")
def kept_starts(fake_device, tiny_family_model, shape_images, tmp_path_factory):
    """family -> (peak, placed) of the start of the STEPS run with every table where its encoder goes
    (without_host_tables), started once: the reference of both tests below that start tiny Wan so."""
    started = {}

    def get(family: str):
        if family not in started:
            config = train_config(tiny_family_model(family), shape_images, tmp_path_factory.mktemp(f"kept-{family}"),
                                  STEPS, {"model": {"family": family}, "train_device": str(fake_device)})
            with pytest.MonkeyPatch.context() as patch:
                without_host_tables(patch)
                started[family] = start(config, placed)
        return started[family]

    return get


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_a_frozen_encoders_token_table_stays_on_the_host(family, fake_device, tmp_path, tiny_family_model,
                                                         shape_images, monkeypatch, kept_starts):
    from modules.plan.run_plan import plan_run

    def config(where, *overlays):
        return train_config(tiny_family_model(family), shape_images, tmp_path / where, STEPS,
                            {"model": {"family": family}, "train_device": str(fake_device)}, *overlays)

    kept_peak, kept = kept_starts(family)
    with monkeypatch.context() as patch:
        without_host_tables(patch)
        kept_plan = plan_run(config("kept"), None, None)
    peak, hosted = start(config("hosted"), placed)
    plan = plan_run(config("hosted"), None, None)

    assert set(kept["tables"].values()) == {"fakegpu"}
    assert set(hosted["tables"].values()) == {"cpu"} and set(hosted["computes"].values()) == {"fakegpu"}
    for key, value in kept["encoded"].items():  # the same rows, looked up elsewhere
        assert torch.equal(hosted["encoded"][key], value), key
    table_bytes = hosted["table_bytes"]
    assert table_bytes > 0
    # caching holds every part on the device: without the tables its peak is lower by their bytes
    assert kept_peak - peak == pytest.approx(table_bytes, rel=0.02), f"peak {kept_peak} -> {peak}, tables {table_bytes}"
    assert kept_plan.outside_step - plan.outside_step == table_bytes
    assert plan.host["train_peak"] - kept_plan.host["train_peak"] >= table_bytes - (
        kept_plan.host["pinned"] - plan.host["pinned"])  # home on the host, no longer in a pinned home copy
    assert any("token tables on the host" in note for note in plan.notes)


def test_parked_encoder_blocks_and_a_host_table_together(fake_device, tmp_path, tiny_family_model, shape_images,
                                                         kept_starts):
    """offload_fraction 1: the encoder's blocks stream from the temp device and its table is looked up
    on the host; a caption encodes as it does with everything on the device, and the run trains."""
    reference = kept_starts("wan")[1]["encoded"]
    parked = train_config(tiny_family_model("wan"), shape_images, tmp_path / "parked", STEPS,
                          {"model": {"family": "wan"}, "train_device": str(fake_device)},
                          {"model": {"parts": {"text_encoder": {"offload_fraction": 1.0}}}})
    _, hosted_placed = start(parked, placed, train=True)
    where, hosted = hosted_placed["tables"]["text_encoder"], hosted_placed["encoded"]
    assert where == "cpu"
    for key, value in reference.items():
        assert torch.equal(hosted[key], value), key


@pytest.mark.parametrize("overlay", [
    {"model": {"parts": {"text_encoder": {"train": True}}}},  # a LoRA on the encoder
    {"method": {"type": "embedding"}, "embeddings": [{"placeholder": "<tok>", "vectors": 2, "init_text": "ab"}]},
], ids=["trained-encoder", "embedding"])
def test_an_encoder_the_step_changes_keeps_its_table_on_the_device(overlay, fake_device, tmp_path, tiny_family_model,
                                                                    shape_images):
    from modules.plan.run_plan import plan_run

    config = train_config(tiny_family_model("wan"), shape_images, tmp_path, STEPS,
                          {"model": {"family": "wan"}, "train_device": str(fake_device)}, overlay,
                          {"concepts": [{"path": str(shape_images), "captions": {"prefix": "<tok> "}}]})
    _, where = start(config, lambda trainer: {n: t.device.type for n, t in tables(trainer).items()})
    assert where == {"text_encoder": "fakegpu"}
    assert not any("token tables on the host" in note for note in plan_run(config, None, None).notes)


def test_an_embedding_loaded_from_a_file_leaves_its_table_on_the_host(fake_device, tmp_path, tiny_family_model,
                                                                      shape_images, monkeypatch):
    """A frozen embedding (from a file, beside the LoRA) does not train its encoder: the table stays
    on the host, its new tokens' rows join the rows the table sends over, a caption with the
    placeholder encodes as with the table on the device, the run trains and samples with it in
    every step (the text is not cached), and the plan counts the table off the device."""
    import json

    from safetensors.torch import save_file

    from modules.model.components.embedding_tokens import expand_placeholders
    from modules.plan.run_plan import plan_run

    model = tiny_family_model("wan")
    width = json.loads((model / "text_encoder" / "config.json").read_text())["d_model"]
    save_file({"umt5xxl": torch.randn(2, width)}, str(tmp_path / "tok.safetensors"))
    loaded = {"embeddings": [{"placeholder": "<tok>", "train": False, "path": str(tmp_path / "tok.safetensors")}],
              "concepts": [{"path": str(shape_images), "captions": {"prefix": "<tok> "}}]}

    def config(where):
        return train_config(model, shape_images, tmp_path / where, STEPS,
                            {"model": {"family": "wan"}, "train_device": str(fake_device)}, loaded)

    def placed(trainer):
        family = trainer.family
        tokens = family.tokenize([expand_placeholders("<tok> " + CAPTION, {"<tok>": 2})])
        return ({n: t.device.type for n, t in tables(trainer).items()},
                {key: value.cpu() for key, value in family.encode_text(tokens).items()})

    with monkeypatch.context() as patch:
        without_host_tables(patch)
        _, (kept_where, reference) = start(config("kept"), placed)
    _, (where, hosted) = start(config("hosted"), placed, train=True)
    assert kept_where == {"text_encoder": "fakegpu"} and where == {"text_encoder": "cpu"}
    for key, value in reference.items():
        assert torch.equal(hosted[key], value), key
    assert any("token tables on the host (text_encoder)" in note for note in plan_run(config("hosted"), None, None).notes)


@pytest.mark.parametrize("family_name", family_names())
def test_every_family_encodes_the_same_with_its_tables_on_the_host(family_name, fake_device, tiny_family_model):
    """Each family sends its ids and masks where compute_device says its encoder computes: with the
    tables on the host (and all else on the device) a caption encodes exactly as with none there."""
    from modules.config.families import get_family_class
    from modules.config.loading import build_config
    from modules.offload.host_tables import HostTable, table_lookups

    config = build_config([{"model": {"family": family_name, "base": str(tiny_family_model(family_name))}}])
    family = get_family_class(family_name)(config)
    family.load()
    encoders = {name: family.parts[name].eval().to(fake_device) for name in family.text_parts}
    captions = ["a red square", "a much longer caption about a blue circle"]
    with torch.no_grad():
        reference = family.encode_text(family.tokenize(captions))
        hosted = {name: HostTable(lookups, fake_device) for name, module in encoders.items()
                  if (lookups := table_lookups(module, family.never_run.get(name, ())))}
        # (every family's: FIBO Edit's SmolLM3 table is its head's weight too, a head it declares never runs)
        assert hosted, f"{family_name}: no token table that can stay on the host (table_lookups)"
        assert all(t.weight.device.type == "cpu" for table in hosted.values() for t in table.lookups)
        encoded = family.encode_text(family.tokenize(captions))
    for key, value in reference.items():
        if value is not None:
            assert encoded[key].device == value.device and torch.equal(encoded[key].cpu(), value.cpu()), key


def test_auto_offload_does_not_park_to_make_room_for_a_table_on_the_host(tmp_path, tiny_family_model, shape_images):
    """`offload_fraction: auto` counts a host table as off the device (plan/auto.py offload_fractions
    asks host_table_parts): tiny Wan with a 200000-token vocabulary, whose UMT5 table (25.6 MB) is far
    bigger than the rest of the model and its activations, fits a budget of its planned peak without
    parking; counting the table on the device, auto parked the whole transformer for it."""
    import json
    import shutil

    from modules.plan.run_plan import Planner, plan_run

    model = tmp_path / "wan-big-vocab"
    shutil.copytree(tiny_family_model("wan"), model)
    encoder_config = model / "text_encoder" / "config.json"  # (the plan builds on meta from the configs)
    encoder_config.write_text(json.dumps({**json.loads(encoder_config.read_text()), "vocab_size": 200_000}))
    park = {"model": {"family": "wan", "parts": {"transformer": {"offload_fraction": "auto",
                                                                 "gradient_checkpointing": True}}}}
    config = train_config(model, shape_images, tmp_path / "ws", STEPS, park)
    planner = Planner(None)
    unparked = plan_run(config, None, None, planner=planner)
    sizes = planner.sizes(config, planner.weight_modes(config))["parts"]
    budget = unparked.device_peak
    assert sum(size["bytes"] for size in sizes.values()) > budget  # the table decides: with it the weights do not fit
    plan = plan_run(config, budget, None, planner=planner)
    assert plan.auto["model.parts.transformer.offload_fraction"] == {"value": 0.0,
                                                                     "why": "everything fits without parking"}
    assert plan.fits and plan.device_peak == budget


@pytest.mark.parametrize("family_name", [name for name in family_names() if get_family_class(name).embedding_slots])
def test_every_family_encodes_a_loaded_embedding_the_same_with_its_tables_on_the_host(family_name, fake_device,
                                                                                     tiny_family_model):
    """Embeddings loaded from a file (not trained) leave their encoders frozen, so those keep their
    tables on the host (host_table_parts): the new tokens' rows (AddedTokenRows, hooked after the
    host table as the trainer orders them: placement, then the method) join the rows the table sent
    over, and a caption with the placeholder encodes exactly as with the table on the device."""
    from modules.config.loading import build_config
    from modules.model.components.embedding_tokens import (
        AddedTokenRows,
        add_tokens,
        expand_placeholders,
        placeholder_tokens,
    )
    from modules.offload.host_tables import HostTable, table_lookups

    config = build_config([{"model": {"family": family_name, "base": str(tiny_family_model(family_name))}}])
    family = get_family_class(family_name)(config)
    family.load()
    slots = family.embedding_slots
    encoders = {name: family.parts[name].eval().to(fake_device) for name in family.text_parts}
    first_ids, added = {}, {}
    for part, (attribute, _key) in slots.items():
        tokenizer = getattr(family, attribute)  # (a tokenizer two encoders share gets the tokens once)
        if id(tokenizer) not in added:
            added[id(tokenizer)] = add_tokens(tokenizer, placeholder_tokens("<tok>", 2), "test")[0]
        first_ids[part] = added[id(tokenizer)]
    generator = torch.Generator().manual_seed(0)
    vectors = {part: torch.randn(2, token_embedding(encoders[part]).embedding_dim, generator=generator)
               .to(fake_device) for part in slots}
    captions = [expand_placeholders(text, {"<tok>": 2}) for text in ["a <tok> square", "a blue circle by <tok>"]]

    def encode_with_rows():
        rows = [AddedTokenRows(token_embedding(encoders[part]), first_ids[part], [vectors[part]]) for part in slots]
        encoded = family.encode_text(family.tokenize(captions))
        for hook in rows:
            assert hook.seen_vectors() == [True], family_name  # the placeholder reached the encoder
            hook.remove()
        return encoded

    with torch.no_grad():
        reference = encode_with_rows()
        hosted = {name: HostTable(lookups, fake_device) for name, module in encoders.items()
                  if name in slots and (lookups := table_lookups(module, family.never_run.get(name, ())))}
        assert hosted, f"{family_name}: no token table that can stay on the host (table_lookups)"
        encoded = encode_with_rows()
    assert all(t.weight.device.type == "cpu" for table in hosted.values() for t in table.lookups)
    for key, value in reference.items():
        if value is not None:
            assert encoded[key].device == value.device and torch.equal(encoded[key].cpu(), value.cpu()), key


@pytest.mark.parametrize("family", [name for name in family_names() if get_family_class(name).never_run])
def test_a_table_tied_to_a_head_that_never_runs_stays_on_the_host(family, fake_device, tmp_path, tiny_family_model,
                                                                  shape_images, monkeypatch):
    """FIBO Edit's SmolLM3 ties its head to its token table and declares the head never runs
    (ModelFamily.never_run): the table and the head stay on the host, a caption encodes as with
    them on the device, and the run trains and samples (the pipeline too runs the language model
    without its head: the head's guard would stop it)."""
    from modules.plan.run_plan import plan_run

    def config(where):
        return train_config(tiny_family_model(family), shape_images, tmp_path / where, STEPS,
                            {"model": {"family": family}, "train_device": str(fake_device)})

    def placed(trainer):
        return {name: table.device.type for name, table in tables(trainer).items()}, encoded(trainer)

    with monkeypatch.context() as patch:
        without_host_tables(patch)
        _, (kept_where, reference) = start(config("kept"), placed)
    _, (where, hosted) = start(config("hosted"), placed, train=True)
    assert set(kept_where.values()) == {"fakegpu"} and set(where.values()) == {"cpu"}
    for key, value in reference.items():
        assert torch.equal(hosted[key], value), key
    assert any("token tables on the host" in note for note in plan_run(config("hosted"), None, None).notes)


def test_a_tied_head_that_never_runs_is_off_the_device_in_the_plan_in_a_quantized_mode(tiny_family_model):
    """FIBO Edit's int8 SmolLM3 keeps its tied head dense, the table itself (skip_rules.py), in the
    plan's skeleton as in the load: the head waits on the host with the table (never_run), and the
    plan counts the one tensor once as the table, none of it on the device."""
    from modules.config.loading import build_config
    from modules.offload.layer_tensors import block_bytes
    from modules.plan.run_plan import Planner

    config = build_config([{"model": {"family": "fibo_edit", "base": str(tiny_family_model("fibo_edit")),
                                      "parts": {"text_encoder": {"weight_dtype": "int8"}}}}])
    planner = Planner(None)
    sized = planner.sizes(config, planner.weight_modes(config))
    encoder = sized["family"].parts["text_encoder"]
    assert encoder.lm_head.weight is token_embedding(encoder).weight  # (tied, not quantized apart)
    assert sized["parts"]["text_encoder"]["table"] == block_bytes(token_embedding(encoder))
