"""A phase pass replays a VAE's repeated encoder and decoder calls and its tile blends
(modules/plan/repeated_calls.py):
each key's first call runs, the rest (in that pass and the passes after it) are made from its note. The peak must be the pass's without
replays to the byte: a causal Wan VAE (its encoder and decoder keep each conv's last frames in a
list they mutate, call after call) and an SD-style AutoencoderKL, tiled (tiles of several shapes)
and whole, on meta. And a wrong key must show: a toy module whose bytes depend on its input's shape
and on what its cache list holds, planned with and without replays."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modules.plan import phase_pass
from modules.plan.attention import efficient_attention
from modules.plan.meta_ops import MetaOpCache
from modules.plan.repeated_calls import RepeatedCalls


def _wan_vae():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                      tile_sample_stride_width=48)
    return vae, (1, 3, 13, 112, 160)  # 3 x 4 tiles of four shapes, 4 latent frames


def _kl_vae():
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32,
                        sample_size=32)  # 32 px tiles, 25% overlap
    vae.enable_tiling()
    return vae, (1, 3, 80, 112)


def _peaks(vae, pixels_shape, tiled: bool, replay: bool) -> tuple[int, int, int]:
    """(the encode's peak, the decode's, a second encode's) on meta, in passes that share one
    RepeatedCalls of the VAE's children where `replay` (the second encode's calls all replayed)."""
    meta = MetaOpCache()
    vae.use_tiling = tiled
    known = [*vae.parameters(), *vae.buffers()]
    blends = [(vae, name) for name in ("blend_v", "blend_h")]  # (in place into their second argument)
    repeated = RepeatedCalls(vae.children(), blends) if replay else None
    latents = []

    def encode():
        latents.append(vae.encode(torch.empty(pixels_shape, device="meta")).latent_dist.mean)

    def decode():
        vae.decode(torch.empty(latents[0].shape, device="meta"), return_dict=False)
    return (phase_pass._peak(encode, known, meta, efficient_attention, repeated),
            phase_pass._peak(decode, known, meta, efficient_attention, repeated),
            phase_pass._peak(encode, known + latents, meta, efficient_attention, repeated))


@pytest.mark.parametrize("make", [_wan_vae, _kl_vae], ids=["wan causal vae", "autoencoder kl"])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "whole"])
def test_replayed_vae_calls_plan_the_passes_peak_to_the_byte(make, tiled, monkeypatch):
    with torch.device("meta"):
        vae, shape = make()
    vae.eval()
    replays = []
    replayed = RepeatedCalls._replay
    monkeypatch.setattr(RepeatedCalls, "_replay", lambda self, *args: replays.append(1) or replayed(self, *args))
    assert _peaks(vae, shape, tiled, replay=True) == _peaks(vae, shape, tiled, replay=False)
    if tiled or make is _wan_vae:  # (a whole KL decode calls its decoder once)
        assert replays, "nothing was replayed"


class _Cached(nn.Module):
    """Holds more while its cache holds a tensor, and more for a larger input; keeps its input's double."""

    def forward(self, x, cache):
        scratch = torch.empty(x.shape[0] * 64, device=x.device)  # (a transient the input's shape sizes)
        if cache[0] is not None:
            scratch = torch.cat([scratch, cache[0], cache[0]])
        cache[0] = x * 2
        return x + scratch[:1]


def _toy_peak(replay: bool) -> tuple[int, int]:
    module = _Cached()
    live_calls = []

    def run():
        cache = [None]
        for size in (8, 8, 8, 32, 32, 8):
            live_calls.append(module(torch.empty(size, device="meta"), cache))
    meta = MetaOpCache()
    peak = phase_pass._peak(run, [], meta, efficient_attention, RepeatedCalls([module]) if replay else None)
    return peak, len(live_calls)


def test_a_call_is_replayed_only_for_the_same_shapes_and_cache_state(monkeypatch):
    replays = []
    replayed = RepeatedCalls._replay
    monkeypatch.setattr(RepeatedCalls, "_replay", lambda self, *args: replays.append(1) or replayed(self, *args))
    assert _toy_peak(replay=True) == _toy_peak(replay=False)
    # (8, empty cache) runs; (8, cache of 8) runs, then is replayed; (32, cache of 8) and (32, cache of 32)
    # run; (8, cache of 32) runs
    assert len(replays) == 1
