"""Hanayo's own wave order (`schedule="hanayo"`), beside our greedy order (`schedule="wave"`).

Both use Hanayo's placement (`wave_placement`: the 2PW chunks run down the P devices and back up,
W times). They differ in the order of work on each device.

Hanayo derives its wave from Chimera (§3.2, Fig. 5): take Chimera's bidirectional pipeline and swap
each device's blocks of one direction with the symmetric device's blocks of the other; "the order
of computation remains unchanged". So the paper's order is Chimera's order read along one wave,
and §3.3 adds waves by cutting the same pipeline into 2PW stages (Fig. 3(e), 6) with the same
structure. In Chimera each direction is a DAPPLE / 1F1B pipeline of D = 2P stages; after the swap
each wave pipeline carries B = P micro-batches (Chimera-wave) through its 2PW virtual stages.
Hence, for B = P:

- virtual stage (chunk) c of n = 2PW runs 1F1B over the unit's micro-batches: min(n - 1 - c, B)
  warm-up forwards, then one forward one backward, then the remaining backwards;
- a device runs its chunks' sequences merged in the order their work becomes ready (T_B = 2 T_F,
  equal chunks; ties: the older micro-batch), which is what the swap of Chimera's time slots gives.

For B > P the paper (like Chimera, §3.5 there) runs basic units of P micro-batches one after the
other: unit k holds micro-batches kP .. kP + P - 1 (the last one may be shorter); each chunk runs the
units' 1F1B sequences back to back, and a device fills the end of one unit with the next unit's
forwards of its other chunks when they are ready (Chimera's "direct concatenation").

Checked against the paper by hand (tests/test_hanayo_paper.py: the per-rank orders of Fig. 3(d),
P = 4, W = 1 and Fig. 3(e), W = 2, B = 4; tests/test_multichunk.py::test_wave_p2_b2_by_hand: Fig. 5's
Chimera swapped into waves). Eq. (1)'s bubble ratio is an approximation of such orders: at W = 1
each device idles exactly its numerator's (P - 1) T_B / W; the test compares the rest.

What this gives (tests/test_multichunk.py, docs/results/schedules.md): each chunk stashes at most
min(n - c, P) micro-batches, so a device holds at most P stage-sized activations, as 1F1B's first
device does (Hanayo's memory claim, which the greedy order does not keep); the bubble for B = P is
below 1F1B's; for B > P the units' seams cost time (see the table).
"""

from __future__ import annotations

from .actions import Op, PipelineSchedule
from .lowering import lower
from .wave import wave_placement


def chunk_sequences(chunks: int, stages: int, microbatches: int) -> list[list[tuple[Op, int, int]]]:
    """Per chunk: Chimera's 1F1B order of each unit of `stages` micro-batches, units back to back."""
    out: list[list[tuple[Op, int, int]]] = []
    for c in range(chunks):
        seq: list[tuple[Op, int, int]] = []
        for first in range(0, microbatches, stages):
            unit = list(range(first, min(first + stages, microbatches)))
            warmup = min(chunks - 1 - c, len(unit))
            seq += [(Op.FORWARD, c, i) for i in unit[:warmup]]
            for k in range(len(unit) - warmup):
                seq.append((Op.FORWARD, c, unit[warmup + k]))
                seq.append((Op.BACKWARD, c, unit[k]))
            seq += [(Op.BACKWARD, c, i) for i in unit[len(unit) - warmup :]]
        out.append(seq)
    return out


def merge_by_readiness(
    chunk_rank: tuple[int, ...],
    ranks: int,
    sequences: list[list[tuple[Op, int, int]]],
    unit: int,
    fill: bool = True,
    f: float = 1.0,
    b: float = 2.0,
) -> list[list[tuple[Op, int, int]]]:
    """Each rank's order: its chunks' sequences interleaved in the order their next work becomes ready
    (an event simulation with unit costs f, b per chunk; ties: older micro-batch, then the lower rank).
    A rank that would wait for all its chunks' next work runs, in the meantime, a ready forward of
    the next unit (micro-batches of `unit` at a time) that can start before that work is ready:
    Chimera's direct concatenation, the next unit's forwards in the bubbles at the end of a unit.
    `fill=False` runs the units strictly one after the other (for comparison only: bench_waves.py)."""
    last = len(chunk_rank) - 1
    done: set[tuple[Op, int, int]] = set()
    head = [0] * len(sequences)
    finish: dict[tuple[Op, int, int], float] = {}
    clock = [0.0] * ranks
    order: list[list[tuple[Op, int, int]]] = [[] for _ in range(ranks)]
    mine = [[c for c in range(len(chunk_rank)) if chunk_rank[c] == r] for r in range(ranks)]
    remaining = sum(len(s) for s in sequences)

    def ready(op: Op, c: int, mb: int):
        if op is Op.FORWARD:
            return 0.0 if c == 0 else finish.get((Op.FORWARD, c - 1, mb))
        return finish.get((Op.FORWARD, c, mb)) if c == last else finish.get((Op.BACKWARD, c + 1, mb))

    def next_of(c: int) -> int:
        while head[c] < len(sequences[c]) and sequences[c][head[c]] in done:
            head[c] += 1
        return head[c]

    while remaining:
        best = None
        for r in range(ranks):
            heads, waiting = [], []
            for c in mine[r]:
                i = next_of(c)
                if i == len(sequences[c]):
                    continue
                op, _, mb = sequences[c][i]
                t = ready(op, c, mb)
                if t is not None:
                    heads.append((max(t, clock[r]), mb, c, (op, c, mb)))
                else:
                    waiting.append(c)
            fills = []
            for c in mine[r] if fill else ():  # the next unit's first undone forward on each chunk
                if head[c] == len(sequences[c]):
                    continue
                nxt = sequences[c][head[c]][2] // unit + 1
                for op, _, mb in sequences[c][head[c] :]:
                    if op is Op.FORWARD and mb // unit == nxt and (op, c, mb) not in done:
                        t = ready(op, c, mb)
                        if t is not None:
                            fills.append((max(t, clock[r]), mb, c, (op, c, mb)))
                        break
            first = min(heads) if heads else None
            early = min(fills) if fills else None
            if early is not None and (first is None or (early[0] < first[0] and first[0] > clock[r])):
                pick = early
            else:
                pick = first
            if pick is not None and (best is None or (pick[0], pick[1], r) < (best[0], best[1], best[2])):
                best = (pick[0], pick[1], r, pick[3])
        if best is None:
            raise ValueError("the chunk sequences deadlock")  # cannot happen for 1F1B units
        start, _, r, work = best
        op, c, mb = work
        done.add(work)
        clock[r] = start + (b if op is Op.BACKWARD else f)
        finish[work] = clock[r]
        order[r].append(work)
        remaining -= 1
    return order


def hanayo_order(stages: int, microbatches: int, waves: int = 1, fill: bool = True) -> list[list[tuple[Op, int, int]]]:
    placement = wave_placement(stages, waves)
    return merge_by_readiness(placement, stages, chunk_sequences(len(placement), stages, microbatches), stages, fill)


def hanayo(stages: int, microbatches: int, waves: int = 1) -> PipelineSchedule:
    """Hanayo's wave with the paper's order (Chimera's per-stage 1F1B in units of P micro-batches)."""
    if waves < 1:
        raise ValueError(f"waves={waves}: the number of waves must be >= 1")
    placement = wave_placement(stages, waves)
    return lower(f"hanayo-w{waves}", hanayo_order(stages, microbatches, waves), placement, microbatches)
