"""LyCORIS (lycoris-lora, the format's owner) and this trainer agree on every algorithm, on
single layers of the real models' widths (320, 640, 768, 1280, 3072):

- a trainer file (kohya layout, saved by save_adapter_file) loads with LyCORIS's own
  `create_network_from_weights`, and LyCORIS's forward equals the trainer's hooked one;
- a LyCORIS-made module with random weights, saved as LyCORIS saves it, continues in the trainer
  (`load_adapter_file`, what adapter.init_from runs) with equal outputs.

Also what LyCORIS refuses: DoRA on the input axis (its loader makes output-axis magnitudes), and
LoKr on a conv with a factor its loader cannot re-derive (its own files there too).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from modules.adapters.adapter_set import AdapterSet
from modules.adapters.formats.files import load_adapter_file, save_adapter_file
from modules.adapters.registry import create_adapter
from modules.config.train_config import AdapterConfig
from modules.model.base import ModelFamily

NAME = "lora_unet_layer"  # LyCORIS's kohya name of a module called "layer" in the unet it is given

LAYERS = {  # real widths: SD1.5/SDXL attention and MLP, CLIP-L, FLUX's inner width
    "linear-768-320": lambda: nn.Linear(768, 320),
    "linear-320-1280": lambda: nn.Linear(320, 1280),
    "linear-1280-640": lambda: nn.Linear(1280, 640),
    "linear-3072-3072": lambda: nn.Linear(3072, 3072),
    "conv-320-640": lambda: nn.Conv2d(320, 640, 3, padding=1),
}
ALGORITHMS = {
    "lora": {"type": "lora", "rank": 8, "alpha": 4},
    "dora": {"type": "lora", "rank": 8, "alpha": 4, "dora": True, "dora_axis": "output"},  # LyCORIS's axis
    "loha": {"type": "loha", "rank": 4, "alpha": 2},
    "lokr-small-factor": {"type": "lokr", "rank": 4, "alpha": 2, "factor": 4},
    "lokr-large-factor": {"type": "lokr", "rank": 4, "alpha": 2, "factor": 32},
    "lokr-square-decomposed-both": {"type": "lokr", "rank": 2, "alpha": 1, "decompose_both": True},
    "lokr-weight-decomposed": {"type": "lokr", "rank": 4, "alpha": 2, "factor": 16, "dora": True,
                                "dora_axis": "output"},
    "lokr-full": {"type": "lokr", "rank": 4, "alpha": 4, "factor": 8, "full_matrix": True},
    "oft": {"type": "oft", "block_size": 32},
    "oft-constrained": {"type": "oft", "block_size": 16, "constraint": 1e-4},
}


class OneLayerFamily:
    """The naming side of a ModelFamily (its defaults) for one layer "layer" in a part "unet"."""

    label = "one layer"
    key_layout = ModelFamily.key_layout  # the default: no layout beyond the diffusers names
    original_layers = ModelFamily.original_layers
    other_stems = ModelFamily.other_stems
    comfy_module_name = ModelFamily.comfy_module_name
    canonical_module_name = ModelFamily.canonical_module_name
    comfyui_skips_diffusers_key = ModelFamily.comfyui_skips_diffusers_key
    sd_scripts_skips_key = ModelFamily.sd_scripts_skips_key
    diffusers_skips_key = ModelFamily.diffusers_skips_key
    unstacked_kohya_stem = ModelFamily.unstacked_kohya_stem
    kohya_file_stem = ModelFamily.kohya_file_stem
    comfy_text_encoder_stem = ModelFamily.comfy_text_encoder_stem
    file_layout = ModelFamily.file_layout

    def spec(self, part):
        return SimpleNamespace(adapter_prefix="lora_unet")


def _input(layer):
    generator = torch.Generator().manual_seed(7)
    if isinstance(layer, nn.Conv2d):
        return torch.randn(2, layer.in_channels, 6, 6, generator=generator)
    return torch.randn(3, layer.in_features, generator=generator)


def _ours(layer, options):
    config = AdapterConfig(**options)
    adapter = create_adapter(config, "unet", NAME, layer, torch.device("cpu"), torch.float32)
    adapters = AdapterSet()
    adapters.add("unet", adapter, "layer")
    adapters.hook()
    return adapters, adapter


def _lycoris_forward(network_modules, layer, x):
    for module in network_modules:
        module.apply_to()
    try:
        with torch.no_grad():
            return layer(x)
    finally:
        for module in network_modules:
            module.restore()


@pytest.fixture(scope="module", params=list(LAYERS))
def layer(request):
    torch.manual_seed(0)
    return LAYERS[request.param]().eval()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_trainer_file_loads_in_lycoris_and_computes_the_same(layer, algorithm, tmp_path):
    from lycoris.kohya import create_network_from_weights

    adapters, adapter = _ours(layer, ALGORITHMS[algorithm])
    try:
        generator = torch.Generator().manual_seed(1)
        std = {"loha": 0.3, "lokr": 0.1}.get(adapter.algorithm, 0.02)
        with torch.no_grad():
            for parameter in adapter.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * std)
        x = _input(layer)
        with torch.no_grad():
            ours = layer(x)
        path = tmp_path / "adapter.safetensors"
        save_adapter_file(path, adapters, OneLayerFamily(), "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    with torch.no_grad():
        plain = layer(x)
    unet = nn.Module()
    unet.layer = layer
    if isinstance(layer, nn.Conv2d) and algorithm == "lokr-large-factor":
        # LyCORIS re-derives the factor from w2_b's width, which on a conv includes the kernel, so
        # it refuses its own files here too: the trainer's file is as loadable as LyCORIS's
        own = tmp_path / "lycoris-own.safetensors"
        made = _lycoris_module(layer, ALGORITHMS[algorithm])
        save_file({f"{NAME}.{k}": v.contiguous() for k, v in made.state_dict().items() if k != "scalar"}, str(own))
        for file in (path, own):
            with pytest.raises(RuntimeError, match="must match the size"):
                create_network_from_weights(1.0, str(file), None, None, unet)
        return
    network, _ = create_network_from_weights(1.0, str(path), None, None, unet)
    assert len(network.unet_loras) == 1
    theirs = _lycoris_forward(network.unet_loras, layer, x)
    assert (ours - plain).abs().max() > 1e-3  # the adapter does something worth matching
    # float32 sums of 3072 products in another order (LyCORIS's kernels, the thread count) differ by a few
    # ulps of the output's size: the bound scales with it (1e-5 of the largest output, at least 1e-5)
    assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, ours.abs().max().item()), (ours - theirs).abs().max()


def _lycoris_module(layer, options):
    """The LyCORIS module a run of these options corresponds to, random in every tensor."""
    from lycoris.modules.diag_oft import DiagOFTModule
    from lycoris.modules.locon import LoConModule
    from lycoris.modules.loha import LohaModule
    from lycoris.modules.lokr import LokrModule

    kind = options["type"]
    if kind == "lora":
        module = LoConModule(NAME, layer, 1, options["rank"], options["alpha"],
                             weight_decompose=options.get("dora", False))
    elif kind == "loha":
        module = LohaModule(NAME, layer, 1, options["rank"], options["alpha"])
    elif kind == "lokr":
        module = LokrModule(NAME, layer, 1, options["rank"], options["alpha"], factor=options.get("factor", -1),
                            decompose_both=options.get("decompose_both", False),
                            full_matrix=options.get("full_matrix", False),
                            weight_decompose=options.get("dora", False))
    else:
        module = DiagOFTModule(NAME, layer, 1, options["block_size"], constraint=options.get("constraint", 0))
    generator = torch.Generator().manual_seed(3)
    std = {"loha": 0.3, "lokr": 0.1}.get(kind, 0.02)  # products of factors need larger factors to show
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name != "dora_scale":
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
            else:
                parameter.mul_(1 + 0.1 * torch.rand(parameter.shape, generator=generator))
    return module.eval()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_lycoris_made_file_continues_in_the_trainer(layer, algorithm, tmp_path):
    options = ALGORITHMS[algorithm]
    lycoris = _lycoris_module(layer, options)
    state = {f"{NAME}.{k}": v.detach().contiguous() for k, v in lycoris.state_dict().items() if k != "scalar"}
    path = tmp_path / "lycoris.safetensors"
    save_file(state, str(path))
    x = _input(layer)
    theirs = _lycoris_forward([lycoris], layer, x)
    adapters, _ = _ours(layer, options)
    try:
        load_adapter_file(path, adapters, OneLayerFamily())
        with torch.no_grad():
            ours = layer(x)
    finally:
        adapters.unhook()
    with torch.no_grad():
        plain = layer(x)
    assert (theirs - plain).abs().max() > 1e-3
    # float32 sums of 3072 products in another order (LyCORIS's kernels, the thread count) differ by a few
    # ulps of the output's size: the bound scales with it (1e-5 of the largest output, at least 1e-5)
    assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, ours.abs().max().item()), (ours - theirs).abs().max()


def test_lycoris_refuses_dora_on_the_input_axis(tmp_path):
    from lycoris.kohya import create_network_from_weights

    layer = nn.Linear(768, 320)
    adapters, _ = _ours(layer, {"type": "lora", "rank": 4, "dora": True, "dora_axis": "input"})
    try:
        path = tmp_path / "input-axis.safetensors"
        save_adapter_file(path, adapters, OneLayerFamily(), "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    unet = nn.Module()
    unet.layer = copy.deepcopy(layer)
    with pytest.raises(RuntimeError):
        create_network_from_weights(1.0, str(path), None, None, unet)


def test_diffusers_format_is_refused_where_diffusers_cannot_rebuild_lycoris_splits():
    """diffusers infers peft's decompose_factor from the file; with factor 32 on 320- and
    640-wide layers (LyCORIS: 10x32 and 20x32) no peft factor reproduces both."""
    from modules.adapters.formats.files import AdapterFileError, check_output_format

    adapters = AdapterSet()
    config = AdapterConfig(type="lokr", rank=4, factor=32)
    for width in (320, 640):
        adapters.add("unet", create_adapter(config, "unet", f"{NAME}{width}", nn.Linear(width, width),
                                            torch.device("cpu"), torch.float32), f"layer{width}")
    with pytest.raises(AdapterFileError, match=r"^output\.format: 'diffusers' cannot hold.*factor"):
        check_output_format("diffusers", adapters, OneLayerFamily())
    from diffusers.utils.peft_utils import _create_lokr_config  # what the refusal predicts

    peft_state = {f"{a.name}.{k}": v for a in adapters for k, v in a.state_dict().items() if k != "alpha"}
    with pytest.raises(ValueError, match="decompose_factor"):
        _create_lokr_config(peft_state, None)
    check_output_format("kohya", adapters, OneLayerFamily())
    small = AdapterSet()
    config = AdapterConfig(type="lokr", rank=4, factor=8)
    for width in (320, 640):
        small.add("unet", create_adapter(config, "unet", f"{NAME}{width}", nn.Linear(width, width),
                                         torch.device("cpu"), torch.float32), f"layer{width}")
    check_output_format("diffusers", small, OneLayerFamily())


def _comfyui_oft_weight(weight, blocks, alpha):
    """ComfyUI's OFT merge (comfy/weight_adapter/oft.py), written from its description: ||Q||
    clipped to alpha when alpha > 0, R = (I + Q)(I - Q)^-1, W' = R^T applied per block of rows."""
    q = blocks - blocks.transpose(1, 2)
    if alpha > 0 and q.norm() + 1e-8 > alpha:
        q = q * alpha / (q.norm() + 1e-8)
    eye = torch.eye(blocks.shape[1])
    r = (eye + q) @ torch.linalg.inv(eye - q)
    rows = weight.view(blocks.shape[0], blocks.shape[1], -1)
    return torch.einsum("knm,knc->kmc", r, rows).reshape(weight.shape)


