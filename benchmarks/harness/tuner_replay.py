"""The tuner's predictions replayed on saved traversals (bench_tuner.py's JSON): each traversal
measured every (M, N) of the grid for real, so the two N = 1 settings a tuner profiles are in it.
For each saved model: the live tuner's prediction (its own profile runs) and the other model's,
replayed: ours (tune_model=calibrated) from the traversal's (max M, 1) and (min M, 1) rank records,
or the paper's Eq. 1-8 from the live calibrated tuner's first profile (the paper's point); each
pick's measured throughput over the traversal's best, and Spearman's rho of predicted against
measured samples/s.

    python -m benchmarks.harness.tuner_replay docs/results/tuner_results.json docs/results/tuner_results_gpt_repeats.json

A replay uses the traversal's measurement of the profiled settings where a live tuner runs its own
profile run; the live figures are bench_tuner.py's (docs/results/tuner.md).
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from lightning_pipe.adaptive.stats import spearman
from lightning_pipe.tuning import StageProfile, TuneProfile, choose, predict_calibrated

from .bench import Table


def profile_of(setting: dict[str, Any], batch: int) -> TuneProfile:
    """The N = 1 setting's rank records as the tuner's profile (the calibrated prediction reads no utilisation)."""
    ranks = sorted(setting["measured"]["ranks"], key=lambda r: r["stage"])
    stages = tuple(
        StageProfile(r["compute"], r["comm_total"], (), r["model_bytes"], r["data_bytes"], r["wall"], r["period"] or r["wall"])
        for r in ranks
    )
    return TuneProfile(setting["microbatches"], 1, batch, stages)


def measured(setting: dict[str, Any]) -> float:
    """Samples/s of the job: the median of the traversal's passes."""
    m = setting["measured"]
    return statistics.median(m.get("samples_per_s_passes") or [m["samples_per_s"]])


def replay(model: dict[str, Any]) -> dict[str, Any]:
    grid = {(s["microbatches"], s["pipelines"]): s for s in model["settings"]}
    ms, ns = sorted({m for m, _ in grid}), sorted({n for _, n in grid})
    hi, lo = profile_of(grid[(max(ms), 1)], model["batch_size"]), profile_of(grid[(min(ms), 1)], model["batch_size"])
    rate = {key: measured(s) for key, s in grid.items()}
    best = max(rate, key=rate.get)
    out = {"model": model["model"], "best": best, "settings": len(grid)}
    keys = sorted(grid)

    def verdict(pick: tuple[int, int], predicted: dict) -> dict[str, Any]:
        return {"pick": pick, "ratio": rate[pick] / rate[best], "rho": spearman([predicted[k] for k in keys], [rate[k] for k in keys])}

    tuned = model["tuner"]["tune"]
    live = tuned.get("model", "paper")  # which prediction the live tuner made from its own profile run(s)
    live_pick = (tuned["chosen"]["microbatches"], tuned["chosen"]["pipelines"])
    out[live] = verdict(live_pick, {(c["microbatches"], c["pipelines"]): c["predicted_samples_per_s"] for c in tuned["candidates"]})
    out["live"] = live
    if live == "paper":  # ours replayed from the traversal's two N = 1 settings
        ours = choose(hi, ms, ns, None, lambda m, n: predict_calibrated(hi, lo, m, n))
    else:  # the paper's Eq. 1-8 from the live tuner's own first profile (the paper's point)
        ours = choose(TuneProfile.from_dict(tuned["profile"]), ms, ns)
    other = "calibrated" if live == "paper" else "paper"
    out[other] = verdict(
        (ours.chosen.microbatches, ours.chosen.pipelines), {(c.microbatches, c.pipelines): c.throughput for c in ours.candidates}
    )
    return out


def main(paths: list[str]) -> int:
    t = Table("saved traversal", "model", "live tuner", "best (M, N)", "paper: pick, ÷ best, ρ", "calibrated (ours): pick, ÷ best, ρ")
    for path in paths:
        for model in json.loads(open(path).read())["models"]:
            r = replay(model)
            cells = [f"{r[k]['pick']}, {r[k]['ratio']:.2f}, {r[k]['rho']:+.2f}" for k in ("paper", "calibrated")]
            t.add(path.rsplit("/", 1)[-1], r["model"], r["live"], str(r["best"]), *cells)
    print(t.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
