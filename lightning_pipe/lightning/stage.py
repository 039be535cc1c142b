"""How a LightningModule exposes its pipeline, and the stage module that replaces it on a rank.

The pipeline is the module's single `nn.Sequential` child, or whatever `configure_pipeline()`
returns, or else (a model that loops over its blocks, e.g. a Hugging Face model) the front end's
`TracedPipeline` put in place of the child holding the blocks (`frontend`). On each rank the strategy swaps it for a `PipelineStage` holding only this rank's
blocks, registered under their original indices, so the module's `state_dict()` keys are those
of the full model (``seq.3.weight``) and a gathered checkpoint loads in a plain single process.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

from torch import nn

from ..errors import SettingError
from ..frontend import FrontendError, TracedPipeline, attach_user_names, convert
from ..profiling import check_activation
from ..runtime.call import as_call, as_input
from ..runtime.recompute import run_block
from ..runtime.tensor_parallel import sequence_gather, sequence_scatter


def _on_hidden(x: Any, change: Callable[[Any], Any]) -> Any:
    """`change` applied to an activation's hidden state: the tensor, or a (hidden, mask) tuple's first item."""
    return (change(x[0]), *x[1:]) if isinstance(x, tuple) else change(x)


class PipelineSetupError(ValueError):
    pass


def find_pipeline(module: nn.Module, blocks: Optional[str] = None) -> tuple[str, nn.Sequential]:
    """Return the attribute path and the `nn.Sequential` that forms the pipeline; a model looping over
    its blocks is converted in place (`blocks`: the path of their ModuleList, else found)."""
    traced = [(n, m) for n, m in module.named_children() if isinstance(m, TracedPipeline)]
    if traced:
        return traced[0]
    if blocks is not None:
        return _converted(module, blocks)
    configure = getattr(module, "configure_pipeline", None)
    if callable(configure):
        pipeline = configure()
        if not isinstance(pipeline, nn.Sequential):
            raise PipelineSetupError(
                f"{type(module).__name__}.configure_pipeline() must return an nn.Sequential of blocks, got {type(pipeline).__name__}"
            )
        for name, sub in module.named_modules():
            if sub is pipeline and name:
                return name, pipeline
        raise PipelineSetupError(
            f"{type(module).__name__}.configure_pipeline() returned an nn.Sequential that is not a submodule of the "
            "LightningModule; assign it to an attribute (self.blocks = nn.Sequential(...)) and return that"
        )
    found = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(found) == 1:
        return found[0]
    if not found:
        return _converted(module, None)
    names = ", ".join(n for n, _ in found)
    raise PipelineSetupError(
        f"{type(module).__name__} has several nn.Sequential children ({names}): define configure_pipeline() "
        "returning the one to split across stages"
    )


def _converted(module: nn.Module, blocks: Optional[str]) -> tuple[str, nn.Sequential]:
    try:
        return convert(module, blocks)
    except FrontendError as err:
        raise PipelineSetupError(str(err)) from None


def check_no_outside_parameters(module: nn.Module, path: str) -> None:
    """Trainable parameters outside the pipeline would exist on every rank but train on one: refuse
    them. Frozen ones (requires_grad=False) are harmless: nothing trains them, every rank holds the
    same copy, and the gathered state dict holds them once, as a single process would."""
    outside = [n for n, p in module.named_parameters() if p.requires_grad and not (n == path or n.startswith(path + "."))]
    if outside:
        shown = ", ".join(outside[:5]) + (" ..." if len(outside) > 5 else "")
        raise PipelineSetupError(
            f"{type(module).__name__} has trainable parameters outside its pipeline '{path}': {shown}. "
            "Move them into the nn.Sequential as blocks (a first or last block), so exactly one stage owns them, "
            "or freeze them (requires_grad=False) if they are not meant to train"
        )


def set_submodule(root: nn.Module, path: str, value: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, value)


class _Handoff(BaseException):
    """Ends the user's step on a stage that is not the last: the stage's output is all it needs.
    A BaseException, so a user's ``except Exception`` around the pipeline call does not swallow it."""

    def __init__(self, value: Any):
        super().__init__()
        self.value = value


