"""DoubleBuffer, PipeDream-2BW's weight versions: the pipeline stays full across optimizer steps (paper §3.1).

Per optimizer step the rank runs one slice of the continuous 1F1B order (`schedules.two_bw`): the
forwards of the step's batch b, the backwards paired with them (the previous batch's tail first),
then REDUCE of batch b - 1, whose gradient is now complete. The caller's optimizer step that
follows applies it: W(b) = W(b - 1) - lr * grad f(W(b - 2)). Batch b runs, forward and backward,
on version max(b - 1, 0): the live weights when nothing was applied since, else the stashed copy a
drain keeps. At most two versions are held: the live weights (aliased by the newest batch) and one
older buffer.

`drain` finishes the batch in flight and applies its update through `apply` (the caller's
optimizer step, e.g. Lightning's with clipping and LR scheduling); afterwards every rank holds
W(b + 1) and, stashed, W(b), which the next batch reads. A drain changes when work runs, never
which version a batch uses, so a run that drains (validation, checkpoints, resume) follows the same
trajectory as one that never does.

Fewer micro-batches per step than stages would need a third version (the paper requires m >= d).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

from torch import Tensor, nn

from ...runtime.executor import Carry, Executor, StageHost
from ...runtime.p2p import Activation, Transport
from ...runtime.sharded_versions import ShardedVersions
from ...runtime.versions import Version, WeightVersions, storage
from ...schedules import ScheduleSpec
from ...schedules.actions import Op
from ...schedules.two_bw import drain_actions, leads, step_actions
from ..engine import Versions
from ..flush.engine import Flush

AnyVersions = Union[WeightVersions, ShardedVersions]


@dataclass
class _Batch:
    index: int  # b, counted over the run
    microbatches: int
    version: Version  # W(max(b - 1, 0)), read by all its micro-batches
    stashed: bool  # the version is the stash a drain kept (not the live weights)


class _VersionedHost:
    """The host's forwards on a batch's version; REDUCE first moves the completed batch's gradients
    to the live parameters."""

    def __init__(self, host: StageHost, versions: AnyVersions, batch: Optional[_Batch], completed: Optional[_Batch]):
        self.host, self.versions, self.batch, self.completed = host, versions, batch, completed
        if versions.gathers:  # FSDP2 gathers the weights again for a backward: on the batch's version too
            self.backward_scope = self._backward_scope

    def _backward_scope(self, chunk: int, microbatch: int) -> ContextManager[None]:
        batch = self.completed if microbatch < 0 else self.batch  # a slice numbers the previous batch's below 0
        assert batch is not None
        return self.versions.backward(batch.version)  # type: ignore[union-attr]

    def forward(self, chunk: int, microbatch: int, inputs: Optional[Activation]) -> Any:
        assert self.batch is not None, "a drain runs no forward"
        with self.versions.use(self.batch.version):
            return self.host.forward(chunk, microbatch, inputs)

    def reduce_gradients(self, chunk: int) -> None:
        assert self.completed is not None
        self.versions.collect(self.completed.version)
        self.host.reduce_gradients(chunk)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)


class DoubleBuffer(Versions):
    def __init__(
        self,
        spec: ScheduleSpec,
        stages: int,
        microbatches: int,
        rank: int,
        transport: Transport,
        module: nn.Module,
        apply: Callable[[], None],
        prefetch: bool = True,
        trace: bool = False,
        sliced: int = 0,
        sharded: bool = False,
    ):
        if sliced:
            raise ValueError("schedule='2bw' has no warm-up to slice: use slicer=False")
        self.spec, self.stages, self.rank, self.transport = spec, stages, rank, transport
        self.prefetch, self.trace = prefetch, trace
        # forwards each rank keeps ahead: fixed for the run from the configured M (advance_num: AvgPipe(2BW)'s order)
        self.ahead = leads(stages, microbatches, self.spec.kwargs.get("advance_num", 0))
        # sharded: the stage's blocks are FSDP2's (shard="full"), each rank stashes its shard of a version
        self.versions: AnyVersions = ShardedVersions(module) if sharded else WeightVersions(module)
        self.apply = apply  # applies the live parameters' gradients (the caller's optimizer step)
        self.placement = tuple(range(stages))
        self.carry = Carry()
        self.in_flight: deque[_Batch] = deque()  # at most one batch between steps
        self.applied = 0  # updates applied to the live weights: they are W(applied)
        self.stashed: Optional[dict[int, Tensor]] = None  # W(applied - 1) after a drain, until no batch reads it
        self._evaluation = Flush(ScheduleSpec.of("1f1b"), stages, microbatches, rank, transport, prefetch, trace)
        self._executors: dict[tuple, Executor] = {}
        self._host: Optional[StageHost] = None

    # ---- steps -----------------------------------------------------------------------------------
    def _executor(self, kind: str, microbatches: int, previous: Optional[int] = None) -> Executor:
        key = (kind, microbatches, previous)
        if key not in self._executors:
            ahead = self.ahead
            schedule = (
                drain_actions(self.stages, microbatches, ahead)
                if kind == "drain"
                else step_actions(self.stages, microbatches, previous, ahead)
            )
            executor = Executor(schedule, self.rank, self.transport, self.prefetch, trace=self.trace)
            # a batch's gradients are complete at its own last backward: the previous batch's (micro-batch -1 of
            # a slice) or, on a rank keeping no forward ahead, the step's own; not at the slice's last
            ends = (-1, microbatches - 1) if kind == "step" else (-1,)
            executor.gradients_complete = {i for i, a in enumerate(executor.actions) if a.op is Op.BACKWARD and a.microbatch in ends}
            self._executors[key] = executor
        return self._executors[key]

    def executor(self, kind: str, microbatches: int) -> Executor:
        if kind != "train":
            return self._evaluation.executor(kind, microbatches)
        return self._executor("step", microbatches, self.in_flight[-1].microbatches if self.in_flight else None)

    def _start(self, microbatches: int) -> _Batch:
        b = self.applied + len(self.in_flight)
        v = max(b - 1, 0)
        if v == self.applied:
            return _Batch(b, microbatches, self.versions.version(), stashed=False)
        if v == self.applied - 1 and self.stashed is not None:
            return _Batch(b, microbatches, self.versions.version(self.stashed), stashed=True)
        # cannot happen while every update goes through this mode
        raise RuntimeError(f"2BW: batch {b} needs weight version {v}, but the stage holds W({self.applied}) and no stash of W({v})")

    def run(self, kind: str, host: StageHost, keys: Sequence[Any]) -> Executor:
        if kind != "train":
            self.drain()
            return self._evaluation.run(kind, host, keys)
        if len(keys) < self.stages:  # the configuration is checked up front; a caller splitting otherwise is a bug
            raise ValueError(f"2BW: a step of {len(keys)} micro-batches on {self.stages} stages; it needs microbatches >= stages")
        return self._step(host, keys)

    def _step(self, host: StageHost, keys: Sequence[Any]) -> Executor:
        previous = self.in_flight[-1] if self.in_flight else None
        batch = self._start(len(keys))
        self._host = host  # a drain reduces through it
        executor = self._executor("step", len(keys), previous.microbatches if previous else None)
        executor.run(_VersionedHost(host, self.versions, batch, previous), keys, self.carry)
        self.in_flight.append(batch)
        if previous is not None:  # its gradient is on the live parameters; the caller applies it next
            self.in_flight.popleft()
            del previous  # its version's buffer goes before the live weights get a new one
            self._before_update()
        return executor

    def _before_update(self) -> None:
        """The live weights are about to become W(applied + 1): the stash goes once no batch in
        flight reads it, then a batch still reading the live weights keeps their buffer (two
        buffers at any time: release first, then copy)."""
        self.applied += 1
        if not any(b.stashed for b in self.in_flight):
            self.stashed = None
        if any(self.versions.aliases_live(b.version) for b in self.in_flight):
            self.versions.detach_live()

    def drain(self) -> None:
        """Finish the batch in flight and apply its update; keep W(before) for the next batch."""
        if not self.in_flight:
            return
        microbatches = self.in_flight[-1].microbatches
        self._executor("drain", microbatches).run(_VersionedHost(self._host, self.versions, None, self.in_flight[-1]), [], self.carry)
        self.in_flight.clear()  # the drained batch's version (and the stash it may have read) go first
        self.stashed = None
        self.stashed = self.versions.snapshot()  # W(applied): the version the next batch reads
        self.applied += 1
        self.apply()

    def versions_held(self) -> int:
        """Distinct weight buffers this stage holds now (live, stash, in-flight batches' versions)."""
        if not self.versions.live:
            return 0
        first = self.versions.live[0]
        buffers = {storage(first)}
        if self.stashed is not None:
            buffers.add(storage(self.stashed[id(first)]))
        buffers.update(storage(b.version[id(first)]) for b in self.in_flight)
        return len(buffers)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """After a drain: how many updates the live weights hold and the stashed previous version
        (by the live parameters' ids; the strategy stores it by name)."""
        return {"schedule": [self.spec.name, dict(self.spec.options)], "sliced": 0, "applied": self.applied, "stashed": self.stashed}

    def load_state(self, applied: int, stashed: Optional[dict[int, Tensor]]) -> None:
        if self.in_flight:
            raise RuntimeError("2BW: a state is loaded into a drained pipeline only")
        self.applied, self.stashed = applied, stashed
