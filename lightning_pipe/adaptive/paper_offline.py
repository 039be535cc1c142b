"""The paper's learning procedure (AutoPipe-RL §4.2-4.3) for its three networks, and their comparison
with ours (`offline.py`'s shipped weights) on the same held-out environments.

    python -m lightning_pipe.adaptive.paper_offline --out lightning_pipe/adaptive/weights

writes paper_predictor_d{2,4}.pt, paper_switch_cost_d{2,4}.pt, paper_arbiter_d{2,4}.pt and
paper_report.json (every number docs/results/adaptive.md quotes). The steps, in the paper's order:

1. meta-learning across environments (`meta.reptile`) -> the meta-networks' initialisation;
2. offline training: the predictor and the switch-cost network on every training environment's
   samples from that initialisation; the arbiter by policy gradient on decisions made with them
   (its reward's switching cost from the switch-cost network);
3. online adaptation on the running job: the meta-networks by the few steps of `meta.adapt` on what
   the job measured (its running partition's times under earlier loads, its measured switches), the
   arbiter by `PaperArbiter.online_update` on each measured reward. Measured here on held-out
   environments; "before" and "after" are the same held-out samples.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import meta
from . import paper_data as D
from . import paper_features as P
from . import paper_predictor as N
from .arbiter import arbiter_features, cost_features
from .learned import load_learned
from .offline import samples
from .paper_arbiter import PaperArbiter, features
from .predictor import WEIGHTS, save
from .stats import spearman

HORIZON = 100  # iterations a decision's switching cost is spread over (the reward's normalisation)
ONLINE_STEPS = 5  # online adaptation: gradient steps on what the job measured (Reptile's inner loop, which it prepares)


def supervised(model, task, epochs: int, seed: int, lr: float = 1e-3, batch: int = 128):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(task[-1]), generator=generator)
        for k in range(0, len(order), batch):
            loss = N.mse(model, tuple(t[order[k : k + batch]] for t in task))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def train(make: Callable[[], torch.nn.Module], tasks: Sequence, meta_steps: int, epochs: int, seed: int):
    """Steps 1 and 2: Reptile across the environments' tasks, then offline training on all of them.
    The network is made here, after seeding: its initial weights do not depend on what ran before."""
    torch.manual_seed(seed)
    model = make()
    if meta_steps:
        meta.reptile(model, tasks, N.mse, meta_steps, seed=seed)
    if epochs:
        supervised(model, tuple(torch.cat(parts) for parts in zip(*tasks)), epochs, seed)
    return model.eval()


def speed_scores(pred: torch.Tensor, enc: D.Encoded) -> dict[str, float]:
    """Relative error of the predicted times (from log(T / T0)), and the median over loads of the
    Spearman correlation across one load's partitions (what a decision reads)."""
    rel = (torch.exp(pred - enc.y) - 1).abs()
    rho = []
    for g in enc.group.unique().tolist():
        mine = enc.group == g
        if int(mine.sum()) >= 3:
            r = spearman(pred[mine].tolist(), enc.y[mine].tolist())
            rho.append(r if math.isfinite(r) else 0.0)
    rho.sort()
    return {
        "mean_relative_error": float(rel.mean()),
        "median_relative_error": float(rel.median()),
        "median_spearman": rho[len(rho) // 2] if rho else float("nan"),
    }


def _last_state(enc: D.Encoded) -> torch.Tensor:
    return enc.group == D.STATES - 1


def predictor_online(model, held: Sequence, ours: bool = False) -> dict[str, dict]:
    """Every held-out environment's last load (all its partitions), predicted before and after
    `ONLINE_STEPS` of adaptation on the running partition's measured times under its earlier loads
    (the paper: the whole network by `meta.adapt`; ours: the output layer, as `LearnedScorer`)."""
    before, after, parts = [], [], []
    for states, _ in held:
        enc = D.speed_samples(states)
        inputs = samples(states)[:2] if ours else (enc.sequence, enc.rest)
        support = enc.base & ~_last_state(enc)
        query = _last_state(enc)
        with torch.no_grad():
            before.append(model(*inputs)[query])
        tuned = copy.deepcopy(model)
        task = (inputs[0][support], inputs[1][support], enc.y[support])
        if ours:  # LearnedScorer's adaptation: Adam on the output layer, MSE
            optimizer = torch.optim.Adam(tuned.head[-1].parameters(), lr=1e-3)
            for _ in range(ONLINE_STEPS):
                loss = N.mse(tuned, task)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        else:
            meta.adapt(tuned, N.mse, task, ONLINE_STEPS, 1e-3, len(task[-1]), torch.Generator().manual_seed(0))
        with torch.no_grad():
            after.append(tuned(*inputs)[query])
        parts.append(
            D.Encoded(enc.sequence[query], enc.rest[query], enc.y[query], torch.full((int(query.sum()),), len(parts)), enc.base[query])
        )
    joined = D.Encoded(*(torch.cat([getattr(p, f) for p in parts]) for f in ("sequence", "rest", "y", "group", "base")))
    return {"before": speed_scores(torch.cat(before), joined), "after": speed_scores(torch.cat(after), joined)}


def cost_online(model, held: Sequence, ours_cost=None) -> dict[str, float]:
    """Mean relative error of the predicted switch seconds on each held-out environment's last load,
    before and after 1 and 3 measured switches (the paper: `meta.adapt` on the switches measured so
    far; ours: `SwitchCost.adapt` on each)."""
    out: dict[str, list] = {"before": [], "after_1": [], "after_3": []}
    for states, switching in held:
        enc = D.cost_samples(states, switching)
        raw = D.ours_cost_inputs(states)
        x = P.as_tensor([cost_features(*r) for r in raw])
        measured = [i for i in range(len(enc.y)) if int(enc.group[i]) < D.STATES - 1][:3]
        query = _last_state(enc)
        tuned = copy.deepcopy(ours_cost if ours_cost is not None else model)
        for k in (0, 1, 3):
            if k:
                seen = torch.tensor(measured[:k])
                if ours_cost is not None:
                    for i in measured[(1 if k == 3 else 0) : k]:
                        tuned.adapt(*raw[i], seconds=10 ** float(enc.y[i]))
                else:
                    tuned = copy.deepcopy(model)
                    task = (enc.sequence[seen], enc.rest[seen], enc.y[seen])
                    meta.adapt(tuned, N.mse, task, ONLINE_STEPS, 1e-3, k, torch.Generator().manual_seed(0))
            with torch.no_grad():
                pred = tuned(x[query]) if ours_cost is not None else tuned(enc.sequence[query], enc.rest[query])
            out["before" if k == 0 else f"after_{k}"].append((torch.pow(10.0, pred - enc.y[query]) - 1).abs())
    return {k: float(torch.cat(v).mean()) for k, v in out.items()}


def reward(now: float, new: float, cost: float) -> float:
    """The paper's: the speed after switching relative to staying, less the normalised switching cost."""
    return now / new - 1 - cost / (now * HORIZON)


def paper_choices(predictor, cost_net, envs: Sequence) -> list[dict]:
    """Per held state: the paper predictor's best candidate, what the paper's arbiter reads, the
    offline reward (its cost from the switch-cost network) and the true one (the environment's)."""
    out = []
    for states, switching in envs:
        for s in states:
            if not s.candidates:
                continue
            speed, cost = D.speed_samples([s]), D.cost_samples([s], switching)
            with torch.no_grad():
                k = int(predictor(speed.sequence, speed.rest)[1:].argmin())
                predicted_cost = 10 ** float(cost_net(cost.sequence[k : k + 1], cost.rest[k : k + 1])[0])
            best = s.candidates[k]
            x = features(D.static(s), D.window(s)[-1], P.partition_row(s.base, s.depth), P.partition_row(best, s.depth))
            true = [reward(s.times[0], t, switching.seconds(D.moved_bytes(s, c), s.bandwidth)) for c, t in zip(s.candidates, s.times[1:])]
            out.append({"x": x, "offline": reward(s.times[0], s.times[1 + k], predicted_cost), "true": true[k], "oracle": max(0.0, *true)})
    return out


def ours_rewards(depth: int, envs: Sequence) -> list[float]:
    """Ours (the shipped per-rank predictor, switch-cost MLP and arbiter) deciding on the same states."""
    learned = load_learned(None, depth)
    out = []
    for states, switching in envs:
        for s in states:
            if not s.candidates:
                continue
            seq, cand, _ = samples([s])
            with torch.no_grad():
                pred = [math.exp(float(v)) * s.t0 for v in learned.predictor(seq, cand)]
            k = min(range(len(s.candidates)), key=lambda i: pred[1 + i])
            best = s.candidates[k]
            moved = D.moved_bytes(s, best)
            cost = learned.switch_cost.seconds(moved, min(s.seen_bandwidth), len(D.offline._moved(s.base, best)))
            x = arbiter_features(pred[0], pred[1 + k], s.t0, cost, HORIZON, HORIZON, s.times[0])
            true = reward(s.times[0], s.times[1 + k], switching.seconds(moved, s.bandwidth))
            out.append(true if learned.arbiter.switch(x)[0] else 0.0)
    return out


def train_arbiter(choices: Sequence[dict], depth: int, epochs: int, seed: int) -> PaperArbiter:
    """REINFORCE with a mean baseline on the offline rewards; actions sampled, only the chosen one's reward seen."""
    torch.manual_seed(seed)
    arbiter = PaperArbiter(depth)
    x = torch.tensor([c["x"] for c in choices])
    r_switch = torch.tensor([c["offline"] for c in choices])
    optimizer = torch.optim.Adam(arbiter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        p = torch.sigmoid(arbiter(x))
        action = torch.bernoulli(p.detach(), generator=generator)
        r = action * r_switch
        arbiter.baseline = 0.9 * arbiter.baseline + 0.1 * float(r.mean())
        logp = torch.where(action > 0, torch.log(p + 1e-8), torch.log(1 - p + 1e-8))
        loss = -((r - arbiter.baseline) * logp).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return arbiter.eval()


def arbiter_online(arbiter: PaperArbiter, choices: Sequence[dict]) -> float:
    """Mean true reward over the held-out decisions in order, each measured reward updating the policy."""
    arbiter, total = copy.deepcopy(arbiter), 0.0
    for c in choices:
        switched = arbiter.switch(c["x"])[0]
        r = c["true"] if switched else 0.0
        total += r
        arbiter.online_update(c["x"], switched, r)
    return total / len(choices)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def depth_report(depth: int, args, out: Path) -> dict:
    started = time.perf_counter()
    train_envs = D.environments(args.envs, depth, args.seed + depth)
    held = D.environments(args.held, depth, args.seed + 1000 + depth)
    report: dict = {"environments": args.envs, "held_out_environments": args.held, "simulate_seconds": time.perf_counter() - started}
    held_speed = D.speed_samples([s for states, _ in held for s in states])
    tasks = [D.speed_samples(states).task() for states, _ in train_envs]
    variants = {"meta_then_offline": (args.meta_steps, args.epochs), "offline_only": (0, args.epochs), "meta_only": (args.meta_steps, 0)}
    predictors, report["predictor"] = {}, {}
    for name, (steps, epochs) in variants.items():
        started = time.perf_counter()
        model = predictors[name] = train(lambda: N.speed_predictor(depth), tasks, steps, epochs, args.seed)
        with torch.no_grad():
            scores = speed_scores(model(held_speed.sequence, held_speed.rest), held_speed)
        report["predictor"][name] = {**scores, "train_seconds": time.perf_counter() - started, "online": predictor_online(model, held)}
    ours = load_learned(None, depth)
    with torch.no_grad():
        scores = speed_scores(ours.predictor(*samples([s for states, _ in held for s in states])[:2]), held_speed)
    report["predictor"]["ours_per_rank"] = {**scores, "online": predictor_online(ours.predictor, held, ours=True)}
    constant = float(torch.cat([t[-1] for t in tasks]).mean())  # the training set's mean: what no input explains
    report["predictor"]["constant"] = speed_scores(torch.full_like(held_speed.y, constant), held_speed)
    cost_tasks = [D.cost_samples(states, switching).task() for states, switching in train_envs]
    costs, report["switch_cost"] = {}, {}
    for name, (steps, epochs) in variants.items():
        costs[name] = train(lambda: N.switch_cost(depth), cost_tasks, steps, epochs, args.seed)
        report["switch_cost"][name] = cost_online(costs[name], held)
    report["switch_cost"]["ours_mlp"] = cost_online(None, held, ours_cost=ours.switch_cost)
    started = time.perf_counter()
    arbiter = train_arbiter(paper_choices(predictors["meta_then_offline"], costs["meta_then_offline"], train_envs), depth, 3000, args.seed)
    choices = paper_choices(predictors["meta_then_offline"], costs["meta_then_offline"], held)
    report["arbiter"] = {
        "train_seconds": time.perf_counter() - started,
        "decisions": len(choices),
        "mean_reward": {
            "paper_offline": mean(c["true"] if arbiter.switch(c["x"])[0] else 0.0 for c in choices),
            "paper_online": arbiter_online(arbiter, choices),
            "ours": mean(ours_rewards(depth, held)),
            "never_switch": 0.0,
            "always_switch_paper_candidate": mean(c["true"] for c in choices),
            "oracle": mean(c["oracle"] for c in choices),
        },
    }
    for name, module in (("predictor", predictors["meta_then_offline"]), ("switch_cost", costs["meta_then_offline"]), ("arbiter", arbiter)):
        save(module, out / f"paper_{name}_d{depth}.pt")
    return report


def load(folder: Optional[Path], name: str, depth: int):
    """A shipped paper network (`name`: predictor, switch_cost or arbiter) for `depth`."""
    path = (folder or WEIGHTS) / f"paper_{name}_d{depth}.pt"
    blob = torch.load(path, map_location="cpu", weights_only=True)
    module = PaperArbiter(depth) if name == "arbiter" else (N.speed_predictor if name == "predictor" else N.switch_cost)(depth)
    if blob["meta"].get("l_max") != P.L_MAX or blob["meta"].get("depth") != depth:
        raise ValueError(f"adaptive weights {path}: made for l_max {blob['meta'].get('l_max')}, depth {blob['meta'].get('depth')}")
    module.load_state_dict(blob["state"])
    if name == "arbiter":
        module.baseline = blob["meta"]["baseline"]
    return module.eval()


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Meta-learn, train and compare the paper's predictor, switch-cost network and arbiter.")
    p.add_argument("--out", default=str(WEIGHTS))
    p.add_argument("--depths", default="2,4")
    p.add_argument(
        "--envs",
        type=int,
        default=750,
        help="training environments per depth, each with paper_data.STATES loads (750: as many scenarios as ours)",
    )
    p.add_argument("--held", type=int, default=60, help="held-out environments per depth")
    p.add_argument("--meta-steps", type=int, default=1500)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    report = {
        "meta_learning": "Reptile",
        "online_steps": ONLINE_STEPS,
        "horizon": HORIZON,
        "l_max": P.L_MAX,
        "args": vars(args),
        "depths": {},
    }
    for depth in (int(d) for d in args.depths.split(",")):
        report["depths"][str(depth)] = depth_report(depth, args, out)
        print(f"depth {depth}: {json.dumps(report['depths'][str(depth)])}", flush=True)
    (out / "paper_report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
