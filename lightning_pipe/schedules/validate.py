"""Check a schedule before anything runs, so a bad schedule is a message, never a hang.

The check replays the action lists symbolically with the runtime's semantics: sends never block
(isend), a receive blocks until the matching send has been issued, and messages between two
ranks arrive in the order they were sent (one ordered channel per direction, as gloo and NCCL
deliver them). It reports the first rank and action at fault: a compute whose input no earlier
action provides, a send without its receive or the reverse, receives posted in another order
than the sends, a micro-batch never forwarded or backwarded, or ranks waiting on each other.
A split backward (BI then W, zero-bubble) must run both halves, W after BI on the chunk's rank,
and the gradient reduction after every W.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from .actions import Action, Op, PipelineSchedule


class ScheduleError(ValueError):
    pass


def _message(rank: int, action: Action) -> tuple[int, int, tuple[str, int, int]]:
    """(source rank, destination rank, message id) of a send or receive."""
    c, mb, peer = action.chunk, action.microbatch, action.peer
    if action.op is Op.SEND_ACT:
        return rank, peer, ("activation", c, mb)
    if action.op is Op.RECV_ACT:
        return peer, rank, ("activation", c - 1, mb)
    if action.op is Op.SEND_GRAD:
        return rank, peer, ("gradient", c, mb)
    return peer, rank, ("gradient", c + 1, mb)  # RECV_GRAD


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank}, action {index} {action}"


def _check_static(s: PipelineSchedule) -> None:
    last = s.num_chunks - 1
    for rank, actions in enumerate(s.actions):
        for index, a in enumerate(actions):
            if not 0 <= a.chunk <= last:
                raise ScheduleError(f"{_where(rank, index, a)}: chunk out of range 0..{last}")
            if a.op is not Op.REDUCE_GRAD and not 0 <= (a.microbatch if a.microbatch is not None else -1) < s.num_microbatches:
                raise ScheduleError(f"{_where(rank, index, a)}: micro-batch out of range 0..{s.num_microbatches - 1}")
            if (a.op.is_compute or a.op is Op.REDUCE_GRAD) and s.chunk_rank[a.chunk] != rank:
                raise ScheduleError(f"{_where(rank, index, a)}: chunk {a.chunk} is held by rank {s.chunk_rank[a.chunk]}")
            if a.op.is_compute and a.op is not Op.FORWARD and not s.backward:
                raise ScheduleError(f"{_where(rank, index, a)}: backward in a forward-only schedule")
            if a.op.is_send or a.op.is_recv:
                if s.chunk_rank[a.chunk] != rank:
                    raise ScheduleError(f"{_where(rank, index, a)}: chunk {a.chunk} is held by rank {s.chunk_rank[a.chunk]}")
                neighbour = a.chunk + 1 if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else a.chunk - 1
                if not 0 <= neighbour <= last or s.chunk_rank[neighbour] != a.peer or a.peer == rank:
                    raise ScheduleError(f"{_where(rank, index, a)}: the peer must be the rank holding chunk {neighbour}")
    computes = Counter((a.op, a.chunk, a.microbatch) for acts in s.actions for a in acts if a.op.is_compute)
    for c in range(s.num_chunks):
        for mb in range(s.num_microbatches):
            # a backward is whole (B) or split in its two halves (BI and W), each exactly once
            bi, w = computes[(Op.BACKWARD_INPUT, c, mb)], computes[(Op.BACKWARD_WEIGHT, c, mb)]
            counts = [(computes[(Op.FORWARD, c, mb)], "forwarded")]
            if s.backward:
                counts.append((computes[(Op.BACKWARD, c, mb)] + max(bi, w), "backwarded"))
            for n, what in counts:
                if n != 1:
                    how = "never" if n == 0 else f"{n} times"
                    raise ScheduleError(f"rank {s.chunk_rank[c]}: micro-batch {mb} is {how} {what} on chunk {c}")
            if bi != w:
                raise ScheduleError(
                    f"rank {s.chunk_rank[c]}: micro-batch {mb} on chunk {c} has {bi} input-gradient (BI) and"
                    f" {w} weight-gradient (W) actions: a split backward needs one of each"
                )
    sends = Counter(_message(r, a) for r, acts in enumerate(s.actions) for a in acts if a.op.is_send)
    recvs = Counter(_message(r, a) for r, acts in enumerate(s.actions) for a in acts if a.op.is_recv)
    for rank, actions in enumerate(s.actions):
        for index, a in enumerate(actions):
            if a.op.is_send and recvs[_message(rank, a)] != 1:
                raise ScheduleError(f"{_where(rank, index, a)}: no matching receive on rank {a.peer}")
            if a.op.is_recv and sends[_message(rank, a)] != 1:
                raise ScheduleError(f"{_where(rank, index, a)}: no matching send on rank {a.peer}")
            if (a.op.is_send or a.op.is_recv) and (sends[_message(rank, a)] > 1 or recvs[_message(rank, a)] > 1):
                raise ScheduleError(f"{_where(rank, index, a)}: message sent or received more than once")


def _needs(s: PipelineSchedule, rank: int, a: Action) -> tuple[Optional[tuple], Optional[tuple]]:
    """(local compute, remote message) a compute's input comes from; None where not applicable."""
    c, mb, last = a.chunk, a.microbatch, s.num_chunks - 1
    if a.op is Op.FORWARD:
        if c == 0:
            return None, None
        if s.chunk_rank[c - 1] == rank:
            return (Op.FORWARD, c - 1, mb), None
        return None, ("activation", c - 1, mb)
    if a.op is Op.BACKWARD_WEIGHT:  # needs its own BI only (checked by the caller)
        return None, None
    if c == last:
        return None, None
    if s.chunk_rank[c + 1] == rank:
        return ("input gradient", c + 1, mb), None
    return None, ("gradient", c + 1, mb)


