"""Where a model keeps its repeated blocks: the `nn.ModuleList` of same-type modules its forward
loops over (``transformer.h`` in GPT-2, ``model.layers`` in Llama, ``bert.encoder.layer`` in BERT).

With no hint, the list holding the most parameters wins (the blocks are most of a model; an
expert list inside one block holds less than the list of blocks around it). ``blocks="a.b.c"``
names it instead, as a path from the LightningModule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn


class FrontendError(ValueError):
    """A model the front end cannot cut; the message names the module or call and the fix."""


FIX = "name the blocks with blocks='<path.to.ModuleList>' or define configure_pipeline() returning an nn.Sequential of blocks"


@dataclass(frozen=True)
class Found:
    root_path: str  # the LightningModule's child the step calls (e.g. "model")
    root: nn.Module
    list_path: str  # the blocks' ModuleList inside the root (e.g. "transformer.h")
    blocks: nn.ModuleList


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def candidate_lists(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ModuleList of two or more modules of one type, most parameters first."""
    found = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(b) for b in m}) == 1 and name
    ]
    return sorted(found, key=lambda item: (-_size(item[1]), -len(item[1]), item[0]))


def find_blocks(module: nn.Module, blocks: Optional[str] = None) -> Found:
    owner = type(module).__name__
    if blocks is not None:
        try:
            chosen = module.get_submodule(blocks)
        except AttributeError:
            raise FrontendError(f"blocks={blocks!r}: {owner} has no submodule at that path") from None
        if not isinstance(chosen, nn.ModuleList) or len(chosen) < 1:
            raise FrontendError(f"blocks={blocks!r} is a {type(chosen).__name__}, not an nn.ModuleList of blocks")
        path = blocks
    else:
        lists = candidate_lists(module)
        if not lists:
            raise FrontendError(
                f"{owner} has no pipeline: no nn.Sequential child, no configure_pipeline() and no nn.ModuleList of "
                f"repeated blocks to split across stages; {FIX}"
            )
        if len(lists) > 1 and _size(lists[0][1]) == _size(lists[1][1]) and len(lists[0][1]) == len(lists[1][1]):
            names = ", ".join(n for n, _ in lists[:4])
            raise FrontendError(f"{owner} has several lists of repeated blocks of the same size ({names}): {FIX}")
        path, chosen = lists[0]
    root_path, _, list_path = path.partition(".")
    if not list_path:
        raise FrontendError(
            f"the blocks '{path}' are a direct child of {owner}, whose own step code loops over them; keep the model in a "
            f"submodule (self.model = MyModel(...)) and call it from the step, or define configure_pipeline()"
        )
    return Found(root_path, module.get_submodule(root_path), list_path, chosen)
