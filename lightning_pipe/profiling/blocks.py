"""Per-block profile of a pipeline: the AutoPipe paper's "model configs".

For each block: forward and backward time (median of repeats after warm-up, on the device and at
the micro-batch size training uses), the part of the backward that computes weight gradients (a
zero-bubble schedule's W; the rest is its BI), output activation bytes, parameter bytes and peak memory.
Saved as JSON keyed by model, micro-batch size, dtype and device, so a profile is measured once
and reused; `Profile.synthetic` builds one from given costs. `Profile.costs()` turns it into the
simulator's `CostModel`. `check_activation` is the runtime's rule for what passes between blocks,
applied by the profiler and by the stage alike. Nothing here knows about Lightning.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..runtime.call import Call
from ..runtime.p2p import _DTYPES
from ..runtime.split_backward import backward_input, backward_weight
from ..simulation.costs import CostModel
from .messages import MessageCosts


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
    messages: Optional[dict] = None  # messages.MessageCosts measured on the ranks, as a dict; None: not measured
    weight: list[float] = field(default_factory=list)  # seconds of W (weight gradients) in a split backward; []: not measured
    backward_input: list[float] = field(default_factory=list)  # seconds of BI (input gradient) in a split backward
    runtime_bytes: float = 0.0  # bytes a rank's process holds besides the model, the largest rank's (runtime.py); 0: not measured

    def __post_init__(self) -> None:
        n = len(self.forward)
        for name in (
            ("backward", "activation_bytes", "param_bytes")
            + (("weight",) if self.weight else ())
            + (("backward_input",) if self.backward_input else ())
        ):
            if len(getattr(self, name)) != n:
                raise ValueError(f"profile: {name} has {len(getattr(self, name))} entries for {n} blocks")
        for name in ("forward", "backward", "activation_bytes", "param_bytes", "peak_memory", "weight", "backward_input"):
            bad = [v for v in getattr(self, name) if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
            if bad:
                raise ValueError(f"profile: {name} must hold finite numbers >= 0, got {bad[:3]}")
        if not (isinstance(self.runtime_bytes, (int, float)) and math.isfinite(self.runtime_bytes) and self.runtime_bytes >= 0):
            raise ValueError(f"profile: runtime_bytes must be a finite number >= 0, got {self.runtime_bytes!r}")

    @property
    def num_blocks(self) -> int:
        return len(self.forward)

    @property
    def key(self) -> str:
        return f"{self.model}-mbs{self.microbatch_size}-{self.dtype}-{self.device}"

    def check_blocks(self, num_blocks: int) -> None:
        if self.num_blocks != num_blocks:
            raise ValueError(f"the profile {self.key} has {self.num_blocks} blocks but the model has {num_blocks}")

    def costs(
        self, bandwidth: float = math.inf, latency: float = 0.0, slowdown: Sequence[float] = (), cores: Optional[int] = None
    ) -> CostModel:
        """The simulator's costs; with the measured message costs when the profile holds them."""
        costs = CostModel(
            tuple(self.forward),
            tuple(self.backward),
            tuple(self.activation_bytes),
            tuple(self.param_bytes),
            bandwidth,
            latency,
            tuple(slowdown),
            cores,
            weight=tuple(self.weight),
            backward_input=tuple(self.backward_input),
            runtime_bytes=self.runtime_bytes,
        )
        return self.message_costs.apply(costs) if self.messages else costs

    @property
    def message_costs(self) -> Optional[MessageCosts]:
        return MessageCosts.from_dict(self.messages) if self.messages else None

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
    def synthetic(
        forward: Sequence[float],
        backward: Optional[Sequence[float]] = None,
        activation_bytes: float | Sequence[float] = 0.0,
        param_bytes: float | Sequence[float] = 0.0,
        model: str = "synthetic",
        microbatch_size: int = 1,
    ) -> "Profile":
        n = len(forward)
        backward = list(backward) if backward is not None else [2.0 * f for f in forward]
        as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [float(v)] * n  # noqa: E731
        return Profile(
            model, microbatch_size, "synthetic", "synthetic", list(forward), backward, as_list(activation_bytes), as_list(param_bytes)
        )


