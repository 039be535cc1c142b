"""AvgPipe's elastic averaging: one of N parallel pipelines, joined to the others through the
stage's reference process.

The pipeline's step runs under its own weight-versions layer (a flush, or 2BW: the gradients
are one process's); the user's optimizer then takes its step, unchanged. Around that step the caller calls
`before_update()` and `after_update()`: the latter turns the step into the local update Δ_n(t),
sends it to the stage's reference process and pulls the weights towards W_ref
(`lightning_pipe.runtime.elastic` has the rule). Evaluation and checkpoints see the reference
model, the centre of the parallel models: `showing_reference()` puts it in the stage for a while.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from ...runtime.elastic import ReferenceLink, elastic_pull_, flat_into, flat_size, write_flat


class ElasticAveraging:
    def __init__(
        self,
        module: nn.Module,
        pipeline: int,
        alpha: float,
        staleness: int,
        link: Callable[[int, torch.dtype], ReferenceLink],
        rank: int = 0,
    ):
        self.pipeline, self.alpha, self.staleness = pipeline, alpha, staleness
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"AvgPipe needs one dtype for a stage's trained parameters; stage {rank} has {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self._make_link = link
        self.link: Optional[ReferenceLink] = None
        self.iteration = 0  # t: iterations applied
        self.refs: dict[int, Tensor] = {}  # W_ref(j) held; j of the next posted receive is max(refs) + 1 + len(pending)
        self._next_posted = 0
        self.numel = flat_size(self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        # flat buffers kept for the whole run: the weights before the step, the update, the own weights
        self._before, self._delta, self._own = (torch.zeros(self.numel, dtype=self.dtype, device=device) for _ in range(3))

    # ---- the reference process, started on first use (after any checkpoint is loaded) ------------
    def _start(self) -> None:
        if self.link is not None:
            return
        if not self.refs:  # a fresh start: the parallel models and the reference are the same weights
            self.refs = {self.iteration: flat_into(self.params, torch.zeros_like(self._before))}
        self._next_posted = max(self.refs) + 1
        self.link = self._make_link(self.numel, self.dtype)
        self.link.max_sends = self.staleness + 2  # Δ(t - s - 1) was taken before the pull of t could be served
        if self.pipeline == 0:
            self.link.send_init(self.refs[self.iteration])  # W_ref(t): what the reference holds now

    def _reference(self, j: int) -> Tensor:
        while j not in self.refs:
            got = self.link.take_reference()
            here = got.to(self._before.device)
            if here is not got:  # an accelerator: the host buffer can take the next receive
                self.link.release(got)
            self.refs[self._next_posted - len(self.link.pending) - 1] = here
        return self.refs[j]

    # ---- around the optimizer step ------------------------------------------------------------
    def before_update(self) -> None:
        self._start()
        flat_into(self.params, self._before)

    def after_update(self) -> None:
        """Δ_n(t) to the reference, then W_n(t + 1) = (1 - α) W_n(t) + α W_ref(max(t - s, 0)) + Δ_n(t)."""
        t = self.iteration
        self.link.send_delta(flat_into(self.params, self._delta).sub_(self._before))  # Δ = after - before
        self.link.post_reference()  # W_ref(t + 1)
        self._next_posted += 1
        elastic_pull_(self.params, self._before, self._reference(max(t - self.staleness, 0)), self.alpha)
        self.iteration = t + 1
        oldest = max(self.iteration - self.staleness, 0)  # the next pull's reference; older ones are done with
        for j in [j for j in self.refs if j < oldest]:
            self.link.release(self.refs.pop(j))

    # ---- edges ---------------------------------------------------------------------------------
    def drain(self) -> None:
        """Receive every W_ref posted, so the reference after all applied iterations is held."""
        if self.link is not None:
            self._reference(self.iteration)

    @contextlib.contextmanager
    def showing_reference(self) -> Iterator[None]:
        """The stage holds W_ref(t) (the reference after every applied iteration) inside the block."""
        self._start()
        self.drain()
        flat_into(self.params, self._own)
        write_flat(self.params, self.refs[self.iteration])
        try:
            yield
        finally:
            write_flat(self.params, self._own)

    def pending_references(self) -> dict[int, Tensor]:
        """W_ref(j) the coming pulls still need, besides W_ref(t) itself: j = t - s .. t - 1."""
        self.drain()
        return {j: v for j, v in self.refs.items() if j < self.iteration}

    def load_state(self, iteration: int, reference: Tensor, pending: dict[int, Tensor]) -> None:
        """Resume: t, W_ref(t) and the older references the next pulls need."""

        def buffer(values: Tensor) -> Tensor:
            out = torch.zeros_like(self._before)  # the flat size (padded to one element for an empty stage)
            out[: values.numel()].copy_(values.reshape(-1))
            return out

        self.iteration = iteration
        self.refs = {**{int(j): buffer(v) for j, v in pending.items()}, iteration: buffer(reference)}

    def close(self, graceful: bool = True) -> None:
        """Stop the reference process: by message after a finished run, by SIGKILL after a failure."""
        if self.link is not None:
            link, self.link = self.link, None
            link.stop() if graceful else link.close(kill=True)

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}
