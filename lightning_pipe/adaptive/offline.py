"""Offline training of the learned parts (AutoPipe-RL §4.3 "offline training"), from our simulator.

    python -m lightning_pipe.adaptive.offline --out lightning_pipe/adaptive/weights

regenerates the shipped files: predictor_d{2,4,8}.pt (speed predictor per pipeline depth),
arbiter.pt, switch_cost.pt and report.json (data sizes, training time, held-out accuracy overall
and per schedule). `--workers N` simulates on N processes; the data is the same for any N.

Data: randomised transformer-like models (an embedding, attention / FFN halves, a head; or
blocks of random cost), each with a random micro-batch count, schedule (every one the runtime
runs: gpipe, 1f1b, interleaved with 2 chunks per rank, wave and hanayo with 1 wave, advance and 2bw,
the last two at a random advance_num or 1F1B's order), per-rank slowdowns (half the ranks near 1,
the others 1.2-4x: a shared device), link bandwidth (10 MB/s to 10 GB/s) and a noisy monitor window
of 5 iterations around them; the label of a partition is the simulator's iteration time with the
true slowdowns and bandwidth (2BW: a steady step, between the fill and the drain of its unrolled
schedule). Per scenario the partition balanced on the profile (or, in 30% of them, one neighbour
of it: a job that has switched) and all its neighbour candidates (`neighbour_candidates`) are
labelled, so accuracy is also measured as the rank correlation over one scenario's candidates,
which is what a decision needs.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..planning.replay import Replay, paused_gc
from ..schedules import get_schedule
from ..schedules.spec import ScheduleSpec
from ..simulation import CostModel
from . import features as F
from .arbiter import Arbiter, SwitchCost, arbiter_features, cost_features
from .candidates import neighbour_candidates
from .predictor import WEIGHTS, SpeedPredictor, save
from .stats import spearman

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
    advance: float  # features.ahead of the order (advance / 2BW)
    chunk_rank: tuple[int, ...]  # the rank of each model chunk (several per rank: interleaved, wave)
    slowdown: list[float]
    bandwidth: float
    rows: list[list[float]]  # the monitor's window
    seen_slowdown: list[float]  # its medians
    seen_bandwidth: list[float]
    base: tuple[tuple[int, int], ...]
    candidates: list[tuple[tuple[int, int], ...]]
    times: list[float]  # true iteration time of base, then of each candidate (2BW: of a steady step)

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
            self.chunk_rank,
            self.depth,
            self.microbatches,
            self.seen_slowdown,
            self.seen_bandwidth,
            self.schedule,
            self.advance,
        )


def random_model(rng: random.Random, chunks: int = 2) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-block forward, backward seconds, output bytes, parameter bytes; at least 2 blocks per model chunk."""
    base = 10 ** rng.uniform(-3.7, -1.7)  # 0.2 .. 20 ms per attention half
    if rng.random() < 0.7:  # a transformer of sub-layer blocks
        layers = rng.randint(2, 10) if chunks <= 4 else rng.randint(chunks, 3 * chunks)
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
        n = rng.randint(4, 24) if chunks <= 4 else rng.randint(2 * chunks, 6 * chunks)
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


# the options the scenarios run each schedule with (the defaults; advance_num is drawn per scenario)
SCHEDULE_OPTIONS: dict[str, dict[str, int]] = {"interleaved": {"chunks": 2}, "wave": {"waves": 1}, "hanayo": {"waves": 1}}
TWO_BW_BATCHES = (4, 6)  # a steady 2BW step: (T(6 batches) - T(4 batches)) / 2, past the fill, before the drain
_REPLAYS: dict[tuple, Replay] = {}  # compiled schedules of this process (more kinds than replay.compiled caches)


def _replay(name: str, depth: int, m: int, options: tuple[tuple[str, int], ...]) -> Replay:
    key = (name, depth, m, options)
    if key not in _REPLAYS:
        with paused_gc():
            _REPLAYS[key] = Replay(get_schedule(name)(depth, m, **dict(options)))
    return _REPLAYS[key]


def iteration_times(spec: ScheduleSpec, depth: int, m: int, costs: CostModel, partitions: Sequence) -> list[float]:
    """The simulator's iteration time of each partition; for 2BW, whose schedule is unrolled over
    batches with no flush between them, the time of one steady step (what the runtime measures)."""
    options = tuple(sorted(spec.kwargs.items()))
    if spec.name != "2bw":
        return _replay(spec.name, depth, m, options).iteration_times(costs, partitions)
    few, many = (_replay("2bw", depth, m, (*options, ("batches", n))).iteration_times(costs, partitions) for n in TWO_BW_BATCHES)
    return [(b - a) / (TWO_BW_BATCHES[1] - TWO_BW_BATCHES[0]) for a, b in zip(few, many)]


@dataclass
class Environment:
    """What stays fixed while a job runs (AutoPipe-RL's "environment"): the model's per-block
    profile, its schedule (with options) and micro-batch count at one depth."""

    depth: int
    microbatches: int
    spec: ScheduleSpec
    forward: list[float]
    backward: list[float]
    activation_bytes: list[float]
    param_bytes: list[float]


