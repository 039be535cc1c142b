"""Sources of fixed-length token windows: slices of a token stream, or seeded random ids."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .seeding import sample_generator

# Keeps random token ids apart from the masking randomness of the same sample index.
_SYNTHETIC_PURPOSE = 0x5E7


def _check_index(index: int, length: int) -> int:
    if not 0 <= index < length:
        raise IndexError(f"window {index} out of range [0, {length})")
    return index


class StreamWindows(Dataset):
    """Windows of `length` tokens starting every `stride` tokens; a short tail is left out.

    The stream may be stored compactly (bytes as ``uint8``) or be a memory-mapped token file's
    `TokenSlice` (anything with ``dim()``, ``numel()`` and slicing to a tensor); windows come out as int64.
    """

    def __init__(self, tokens: Tensor, length: int, stride: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if length < 1 or stride < 1:
            raise ValueError(f"length={length} and stride={stride} must be >= 1")
        self.tokens, self.length, self.stride = tokens, length, stride

    def __len__(self) -> int:
        n = self.tokens.numel()
        return 0 if n < self.length else (n - self.length) // self.stride + 1

    def __getitem__(self, index: int) -> Tensor:
        start = _check_index(index, len(self)) * self.stride
        return self.tokens[start : start + self.length].long()


class RandomWindows(Dataset):
    """`num_samples` windows of uniform random ids in [0, vocab_size); no file is touched."""

    def __init__(self, num_samples: int, length: int, vocab_size: int, seed: int, stream: int) -> None:
        self.num_samples, self.length, self.vocab_size = num_samples, length, vocab_size
        self.seed, self.stream = seed, stream

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Tensor:
        g = sample_generator(self.seed, _SYNTHETIC_PURPOSE, self.stream, _check_index(index, len(self)))
        return torch.randint(0, self.vocab_size, (self.length,), generator=g)
