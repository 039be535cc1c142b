"""The small GPT of bench_simulator.py (and its --speedup) and bench_advance.py, their common options,
the profile of its blocks with the loss (`gather_profile`) and the tied weights' all-reduce (`tied_allreduce`).

``args`` is a benchmark's parsed command line: vocab, layers, heads, hidden, seq, mbs (micro-batch
size in sequences), microbatches (see `add_model_arguments` / `add_common_arguments`).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .launch import quiet_segment

KINDS = {"Embedding": "embedding", "ResidualAttentionBlock": "attention", "ResidualFFNBlock": "ffn", "LMHead": "head"}


def model_config(args: Any):
    from lightning_pipe.models import ModelConfig

    return ModelConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.hidden, max_seq_len=args.seq)


def build_model(args: Any) -> nn.Sequential:
    from lightning_pipe.models import build_gpt

    torch.manual_seed(0)
    return build_gpt(model_config(args))


def block_kinds(model: nn.Sequential) -> list[str]:
    return [KINDS.get(type(b).__name__, "block") for b in model]


def make_batch(args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of m micro-batches of random token ids (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, args.vocab, (args.mbs * args.microbatches, args.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def describe(args: Any) -> str:
    """The model in one line, for a benchmark's header."""
    return (
        f"GPT {args.layers} layers ({2 * args.layers + 2} blocks), hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
        f"vocab {args.vocab}, micro-batch {args.mbs}, m = {args.microbatches}"
    )


def add_model_arguments(p: argparse.ArgumentParser, layers: int, vocab: int) -> None:
    """The GPT's size (the defaults that differ between the benchmarks are arguments)."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size (sequences)")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Steps, rounds, profile repeats and the quiet-machine policy (`benchmarks.harness.launch.quiet_segment`)."""
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="timed steps per partition and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=2, help="passes over all partitions (interleaved); steps are pooled")
    p.add_argument("--profile-repeats", type=int, default=10, help="profile_blocks repeats per block (after 2 warm-up)")
    p.add_argument("--retries", type=int, default=2, help="repeats of a segment during which other processes used CPU")
    p.add_argument("--max-foreign", type=float, default=0.15, help="CPUs other processes may use before a segment counts as disturbed")
    p.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait at most for a quiet machine before a segment")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per job before its processes are killed")


def tied_allreduce(model: nn.Sequential, bounds: Any, rank: int) -> Callable[[], None]:
    """The all-reduce of the tied weights' gradients (embedding and LM head) for this rank's stage of
    ``model`` cut at ``bounds``. Every rank makes every group (new_group is collective: same order)."""
    from lightning_pipe.runtime.tied import allreduce_tied, find_tied_parameters

    tied = find_tied_parameters(model, tuple(tuple(b) for b in bounds))
    groups = {t.index: g for t in tied for g in [dist.new_group(list(t.stages))] if rank in t.stages}
    return lambda: allreduce_tied(tied, groups, rank)


def segment(run, rank: int, world: int, args: Any, log) -> tuple[Any, float]:
    """`benchmarks.harness.launch.quiet_segment` with the policy of `add_common_arguments`."""
    return quiet_segment(run, rank, world, retries=args.retries, max_foreign=args.max_foreign, quiet_wait=args.quiet_wait, log=log)


# ---- the profile of every block and the loss (bench_simulator --speedup, bench_advance) ----------------
class LossBlock(nn.Module):
    """The last stage's loss as a block, so the profile times it too: SequentialHost runs the loss
    function after the last block, inside the last stage's forward, and backward starts from it."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.target = target

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, self.target)


def gather_profile(
    blocks: Sequence[nn.Module], sample: Any, target: Any, rank: int, world: int, repeats: int, alone: bool, name: str, mbs: int
):
    """Profile every block, and the loss (folded into the last block's times); concurrently on all
    ranks (``alone=False``) or on rank 0 while the others wait. Every rank returns the same Profile
    (per block the median over the ranks that measured) and the loss's forward / backward seconds."""
    from lightning_pipe.profiling import Profile, profile_blocks

    dist.barrier()
    measured = None
    if not alone or rank == 0:
        measured = profile_blocks(list(blocks) + [LossBlock(target)], sample, torch.device("cpu"), model=name, repeats=repeats, warmup=2)
    parts: list = [None] * world
    dist.all_gather_object(parts, measured)
    parts = [p for p in parts if p is not None]
    n = len(blocks)
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(n + 1)]  # noqa: E731
    forward, backward = field("forward"), field("backward")
    loss = (forward.pop(), backward.pop())
    forward[-1] += loss[0]
    backward[-1] += loss[1]
    profile = Profile(
        name,
        mbs,
        "float32",
        "cpu",
        forward,
        backward,
        field("activation_bytes")[:n],
        field("param_bytes")[:n],
        field("peak_memory")[:n],
        [type(b).__name__ for b in blocks],
    )
    return profile, loss