def validate(s: PipelineSchedule) -> None:
    """Raise `ScheduleError` naming the rank and action at fault; return None for a sound schedule.

    Semantics replayed: a send is issued and never blocks; a receive is *posted* (never blocks) and
    matches the next message on its channel in send order; a compute waits until its remote input
    has been sent, and needs a receive posted for it before it (or the producing compute on this rank)."""
    if s.num_microbatches < 1:
        raise ScheduleError(f"microbatches={s.num_microbatches}: must be >= 1")
    if set(s.chunk_rank) != set(range(s.num_ranks)):
        raise ScheduleError(f"chunk placement {s.chunk_rank} leaves some of the {s.num_ranks} ranks without a chunk")
    _check_static(s)
    send_order: dict[tuple[int, int], list] = {}
    for rank, actions in enumerate(s.actions):
        for a in actions:
            if a.op.is_send:
                src, dst, msg = _message(rank, a)
                send_order.setdefault((src, dst), []).append(msg)
    posted_count: dict[tuple[int, int], int] = {}
    sent: set = set()
    pointer = [0] * s.num_ranks
    done: list[set] = [set() for _ in range(s.num_ranks)]
    posted: list[set] = [set() for _ in range(s.num_ranks)]
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(s.actions):
            while pointer[rank] < len(actions):
                index, a = pointer[rank], actions[pointer[rank]]
                if a.op.is_send:
                    sent.add(_message(rank, a)[2])
                elif a.op.is_recv:
                    src, dst, msg = _message(rank, a)
                    k = posted_count.get((src, dst), 0)
                    expected = send_order.get((src, dst), [])[k]
                    if expected != msg:
                        raise ScheduleError(
                            f"{_where(rank, index, a)}: rank {src} sends {expected[0]} of chunk {expected[1]}"
                            f" mb {expected[2]} first; receives must be posted in the order of the sends"
                        )
                    posted_count[(src, dst)] = k + 1
                    posted[rank].add(msg)
                elif a.op.is_compute:
                    if a.op.gives_input_grad and (Op.FORWARD, a.chunk, a.microbatch) not in done[rank]:
                        raise ScheduleError(
                            f"{_where(rank, index, a)}: needs its own forward of micro-batch {a.microbatch}, which no earlier action provides"
                        )
                    if a.op is Op.BACKWARD_WEIGHT and (Op.BACKWARD_INPUT, a.chunk, a.microbatch) not in done[rank]:
                        raise ScheduleError(
                            f"{_where(rank, index, a)}: runs before the input gradient (BI) of micro-batch {a.microbatch} on chunk {a.chunk}"
                        )
                    local, remote = _needs(s, rank, a)
                    if local is not None and local not in done[rank]:
                        what = "the activation" if a.op is Op.FORWARD else "the gradient"
                        raise ScheduleError(f"{_where(rank, index, a)}: needs {what} of chunk {local[1]}, which no earlier action provides")
                    if remote is not None:
                        if remote not in posted[rank]:
                            what = "the activation" if a.op is Op.FORWARD else "the gradient from"
                            raise ScheduleError(
                                f"{_where(rank, index, a)}: needs {what} of chunk {remote[1]}, which no earlier action provides"
                            )
                        if remote not in sent:
                            break  # posted, not yet sent: wait for the peer
                    done[rank].add((a.op, a.chunk, a.microbatch))
                    if a.op.gives_input_grad:
                        done[rank].add(("input gradient", a.chunk, a.microbatch))
                    if a.op.gives_weight_grad:
                        done[rank].add(("weight gradient", a.chunk, a.microbatch))
                elif a.op is Op.REDUCE_GRAD:
                    upto = s.num_microbatches if a.microbatch is None else a.microbatch + 1  # a batch's REDUCE: up to its end
                    pending = [mb for mb in range(upto) if ("weight gradient", a.chunk, mb) not in done[rank]]
                    if pending:
                        raise ScheduleError(f"{_where(rank, index, a)}: runs before the backward of micro-batches {pending}")
                pointer[rank] += 1
                progress = True
    stuck = [r for r in range(s.num_ranks) if pointer[r] < len(s.actions[r])]
    if stuck:
        waits = "; ".join(_where(r, pointer[r], s.actions[r][pointer[r]]) for r in stuck)
        raise ScheduleError(f"dependency cycle: ranks wait on each other forever: {waits}")
    if s.backward:
        for rank in range(s.num_ranks):
            for c in s.chunks_of(rank):
                reduces = [a for a in s.actions[rank] if a.op is Op.REDUCE_GRAD and a.chunk == c]
                if not reduces:
                    raise ScheduleError(f"rank {rank}: chunk {c} never reduces its gradients (no REDUCE action)")
                closed = [a.microbatch for a in reduces if a.microbatch is not None]  # per-batch REDUCEs (2BW)
                if closed and s.num_microbatches - 1 not in closed:
                    raise ScheduleError(f"rank {rank}: chunk {c} never reduces the gradients of its last batch")
