"""The pipeline's input when the user's step calls the model with keywords or several arguments.

``self.model(input_ids=ids, labels=ids)`` reaches the pipeline as a `Call`; a single positional
argument (``self.seq(x)``) stays itself, so a plain `nn.Sequential` sees exactly what it always did.
A `Call` is block 0's input only: it never travels between stages (every stage holds the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Call:
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def apply(self, fn: Callable[[Any], Any]) -> "Call":
        """A copy with `fn` applied to every argument (e.g. a move to a device)."""
        return Call(tuple(fn(a) for a in self.args), {k: fn(v) for k, v in self.kwargs.items()})


def as_input(args: tuple, kwargs: dict) -> Any:
    """The pipeline input of a call ``pipeline(*args, **kwargs)``."""
    if len(args) == 1 and not kwargs:
        return args[0]
    return Call(tuple(args), dict(kwargs))


def as_call(x: Any) -> Call:
    return x if isinstance(x, Call) else Call((x,), {})
