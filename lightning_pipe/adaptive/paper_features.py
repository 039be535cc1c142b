"""AutoPipe-RL's inputs as the paper lists them (Table 1, Fig. 7), per layer, as fixed-size rows.

- static (constant while training): L, N and per layer i its output activation bytes O_i, input
  gradient bytes G_i and parameter bytes P_i;
- dynamic (every iteration): per worker i its available bandwidth B_i, and FP_{i,j}, BP_{i,j}: the
  forward and backward time of layer j on worker i, which the paper derives from the worker's
  measured speed and the layers' profiled ratios (for every layer j, held by i or not);
- the partition: "an array with size N, each element the assigned layers of each worker" (the
  layer-count array; a contiguous partition is its prefix sums).

The per-layer vectors make a network's input size depend on L: rows are padded to `L_MAX` layers
(with a mask), and a model with more layers is refused. Ours (`features.py`) summarises per rank
instead, so one network serves any L.

Scaling (ours; the paper gives none): times in units of T0 / L (T0 = M * sum(forward + backward) /
N, `features.unit_time`), so a layer of average cost reads about 1; bytes as log10(bytes) - 6;
bandwidth as log10(bytes/s) - 8; counts as layers / L_MAX. The paper's layer-count array is for one
model chunk per worker: schedules with several chunks per worker (interleaved, wave, hanayo) are
not encoded here.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

L_MAX = 24  # layers (blocks) a paper-input network takes; the simulated models at depths 2 and 4 have 4..22
SINGLE_CHUNK = ("gpipe", "1f1b", "advance", "2bw")  # the schedules a layer-count array describes


def static_width() -> int:
    return 2 + 4 * L_MAX  # L, N; mask, O, G, P per layer


def dynamic_width(depth: int) -> int:
    return depth + 2 * depth * L_MAX  # B per worker; FP, BP per worker per layer


def check_layers(layers: int) -> None:
    if layers > L_MAX:
        raise ValueError(f"the paper's per-layer inputs take at most {L_MAX} layers; this model has {layers}")


def _bytes(values: Sequence[float]) -> list[float]:
    return [math.log10(max(v, 1.0)) - 6.0 for v in values] + [0.0] * (L_MAX - len(values))


def static_row(output_bytes: Sequence[float], grad_bytes: Sequence[float], param_bytes: Sequence[float], depth: int) -> list[float]:
    layers = len(output_bytes)
    check_layers(layers)
    mask = [1.0] * layers + [0.0] * (L_MAX - layers)
    return [layers / L_MAX, depth / 8.0, *mask, *_bytes(output_bytes), *_bytes(grad_bytes), *_bytes(param_bytes)]


def worker_bandwidth(links: Sequence[float], depth: int) -> list[float]:
    """B_i from the links' measured bandwidth (link r joins workers r and r + 1): a worker's
    available bandwidth is its slower link's (the paper measures it per worker)."""
    out = []
    for i in range(depth):
        near = [links[k] for k in (i - 1, i) if 0 <= k < len(links)]
        out.append(min(near) if near else 1e9)
    return out


def dynamic_row(
    forward: Sequence[float],
    backward: Sequence[float],
    microbatches: int,
    speed: Sequence[float],
    bandwidth: Sequence[float],
    t0: float,
) -> list[float]:
    """One iteration: B_i, then FP_{i,j} and BP_{i,j} (seconds per iteration: M micro-batches of
    layer j at worker i's measured speed, `speed[i]` = measured / profiled time, 1 = as profiled)."""
    layers, depth = len(forward), len(speed)
    check_layers(layers)
    unit = t0 / layers
    pad = [0.0] * (L_MAX - layers)
    out = [math.log10(max(b, 1.0)) - 8.0 for b in bandwidth]
    for times in (forward, backward):
        for i in range(depth):
            out += [microbatches * t * speed[i] / unit for t in times] + pad
    return out


def layer_counts(bounds: Sequence[tuple[int, int]], depth: int) -> list[int]:
    """The layer-count array of a partition with one contiguous chunk per worker."""
    if len(bounds) != depth:
        raise ValueError(f"a layer-count array describes one chunk per worker: {len(bounds)} chunks on {depth} workers")
    return [hi - lo for lo, hi in bounds]


def partition_row(bounds: Sequence[tuple[int, int]], depth: int) -> list[float]:
    return [n / L_MAX for n in layer_counts(bounds, depth)]


def as_tensor(rows: Sequence) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)
