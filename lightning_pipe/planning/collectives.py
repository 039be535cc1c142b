"""What a collective costs a group of ranks (ours): all-gather, reduce-scatter and all-reduce as rings.

Each collective is a fit `Fit(latency, bus_bandwidth)`: a ring over p ranks takes p - 1 steps (all-gather,
reduce-scatter) or 2 (p - 1) (all-reduce), each paying `latency`, and moves (p - 1) / p of the buffer
(twice for an all-reduce) at `bus_bandwidth` (NCCL's "bus bandwidth"). The same fit then prices the
collective on a group of any size. `profiling.collectives.measure_collectives` fits them on the real
process group; without a measurement, `ring(bandwidth, latency)` stands: the link's bandwidth and
latency for all three. Sizes are the whole buffer: the gathered tensor (all-gather), the input to
scatter (reduce-scatter), the reduced tensor (all-reduce). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Fit:
    latency: float  # s per ring step
    bus_bandwidth: float  # bytes/s


@dataclass(frozen=True)
class CollectiveCosts:
    all_gather: Fit
    reduce_scatter: Fit
    all_reduce: Fit
    ranks: int = 0  # the group they were measured on (0: not measured)
    source: str = "ring model"

    def time(self, kind: str, nbytes: float, ranks: int) -> float:
        """Seconds of collective `kind` of an `nbytes` buffer over `ranks` ranks."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        fit: Fit = getattr(self, kind)
        passes = 2 if kind == "all_reduce" else 1
        return passes * ((ranks - 1) / ranks * nbytes / fit.bus_bandwidth + (ranks - 1) * fit.latency)


def ring(bandwidth: float, latency: float) -> CollectiveCosts:
    """The model without a measurement: every collective a ring over links of `bandwidth` and `latency`."""
    fit = Fit(latency, bandwidth)
    return CollectiveCosts(fit, fit, fit)


def fit_samples(kind: str, ranks: int, samples: list[tuple[float, float]]) -> Fit:
    """The fit of (bytes, seconds) samples of `kind` on `ranks` ranks: least squares of time = a + bytes x c;
    a is the latency (per ring step), c the time per byte moved, from which the bus bandwidth. A noisy
    measurement whose slope comes out <= 0 keeps the smallest buffer's time as latency and the largest's
    rate as bandwidth (never a free collective)."""
    samples = sorted(samples)
    passes = 2 if kind == "all_reduce" else 1
    steps = passes * max(ranks - 1, 1)
    moved = passes * (ranks - 1) / ranks if ranks > 1 else 1.0
    k = len(samples)
    mean_n = sum(n for n, _ in samples) / k
    mean_t = sum(t for _, t in samples) / k
    spread = sum((n - mean_n) ** 2 for n, _ in samples)
    per_byte = sum((n - mean_n) * (t - mean_t) for n, t in samples) / spread if spread > 0 else 0.0
    if per_byte <= 0:
        big_n, big_t = samples[-1]
        return Fit(samples[0][1] / steps, moved * big_n / big_t)
    base = max(mean_t - per_byte * mean_n, 0.0)
    return Fit(base / steps, moved / per_byte)
