"""Offline training of the learned parts (AutoPipe-RL §4.3 "offline training"), from our simulator.

    python -m lightning_pipe.adaptive.offline --out lightning_pipe/adaptive/weights

regenerates the shipped files: predictor_d{2,4}.pt (speed predictor per pipeline depth),
arbiter.pt, switch_cost.pt and report.json (data sizes, training time, held-out accuracy).

Data: randomised transformer-like models (an embedding, attention / FFN halves, a head; or
blocks of random cost), each with a random micro-batch count, schedule (GPipe, 1F1B), per-rank
slowdowns (half the ranks near 1, the others 1.2-4x: a shared device), link bandwidth (10 MB/s to
10 GB/s) and a noisy monitor window of 5 iterations around them; the label of a partition is the
simulator's iteration time with the true slowdowns and bandwidth. Per scenario the partition
balanced on the profile and all its neighbour candidates (`neighbour_candidates`) are labelled, so
accuracy is also measured as the rank correlation over one scenario's candidates, which is what a
decision needs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..bench.stats import spearman
from ..planning.replay import cached_schedule
from ..simulation import CostModel, simulate
from . import features as F
from .arbiter import Arbiter, SwitchCost, arbiter_features, cost_features
from .candidates import neighbour_candidates
from .predictor import WEIGHTS, SpeedPredictor, save

WINDOW = 5


@dataclass
class Scenario:
    forward: list[float]
    backward: list[float]
    activation_bytes: list[float]
    param_bytes: list[float]
    depth: int
    microbatches: int
    schedule: str
    slowdown: list[float]
    bandwidth: float
    rows: list[list[float]]  # the monitor's window
    seen_slowdown: list[float]  # its medians
    seen_bandwidth: list[float]
    base: tuple[tuple[int, int], ...]
    candidates: list[tuple[tuple[int, int], ...]]
    times: list[float]  # true iteration time of base, then of each candidate

    @property
    def t0(self) -> float:
        return F.unit_time(self.forward, self.backward, self.microbatches, self.depth)

    def candidate_row(self, bounds) -> list[float]:
        return F.candidate_row(
            self.forward,
            self.backward,
            self.activation_bytes,
            self.param_bytes,
            bounds,
            tuple(range(self.depth)),
            self.depth,
            self.microbatches,
            self.seen_slowdown,
            self.seen_bandwidth,
            self.schedule,
        )


def random_model(rng: random.Random, depth: int = 2) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-block forward, backward seconds, output bytes, parameter bytes; at least 2 blocks per stage."""
    base = 10 ** rng.uniform(-3.7, -1.7)  # 0.2 .. 20 ms per attention half
    if rng.random() < 0.7:  # a transformer of sub-layer blocks
        layers = rng.randint(2, 10) if depth <= 4 else rng.randint(depth, 3 * depth)
        ffn = rng.uniform(1.5, 2.3)
        fwd = [base * rng.uniform(0.05, 0.3)]
        for _ in range(layers):
            fwd += [base * rng.uniform(0.9, 1.1), base * ffn * rng.uniform(0.9, 1.1)]
        fwd.append(base * rng.uniform(0.3, 4.0))
        params_unit = 10 ** rng.uniform(4, 8)
        params = (
            [params_unit * rng.uniform(2, 20)]
            + [params_unit * k for _ in range(layers) for k in (4, 8)]
            + [params_unit * rng.uniform(0.1, 20)]
        )
    else:  # blocks of random cost
        n = rng.randint(4, 24) if depth <= 4 else rng.randint(2 * depth, 6 * depth)
        fwd = [base * math.exp(rng.gauss(0, 0.6)) for _ in range(n)]
        params = [10 ** rng.uniform(4, 8) for _ in range(n)]
    bwd = [f * rng.uniform(1.6, 2.5) for f in fwd]
    act = [10 ** rng.uniform(4, 8)] * len(fwd)
    return fwd, bwd, act, params


