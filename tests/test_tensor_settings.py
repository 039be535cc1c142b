"""tensor=T without processes: the rank grid (tp innermost), the settings it refuses in one line, the
planners' costs per tensor rank, and the plans (ours, a Hugging Face model's) matched to blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.frontend.tensor_plan import hf_plan_of, hf_tensor_plan
from lightning_pipe.models.blocks import Embedding, LMHead, MLMHead, ResidualAttentionBlock, ResidualFFNBlock
from lightning_pipe.models.tensor_plan import tensor_plan
from lightning_pipe.planning.tensor import split_by_tensor
from lightning_pipe.runtime.tensor_parallel import FusedColwise, VocabParallel
from lightning_pipe.simulation.costs import CostModel
from lightning_pipe.topology import Topology


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_every_rank_has_one_place_in_the_grid_with_tensor_innermost(tensor, width, depth):
    topo = Topology(tensor * width * depth, width, tensor=tensor)
    assert topo.depth == depth
    grid = torch.arange(topo.world_size).reshape(depth, width, tensor)  # ("pp", "dp", "tp"), pipeline outermost
    assert all(topo.global_rank(w, s, t) == grid[s, w, t] for s in range(depth) for w in range(width) for t in range(tensor))
    places = {(topo.replica_of(r), topo.stage_of(r), topo.tensor_of(r)) for r in range(topo.world_size)}
    assert len(places) == topo.world_size, "no two ranks share a place"
    for r in range(topo.world_size):
        w, s, t = topo.replica_of(r), topo.stage_of(r), topo.tensor_of(r)
        assert topo.global_rank(w, s, t) == r
        group = topo.tensor_ranks(w, s)
        assert group == list(range(r - t, r - t + tensor)), "a tensor group is consecutive ranks (one node)"
        assert r in topo.pipeline_ranks(w, t) and r in topo.stage_ranks(s, t)
        assert all(topo.tensor_of(q) == t for q in topo.pipeline_ranks(w, t) + topo.stage_ranks(s, t))


def test_tensor_must_divide_the_world():
    with pytest.raises(SettingError, match=r"tensor=3 does not divide the world size 8 .*allowed values: \[1, 2, 4, 8\]") as err:
        PipelineConfig(tensor=3).check_world(8)
    assert err.value.setting == "tensor"
    with pytest.raises(SettingError, match=r"width=3 does not divide the world size 8 / tensor=2") as err:
        PipelineConfig(tensor=2, width=3).check_world(8)
    assert err.value.setting == "width"


@pytest.mark.parametrize(
    "settings,words",
    [
        (dict(adaptive=True), "adaptive"),
        (dict(planner="2bw", planner_2bw_cost="paper"), "planner_2bw_cost='paper'"),
        (dict(pipelines=2), "pipelines"),
    ],
)
def test_what_tensor_parallelism_does_not_run_is_refused_in_one_line(settings, words):
    with pytest.raises(SettingError) as err:
        PipelineConfig(tensor=2, **settings)
    message = str(err.value)
    assert err.value.setting == "tensor" and "\n" not in message and words in message and "tensor=2" in message


def test_sequence_parallelism_needs_tensor_ranks():
    with pytest.raises(SettingError, match="sequence_parallel=True splits the sequence over the tensor ranks: it needs tensor > 1") as err:
        PipelineConfig(sequence_parallel=True)
    assert err.value.setting == "sequence_parallel"
    assert PipelineConfig(tensor=2, sequence_parallel=True).sequence_parallel


def test_tensor_counts_like_the_other_sizes():
    with pytest.raises(SettingError) as err:
        PipelineConfig(tensor=0)
    assert err.value.setting == "tensor"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["embedding", "attention", "ffn", "layer", "head"]), min_size=1, max_size=12), st.integers(1, 8), st.booleans()
)
def test_split_costs_divide_what_a_plan_splits_and_keep_the_rest(kinds, tensor, vocab):
    n = len(kinds)
    costs = CostModel(
        forward=tuple(1.0 + i for i in range(n)),
        backward=tuple(2.0 + i for i in range(n)),
        param_bytes=tuple(10.0 * (i + 1) for i in range(n)),
        activation_bytes=tuple(5.0 for _ in range(n)),
    )
    split = split_by_tensor(costs, kinds, tensor, vocab)  # vocab: our plan, the embedding and head split over the vocabulary
    for i, kind in enumerate(kinds):
        share = 1 / tensor if kind in ("attention", "ffn", "layer") or (vocab and kind in ("embedding", "head")) else 1.0
        for name in ("forward", "backward", "param_bytes"):
            assert getattr(split, name)[i] == pytest.approx(getattr(costs, name)[i] * share)
    assert split.activation_bytes == costs.activation_bytes, "the residual stream crosses a cut whole"
    assert split_by_tensor(costs, kinds, 1, vocab) is costs
    assert dataclasses.replace(split, forward=costs.forward, backward=costs.backward, param_bytes=costs.param_bytes) == costs


def test_our_plan_splits_attention_by_heads_the_mlp_in_halves_and_the_vocabulary():
    attention, ffn = ResidualAttentionBlock(16, 4), ResidualFFNBlock(16)
    plan = tensor_plan(attention, 2)
    assert set(plan) == {"attn.qkv", "attn.proj"} and isinstance(plan["attn.qkv"], FusedColwise)
    assert isinstance(plan["attn.proj"], RowwiseParallel)
    plan = tensor_plan(ffn, 4)
    assert isinstance(plan["mlp.fc"], ColwiseParallel) and isinstance(plan["mlp.proj"], RowwiseParallel)
    embedding = Embedding(10, 16, 8)  # the token embedding and the (tied) head split over the vocabulary
    plan = tensor_plan(embedding, 2)
    assert set(plan) == {"token"} and isinstance(plan["token"], VocabParallel)
    assert isinstance(tensor_plan(LMHead(16, embedding.token.weight), 2), VocabParallel)
    assert isinstance(tensor_plan(MLMHead(16, embedding.token.weight), 2), VocabParallel)
    assert set(tensor_plan(embedding, 4)) == {"token"}  # 10 tokens over 4 ranks: split unevenly, not refused
    assert isinstance(tensor_plan(LMHead(16, embedding.token.weight), 3), VocabParallel)
    with pytest.raises(ValueError, match="4 attention heads do not split over tensor=3"):
        tensor_plan(attention, 3)


def test_a_hugging_face_plan_applies_to_a_traced_blocks_own_names():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=11
    )
    model = transformers.LlamaForCausalLM(config)
    base = hf_plan_of(model)
    assert base == dict(config.base_model_tp_plan)
    block = torch.nn.Module()  # a block as the front end holds it: the layer under its path, "/" for "."
    block.add_module("model/layers/0", model.model.layers[0])
    plan = hf_tensor_plan(block, base)
    assert {k: type(v) for k, v in plan.items()} == {
        "model/layers/0.self_attn.q_proj": ColwiseParallel,
        "model/layers/0.self_attn.k_proj": ColwiseParallel,
        "model/layers/0.self_attn.v_proj": ColwiseParallel,
        "model/layers/0.self_attn.o_proj": RowwiseParallel,
        "model/layers/0.mlp.gate_proj": ColwiseParallel,
        "model/layers/0.mlp.up_proj": ColwiseParallel,
        "model/layers/0.mlp.down_proj": RowwiseParallel,
    }
    with pytest.raises(ValueError, match="'colwise_rep'.*supported styles"):
        hf_tensor_plan(block, {"layers.*.self_attn.q_proj": "colwise_rep"})
    assert hf_plan_of(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))) is None
