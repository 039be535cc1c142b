"""The executor's host inside Lightning: micro-batches through the user's own step methods.

- Chunk 0 runs the user's step on the micro-batch up to the pipeline call (whatever the step does
  to the batch before calling ``self.<pipeline>(x)`` is how the pipeline's input is made), runs
  its blocks on ``x`` and stops the step there.
- Middle chunks run their blocks on the received activation; no user code.
- The last chunk runs the user's step again: the pipeline call now runs the last blocks on the
  received activation, and the step computes the loss and logs as it would in one process.
  The loss is weighted by the micro-batch's share of the samples (and scaled for fp16).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

from torch import Tensor
from torch.distributed.tensor import DTensor

from ..runtime.p2p import Activation
from .logs import LogRecorder
from .stage import PipelineStage, _Handoff


def as_local(t: Tensor) -> Tensor:
    """A loss or logged value as a plain tensor: under loss_parallel the loss is a DTensor, the same on every
    tensor rank (replicated)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def loss_of(output: Any, step: str) -> Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            f"{step} returned {type(output).__name__} on the last pipeline stage; under AutoPipeStrategy it must return "
            "the loss tensor (or a dict with 'loss'): skipping a batch by returning None is not supported"
        )
    return loss


class LightningHost:
    def __init__(self, module: Any, stage: PipelineStage, last_chunk: int, reduce: Callable[[int], None]):
        self.module, self.stage, self.last_chunk, self._reduce = module, stage, last_chunk, reduce
        self.recorder = LogRecorder(module)
        self.step_name = "training_step"
        self.microbatches: list[Any] = []
        self.weights: list[float] = []
        self.step_args: tuple = ()
        self.step_kwargs: dict = {}
        self.scale: Optional[Callable[[Tensor], Tensor]] = None
        self.loss: Optional[Tensor] = None
        self.outputs: list[Any] = []
        # the step runner's: when the last chunk has run every micro-batch (the step's logs are
        # complete), and work to do while the executor waits for a receive
        self.on_forwards_done: Optional[Callable[[], None]] = None
        self.on_idle: Optional[Callable[[], None]] = None
        self._last_forwards = 0

    def begin(
        self,
        step_name: str,
        microbatches: list[Any],
        weights: list[float],
        args: tuple,
        kwargs: dict,
        scale: Optional[Callable[[Tensor], Tensor]] = None,
    ) -> None:
        self.step_name, self.microbatches, self.weights = step_name, microbatches, weights
        self.step_args, self.step_kwargs, self.scale = args, kwargs, scale
        self.loss, self.outputs = None, []
        self._last_forwards = 0
        self.recorder.reset()

    def forward(self, chunk: int, microbatch: int, inputs: Optional[Activation]) -> Any:
        if chunk not in (0, self.last_chunk):
            return self.stage.run_chunk(chunk, inputs, microbatch)
        is_last = chunk == self.last_chunk
        calls = 0

        def runner(x: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(f"{self.step_name} called the pipeline twice; under AutoPipeStrategy call it once per step")
            out = self.stage.run_chunk(chunk, x if chunk == 0 else inputs, microbatch)
            if not is_last:
                raise _Handoff(out)
            return out

        self.stage._runner = runner
        self.recorder.active, self.recorder.weight = is_last, self.weights[microbatch]
        try:
            result = getattr(self.module, self.step_name)(self.microbatches[microbatch], *self.step_args, **self.step_kwargs)
        except _Handoff as handoff:
            return handoff.value
        finally:
            self.stage._runner = None
            self.recorder.active = False
        if calls == 0:
            raise RuntimeError(f"{self.step_name} never called the pipeline; call self.<pipeline>(x) in it")
        if not is_last:  # only possible if the step caught the hand-off; treat as a hard error
            raise RuntimeError(f"{self.step_name} continued past the pipeline call on a stage that is not the last")
        if self.step_name != "training_step":
            self.outputs.append(result)
            return None
        loss = loss_of(result, self.step_name)
        weighted = loss * self.weights[microbatch]
        value = as_local(weighted.detach())
        self.loss = value if self.loss is None else self.loss + value
        self._last_forwards += 1
        if self._last_forwards == len(self.microbatches) and self.on_forwards_done is not None:
            self.on_forwards_done()
        return self.scale(weighted) if self.scale is not None else weighted

    def idle(self) -> None:
        if self.on_idle is not None:
            self.on_idle()

    def reduce_gradients(self, chunk: int) -> None:
        if self.stage.gradients_final is not None:
            self.stage.gradients_final(chunk)
        self._reduce(chunk)

    def before_backward(self, chunk: int, last: bool) -> None:
        if self.stage.backward_sync is not None:
            self.stage.backward_sync(chunk, last)

    def weight_gradients_done(self, chunk: int, microbatch: int) -> None:
        if self.stage.backward_end is not None:
            self.stage.backward_end(chunk)
        if self.stage.backward_done is not None:
            self.stage.backward_done(microbatch, len(self.microbatches))
