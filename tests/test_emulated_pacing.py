"""PacedBlocks (emulated devices for the benchmarks): consecutive blocks of a chunk chain on one clock,
as a device runs a chunk's kernels back to back, and a chunk never lasts less than its emulated time."""

from __future__ import annotations

import time

import torch

from benchmarks.harness import emulated
from benchmarks.harness.emulated import CHAIN_GAP, emulated_model


def test_a_block_chains_only_onto_its_model_neighbour_in_the_same_direction_and_soon():
    emulated._done(("f", 3), 10.0)
    assert emulated._chained(("f", 3), 10.0 + CHAIN_GAP / 2) == 10.0  # block 4's forward right after block 3's
    assert emulated._chained(("f", 3), 10.0 + 2 * CHAIN_GAP) == 10.0 + 2 * CHAIN_GAP  # after a wait: its own start
    assert emulated._chained(("f", 5), 10.0 + CHAIN_GAP / 2) == 10.0 + CHAIN_GAP / 2  # not the block before it
    assert emulated._chained(("b", 3), 10.0 + CHAIN_GAP / 2) == 10.0 + CHAIN_GAP / 2  # the other direction


def test_paced_blocks_are_indexed_and_a_chunk_lasts_at_least_its_time():
    forward, backward, blocks = 2e-3, 4e-3, 6
    model = emulated_model(blocks, 8, forward, backward, paced=True)
    assert [b.index for b in model] == list(range(blocks))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    t0 = time.perf_counter()
    y = model(x)
    t1 = time.perf_counter()
    y.sum().backward()
    t2 = time.perf_counter()
    # chaining moves a block's start back to its neighbour's deadline, never before it
    assert t1 - t0 >= blocks * forward * 0.999
    assert t2 - t1 >= blocks * backward * 0.999
    assert emulated._CHAIN["after"] == ("b", 0)  # the backward ended on the first block
