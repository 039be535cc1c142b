"""Measure a `SizedProfile` (PipeDream-2BW's cost functions, `planning/sized.py`) on a device.

For each micro-batch size and each block: forward and backward time (`profile_blocks`' chain mode,
2 micro-batches in flight, as `autoplan.profile_pipeline` measures), the backward time when the
block's forward is re-run inside it (the same chain, every block under
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``: measured, not the paper's
4/3), the bytes autograd saves for the block's backward (`SavedBytes` during one forward, each
storage once, the block's parameters and buffers left out), and the bytes of its input (what
recomputation keeps instead) and its output (what crosses a stage boundary).

Blocks are on the device only while measured: the timed chain holds all blocks at once (as
`profile_blocks`' chain mode does), the byte count one block at a time. The global RNG states
(the device's too) and the blocks' buffers (e.g. BatchNorm statistics) and gradients are as
before afterwards. Nothing here knows about Lightning.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..planning.sized import SizedProfile
from .blocks import _leaf, _nbytes, _to, check_activation, profile_blocks
from .saved import SavedBytes


class _Recomputed(nn.Module):
    """A block whose forward autograd re-runs inside its backward (activation recomputation):
    only the block's input is kept from the forward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False)


def check_sizes(sizes: Sequence[int]) -> list[int]:
    """`sizes` as a list of ints, or a ValueError naming `sizes`: ascending distinct integers >= 1."""
    try:
        values = list(sizes)
    except TypeError:
        raise ValueError(f"sizes must be a sequence of distinct integers >= 1 in ascending order, got {sizes!r}") from None
    if (
        not values
        or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in values)
        or any(a >= b for a, b in zip(values, values[1:]))
    ):
        raise ValueError(f"sizes must be a non-empty sequence of distinct integers >= 1 in ascending order, got {values!r}")
    return [int(s) for s in values]


def _home(block: nn.Module, device: torch.device) -> torch.device:
    """Where the block lives (its first parameter, else its first buffer; `device` if it has neither)."""
    for t in (*block.parameters(), *block.buffers()):
        return t.device
    return device


def _bytes_pass(
    blocks: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    context: Callable[[], Any],
    loss_fn: Optional[Callable[[Any], Tensor]],
) -> tuple[list[float], list[float], list[float]]:
    """Per block, one forward: (saved_bytes, input_bytes, output_bytes). Each block gets its input
    as its own leaf (a received micro-batch's fresh buffer), so the input's storage counts its own
    bytes. The last block's saved bytes include its loss's (`loss_fn`: the last stage runs both)."""
    saved, inputs, outputs = [], [], []
    x = sample
    for i, block in enumerate(blocks):
        home = _home(block, device)
        block.to(device)
        inp = _leaf(_to(x, device), copy=True)
        with context(), SavedBytes(exclude=[*block.parameters(), *block.buffers()]) as count:
            out = block(inp)
            loss = loss_fn(out) if loss_fn is not None and i == len(blocks) - 1 else None
        saved.append(float(count.total))
        inputs.append(float(_nbytes(inp)))
        outputs.append(float(_nbytes(out)))
        if i < len(blocks) - 1:
            check_activation(out, i, block)
        x = _leaf(out)  # cut from the graph: this block's saved tensors go with `out` / `loss`
        del out, loss, inp, count
        block.to(home)
    return saved, inputs, outputs


def profile_sizes(
    blocks: Sequence[nn.Module],
    sample_of: Callable[[int], Any],
    sizes: Sequence[int],
    device: torch.device | str,
    model: str = "model",
    repeats: int = 3,
    warmup: int = 1,
    loss_fn_of: Optional[Callable[[int], Callable[[Any], Tensor]]] = None,
    context: Callable[[], Any] = torch.enable_grad,
) -> SizedProfile:
    """Measure every block of `blocks` at each micro-batch size of `sizes` on `device`.

    ``sample_of(b)``: block 0's input for a micro-batch of b samples. ``loss_fn_of(b)`` (optional):
    the loss closure for that size (as `profile_blocks`' ``loss_fn``): the last block's times then
    include the loss, and its saved bytes the loss's. ``repeats`` / ``warmup``: rounds of the
    timed chain (median of `repeats`). ``context``: what every forward runs under (e.g. autocast).

    Returns a `SizedProfile` with `source="measured"`; times in seconds, sizes in bytes.
    """
    sizes = check_sizes(sizes)
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    blocks = list(blocks)
    if not blocks:
        raise ValueError("profile_sizes: no blocks to measure")
    device = torch.device(device)
    recomputed = [_Recomputed(b) for b in blocks]
    params = list({id(p): p for b in blocks for p in b.parameters()}.values())
    grads = [p.grad for p in params]
    buffers = [{name: buf.detach().clone() for name, buf in b.named_buffers()} for b in blocks]
    accelerator = device.type != "cpu"
    rows: dict[str, list[list[float]]] = {
        k: [] for k in ("forward", "backward", "recompute_backward", "saved_bytes", "input_bytes", "output_bytes")
    }
    param_bytes: list[float] = []
    try:
        for p in params:  # else the first round's backward would add into the caller's gradients
            p.grad = None
        with torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type if accelerator else None):
            for b in sizes:
                sample = sample_of(b)
                loss_fn = loss_fn_of(b) if loss_fn_of is not None else None
                # whole backwards only: the 2BW planner reads no W, and a W under recomputation would rerun the forward
                timing = dict(
                    model=model, repeats=repeats, warmup=warmup, context=context, loss_fn=loss_fn, inflight=2, split_backward=False
                )
                plain = profile_blocks(blocks, sample, device, **timing)
                again = profile_blocks(recomputed, sample, device, **timing)
                saved, inputs, outputs = _bytes_pass(blocks, sample, device, context, loss_fn)
                n = range(len(blocks))
                rows["forward"].append([plain[i]["forward"] for i in n])
                rows["backward"].append([plain[i]["backward"] for i in n])
                rows["recompute_backward"].append([again[i]["backward"] for i in n])
                rows["saved_bytes"].append(saved)
                rows["input_bytes"].append(inputs)
                rows["output_bytes"].append(outputs)
                param_bytes = [plain[i]["param_bytes"] for i in n]
    finally:
        with torch.no_grad():
            for b, kept in zip(blocks, buffers):  # e.g. BatchNorm statistics: as if never run; by name, as
                for name, buf in b.named_buffers():  # moving a block to a device and back replaces its buffers
                    buf.copy_(kept[name])
        for p, g in zip(params, grads):  # profile_blocks clears gradients: the caller's come back
            p.grad = g
    return SizedProfile(model, sizes, param_bytes=param_bytes, block_names=[type(b).__name__ for b in blocks], **rows)
