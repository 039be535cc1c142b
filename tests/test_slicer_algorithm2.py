"""AutoPipe's Algorithm 2 (planning/slicer_algorithm2.py): its steps on cases worked by hand, the
paper's schedule with the merged half messages, and exactness of sliced runs on real processes."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from models import max_rel_diff, mlp_blocks
from torch import nn

from lightning_pipe.planning.slicer import algorithm2_slicing, choose_slicing
from lightning_pipe.planning.slicer_algorithm2 import algorithm2, merge_stages, paper_schedule, simulate_paper
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.actions import Action, Op
from lightning_pipe.schedules.validate import validate
from lightning_pipe.simulation import CostModel


# ---- Algorithm 2, line by line, worked by hand -------------------------------------------------
def test_algorithm2_three_even_stages_stops_at_one():
    # f = b = 2 on 3 stages, Comm = 0.
    # lines 6-9: tempt = 1 + 1 + 1 = 3; lines 10-15: startt = [3+2, 5+2, 7+2] = [5, 7, 9]
    # mb = 1: endt[0] = (1, 2); endt[1] = (max(1, 1+1), max(2+1, 2+1)) = (2, 3);
    #         endt[2] = (max(1, 2+1), max(3+1, 3+1)) = (3, 4)
    # lines 29-33: tempt = startt[0] - f_1 - f_0 = 5 - 2 - 2 = 1 <= endt[0][1] = 2: return 1
    run = algorithm2([2, 2, 2], [2, 2, 2], 0.0, microbatches=6)
    assert run.startt == (5, 7, 9)
    assert len(run.steps) == 1
    mb, endt, tempt = run.steps[0]
    assert mb == 1 and tempt == 1
    assert endt[:3] == ((1, 2), (2, 3), (3, 4))
    assert run.sliced == 1


def test_algorithm2_half_messages_and_second_iteration():
    # f = b = 2 on 2 stages, Comm = 2 (a half's message: 1).
    # lines 6-9: tempt = (1 + 1) + 1 = 3; lines 10-15: startt = [3 + 2 + 2, 7 + 2] = [7, 9]
    # mb = 1: endt[0] = (0+1+1, 2+1+1) = (2, 4); endt[1] = (max(1, 2+1), max(3+1, 4+1)) = (3, 5)
    #         tempt = 7 - f_0 = 5 > endt[0][1] = 4: slice the next one
    # mb = 2: endt[0][0] = max(4+1+1, endt[1][1] = 5) = 6; endt[0][1] = max(6+1+1, endt[1][0] = 3) = 8
    #         tempt = startt[1] - f_0 = 7 <= 8: return 2
    run = algorithm2([2, 2], [2, 2], 2.0, microbatches=4)
    assert run.startt == (7, 9)
    assert [s[0] for s in run.steps] == [1, 2]
    assert run.steps[0][1][:2] == ((2, 4), (3, 5)) and run.steps[0][2] == 5
    assert run.steps[1][1][0] == (6, 8) and run.steps[1][2] == 7
    assert run.sliced == 2


def test_algorithm2_blocked_send_line_26():
    # A fast stage 0 (f = 2) feeding a slow stage 1 (f = 6), b = 1, Comm = 0: the second sliced
    # micro-batch's first half on stage 0 waits for stage 1 to finish the first one's second half
    # (line 26): endt[0][0] = max(endt[0][1] + 1 = 3, endt[1][1] = 6) = 6, then 7. Without line 26
    # it would be (3, 4).
    # startt = [4 + 1, 5 + 1] = [5, 6]; mb = 1: endt[0] = (1, 2), endt[1] = (3, 6); 5 - 2 = 3 > 2
    run = algorithm2([2, 6], [1, 1], 0.0, microbatches=4)
    assert run.steps[0][1][:2] == ((1, 2), (3, 6))
    assert run.steps[1][1][0] == (6, 7)
    assert run.steps[1][2] == 4 and run.sliced == 2


def test_algorithm2_bounds():
    assert algorithm2([1.0], [2.0], 0.0, 4).sliced == 0  # one stage: nothing to slice
    assert algorithm2([2, 2], [4, 4], 0.0, 1).sliced == 1  # never more than the micro-batches
    run = algorithm2([2, 2], [4, 4], 0.0, 8)  # tempt stays above endt: stops at the stages
    assert run.sliced == 2 and all(t > e[0][1] for _, e, t in run.steps)
    with pytest.raises(ValueError):
        algorithm2([1, 2], [1], 0.0, 4)


# ---- the paper's schedule and the merge ---------------------------------------------------------
def _sends(actions, rank):
    return [(a.op, a.microbatch) for a in actions[rank] if a.op in (Op.FORWARD, Op.SEND_ACT)]


def test_merge_stage_is_the_last_warmup_forward():
    # the paper's example: micro-batch 1 is blocked at stage 2 of 4
    assert merge_stages(4, 2) == {2: 1}
    assert merge_stages(4, 3) == {2: 1, 1: 2}
    assert merge_stages(4, 1) == {}  # micro-batch 0 meets it at the last stage, which sends nothing
    assert merge_stages(2, 2) == {0: 1}


def test_merged_first_half_goes_with_the_second():
    merged, plain = paper_schedule(4, 4, 2), paper_schedule(4, 4, 2, merge=False)
    validate(merged)
    # micro-batch 1 = halves 2 and 3; on stage 2 the first half's send waits for the second half
    assert _sends(merged.actions, 2)[:6] == [
        (Op.FORWARD, 0),
        (Op.SEND_ACT, 0),
        (Op.FORWARD, 1),
        (Op.SEND_ACT, 1),
        (Op.FORWARD, 2),
        (Op.FORWARD, 3),
    ]
    i = merged.actions[2].index(Action(Op.SEND_ACT, 2, 2, 3))
    assert merged.actions[2][i + 1] == Action(Op.SEND_ACT, 2, 3, 3)  # adjacent: one p2p group
    assert _sends(plain.actions, 2)[4:6] == [(Op.FORWARD, 2), (Op.SEND_ACT, 2)]
    for rank in (0, 1, 3):  # elsewhere the halves are sent one by one
        assert merged.actions[rank] == plain.actions[rank]


def test_paper_schedule_keeps_halves_together_in_1f1b():
    # 1F1B over the whole micro-batches: stage 0 of 4 warms up 3 whole ones (5 entries with 2 sliced),
    # where our variant counts every half as a micro-batch of its own (3 entries)
    paper = [a for a in paper_schedule(4, 4, 2).actions[0] if a.op.is_compute]
    ours = [a for a in build_schedule("1f1b", 4, 6).actions[0] if a.op.is_compute]
    assert [(a.op, a.microbatch) for a in paper[:6]] == [(Op.FORWARD, i) for i in range(5)] + [(Op.FORWARD, 5)]
    assert [(a.op, a.microbatch) for a in ours[:4]] == [(Op.FORWARD, 0), (Op.FORWARD, 1), (Op.FORWARD, 2), (Op.FORWARD, 3)]
    assert (ours[4].op, ours[4].microbatch) == (Op.BACKWARD, 0)
    # backward: the halves back to back, after the whole micro-batch's forward turn
    assert [(a.op, a.microbatch) for a in paper[6:8]] == [(Op.BACKWARD, 0), (Op.BACKWARD, 1)]


def test_merge_delays_the_first_half_in_the_simulator():
    # a stage 2 of 4 that is not busy: the merged first half arrives only after the second half's forward
    costs = CostModel.uniform(4, 1.0, 2.0, activation_bytes=(0.0,) * 4)
    bounds = [(i, i + 1) for i in range(4)]
    merged, plain = simulate_paper(costs, bounds, 4, 2), simulate_paper(costs, bounds, 4, 2, merge=False)

    def sent(t, mb):
        return next(e.start for e in t.events if e.rank == 2 and e.action.op is Op.SEND_ACT and e.action.microbatch == mb)

    def forward_end(t, mb):
        return next(e.end for e in t.computes(2) if e.action.op is Op.FORWARD and e.action.microbatch == mb)

    assert sent(plain, 2) == forward_end(plain, 2)
    assert sent(merged, 2) == forward_end(merged, 3) == sent(merged, 3)


def test_algorithm2_slicing_plan():
    # three even stages (the first hand-worked case): Algorithm 2 slices 1; the figures are the
    # simulator's on the paper's schedule
    costs = CostModel.uniform(3, 2.0, 2.0)
    bounds = [(0, 1), (1, 2), (2, 3)]
    plan = algorithm2_slicing(costs, bounds, 6)
    assert plan.method == "algorithm2" and plan.sliced == 1
    assert plan.baseline_startup == 4.0 and plan.startup == 2.0  # (p - 1) f, halved
    assert plan.summary()["method"] == "algorithm2"
    assert choose_slicing(costs, bounds, 6).method == "sweep"


def test_our_slicer_weighs_the_messages_halves_add():
    # each half is a micro-batch of its own, so slicing adds a send and a receive per stage link; with
    # a receive costing more than the start-up it saves, our slicer keeps the micro-batches whole
    import dataclasses

    bounds = [(0, 1), (1, 2), (2, 3)]
    quiet = CostModel.uniform(3, 2.0, 2.0)
    assert choose_slicing(quiet, bounds, 6).sliced == 1
    costly = dataclasses.replace(quiet, recv_overhead=3.0)
    plan = choose_slicing(costly, bounds, 6)
    assert plan.sliced == 0
    k1 = dict((k, t) for k, _, t in plan.candidates)[1]
    assert k1 > plan.baseline_iteration_time  # slicing one would have been slower, not merely not faster


# ---- exactness on real processes ---------------------------------------------------------------
def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(3)]


def _reference() -> dict:
    torch.manual_seed(0)
    model = mlp_blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _sliced_stage(rank: int, world: int, variants: list) -> list[dict]:
    from lightning_pipe.runtime.executor import Executor
    from lightning_pipe.runtime.microbatch import signature, split_microbatches
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost

    out = []
    for name, m, k in variants:
        torch.manual_seed(0)
        model = mlp_blocks()
        start, stop = (0, 3) if rank == 0 else (3, 6)
        chunk = nn.Sequential(*[model[i] for i in range(start, stop)])
        schedule = paper_schedule(world, m, k) if name == "alg2" else build_schedule("1f1b", world, m + k)
        host = SequentialHost({rank: chunk}, world - 1, nn.functional.cross_entropy)
        executor = Executor(schedule, rank, Transport(lambda r: r, torch.device("cpu")))
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
        for x, y in _batches():
            opt.zero_grad()
            host.inputs, host.weights = split_microbatches(x, m, k)
            host.targets, _ = split_microbatches(y, m, k)
            host.losses = []
            executor.run(host, [signature(t) for t in host.inputs])
            opt.step()
        out.append({key: v for key, v in model.state_dict().items() if start <= int(key.split(".")[0]) < stop})
    return out


@pytest.mark.multiprocess
def test_sliced_runs_equal_one_process():
    variants = [("alg2", 4, 2), ("alg2", 4, 1), ("ours", 4, 2)]  # alg2 with k = 2 merges on stage 0
    per_rank = run_distributed(_sliced_stage, 2, variants, timeout=180)
    reference = _reference()
    for i, variant in enumerate(variants):
        got = {**per_rank[0][i], **per_rank[1][i]}
        err = max_rel_diff(reference, got)
        assert err <= 1e-5, f"{variant}: rel err {err:.2e}"