# ---- what passes between blocks ---------------------------------------------------------------
ALLOWED_ACTIVATIONS = (
    "a tensor or a tuple of tensors (integer and bool tensors travel without gradients; dtypes: "
    + ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
    + ")"
)


def check_activation(value: Any, index: int, block: nn.Module) -> None:
    """Refuse an output of pipeline block `index` that the runtime cannot pass to the next block.

    Between two stages the runtime (`runtime.p2p`) sends a tensor or a plain tuple of tensors of
    a sendable dtype. Anything else (a dict, a list, a None, a namedtuple, which would arrive as a
    plain tuple) would pass between two blocks of one stage and fail between two stages, so it
    would train with one partition and not with another. The stage (each block it runs) and the
    profiler call this on every block output but the pipeline's last (which goes to the user's
    step, not to a block), so every partition refuses the same model with the same message.
    """
    problem = _activation_problem(value)
    if problem is not None:
        raise TypeError(
            f"pipeline block {index} ({type(block).__name__}) returned {problem}; an activation passed between "
            f"pipeline blocks must be {ALLOWED_ACTIVATIONS}. Return a tuple of tensors instead (e.g. "
            "tuple(d.values()) for a dict, tuple(l) for a list), whatever the partition"
        )


def _activation_problem(value: Any) -> Optional[str]:
    if isinstance(value, Tensor):
        return None if value.dtype in _DTYPES else f"a tensor of dtype {value.dtype}, which cannot be sent between stages"
    if not isinstance(value, tuple):
        return f"a {type(value).__name__}"
    if type(value) is not tuple:
        return f"a {type(value).__name__} (a tuple subclass: the next stage would receive a plain tuple)"
    for i, item in enumerate(value):
        if not isinstance(item, Tensor):
            return f"a tuple holding a {type(item).__name__} at position {i}"
        if item.dtype not in _DTYPES:
            return f"a tuple holding a tensor of dtype {item.dtype} at position {i}, which cannot be sent between stages"
    return None


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in `value`, in order (the last block's output may be any structure: it goes to the step)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _float_outputs(value: Any) -> list[Tensor]:
    return [t for t in _tensors(value) if t.requires_grad]


def _leaf(value: Any, copy: bool = False) -> Any:
    """A block's input as the runtime makes it (`executor._local_leaf`, `p2p`): fresh leaves that
    require grad where the tensor they come from did, so an integer mask or a float tensor made
    without a gradient gets none, as in training. ``copy``: for an input used again (by the next
    repeat or micro-batch in flight), its own memory, as each received micro-batch has, so a block
    that changes its input in place does not change another run's."""
    if isinstance(value, Tensor):
        return (value.detach().clone() if copy else value.detach()).requires_grad_(value.requires_grad)
    if type(value) is tuple:
        return tuple(_leaf(v, copy) for v in value)
    return value  # the pipeline's own input (block 0's) may be anything the step passes


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
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    inflight: Optional[int] = None,
    split_backward: bool = True,
) -> dict[int, dict[str, float]]:
    """Measure blocks ``indices`` (all by default) on `device` with `sample` as block 0's input.

    Blocks before the first measured one are run forward only to make its input. Each block is
    moved to the device while it is measured and back afterwards, so a model larger than one
    device can be profiled. Returns ``{index: {forward, backward, activation_bytes, param_bytes, peak_memory}}``.

    ``loss_fn(output) -> scalar`` (e.g. a closure over the micro-batch's targets): the last block
    of `blocks` is then timed as the last stage runs it, its forward followed by the loss and its
    backward started from the loss, so the loss's cost lands in that block's times. Its
    activation_bytes stay those of the block's own output.

    ``inflight=k`` ("chain" mode): the blocks from the first to the last measured one run back to
    back as one stage does, on k micro-batches in flight (k forwards through all of them, then k
    backwards), each block timed between its neighbours; `repeats` / `warmup` count such rounds.
    A block alone, its backward right after its forward on the same input, runs with hot caches
    and comes out several percent faster than inside a stage (3-11% on a small GPT on CPU); the
    chain keeps the caches as busy as training does. The chain's blocks are on `device` together.

    What passes from a block to the next is what the runtime passes (`check_activation`: a tensor
    or a tuple of tensors, else a TypeError naming the block), as fresh leaves requiring grad
    where training's would. ``split_backward``: every other chain backward runs as BI then W, timing
    zero-bubble's halves (their W share; off for a profile that needs whole backwards only).
    """
    wanted = set(range(len(blocks)) if indices is None else indices)
    if inflight is not None:
        if not (isinstance(inflight, int) and inflight >= 1):
            raise ValueError(f"inflight must be None or an integer >= 1, got {inflight!r}")
        return _profile_chain(blocks, sample, device, wanted, repeats, warmup, context, loss_fn, inflight, split_backward)
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
                results[i] = _measure(block, x, device, repeats, warmup, loss_fn if i == len(blocks) - 1 else None)
        x = _forward(blocks, i, x, context)
        block.to(home)
    return results


