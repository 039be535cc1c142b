"""shard="optimizer" (ZeRO-1): its settings refused in one line before any process, and the ownership
rule every rank computes alike."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.modes.width.engine import owners
from lightning_pipe.planning.auto import adam_weight_copies
from lightning_pipe.runtime.reduce import buckets


def test_settings_refused_before_any_process():
    for settings, words in [
        (dict(shard="full", width=2), "shard='full' (FSDP2"),
        (dict(shard="zero3", width=2), "allowed values: 'none'"),
        (dict(shard="optimizer"), "width=1 has none"),
        (dict(shard="optimizer", width=1, pipelines=2), "AvgPipe's pipelines"),
        (dict(shard="optimizer", width=2, adaptive="rule"), "a live switch moves blocks"),
    ]:
        with pytest.raises(SettingError, match="shard") as err:
            PipelineConfig(**settings)
        assert words in str(err.value) and err.value.setting == "shard"


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 8))
def test_owners_cover_every_parameter_and_balance_within_the_largest(sizes, shards):
    owner = owners(sizes, shards)
    assert len(owner) == len(sizes) and all(0 <= o < shards for o in owner)
    load = [sum(n for n, o in zip(sizes, owner) if o == w) for w in range(shards)]
    assert max(load) - min(load) <= max(sizes)  # greedy largest-first onto the least loaded
    if len(sizes) >= shards:
        assert min(load) > 0, "every replica steps some parameters when there are enough"
    assert owners(list(sizes), shards) == owner  # every rank gets the same answer


def test_the_planners_count_adams_moments_once_per_stage():
    # parameters + gradients whole on every replica, the two moments divided over the replicas
    assert adam_weight_copies(1) == 4.0 and adam_weight_copies(2) == 3.0 and adam_weight_copies(4) == 2.5
    assert PipelineConfig(width=4, shard="optimizer").optimizer_shards == 4
    assert PipelineConfig(width=4).optimizer_shards == 1


@given(st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["float32", "float64"])), max_size=30), st.integers(8, 2000))
def test_buckets_keep_every_tensor_once_by_dtype_within_the_cap(shapes, cap):
    tensors = [torch.zeros(n, dtype=getattr(torch, d)) for n, d in shapes]
    found = list(buckets(tensors, cap))
    assert sorted(id(t) for g in found for t in g) == sorted(id(t) for t in tensors)
    for group in found:
        assert len({t.dtype for t in group}) == 1
        assert len(group) == 1 or sum(t.numel() * t.element_size() for t in group) <= cap
        order = [next(i for i, x in enumerate(tensors) if x is t) for t in group]
        assert order == sorted(order)  # the tensors' own order within a bucket
