"""Precision plugins that know the pipeline: global-norm clipping and fp16 overflow agreement.

As Lightning's FSDP strategy runs with its own `FSDPPrecision`, the strategy turns whatever
precision plugin the Trainer chose (32-true, 64-true, 16/bf16-true, 16/bf16-mixed, or a user's
own) into a subclass of it with `PipelinePrecisionMixin`, keeping the plugin's state. The mixin
overrides two public hooks:

- `clip_grad_by_norm`: the norm over every stage's gradients, so all stages scale by one factor
  (the base plugin would clip each stage by its own norm);
- `optimizer_step`: with a GradScaler, the ranks agree on an overflow before the scaler unscales,
  so every stage skips the same steps (a stage alone would skip on its own overflows only).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from .gradients import StageGradients


class PipelinePrecisionMixin:
    pipeline: Optional[StageGradients] = None  # bound by the strategy once the model is cut

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.pipeline is None:  # not cut (e.g. a single-process run): the plugin's own clipping
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        self.pipeline.clip_grad_norm(self.main_params(optimizer), float(clip_val))  # type: ignore[attr-defined]

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None or self.pipeline is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]

        def agreed_closure() -> Any:
            result = closure()
            self.pipeline.agree_on_overflow(self.main_params(optimizer))  # type: ignore[union-attr, attr-defined]
            return result

        return super().optimizer_step(optimizer, model=model, closure=agreed_closure, **kwargs)  # type: ignore[misc]

    def __reduce__(self) -> tuple:
        # the class is made at run time, so pickle (spawn) the plain plugin's class and state instead
        state = {k: v for k, v in self.__dict__.items() if k != "pipeline"}
        return _rebuild, (type(self).__mro__[2], state)


@lru_cache(maxsize=None)
def _pipeline_class(base: type) -> type:
    return type(f"Pipeline{base.__name__}", (PipelinePrecisionMixin, base), {"__module__": __name__})


def _rebuild(base: type, state: dict) -> Precision:
    converted = _pipeline_class(base).__new__(_pipeline_class(base))
    converted.__dict__.update(state)
    return converted


def pipeline_precision(plugin: Optional[Precision]) -> Optional[Precision]:
    """`plugin` as its pipeline-aware subclass, with the same state (scaler, dtype, device)."""
    if plugin is None or isinstance(plugin, PipelinePrecisionMixin):
        return plugin
    if not isinstance(plugin, Precision):
        raise TypeError(f"precision_plugin={plugin!r}: expected a lightning.pytorch.plugins.precision.Precision")
    return _rebuild(type(plugin), dict(plugin.__dict__))