def balanced(costs: Sequence[float], depth: int) -> tuple[tuple[int, int], ...]:
    """Contiguous cuts at the prefix sums nearest k / depth of the total, every part at least one block."""
    total, edges, acc = sum(costs), [0], 0.0
    for b, c in enumerate(costs[:-1]):
        acc += c
        k = len(edges)
        if k < depth and acc >= total * k / depth and len(costs) - (b + 1) >= depth - k:
            edges.append(b + 1)
    while len(edges) < depth:  # too few cut points found: cut at the end
        edges.append(len(costs) - (depth - len(edges)))
    edges.append(len(costs))
    return tuple((edges[i], edges[i + 1]) for i in range(depth))


def scenario(rng: random.Random, depth: int) -> Scenario:
    while True:
        fwd, bwd, act, params = random_model(rng, depth)
        if len(fwd) >= 2 * depth:
            break
    m = rng.choice([depth, 2 * depth, 4 * depth])
    schedule = rng.choice(F.SCHEDULES)
    quiet = rng.random() < 0.35  # nothing shares the devices: what most of a run looks like
    slowdown = [rng.uniform(0.95, 1.2) if quiet or rng.random() < 0.5 else rng.uniform(1.2, 4.0) for _ in range(depth)]
    bandwidth = 10 ** rng.uniform(7, 10)
    slows = [[s * math.exp(rng.gauss(0, 0.05)) for s in slowdown] for _ in range(WINDOW)]
    bws = [[bandwidth * math.exp(rng.gauss(0, 0.2)) for _ in range(depth - 1)] for _ in range(WINDOW)]
    rows = [F.sequence_row(s, b) for s, b in zip(slows, bws)]
    seen_slow, seen_bw = F.window_summary(slows, bws)
    base = balanced([f + b for f, b in zip(fwd, bwd)], depth)
    cands = neighbour_candidates(base, tuple(range(depth)))
    costs = CostModel(tuple(fwd), tuple(bwd), tuple(act), tuple(params), bandwidth, 20e-6, tuple(slowdown))
    sched = cached_schedule(schedule, depth, m)
    times = [simulate(sched, costs, b, critical_path=False).iteration_time for b in [base, *cands]]
    return Scenario(fwd, bwd, act, params, depth, m, schedule, slowdown, bandwidth, rows, seen_slow, seen_bw, base, cands, times)


