"""The runtime on real gloo processes reproduces single-process training (plain PyTorch, no Lightning)."""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist import run_distributed
from models import masked_blocks, max_rel_diff, mlp_blocks
from torch import nn

from lightning_pipe.planning import partition_blocks
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import build_schedule

UNEVEN = {2: [1, 5], 3: [1, 2, 3], 4: [3, 1, 1, 1]}


def batches(kind: str, dtype: torch.dtype):
    """Three steps; the masked kind changes sequence length and ends on a short batch (renegotiation)."""
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [(torch.randn(10, 8, generator=g, dtype=dtype), torch.randint(0, 3, (10,), generator=g)) for _ in range(3)]
    shapes = [(10, 5), (10, 7), (7, 4)]
    return [(torch.randint(0, 17, s, generator=g), torch.randint(0, 3, (s[0],), generator=g)) for s in shapes]


def build(kind: str, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return (mlp_blocks() if kind == "mlp" else masked_blocks()).to(dtype)


def reference(kind: str, dtype: torch.dtype) -> dict:
    model = build(kind, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(kind, dtype):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def train_stage(rank: int, world: int, configs: list) -> list[dict]:
    results = []
    for kind, dtype, schedule, partition, m in configs:
        model = build(kind, dtype)
        start, stop = partition_blocks(partition, len(model), world).bounds[rank]
        chunk = nn.Sequential(*[model[i] for i in range(start, stop)])
        host = SequentialHost({rank: chunk}, world - 1, nn.functional.cross_entropy)
        pipe = SequentialPipeline(build_schedule(schedule, world, m), rank, host, Transport(lambda r: r, torch.device("cpu")))
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
        for x, y in batches(kind, dtype):
            opt.zero_grad()
            pipe.step(x, y)
            opt.step()
        results.append({k: v for k, v in model.state_dict().items() if start <= int(k.split(".")[0]) < stop})
    return results


def check(world: int, configs: list) -> None:
    per_rank = run_distributed(train_stage, world, configs, timeout=240)
    for i, (kind, dtype, schedule, partition, m) in enumerate(configs):
        got = {}
        for rank_results in per_rank:
            got.update(rank_results[i])
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        err = max_rel_diff(reference(kind, dtype), got)
        assert err <= tol, f"{schedule} world={world} partition={partition} m={m} {kind} {dtype}: rel err {err:.2e} > {tol}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gpipe_and_1f1b_equal_single_process(world):
    configs = [
        ("mlp", torch.float64, schedule, partition, m)
        for schedule, partition, m in itertools.product(["gpipe", "1f1b"], ["uniform", UNEVEN[world]], [1, 3, 4])
    ]
    configs += [("mlp", torch.float32, schedule, "uniform", 4) for schedule in ["gpipe", "1f1b"]]
    check(world, configs)


@pytest.mark.parametrize("world", [2, 3])
def test_tuple_activation_with_integer_mask_and_changing_shapes(world):
    configs = [("masked", torch.float64, schedule, "uniform", 3) for schedule in ["gpipe", "1f1b"]]
    check(world, configs)


def traced_step(rank: int, world: int) -> list:

    model = build("mlp", torch.float64)
    start, stop = partition_blocks("uniform", len(model), world).bounds[rank]
    chunk = nn.Sequential(*[model[i] for i in range(start, stop)])
    host = SequentialHost({rank: chunk}, world - 1, nn.functional.cross_entropy)
    pipe = SequentialPipeline(build_schedule("1f1b", world, 4), rank, host, Transport(lambda r: r, torch.device("cpu")))
    pipe.executor.trace = True
    x, y = batches("mlp", torch.float64)[0]
    pipe.step(x, y)
    return pipe.executor.records


def test_trace_records_every_compute_and_send():
    from lightning_pipe.viz import traced_timeline

    schedule = build_schedule("1f1b", 2, 4)
    records = run_distributed(traced_step, 2, timeout=120)
    for rank, recs in enumerate(records):
        traced = [schedule.actions[rank][i] for i, _, _ in recs]
        expected = [a for a in schedule.actions[rank] if a.op.is_compute or a.op.is_send]
        assert sorted(map(str, traced)) == sorted(map(str, expected))
        computes = [(s, e) for i, s, e in recs if schedule.actions[rank][i].op.is_compute]
        assert all(s <= e for s, e in computes) and all(a[1] <= b[0] for a, b in zip(computes, computes[1:]))
    timeline = traced_timeline(schedule, records)
    assert timeline.iteration_time > 0 and len(timeline.computes()) == 2 * 2 * 4
