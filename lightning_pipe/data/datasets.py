"""Training samples for the two objectives, built from a source of token windows."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .masking import IGNORE_INDEX, mask_tokens, num_predicted
from .seeding import sample_generator

_MASKING_PURPOSE = 0x3A5C


class CausalLMDataset(Dataset):
    """(input_ids (T,), targets (T,)) from windows of T+1 tokens: targets are inputs shifted by one."""

    def __init__(self, windows: Dataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        w = self.windows[index]
        return w[:-1], w[1:]


class MaskedLMDataset(Dataset):
    """(input_ids (T,), attention_mask (T,), labels (T,)) from windows of T tokens.

    Exactly `num_predicted(T, mask_prob)` labels per sample are not `IGNORE_INDEX`. The masking is
    seeded by (seed, stream, index): a sample is masked the same way on every worker, rank and run.
    `frame` = (cls, sep): the window becomes ``[cls] + window + [sep]`` (T + 2 tokens), the k predicted
    positions drawn among the window's T.
    """

    def __init__(
        self,
        windows: Dataset,
        mask_prob: float,
        seed: int,
        stream: int,
        mask_id: int,
        num_random: int,
        random_table: Optional[Tensor] = None,
        frame: Optional[tuple[int, int]] = None,
    ) -> None:
        self.windows, self.mask_prob, self.frame = windows, mask_prob, frame
        self.seed, self.stream = seed, stream
        self.mask_id, self.num_random, self.random_table = mask_id, num_random, random_table

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        ids = self.windows[index]
        g = sample_generator(self.seed, _MASKING_PURPOSE, self.stream, index)
        inputs, labels = mask_tokens(ids, num_predicted(ids.numel(), self.mask_prob), g, self.mask_id, self.num_random, self.random_table)
        if self.frame is not None:
            cls, sep = (torch.tensor([i], dtype=inputs.dtype) for i in self.frame)
            inputs, labels = (
                torch.cat([cls, inputs, sep]),
                torch.cat([torch.full_like(cls, IGNORE_INDEX), labels, torch.full_like(sep, IGNORE_INDEX)]),
            )
        # Windows are always full, so nothing is padding.
        return inputs, torch.ones_like(inputs), labels
