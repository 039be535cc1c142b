"""The action language: what one pipeline rank does, in order, during one step.

A schedule is data, not code: a `PipelineSchedule` holds one ordered list of `Action`s per
pipeline rank. The runtime executes these lists with real tensors, the validator replays them
symbolically, and (later) the simulator replays them on a cost model. Nothing here knows about
torch.distributed or Lightning.

Model chunks are numbered globally along the pipeline: chunk ``c`` feeds chunk ``c + 1``.
``chunk_rank[c]`` says which pipeline rank holds chunk ``c``; with one chunk per rank (GPipe,
1F1B) chunk ``c`` lives on rank ``c``, multi-chunk schedules (interleaved, wave) place several
chunks on one rank, and adjacent chunks on one rank hand over locally without communication.

A backward is one action (B: input and weight gradients together) or two, as zero-bubble
pipelines split it (Qi et al., ICLR 2024): BI, the gradient with respect to the chunk's input,
which the previous chunk waits for, and W, the weight gradients, which can wait to fill a bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients at once
    BACKWARD_INPUT = "BI"  # the paper's B: the input gradient only (what the previous chunk waits for)
    BACKWARD_WEIGHT = "W"  # the weight gradients of a micro-batch whose BI has run
    SEND_ACT = "SEND_F"  # send the activation chunk `chunk` produced for `microbatch` to `peer`
    RECV_ACT = "RECV_F"  # receive the activation that chunk `chunk` consumes, from `peer`
    SEND_GRAD = "SEND_B"  # send the input gradient of chunk `chunk` to `peer`
    RECV_GRAD = "RECV_B"  # receive the output gradient chunk `chunk` needs, from `peer`
    REDUCE_GRAD = "REDUCE"  # gradients of chunk `chunk` are final: reduce across pipeline replicas
    # (a REDUCE with a micro-batch closes the batch ending at it: 2BW applies one update per batch)

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    @property
    def gives_input_grad(self) -> bool:
        """The compute that produces the gradient the previous chunk consumes."""
        return self in (Op.BACKWARD, Op.BACKWARD_INPUT)

    @property
    def gives_weight_grad(self) -> bool:
        """The compute after which a micro-batch's weight gradients are accumulated (and its activations free)."""
        return self in (Op.BACKWARD, Op.BACKWARD_WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACT, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACT, Op.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    op: Op
    chunk: int
    microbatch: Optional[int] = None
    peer: Optional[int] = None  # pipeline rank on the other end of a send / receive

    def __str__(self) -> str:
        text = f"{self.op.value}(chunk={self.chunk}"
        if self.microbatch is not None:
            text += f", mb={self.microbatch}"
        if self.peer is not None:
            text += f", {'to' if self.op.is_send else 'from'}={self.peer}"
        return text + ")"


@dataclass
class PipelineSchedule:
    """Per-rank action lists of one training (or forward-only) step of one pipeline."""

    name: str
    num_microbatches: int
    chunk_rank: tuple[int, ...]  # chunk index -> pipeline rank holding it
    actions: list[list[Action]] = field(default_factory=list)  # pipeline rank -> its actions
    backward: bool = True  # False for forward-only (evaluation) schedules
    weight_versions: int = 1  # weight versions a rank holds at once (2 for PipeDream-2BW's stashing)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_rank)

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.chunk_rank) if r == rank]

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.num_ranks} ranks, {self.num_chunks} chunks, m={self.num_microbatches}"]
        for rank, acts in enumerate(self.actions):
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)
