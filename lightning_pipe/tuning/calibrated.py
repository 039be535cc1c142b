"""Ours, not the paper's: the tuner's calibrated prediction (`tune_model=calibrated`).

AvgPipe's Eq. 1-8 (predict.py) rank (M, N) backwards on shared CPU cores (docs/results/tuner.md): a
micro-batch has a fixed cost that Eq. 2 cannot express, and the N pipelines fill each other's
bubbles, which Eq. 5-7 (bubbles independent of N) do not model. This variant keeps the paper's
profile and adds a second profile point:

- two profiled settings at N = 1, M = m_lo and m_hi, give per stage k a line through both,
  C_k(M) = a_k + b_k M for the computation per batch and W_k(M) likewise for the time on the wire
  (b_k: what each extra micro-batch costs: dispatch, messages, the executor's work);
- the iteration's work outside the schedule (optimizer step, AvgPipe's update, Lightning's loop)
  per rank, O_k = period - wall of the profile (their mean over both points);
- one pipeline's batch cannot finish before its critical path (a flush schedule of per-micro-batch
  stage times t_k = (C_k + W_k) / M), L = sum_k t_k + (M - 1) max_k t_k + max_k O_k;
- a device shared by N pipelines cannot finish their N batches before it has done their work,
  D_k = N (C_k + W_k + O_k): the pipelines fill each other's bubbles until the device is full.

So the N batches take S = max(max_k D_k, L) and one batch T* = S / N (the quantity Eq. 1 predicts).
Memory is Eq. 8's, from the m_hi profile, unchanged.
"""

from __future__ import annotations

from .predict import Prediction, TuneProfile


def _line(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    """The value at x of the line through (x1, y1) and (x2, y2), never below zero."""
    if x1 == x2:
        return max((y1 + y2) / 2, 0.0)
    return max(y1 + (y2 - y1) * (x - x1) / (x2 - x1), 0.0)


def predict_calibrated(hi: TuneProfile, lo: TuneProfile, m_star: int, n_star: int) -> Prediction:
    """(M, N) = (m_star, n_star) from the profiles at (m_hi, 1) and (m_lo, 1) of the same partition."""
    if hi.pipelines != 1 or lo.pipelines != 1 or len(hi.stages) != len(lo.stages):
        raise ValueError("the calibrated prediction needs two N = 1 profiles of the same stages")
    compute, wire, outside = [], [], []
    for h, w in zip(hi.stages, lo.stages):
        compute.append(_line(lo.microbatches, w.compute, hi.microbatches, h.compute, m_star))
        wire.append(_line(lo.microbatches, w.comm_total, hi.microbatches, h.comm_total, m_star))
        outside.append(max((h.period - h.wall + w.period - w.wall) / 2, 0.0))
    per_micro = [(c + w) / m_star for c, w in zip(compute, wire)]
    critical = sum(per_micro) + (m_star - 1) * max(per_micro) + max(outside)
    device = [n_star * (c + w + o) for c, w, o in zip(compute, wire, outside)]
    step = max(max(device), critical)
    per_batch = step / n_star
    memory = [n_star * s.model_bytes + hi.microbatches * n_star / m_star * s.data_bytes for s in hi.stages]  # Eq. 8, n = 1
    return Prediction(
        m_star,
        n_star,
        per_batch,
        hi.batch_size / per_batch if per_batch > 0 else float("inf"),
        max(memory),
        tuple((c, w, critical, o) for c, w, o in zip(compute, wire, outside)),  # tune.json's C, W, L, O
        tuple(memory),
    )
