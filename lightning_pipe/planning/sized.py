"""Per-block costs as functions of the micro-batch size: PipeDream-2BW's cost functions (§4.2).

A `SizedProfile` holds, for a few measured micro-batch sizes, each block's forward and backward
time, its backward time when its forward is re-run inside it (recomputation, measured, not the
paper's constant 4/3), the bytes autograd keeps for its backward (full activations), its input
bytes (what recomputation keeps instead) and its output bytes (what crosses a stage boundary).
`at(b)` interpolates between measured sizes, piecewise linearly: time per sample is not constant
in b (arithmetic intensity grows with b, §4.2.1), so a single measurement scaled would be wrong.
Beyond the largest measured size it extrapolates the last segment's slope (bytes never below
proportional scaling from the largest size, times never below the largest's); below the smallest it
scales the smallest proportionally. No torch, no Lightning.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..simulation import CostModel

TIME_FIELDS = ("forward", "backward", "recompute_backward")
BYTE_FIELDS = ("saved_bytes", "input_bytes", "output_bytes")


@dataclass(frozen=True)
class BlockCosts:
    """Every block's costs at one micro-batch size (seconds, bytes)."""

    size: float
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute_backward: tuple[float, ...]
    saved_bytes: tuple[float, ...]
    input_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]

    def cost_model(self, bounds: Sequence[tuple[int, int]], recompute: Sequence[bool], bandwidth: float, latency: float) -> CostModel:
        """The simulator's costs with each stage's blocks recomputed or not (`recompute` per stage)."""
        backward = list(self.backward)
        for (a, b), on in zip(bounds, recompute):
            if on:
                backward[a:b] = self.recompute_backward[a:b]
        return CostModel(self.forward, tuple(backward), self.output_bytes, self.param_bytes, bandwidth, latency)


@dataclass
class SizedProfile:
    """Measured (or analytic) per-block costs at several micro-batch sizes; lists are [size][block]."""

    model: str
    sizes: list[int]
    forward: list[list[float]]
    backward: list[list[float]]
    recompute_backward: list[list[float]]
    saved_bytes: list[list[float]]
    input_bytes: list[list[float]]
    output_bytes: list[list[float]]
    param_bytes: list[float]
    block_names: list[str] = field(default_factory=list)
    source: str = "measured"  # or "analytic (FLOPs)"

    def __post_init__(self) -> None:
        if (
            not self.sizes
            or any(not isinstance(v, int) for v in self.sizes)
            or sorted(set(self.sizes)) != list(self.sizes)
            or self.sizes[0] < 1
        ):
            raise ValueError(f"sized profile: sizes must be distinct integers >= 1 in ascending order, got {self.sizes}")
        n = len(self.param_bytes)
        for name in (*TIME_FIELDS, *BYTE_FIELDS):
            rows = getattr(self, name)
            if len(rows) != len(self.sizes) or any(len(r) != n for r in rows):
                raise ValueError(f"sized profile: {name} must hold {len(self.sizes)} rows of {n} blocks")
            if any(not (0 <= v < math.inf) for r in rows for v in r):
                raise ValueError(f"sized profile: {name} must hold finite numbers >= 0")
        if any(not (0 <= v < math.inf) for v in self.param_bytes):
            raise ValueError("sized profile: param_bytes must hold finite numbers >= 0")
        if self.block_names and len(self.block_names) != n:
            raise ValueError(f"sized profile: {len(self.block_names)} block names for {n} blocks")

    @property
    def num_blocks(self) -> int:
        return len(self.param_bytes)

    def at(self, b: float) -> BlockCosts:
        """Costs at micro-batch size `b`: measured if it is one of `sizes`, else interpolated."""
        if b <= 0:
            raise ValueError(f"micro-batch size {b}: must be > 0")
        values = {name: tuple(self._value(getattr(self, name), b, name in BYTE_FIELDS)) for name in (*TIME_FIELDS, *BYTE_FIELDS)}
        return BlockCosts(float(b), param_bytes=tuple(self.param_bytes), **values)

    def _value(self, rows: list[list[float]], b: float, bytes_: bool) -> list[float]:
        sizes = self.sizes
        if len(sizes) == 1 or b < sizes[0]:  # below the smallest (or one measurement): proportional
            return [v * b / sizes[0] for v in rows[0]]
        i = bisect.bisect_left(sizes, b)
        if i < len(sizes) and sizes[i] == b:
            return list(rows[i])
        lo, hi = (i - 1, i) if i < len(sizes) else (len(sizes) - 2, len(sizes) - 1)
        s0, s1 = sizes[lo], sizes[hi]
        out = []
        for v0, v1 in zip(rows[lo], rows[hi]):
            v = v0 + (v1 - v0) * (b - s0) / (s1 - s0)
            if b > s1:  # beyond the largest: bytes never below proportional, times never below the largest's
                v = max(v, v1 * b / s1 if bytes_ else v1)
            out.append(v)
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)
        return path

    @staticmethod
    def load(path: str | Path) -> "SizedProfile":
        try:
            return SizedProfile(**json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"sized profile {path}: {err}") from None