def _forward(blocks: Sequence[nn.Module], i: int, x: Any, context: Callable[[], Any]) -> Any:
    """Block i's output as the next block's input: checked as the runtime would take it, and cut
    from the graph (run with grad, so its tensors require grad exactly where training's would)."""
    with context():
        out = blocks[i](x)
    if i < len(blocks) - 1:
        check_activation(out, i, blocks[i])
    return _leaf(out)


def _profile_chain(
    blocks: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    wanted: set[int],
    repeats: int,
    warmup: int,
    context: Callable[[], Any],
    loss_fn: Optional[Callable[[Any], Tensor]],
    inflight: int,
    split_backward: bool = True,
) -> dict[int, dict[str, float]]:
    if not wanted:
        return {}
    first, last = min(wanted), max(wanted)
    x = sample
    for i, block in enumerate(blocks[:first]):  # forward only, to make the first measured block's input
        home = next((p.device for p in block.parameters()), device)
        block.to(device)
        x = _forward(blocks, i, _to(x, device), context)
        block.to(home)
    x = _to(x, device)
    chain = list(blocks[first : last + 1])
    homes = [next((p.device for p in b.parameters()), device) for b in chain]
    for b in chain:
        b.to(device)
    n, ends_model = len(chain), last == len(blocks) - 1
    fwd: list[list[float]] = [[] for _ in chain]
    bwd: list[list[float]] = [[] for _ in chain]
    split: list[list[tuple[float, float]]] = [[] for _ in chain]  # (BI, W) of the backwards run split
    peak, out_bytes = [0.0] * n, [0] * n
    cuda = device.type == "cuda"

    def timed(fn: Callable[[], Any], j: int) -> tuple[Any, float]:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        value = fn()
        _sync(device)
        elapsed = time.perf_counter() - t0
        if cuda:
            peak[j] = max(peak[j], float(torch.cuda.max_memory_allocated(device)))
        return value, elapsed

    with context():
        for r in range(warmup + repeats):
            stash = []
            for _ in range(inflight):
                h, saved = x, []
                for j, block in enumerate(chain):
                    inp = _leaf(h, copy=j == 0)  # a fresh leaf per block: backward is timed block by block

                    def run(block=block, inp=inp, j=j):
                        out = block(inp)
                        return out, (loss_fn(out) if loss_fn is not None and ends_model and j == n - 1 else None)

                    (out, loss), t = timed(run, j)
                    if first + j < len(blocks) - 1:
                        check_activation(out, first + j, block)
                    out_bytes[j] = _nbytes(out)
                    if r >= warmup:
                        fwd[j].append(t)
                    saved.append((inp, out if loss is None else loss))
                    h = out
                stash.append(saved)
            for k, saved in enumerate(stash):
                grads: Optional[list[Tensor]] = None
                halves = split_backward and (r + k) % 2 == 1  # every other backward runs as BI then W (zero-bubble's halves)
                for j in reversed(range(n)):
                    inp, out = saved[j]
                    outs = _float_outputs(out)
                    seeds = grads if grads is not None else [torch.ones_like(o) for o in outs]
                    if halves:
                        (leaf_grads, deferred), t_bi = timed(
                            lambda outs=outs, seeds=seeds, inp=inp: backward_input(outs, seeds, _float_outputs(inp)), j
                        )
                        _, t_w = timed(lambda deferred=deferred: backward_weight(deferred), j)
                        for leaf, g in zip(_float_outputs(inp), leaf_grads):
                            leaf.grad = g  # where the whole backward leaves it, for the block before
                        if r >= warmup:
                            split[j].append((t_bi, t_w))
                    else:
                        _, t = timed(lambda outs=outs, seeds=seeds: torch.autograd.backward(outs, seeds) if outs else None, j)
                        if r >= warmup:
                            bwd[j].append(t)
                    if j > 0:
                        grads = _input_grads(saved[j - 1][1], inp)
            for b in chain:
                b.zero_grad(set_to_none=True)  # gradients accumulate over a round, as over a step
    for b, home in zip(chain, homes):
        b.to(home)
    return {
        first + j: {
            "forward": statistics.median(fwd[j]),
            "backward": statistics.median(bwd[j] or [a + b for a, b in split[j]]),
            # the split backwards' own times: BI and W cost more together than one backward (the cut's calls)
            "backward_input": statistics.median(bi for bi, _ in split[j]) if split[j] else 0.0,
            "weight": statistics.median(w for _, w in split[j]) if split[j] else 0.0,
            "activation_bytes": float(out_bytes[j]),
            "param_bytes": float(sum(p.numel() * p.element_size() for p in chain[j].parameters())),
            "peak_memory": peak[j],
        }
        for j in range(n)
        if first + j in wanted
    }


