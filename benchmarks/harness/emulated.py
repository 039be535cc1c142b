"""Emulated devices: blocks that occupy their rank for a set time without using a core.

A GPU leaves its host idle while it computes; a block here sleeps for its time instead, so many
ranks fit on a 2-core machine and a rank can be made slower (`set_slowdown`, a shared device) while
the real runtime, p2p and schedules run around it. A small Linear keeps the arithmetic real, so a
run still equals one process bit for bit. Used by tests and benchmarks; figures measured with it
say so.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

_SLOWDOWN = [1.0]  # this process's factor on every emulated block's time
_DEVICE: list[Any] = [None]  # an open lock file: the emulated device this process shares with others


def set_slowdown(factor: float) -> None:
    """From now on, this process's emulated blocks take `factor` times their time."""
    _SLOWDOWN[0] = float(factor)


def share_device(path: str) -> None:
    """From now on, this process's emulated blocks run on the device named by the lock file `path`:
    processes naming one file run their blocks one at a time, as kernels of several processes on
    one GPU do (AvgPipe's N pipelines on K devices)."""
    _DEVICE[0] = open(path, "a")


def _occupy(seconds: float) -> None:
    if _DEVICE[0] is None:
        time.sleep(seconds)
        return
    import fcntl  # POSIX: only runs that share an emulated device need it

    fcntl.flock(_DEVICE[0], fcntl.LOCK_EX)
    try:
        time.sleep(seconds)
    finally:
        fcntl.flock(_DEVICE[0], fcntl.LOCK_UN)


def slowdown() -> float:
    return _SLOWDOWN[0]


class _Occupy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        _occupy(forward_s * _SLOWDOWN[0])
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _occupy(ctx.backward_s * _SLOWDOWN[0])
        return grad, None, None


class EmulatedBlock(nn.Module):
    """``x + tanh(linear(x))``, then `forward_s` / `backward_s` seconds of emulated device time."""

    def __init__(self, width: int, forward_s: float, backward_s: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Occupy.apply(x + torch.tanh(self.linear(x)), self.forward_s, self.backward_s)


def emulated_model(
    blocks: int, width: int, forward_s: float, backward_s: float, seed: int = 0, paced: bool = False, gain: float = 1.0
) -> nn.Sequential:
    """`blocks` EmulatedBlocks (`paced`: PacedBlocks) in float64 (exact comparisons to 1e-10),
    weights from `seed`: the same model in every process, whatever its emulated times (0 for a
    one-process reference). `gain` scales the initial weights: a deep stack of residual blocks at
    gain 1 is so ill-conditioned that splitting a batch into micro-batches alone (one process,
    float64) moves the weights by 1e-9 at 64 blocks and 1e-5 at 128 after 5 SGD steps, which
    would hide a real difference; 16 / blocks keeps deep stacks at rounding level (< 1e-15)."""
    g = torch.Generator().manual_seed(seed)
    kind = PacedBlock if paced else EmulatedBlock
    model = nn.Sequential(*[kind(width, forward_s, backward_s) for _ in range(blocks)]).double()
    if paced:
        for i, block in enumerate(model):
            block.index = i
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64) - 0.5) * (2 * gain / width**0.5))
    return model


def fine_timer_slack(nanoseconds: int = 1000) -> bool:
    """Ask Linux to wake this process's sleeps within `nanoseconds` (the default slack is 50 us,
    added to nearly every sleep): an emulated block then occupies its rank for closer to its time.
    Returns whether it took effect (False off Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(29, nanoseconds, 0, 0, 0) == 0  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


# A device runs a chunk's kernels back to back while its host queues the next ones, so the host's
# time between two blocks of one chunk is hidden. PacedBlocks do the same: a block that follows its
# model neighbour on this process within CHAIN_GAP of that neighbour's deadline starts at the
# deadline (its own arithmetic and call overhead fall inside its time, up to CHAIN_GAP late). The
# clock is per process (each rank is one); a wait for a message, another micro-batch or the other
# direction breaks the chain, so time outside a chunk's blocks is still the runtime's and measured.
CHAIN_GAP = 1e-3
_CHAIN = {"after": None, "deadline": 0.0}  # the last paced block's ("f" / "b", index) and its deadline


def _chained(step: tuple, now: float) -> float:
    """When a block doing `step` starts: its predecessor's deadline if it follows it closely, else now."""
    if _CHAIN["after"] == step and now - _CHAIN["deadline"] < CHAIN_GAP:
        return _CHAIN["deadline"]
    return now


def _done(step: tuple, deadline: float) -> None:
    _CHAIN["after"], _CHAIN["deadline"] = step, deadline


class _Stamp:
    """One call of a PacedBlock: when its forward started, when its backward started, and where it sits."""

    __slots__ = ("forward_s", "backward_s", "start", "back", "has_tail", "index")


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _PaceStart(torch.autograd.Function):
    """Identity at the block's input: its backward runs last in the block and ends the block's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stamp: _Stamp) -> torch.Tensor:
        ctx.stamp = stamp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        stamp = ctx.stamp
        _sleep_until(stamp.back + stamp.backward_s)
        _done(("b", stamp.index), stamp.back + stamp.backward_s)
        return grad, None


class _PaceEnd(torch.autograd.Function):
    """Identity at the block's output: its forward ends the block's forward, its backward starts the clock."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, stamp: _Stamp) -> torch.Tensor:
        ctx.stamp = stamp
        _sleep_until(stamp.start + stamp.forward_s)
        _done(("f", stamp.index), stamp.start + stamp.forward_s)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        stamp = ctx.stamp
        stamp.back = _chained(("b", stamp.index + 1), time.perf_counter())
        if not stamp.has_tail:  # no input gradient (the model's first block): the whole time here
            _sleep_until(stamp.back + stamp.backward_s)
            _done(("b", stamp.index), stamp.back + stamp.backward_s)
        return grad, None


class PacedBlock(EmulatedBlock):
    """An EmulatedBlock that occupies its rank for `forward_s` / `backward_s` in all, its own
    arithmetic (the Linear, autograd) included: it sleeps until its start plus its time, rather
    than its time after the arithmetic. So a block is as long as its emulated time on any machine,
    as a device kernel's time includes its arithmetic (as long as the arithmetic is shorter).
    With an `index` (its place in the model; `emulated_model` sets it) consecutive blocks chain
    (CHAIN_GAP above): a chunk of k blocks lasts the sum of their times, as on a device."""

    index: int = -2  # not placed: never chains

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stamp = _Stamp()
        stamp.index = self.index
        stamp.start = _chained(("f", self.index - 1), time.perf_counter()) if self.index >= 0 else time.perf_counter()
        stamp.forward_s, stamp.backward_s = self.forward_s * _SLOWDOWN[0], self.backward_s * _SLOWDOWN[0]
        stamp.has_tail = torch.is_grad_enabled() and x.requires_grad
        if stamp.has_tail:
            x = _PaceStart.apply(x, stamp)
        return _PaceEnd.apply(x + torch.tanh(self.linear(x)), stamp)