class PipelineStage(nn.Module):
    """This rank's blocks of the pipeline; called by the user's steps in place of the Sequential.

    Every block's output but the pipeline's last (block ``num_blocks - 1``, whose output goes to
    the step) must be what the runtime can send to another stage (`check_activation`), also between
    two blocks of this stage: a model is refused alike under every partition, never trained under
    one and failing under another.

    With `recompute` (the stage's entry of `PipelineConfig.recompute`, set when it is cut) each
    block keeps only its input for backward and runs its forward again there (runtime.recompute)."""

    def __init__(self, blocks: dict[int, nn.Module], chunk_bounds: dict[int, tuple[int, int]], num_blocks: int, recompute: bool = False):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)
        self.chunk_bounds = chunk_bounds
        self.num_blocks = num_blocks
        self.recompute = recompute
        self._runner: Optional[Callable[[Any], Any]] = None
        # a fine-grained switch's transition iteration: micro-batches < early run on `before` (the
        # old partition's bounds); `arrival(b)` waits for a moved-in block's weights before it runs
        self.early, self.before = 0, chunk_bounds
        self.arrival: Optional[Callable[[int], None]] = None
        self.backward_done: Optional[Callable[[int, int], None]] = None  # (micro-batch, count): the old worker's partial gradients
        self.backward_sync: Optional[Callable[[int, bool], None]] = None  # (chunk, last): before a backward (shard="full")
        # shard="full" under a split backward (zero bubble): (chunk) after each backward (whole or W) of the chunk,
        # and once its gradients are final for the step (the schedule's REDUCE, after its last W)
        self.backward_end: Optional[Callable[[int], None]] = None
        self.gradients_final: Optional[Callable[[int], None]] = None
        attach_user_names(self)  # a traced model's blocks: state dicts in the model's own names

    def blocks(self) -> dict[int, nn.Module]:
        return {int(name): block for name, block in self._modules.items()}

    def reassign(self, blocks: dict[int, nn.Module], chunk_bounds: dict[int, tuple[int, int]]) -> None:
        """Hold `blocks` now (a live switch moved some in or out), in block order."""
        for name in list(self._modules):
            del self._modules[name]
        for index in sorted(blocks):
            self.add_module(str(index), blocks[index])
        self.chunk_bounds = chunk_bounds

    def transition(self, early: int, before: dict[int, tuple[int, int]]) -> None:
        """The next run's micro-batches < `early` use the `before` bounds (0: none does)."""
        self.early, self.before = early, before

    def run_chunk(self, chunk: int, x: Any, microbatch: int = -1) -> Any:
        start, stop = (self.before if 0 <= microbatch < self.early else self.chunk_bounds)[chunk]
        split = None  # sequence parallelism: the tensor mesh the hidden state is split over (by sequence), else None
        for index in range(start, stop):
            if self.arrival is not None:
                self.arrival(index)
            block = self._modules[str(index)]
            mesh = getattr(block, "sequence_parallel", None)  # set on the blocks that run on a part of the sequence
            if mesh is not split:  # whole into such a block, whole out of a run of them: a chunk's ends stay whole
                try:
                    x = _on_hidden(x, partial(sequence_scatter, mesh=mesh) if split is None else partial(sequence_gather, mesh=split))
                except ValueError as err:
                    raise SettingError(f"sequence_parallel=True: {err}", "sequence_parallel") from None
                split = mesh
            x = run_block(block, x, self.recompute)
            if index < self.num_blocks - 1:
                check_activation(x, index, block)
        if split is not None:
            x = _on_hidden(x, partial(sequence_gather, mesh=split))
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = as_input(args, kwargs)
        for block in self._modules.values():  # a traced model's last block runs the model's call again
            if getattr(block, "frontend", None) is not None:
                block.frontend.call = as_call(x)
                break
        if self._runner is None:
            raise RuntimeError(
                "this pipeline holds only one stage's blocks on this rank and runs inside the strategy's "
                "training/validation/test/predict steps; call it from those steps"
            )
        return self._runner(x)
