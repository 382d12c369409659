"""The passes outside the training step, on tensors without data: what filling the caches and making
a sample hold on the train device beyond the weights (run_plan's `outside_step` phases).

Caching (modules/data/cache_build.py): the image encoders over a chunk of ENCODE_BATCH images (with
`data.flip` their mirrored copies too; a VAE that can takes them one at a time,
one_image_per_encoder_call) at the largest training resolution (a
video family's clips of the longest concept's frames), its pixel conditioning included, as the
pixels reach the device and the latents are cast to float32; then the text encoders over
ENCODE_BATCH captions of the planned tokens (`planning_tokens`). Both without grad, the parts in
eval mode as loaded. A phase that the run does not have (latents or text not cached) is left out.

Sampling (modules/sampling/, the families' pipelines): for the sample prompt that holds the most
(width x height x frames x the guidance batch), the prompt's text encoding (batch 1), the
denoiser's forward through the family's own `predict`, without grad, in eval mode, on latents of
the prompt's size (two where the family's pipeline batches the conditional and unconditional
passes at the prompt's cfg: `batched_guidance_above`; with the prompt's control images' latents) and the
conditioning `planning_conditioning_with_controls` describes; then the VAE's own `decode` of the
latents its `encode` gives at that size (what the pipelines decode, before their scaling), tiled as
`sampling.vae_tiling` says (modules/sampling/vae_tiling.py, the sampler's own switch). The
phase holds the largest of these (they run one after another); the adapters' small forward
intermediates and the pipeline's latents between steps are not counted.

Every part runs on the meta device (meta_ops.py), the text encoders as in the step (fake_pass.py):
transformers' mask helpers take the branch they take for fake tensors (traced_meta.py), and an
encoder that still reads a value runs on fake tensors. Every new storage on the train device is
counted by LiveBytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from modules.plan.attention import efficient_attention
from modules.plan.live_bytes import LiveBytes
from modules.plan.meta_ops import MetaOpCache
from modules.plan.repeated_calls import RepeatedCalls

TRAIN = torch.device("meta")


@dataclass(frozen=True)
class PhaseFigures:
    caching: int | None  # the most bytes filling the caches holds beyond the weights; None: nothing is cached
    sampling: int | None  # the same for one sample of the largest prompt; None: no sample prompt
    notes: tuple[str, ...] = field(default_factory=tuple)


def largest_prompt(config, family):
    """The enabled sample prompt that holds the most: its pixels x frames x guidance batch (None: none)."""
    prompts = [p for p in config.sampling.prompts if p.enabled]
    if not prompts:
        return None
    return max(prompts, key=lambda p: p.width * p.height * sample_frames(p, family) * guidance_batch(p, family))


def sample_frames(prompt, family) -> int:
    return prompt.frames if prompt.frames > 1 and family.temporal_quantum is not None else 1


def guidance_batch(prompt, family) -> int:
    """2 where the family's pipeline runs the unconditional pass in the same batch at the prompt's cfg, else 1."""
    above = family.batched_guidance_above
    return 2 if above is not None and prompt.cfg > above else 1


def cache_batch(config) -> int:
    from modules.data.cache_build import ENCODE_BATCH

    return ENCODE_BATCH * (2 if config.data.flip else 1)


class PhasePasses:
    """The caching and sampling passes on `family`'s meta parts (a fresh architecture: the passes place
    its tensors), each run once: the plans of one config with sampling's VAE tiling on and off
    (`auto`, resolved last: auto.resolve_auto_vae_tiling) share the caching phase, the prompt's text
    encoding and, where the VAE does not run in it, the denoiser's pass; only what tiling changes
    runs again. `cache_latents`/`cache_text`: which caches the run fills, at `resolution` and `frames`."""

    def __init__(self, family, config, resolution: int, frames: int, cache_latents: bool, cache_text: bool,
                 fused_attention: bool = True):
        self.family, self.config = family, config
        self.meta = MetaOpCache()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.attention = efficient_attention if fused_attention else contextlib.nullcontext
        for module in family.parts.values():
            module.eval()
        self.vae = _decoding_part(family)
        # what the passes call again on the same shapes (repeated_calls.py): a VAE encode or decode
        # its encoder and decoder once per frame chunk (and tile), in caching and sampling alike, a
        # tiled one diffusers' blend of each tile's edges into its neighbours'
        self.repeated = RepeatedCalls(self.vae.children() if self.vae is not None else [],
                                      [(self.vae, name) for name in ("blend_v", "blend_h")
                                       if callable(getattr(self.vae, name, None))])
        image_modules = [family.parts[p] for p in family.image_parts]
        for module in image_modules + [family.parts[family.denoiser_part]]:
            _place(module, self.meta)
        self.known = [t for m in family.parts.values() for t in (*m.parameters(), *m.buffers())]
        self.caching, self.notes, self.tokens = self._caching(config, resolution, frames, cache_latents, cache_text)
        self.cached_text = cache_text and self.tokens is not None
        self._sampling: dict[bool, tuple[int, list[str]]] = {}
        self._prompt_passes = None  # what of the sample tiling does not change (_PromptPasses)

    def _caching(self, config, resolution, frames, cache_latents, cache_text):
        family, notes, caching = self.family, [], None
        if cache_latents:
            from modules.data.cache_build import one_image_per_encoder_call

            def encode():
                batch = cache_batch(config)
                pixels = torch.empty(batch, 3, *((frames,) if frames > 1 else ()), resolution, resolution, device=TRAIN)
                family.encode_images(pixels).float()
                family.encode_pixel_conditioning(pixels)
            with one_image_per_encoder_call(family):  # as the cache build encodes (one image per VAE call)
                caching = _peak(encode, self.known, self.meta, self.attention, self.repeated)
        tokens = None
        if cache_text:
            from modules.data.cache_build import ENCODE_BATCH

            tokens = family.planning_tokens(ENCODE_BATCH, TRAIN)
            if tokens is None:
                notes.append("caching: the text encoders' activations are not planned (the family's text encoding "
                             "cannot run on shapes alone: planning_tokens)")
            else:
                caching = max(caching or 0, _text_peak(family, tokens, self.known, self.meta, self.fake,
                                                       self.attention))
        return caching, notes, tokens

    def figures(self, tiled: bool) -> PhaseFigures:
        """The phases' peaks with the sample decoded tiled (`tiled`) or whole."""
        prompt = largest_prompt(self.config, self.family)
        if prompt is None:
            return PhaseFigures(self.caching, None, tuple(self.notes))
        if tiled not in self._sampling:
            notes = []
            self._sampling[tiled] = (self._sampling_peak(prompt, notes, tiled), notes)
        sampling, notes = self._sampling[tiled]
        return PhaseFigures(self.caching, sampling, tuple(self.notes + notes))

    def _sampling_peak(self, prompt, notes, tiled: bool) -> int:
        from modules.sampling.vae_tiling import supports_tiling, tiled_decoding

        vae, meta, attention = self.vae, self.meta, self.attention
        if self._prompt_passes is None:
            self._prompt_passes = _PromptPasses(self, prompt)
        passes = self._prompt_passes
        peaks = list(passes.text_peaks)
        if tiled in passes.denoise:
            peaks.append(passes.denoise[tiled])
        else:
            with tiled_decoding([vae] if vae is not None else [], tiled), _runs(vae) as vae_ran:
                # (the sampler's switch holds for the whole pipeline: its own VAE encodes, an
                # image-to-video prompt's image or control images, tile too)
                peak = _peak(passes.denoise_pass, self.known + passes.inputs, meta, attention, self.repeated)
            peaks.append(peak)
            # where the VAE did not run in it, tiling changes nothing there: the other tiling's too
            passes.denoise.update({tiled: peak} if vae_ran else {True: peak, False: peak})
        if vae is None or passes.decoded is None:
            notes.append("sampling: the VAE decode is not planned (no image part with encode and decode)")
        else:
            z = passes.decoded
            if tiled and not supports_tiling(vae):
                notes.append(f"sampling: {type(vae).__name__} has no tiled decode: vae_tiling decodes it whole")

            def decode():
                with tiled_decoding([vae], tiled):  # the sampler's own switch (modules/sampling/vae_tiling.py)
                    vae.decode(torch.empty(z.shape, dtype=z.dtype, device=TRAIN), return_dict=False)
            peaks.append(_peak(decode, self.known, meta, attention, self.repeated))
        return max(peaks)


