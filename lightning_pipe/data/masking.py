"""BERT-style masking with a fixed number of predicted positions per sample.

Every sample predicts exactly k positions, so a loss averaged over all predicted tokens of a batch
equals the mean of the per-sample means. That makes the loss of a batch the sample-weighted mean
of its micro-batches' losses, which pipeline micro-batching relies on for exact equality.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def num_predicted(seq_len: int, mask_prob: float) -> int:
    return max(1, round(mask_prob * seq_len))


def mask_tokens(
    ids: Tensor, k: int, generator: torch.Generator, mask_id: int, num_random: int, random_table: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Choose k positions of the 1-D `ids`; return (inputs, labels).

    Of the chosen positions about 80% become `mask_id`, 10% a random id in [0, num_random) and 10%
    stay unchanged (BERT), decided per position. With `random_table` (`num_random` ids, e.g. a
    tokenizer's ordinary ids) the random id is ``random_table[r]`` instead of ``r``. Labels hold the
    original ids there and `IGNORE_INDEX` elsewhere.
    """
    positions = torch.randperm(ids.numel(), generator=generator)[:k]
    # Draw everything up front, in a fixed order, so the result depends only on the generator.
    choice = torch.rand(k, generator=generator)
    random_ids = torch.randint(0, num_random, (k,), generator=generator, dtype=ids.dtype)
    if random_table is not None:
        random_ids = random_table.to(ids.dtype)[random_ids]

    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[positions] = ids[positions]
    inputs = ids.clone()
    to_mask = choice < 0.8
    to_random = (choice >= 0.8) & (choice < 0.9)
    inputs[positions[to_mask]] = mask_id
    inputs[positions[to_random]] = random_ids[to_random]
    return inputs, labels
