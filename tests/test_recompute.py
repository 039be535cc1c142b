"""Activation recomputation per pipeline stage (`recompute=`): exact, and really switched on.

The runtime function (`runtime.recompute.run_block`) on one process: the same gradients bit for
bit (dropout replayed from the stashed RNG state), only the input saved, the parameters of the
forward (2BW's weight version) used again in backward. Then the strategy on 2 gloo processes: 1F1B
with only stage 0 recomputing against a single process written out micro-batch by micro-batch, and
2BW recomputing on both stages against 2BW without; dropout is on, so the replay matters. Each
block counts its forwards: a recomputed block runs twice per micro-batch.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import lightning as L
import pytest
import torch
from models import START, LitSeq, loader, max_rel_diff, trainer_kwargs
from torch import nn
from torch.nn import functional as F

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.errors import SettingError
from lightning_pipe.runtime.recompute import run_block
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.runtime.versions import WeightVersions

SEED = 1234  # every batch reseeds the RNG: SEED + batch, on every rank and in the reference
STEPS, M, WIDTH, P = 4, 2, 8, 0.3


class DropBlock(nn.Module):
    """tanh(linear) then dropout; an optional second input gates it (a tuple activation). Counts its forwards."""

    def __init__(self, width: int = WIDTH, p: float = P):
        super().__init__()
        self.lin, self.drop, self.calls = nn.Linear(width, width), nn.Dropout(p), 0

    def forward(self, x):
        self.calls += 1
        if isinstance(x, tuple):
            h, g = x
            return self.drop(torch.tanh(self.lin(h))) * g, g
        return self.drop(torch.tanh(self.lin(x)))


# ---- the runtime function, no processes ---------------------------------------------------------
def _backward(block: nn.Module, inputs, recompute: bool):
    """(packed bytes, gradients of the parameters and inputs) of one forward + backward under a fixed RNG."""
    block.zero_grad()
    leaves = inputs if isinstance(inputs, tuple) else (inputs,)
    for t in leaves:
        t.grad = None
    packed = []

    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_block(block, inputs, recompute)
    torch.manual_seed(99)  # backward's replay must not read the RNG as it is now
    loss = sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,)))
    loss.backward()
    return sum(packed), [p.grad.clone() for p in block.parameters()] + [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("as_tuple", [False, True], ids=["tensor", "tuple"])
def test_run_block_same_gradients_bit_for_bit_and_saves_only_the_input(as_tuple):
    torch.manual_seed(0)
    block = DropBlock().double()
    h = torch.randn(5, WIDTH, dtype=torch.float64, requires_grad=True)
    inputs = (h, torch.rand(5, WIDTH, dtype=torch.float64, requires_grad=True)) if as_tuple else h
    plain_bytes, plain = _backward(block, inputs, False)
    assert block.calls == 1
    kept_bytes, recomputed = _backward(block, inputs, True)
    assert block.calls == 3  # the forward, then its replay in backward
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)
    input_bytes = sum(t.numel() * t.element_size() for t in (inputs if as_tuple else (inputs,)))
    assert kept_bytes == input_bytes < plain_bytes  # only the input (each tensor of a tuple) is kept
    with torch.no_grad():  # evaluation: nothing to recompute, no checkpoint
        run_block(block, inputs, True)
    assert block.calls == 4


def test_run_block_replays_on_the_parameters_of_its_forward():
    """2BW runs a micro-batch's forward on its weight version (swapped in for the forward only) and
    its backward after the optimizer has written the live weights: the replay must see the version."""
    torch.manual_seed(0)
    block = DropBlock().double()
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    grads = {}
    for recompute in (False, True):
        live = {n: p.detach().clone() for n, p in block.named_parameters()}
        versions = WeightVersions(block)
        version = versions.version()
        torch.manual_seed(3)
        with versions.use(version):
            out = run_block(block, x, recompute)
        versions.detach_live()
        with torch.no_grad():  # the optimizer step between forward and backward
            for p in block.parameters():
                p.add_(1.0)
        out.sum().backward()
        grads[recompute] = [version[id(p)].grad for p in block.parameters()]
        assert all(torch.equal(p - 1.0, live[n]) for n, p in block.named_parameters())
        with torch.no_grad():
            for n, p in block.named_parameters():
                p.copy_(live[n])
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_sequential_host_recomputes_each_block():
    torch.manual_seed(0)
    chunk = nn.Sequential(DropBlock(), DropBlock(), nn.Linear(WIDTH, 3)).double()
    x, y = torch.randn(6, WIDTH, dtype=torch.float64), torch.randint(0, 3, (6,))
    grads = {}
    for recompute in (False, True):
        host = SequentialHost({0: chunk}, 0, F.cross_entropy, recompute=recompute)
        host.inputs, host.targets, host.weights = [x], [y], [1.0]
        chunk.zero_grad()
        torch.manual_seed(5)
        host.forward(0, 0, None).backward()
        grads[recompute] = [p.grad.clone() for p in chunk.parameters()]
    assert [chunk[0].calls, chunk[1].calls] == [3, 3]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


# ---- the strategy on 2 processes ------------------------------------------------------------------
class LitDrop(LitSeq):
    """LitSeq (AdamW, StepLR) with dropout blocks; the RNG is reseeded at every batch, and each rank
    writes its blocks' forward counts at the end of training."""

    def __init__(self, folder: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(*[DropBlock() for _ in range(5)], nn.Linear(WIDTH, 3)).double()
        self.folder, self.seen = folder, 0

    def on_train_batch_start(self, batch, batch_idx):
        torch.manual_seed(SEED + self.seen)
        self.seen += 1

    def on_train_end(self):
        calls = {i: b.calls for i, b in self.seq.named_children() if isinstance(b, DropBlock)}
        Path(self.folder, f"calls-{self.global_rank}.json").write_text(json.dumps(calls))


def fit(folder: Path, schedule: str, recompute) -> tuple[LitDrop, list[dict[str, int]]]:
    model = LitDrop(str(folder))
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=M, partition=[3, 3], recompute=recompute, start_method=START, timeout=30.0)
    L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=STEPS)).fit(model, loader())
    return model, [json.loads(Path(folder, f"calls-{r}.json").read_text()) for r in range(2)]


