"""compile=True: torch.compile on each pipeline block, once, in place (`nn.Module.compile`), as torchtitan
compiles per transformer block. Done before the profile, so the planners plan on compiled costs; the
blocks stay compiled wherever the cut puts them (the state dict's names do not change). A micro-batch of
another size (an uneven last batch) is left to Dynamo's automatic dynamic shapes (it recompiles with
that dimension dynamic rather than once per size; not measured here). What Dynamo could not capture is said in one line at the end of fit (`graph_breaks`).
compile='auto' (autoplan.py) profiles the blocks eager and compiled and keeps the faster plan."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Optional

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

COMPILED = "_lightning_pipe_compiled"


def compile_blocks(pipeline: nn.Module, split: bool = False) -> int:
    """Compile every block of `pipeline` not compiled yet (a second fit finds them compiled); how many now.
    `split` (tensor > 1): the blocks hold DTensor shards, and inductor's on-disk caches (FX graph, AOTAutograd)
    handed them another run's wrong artifact (a warm cache trained wrong; a cold one was exact), so this
    process compiles them afresh each run. The profiler measures their split backward with the graph
    retained, which AOTAutograd's donated buffers refuse: those are off too."""
    if split:
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        torch._functorch.config.donated_buffer = False
    count = 0
    for block in pipeline:
        if not getattr(block, COMPILED, False):
            block.compile()
            setattr(block, COMPILED, True)
            count += 1
    return count


def copied(block: nn.Module) -> nn.Module:
    """A deep copy of `block`, compiled again where `block` was: `copy.deepcopy` drops the compiled call
    `nn.Module.compile` set (the copy would run eager while marked compiled)."""
    twin = copy.deepcopy(block)
    if getattr(block, COMPILED, False):
        twin.compile()
    return twin


def uncompile_blocks(pipeline: nn.Module) -> None:
    """Back to eager (compile='auto' found the eager step faster): `nn.Module.compile` only set the
    module's compiled call, so clearing it restores the plain one (Dynamo's cache is left as it is)."""
    for block in pipeline:
        if getattr(block, COMPILED, False):
            block._compiled_call_impl = None
            delattr(block, COMPILED)


def graph_breaks() -> Optional[str]:
    """One line on Dynamo's graph breaks in this process (None: none): how many, the commonest reasons."""
    from torch._dynamo.utils import counters

    breaks = Counter(counters["graph_break"])
    if not breaks:
        return None
    reasons = "; ".join(f"{reason[:80]} ({n}x)" for reason, n in breaks.most_common(3))
    return f"compile=True: {sum(breaks.values())} graph break(s) in the blocks, each a Python fallback: {reasons}"


def report_graph_breaks() -> None:
    """At the end of fit, on every rank (a collective): each distinct line once, with the ranks it holds for."""
    mine = graph_breaks()
    lines = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(lines, mine)
    seen: dict[str, list[int]] = {}
    for r, line in enumerate(lines):
        if line is not None:
            seen.setdefault(line, []).append(r)
    for line, ranks in seen.items():
        rank_zero_info(f"{line} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})")
