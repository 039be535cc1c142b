"""CostModel: what the simulator charges: per-block compute, messages on the link, shared cores.

Measured by `lightning_pipe.profiling` (blocks, message costs) or written analytically
(`planning/flops.py`); read by the simulator and every planner.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CostModel:
    """Per-block costs of one micro-batch, and the links between ranks.

    ``forward[i]`` / ``backward[i]``: seconds for block i; ``activation_bytes[i]``: bytes of block i's
    output (what crosses a stage boundary after it); ``param_bytes[i]``: its weights. Communication
    takes ``latency + bytes / bandwidth``; ``slowdown[r]`` multiplies rank r's compute times (a
    shared or slower device). A zero-bubble schedule splits a backward in BI and W: ``weight[i]`` and
    ``backward_input[i]`` are block i's W and BI seconds measured that way (they may sum to more than
    ``backward[i]``: the split has costs of its own); ``weight`` alone: W, and BI the rest of the
    backward; neither: half the backward each.

    ``cores``: the ranks share this many processors (e.g. 4 CPU processes on 2 cores). While k
    ranks compute at once, each progresses at min(1, cores / k) of its profiled speed (processor
    sharing); a rank waiting for a message uses no core. None (the default), or at least as many
    cores as ranks: every rank has a device of its own.

    Messages (measured by `messages.measure_messages`): ``send_overhead`` / ``recv_overhead`` are
    seconds of a rank's own thread per message it sends / receives (gloo copies and enqueues on the
    caller's thread; NCCL only launches a kernel), taken where the action stands in its list, so
    the next compute starts that much later; ``handoff_delay`` is the mean time, beyond ``latency +
    bytes / bandwidth``, until a receiver that waits for a message runs with it (a process or
    thread woken up). All three default to 0: the link model alone.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation_bytes: tuple[float, ...] = ()
    param_bytes: tuple[float, ...] = ()
    bandwidth: float = math.inf  # bytes / s
    latency: float = 0.0  # s
    slowdown: tuple[float, ...] = ()
    cores: Optional[int] = None
    send_overhead: float = 0.0  # s of the sender's thread per message
    recv_overhead: float = 0.0  # s of the receiver's thread per message
    handoff_delay: float = 0.0  # s, mean, added to every message's arrival
    weight: tuple[float, ...] = ()  # s of block i's weight gradients (W) in a split backward; empty: half the backward
    backward_input: tuple[float, ...] = ()  # s of its input gradient (BI) in a split backward; empty: backward - weight
    runtime_bytes: float = 0.0  # bytes every rank's process holds besides the model (profiling/runtime.py); 0: not measured

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0 or len(self.backward) != n:
            raise ValueError(f"costs: forward ({n}) and backward ({len(self.backward)}) need one time per block")
        for name in ("activation_bytes", "param_bytes", "weight", "backward_input"):
            values = getattr(self, name)
            if values and len(values) != n:
                raise ValueError(f"costs: {name} has {len(values)} entries for {n} blocks")
        if self.backward_input and not self.weight:
            raise ValueError("costs: backward_input (BI times) comes with weight (W times), measured together")
        if not self.backward_input and any(w > b for w, b in zip(self.weight, self.backward)):
            raise ValueError("costs: without BI times, a block's W is a part of its backward: weight[i] <= backward[i]")
        for name in ("forward", "backward", "activation_bytes", "param_bytes", "weight", "backward_input"):
            bad = [v for v in getattr(self, name) if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
            if bad:
                raise ValueError(f"costs: {name} must hold finite numbers >= 0, got {bad[:3]}")
        if not self.bandwidth > 0 or self.latency < 0 or any(not s > 0 for s in self.slowdown):
            raise ValueError("costs: bandwidth must be > 0, latency >= 0 and every slowdown > 0")
        if not (isinstance(self.runtime_bytes, (int, float)) and math.isfinite(self.runtime_bytes) and self.runtime_bytes >= 0):
            raise ValueError(f"costs: runtime_bytes must be a finite number of bytes >= 0, got {self.runtime_bytes!r}")
        for name in ("send_overhead", "recv_overhead", "handoff_delay"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"costs: {name} must be a finite number of seconds >= 0, got {value!r}")
        if self.cores is not None and not (isinstance(self.cores, int) and self.cores >= 1):
            raise ValueError(f"costs: cores must be None or an integer >= 1, got {self.cores!r}")

    @property
    def num_blocks(self) -> int:
        return len(self.forward)

    @functools.cached_property
    def _ranges(self) -> dict[tuple[int, int], tuple[float, float, float]]:
        """(first, stop) block range -> its forward sum, backward sum and boundary message (`chunk_costs`)."""
        return {}

    @staticmethod
    def uniform(blocks: int, forward: float, backward: float, **kwargs) -> "CostModel":
        return CostModel((forward,) * blocks, (backward,) * blocks, **kwargs)

    @property
    def fixed_comm(self) -> float:
        """A message's time that does not grow with its size: latency and the hand-off delay."""
        return self.latency + self.handoff_delay if self.handoff_delay else self.latency

    def comm_time(self, block: int) -> float:
        size = self.activation_bytes[block] if self.activation_bytes else 0.0
        return self.fixed_comm + (size / self.bandwidth if size else 0.0)

    @property
    def has_message_overheads(self) -> bool:
        return bool(self.send_overhead or self.recv_overhead)

    def message_gap(self, sends: int, recvs: int) -> float:
        """Seconds a rank's thread spends on `sends` sends and `recvs` receives between two computes.
        One expression of the counts, so `simulate` and the planners' replay add the same floats."""
        return sends * self.send_overhead + recvs * self.recv_overhead

    def factor(self, rank: int) -> float:
        return self.slowdown[rank] if rank < len(self.slowdown) else 1.0

    def shares_cores(self, ranks: int) -> bool:
        """Whether `ranks` ranks computing at once would have to share processors."""
        return self.cores is not None and self.cores < ranks
