"""PipeDream-2BW's runtime mode on real gloo processes against the 2BW rule written out here.

The reference keeps the previous weights, takes batch b's gradient at W(max(b - 1, 0)) and applies
it to the current weights with the same optimizer: W(b + 1) = W(b) - lr * grad f(W(b - 1)).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from _dist import run_distributed
from models import mlp_blocks
from torch import nn

from lightning_pipe.modes.two_bw.engine import DoubleBuffer, _Batch
from lightning_pipe.runtime.microbatch import signature, split_microbatches
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import ScheduleSpec

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def data(steps, batch, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    sizes = batch if isinstance(batch, list) else [batch] * steps
    return [(torch.randn(n, 8, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def model(dtype):
    torch.manual_seed(0)
    return mlp_blocks(6).to(dtype)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def reference_2bw(batches, dtype, optimizer, m, drain_every=None):
    """The 2BW rule on one process: gradient of batch b at W(max(b-1, 0)), applied to W(b)."""
    net = model(dtype)
    opt = OPTIMIZERS[optimizer](net.parameters())
    previous = copy.deepcopy(net)  # W(b - 1)
    for b, (x, y) in enumerate(batches):
        at = previous if b >= 1 else copy.deepcopy(net)
        at.zero_grad()
        parts, weights = split_microbatches((x, y), m)
        for (xm, ym), w in zip(parts, weights):
            (loss_fn(at(xm), ym) * w).backward()
        previous = copy.deepcopy(net)
        for p, q in zip(net.parameters(), at.parameters()):
            p.grad = q.grad.clone()
        opt.step()
    return net.state_dict()


def train_2bw(rank, world, batches, dtype, optimizer, m, drain_every):
    torch.set_num_threads(1)
    # Nothing the process held before this run is one of its batches (a forked worker holds all of
    # pytest's heap): moved out of gc.get_objects()'s sight, so that each look at the buffers below
    # scans what this run made (every _Batch among it), not half a million objects, after every new buffer
    gc.freeze()
    net = model(dtype)
    bounds = [(i * len(net) // world, (i + 1) * len(net) // world) for i in range(world)]
    a, b = bounds[rank]
    stage = nn.Sequential(*net[a:b])
    host = SequentialHost({rank: stage}, world - 1, loss_fn)
    opt = OPTIMIZERS[optimizer](stage.parameters())

    def apply():
        opt.step()
        opt.zero_grad(set_to_none=True)

    mode = DoubleBuffer(ScheduleSpec.of("2bw"), world, m, rank, Transport(lambda r: r, torch.device("cpu")), stage, apply)
    held = 0
    peaks = []  # weight buffers alive right after each new one is made (the moments of a peak)
    first = next(stage.parameters())

    def buffers():
        """Distinct buffers of the first weight held by anything alive: the live parameter, the
        stash, any batch's version (a finished batch kept alive by a stray reference counts)."""
        ptrs = {first.untyped_storage().data_ptr()}
        if mode.stashed is not None:
            ptrs.add(mode.stashed[id(first)].untyped_storage().data_ptr())
        for obj in gc.get_objects():
            if isinstance(obj, _Batch):
                ptrs.add(obj.version[id(first)].untyped_storage().data_ptr())
        return len(ptrs)

    def counted(make):
        def wrapper(*args):
            out = make(*args)
            peaks.append(buffers() + (make.__name__ == "snapshot"))  # the snapshot is not the stash yet
            return out

        return wrapper

    mode.versions.detach_live = counted(mode.versions.detach_live)
    mode.versions.snapshot = counted(mode.versions.snapshot)
    for step, (x, y) in enumerate(batches):
        for p in stage.parameters():
            p.grad = None
        host.inputs, host.weights = split_microbatches(x, m)
        host.targets, _ = split_microbatches(y, m)
        keys = [("train", signature(mb)) for mb in host.inputs]
        mode.run("train", host, keys)
        held = max(held, mode.versions_held())
        opt.step()  # what the caller does after each step: applies what REDUCE put on the live grads
        if drain_every and (step + 1) % drain_every == 0:
            mode.drain()
    mode.drain()
    assert peaks, "no new weight buffer was ever made"
    held = max(held, *peaks)
    return {f"{a + int(k.split('.', 1)[0])}.{k.split('.', 1)[1]}": v for k, v in stage.state_dict().items()}, held


def max_rel(ref, got):
    return max(((ref[k] - got[k]).abs().max() / ref[k].abs().max().clamp(min=1e-30)).item() for k in ref)


CASES = [
    (2, 2, 10, "momentum", "float64", None),  # m = d
    (2, 4, 10, "adam", "float64", None),  # m = 2d
    (4, 4, 12, "momentum", "float64", None),
    (4, 8, 13, "adam", "float64", None),  # a batch not divisible by m
    (2, 3, 10, "sgd", "float32", 3),  # drains in between (validation, checkpoints) keep the trajectory
    (4, 5, 11, "adamw", "float64", 2),
]


@pytest.mark.parametrize("world,m,batch,optimizer,dtype,drain_every", CASES)
def test_2bw_equals_the_rule_on_one_process(world, m, batch, optimizer, dtype, drain_every):
    dt = getattr(torch, dtype)
    batches = data(7, batch, dt)
    ref = reference_2bw(batches, dt, optimizer, m)
    results = run_distributed(train_2bw, world, batches, dt, optimizer, m, drain_every, timeout=240)
    got = {k: v for state, _ in results for k, v in state.items()}
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert max_rel(ref, got) <= tol
    assert all(held <= 2 for _, held in results), "a stage held more than two weight versions"


def test_1f1b_with_flush_differs_from_2bw():
    """The test can tell the rules apart: plain SGD semantics (flush) is not 2BW's 1-stale update."""
    batches = data(5, 8, torch.float64)
    ref = reference_2bw(batches, torch.float64, "momentum", 4)
    net = model(torch.float64)
    opt = OPTIMIZERS["momentum"](net.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    assert max_rel(ref, net.state_dict()) > 1e-4
