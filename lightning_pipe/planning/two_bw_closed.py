"""PipeDream-2BW's closed-form cost functions (§4.2), as the paper writes them: the baseline our
simulated THROUGHPUT / MEMORY (planning/two_bw.py) are measured against.

Per stage i of d (B/d blocks each, the paper's even split), per-device micro-batch size b:

    T_comp_i(b)      forward + backward of the stage's blocks (x c_extra with recomputation: the
                     measured recompute cost when the profile has it, the paper's 4/3 otherwise)
    T_{j->i}(b)      2 |A_inp+out(b)| 1(d > 1) / bw_depth(d)   activations and gradients across stages
    T_i^comm(b)      ring all-reduce of the stage's weight gradients over w replicas, 2 (w-1)/w |W_i| /
                     bw_width(w); amortised over the g micro-batches of a step (our reading of §5.4.1:
                     "throughput increases with gradient accumulation due to less communication")
    t = max_i max(T_comp_i, sum_j T_{j->i}, T_i^comm)         (pipelined: one micro-batch every t)
    t = sum_i max(T_comp_i + sum_j T_{j->i}, T_i^comm)        (without pipelining: g = 1, one micro-batch
                                                               passes the stages one after the other)
    THROUGHPUT = w b / t samples/s

MEMORY (§4.2.2, §3.1): 2|W|/d + |A_total(b)| without recomputation (d stashed versions of a stage's
|A_total(b)|/d), 2|W|/d + |A_total(b)|/d with it; one weight version for 1F1B, and GPipe's
(|W| + m |A_inp(b)| + (|A(b)| - |A_inp(b)|)) / d form, as §3.1 states it. No optimizer state: the
paper's formula has none.
"""

from __future__ import annotations

from .partition import partition_blocks
from .sized import BlockCosts

C_EXTRA = 4.0 / 3.0  # the paper's constant for recomputation's extra forward


def even_bounds(blocks: int, depth: int) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(b) for b in partition_blocks("uniform", blocks, depth).bounds)


def closed_step(costs: BlockCosts, depth: int, width: int, g: int, recompute: bool, hw: object, pipelined: bool = True) -> float:
    """t: seconds per micro-batch, the paper's pipelined expression (the steady state) or, with
    `pipelined=False`, its expression without pipelining (stages add up, communication after compute)."""
    bounds = even_bounds(len(costs.forward), depth)
    link = hw.pipeline_bandwidth(depth, width)
    replica = hw.replica_bandwidth(width)
    worst = total = 0.0
    for i, (a, b) in enumerate(bounds):
        compute = sum(costs.forward[a:b]) + sum(costs.backward[a:b])
        if recompute:
            measured = sum(costs.forward[a:b]) + sum(costs.recompute_backward[a:b])
            compute = measured if measured > compute else C_EXTRA * compute
        incoming = []
        if i > 0:  # activations in, gradients back
            incoming.append(2 * (costs.output_bytes[a - 1]) / link)
        if i < depth - 1:
            incoming.append(2 * costs.output_bytes[b - 1] / link)
        comm = sum(incoming) if depth > 1 else 0.0
        params = sum(costs.param_bytes[a:b])
        allreduce = 2 * (width - 1) / width * params / replica / g if width > 1 else 0.0
        worst = max(worst, compute, comm, allreduce)
        total += max(compute + comm, allreduce)
    return worst if pipelined else total


def closed_memory(costs: BlockCosts, depth: int, schedule: str, m: int, recompute: bool) -> float:
    """The paper's per-device footprint (§4.2.2 / §3.1)."""
    weights = sum(costs.param_bytes)
    acts = sum(costs.saved_bytes)
    inputs = sum(costs.input_bytes)
    versions = 2 if schedule == "2bw" else 1
    if schedule == "gpipe":
        held = m * (inputs if recompute else acts)
        return (weights + held + ((acts - inputs) if recompute else 0.0)) / depth
    if recompute:
        return versions * weights / depth + acts / depth
    return versions * weights / depth + acts


def closed_throughput(costs: BlockCosts, depth: int, width: int, b: int, g: int, recompute: bool, hw: object) -> float:
    return width * b / closed_step(costs, depth, width, g, recompute, hw)