def reference(steps: int) -> LitDrop:
    """One process, each step micro-batch by micro-batch as the ranks draw their dropout masks: each
    stage from the batch's seed, its micro-batches in order (1F1B runs a rank's forwards in order)."""
    ref = LitDrop()
    conf = ref.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    stages = (ref.seq[:3], ref.seq[3:])
    for b, (x, y) in enumerate(list(loader())[:steps]):
        xs, ys = x.tensor_split(M), y.tensor_split(M)
        torch.manual_seed(SEED + b)
        hidden = [stages[0](xi) for xi in xs]
        torch.manual_seed(SEED + b)
        loss = sum(F.cross_entropy(stages[1](h), yi) * (len(yi) / len(y)) for h, yi in zip(hidden, ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return ref


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_1f1b_recomputes_stage_0_only_and_equals_one_process(tmp_path):
    model, calls = fit(tmp_path, "1f1b", [True, False])
    forwards = STEPS * M
    assert calls[0] == {"0": 2 * forwards, "1": 2 * forwards, "2": 2 * forwards}  # each replayed in backward
    assert calls[1] == {"3": forwards, "4": forwards}
    assert max_rel_diff(reference(STEPS).state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_2bw_recompute_equals_2bw_without(tmp_path):
    """Batch b's backward ends in step b + 1, after the update to W(b): its replay must run on W(b - 1)."""
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    recomputed, calls_on = fit(tmp_path / "on", "2bw", True)
    plain, calls_off = fit(tmp_path / "off", "2bw", False)
    forwards = STEPS * M
    assert all(n == forwards for rank in calls_off for n in rank.values())
    # counted before the drain at the end of fit: every backward but the last batch's tail replayed
    assert all(n > forwards for rank in calls_on for n in rank.values())
    assert max_rel_diff(plain.state_dict(), recomputed.state_dict()) <= 1e-10


def test_a_list_for_another_depth_fails_before_spawning():
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=M, partition="uniform", recompute=[True, False, True], start_method=START)
    with pytest.raises(SettingError, match=r"recompute=\[True, False, True\]: 3 entries for 2 stages"):
        L.Trainer(devices=2, strategy=strategy, **trainer_kwargs()).fit(LitDrop(), loader())
    assert not multiprocessing.active_children()
