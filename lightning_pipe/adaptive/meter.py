"""What the monitor measures of one step on one rank (AutoPipe-RL Table 1's dynamic metrics).

The executor calls the meter around each compute and message (`Executor.meter`); nothing is
synchronised during the step. Compute time is host time on CPU and CUDA events on a GPU (read
once, after the step, when the loss has already synchronised the device). Messages are stamped
when the sender issues them and when the receiver's wait returns; a receive whose wait blocked
arrived at that moment, so (arrival - issue) is that message's transfer time (`monitor.py`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

# A wait shorter than this found the data already there: its stamp says when it was read, not when it arrived.
BLOCKED = 100e-6


class StepMeter:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.forward_s = self.backward_s = 0.0
        self._events: list[tuple[Any, Any, bool]] = []
        self.sends: dict[int, tuple[float, int]] = {}  # send action -> (issued, bytes)
        self.recvs: dict[int, tuple[float, bool, int]] = {}  # receive action -> (wait returned, blocked, bytes)
        self.started = time.perf_counter()

    # ---- called by the executor ------------------------------------------------------------------
    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token: Any, forward: bool) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((token, end, forward))
            return
        spent = time.perf_counter() - token
        if forward:
            self.forward_s += spent
        else:
            self.backward_s += spent

    def sent(self, owners: list[int], ops: list[Any]) -> None:
        now = time.perf_counter()
        for j, op in zip(owners, ops):
            if op.op is dist.isend:
                issued, size = self.sends.get(j, (now, 0))
                self.sends[j] = (issued, size + op.tensor.numel() * op.tensor.element_size())

    def waiting(self, pending: Any) -> None:
        before = time.perf_counter()
        buffers = pending.value()
        now = time.perf_counter()
        self.recvs[pending.action] = (now, now - before > BLOCKED, sum(t.numel() * t.element_size() for t in buffers))

    # ---- after the step ------------------------------------------------------------------------
    def finish(self) -> tuple[float, float, float]:
        """(forward, backward, wall) seconds of the step."""
        wall = time.perf_counter() - self.started
        if self._events:
            self._events[-1][1].synchronize()
            for begin, end, forward in self._events:
                ms = begin.elapsed_time(end) / 1e3
                if forward:
                    self.forward_s += ms
                else:
                    self.backward_s += ms
            self._events = []
        return self.forward_s, self.backward_s, wall
