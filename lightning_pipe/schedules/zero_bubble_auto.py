"""The zero-bubble paper's automatic scheduling heuristic (Qi et al., ICLR 2024, §3.1): the orders.

Given each stage's F, BI and W times, the message time and a memory limit (micro-batches whose
activations a stage may hold: an F takes one, its W gives it back, as our executor keeps a graph
until W), the heuristic builds each stage's order on a simulated clock, as the paper lays it out:

1. warm-up: as many F's as the memory limit allows before the first B; an F that would delay the
   first B is scheduled or not by the first binary hyperparameter (`fill_warmup`);
2. steady state: one F and one B in turn; a W fills a gap at least T_W long, or a shorter one when
   that gap would make this stage's accumulated idle time the largest of all stages; a W is also
   scheduled when the memory limit stops the next F;
3. stage i keeps at least one F ahead of stage i + 1 (the data dependency does this); when it is
   more than one ahead, the second binary hyperparameter (`skip_forward`) lets it take an available
   B instead of the F, if that leaves no gap;
4. when the F's run out: the B's as their gradients come, W's in the gaps, then the W's left.

The paper then tries every combination of the binary hyperparameters and keeps the best.
`planning/zero_bubble.py` does that on a run's measured times, scored by our simulator (what
`schedule="zb-auto"` runs); `zb_auto` here is the same heuristic on the paper's equal times
(T_F = T_B = T_W, no message time) held to 1F1B's memory (p micro-batches), scored by the
heuristic's own clock: the form a schedule name builds without a profile.

Ours, not the paper's: where the paper is silent on a stage whose turn's op (F or B) has not
arrived and no W fills the wait, the other op runs if it is there (`decide`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import product
from typing import Optional, Sequence

from .actions import Op, PipelineSchedule
from .lowering import lower

F, B, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


@dataclass
class _Stage:
    forwards: int = 0
    backwards: int = 0
    clock: float = 0.0
    idle: float = 0.0
    held: int = 0  # micro-batches whose activations are held (F done, W not yet)
    last: Optional[Op] = None


def heuristic_orders(
    f: Sequence[float], b: Sequence[float], w: Sequence[float], comm: float, m: int, limit: int, fill_warmup: bool, skip_forward: bool
) -> list[list[tuple[Op, int, int]]]:
    """Each stage's compute order by the paper's heuristic (times per stage; `limit` >= 1)."""
    return _heuristic(f, b, w, comm, m, limit, fill_warmup, skip_forward)[0]


def _heuristic(
    f: Sequence[float], b: Sequence[float], w: Sequence[float], comm: float, m: int, limit: int, fill_warmup: bool, skip_forward: bool
) -> tuple[list[list[tuple[Op, int, int]]], float]:
    """The orders and the heuristic's own clock at the end (its makespan on these times)."""
    p = len(f)
    stages = [_Stage() for _ in range(p)]
    pending: list[deque[int]] = [deque() for _ in range(p)]
    end: dict[tuple[Op, int, int], float] = {}
    orders: list[list[tuple[Op, int, int]]] = [[] for _ in range(p)]

    def ready(op: Op, i: int, k: int) -> Optional[float]:
        """When F / B of micro-batch k can start on stage i; None while its producer has not run."""
        if op is F:
            return 0.0 if i == 0 else (None if (F, i - 1, k) not in end else end[(F, i - 1, k)] + comm)
        if i == p - 1:
            return end.get((F, i, k))
        return None if (B, i + 1, k) not in end else end[(B, i + 1, k)] + comm

    def earliest(op: Op, i: int, k: int) -> float:
        """A lower bound of `ready` while it is unknown: the producer's stage is busy until its clock."""
        known = ready(op, i, k)
        if known is not None:
            return known
        j = i - 1 if op is F else i + 1
        return stages[j].clock + (f[j] if op is F else b[j]) + comm

    def decide(i: int) -> Optional[tuple[Op, int, float]]:
        s = stages[i]
        can_f = s.forwards < m and s.held < limit
        can_b = s.backwards < s.forwards
        if s.backwards == 0 and s.forwards < m:  # warm-up: forwards until the first B
            first_b = earliest(B, i, 0) if s.forwards else math.inf  # B(0) needs F(0) first
            prefer = F if can_f and (fill_warmup or s.clock + f[i] <= first_b) else B
        elif s.forwards >= m:
            prefer = B
        else:
            prefer = B if s.last is F else F
            if prefer is F and skip_forward and can_b and i < p - 1 and s.forwards - stages[i + 1].forwards > 1:
                t = ready(B, i, s.backwards)
                if t is not None and t <= s.clock:
                    prefer = B  # far enough ahead: a B now leaves no gap
        if prefer is F and not can_f:  # forwards used up, or the memory limit: a W gives memory back
            prefer = W if pending[i] and s.forwards < m else B if can_b else W
        if prefer is B and not can_b:
            prefer = F if can_f else W
        if prefer is W:
            return (W, pending[i][0], s.clock) if pending[i] else None
        k = s.forwards if prefer is F else s.backwards
        t = ready(prefer, i, k)
        gap = (t if t is not None else earliest(prefer, i, k)) - s.clock
        if pending[i] and gap > 0:
            worst = max(other.idle for other in stages)
            if gap >= w[i] or (t is not None and s.idle + gap > worst):
                return W, pending[i][0], s.clock  # fill the bubble with a W
        other = F if prefer is B else B
        if (t is None or t > s.clock) and (can_f if other is F else can_b):
            # our reading where the paper is silent: the turn's op is not there yet and no W fills the
            # wait, but the other op is: it runs (the F / B alternation resumes after it)
            k2 = s.forwards if other is F else s.backwards
            t2 = ready(other, i, k2)
            if t2 is not None and (t2 <= s.clock or t is None):
                # ... also when it is not there yet but its time is known while the turn's op waits on a
                # producer that may wait on this stage (else two stages can wait on each other forever)
                return other, k2, max(t2, s.clock)
        if t is None:
            return None  # wait until the producer runs
        return prefer, k, max(t, s.clock)

    remaining = 3 * m * p
    while remaining:
        choices = [(c[2], i, c) for i in range(p) if (c := decide(i)) is not None]
        if not choices:
            raise RuntimeError("the zero-bubble heuristic stalled (a bug: every stage waits)")
        start, i, (op, k, _) = min(choices, key=lambda x: (x[0], x[1]))
        s = stages[i]
        duration = {F: f[i], B: b[i], W: w[i]}[op]
        s.idle += start - s.clock
        s.clock = end[(op, i, k)] = start + duration
        orders[i].append((op, i, k))
        if op is F:
            s.forwards += 1
            s.held += 1
        elif op is B:
            s.backwards += 1
            pending[i].append(k)
        else:
            pending[i].popleft()
            s.held -= 1
        s.last = op if op is not W else s.last
        remaining -= 1
    return orders, max(s.clock for s in stages)


def zb_auto(stages: int, microbatches: int) -> PipelineSchedule:
    """The heuristic on equal times within 1F1B's memory: the fastest of its four hyperparameter
    combinations by its own clock (the first on a tie)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"zb-auto needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
    ones = [1.0] * stages
    runs = [_heuristic(ones, ones, ones, 0.0, microbatches, stages, fill, skip) for fill, skip in product((True, False), repeat=2)]
    orders = min(runs, key=lambda run: run[1])[0]
    return lower("zb-auto", orders, tuple(range(stages)), microbatches)
