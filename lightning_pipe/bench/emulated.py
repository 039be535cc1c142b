"""Emulated devices: blocks that occupy their rank for a set time without using a core.

A GPU leaves its host idle while it computes; a block here sleeps for its time instead, so many
ranks fit on a 2-core machine and a rank can be made slower (`set_slowdown`, a shared device) while
the real runtime, p2p and schedules run around it. A small Linear keeps the arithmetic real, so a
run still equals one process bit for bit. Used by tests and benchmarks; figures measured with it
say so.
"""

from __future__ import annotations

import time

import torch
from torch import nn

_SLOWDOWN = [1.0]  # this process's factor on every emulated block's time


def set_slowdown(factor: float) -> None:
    """From now on, this process's emulated blocks take `factor` times their time."""
    _SLOWDOWN[0] = float(factor)


def slowdown() -> float:
    return _SLOWDOWN[0]


class _Occupy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s * _SLOWDOWN[0])
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s * _SLOWDOWN[0])
        return grad, None, None


class EmulatedBlock(nn.Module):
    """``x + tanh(linear(x))``, then `forward_s` / `backward_s` seconds of emulated device time."""

    def __init__(self, width: int, forward_s: float, backward_s: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Occupy.apply(x + torch.tanh(self.linear(x)), self.forward_s, self.backward_s)
