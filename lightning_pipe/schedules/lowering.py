"""Lower compute-only orders into full action lists with communication.

A schedule generator only decides the order of forwards and backwards on each rank. This pass
adds the rest: a receive right before the compute that consumes remote data, a send right after
the compute that produces it, and a gradient reduction after a chunk's last backward. Placing a
rank's send and the following receive next to each other lets the runtime batch them into one
`batch_isend_irecv` group, which is what keeps NCCL's in-order p2p streams from deadlocking when
two neighbours exchange at once (1F1B's steady state). Receives are moved earlier at run time
(prefetch), not here, so the simulated and executed lists stay the same.
"""

from __future__ import annotations

from .actions import Action, Op, PipelineSchedule


def lower(
    name: str,
    compute: list[list[tuple[Op, int, int]]],
    chunk_rank: tuple[int, ...],
    num_microbatches: int,
    backward: bool = True,
) -> PipelineSchedule:
    """``compute[rank]`` is an ordered list of ``(op, chunk, microbatch)``, op one of F, B, or a split
    backward's BI and W (the reduction follows a chunk's last B or W)."""
    last = len(chunk_rank) - 1
    lists: list[list[Action]] = []
    for rank, order in enumerate(compute):
        out: list[Action] = []
        last_backward = {c: i for i, (op, c, _) in enumerate(order) if op.gives_weight_grad}
        for index, (op, chunk, mb) in enumerate(order):
            if op is Op.FORWARD:
                if chunk > 0 and chunk_rank[chunk - 1] != rank:
                    out.append(Action(Op.RECV_ACT, chunk, mb, chunk_rank[chunk - 1]))
                out.append(Action(Op.FORWARD, chunk, mb))
                if chunk < last and chunk_rank[chunk + 1] != rank:
                    out.append(Action(Op.SEND_ACT, chunk, mb, chunk_rank[chunk + 1]))
            elif op.is_compute:
                if op.gives_input_grad and chunk < last and chunk_rank[chunk + 1] != rank:
                    out.append(Action(Op.RECV_GRAD, chunk, mb, chunk_rank[chunk + 1]))
                out.append(Action(op, chunk, mb))
                if op.gives_input_grad and chunk > 0 and chunk_rank[chunk - 1] != rank:
                    out.append(Action(Op.SEND_GRAD, chunk, mb, chunk_rank[chunk - 1]))
                if last_backward[chunk] == index:
                    out.append(Action(Op.REDUCE_GRAD, chunk))
            else:
                raise ValueError(f"compute order of rank {rank} holds {op}; only F, B, BI and W are compute ops")
        lists.append(out)
    return PipelineSchedule(name, num_microbatches, tuple(chunk_rank), _receives_in_send_order(lists), backward)


def _message(rank: int, a: Action) -> tuple:
    """(source, destination, (kind, producing chunk, micro-batch)) of a send or a receive."""
    if a.op is Op.SEND_ACT:
        return rank, a.peer, ("act", a.chunk, a.microbatch)
    if a.op is Op.SEND_GRAD:
        return rank, a.peer, ("grad", a.chunk, a.microbatch)
    if a.op is Op.RECV_ACT:
        return a.peer, rank, ("act", a.chunk - 1, a.microbatch)
    return a.peer, rank, ("grad", a.chunk + 1, a.microbatch)


def _receive(src: int, msg: tuple) -> Action:
    kind, chunk, mb = msg
    return Action(Op.RECV_ACT, chunk + 1, mb, src) if kind == "act" else Action(Op.RECV_GRAD, chunk - 1, mb, src)


def _receives_in_send_order(lists: list[list[Action]]) -> list[list[Action]]:
    """Messages between two ranks are matched in order (NCCL has no tags), so a rank must post its
    receives from a peer in the order the peer sends. Where a rank needs a later message first
    (multi-chunk schedules), the earlier ones are posted just before it: posting never blocks, and
    the posted buffers wait until their computes take them."""
    sends: dict[tuple[int, int], list[tuple]] = {}
    for rank, actions in enumerate(lists):
        for a in actions:
            if a.op.is_send:
                src, dst, msg = _message(rank, a)
                sends.setdefault((src, dst), []).append(msg)
    position = {pair: {msg: i for i, msg in reversed(list(enumerate(order)))} for pair, order in sends.items()}  # first send of each
    out = []
    for rank, actions in enumerate(lists):
        posted: dict[tuple[int, int], int] = {}
        rewritten: list[Action] = []
        for a in actions:
            if not a.op.is_recv:
                rewritten.append(a)
                continue
            src, dst, msg = _message(rank, a)
            order = sends.get((src, dst), [])
            index = position.get((src, dst), {}).get(msg)
            if index is None:  # no such send: leave it for the validator to name
                rewritten.append(a)
                continue
            upto = index + 1
            for earlier in order[posted.get((src, dst), 0) : upto]:
                rewritten.append(_receive(src, earlier))
            posted[(src, dst)] = max(posted.get((src, dst), 0), upto)
        out.append(rewritten)
    return out
