"""PipeDream-2BW (Narayanan et al., 2021, §3): 1F1B that never flushes, two weight versions per stage.

Micro-batches flow through one continuous 1F1B order across optimizer steps: rank ``s`` keeps
``p - s - 1`` forwards ahead of its backwards, so the forwards of batch t+1 fill the slots a flush
would leave idle while batch t's last backwards drain. Batch b (all its micro-batches, forward and
backward) runs on weight version max(b - 1, 0), and its gradient is applied to the newest version:
W(t+1) = W(t) - lr * grad f(W(t-1)). A stage therefore holds two versions: the one in-flight
micro-batches of the previous batch still need, and the newest.

`pipedream_2bw(stages, m)` is the whole run of `batches` batches unrolled (the fill, steady steps and
the drain), one REDUCE per batch and chunk, for `validate`, the simulator and the timeline pictures.
The runtime runs it one optimizer step at a time: `step_actions` is one step's slice of the same
order — the forwards of the step's batch, the backwards paired with them (the previous batch's tail
first) and the REDUCE of the previous batch — and `drain_actions` the tail that a drain finishes.
In a slice, micro-batch i of the step's batch is ``i`` and the previous batch's are negative
(``i - m_prev``); a gradient a rank sends at the very end of a step is received in the next one.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .actions import Action, Op, PipelineSchedule
from .advance import advance_bounds, warmups
from .lowering import lower

NAME = "2bw"
SHOWN_BATCHES = 3  # the unrolled schedule: the fill, one steady step, and the drain


def leads(stages: int, microbatches: int, advance_num: int = 0) -> list[int]:
    """Forwards each rank keeps ahead of its backwards: 1F1B's p - s - 1 (advance_num 0), or AvgPipe's
    advance forward propagation (§4.2) run without a flush, as AvgPipe(2BW) does: advance_num on the
    first stage, advance_num - s downstream, 0 on the last (`schedules.advance.warmups`). At most M
    ahead, so a step still completes the batch before it and two weight versions suffice."""
    if not advance_num:
        return [stages - rank - 1 for rank in range(stages)]
    low, high = advance_bounds(stages, microbatches)
    if not low <= advance_num <= high:
        raise ValueError(
            f"advance_num={advance_num} is outside [K - 1, M] = [{low}, {high}] for K={stages} stages and "
            f"M={microbatches} micro-batches ({low}: 2BW's 1F1B order, {high}: all of a batch's forwards first)"
        )
    return warmups(stages, microbatches, advance_num)


def _continuous_1f1b(stages: int, total: int, ahead_of: Sequence[int]) -> list[list[tuple[Op, int, int]]]:
    """1F1B over `total` micro-batches with no flush anywhere: the order every batch lives in."""
    compute = []
    for rank in range(stages):
        ahead = min(ahead_of[rank], total)
        order = [(Op.FORWARD, rank, i) for i in range(ahead)]
        for i in range(total - ahead):
            order += [(Op.FORWARD, rank, ahead + i), (Op.BACKWARD, rank, i)]
        order += [(Op.BACKWARD, rank, i) for i in range(total - ahead, total)]
        compute.append(order)
    return compute


def _step_of(actions: list[Action], batch_of: list[int], drained: int, paired: bool) -> list[int]:
    """The optimizer step each action runs in: a forward in its batch's step; a backward in the step
    of the forward before it (1F1B pairs stay together), or `drained` in the cool-down after the
    last pair (`paired`: the order has pairs at all, i.e. fewer forwards ahead than micro-batches);
    a receive with the compute it feeds, a send with the compute that produced it."""
    steps, current, previous = [0] * len(actions), -1, None
    last_forward = max((i for i, a in enumerate(actions) if a.op is Op.FORWARD), default=-1)
    for i, a in enumerate(actions):
        if a.op is Op.FORWARD:
            current = batch_of[a.microbatch]
        elif a.op is Op.BACKWARD and i > last_forward and (previous is Op.BACKWARD or not paired):
            current = drained  # the cool-down: backwards no forward pairs with
        if a.op.is_compute:
            previous = a.op
        steps[i] = current
    for i in range(len(actions) - 1, -1, -1):  # a receive goes with the compute after it
        if actions[i].op.is_recv:
            steps[i] = steps[i + 1]
    return steps


def _unrolled(stages: int, sizes: Sequence[int], ahead: Sequence[int]) -> tuple[PipelineSchedule, list[list[int]], list[int]]:
    """The lowered continuous order over batches of `sizes` micro-batches (no REDUCE), each
    action's step (len(sizes) = the drain) and each micro-batch's batch. `ahead` is fixed for the
    run (not derived from `sizes`), so consecutive steps' slices agree where they meet."""
    batch_of = [b for b, m in enumerate(sizes) for _ in range(m)]
    total = len(batch_of)
    if min(sizes) < max(ahead):
        raise ValueError(
            f"a batch of {min(sizes)} micro-batches with {max(ahead)} forwards kept ahead: PipeDream-2BW would need a "
            "third weight version; use batches of at least advance_num micro-batches (e.g. drop_last=True) or lower advance_num"
        )
    schedule = lower(NAME, _continuous_1f1b(stages, total, ahead), tuple(range(stages)), total)
    for rank, actions in enumerate(schedule.actions):
        schedule.actions[rank] = [a for a in actions if a.op is not Op.REDUCE_GRAD]
    steps = [_step_of(actions, batch_of, len(sizes), total > ahead[rank]) for rank, actions in enumerate(schedule.actions)]
    return schedule, steps, batch_of


