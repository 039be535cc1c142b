"""bench_emulated's setting, small: emulated ranks (blocks that sleep) train exactly as one process.

Four gloo processes run two multi-chunk schedules of benchmarks/bench_emulated.py's grid on a model
of EmulatedBlocks and PacedBlocks (a float64 Linear each, 0.2 / 0.4 ms of emulated time); after three SGD steps every
rank's weights, and the last rank's losses, equal one process training the same model on the
same batches (the blocks without sleeps) to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed

from benchmarks.harness.emulated import emulated_model
from lightning_pipe.planning import partition_blocks
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import build_schedule

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

BLOCKS, WIDTH, STEPS, LR = 16, 8, 3, 0.1
# (schedule, options, micro-batches, PacedBlock or EmulatedBlock): the benchmark runs PacedBlocks
CASES = [("interleaved", {"chunks": 2}, 8, False), ("hanayo", {"waves": 2}, 4, True)]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        x = torch.randn(16, WIDTH, generator=g, dtype=torch.float64)
        out.append((x, torch.sin(x.flip(1))))
    return out


def one_process() -> tuple[dict, list[float]]:
    model = emulated_model(BLOCKS, WIDTH, 0.0, 0.0, seed=4)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def train(rank: int, world: int) -> list[tuple[dict, list[float]]]:
    transport = Transport(lambda r: r, torch.device("cpu"))
    out = []
    for name, options, m, paced in CASES:
        schedule = build_schedule(name, world, m, **options)
        bounds = partition_blocks("uniform", BLOCKS, schedule.num_chunks).bounds
        model = emulated_model(BLOCKS, WIDTH, 2e-4, 4e-4, seed=4, paced=paced)
        chunks = {c: model[bounds[c][0] : bounds[c][1]] for c in schedule.chunks_of(rank)}
        pipe = SequentialPipeline(schedule, rank, SequentialHost(chunks, schedule.num_chunks - 1, F.mse_loss), transport)
        opt = torch.optim.SGD([p for c in chunks.values() for p in c.parameters()], lr=LR)
        losses = []
        for x, y in batches():
            opt.zero_grad()
            loss = pipe.step(x, y)
            opt.step()
            if loss is not None:
                losses.append(loss.item())
        mine = {i for c in chunks for i in range(*bounds[c])}
        out.append(({k: v for k, v in model.state_dict().items() if int(k.split(".")[0]) in mine}, losses))
    return out


def test_emulated_ranks_train_as_one_process():
    reference, ref_losses = one_process()
    ranks = run_distributed(train, 4, timeout=90)
    for i, (name, options, m, _) in enumerate(CASES):
        got: dict = {}
        losses = []
        for part in ranks:
            weights, rank_losses = part[i]
            got.update(weights)
            losses += rank_losses
        assert got.keys() == reference.keys(), f"{name}: every block is trained by exactly one rank"
        for k, ref in reference.items():
            rel = ((got[k] - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-10, f"{name} {options} m={m}: {k} differs from one process by {rel:.2e}"
        assert losses == pytest.approx(ref_losses, rel=1e-10), f"{name}: the last rank's losses"