class _PromptPasses:
    """Of the sample prompt's passes, what tiling does not change: its latents' shapes, its text
    encoding's peak, the denoiser's pass (run by PhasePasses, under each tiling where the VAE runs in it)."""

    def __init__(self, passes: PhasePasses, prompt):
        family, meta = passes.family, passes.meta
        frames = sample_frames(prompt, family)
        batch = guidance_batch(prompt, family)
        controls = min(len(prompt.control_images), family.control_images)
        pixels = torch.empty(1, 3, *((frames,) if frames > 1 else ()), prompt.height, prompt.width, device=TRAIN)
        made = {}

        def shapes():  # the shapes; its peak unused, counted for the notes of the VAE's calls it makes,
            # which the denoiser's pass makes again (an image-to-video prompt's first-frame encode)
            made["latents"] = family.encode_images(pixels)
            made["conditioning"] = family.encode_pixel_conditioning(pixels)
        with _first_encoding(passes.vae) as encoded:
            _peak(shapes, passes.known, meta, passes.attention, passes.repeated)
        latents, conditioning = made["latents"], made["conditioning"]
        self.decoded = encoded[0] if encoded else None
        self.text_peaks = []
        tokens = None if passes.cached_text else family.planning_tokens(1, TRAIN)
        if tokens is not None:  # the prompt's own encoding (a negative one is a second call of the same size);
            # where caching encodes captions, at its larger batch on the same weights, that phase holds more
            self.text_peaks.append(_text_peak(family, tokens, passes.known, meta, passes.fake, passes.attention))
        self.inputs = [latents, *conditioning.values()]
        self.denoise: dict[bool, int] = {}  # tiled -> the denoiser pass's peak

        def denoise():
            from modules.util.torch_utils import make_generator

            if conditioning:  # a pipeline's own encoding of the prompt's image (image-to-video)
                family.encode_pixel_conditioning(torch.empty_like(pixels))
            text = {**family.planning_conditioning_with_controls(batch, TRAIN, controls, prompt.width, prompt.height),
                    **{k: _batched(v, batch) for k, v in conditioning.items()}}
            if controls:  # the control images' latents, encoded at the sample's size
                control_pixels = torch.empty(controls, 3, prompt.height, prompt.width, device=TRAIN)
                text["control_latents"] = _batched(family.encode_images(control_pixels).float().unsqueeze(0), batch)
            family.predict(_batched(latents, batch), text, make_generator("cpu", 0))
        self.denoise_pass = denoise