def draw_environment(rng: random.Random, depth: int, schedule: Optional[str] = None) -> Environment:
    schedule = schedule or rng.choice(F.SCHEDULES)
    m = rng.choice([depth, 2 * depth, 4 * depth])
    options = dict(SCHEDULE_OPTIONS.get(schedule, {}))
    if schedule in ("advance", "2bw") and rng.random() < 0.7:  # 1F1B's order (0) or further ahead
        options["advance_num"] = rng.randint(depth - 1, m)
    spec = ScheduleSpec.of(schedule, **options)
    chunks = spec.chunk_count(depth)
    while True:
        fwd, bwd, act, params = random_model(rng, chunks)
        if len(fwd) >= 2 * chunks:
            break
    return Environment(depth, m, spec, fwd, bwd, act, params)


def draw_state(rng: random.Random, env: Environment) -> Scenario:
    """A load on the environment's devices and links (slowdowns, bandwidth, the monitor's window)
    and a running partition, with every neighbour candidate labelled by the simulator."""
    depth, m, spec = env.depth, env.microbatches, env.spec
    fwd, bwd, act, params = env.forward, env.backward, env.activation_bytes, env.param_bytes
    quiet = rng.random() < 0.35  # nothing shares the devices: what most of a run looks like
    slowdown = [rng.uniform(0.95, 1.2) if quiet or rng.random() < 0.5 else rng.uniform(1.2, 4.0) for _ in range(depth)]
    bandwidth = 10 ** rng.uniform(7, 10)
    slows = [[s * math.exp(rng.gauss(0, 0.05)) for s in slowdown] for _ in range(WINDOW)]
    bws = [[bandwidth * math.exp(rng.gauss(0, 0.2)) for _ in range(depth - 1)] for _ in range(WINDOW)]
    rows = [F.sequence_row(s, b) for s, b in zip(slows, bws)]
    seen_slow, seen_bw = F.window_summary(slows, bws)
    chunk_rank = _replay(spec.name, depth, m, tuple(sorted(spec.kwargs.items()))).chunk_rank
    base = balanced([f + b for f, b in zip(fwd, bwd)], spec.chunk_count(depth))
    if rng.random() < 0.3:  # a partition a switch has moved away from the balanced one
        base = rng.choice(neighbour_candidates(base, chunk_rank) or [base])
    cands = neighbour_candidates(base, chunk_rank)
    costs = CostModel(tuple(fwd), tuple(bwd), tuple(act), tuple(params), bandwidth, 20e-6, tuple(slowdown))
    times = iteration_times(spec, depth, m, costs, [base, *cands])
    advance = F.ahead(spec.name, depth, m, spec.kwargs.get("advance_num", 0))
    return Scenario(
        fwd, bwd, act, params, depth, m, spec.name, advance, chunk_rank, slowdown, bandwidth, rows, seen_slow, seen_bw, base, cands, times
    )


def scenario(rng: random.Random, depth: int, schedule: Optional[str] = None) -> Scenario:
    """One environment under one load (the draws in the order the shipped weights were made with)."""
    return draw_state(rng, draw_environment(rng, depth, schedule))


def _one(job: tuple[int, int, int]) -> Scenario:
    seed, depth, i = job
    return scenario(random.Random(seed * 1_000_003 + i), depth)  # one stream per scenario: any worker count, same data