def _input_grads(out: Any, leaf: Any) -> list[Tensor]:
    """Gradients for the outputs of the block before (those requiring grad, in order) from the
    next block's input leaves: position by position, zeros where the next block did not use one."""
    outs = out if isinstance(out, tuple) else (out,)
    leaves = leaf if isinstance(leaf, tuple) else (leaf,)
    return [
        lf.grad if isinstance(lf, Tensor) and lf.grad is not None else torch.zeros_like(o)
        for o, lf in zip(outs, leaves)
        if isinstance(o, Tensor) and o.requires_grad
    ]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if type(value) is tuple or isinstance(value, list):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):  # block 0's input: whatever the step passes
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, Call):  # ... or the keyword call of a model the front end cut
        return value.apply(lambda v: _to(v, device))
    return value


def _measure(
    block: nn.Module, x: Any, device: torch.device, repeats: int, warmup: int, loss_fn: Optional[Callable[[Any], Tensor]] = None
) -> dict[str, float]:
    fwd, bwd = [], []
    out = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for r in range(warmup + repeats):
        inp = _leaf(x, copy=True)
        _sync(device)
        t0 = time.perf_counter()
        out = block(inp)
        loss = loss_fn(out) if loss_fn is not None else None
        _sync(device)
        t1 = time.perf_counter()
        outs = _float_outputs(loss if loss is not None else out)
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
    return {
        "forward": statistics.median(fwd),
        "backward": statistics.median(bwd),
        "activation_bytes": float(_nbytes(out)),
        "param_bytes": float(params),
        "peak_memory": peak,
    }