def measure_phases(family, config, resolution: int, frames: int, cache_latents: bool, cache_text: bool,
                   fused_attention: bool = True, tiled: bool | None = None) -> PhaseFigures:
    """The activation peaks of caching and of sampling `config`'s largest prompt (PhasePasses), with
    the decode tiled as `tiled` says (None: as the config plans it, planned_tiling)."""
    passes = PhasePasses(family, config, resolution, frames, cache_latents, cache_text, fused_attention)
    return passes.figures(planned_tiling(config) if tiled is None else tiled)


def planned_tiling(config) -> bool:
    """Whether the sampling phase decodes tiled: `sampling.vae_tiling` true, or auto (the plan
    resolves auto last, auto.resolve_auto_vae_tiling: until then the other autos are chosen against
    the tiled decode, so none parks or quantizes for what tiling would save)."""
    return config.sampling.vae_tiling is not False


def _batched(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.empty((batch, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)


def _peak(run, known, meta: MetaOpCache, attention, repeated: RepeatedCalls | None = None) -> int:
    """The most new bytes `run()` holds on the train device at once (meta tensors), without grad;
    of the calls `repeated` watches (a VAE's encoder and decoder), each key's first runs and the rest
    are replayed (repeated_calls.py)."""
    live = LiveBytes(TRAIN, meta.run, flops=False)  # (no phase's FLOPs are planned)
    live.known(known)
    with torch.no_grad(), live, attention(), \
            repeated.counting(live) if repeated is not None else contextlib.nullcontext():
        run()
    return live.peak


def _text_peak(family, tokens: dict, known, meta: MetaOpCache, fake: FakeTensorMode, attention) -> int:
    """The text encoders' pass over `tokens`, without grad: on meta (the quicker pass: Qwen2.5-VL's
    caching pass 0.09 s against 1.5 s on fake tensors), transformers' mask helpers taking the branch
    they take for fake tensors (traced_meta.py, as in the step), or where the encoders still ask a
    value of a tensor, on fake tensors."""
    from modules.plan.traced_meta import meta_tensors_traced

    parts = [family.parts[p] for p in family.text_parts]
    if not any(getattr(m, "_plan_fake", False) for m in parts):
        for module in parts:
            _place(module, meta)
        try:
            with meta_tensors_traced():
                return _peak(lambda: family.encode_text(tokens), _with_tensors(known, parts) + list(tokens.values()),
                             meta, attention)
        except (RuntimeError, NotImplementedError) as error:
            if "meta" not in str(error):
                raise
        for module in parts:  # again on fake tensors
            module._plan_on_train_device = False
            module._plan_fake = True
    for module in parts:
        _place(module, fake)
    live = LiveBytes(TRAIN, flops=False)
    with fake:
        live.known(_with_tensors(known, parts) + list(tokens.values()))
        with torch.no_grad(), live, attention():
            family.encode_text(tokens)
    return live.peak


def _with_tensors(known: list, modules) -> list:
    return known + [t for m in modules for t in (*m.parameters(), *m.buffers())]


def _place(module: torch.nn.Module, mode) -> None:
    """Every tensor of `module` empty on the train device, once (fake ones under a FakeTensorMode)."""
    if getattr(module, "_plan_on_train_device", False):
        return
    with mode:
        module.to_empty(device=TRAIN)
    module._plan_on_train_device = True


def _decoding_part(family):
    """The image part that encodes to latents and decodes them (the VAE), or None."""
    for part in family.image_parts:
        module = family.parts[part]
        if callable(getattr(module, "encode", None)) and callable(getattr(module, "decode", None)):
            return module
    return None


@contextlib.contextmanager
def _runs(vae):
    """A list inside the block that is not empty once any of `vae`'s modules has run (its encoder or
    decoder: diffusers' encode and decode, tiled or whole, compute only through them)."""
    ran: list[bool] = []
    if vae is None:
        yield ran
        return
    hooks = [module.register_forward_pre_hook(lambda *_: ran.append(True)) for module in vae.children()]
    try:
        yield ran
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _first_encoding(vae):
    """The latents (the distribution's mean) of the first call of `vae.encode` inside the block, in a list."""
    seen: list[torch.Tensor] = []
    if vae is None:
        yield seen
        return
    original = vae.encode

    def encode(*args, **kwargs):
        out = original(*args, **kwargs)
        if not seen:
            dist = out.latent_dist if hasattr(out, "latent_dist") else out[0]
            seen.append(dist.mean)
        return out

    vae.encode = encode
    try:
        yield seen
    finally:
        del vae.encode
