"""Profiles (measured and synthetic, JSON round trip, bad input) and timeline pictures/traces."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_pipe.models import build_gpt, get_model_config
from lightning_pipe.profiling import Profile, profile_blocks
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import simulate
from lightning_pipe.simulation.timelines import chrome_trace, gantt, traced_timeline


def test_profile_blocks_measures_every_block_and_round_trips(tmp_path):
    torch.manual_seed(0)
    blocks = list(build_gpt(get_model_config("gpt-tiny")))
    x = torch.randint(0, 256, (2, 32))
    measured = profile_blocks(blocks, x, torch.device("cpu"), repeats=2, warmup=1)
    assert sorted(measured) == list(range(len(blocks)))
    for m in measured.values():
        assert m["forward"] > 0 and m["backward"] > 0
        assert m["activation_bytes"] > 0
    # the FFN block holds 2 * d * 4d weights (+ biases, LN): the biggest blocks after embedding/head
    assert measured[2]["param_bytes"] > measured[1]["param_bytes"]
    assert measured[1]["activation_bytes"] == 2 * 32 * 128 * 4  # (B, T, d) float32
    field = lambda k: [measured[i][k] for i in range(len(blocks))]  # noqa: E731
    p = Profile("gpt-tiny", 2, "float32", "cpu", field("forward"), field("backward"), field("activation_bytes"), field("param_bytes"))
    path = p.save(tmp_path / "profile.json")
    q = Profile.load(path)
    assert q == p and q.key == "gpt-tiny-mbs2-float32-cpu"
    costs = q.costs(bandwidth=1e9, latency=1e-5)
    assert costs.num_blocks == len(blocks) and costs.forward == tuple(p.forward)


class _SlowLoss(torch.autograd.Function):
    """A loss whose forward takes 20 ms and backward 30 ms (sleeps), so its share is known."""

    @staticmethod
    def forward(ctx, x):
        import time

        time.sleep(0.02)
        ctx.shape = x.shape
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(0.03)
        return grad * torch.ones(ctx.shape)


def test_profile_blocks_times_the_loss_with_the_last_block():
    blocks = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)]
    x = torch.randn(4, 16)
    plain = profile_blocks(blocks, x, torch.device("cpu"), repeats=3, warmup=1)
    with_loss = profile_blocks(blocks, x, torch.device("cpu"), repeats=3, warmup=1, loss_fn=_SlowLoss.apply)
    # only the last block carries the loss: its forward >= 20 ms, its backward >= 30 ms
    assert with_loss[1]["forward"] >= 0.02 and with_loss[1]["backward"] >= 0.03
    assert plain[1]["forward"] < 0.01 and plain[1]["backward"] < 0.01
    assert with_loss[0]["forward"] < 0.01 and with_loss[0]["backward"] < 0.01
    # what crosses the boundary is still the block's output (4 x 8 float32), not the scalar loss
    assert with_loss[1]["activation_bytes"] == plain[1]["activation_bytes"] == 4 * 8 * 4
    # measured alone (indices), the last block still carries it; an earlier block never does
    assert profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0, indices=[1], loss_fn=_SlowLoss.apply)[1]["forward"] >= 0.02
    assert profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0, indices=[0], loss_fn=_SlowLoss.apply)[0]["forward"] < 0.01


def test_profile_blocks_chain_mode_runs_the_blocks_as_a_stage():
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)]
    calls = [0, 0, 0]
    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    first_grads = []
    blocks[0].weight.register_hook(lambda g: first_grads.append(g.abs().sum().item()))
    x = torch.randn(4, 16)
    res = profile_blocks(blocks, x, torch.device("cpu"), repeats=2, warmup=1, inflight=3, loss_fn=_SlowLoss.apply)
    # (warm-up + repeats) rounds of 3 micro-batches through every block; the backward chain reaches
    # block 0 with the real gradient from the loss (not zeros) every time
    assert calls == [9, 9, 9] and len(first_grads) == 9 and all(g > 0 for g in first_grads)
    assert sorted(res) == [0, 1, 2]
    assert res[2]["forward"] >= 0.02 and res[2]["backward"] >= 0.03  # the loss, with the last block
    assert res[0]["forward"] < 0.01 and res[0]["backward"] < 0.01
    alone = profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0)
    for i in range(3):
        assert res[i]["activation_bytes"] == alone[i]["activation_bytes"] and res[i]["param_bytes"] == alone[i]["param_bytes"]
    # a middle block alone: the blocks before it run once, forward only, to make its input
    calls[:] = [0, 0, 0]
    assert sorted(profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0, inflight=2, indices=[1])) == [1]
    assert calls == [1, 2, 0]
    with pytest.raises(ValueError, match="inflight must be None or an integer >= 1"):
        profile_blocks(blocks, x, torch.device("cpu"), inflight=0)


class _Out(torch.nn.Module):
    """Returns `kind`: "dict", "list", "tuple+None", "namedtuple" or "tuple" (of tensors, allowed)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return {
            "dict": lambda: {"h": h, "x": x},
            "list": lambda: [h, x],
            "tuple+None": lambda: (h, None),
            "namedtuple": lambda: torch.return_types.max((h, x)),
            "tuple": lambda: (h, x),
        }[self.kind]()


