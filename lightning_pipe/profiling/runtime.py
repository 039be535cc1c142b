"""runtime_bytes: the memory a training process holds besides the model's state.

A stage's weights, gradients, optimizer state and activations are what the planners count; a
process also holds its runtime: on a host, the interpreter and the libraries it imported (Python,
torch, Lightning: about 0.3 GiB on CPU, measured in docs/results/memory.md), on a GPU the CUDA context and
the libraries' workspaces outside torch's caching allocator (typically 0.3-1 GiB). On small stages
that term decides whether a device fits, so the memory model adds it to every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch


def _anonymous_bytes() -> float:
    """This process's anonymous resident memory (Linux /proc); 0 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def _tensor_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> float:
    """Bytes of the distinct storages among `tensors` that live on `device`'s type (not meta)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device.type and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return float(sum(seen.values()))


def runtime_bytes(device: torch.device, modules: Iterable[Any] = ()) -> float:
    """What this process holds on `device` besides the tensors of `modules` (the model, however much
    of it exists yet): on CUDA the device memory in use outside torch's caching allocator (the
    context and library workspaces; on a shared GPU, other processes' memory too, which this one
    cannot use either); on a host the process's anonymous memory less the modules' tensors there."""
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(max(0, (total - free) - torch.cuda.memory_reserved(device)))
    if device.type != "cpu":  # other accelerators: no portable reading; the model counts without it
        return 0.0
    return max(0.0, _anonymous_bytes() - _tensor_bytes(tensors, device))
