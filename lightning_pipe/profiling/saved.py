"""SavedBytes: the bytes autograd saves for backward inside a block (the tuner's and the sized
profile's data bytes)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch


class SavedBytes:
    """Within the block: the bytes autograd saves for backward. A storage counts once while some
    saved tensor still holds it: in 1F1B a micro-batch's backward frees its saved tensors and the
    next forward reuses their addresses, which are new bytes (an address-only key undercounted them).
    Storages in `exclude` (e.g. the stage's parameters, counted elsewhere) are not counted."""

    def __init__(self, exclude: Any = ()) -> None:
        self.total = 0
        self._live: dict[int, int] = {}  # storage address -> saved tensors still holding it
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._hooks: Optional[Any] = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude:
            return t
        if ptr not in self._live:
            self.total += storage.nbytes()
            self._live[ptr] = 0
        self._live[ptr] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        left = self._live.get(ptr, 0) - 1
        if left > 0:
            self._live[ptr] = left
        else:
            self._live.pop(ptr, None)

    def __enter__(self) -> "SavedBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
