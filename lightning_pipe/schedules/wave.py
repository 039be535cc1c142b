"""Wave-like pipelines (Hanayo, Liu et al., SC'23): 2W model chunks per device, no model replicas.

`schedule="wave"` is Hanayo's placement with OUR greedy order (below); `schedule="hanayo"`
(`wave_hanayo.py`) is the same placement with the paper's own order. docs/results/schedules.md compares
both with 1F1B (benchmarks/bench_waves.py --simulated).

The stages run down the P devices and back up, W times: chunk c sits on device c % P on the way
down (even segments c // P) and on device P - 1 - c % P on the way up, so at each turn two
adjacent chunks share a device and hand over locally, without communication. Chimera-wave is
W = 1 with B = P micro-batches (Hanayo §3.2: Chimera's two pipelines folded into one wave).

The order of work on each device (ours, not the paper's) comes from a greedy list schedule over this placement with
T_B = 2 T_F: a device runs a ready backward first (oldest micro-batch first, which frees its
activations), else the ready forward of the oldest micro-batch, deepest chunk first. The result is
a valid, deadlock-free order that the validator checks like any other. Against Hanayo's order
(docs/results/schedules.md, P = 2, 4, 8, W = 1, 2, 4, B = P, 2P, 4P): the same time at B = P; of the 18
cases with B > P ours is faster in 5 (B = 4P, P >= 4), slower in 9, equal in 4; it holds up to
1.875x 1F1B's peak activations (Hanayo's order: 1F1B's at B = P, at most 1.44x for B > P).
"""

from __future__ import annotations

from .actions import Op, PipelineSchedule
from .lowering import lower


def wave_placement(stages: int, waves: int) -> tuple[int, ...]:
    p = stages
    return tuple(c % p if (c // p) % 2 == 0 else p - 1 - c % p for c in range(2 * p * waves))


def greedy_order(
    chunk_rank: tuple[int, ...], ranks: int, microbatches: int, f: float = 1.0, b: float = 2.0
) -> list[list[tuple[Op, int, int]]]:
    """Compute order per rank from an event simulation of ready work (unit communication-free costs)."""
    last = len(chunk_rank) - 1
    ready_at: dict[tuple[Op, int, int], float] = {(Op.FORWARD, 0, i): 0.0 for i in range(microbatches)}
    done: set = set()
    clock = [0.0] * ranks
    order: list[list[tuple[Op, int, int]]] = [[] for _ in range(ranks)]
    remaining = 2 * len(chunk_rank) * microbatches
    while remaining:
        # the rank that can start something earliest goes next (ties: the lower rank), so events are
        # decided in time order and nothing that becomes ready earlier can be overlooked
        best = None
        for r in range(ranks):
            mine = [(t, op, c, mb) for (op, c, mb), t in ready_at.items() if chunk_rank[c] == r]
            if not mine:
                continue
            start = max(clock[r], min(x[0] for x in mine))
            t, op, c, mb = min((x for x in mine if x[0] <= start), key=lambda x: (x[1] is not Op.BACKWARD, x[3], -x[2]))
            if best is None or (start, r) < (best[0], best[1]):
                best = (start, r, op, c, mb)
        start, r, op, c, mb = best
        del ready_at[(op, c, mb)]
        clock[r] = start + (b if op is Op.BACKWARD else f)
        order[r].append((op, c, mb))
        done.add((op, c, mb))
        remaining -= 1
        if op is Op.FORWARD:
            if c < last:
                ready_at[(Op.FORWARD, c + 1, mb)] = clock[r]
            else:
                ready_at[(Op.BACKWARD, c, mb)] = clock[r]
        elif c > 0:
            ready_at[(Op.BACKWARD, c - 1, mb)] = clock[r]
    return order


def wave(stages: int, microbatches: int, waves: int = 1) -> PipelineSchedule:
    if waves < 1:
        raise ValueError(f"waves={waves}: the number of waves must be >= 1")
    placement = wave_placement(stages, waves)
    compute = greedy_order(placement, stages, microbatches)
    return lower(f"wave-w{waves}", compute, placement, microbatches)


def wave_chunks(stages: int, waves: int = 1) -> int:
    return 2 * stages * waves


def wave_misfit(stages: int, num_blocks: int, waves: int = 1, name: str = "wave") -> str:
    """Why W waves do not fit a model of `num_blocks` blocks, and what fits."""
    most = num_blocks // (2 * stages)
    hint = f"waves <= {most}" if most else f"at most {num_blocks // 2} ranks or another schedule"
    return (
        f"schedule={name!r} with waves={waves} on {stages} ranks cuts the model into 2 x {stages} x "
        f"{waves} = {2 * stages * waves} chunks, more than its {num_blocks} blocks: use {hint}"
    )