def _a1111_oft_weight(weight, blocks, alpha):
    """A1111's kohya-style OFT (extensions-builtin/Lora/network_oft.py): blocks = oft_blocks.shape[0],
    block size = out / blocks, ||Q|| clamped to alpha * out (so alpha 0 clamps Q to nothing)."""
    out = weight.shape[0]
    q = blocks - blocks.transpose(1, 2)
    norm = q.norm()
    q = q * ((torch.clamp(norm, max=alpha * out) + 1e-8) / (norm + 1e-8))
    size = out // blocks.shape[0]
    eye = torch.eye(size)
    r = (eye + q) @ torch.linalg.inv(eye - q)
    rows = weight.view(blocks.shape[0], size, -1)
    return torch.einsum("knm,knc->kmc", r, rows).reshape(weight.shape)


@pytest.mark.parametrize("constraint", [0.0, 1e-4])
def test_oft_files_compute_the_same_in_comfyui_and_a1111_maths(tmp_path, constraint):
    """A file never carries alpha 0 (A1111 would clamp Q to 0: no rotation). Without a constraint
    its alpha is a bound neither clips at; with one, A1111 matches and ComfyUI (which clips to
    alpha itself) differs once the constraint binds, as README's table says."""
    from safetensors.torch import load_file

    layer = nn.Linear(768, 320)
    adapters, adapter = _ours(layer, {"type": "oft", "block_size": 32, "constraint": constraint})
    try:
        with torch.no_grad():
            adapter.oft_blocks.normal_(0, 0.02, generator=torch.Generator().manual_seed(4))
            ours = adapter.merged_weight()
        path = tmp_path / "oft.safetensors"
        save_adapter_file(path, adapters, OneLayerFamily(), "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    file = load_file(str(path))
    blocks, alpha = file[f"{NAME}.oft_blocks"], float(file[f"{NAME}.alpha"])
    assert blocks.shape == (32, 10, 10) and alpha > 0
    weight = layer.weight.detach()
    assert (_a1111_oft_weight(weight, blocks, alpha) - ours).abs().max() < 1e-5
    comfyui = (_comfyui_oft_weight(weight, blocks, alpha) - ours).abs().max()
    assert comfyui < 1e-5 if constraint == 0 else comfyui > 1e-4
    assert (_a1111_oft_weight(weight, blocks, 0.0) - weight).abs().max() < 1e-8  # what alpha 0 would do: nothing


# what a LyCORIS file's tensors decide, by option (alpha and OFT's constraint are tensors: loaded)
ADOPTED = ("rank", "dora", "dora_axis", "factor", "decompose_both", "full_matrix", "block_size")


@pytest.mark.parametrize("shape", ["linear-768-320", "conv-320-640"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_continuing_from_a_lycoris_file_adopts_its_layout(algorithm, shape, tmp_path):
    """adapter.init_from with only adapter.type given: the file's DoRA axis, rank and the
    algorithm's options (LoKr's factor, decompose_both, full_matrix; OFT's block size) are adopted
    (and said), and the run continues with LyCORIS's outputs."""
    from modules.adapters.formats.adopt import adopt_file_layout

    if shape.startswith("conv") and algorithm == "lokr-large-factor":
        pytest.skip("LyCORIS refuses its own file there (test_a_trainer_file_loads_in_lycoris_...)")
    torch.manual_seed(0)
    layer = LAYERS[shape]().eval()
    options = ALGORITHMS[algorithm]
    lycoris = _lycoris_module(layer, options)
    path = tmp_path / "lycoris.safetensors"
    save_file({f"{NAME}.{k}": v.detach().contiguous() for k, v in lycoris.state_dict().items() if k != "scalar"},
              str(path))
    config, said = adopt_file_layout(AdapterConfig(type=options["type"], init_from=str(path)), path)
    fully_full = options.get("full_matrix")  # no low-rank factor: no rank to see, none needed
    for field in ADOPTED:
        if field in options and not (field == "rank" and fully_full):
            assert getattr(config, field) == options[field], (field, said)
            default = type(config).model_fields[field].default
            assert (f"adapter.{field}: {options[field]!r}" in "".join(said)) == (options[field] != default), said
    x = _input(layer)
    theirs = _lycoris_forward([lycoris], layer, x)
    adapter = create_adapter(config, "unet", NAME, layer, torch.device("cpu"), torch.float32)
    adapters = AdapterSet()
    adapters.add("unet", adapter, "layer")
    adapters.hook()
    try:
        load_adapter_file(path, adapters, OneLayerFamily())
        with torch.no_grad():
            ours = layer(x)
    finally:
        adapters.unhook()
    assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, ours.abs().max().item())


def test_an_explicit_lokr_option_the_file_contradicts_is_refused(tmp_path):
    from modules.adapters.formats.adopt import adopt_file_layout
    from modules.adapters.formats.files import AdapterFileError

    lycoris = _lycoris_module(nn.Linear(768, 320), ALGORITHMS["lokr-small-factor"])
    path = tmp_path / "lycoris.safetensors"
    save_file({f"{NAME}.{k}": v.detach().contiguous() for k, v in lycoris.state_dict().items() if k != "scalar"},
              str(path))
    with pytest.raises(AdapterFileError, match=r"adapter\.factor is 8 but the file's is 4"):
        adopt_file_layout(AdapterConfig(type="lokr", rank=4, factor=8), path)
    config, said = adopt_file_layout(AdapterConfig(type="lokr", rank=4, factor=4), path)
    assert said == [] and config.factor == 4


def test_an_explicit_setting_the_lycoris_file_contradicts_is_refused(tmp_path):
    from modules.adapters.formats.adopt import adopt_file_layout
    from modules.adapters.formats.files import AdapterFileError

    lycoris = _lycoris_module(nn.Linear(768, 320), ALGORITHMS["dora"])
    path = tmp_path / "lycoris.safetensors"
    save_file({f"{NAME}.{k}": v.detach().contiguous() for k, v in lycoris.state_dict().items() if k != "scalar"},
              str(path))
    with pytest.raises(AdapterFileError, match=r"adapter\.dora_axis is 'input' but the file's is 'output'"):
        adopt_file_layout(AdapterConfig(type="lora", dora=True, dora_axis="input"), path)
    with pytest.raises(AdapterFileError, match=r"adapter\.rank is 4 but the file's is 8"):
        adopt_file_layout(AdapterConfig(type="lora", rank=4), path)
    config, said = adopt_file_layout(AdapterConfig(type="lora", rank=8, dora=True, dora_axis="output"), path)
    assert said == [] and config.dora_axis == "output"


def test_a_lycoris_oft_file_with_layers_outside_the_preset_continues_in_the_trainer(tmp_path, tiny_model,
                                                                                     shape_images):
    """LyCORIS's OFT on the tiny UNet's attention/MLP layers and on conv_out, which the default
    preset (attn-mlp) leaves out: the run adopts conv_out (says so, trains it) and its UNet
    computes what LyCORIS's does."""
    from conftest import train_config

    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.generic_trainer import GenericTrainer

    class Warnings(TrainCallbacks):
        def __init__(self):
            super().__init__()
            self.said: list[str] = []

        def on_warning(self, message):
            self.said.append(message)

    def trainer(workspace, **adapter):
        callbacks = Warnings()
        run = GenericTrainer(train_config(tiny_model, shape_images, workspace, {
            "adapter": {"type": "oft", "block_size": 2, **adapter}, "schedule": {"max_steps": 1}}), callbacks)
        run.start()
        return run, callbacks

    plain, _ = trainer(tmp_path / "a")
    unet = plain.family.parts["unet"]
    chosen = {a.name: plain.adapters.module_name_of[a.name] for a in plain.adapters}
    plain.adapters.unhook()
    assert "conv_out" not in chosen.values()
    chosen["lora_unet_conv_out"] = "conv_out"
    modules = dict(unet.named_modules())
    lycoris = [_lycoris_module(modules[module_name], {"type": "oft", "block_size": 2}) for module_name in chosen.values()]
    for module, name in zip(lycoris, chosen):
        module.lora_name = name
    path = tmp_path / "lycoris-oft.safetensors"
    save_file({f"{name}.{k}": v.detach().contiguous() for module, name in zip(lycoris, chosen)
               for k, v in module.state_dict().items() if k != "scalar"}, str(path))

    generator = torch.Generator().manual_seed(5)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)

    def output(model):
        with torch.no_grad():
            return model(sample, torch.tensor([500]), encoder_hidden_states=context).sample

    for module in lycoris:
        module.apply_to()
    try:
        theirs = output(unet)
    finally:
        for module in lycoris:
            module.restore()
    before = output(unet)

    resumed, callbacks = trainer(tmp_path / "b", init_from=str(path))
    names = {a.name for a in resumed.adapters}
    assert names == set(chosen)
    assert [w for w in callbacks.said if "adopted the file's layers" in w and "unet.conv_out" in w
            and "'attn-mlp'" in w], callbacks.said
    ours = output(resumed.family.parts["unet"])
    assert (theirs - before).abs().max() > 1e-3
    assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, theirs.abs().max().item())
    conv_out = resumed.adapters.modules["lora_unet_conv_out"]
    assert any(p is q for p in resumed.adapters.parameters("unet") for q in conv_out.parameters())
    resumed.train()
    assert resumed.step == 1
