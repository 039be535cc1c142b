"""Per-block profile of a pipeline: the AutoPipe paper's "model configs".

For each block: forward and backward time (median of repeats after warm-up, on the device and at
the micro-batch size training uses), output activation bytes, parameter bytes and peak memory.
Saved as JSON keyed by model, micro-batch size, dtype and device, so a profile is measured once
and reused; `Profile.synthetic` builds one from given costs. `Profile.costs()` turns it into the
simulator's `CostModel`. Nothing here knows about Lightning.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .simulator import CostModel


@dataclass
class Profile:
    model: str
    microbatch_size: int
    dtype: str
    device: str
    forward: list[float]  # seconds per block
    backward: list[float]
    activation_bytes: list[float]
    param_bytes: list[float]
    peak_memory: list[float] = field(default_factory=list)  # bytes allocated at the block's peak (CUDA), else 0
    block_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.forward)
        for name in ("backward", "activation_bytes", "param_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"profile: {name} has {len(getattr(self, name))} entries for {n} blocks")
        for name in ("forward", "backward", "activation_bytes", "param_bytes", "peak_memory"):
            bad = [v for v in getattr(self, name) if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
            if bad:
                raise ValueError(f"profile: {name} must hold finite numbers >= 0, got {bad[:3]}")

    @property
    def num_blocks(self) -> int:
        return len(self.forward)

    @property
    def key(self) -> str:
        return f"{self.model}-mbs{self.microbatch_size}-{self.dtype}-{self.device}"

    def check_blocks(self, num_blocks: int) -> None:
        if self.num_blocks != num_blocks:
            raise ValueError(f"the profile {self.key} has {self.num_blocks} blocks but the model has {num_blocks}")

    def costs(self, bandwidth: float = math.inf, latency: float = 0.0, slowdown: Sequence[float] = ()) -> CostModel:
        return CostModel(tuple(self.forward), tuple(self.backward), tuple(self.activation_bytes),
                         tuple(self.param_bytes), bandwidth, latency, tuple(slowdown))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)  # never a half-written profile
        return path

    @staticmethod
    def load(path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"profile {path}: not valid JSON ({err})") from None
        missing = {"model", "microbatch_size", "dtype", "device", "forward", "backward", "activation_bytes", "param_bytes"} - set(data)
        if missing:
            raise ValueError(f"profile {path}: missing fields {sorted(missing)}")
        return Profile(**data)

    @staticmethod
    def synthetic(forward: Sequence[float], backward: Optional[Sequence[float]] = None, activation_bytes: float | Sequence[float] = 0.0,
                  param_bytes: float | Sequence[float] = 0.0, model: str = "synthetic", microbatch_size: int = 1) -> "Profile":
        n = len(forward)
        backward = list(backward) if backward is not None else [2.0 * f for f in forward]
        as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [float(v)] * n  # noqa: E731
        return Profile(model, microbatch_size, "synthetic", "synthetic", list(forward), backward, as_list(activation_bytes), as_list(param_bytes))


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _float_outputs(value: Any) -> list[Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, Tensor) and t.requires_grad]


def _leaf(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_leaf(v) for v in value)
    return value


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_blocks(
    blocks: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    model: str = "model",
    repeats: int = 5,
    warmup: int = 2,
    indices: Optional[Sequence[int]] = None,
    context: Callable[[], Any] = torch.enable_grad,
) -> dict[int, dict[str, float]]:
    """Measure blocks ``indices`` (all by default) on `device` with `sample` as block 0's input.

    Blocks before the first measured one are run forward only to make its input. Each block is
    moved to the device while it is measured and back afterwards, so a model larger than one
    device can be profiled. Returns ``{index: {forward, backward, activation_bytes, param_bytes, peak_memory}}``.
    """
    wanted = set(range(len(blocks)) if indices is None else indices)
    results: dict[int, dict[str, float]] = {}
    x = sample
    for i, block in enumerate(blocks):
        if i > max(wanted, default=-1):
            break
        home = next((p.device for p in block.parameters()), device)
        block.to(device)
        x = _to(x, device)
        if i in wanted:
            with context():
                results[i] = _measure(block, x, device, repeats, warmup)
        with torch.no_grad(), context():
            x = block(x)
        block.to(home)
    return results


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def _measure(block: nn.Module, x: Any, device: torch.device, repeats: int, warmup: int) -> dict[str, float]:
    fwd, bwd = [], []
    out = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for r in range(warmup + repeats):
        inp = _leaf(x)
        _sync(device)
        t0 = time.perf_counter()
        out = block(inp)
        _sync(device)
        t1 = time.perf_counter()
        outs = _float_outputs(out)
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        _sync(device)
        t2 = time.perf_counter()
        block.zero_grad(set_to_none=True)
        if r >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    return {"forward": statistics.median(fwd), "backward": statistics.median(bwd),
            "activation_bytes": float(_nbytes(out)), "param_bytes": float(params), "peak_memory": peak}
