"""Zero-bubble schedules on real gloo processes train to one process's weights (fp64 <= 1e-10):
ZB-H1, ZB-V and the paper's heuristic's schedules in plain PyTorch on 2 and 4 ranks, and through
the Trainer (tied weights, recomputation)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from models import START, LitSeq, loader, masked_blocks, max_rel_diff, mlp_blocks
from test_strategy import pipelined, single
from torch import nn

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.planning import partition_blocks
from lightning_pipe.planning.zero_bubble import zero_bubble_auto
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel

pytestmark = pytest.mark.multiprocess


def build(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return (mlp_blocks(8) if kind == "mlp" else masked_blocks(mixes=6)).double()


def batches(kind: str):
    """Three steps; the masked kind changes sequence length (shape headers) and ends on a short batch."""
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [(torch.randn(10, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)) for _ in range(3)]
    return [(torch.randint(0, 17, s, generator=g), torch.randint(0, 3, (s[0],), generator=g)) for s in [(10, 5), (10, 7), (7, 4)]]


def reference(kind: str) -> dict:
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(kind):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def train(rank: int, world: int, configs: list) -> list[dict]:
    out = []
    for kind, name, partition, m in configs:
        model = build(kind)
        schedule = heuristic(world, m) if name == "zb-auto" else build_schedule(name, world, m)
        bounds = partition_blocks(partition, len(model), schedule.num_chunks).bounds
        chunks = {c: nn.Sequential(*model[slice(*bounds[c])]) for c in schedule.chunks_of(rank)}
        host = SequentialHost(chunks, schedule.num_chunks - 1, nn.functional.cross_entropy)
        pipe = SequentialPipeline(schedule, rank, host, Transport(lambda r: r, torch.device("cpu")))
        opt = torch.optim.AdamW([p for c in chunks.values() for p in c.parameters()], lr=1e-2)
        for x, y in batches(kind):
            opt.zero_grad()
            pipe.step(x, y)
            opt.step()
        mine = {b for c in chunks for b in range(*bounds[c])}
        out.append({k: v for k, v in model.state_dict().items() if int(k.split(".")[0]) in mine})
    return out


def heuristic(world: int, m: int):
    """The paper's heuristic on an uneven profile (the same on every rank: a pure function of it)."""
    f, b, w = (1.0, 1.5, 0.7, 1.2)[:world], (2.0, 2.5, 1.6, 3.0)[:world], (0.7, 1.2, 0.5, 1.0)[:world]
    costs = CostModel(f, b, activation_bytes=(1.0,) * world, weight=w)
    return zero_bubble_auto(costs, [(i, i + 1) for i in range(world)], m, memory_limit=world + 0.5, weight_copies=0)[0]


UNEVEN = {2: {"zb-h1": [1, 7], "zb-v": [1, 3, 3, 1]}, 4: {"zb-h1": [3, 1, 2, 2], "zb-v": [1, 1, 1, 1, 1, 1, 1, 1]}}


@pytest.mark.parametrize("world", [2, 4])
def test_zero_bubble_schedules_equal_one_process(world):
    configs = [
        (kind, name, partition, m)
        for name in ("zb-h1", "zb-v")
        for kind, partition, m in [
            ("mlp", "uniform", 1),
            ("mlp", UNEVEN[world][name], 3),
            ("mlp", "uniform", 2 * world),
            ("masked", "uniform", 4),
        ]
    ]
    configs += [("mlp", "zb-auto", UNEVEN[world]["zb-h1"], 2 * world + 1), ("masked", "zb-auto", "uniform", 3)]
    per_rank = run_distributed(train, world, configs, timeout=240)
    for i, (kind, name, partition, m) in enumerate(configs):
        got = {k: v for part in per_rank for k, v in part[i].items()}
        err = max_rel_diff(reference(kind), got)
        assert err <= 1e-10, f"{name} world={world} {kind} partition={partition} m={m}: rel err {err:.2e}"


@pytest.mark.parametrize("schedule,devices,kw", [("zb-h1", 2, dict(tied=True)), ("zb-v", 2, dict(recompute=True)), ("zb-h1", 4, {})])
def test_zero_bubble_through_the_trainer(tmp_path, schedule, devices, kw):
    tied = kw.pop("tied", False)
    ref = LitSeq(tied=tied)
    single(ref, train=loader(tied=tied), gradient_clip_val=0.05)  # clipping: the global norm counts every W's gradient
    model = LitSeq(tied=tied)
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=4, start_method=START, **kw)
    pipelined(model, devices, train=loader(tied=tied), strategy=strategy, gradient_clip_val=0.05, default_root_dir=tmp_path)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
