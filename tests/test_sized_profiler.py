"""profile_sizes: a measured SizedProfile (hand-counted bytes, recomputation really re-runs the
forward, RNG and buffers untouched, bad sizes refused); SizedProfile.at interpolation and JSON."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from benchmarks.harness.mlp import Block, make_model
from lightning_pipe.planning.sized import BYTE_FIELDS, TIME_FIELDS, SizedProfile
from lightning_pipe.profiling.sized import profile_sizes

CPU = torch.device("cpu")
HIDDEN, INNER = 256, 512


def test_bytes_match_the_hand_count_of_the_residual_mlp():
    blocks = list(make_model({"hidden": HIDDEN, "mlp_ratio": INNER // HIDDEN, "blocks": 2}))
    p = profile_sizes(blocks, lambda b: torch.randn(b, HIDDEN), [16, 32], CPU, model="mlp", repeats=1, warmup=0)
    assert p.sizes == [16, 32] and p.model == "mlp" and p.block_names == ["Block", "Block"] and p.source == "measured"
    # docs/results/memory.md: at 32 rows one block's forward saves its input (32 KiB), fc1's output (64 KiB)
    # and GELU's output (64 KiB); the residual add nothing, the weights are not activations
    per_row = HIDDEN * 4 + INNER * 4 + INNER * 4
    assert 32 * per_row == 160 * 1024
    assert p.saved_bytes == [[16.0 * per_row] * 2, [32.0 * per_row] * 2]
    assert p.input_bytes == p.output_bytes == [[16.0 * HIDDEN * 4] * 2, [32.0 * HIDDEN * 4] * 2]
    assert p.param_bytes == [4.0 * (HIDDEN * INNER + INNER + INNER * HIDDEN + HIDDEN)] * 2  # 1,027 KiB


class _SlowForward(Block):
    """The MLP block with a 10 ms forward (a sleep: noise can only lengthen it) that counts its calls."""

    def __init__(self) -> None:
        super().__init__(32, 64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.01)
        return super().forward(x)


def test_recompute_backward_reruns_the_forward():
    blocks = [_SlowForward(), _SlowForward()]
    repeats, warmup = 3, 0
    p = profile_sizes(blocks, lambda b: torch.randn(b, 32), [4], CPU, repeats=repeats, warmup=warmup)
    for plain, again in zip(p.backward[0], p.recompute_backward[0]):
        assert again > plain + 0.009  # the 10 ms forward runs again inside the backward
    rounds = (warmup + repeats) * 2  # micro-batches through each timed chain (2 in flight)
    # plain chain 1 forward each, recomputed chain 2 (forward + re-run in backward), bytes pass 1
    assert [b.calls for b in blocks] == [rounds * 3 + 1] * 2


def _bn_dropout_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)) for _ in range(2)] + [nn.Linear(8, 3)]


def test_rng_buffers_and_gradients_are_as_before():
    blocks = _bn_dropout_blocks()
    for blk in blocks:
        for prm in blk.parameters():
            prm.grad = torch.full_like(prm, 7.0)
    grads = [prm.grad for blk in blocks for prm in blk.parameters()]
    state = {f"{i}.{k}": v.clone() for i, blk in enumerate(blocks) for k, v in blk.state_dict().items()}
    targets = torch.randint(0, 3, (4,))
    rng = torch.get_rng_state()
    loss_of = lambda b: lambda out: nn.functional.cross_entropy(out, targets[:b])
    p = profile_sizes(blocks, lambda b: torch.randn(b, 8), [2, 4], CPU, repeats=1, warmup=0, loss_fn_of=loss_of)
    assert p.num_blocks == 3 and all(v > 0 for v in p.saved_bytes[1])
    assert torch.equal(torch.get_rng_state(), rng)
    after = {f"{i}.{k}": v for i, blk in enumerate(blocks) for k, v in blk.state_dict().items()}
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert [prm.grad for blk in blocks for prm in blk.parameters()] == grads  # the very tensors, untouched
    assert all(bool((g == 7.0).all()) for g in grads)


@pytest.mark.parametrize("sizes", [[], [0, 2], [2, 2], [4, 2], [1.5, 2], [True, 2], None])
def test_bad_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="sizes"):
        profile_sizes([nn.Linear(2, 2)], lambda b: torch.randn(b, 2), sizes, CPU)


# ---- SizedProfile.at: between measured sizes, exact at them; JSON round trip --------------------
FIELDS = (*TIME_FIELDS, *BYTE_FIELDS)
values = st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)


@st.composite
def profiles(draw):
    sizes = sorted(draw(st.sets(st.integers(1, 512), min_size=2, max_size=5)))
    n = draw(st.integers(1, 4))
    rows = {f: [draw(st.lists(values, min_size=n, max_size=n)) for _ in sizes] for f in FIELDS}
    return SizedProfile("m", sizes, param_bytes=draw(st.lists(values, min_size=n, max_size=n)), block_names=["b"] * n, **rows)


@settings(max_examples=150, deadline=None)
@given(profiles(), st.data())
def test_at_interpolates_between_measured_sizes(p, data):
    i = data.draw(st.integers(0, len(p.sizes) - 2))
    lo, hi = p.sizes[i], p.sizes[i + 1]
    exact = p.at(lo)
    for f in FIELDS:
        assert list(getattr(exact, f)) == getattr(p, f)[i]
    assert list(exact.param_bytes) == p.param_bytes
    b = data.draw(st.floats(min_value=lo, max_value=hi, exclude_min=True, exclude_max=True))
    costs = p.at(b)
    for f in FIELDS:
        for v, v0, v1 in zip(getattr(costs, f), getattr(p, f)[i], getattr(p, f)[i + 1]):
            slack = 1e-12 * max(v0, v1)  # one rounding of v0 + (v1 - v0) * t
            assert min(v0, v1) - slack <= v <= max(v0, v1) + slack, (f, b, v0, v1, v)
    assert list(costs.param_bytes) == p.param_bytes
    with tempfile.TemporaryDirectory() as tmp:
        assert SizedProfile.load(p.save(Path(tmp) / "sized.json")) == p
