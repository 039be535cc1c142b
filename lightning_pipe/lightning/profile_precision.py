"""Profile as the run computes: the blocks in the run's precision while they are timed.

The strategy profiles and plans before the precision plugin converts the stage (`convert_module`
runs on the cut), so a `bf16-true` run would otherwise be planned on float32 times and bytes (twice
its weights' memory), and a mixed-precision run without its autocast. Here the whole pipeline is
converted in place for the profile and its tensors get their dtypes back afterwards. The values a
run trains from are unchanged: a value converted there and back holds exactly what the run's own
conversion to that dtype gives, and that conversion follows (the same plugin).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn


@contextmanager
def run_precision(precision: Optional[Any], pipeline: nn.Module) -> Iterator[Callable[[Any], Any]]:
    """`pipeline` converted by `precision` (Lightning's plugin; None: as it is) inside the plugin's
    forward context; yields the plugin's `convert_input` for the sample batch."""
    if precision is None:
        yield lambda data: data
        return
    held = [(t, t.dtype) for t in (*pipeline.parameters(), *pipeline.buffers())]
    precision.convert_module(pipeline)
    try:
        with precision.forward_context():
            yield precision.convert_input
    finally:
        with torch.no_grad():
            for t, dtype in held:
                if t.dtype != dtype:
                    t.data = t.data.to(dtype)
