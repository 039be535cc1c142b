"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v model chunks per rank, placed round-robin.

Chunk c lives on rank c % p, so a micro-batch passes every rank v times and each stage's work is
1/v of a plain stage: the fill and drain bubbles shrink by v, at the price of v times the
messages. Each rank runs micro-batches in groups of p per chunk (forwards through its chunks in
order, backwards in reverse), with (p - rank - 1) * 2 + (v - 1) * p warm-up forwards.
"""

from __future__ import annotations

from ..errors import SettingError
from .actions import Op, PipelineSchedule
from .lowering import lower


def interleaved_1f1b(stages: int, microbatches: int, chunks: int = 2) -> PipelineSchedule:
    p, v, m = stages, chunks, microbatches
    if v < 1:
        raise ValueError(f"chunks={v}: the number of model chunks per rank must be >= 1")
    if m % p:
        raise SettingError(
            f"microbatches={m}: interleaved 1F1B needs a multiple of the {p} stages (e.g. {p * max(1, m // p + 1)})", "microbatches"
        )
    total = m * v

    def forward(k: int, rank: int) -> tuple[Op, int, int]:
        local = (k // p) % v
        return Op.FORWARD, local * p + rank, (k // (p * v)) * p + k % p

    def backward(k: int, rank: int) -> tuple[Op, int, int]:
        local = v - 1 - (k // p) % v
        return Op.BACKWARD, local * p + rank, (k // (p * v)) * p + k % p

    compute = []
    for rank in range(p):
        warmup = total if v > 1 and m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
        order = [forward(k, rank) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k, rank), backward(k, rank)]
        order += [backward(k, rank) for k in range(total - warmup, total)]
        compute.append(order)
    return lower(f"interleaved-v{v}", compute, tuple(c % p for c in range(p * v)), m)


def interleaved_chunks(stages: int, chunks: int = 2) -> int:
    return stages * chunks


def interleaved_misfit(stages: int, num_blocks: int, chunks: int = 2) -> str:
    """Why v chunks per rank do not fit a model of `num_blocks` blocks, and what fits."""
    most = num_blocks // stages
    hint = f"chunks <= {most}" if most else "fewer ranks"
    return (
        f"schedule='interleaved' with chunks={chunks} on {stages} ranks cuts the model into "
        f"{stages * chunks} chunks, more than its {num_blocks} blocks: use {hint}"
    )
