"""Per-sample random generators derived from (seed, stream, index).

Seeding by sample index, not by a running generator, makes a sample's randomness independent of
the order samples are drawn in, of DataLoader workers and of ranks: the same sample is always
masked (or generated) the same way.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1

# Streams keep the random numbers of different purposes and splits apart.
TRAIN = 0
VAL = 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from integers (nearby inputs give unrelated seeds)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1  # torch.Generator.manual_seed takes any 64-bit value; stay non-negative anyway


def sample_generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))