def generate(count: int, depth: int, seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    return [scenario(rng, depth) for _ in range(count)]


def samples(scenarios: Sequence[Scenario]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, cands, ys = [], [], []
    for s in scenarios:
        for bounds, t in zip([s.base, *s.candidates], s.times):
            seqs.append(s.rows)
            cands.append(s.candidate_row(bounds))
            ys.append(math.log(t / s.t0))
    seq, cand = F.as_tensors(seqs, cands)
    return seq, cand, torch.tensor(ys)


def train_predictor(train: Sequence[Scenario], depth: int, epochs: int = 40, seed: int = 0) -> SpeedPredictor:
    torch.manual_seed(seed)
    model = SpeedPredictor(depth)
    seq, cand, y = samples(train)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for i in range(0, len(y), 256):
            idx = order[i : i + 256]
            loss = torch.nn.functional.mse_loss(model(seq[idx], cand[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        schedule.step()
    return model.eval()


def evaluate_predictor(model: SpeedPredictor, held: Sequence[Scenario]) -> dict[str, float]:
    """Mean relative error of the predicted iteration time; median Spearman over each scenario's candidates;
    and the same relative error for a constant (the training mean of log T / T0) for comparison."""
    seq, cand, y = samples(held)
    with torch.no_grad():
        pred = model(seq, cand)
    rel = (torch.exp(pred - y) - 1).abs()
    correlations, k = [], 0
    for s in held:
        n = 1 + len(s.candidates)
        if n >= 3:
            rho = spearman(pred[k : k + n].tolist(), y[k : k + n].tolist())
            correlations.append(rho if math.isfinite(rho) else 0.0)  # a constant prediction orders nothing
        k += n
    correlations.sort()
    return {
        "mean_relative_error": float(rel.mean()),
        "median_spearman_over_candidates": correlations[len(correlations) // 2] if correlations else float("nan"),
        "samples": len(y),
    }


def constant_error(train: Sequence[Scenario], held: Sequence[Scenario]) -> float:
    _, _, y_train = samples(train)
    _, _, y = samples(held)
    return float((torch.exp(y_train.mean() - y) - 1).abs().mean())


# ---- the arbiter: a contextual bandit trained with REINFORCE ------------------------------------------
@dataclass
class Decision:
    features: list[float]
    reward_switch: float  # the reward had it switched (staying earns 0)


def switch_seconds(rng: random.Random, moved_bytes: float, bandwidth: float) -> float:
    """Part 1's measured form: a fixed part (5-30 ms measured on 2 CPU processes) plus 3 x the moved
    parameter bytes (weights + Adam's moments) over the link."""
    return rng.uniform(0.005, 0.03) + 3 * moved_bytes / bandwidth


def decisions(model: SpeedPredictor, scenarios: Sequence[Scenario], seed: int) -> list[Decision]:
    """For each scenario: the predictor's best candidate, what the arbiter would see, and the true reward of switching."""
    rng = random.Random(seed)
    out = []
    for s in scenarios:
        if not s.candidates:
            continue
        seq, cand = F.as_tensors([s.rows] * (1 + len(s.candidates)), [s.candidate_row(b) for b in [s.base, *s.candidates]])
        with torch.no_grad():
            pred = [math.exp(float(v)) * s.t0 for v in model(seq, cand)]
        # sim-to-real: on a real job the predictor errs more than on the simulator's own world (part 1
        # measured 15-17% model error, mostly common to all candidates); each candidate's prediction gets
        # an independent error of a scenario-wide size, so the arbiter learns what a small gain is worth
        sigma = rng.uniform(0.05, 0.15)
        pred = [t * math.exp(rng.gauss(0, sigma)) for t in pred]
        best = min(range(len(s.candidates)), key=lambda i: pred[1 + i])
        moved = sum(s.param_bytes[b] for b in _moved(s.base, s.candidates[best]))
        cost = switch_seconds(rng, moved, s.bandwidth)
        seen_cost = cost * math.exp(rng.gauss(0, 0.3))
        left = 10 ** rng.uniform(1, 4)
        since = 10 ** rng.uniform(0, 3)
        measured = s.times[0] * rng.uniform(1.0, 1.25)  # what the real job adds outside the model
        feats = arbiter_features(pred[0], pred[1 + best], s.t0, seen_cost, left, since, measured)
        now, new = s.times[0], s.times[1 + best]
        horizon = min(left, 200)  # the iterations a decision covers before the next one may undo it
        out.append(Decision(feats, now / new - 1 - cost / (now * horizon)))
    return out


def train_arbiter(train: Sequence[Decision], epochs: int = 3000, seed: int = 0) -> Arbiter:
    torch.manual_seed(seed)
    arbiter = Arbiter()
    x = torch.tensor([d.features for d in train])
    r_switch = torch.tensor([d.reward_switch for d in train])
    optimizer = torch.optim.Adam(arbiter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    baseline = 0.0
    for _ in range(epochs):
        p = torch.sigmoid(arbiter(x))
        action = torch.bernoulli(p.detach(), generator=generator)  # sampled, as a live job would act
        reward = action * r_switch  # only the chosen action's reward is seen
        baseline = 0.9 * baseline + 0.1 * float(reward.mean())
        logp = torch.where(action > 0, torch.log(p + 1e-8), torch.log(1 - p + 1e-8))
        loss = -((reward - baseline) * logp).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return arbiter.eval()


def mean_reward(choose, held: Sequence[Decision]) -> float:
    return sum(d.reward_switch if choose(d) else 0.0 for d in held) / len(held)


def train_switch_cost(seed: int = 0, n: int = 4000, epochs: int = 300) -> SwitchCost:
    rng = random.Random(seed)
    rows, ys = [], []
    for _ in range(n):
        moved, bw, blocks = 10 ** rng.uniform(3, 10), 10 ** rng.uniform(7, 10), rng.randint(1, 20)
        rows.append(cost_features(moved, bw, blocks))
        ys.append(math.log10(0.0125 + 3 * moved / bw))  # the fixed part's middle: measured 5-30 ms
    x, y = torch.tensor(rows), torch.tensor(ys)
    torch.manual_seed(seed)
    model = SwitchCost()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(epochs):
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _moved(old, new) -> list[int]:
    owner = lambda bounds: {b: c for c, (lo, hi) in enumerate(bounds) for b in range(lo, hi)}  # noqa: E731
    before, after = owner(old), owner(new)
    return [b for b in before if before[b] != after[b]]


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Train the adaptive mode's predictor, arbiter and switch-cost networks from the simulator.")
    p.add_argument("--out", default=str(WEIGHTS))
    p.add_argument("--depths", default="2,4")
    p.add_argument("--scenarios", type=int, default=2000, help="simulated scenarios per depth (each labels ~10-30 partitions)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--predictors-only", action="store_true", help="train only the listed depths' predictors (keep arbiter.pt, switch_cost.pt)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    report: dict = {"scenarios_per_depth": args.scenarios, "epochs": args.epochs, "seed": args.seed, "depths": {}}
    if args.predictors_only and (out / "report.json").is_file():  # add to what is there
        report = json.loads((out / "report.json").read_text())
    arbiter_data: list[Decision] = []
    for depth in (int(d) for d in args.depths.split(",")):
        started = time.perf_counter()
        data = generate(args.scenarios, depth, seed=args.seed + depth)
        held = generate(max(50, args.scenarios // 5), depth, seed=args.seed + 1000 + depth)
        simulated = time.perf_counter() - started
        started = time.perf_counter()
        model = train_predictor(data, depth, args.epochs, args.seed)
        trained = time.perf_counter() - started
        path = out / f"predictor_d{depth}.pt"
        save(model, path)
        scores = evaluate_predictor(model, held)
        scores["constant_mean_relative_error"] = constant_error(data, held)
        report["depths"][depth] = {
            "simulate_seconds": simulated,
            "train_seconds": trained,
            "file_bytes": path.stat().st_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "training_samples": int(samples(data)[2].numel()),
            "held_out": scores,
        }
        print(f"depth {depth}: {report['depths'][depth]}", flush=True)
        if args.predictors_only:
            continue
        arbiter_data += decisions(model, generate(max(200, args.scenarios // 2), depth, seed=args.seed + 2000 + depth), args.seed + depth)
    if args.predictors_only:
        (out / "report.json").write_text(json.dumps(report, indent=1))
        return
    random.Random(args.seed).shuffle(arbiter_data)
    cut = int(0.8 * len(arbiter_data))
    started = time.perf_counter()
    arbiter = train_arbiter(arbiter_data[:cut], seed=args.seed)
    held = arbiter_data[cut:]
    save(arbiter, out / "arbiter.pt")
    report["arbiter"] = {
        "train_seconds": time.perf_counter() - started,
        "decisions": len(arbiter_data),
        "held_out_mean_reward": {
            "arbiter": mean_reward(lambda d: arbiter.switch(d.features)[0], held),
            "never_switch": 0.0,
            "always_switch": mean_reward(lambda d: True, held),
            "rule_5_percent": mean_reward(lambda d: d.features[2] >= 0.05, held),
            "oracle": mean_reward(lambda d: d.reward_switch > 0, held),
        },
        "file_bytes": (out / "arbiter.pt").stat().st_size,
    }
    cost = train_switch_cost(args.seed)
    save(cost, out / "switch_cost.pt")
    report["switch_cost"] = {"file_bytes": (out / "switch_cost.pt").stat().st_size}
    print(f"arbiter: {report['arbiter']}", flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
