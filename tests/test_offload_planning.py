"""Which blocks layer offloading parks, on the real widths: `offload_fraction` is a share of block
bytes, the parked blocks are spread so no prefetch window carries two big ones where smaller ones
could go, and the prefetch depth is a config field. The models are built on the meta device from
resources/model_configs (benchmarks/offload_layout.py prints the same layouts)."""

from __future__ import annotations

import random

import pytest

from benchmarks.offload_layout import real_width_block_bytes
from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.offload.schedule import SHORT_ENOUGH, Pass, bytes_in_flight, choose_parked, schedule_table


@pytest.fixture(scope="module")
def sdxl_blocks() -> list[int]:
    return real_width_block_bytes("sdxl", "unet", "sdxl/unet")


@pytest.fixture(scope="module")
def flux_blocks() -> list[int]:
    return real_width_block_bytes("flux", "transformer", "flux/transformer")


def share(sizes: list[int], parked: list[int]) -> float:
    return sum(sizes[i] for i in parked) / sum(sizes)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_sdxl_parks_the_fraction_of_its_block_bytes(sdxl_blocks, fraction):
    # SDXL's 10-layer transformer blocks are 14% of the UNet each: chosen by count, 0.5 parked 87%
    assert len(sdxl_blocks) == 28
    assert fraction <= share(sdxl_blocks, choose_parked(sdxl_blocks, fraction)) <= fraction + 0.05


def test_sdxl_at_half_never_has_two_big_blocks_in_flight_at_once(sdxl_blocks):
    parked = choose_parked(sdxl_blocks, 0.5)
    largest = max(sdxl_blocks)
    assert bytes_in_flight(sdxl_blocks, parked) < 1.2 * largest


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_flux_parks_the_fraction_of_its_block_bytes_spread_over_both_kinds_of_block(flux_blocks, fraction):
    parked = choose_parked(flux_blocks, fraction)
    assert fraction <= share(flux_blocks, parked) <= fraction + 0.05
    double, single = [i for i in parked if i < 19], [i for i in parked if i >= 19]
    for kind, count in ((double, 19), (single, 38)):
        # each kind of block parks about the fraction of its own bytes: the transfers keep pace
        assert abs(len(kind) / count - fraction) < 0.1, parked
    if fraction <= 0.5:  # room to keep the big parked blocks apart: no two double blocks in a row
        assert all(b - a > 1 for a, b in zip(double, double[1:])), parked
    assert bytes_in_flight(flux_blocks, parked) <= 2 * max(flux_blocks)


def test_the_parked_bytes_reach_the_fraction_and_pass_it_by_little_for_any_sizes():
    generator = random.Random(0)
    for _ in range(200):
        sizes = [generator.choice([1, 2, 3, 10, 40]) * generator.randint(1, 5) for _ in range(generator.randint(1, 30))]
        fraction = generator.choice([0.05, 0.3, 0.5, 0.77, 0.95])
        parked = choose_parked(sizes, fraction)
        parked_bytes, total = sum(sizes[i] for i in parked), sum(sizes)
        assert parked_bytes >= fraction * total - SHORT_ENOUGH * total, (sizes, fraction, parked)
        # past it by at most the tolerance, or by less than the smallest block that could be dropped
        over = parked_bytes - fraction * total
        assert over <= max(0.01 * total, min(sizes[i] for i in parked)), (sizes, fraction, parked)


@pytest.mark.parametrize("window", [2, 3, 4])
def test_a_deeper_prefetch_keeps_more_parked_blocks_resident_and_the_needed_one_always(window):
    parked = [1, 2, 4, 6, 7]
    for kind in Pass:
        for block, resident in schedule_table(9, parked, kind, window):
            if block in parked:
                assert block in resident, (kind, block)
            assert len(resident) == window
    # the forward's first rows: block 0 runs while 1 is needed next and the rest are on their way
    assert schedule_table(9, parked, Pass.FORWARD_THEN_BACKWARD, window)[0] == (0, tuple(parked[:window]))


def test_offload_prefetch_is_bounded_and_named():
    assert build_config([{}]).model.parts["unet"].offload_prefetch == 1
    for bad in (0, 9):
        with pytest.raises(ConfigError, match=r"model\.parts\.unet\.offload_prefetch"):
            build_config([{"model": {"parts": {"unet": {"offload_prefetch": bad}}}}])


def test_a_few_bytes_short_of_the_share_do_not_cost_a_whole_block_more():
    # T5's 24 blocks: the first holds 4 KiB of position bias more than the others
    sizes = [385_896_448] + [385_892_352] * 23
    parked = choose_parked(sizes, 0.5)
    assert len(parked) == 12 and abs(sum(sizes[i] for i in parked) / sum(sizes) - 0.5) < 1e-4