def analytic_profile(
    model: object,
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    seq_len: Optional[int] = None,
    family: Optional[str] = None,
    dtype_bytes: int = 2,
    half_rate_tokens: float = 512.0,
    **device: float,
) -> SizedProfile:
    """A `SizedProfile` of a GPT / BERT recipe from its FLOPs (`flops.transformer_costs`) for planning
    paper-size models without their hardware. Activation bytes per layer follow Korthikanti et al.
    (2022) for 16-bit training, s b h (34 + 5 a s / h) bytes: the attention half (with its LayerNorm)
    keeps 13 s b h + 5 a s^2 b, the FFN half 21 s b h; the embedding its dropout mask (s b h / 2 ... taken
    as s b h); the head its input and the logits with their fp32 softmax (6 s b V). Recomputation
    re-runs the forward inside the backward: its backward is forward + backward.

    Arithmetic intensity (§4.2.1): a FLOP count alone makes time linear in b, so a larger micro-batch
    would never pay. Ours, an assumption to be replaced by a measured profile: a block's matmuls run at
    the device's rate x tokens / (tokens + half_rate_tokens), i.e. half the rate at `half_rate_tokens`
    rows (b x seq_len), most of it at several thousand; the embedding (memory-bound) is left as is."""
    from ..models.config import resolve_config
    from .flops import transformer_costs

    cfg = resolve_config(model)
    T = cfg.max_seq_len if seq_len is None else seq_len
    rows: dict[str, list[list[float]]] = {name: [] for name in (*TIME_FIELDS, *BYTE_FIELDS)}
    params: list[float] = []
    kinds: tuple[str, ...] = ()
    for b in sizes:
        costs, kinds = transformer_costs(model, b, T, family=family, dtype_bytes=dtype_bytes, **device)
        hidden = b * T * cfg.d_model * dtype_bytes / 2  # s b h in 16-bit units of 2 bytes
        per_kind = {
            "embedding": hidden * 1,  # the dropout mask; the lookup keeps only token ids
            "attention": hidden * 13 + 5 * cfg.n_head * T * T * b * dtype_bytes / 2,
            "ffn": hidden * 21,
            "head": hidden * 2 + 6 * b * T * cfg.vocab_size,
        }
        slower = [1.0 if k == "embedding" else 1.0 + half_rate_tokens / (b * T) for k in kinds]
        forward = [f * x for f, x in zip(costs.forward, slower)]
        backward = [bw * x for bw, x in zip(costs.backward, slower)]
        rows["forward"].append(forward)
        rows["backward"].append(backward)
        rows["recompute_backward"].append([f + bw for f, bw in zip(forward, backward)])
        rows["saved_bytes"].append([float(per_kind[k]) for k in kinds])
        out = list(costs.activation_bytes)
        rows["output_bytes"].append(out)
        rows["input_bytes"].append([float(b * T * 8)] + out[:-1])  # block 0 reads token ids
        params = list(costs.param_bytes)
    name = model if isinstance(model, str) else "model"
    return SizedProfile(name, list(sizes), param_bytes=params, block_names=list(kinds), source="analytic (FLOPs)", **rows)
