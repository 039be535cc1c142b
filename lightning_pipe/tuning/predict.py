"""AvgPipe's prediction of other settings from one profile (§5.2.2-5.2.3, Eq. 1-8), and the choice.

The profile was taken at M = m micro-batches and N = n pipelines; for a candidate (m*, n*), per
device (stage) k, with r = m n* / (m* n) the factor by which utilisation scales:

    T_gpu*  = (1 / r) (T_gpu + ∫ max(r phi(t) - 1, 0) dt)                               (2)
    𝕋*      = (n* / n) 𝕋
    T_com*  = 𝕋* / m* + (m* - 1) / m* · max(𝕋* - T_gpu*, 0)                              (3, 4)
    T_up*   = T_up*(k-1) + (𝕋*(k-1) + T_gpu*(k-1)) / m*,   T_up*(1) = 0                    (6)
    T_down* = T_down*(k+1) + (𝕋*(k+1) + T_gpu*(k+1)) / m*, T_down*(K) = 0                  (7)
    T*      = T_gpu* + T_com* + T_up* + T_down*                                             (1, 5)
    F*      = (n* / n) F_mod + (m n* / (m* n)) F_dat                                         (8)

T is the time per batch of one pipeline, with the n* pipelines' batches sharing the device: the
step of the n* pipelines takes n* T, and the job's throughput is B / T samples per second (B the
batch of one pipeline). The prediction is AFAB's (the paper: advance forward propagation brings
1F1B close to it); the slowest device's T is the batch's. F is per device: the n* processes of
stage k on it, the layout the strategy runs by default (`share_devices`, N processes per device);
with share_devices=false each process has a device of its own and F / n* is each's. The reference
model lives in a host process (runtime/reference.py), so it is not in a device's F_mod.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import SettingError


@dataclass(frozen=True)
class StageProfile:
    compute: float  # T_gpu: seconds of computation per batch
    comm_total: float  # 𝕋: seconds the batch's messages are on the wire
    utilisation: tuple[tuple[float, float], ...]  # phi(t) over one batch: (seconds, fraction) intervals
    model_bytes: float  # F_mod
    data_bytes: float  # F_dat
    wall: float = 0.0  # measured seconds per step (for the report)
    period: float = 0.0  # measured seconds from one step's start to the next's (tune_model=calibrated)

    def overuse(self, r: float) -> float:
        """∫ max(r phi(t) - 1, 0) dt: the work that would not fit under 100% at r times the utilisation."""
        return sum(d * max(r * phi - 1.0, 0.0) for d, phi in self.utilisation)


@dataclass(frozen=True)
class TuneProfile:
    microbatches: int  # m
    pipelines: int  # n
    batch_size: int  # B: samples in one pipeline's batch
    stages: tuple[StageProfile, ...]

    @classmethod
    def from_ranks(cls, microbatches: int, pipelines: int, batch_size: int, ranks: Sequence[dict[str, Any]]) -> "TuneProfile":
        ordered = sorted(ranks, key=lambda r: r["stage"])
        stages = tuple(
            StageProfile(
                r["compute"],
                r["comm_total"],
                tuple(map(tuple, r["utilisation"])),
                r["model_bytes"],
                r["data_bytes"],
                r["wall"],
                r.get("period") or r["wall"],
            )
            for r in ordered
        )
        return cls(microbatches, pipelines, batch_size, stages)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s in d["stages"]:
            s["utilisation"] = [list(p) for p in s["utilisation"]]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneProfile":
        stages = tuple(StageProfile(**{**s, "utilisation": tuple(map(tuple, s["utilisation"]))}) for s in d["stages"])
        return cls(d["microbatches"], d["pipelines"], d["batch_size"], stages)


@dataclass(frozen=True)
class Prediction:
    microbatches: int
    pipelines: int
    per_batch: float  # T*: seconds per batch (the slowest device's)
    throughput: float  # samples / s of the whole job
    memory: float  # bytes on the fullest device
    terms: tuple[tuple[float, float, float, float], ...]  # per device: T_gpu*, T_com*, T_up*, T_down*
    memory_per_device: tuple[float, ...]
    verdict: str = ""


def predict(profile: TuneProfile, m_star: int, n_star: int) -> Prediction:
    m, n = profile.microbatches, profile.pipelines
    r = (m * n_star) / (m_star * n)
    gpu = [(s.compute + s.overuse(r)) / r for s in profile.stages]  # Eq. 2
    wire = [n_star / n * s.comm_total for s in profile.stages]
    com = [w / m_star + (m_star - 1) / m_star * max(w - g, 0.0) for w, g in zip(wire, gpu)]  # Eq. 4
    K = len(profile.stages)
    up, down = [0.0] * K, [0.0] * K
    for k in range(1, K):  # Eq. 6
        up[k] = up[k - 1] + (wire[k - 1] + gpu[k - 1]) / m_star
    for k in range(K - 2, -1, -1):  # Eq. 7
        down[k] = down[k + 1] + (wire[k + 1] + gpu[k + 1]) / m_star
    per_device = [g + c + u + d for g, c, u, d in zip(gpu, com, up, down)]  # Eq. 1, 5
    memory = [n_star / n * s.model_bytes + m * n_star / (m_star * n) * s.data_bytes for s in profile.stages]  # Eq. 8
    T = max(per_device)
    return Prediction(
        m_star,
        n_star,
        T,
        profile.batch_size / T if T > 0 else float("inf"),
        max(memory),
        tuple(zip(gpu, com, up, down)),
        tuple(memory),
    )


def default_grid(batch_size: int, microbatches: Optional[Sequence[int]], pipelines: Optional[Sequence[int]]) -> tuple[list[int], list[int]]:
    """M: the given counts, else powers of two from 1 to the batch size (at most 64); N: given, else 1, 2, 4."""
    if microbatches is None:
        ms, m = [], 1
        while m <= min(batch_size, 64):
            ms.append(m)
            m *= 2
    else:
        ms = sorted(set(microbatches))
    too_many = [m for m in ms if m > batch_size]
    if too_many:
        raise SettingError(
            f"tune_microbatches={ms}: {too_many} exceed the batch size {batch_size} (a micro-batch needs a sample); "
            f"use counts <= {batch_size}",
            "tune_microbatches",
        )
    return ms, sorted(set(pipelines or (1, 2, 4)))


@dataclass
class TuneResult:
    profile: TuneProfile
    candidates: list[Prediction]
    memory_limit: Optional[float]
    chosen: Prediction
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of the profile and of the prediction
    partition: Optional[list[int]] = None  # blocks per chunk the profiled run planned (the chosen job reuses it)
    model: str = "paper"  # the prediction: "paper" (Eq. 1-8) or "calibrated" (ours, calibrated.py)
    profile_lo: Optional[TuneProfile] = None  # calibrated: the second profiled setting

    def table(self) -> str:
        head = f"{'M':>4} {'N':>3} {'micro-batch':>11} {'T/batch ms':>11} {'samples/s':>10} {'memory MiB':>11}  verdict"
        lines = [
            f"tuner (AvgPipe §5.2): profiled M={self.profile.microbatches}, N={self.profile.pipelines} "
            f"({len(self.profile.stages)} stages, batch {self.profile.batch_size} per pipeline); memory limit "
            + (f"{self.memory_limit / 2**20:.1f} MiB per device" if self.memory_limit else "none"),
            head,
        ]
        for c in sorted(self.candidates, key=lambda c: (c.microbatches, c.pipelines)):
            size = self.profile.batch_size / c.microbatches
            lines.append(
                f"{c.microbatches:>4} {c.pipelines:>3} {size:>11.1f} {c.per_batch * 1e3:>11.2f} {c.throughput:>10.1f} "
                f"{c.memory / 2**20:>11.2f}  {c.verdict}"
            )
        if self.profile_lo is not None:
            lines.insert(1, f"calibrated prediction (ours): second profile at M={self.profile_lo.microbatches}, N=1")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        names = ("T_gpu", "T_com", "T_up", "T_down") if self.model == "paper" else ("C", "W", "L", "O")
        return {
            "profile": self.profile.to_dict(),
            "model": self.model,
            "profile_lo": self.profile_lo.to_dict() if self.profile_lo is not None else None,
            "memory_limit": self.memory_limit,
            "chosen": {"microbatches": self.chosen.microbatches, "pipelines": self.chosen.pipelines},
            "partition": self.partition,
            "candidates": [
                {
                    "microbatches": c.microbatches,
                    "pipelines": c.pipelines,
                    "predicted_seconds_per_batch": c.per_batch,
                    "predicted_samples_per_s": c.throughput,
                    "predicted_memory_bytes": c.memory,
                    "memory_per_device": list(c.memory_per_device),
                    "terms_per_device": [dict(zip(names, t)) for t in c.terms],
                    "verdict": c.verdict,
                }
                for c in self.candidates
            ],
            "seconds": self.seconds,
        }

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def choose(
    profile: TuneProfile,
    microbatches: Sequence[int],
    pipelines: Sequence[int],
    memory_limit: Optional[float] = None,
    predictor: Optional[Callable[[int, int], Prediction]] = None,
) -> TuneResult:
    """Every (M, N) of the grid predicted (Eq. 1-8 from `profile`, or `predictor`); the fastest within
    memory_limit chosen (ties: fewer pipelines, then fewer micro-batches: less memory, fewer messages)."""
    predictor = predictor or (lambda m_star, n_star: predict(profile, m_star, n_star))
    model = max(s.model_bytes for s in profile.stages) / profile.pipelines
    if memory_limit is not None and model >= memory_limit:
        raise SettingError(
            f"memory_limit={memory_limit:.0f} bytes is below what one pipeline's model needs on its fullest device "
            f"({model:.0f} bytes: weights, gradients, optimizer state): raise memory_limit",
            "memory_limit",
        )
    candidates = []
    for m_star in microbatches:
        for n_star in pipelines:
            p = predictor(m_star, n_star)
            fits = memory_limit is None or p.memory <= memory_limit
            candidates.append(Prediction(**{**p.__dict__, "verdict": "fits" if fits else "over memory_limit"}))
    feasible = [c for c in candidates if c.verdict == "fits"]
    if not feasible:
        least = min(candidates, key=lambda c: c.memory)
        raise SettingError(
            f"no (M, N) in tune_microbatches={list(microbatches)} x tune_pipelines={list(pipelines)} fits memory_limit="
            f"{memory_limit:.0f} bytes; the least, M={least.microbatches} N={least.pipelines}, needs {least.memory:.0f}: "
            "allow more micro-batches, fewer pipelines, or raise memory_limit",
            "memory_limit",
        )
    best = min(feasible, key=lambda c: (c.per_batch, c.pipelines, c.microbatches))
    candidates = [Prediction(**{**c.__dict__, "verdict": "chosen"}) if c is best else c for c in candidates]
    chosen = next(c for c in candidates if c.verdict == "chosen")
    return TuneResult(profile, candidates, memory_limit, chosen)