def pipedream_2bw(stages: int, microbatches: int, batches: int = SHOWN_BATCHES, advance_num: int = 0) -> PipelineSchedule:
    """`batches` optimizer steps of 2BW unrolled, micro-batches numbered over the run. Batch b's
    gradients are reduced (REDUCE with the batch's last micro-batch) where the runtime applies
    them: at the end of step b + 1, or at the end of the drain for the last batch."""
    if microbatches < stages:
        raise ValueError(
            f"microbatches={microbatches} is fewer than the {stages} stages: PipeDream-2BW needs m >= stages "
            "(micro-batches per step) to hold no more than two weight versions; raise microbatches or use fewer stages"
        )
    sizes = [microbatches] * batches
    schedule, steps, _ = _unrolled(stages, sizes, leads(stages, microbatches, advance_num))
    ends = [sum(sizes[: b + 1]) - 1 for b in range(batches)]
    for rank, actions in enumerate(schedule.actions):
        out: list[Action] = []
        for i, a in enumerate(actions):
            out.append(a)
            closing = i + 1 == len(actions) or steps[rank][i + 1] != steps[rank][i]
            step = steps[rank][i]
            if closing and 1 <= step < batches:  # the end of step `step`: the batch before it is complete
                out.append(Action(Op.REDUCE_GRAD, rank, ends[step - 1]))
        out.append(Action(Op.REDUCE_GRAD, rank, ends[-1]))  # the drain (which may hold no compute here)
        schedule.actions[rank] = out
    schedule.weight_versions = 2
    return schedule


def _slice(stages: int, sizes: Sequence[int], step: int, reduce: bool, ahead: Sequence[int]) -> list[list[Action]]:
    """Step `step` of the continuous order over `sizes`, micro-batches renumbered relative to the
    start of batch `step` (so the previous batch's are negative)."""
    schedule, steps, _ = _unrolled(stages, sizes, ahead)
    base = sum(sizes[:step])
    lists = []
    for rank, actions in enumerate(schedule.actions):
        mine = [_renumber(a, base) for a, s in zip(actions, steps[rank]) if s == step]
        if reduce:
            mine.append(Action(Op.REDUCE_GRAD, rank, -1))
        lists.append(mine)
    return lists


def _renumber(a: Action, base: int) -> Action:
    return Action(a.op, a.chunk, a.microbatch - base if a.microbatch is not None else None, a.peer)


def step_actions(stages: int, microbatches: int, previous: Optional[int], ahead: Optional[Sequence[int]] = None) -> PipelineSchedule:
    """One optimizer step on a batch of `microbatches`: the fill (`previous` None: nothing in flight)
    or a steady step after a batch of `previous` micro-batches, whose tail it finishes and reduces.
    `ahead`: `leads(...)` of the run (None: 1F1B's)."""
    ahead = ahead or leads(stages, microbatches)
    if previous is None:
        lists = _slice(stages, [microbatches], 0, reduce=False, ahead=ahead)
    else:
        lists = _slice(stages, [previous, microbatches], 1, reduce=True, ahead=ahead)
    return PipelineSchedule(f"{NAME}-step", microbatches, tuple(range(stages)), lists, weight_versions=2)


def drain_actions(stages: int, microbatches: int, ahead: Optional[Sequence[int]] = None) -> PipelineSchedule:
    """The drain after a batch of `microbatches`: its remaining backwards, then its REDUCE."""
    ahead = ahead or leads(stages, microbatches)
    lists = _slice(stages, [microbatches], 1, reduce=True, ahead=ahead)  # the drained batch's are negative
    return PipelineSchedule(f"{NAME}-drain", microbatches, tuple(range(stages)), lists, weight_versions=2)
