"""The interfaces of the engine's layers: everything any caller uses, declared here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence

from ..runtime.executor import Executor, StageHost
from ..runtime.p2p import Transport
from ..schedules import ScheduleSpec


class Versions(ABC):
    """Weight versions: runs this rank's action list of a step and owns what outlives the step."""

    spec: ScheduleSpec  # the schedule it runs
    transport: Transport  # the pipeline's point-to-point link (the monitor and the tuner read its counters)
    placement: Sequence[int]  # the rank holding each model chunk
    trace: bool  # record each action's times (executors built after it is set record)

    @abstractmethod
    def run(self, kind: str, host: StageHost, keys: Sequence[Any]) -> Executor:
        """Run one step's action list (`kind`: "train" or "eval"); keys[i] is micro-batch i's
        signature. Returns the executor that ran (its schedule, its trace)."""

    @abstractmethod
    def executor(self, kind: str, microbatches: int) -> Executor:
        """The executor a `kind` step of `microbatches` micro-batches would run now."""

    @abstractmethod
    def drain(self) -> None:
        """Apply whatever is still in flight (nothing for a flushing schedule)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """What resumes this layer exactly: "schedule" ([name, options]) and "sliced" at least."""


class Controller(Protocol):
    """A per-step rule that changes the schedule between steps, alike on every rank."""

    advance_num: int

    def measure_stash(self, microbatches: int) -> AbstractContextManager[None]:
        """Around a training step: what the rule measures inside it."""
        ...

    def observe(self, seconds: float, device: Any = None) -> int:
        """After a full training step: agree with the other ranks and decide the next value."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
