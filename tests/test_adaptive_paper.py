"""AutoPipe-RL's learning as the paper defines it: per-layer inputs with the layer-count array,
meta-learning across environments (Reptile), the arbiter on Table 1's metrics and both partitions
with its online update from measured rewards, and the switching-cost meta-network. Each test holds
one step: it fails if the step is taken out."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from lightning_pipe.adaptive import meta
from lightning_pipe.adaptive import paper_data as D
from lightning_pipe.adaptive import paper_features as P
from lightning_pipe.adaptive import paper_predictor as N
from lightning_pipe.adaptive.paper_arbiter import PaperArbiter, features, inputs

L = P.L_MAX


def test_static_row_is_per_layer_and_padded():
    out, grad, params = [1e6, 2e6, 1e7, 1e5, 1e4], [0.0, 1e6, 2e6, 1e7, 1e5], [1e8, 1e6, 1e6, 1e6, 1e7]
    row = P.static_row(out, grad, params, depth=2)
    assert len(row) == P.static_width()
    assert row[:2] == [5 / L, 2 / 8]  # L and N
    assert row[2 : 2 + L] == [1.0] * 5 + [0.0] * (L - 5)  # which layers exist
    for k, values in enumerate((out, grad, params)):
        block = row[2 + L * (k + 1) : 2 + L * (k + 2)]
        assert block[:5] == pytest.approx([math.log10(max(v, 1.0)) - 6 for v in values])
        assert block[5:] == [0.0] * (L - 5)
    with pytest.raises(ValueError, match=f"at most {L} layers"):
        P.static_row([1.0] * (L + 1), [1.0] * (L + 1), [1.0] * (L + 1), 2)


def test_dynamic_row_holds_bandwidth_and_each_layers_time_on_each_worker():
    forward, backward = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0]
    t0 = 4 * (sum(forward) + sum(backward)) / 2  # M = 4, N = 2
    row = P.dynamic_row(forward, backward, 4, speed=[1.0, 3.0], bandwidth=[1e9, 1e8], t0=t0)
    assert len(row) == P.dynamic_width(2)
    assert row[:2] == pytest.approx([1.0, 0.0])  # log10(B) - 8
    unit = t0 / 3
    fp_worker1 = row[2 + L : 2 + L + 3]  # FP_{1, j}: worker 1 runs every layer 3x slower than profiled
    assert fp_worker1 == pytest.approx([4 * f * 3.0 / unit for f in forward])
    bp_worker0 = row[2 + 2 * L : 2 + 2 * L + 3]
    assert bp_worker0 == pytest.approx([4 * b / unit for b in backward])
    assert P.worker_bandwidth([5e8, 2e8], 3) == [5e8, 2e8, 2e8]


def test_the_partition_is_the_layer_count_array():
    assert P.layer_counts(((0, 3), (3, 5)), 2) == [3, 2]
    with pytest.raises(ValueError, match="one chunk per worker"):
        P.layer_counts(((0, 1), (1, 2), (2, 3), (3, 5)), 2)  # interleaved: two chunks per worker
    # every encoded sample of a scenario: the same static part, then its own layer-count array
    ((states, _),) = D.environments(1, 2, seed=3)
    enc = D.speed_samples(states[:1])
    s = states[0]
    for row, bounds in zip(enc.rest.tolist(), D.partitions(s)):
        assert row[: P.static_width()] == pytest.approx(D.static(s))
        assert row[P.static_width() :] == pytest.approx([(hi - lo) / L for lo, hi in bounds])
    assert len({tuple(r[P.static_width() :]) for r in enc.rest.tolist()}) == len(D.partitions(s)), "each partition reads differently"


def _tasks(rng: random.Random, n: int) -> list:
    """Linear tasks y = a x + b around a = 3, b = -2: what the environments share, which Reptile's
    initialisation should find."""
    out = []
    for _ in range(n):
        a, b = 3 + rng.uniform(-0.3, 0.3), -2 + rng.uniform(-0.3, 0.3)
        x = torch.linspace(-1, 1, 16).unsqueeze(1)
        out.append((x, a * x.squeeze(1) + b))
    return out


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x).squeeze(1) - y).pow(2).mean()


def test_reptile_outer_update_moves_the_initialisation_toward_the_adapted_weights():
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    before = [p.detach().clone() for p in model.parameters()]
    task = _tasks(random.Random(0), 1)[0]
    adapted = nn.Linear(1, 1)
    adapted.load_state_dict(model.state_dict())
    meta.adapt(adapted, _loss, task, 5, 0.1, 16, torch.Generator().manual_seed(7))
    meta.reptile_step(model, _loss, task, 5, 0.1, 16, 0.25, torch.Generator().manual_seed(7))
    for p, q, p0 in zip(model.parameters(), adapted.parameters(), before):
        assert not torch.equal(p, p0)
        assert torch.allclose(p, p0 + 0.25 * (q - p0)), "theta <- theta + epsilon (theta_k - theta)"


def test_meta_learned_initialisation_adapts_better_to_a_new_environment():
    torch.manual_seed(0)
    start = nn.Linear(1, 1)
    with torch.no_grad():
        start.weight.fill_(-4.0)
        start.bias.fill_(5.0)
    learned = nn.Linear(1, 1)
    learned.load_state_dict(start.state_dict())
    meta.reptile(learned, _tasks(random.Random(1), 20), _loss, meta_steps=60, inner_steps=5, inner_lr=0.1, batch=16)
    new = _tasks(random.Random(2), 5)

    def after_adaptation(init: nn.Module) -> float:
        losses = []
        for task in new:
            model = nn.Linear(1, 1)
            model.load_state_dict(init.state_dict())
            meta.adapt(model, _loss, task, 3, 0.1, 16, torch.Generator().manual_seed(0))
            losses.append(float(_loss(model, task).detach()))
        return sum(losses) / len(losses)

    assert after_adaptation(learned) < 0.1 * after_adaptation(start)


def test_arbiter_reads_table_1_and_both_partitions():
    ((states, _),) = D.environments(1, 2, seed=3)
    s = states[0]
    now, new = P.partition_row(s.base, 2), P.partition_row(s.candidates[0], 2)
    x = features(D.static(s), D.window(s)[-1], now, new)
    assert len(x) == inputs(2)
    assert x[-4:] == now + new
    arbiter = PaperArbiter(2)
    assert arbiter.probability(x) != arbiter.probability(features(D.static(s), D.window(s)[-1], now, now)), "the new partition is read"


@pytest.mark.parametrize("switched, reward, up", [(True, 0.3, True), (True, -0.3, False), (False, 0.3, False)])
def test_arbiter_online_update_moves_the_policy_toward_the_measured_reward(switched, reward, up):
    torch.manual_seed(0)
    arbiter = PaperArbiter(2, lr=1e-2)
    x = [random.Random(k).uniform(-1, 1) for k in range(inputs(2))]
    before = arbiter.probability(x)
    for _ in range(3):
        arbiter.online_update(x, switched, reward)
    after = arbiter.probability(x)
    assert (after > before + 1e-3) if up else (after < before - 1e-3), (before, after)


def test_switch_cost_samples_read_both_partitions_and_label_the_moved_bytes():
    ((states, switching),) = D.environments(1, 2, seed=5)
    s = states[0]
    enc = D.cost_samples(states[:1], switching)
    row, bounds = enc.rest[0].tolist(), s.candidates[0]
    assert row[-4:] == pytest.approx(P.partition_row(s.base, 2) + P.partition_row(bounds, 2))
    (_, cut), (new_cut, _) = s.base[0], bounds[1]
    moved = sum(s.param_bytes[b] for b in range(min(cut, new_cut), max(cut, new_cut)))
    expected = switching.fixed_s + switching.state_copies * moved / (switching.efficiency * s.bandwidth)
    assert float(enc.y[0]) == pytest.approx(math.log10(expected), rel=1e-5)


def test_online_adaptation_fits_a_measured_switch():
    torch.manual_seed(0)
    envs = D.environments(2, 2, seed=6)
    net = N.switch_cost(2).eval()
    enc = D.cost_samples(envs[0][0], envs[0][1])
    task = enc.task(torch.arange(2))
    before = float(N.mse(net, task).detach())
    meta.adapt(net, N.mse, task, 10, 1e-3, 2, torch.Generator().manual_seed(0))
    assert float(N.mse(net, task).detach()) < 0.5 * before


def test_shipped_paper_weights_load_and_a_wrong_depth_is_named(tmp_path):
    import shutil

    from lightning_pipe.adaptive.paper_offline import load
    from lightning_pipe.adaptive.predictor import WEIGHTS

    for depth in (2, 4):
        for name in ("predictor", "switch_cost", "arbiter"):
            assert load(None, name, depth).depth == depth
    shutil.copy(WEIGHTS / "paper_predictor_d2.pt", tmp_path / "paper_predictor_d4.pt")
    with pytest.raises(ValueError, match="paper_predictor_d4.pt: made for l_max 24, depth 2"):
        load(tmp_path, "predictor", 4)


def test_shipped_paper_predictor_on_fresh_environments():
    # environments no run has seen: the shipped weights order one load's partitions (an untrained
    # network: 0.46) and predict their median time below the constant's error (untrained: 47% vs 34%)
    from lightning_pipe.adaptive.paper_offline import load, speed_scores

    held = D.environments(12, 2, seed=31_000)
    enc = D.speed_samples([s for states, _ in held for s in states])
    with torch.no_grad():
        scores = speed_scores(load(None, "predictor", 2)(enc.sequence, enc.rest), enc)
    constant = speed_scores(torch.full_like(enc.y, float(enc.y.mean())), enc)
    assert scores["median_relative_error"] < 0.6 * constant["median_relative_error"], (scores, constant)
    assert scores["median_spearman"] >= 0.75, scores


def test_offline_training_starts_from_the_meta_learned_initialisation():
    # the paper's order: meta-learning first, then offline training from where it left the network
    from lightning_pipe.adaptive.paper_offline import train

    tasks = [D.speed_samples(states).task() for states, _ in D.environments(2, 2, seed=8)]

    def trained(meta_steps: int, epochs: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in train(lambda: N.speed_predictor(2), tasks, meta_steps, epochs, seed=0).parameters()]

    torch.manual_seed(0)
    init = [p.detach().clone() for p in N.speed_predictor(2).parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(trained(2, 0), init)), "Reptile changed the initialisation"
    assert any(not torch.equal(a, b) for a, b in zip(trained(2, 1), trained(0, 1))), "offline training starts from it"
