"""FSDP2's all-gathers in schedule="auto"'s costs (planning/gathers.py): the charge for every block, reshard setting
and replica count, against the rule written here."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipe.planning.collectives import Fit, ring
from lightning_pipe.planning.gathers import gather_times, with_gathers
from lightning_pipe.simulation import CostModel

SECONDS = st.floats(1e-5, 1e-1)
LINK = ring(bandwidth=2e9, latency=20e-6)


@st.composite
def profiles(draw):
    n = draw(st.integers(1, 8))
    forward = draw(st.lists(SECONDS, min_size=n, max_size=n))
    backward = [2 * f for f in forward]
    params = draw(st.lists(st.floats(0, 1e8), min_size=n, max_size=n))
    split = draw(st.sampled_from(["none", "weight", "both"]))  # a profile with W times, with W and BI, or neither
    weight = tuple(b / 2 for b in backward) if split != "none" else ()
    bi = tuple(0.6 * b for b in backward) if split == "both" else ()
    return CostModel(tuple(forward), tuple(backward), param_bytes=tuple(params), weight=weight, backward_input=bi)


@given(profiles(), st.integers(2, 16), st.sampled_from(["microbatch", "step"]), st.integers(1, 32))
def test_each_block_pays_its_weights_gather_per_forward_and_backward_or_once_a_step(costs, width, reshard, m):
    got = with_gathers(costs, width, reshard, m, LINK)
    for i, p in enumerate(costs.param_bytes):
        # a ring all-gather of the whole weights: (w - 1) steps of the latency and (w - 1) / w of the bytes
        gather = (width - 1) / width * p / 2e9 + (width - 1) * 20e-6 if p > 0 else 0.0
        per_forward, per_backward = (gather / m, 0.0) if reshard == "step" else (gather, gather)
        assert got.forward[i] == pytest.approx(costs.forward[i] + per_forward, rel=1e-12, abs=1e-15)
        assert got.backward[i] == pytest.approx(costs.backward[i] + per_backward, rel=1e-12, abs=1e-15)
        if costs.backward_input:  # the gather comes before BI; W runs on what BI gathered
            assert got.backward_input[i] == pytest.approx(costs.backward_input[i] + per_backward, rel=1e-12, abs=1e-15)
        assert got.weight == costs.weight
    assert (got.param_bytes, got.activation_bytes) == (costs.param_bytes, costs.activation_bytes)
    assert got.num_blocks == costs.num_blocks


@given(profiles(), st.sampled_from(["microbatch", "step"]))
def test_one_replica_gathers_nothing(costs, reshard):
    assert with_gathers(costs, 1, reshard, 4, LINK) == costs
    assert gather_times(costs, 1, LINK) == [0.0] * costs.num_blocks


def test_measured_fits_price_the_gathers_and_bad_settings_are_named():
    costs = CostModel((1e-3, 2e-3), (2e-3, 4e-3), param_bytes=(1e6, 4e6))
    slow = ring(1e9, 0.0)
    measured = type(slow)(Fit(0.0, 1e8), slow.reduce_scatter, slow.all_reduce, ranks=2, source="measured on 2 ranks (cpu)")
    assert gather_times(costs, 2, measured) == pytest.approx([0.5e6 / 1e8, 2e6 / 1e8])  # the all-gather's own fit
    assert sum(with_gathers(costs, 2, "microbatch", 2, measured).forward) > sum(with_gathers(costs, 2, "microbatch", 2, slow).forward)
    with pytest.raises(ValueError, match="reshard='always': 'microbatch' or 'step'"):
        with_gathers(costs, 2, "always", 2, LINK)
    with pytest.raises(ValueError, match="microbatches=0"):
        with_gathers(costs, 2, "step", 0, LINK)