def generate(count: int, depth: int, seed: int, workers: int = 1) -> list[Scenario]:
    jobs = [(seed, depth, i) for i in range(count)]
    if workers <= 1:
        return [_one(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_one, jobs, chunksize=8)


def samples(scenarios: Sequence[Scenario]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, cands, ys = [], [], []
    for s in scenarios:
        for bounds, t in zip([s.base, *s.candidates], s.times):
            seqs.append(s.rows)
            cands.append(s.candidate_row(bounds))
            ys.append(math.log(t / s.t0))
    seq, cand = F.as_tensors(seqs, cands)
    return seq, cand, torch.tensor(ys)


def _batches(sizes: Sequence[int], order: torch.Tensor, size: int):
    """Sample indices in batches of about `size` samples made of whole scenarios (a scenario's
    candidates together, for the pairwise loss), with each sample's scenario within the batch."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    idx: list[int] = []
    group: list[int] = []
    for g in order.tolist():
        idx.extend(range(starts[g], starts[g + 1]))
        group.extend([group[-1] + 1 if group else 0] * sizes[g])
        if len(idx) >= size:
            yield torch.tensor(idx), torch.tensor(group)
            idx, group = [], []
    if idx:
        yield torch.tensor(idx), torch.tensor(group)


def _pairwise(pred: torch.Tensor, target: torch.Tensor, group: torch.Tensor, sharpness: float) -> torch.Tensor:
    """RankNet's logistic loss over every ordered pair of one scenario's partitions, averaged per scenario."""
    losses = []
    for g in range(int(group[-1]) + 1):
        p, t = pred[group == g], target[group == g]
        slower = (t[:, None] - t[None, :]) > 0  # partition i takes longer than j
        if slower.any():
            losses.append(torch.nn.functional.softplus(-sharpness * (p[:, None] - p[None, :]))[slower].mean())
    return torch.stack(losses).mean() if losses else pred.sum() * 0


def train_predictor(
    train: Sequence[Scenario], depth: int, epochs: int = 40, seed: int = 0, pairwise: float = 0.03, sharpness: float = 300.0
) -> SpeedPredictor:
    """Adam on log(T / T0), in batches of whole scenarios, with two losses of ours:

    - Huber on the log time (squared within 0.1 of the label, linear beyond), so the few partitions
      the simulator times far from their neighbours (a slow link, a starved stage) do not pull the fit;
    - `pairwise` x RankNet's loss over each scenario's pairs of partitions: a decision reads the
      candidates' order, and half of a scenario's candidates lie within 0.1% of another one, which
      small level errors reorder; `sharpness` (per unit of log time) stops pushing a pair apart once
      it is ordered by a percent or two, so the level stays the Huber term's."""
    torch.manual_seed(seed)
    model = SpeedPredictor(depth)
    seq, cand, y = samples(train)
    sizes = [1 + len(s.candidates) for s in train]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx, group in _batches(sizes, torch.randperm(len(sizes), generator=generator), 256):
            pred, target = model(seq[idx], cand[idx]), y[idx]
            loss = torch.nn.functional.huber_loss(pred, target, delta=0.1)
            if pairwise:
                loss = loss + pairwise * _pairwise(pred, target, group, sharpness)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        schedule.step()
    return model.eval()


def evaluate_predictor(model: SpeedPredictor, held: Sequence[Scenario]) -> dict[str, float]:
    """Mean relative error of the predicted iteration time and the median Spearman over each
    scenario's candidates (what a decision needs: their order)."""
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
        "median_relative_error": float(rel.median()),
        "median_spearman_over_candidates": correlations[len(correlations) // 2] if correlations else float("nan"),
        "samples": len(y),
        "scenarios": len(held),
    }


def constant_log_ratio(train: Sequence[Scenario]) -> float:
    """The constant predictor: the training set's mean log(T / T0)."""
    return float(samples(train)[2].mean())


def constant_error(constant: float, held: Sequence[Scenario]) -> float:
    """The mean relative error of predicting `constant` (a `constant_log_ratio`) for every partition."""
    _, _, y = samples(held)
    return float((torch.exp(constant - y) - 1).abs().mean())


def evaluate_by_schedule(model: SpeedPredictor, constant: float, held: Sequence[Scenario]) -> dict[str, dict]:
    """`evaluate_predictor` and the constant's error on each schedule's held-out scenarios alone."""
    out = {}
    for name in F.SCHEDULES:
        part = [s for s in held if s.schedule == name]
        if part:
            out[name] = {**evaluate_predictor(model, part), "constant_mean_relative_error": constant_error(constant, part)}
    return out


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
    p.add_argument("--depths", default="2,4,8")
    p.add_argument("--scenarios", type=int, default=3000, help="simulated scenarios per depth (each labels ~10-150 partitions)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="processes simulating the scenarios (the data does not depend on it)")
    p.add_argument(
        "--predictors-only", action="store_true", help="train only the listed depths' predictors (keep arbiter.pt, switch_cost.pt)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    report: dict = {
        "scenarios_per_depth": args.scenarios,
        "held_out_scenarios_per_depth": max(50, args.scenarios // 5),
        "epochs": args.epochs,
        "seed": args.seed,
        "schedules": list(F.SCHEDULES),
        "depths": {},
    }
    if args.predictors_only and (out / "report.json").is_file():  # add to what is there
        report = json.loads((out / "report.json").read_text())
    arbiter_data: list[Decision] = []
    for depth in (int(d) for d in args.depths.split(",")):
        started = time.perf_counter()
        data = generate(args.scenarios, depth, seed=args.seed + depth, workers=args.workers)
        held = generate(max(50, args.scenarios // 5), depth, seed=args.seed + 1000 + depth, workers=args.workers)
        simulated = time.perf_counter() - started
        started = time.perf_counter()
        model = train_predictor(data, depth, args.epochs, args.seed)
        trained = time.perf_counter() - started
        path = out / f"predictor_d{depth}.pt"
        save(model, path)
        constant = constant_log_ratio(data)
        scores = evaluate_predictor(model, held)
        scores["constant_mean_relative_error"] = constant_error(constant, held)
        report["depths"][str(depth)] = {
            "simulate_seconds": simulated,
            "train_seconds": trained,
            "file_bytes": path.stat().st_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "training_samples": sum(1 + len(s.candidates) for s in data),
            "constant_log_ratio": constant,  # the constant predictor, for comparisons on new data
            "held_out": scores,
            "held_out_by_schedule": evaluate_by_schedule(model, constant, held),
        }
        print(f"depth {depth}: {json.dumps(report['depths'][str(depth)])}", flush=True)
        if args.predictors_only:
            continue
        more = generate(max(200, args.scenarios // 2), depth, seed=args.seed + 2000 + depth, workers=args.workers)
        arbiter_data += decisions(model, more, args.seed + depth)
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
