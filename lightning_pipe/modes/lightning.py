"""The Lightning side of every mode: each hook the composition (`lightning/compose.py`) calls, declared once.

A layer gets what it uses when it is made or in a hook (the context, the runner, an update
callable), never the composition itself. A layer carries what belongs to it in Lightning: the Trainer settings it refuses (before any
process starts), its checkpoint state (handed to `lightning.checkpoint`, which owns the keys), what
evaluation and checkpoints see, its part of a live switch, its end. Every hook defaults to
nothing, so a layer overrides only what it changes.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

from torch import nn

from ..config import PipelineConfig
from .engine import Versions

if TYPE_CHECKING:
    from ..lightning.context import RankContext

Update = Callable[[Callable[[], Any]], Any]  # one update of the weights through every layer's optimizer_step


class Layer:
    """Every hook has a default; the kinds below add what they require."""

    def __init__(self, ctx: "RankContext"):
        self.ctx = ctx

    @classmethod
    def check_trainer(cls, config: PipelineConfig, trainer: Any, model: Any) -> None:
        """Refuse, with a `SettingError`, Trainer settings this layer cannot honour (before spawning);
        a mode's checks live in its `settings.py`, beside its settings' own (`check_config`)."""

    def start(self) -> None:
        """Optimizers and LR schedulers exist (setup's end)."""

    def prepare_stage(self) -> None:
        """The stage is cut, on its device and in step with its replicas; no optimizer exists yet (the
        place to re-lay its parameters out, e.g. FSDP2's sharding)."""

    def on_runtime(self, runner: Versions) -> None:
        """The runner, gradients and steps were (re)built over the current cut."""

    def optimizer_step(self, step: Callable[[], Any]) -> Any:
        """Around every update of the weights (Lightning's optimizer step, or a drain's update)."""
        return step()

    def showing_model(self) -> ContextManager[None]:
        """Inside the block the stage holds the weights evaluation, checkpoints and the end of fit see."""
        return contextlib.nullcontext()

    def whole_optimizers(self, gather: bool) -> ContextManager[None]:
        """Inside the block the optimizers hold every parameter of the stage, as a checkpoint stores them
        (`gather`: with their state, for saving; else for loading). Collective where the layer needs it."""
        return contextlib.nullcontext()

    @property
    def shows_other_weights(self) -> bool:
        """`showing_model` puts other weights in the stage (a checkpoint must copy them)."""
        return False

    def drain(self) -> None:
        """Apply or receive what is still in flight (before evaluation, a checkpoint, a switch, the end)."""

    def switch_extras(self) -> Optional[Callable[[nn.Parameter], dict[str, Any]]]:
        """Before a live switch: per-parameter state that moves with a block (None: nothing)."""
        return None

    def after_switch(self, received: dict[int, dict[str, Any]]) -> None:
        """After a live switch (runtime rebuilt): `received` are moved parameters' extras by id."""

    def parameter_state(self, stored: dict[int, str], state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per-parameter checkpoint extras by stored name (`stored`: id -> name; `state`: the stage's named
        optimizer state). Collective where the layer needs other ranks."""
        return {}

    def run_state(self) -> dict[str, Any]:
        """The layer's checkpoint state (short names of `checkpoint.keys.RUN`)."""
        return {}

    def load(self, run: dict[str, Any], extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> None:
        """Resume: the checkpoint's run state, per-parameter extras by id, the whole checkpoint."""

    def close(self, graceful: bool) -> None:
        """The end of the run (`graceful`: it finished; else it failed)."""


class VersionsLayer(Layer, ABC):
    """Weight versions: builds, and holds, the runner of a step's action list. `update` is one update of
    the weights through every layer (what a drain applies, where the rule applies one there)."""

    def __init__(self, ctx: "RankContext", update: Update):
        super().__init__(ctx)
        self.update = update
        self.runner: Optional[Versions] = None

    def build_runner(self, settings: dict[str, Any]) -> Versions:
        self.runner = self.make_runner(settings)
        return self.runner

    @abstractmethod
    def make_runner(self, settings: dict[str, Any]) -> Versions:
        """The runner over the current cut (`settings`: spec, stages, microbatches, rank, transport, ...)."""

    def update_due(self) -> bool:
        """Asked before Lightning's optimizer step: whether it will apply an update (a flush: always)."""
        return True

    def drain(self) -> None:
        self.runner.drain()

    def run_state(self) -> dict[str, Any]:
        state = self.runner.state_dict()
        return {"schedule": state["schedule"], "sliced": state["sliced"]}


class ReplicasLayer(Layer):
    """Replicas of the pipeline: whether REDUCE averages gradients across them. `versions`: the weight
    versions layer, whose per-parameter state a replica's checkpoint entry carries."""

    averages_gradients: bool = False
    shards_optimizer: bool = False  # each replica steps its own share of the parameters: clipping's norm spans the replicas

    def __init__(self, ctx: "RankContext", versions: VersionsLayer):
        super().__init__(ctx)
        self.versions = versions

    def own_extras(self, extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Resume: the per-parameter extras of this replica's model, by parameter id (`extras`: the ones
        a checkpoint stores beside its model; the same for every replica unless they train apart)."""
        return extras


class PartitionLayer(Layer, ABC):
    """Partition control: may move block boundaries between steps. `planner`: the setup's planner (its
    profile and costs, read at `start`); `switching`: the composition's live switch
    (`lightning/fine_switch.Switching`)."""

    def __init__(self, ctx: "RankContext", planner: Any, switching: Any):
        super().__init__(ctx)
        self.planner, self.switching = planner, switching

    @abstractmethod
    def request(self, bounds: Any, early: Optional[int] = None) -> Any:
        """Switch to `bounds` at the next batch's start (every rank asks alike); `early`: a fine-grained
        switch's micro-batches left on the old worker (None: chosen from the measurements)."""

    def before_batch(self) -> None:
        """A training batch starts: apply a pending switch."""

    def begin_step(self) -> None:
        """Before a training step's schedule."""

    def end_step(self, executor: Any, microbatches: int) -> None:
        """After a training step's schedule."""

    def after_backward(self) -> None:
        """The step's gradients are back in place, before the optimizer step (a fine-grained switch ends)."""

    def finish(self) -> None:
        """The end of fit (every rank): nothing left in flight."""


class ControllerLayer(Layer):
    """A per-step controller: hands the runner its rule."""

    def runner_options(self) -> dict[str, Any]:
        return {}
