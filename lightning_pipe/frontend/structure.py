"""What crosses a cut of a traced model: the tensors of a block's call (or of the last block's output),
flat, with everything else (the nesting, `None`s, flags) kept as a recorded structure.

The runtime sends a plain tuple of tensors between stages. A block call such as
``block(hidden, attention_mask=mask, position_embeddings=(cos, sin), use_cache=False)`` is flattened
with torch's pytree into leaves; the tensor leaves travel, the other leaves are constants checked on
every call (a flag that changes between steps would make stages disagree, so it is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .find import FrontendError

_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def leaves_with_names(value: Any) -> tuple[list[Any], list[str], pytree.TreeSpec]:
    pairs, spec = pytree.tree_flatten_with_path(value)
    return [leaf for _, leaf in pairs], [pytree.keystr(path) for path, _ in pairs], spec


@dataclass
class Structure:
    """The recorded structure of a call or output: `tree` with tensors at `tensor_slots` and the
    other leaves equal to `constants`."""

    tree: pytree.TreeSpec
    tensor_slots: tuple[int, ...]
    constants: dict[int, Any]
    names: tuple[str, ...]
    what: str  # for messages: "block calls", "the last block's output"

    @staticmethod
    def of(value: Any, what: str) -> "Structure":
        leaves, names, tree = leaves_with_names(value)
        constants = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                continue
            if not isinstance(leaf, _CONSTANT_TYPES):
                raise FrontendError(
                    f"{what} pass a {type(leaf).__name__} ({names[i] or 'the value'}), which cannot travel between stages: "
                    "only tensors, tuples, lists, dicts, None and plain flags can; turn it off (e.g. use_cache=False) or "
                    "define configure_pipeline()"
                )
            constants[i] = leaf
        slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor))
        return Structure(tree, slots, constants, tuple(names), what)

    def same_as(self, other: "Structure") -> bool:
        return self.tree == other.tree and self.tensor_slots == other.tensor_slots and self.constants == other.constants

    def flat(self, value: Any) -> tuple[Tensor, ...]:
        """The tensors of `value`, after checking it has the recorded structure."""
        leaves, names, tree = leaves_with_names(value)
        if tree != self.tree or any(not isinstance(leaves[i], Tensor) for i in self.tensor_slots):
            changed = [self.names[i] for i in self.tensor_slots if i < len(leaves) and not isinstance(leaves[i], Tensor)]
            changed += [names[i] for i in range(len(leaves)) if isinstance(leaves[i], Tensor) and i not in self.tensor_slots]
            raise FrontendError(
                f"the model's {self.what} changed structure since it was traced ({', '.join(changed) or 'their nesting'} "
                "changed between a tensor and None): what crosses a stage must have one structure every step. A model that "
                "drops its attention mask when a batch has no padding does this: pass batches that always carry padding, or "
                "build the mask in the step and pass it the same way every time"
            )
        for i, constant in self.constants.items():
            if leaves[i] != constant:
                raise FrontendError(
                    f"the model's {self.what} changed {self.names[i] or 'a flag'} from {constant!r} to {leaves[i]!r} since it was "
                    "traced; every step must call the model the same way"
                )
        return tuple(leaves[i] for i in self.tensor_slots)

    def build(self, tensors: Any) -> Any:
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        leaves: list[Any] = [None] * self.tree.num_leaves
        for i, c in self.constants.items():
            leaves[i] = c
        for i, t in zip(self.tensor_slots, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.tree)
