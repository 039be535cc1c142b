"""Zero-bubble pipelines (Qi et al., ICLR 2024): the split backward in the action language, the
BI / W halves of autograd, and the ZB-H1 / ZB-V orders against the paper's bubble."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import masked_blocks, tied_blocks
from torch import nn

from lightning_pipe.runtime.recompute import run_block
from lightning_pipe.runtime.split_backward import backward_input, backward_weight
from lightning_pipe.schedules import Action, Op, ScheduleError, build_schedule, validate
from lightning_pipe.schedules.text import dump, load, parse_token
from lightning_pipe.simulation import CostModel, simulate


def uniform(schedule, f=1.0, bi=1.0, w=1.0):
    """One block per chunk, T_F = f, T_B = bi, T_W = w, no communication."""
    n = schedule.num_chunks
    costs = CostModel.uniform(n, f, bi + w, weight=(w,) * n, activation_bytes=(1.0,) * n)
    return simulate(schedule, costs, [(c, c + 1) for c in range(n)])


# ---- the language ------------------------------------------------------------------------------
def test_split_backward_tokens_round_trip():
    assert parse_token("BI2.3") == Action(Op.BACKWARD_INPUT, 2, 3)
    assert parse_token("W0.1") == Action(Op.BACKWARD_WEIGHT, 0, 1)
    s = build_schedule("zb-h1", 3, 4)
    text = dump(s)
    assert " BI1.0 " in text and " W1.0" in text and " B1.0 " not in text
    assert load(text) == s
    with pytest.raises(ValueError, match=r"expected W<chunk>.<micro-batch>"):
        parse_token("Wx")


def _edited(edit, name="zb-h1", p=2, m=3):
    s = build_schedule(name, p, m)
    edit(s.actions)
    return s


def test_validation_names_a_broken_split():
    def w_before_bi(lists):
        i = lists[1].index(Action(Op.BACKWARD_INPUT, 1, 0))
        lists[1].insert(i, lists[1].pop(lists[1].index(Action(Op.BACKWARD_WEIGHT, 1, 0))))

    with pytest.raises(ScheduleError, match=r"rank 1, action \d+ W\(chunk=1, mb=0\): runs before the input gradient \(BI\)"):
        validate(_edited(w_before_bi))
    with pytest.raises(ScheduleError, match=r"micro-batch 2 on chunk 0 has 1 input-gradient \(BI\) and 0 weight-gradient \(W\)"):
        validate(_edited(lambda lists: lists[0].remove(Action(Op.BACKWARD_WEIGHT, 0, 2))))
    with pytest.raises(ScheduleError, match=r"micro-batch 1 is 2 times backwarded on chunk 1"):
        validate(_edited(lambda lists: lists[1].append(Action(Op.BACKWARD, 1, 1))))

    def reduce_early(lists):  # the gradient reduction before the last W
        lists[0].remove(Action(Op.REDUCE_GRAD, 0))
        lists[0].insert(lists[0].index(Action(Op.BACKWARD_WEIGHT, 0, 2)), Action(Op.REDUCE_GRAD, 0))

    with pytest.raises(ScheduleError, match=r"REDUCE\(chunk=0\): runs before the backward of micro-batches \[2\]"):
        validate(_edited(reduce_early))


def test_a_w_hands_nothing_to_the_previous_chunk():
    # lowering: only BI receives and sends gradients; the reduction follows the chunk's last W
    s = build_schedule("zb-h1", 2, 2)
    rank1 = [str(a) for a in s.actions[1]]
    for i, a in enumerate(s.actions[1]):
        if a.op is Op.BACKWARD_WEIGHT:
            assert s.actions[1][i - 1].op is not Op.RECV_GRAD and (i + 1 == len(rank1) or s.actions[1][i + 1].op is not Op.SEND_GRAD)
    assert s.actions[0][-1] == Action(Op.REDUCE_GRAD, 0) and s.actions[0][-2].op is Op.BACKWARD_WEIGHT


# ---- ZB-H1 and ZB-V against the paper ----------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("times", [1, 2, 4])
def test_zb_h1_bubble_is_the_papers(p, times):
    # §3: with T_F = T_B = T_W, 1F1B idles (p - 1)(T_F + T_B + T_W) per rank, ZB-H1 (p - 1)(T_F + T_B - T_W)
    m = times * p
    zb, one = uniform(build_schedule("zb-h1", p, m)), uniform(build_schedule("1f1b", p, m))
    assert zb.iteration_time == 3 * m + (p - 1) * (1 + 1 - 1)
    assert one.iteration_time == 3 * m + (p - 1) * 3
    # ... with 1F1B's peak memory: every stage holds at most p micro-batches, 1F1B's first stage's count
    assert zb.peak_activations == [p] * p and max(one.peak_activations) == p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_v_idles_only_while_its_input_travels_down(p):
    # §6: T_F = T_B = T_W per chunk, m >= 2p - 1: each rank computes 6m; the only idle time is the last
    # rank's wait for micro-batch 0 to cross the p - 1 ranks above it
    for m in (2 * p - 1, 2 * p, 4 * p):
        s = build_schedule("zb-v", p, m)
        assert s.chunk_rank == tuple(range(p)) + tuple(reversed(range(p)))
        t = uniform(s)
        assert t.iteration_time == 6 * m + (p - 1)
        assert max(t.peak_activation_bytes) <= 2 * p  # 1F1B's peak: p whole stages = 2p chunk halves


@settings(deadline=None, max_examples=60)
@given(p=st.integers(1, 6), m=st.integers(1, 20))
def test_zero_bubble_orders_are_valid_for_every_depth_and_microbatch_count(p, m):
    for name in ("zb-h1", "zb-v"):
        s = build_schedule(name, p, m)  # validated
        per_chunk = {(a.op, a.chunk, a.microbatch) for acts in s.actions for a in acts if a.op.is_compute}
        assert len(per_chunk) == 3 * m * s.num_chunks  # F, BI, W of every micro-batch on every chunk
        assert not any(a.op is Op.BACKWARD for acts in s.actions for a in acts)


# ---- BI then W equals one backward, each graph node run once --------------------------------------
class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls: inserted on the input path and on weight paths."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        Counted.calls += 1
        return g


class Mixed(nn.Module):
    """A weight-only subgraph, a weight on both sides of the cut and, with `reuse`, a layer applied twice."""

    def __init__(self, reuse: bool):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.scale = nn.Parameter(torch.randn(5))
        self.reuse = reuse

    def forward(self, x):
        w = Counted.apply(self.scale.exp())  # weight only: W's alone
        h = torch.tanh(Counted.apply(self.a(x)) * w)  # the input path
        h = (self.a if self.reuse else self.c)(h) + self.b(h) + w.sum()
        return nn.functional.layer_norm(h, (5,)) * (self.scale * 2).t()


def _both_ways(fn, params, x, leaves):
    """(input gradients, weight gradients, Counted calls) of one backward, then of BI followed by W."""
    out = fn(x)
    g = torch.randn_like(out)
    full_x = torch.autograd.grad(out, leaves, g, retain_graph=True)
    torch.autograd.backward(out, g)
    full = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    Counted.calls = 0
    split_x, deferred = backward_input([fn(x)], [g], leaves)
    assert all(p.grad is None for p in params)  # BI touches no weight gradient
    bi_calls = Counted.calls
    backward_weight(deferred)
    # equal up to the order in which a weight used twice sums its two contributions
    assert max(((a - p.grad).abs().max() / a.abs().max()).item() for a, p in zip(full, params)) <= 1e-12
    assert max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(full_x, split_x)) <= 1e-12
    return bi_calls, Counted.calls


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("reuse", [False, True])
def test_bi_then_w_is_one_backward(recompute, reuse):
    torch.manual_seed(0)
    mixed = Mixed(reuse).double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    used = [p for name, p in mixed.named_parameters() if not (reuse and name.startswith("c."))]
    bi, total = _both_ways(lambda x: run_block(mixed, x, recompute), used, x, [x])
    # two counted nodes, one on the input path (BI's), one on a weight-only path (W's): W redoes no
    # input-path node, unless a layer applied twice makes it pass there again to its other use
    assert bi == 1 and total == (3 if reuse else 2)


@pytest.mark.parametrize("blocks", [masked_blocks, tied_blocks])
def test_bi_then_w_on_the_test_models(blocks):
    # a tuple activation with an integer mask (masked); a weight shared by the first and last block (tied)
    torch.manual_seed(0)
    model = blocks().double()
    first = model[0](torch.randint(0, 11, (4, 6)))
    first = (
        tuple(t.detach().requires_grad_(t.is_floating_point()) for t in first)
        if isinstance(first, tuple)
        else first.detach().requires_grad_()
    )
    rest = nn.Sequential(*model[1:])
    leaves = [t for t in (first if isinstance(first, tuple) else (first,)) if t.requires_grad]
    _both_ways(rest, list(rest.parameters()), first, leaves)