class _In(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, inputs):
        h, x = (inputs["h"], inputs["x"]) if isinstance(inputs, dict) else (inputs[0], inputs[1])
        return self.lin(h) + (x if x is not None else 0)


@pytest.mark.parametrize(
    "kind,what",
    [("dict", "a dict"), ("list", "a list"), ("tuple+None", "a tuple holding a NoneType at position 1"), ("namedtuple", "a max")],
)
@pytest.mark.parametrize("inflight,indices", [(None, None), (2, None), (2, [1]), (None, [2])])
def test_profile_blocks_refuses_what_the_runtime_cannot_pass_between_blocks(kind, what, inflight, indices):
    # a dict or a list between blocks used to end in "Trying to backward through the graph a second
    # time" (chain mode) while the runtime fails on it between stages only: now the same TypeError
    # naming the block, whichever blocks a rank profiles
    blocks = [_Out(kind), _In(), torch.nn.Linear(8, 3)]
    x = torch.randn(4, 8)
    with pytest.raises(
        TypeError,
        match=rf"pipeline block 0 \(_Out\) returned {what}.*; an activation passed between pipeline blocks "
        r"must be a tensor or a tuple of tensors \(integer and bool tensors travel without gradients",
    ):
        profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0, inflight=inflight, indices=indices, loss_fn=torch.sum)


def test_profile_blocks_takes_what_the_runtime_takes():
    x = torch.randn(4, 8)
    # a tuple of tensors passes; the last block's output goes to the step, so it may be a dict
    blocks = [_Out("tuple"), _In(), _Out("dict")]
    for inflight in (None, 2):
        res = profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0, inflight=inflight, loss_fn=lambda d: d["h"].sum())
        assert sorted(res) == [0, 1, 2] and res[0]["activation_bytes"] == 2 * 4 * 8 * 4 and res[2]["backward"] > 0
    # the pipeline's own input comes from the step, never from another stage: any structure
    for inflight in (None, 2):
        res = profile_blocks([_In(), torch.nn.Linear(8, 3)], {"h": x, "x": x}, torch.device("cpu"), repeats=1, warmup=0, inflight=inflight)
        assert sorted(res) == [0, 1]


class _FloatMask(torch.nn.Module):
    """(hidden, mask): a float mask made without a gradient, as the runtime passes it: no grad."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), (x > 0).to(x.dtype)


class _ScaleMaskInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, inputs):
        h, mask = inputs
        mask.mul_(0.5)  # in place on its input: fine on a tensor that needs no gradient
        return self.lin(h) * mask


def test_profile_blocks_passes_gradients_only_where_training_does():
    # The runtime hands a stage tensors requiring grad exactly where the producer's did (p2p sends
    # the flag); the profiler made every float tensor require one, so this in-place use of a float
    # mask failed in profiling ("a leaf Variable that requires grad ...") and worked in training.
    blocks = [_FloatMask(), _ScaleMaskInPlace(), torch.nn.Linear(8, 3)]
    x = torch.randn(4, 8)
    for inflight, indices in [(None, None), (2, None), (2, [1, 2]), (None, [1])]:
        res = profile_blocks(blocks, x, torch.device("cpu"), repeats=1, warmup=0, inflight=inflight, indices=indices, loss_fn=torch.sum)
        assert all(r["backward"] > 0 for r in res.values())


def test_synthetic_profile_and_bad_profiles(tmp_path):
    p = Profile.synthetic([1.0, 2.0, 3.0])
    assert p.backward == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="forward must hold finite numbers >= 0"):
        Profile.synthetic([1.0, -2.0])
    with pytest.raises(ValueError, match="backward must hold finite numbers >= 0"):
        Profile.synthetic([1.0, 1.0], [1.0, math.nan])
    with pytest.raises(ValueError, match="has 3 blocks but the model has 4"):
        p.check_blocks(4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "forward": [1.0]}))
    with pytest.raises(ValueError, match="missing fields"):
        Profile.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.load(bad)


def test_gantt_png_and_chrome_trace(tmp_path):
    t = simulate(
        build_schedule("1f1b", 3, 4),
        Profile.synthetic([1.0, 2.0, 1.0], activation_bytes=8.0).costs(bandwidth=16.0),
        [(0, 1), (1, 2), (2, 3)],
    )
    png = gantt(t, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(chrome_trace(t, tmp_path / "trace.json").read_text())["traceEvents"]
    computes = [e for e in trace if e.get("cat") == "compute"]
    assert len(computes) == 3 * 4 * 2
    assert max(e["ts"] + e["dur"] for e in computes) == pytest.approx(t.iteration_time * 1e6)


def test_traced_timeline_from_records():
    s = build_schedule("gpipe", 2, 1)
    index = {r: {a: i for i, a in enumerate(s.actions[r])} for r in range(2)}
    f0, b0 = [a for a in s.actions[0] if a.op.is_compute]
    f1, b1 = [a for a in s.actions[1] if a.op.is_compute]
    records = [[(index[0][f0], 10.0, 11.0), (index[0][b0], 14.0, 16.0)], [(index[1][f1], 11.5, 12.5), (index[1][b1], 12.5, 13.5)]]
    t = traced_timeline(s, records)
    assert t.iteration_time == pytest.approx(6.0) and t.busy == pytest.approx([3.0, 2.0]) and t.startup == pytest.approx(1.5)
