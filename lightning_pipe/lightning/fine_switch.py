"""A fine-grained switch on one rank (AutoPipe-RL §4.4; the transfers are adaptive/fine_grained.py).

A `Transition` is made at the transition iteration's start on every rank of the job (the transfers'
process groups are made before the first one, once, by all): the cut takes the new bounds, the stage keeps the old
ones for micro-batches < k, the two workers start their transfers, and the gradients and runtime
are rebuilt over the new cut (the old worker's moved blocks are outside its gradient groups: the
new worker reduces them). `finish` runs after the iteration's backward, before the optimizer step.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from ..adaptive.fine_grained import Incoming, Outgoing, fine_grained_move, keeps_running_statistics
from ..adaptive.switch import Bounds, Move
from ..modes.lightning import Layer
from ..runtime.tied import tied_from_groups
from .context import RankContext
from .gradients import StageGradients


class Switching(Protocol):
    """What a live switch uses of the composed layers (`compose.Training` is one): their hooks, and
    the gradients and runtime it rebuilds over the new cut."""

    ctx: RankContext
    layers: Sequence[Layer]
    gradients: Optional[StageGradients]

    def build_gradients(self) -> StageGradients: ...

    def build_runtime(self) -> None: ...

    def switch(self, new: Any) -> Any:
        """The stop-and-move switch (collective over the pipeline)."""
        ...


def why_not_fine(switching: Switching, new: Bounds) -> tuple[Optional[Move], str]:
    """The move, or why this switch stops the pipeline instead."""
    ctx = switching.ctx
    carried = [type(layer).__name__ for layer in switching.layers if type(layer).switch_extras is not Layer.switch_extras]
    if carried:
        return None, f"{', '.join(carried)} carries per-parameter state with the blocks"
    if ctx.trainer.accumulate_grad_batches > 1:
        return None, "gradients accumulate over several batches"
    move, why = fine_grained_move(ctx.cut.bounds, new, ctx.cut.placement, ctx.cut.ties)
    held = {**ctx.cut.skeletons, **ctx.cut.stage.blocks()}  # every block, as a skeleton where another rank holds it
    if move is not None and any(keeps_running_statistics(held[b]) for b in move.blocks):
        return None, "a moved block updates running statistics in its forward (BatchNorm)"
    return move, why


class Transition:
    """This rank's part of one fine-grained switch, from the batch's start to `finish`."""

    def __init__(self, switching: Switching, move: Move, new: Bounds, early: int, group: Any):
        self.switching, self.move, self.early = switching, move, early
        ctx, cut = switching.ctx, switching.ctx.cut
        me, old = ctx.stage_index, cut.bounds
        blocks = cut.stage.blocks()
        self.outgoing: Optional[Outgoing] = None
        self.incoming: Optional[Incoming] = None
        if me == move.src:
            self.outgoing = Outgoing(blocks, move, ctx.pipeline_rank(move.dst), ctx.optimizers, early, ctx.device, group)
        elif me == move.dst:
            self.incoming = Incoming(blocks, cut.skeletons, move, ctx.pipeline_rank(move.src), ctx.device, group)
        self.blocks = blocks
        mine = [c for c, r in enumerate(cut.placement) if r == me]
        cut.bounds = new
        cut.stage.reassign(blocks, {c: new[c] for c in mine})
        cut.stage.transition(early, {c: old[c] for c in mine})
        cut.tied = tied_from_groups(cut.ties, cut.bounds, cut.placement, me, blocks)
        switching.build_gradients()
        switching.build_runtime()
        if self.incoming is not None:
            cut.stage.arrival = self.incoming.fill
            switching.gradients.before_reduce = self.incoming.add_partial
        if self.outgoing is not None:
            cut.stage.backward_done = self.outgoing.backward_done

    def finish(self) -> tuple[int, float]:
        """Bytes this rank sent and seconds its compute waited for the transfers."""
        ctx, cut = self.switching.ctx, self.switching.ctx.cut
        sent = 0
        if self.outgoing is not None:
            sent = self.outgoing.finish(cut.skeletons)
            cut.stage.reassign(self.blocks, cut.stage.chunk_bounds)
        if self.incoming is not None:
            self.incoming.finish(ctx.optimizers)
        cut.stage.transition(0, cut.stage.chunk_bounds)
        cut.stage.arrival = cut.stage.backward_done = None
        self.switching.gradients.before_reduce = None
        cut.switched = True
        for layer in self.switching.layers:
            layer.after_switch({})
        return sent, self.incoming.waited if self.incoming is not None else 0.0
