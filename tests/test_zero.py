"""shard="optimizer" (ZeRO-1 over the width's replicas) on real processes: pp2 x dp2 (4 ranks) against
one process on the global batch, the optimizer state held once per stage, checkpoints in the layout of
shard="none" that resume bit for bit."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import START, EpochPerm, LitSeq, dataset, max_rel_diff, trainer_kwargs
from test_two_bw_strategy import reference_2bw
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning.checkpoint.sharded import consolidate
from lightning_pipe.planning.entry import link_model
from lightning_pipe.profiling import Profile
from lightning_pipe.runtime.reduce import local
from lightning_pipe.schedules import one_f_one_b
from lightning_pipe.simulation import simulate

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]

# Lightning's DistributedSampler (shuffle, seed 0) gives replica r of 2 the rows perm[r::2] (EpochPerm): batch k
# of both replicas together is perm[10k : 10k + 10], one process's global batch
N, PER_REPLICA = 40, 5


class RecordState(Callback):
    """Each rank writes how much optimizer state it holds against its stage's parameters."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        held = {n for n, p in pl_module.named_parameters() if p in opt.state}
        stage = {n: p.numel() for n, p in pl_module.named_parameters()}
        moments = sum(local(s["exp_avg"]).numel() for s in opt.state.values())  # shard="full": this rank's shards
        weights = sum(local(p).numel() for p in pl_module.parameters())
        mesh = trainer.strategy.device_mesh  # the run's one mesh (made once)
        layout = dict(
            ranks=mesh.mesh.tolist(), names=mesh.mesh_dim_names, dp=mesh["dp"].mesh.tolist(), same=trainer.strategy.device_mesh is mesh
        )
        out = dict(stage=stage, held=held, moments=moments, weights=weights, rank=trainer.global_rank, mesh=layout)
        torch.save(out, os.path.join(self.folder, f"state-rank{trainer.global_rank}.pt"))


class CountCollective(Callback):
    """Each rank counts one of FSDP2's collectives (`name` in torch.distributed: reduce_scatter_single,
    all_gather_single) in every training step (the real collective, counted on its way through) against
    its sharded blocks, with the dtypes of the tensors it sends; written as `<tag>-rank<r>.pt`."""

    def __init__(self, folder, name, tag):
        self.folder, self.name, self.tag, self.per_step, self.dtypes = folder, name, tag, [], set()

    def on_train_start(self, trainer, pl_module):
        real = getattr(torch.distributed, self.name)

        def counted(output, input, *args, **kwargs):
            self.calls += 1
            self.dtypes.add(input.dtype)
            return real(output, input, *args, **kwargs)

        setattr(torch.distributed, self.name, counted)  # this worker process only

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_step.append(self.calls)

    def on_train_end(self, trainer, pl_module):
        blocks = sum(isinstance(m, FSDPModule) for m in pl_module.modules())
        out = dict(per_step=self.per_step, blocks=blocks, dtypes=self.dtypes)
        torch.save(out, os.path.join(self.folder, f"{self.tag}-rank{trainer.global_rank}.pt"))


def single(steps, tied=False, dtype="float64", **kw):
    ref = LitSeq(tied=tied, dtype=dtype)
    trainer = L.Trainer(devices=1, **trainer_kwargs(max_steps=steps, **kw))
    data = dataset(n=N, tied=tied, dtype=getattr(torch, dtype))
    trainer.fit(ref, DataLoader(data, batch_size=2 * PER_REPLICA, sampler=EpochPerm(N)))
    return ref, trainer


def pipelined(
    model,
    steps,
    train=None,
    callbacks=(),
    ckpt_path=None,
    gradient_clip_val=None,
    val=None,
    precision=None,
    default_root_dir=None,
    **settings,
):
    settings = dict(dict(schedule="1f1b", microbatches=2, width=2, shard="optimizer", start_method=START), **settings)
    kw = dict(enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), gradient_clip_val=gradient_clip_val)
    if default_root_dir is not None:
        kw.update(default_root_dir=default_root_dir)
    if precision is not None:
        kw.update(precision=precision)
    if val is not None:
        kw.update(val_check_interval=2, limit_val_batches=2)
    trainer = L.Trainer(
        devices=4, strategy=AutoPipeStrategy(**settings), callbacks=list(callbacks), **trainer_kwargs(max_steps=steps, **kw)
    )
    trainer.fit(model, train or DataLoader(dataset(n=N), batch_size=PER_REPLICA), val, ckpt_path=ckpt_path)
    return trainer


# clipping active: the global norm is summed over every rank's share of the gradients
@pytest.mark.parametrize("schedule,options", [("1f1b", {}), ("interleaved", {"chunks": 2}), ("zb-h1", {})])
def test_sharded_optimizer_equals_one_process_and_holds_each_state_once(tmp_path, schedule, options):
    ref, _ = single(5, gradient_clip_val=0.05)
    model = LitSeq()
    pipelined(model, 5, callbacks=[RecordState(tmp_path)], schedule=schedule, gradient_clip_val=0.05, **options)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    unclipped, _ = single(5)
    assert max_rel_diff(unclipped.state_dict(), model.state_dict()) > 1e-6  # the clip took effect
    ranks = [torch.load(os.path.join(tmp_path, f"state-rank{r}.pt")) for r in range(4)]
    for stage in range(2):  # ranks 2s + w: stage s of replica w (pipeline outermost, topology.py)
        a, b = ranks[2 * stage], ranks[2 * stage + 1]
        assert a["stage"] == b["stage"]
        assert a["held"] and b["held"] and not a["held"] & b["held"], "each parameter's state on one replica"
        assert a["held"] | b["held"] == set(a["stage"]), "every parameter's state on some replica"
        assert a["moments"] + b["moments"] == sum(a["stage"].values())
    for rank, r in enumerate(ranks):  # mesh[s][w] is stage s of replica w (rank 2s + w); "dp" is the stage's replicas
        assert r["mesh"] == dict(ranks=[[0, 1], [2, 3]], names=("pp", "dp"), dp=[rank - rank % 2, rank - rank % 2 + 1], same=True)


# FSDP2 per block: every parameter, gradient and moment split over the two replicas of its stage; its weights
# gathered for each micro-batch's forward and backward (reshard="microbatch") or once a step (reshard="step",
# with validation between steps: an evaluation frees what it gathered, the next step gathers the updated shards)
@pytest.mark.parametrize(
    "schedule,options,reshard",
    [
        ("1f1b", {}, "microbatch"),
        ("gpipe", {}, "microbatch"),
        ("interleaved", {"chunks": 2}, "microbatch"),
        ("1f1b", {}, "step"),
        ("interleaved", {"chunks": 2}, "step"),
        ("1f1b", {"recompute": True}, "microbatch"),  # a recomputed block's forward replayed on gathered weights
        ("1f1b", {"recompute": True}, "step"),
    ],
)
def test_fully_sharded_replicas_equal_one_process_and_hold_half_of_everything(tmp_path, schedule, options, reshard):
    ref, _ = single(5, gradient_clip_val=0.05)
    model = LitSeq()
    callbacks = [
        RecordState(tmp_path),
        CountCollective(tmp_path, "reduce_scatter_single", "rs"),  # a block's gradients reduce-scattered
        CountCollective(tmp_path, "all_gather_single", "ag"),  # a block's weights gathered
    ]
    val = DataLoader(dataset(n=N), batch_size=PER_REPLICA) if reshard == "step" else None
    pipelined(model, 5, callbacks=callbacks, schedule=schedule, shard="full", gradient_clip_val=0.05, reshard=reshard, val=val, **options)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    for rank in range(4):  # m = 2 micro-batches, one reduce-scatter per sharded block and step
        counts = torch.load(os.path.join(tmp_path, f"rs-rank{rank}.pt"))
        assert counts["blocks"] > 0 and counts["per_step"] == [counts["blocks"]] * 5, counts
        gathers = torch.load(os.path.join(tmp_path, f"ag-rank{rank}.pt"))
        per_block = 1 if reshard == "step" else 2 * 2  # once a step, or for each of the 2 forwards and 2 backwards
        assert gathers["per_step"] == [per_block * gathers["blocks"]] * 5, gathers
    ranks = [torch.load(os.path.join(tmp_path, f"state-rank{r}.pt")) for r in range(4)]
    for stage in range(2):  # the stage's two replicas: ranks 2s, 2s + 1
        a, b = ranks[2 * stage], ranks[2 * stage + 1]
        total = sum(a["stage"].values())
        assert a["held"] == b["held"] == set(a["stage"]), "each rank holds a shard of every parameter's state"
        assert a["weights"] + b["weights"] == total and a["moments"] + b["moments"] == total
        assert a["weights"] < total and b["weights"] < total


class GathersAtForward(Callback):
    """Each rank records, for every training forward of each sharded block, how many all-gathers FSDP2's pre-forward
    issued (a counting hook first, FSDP2's, then a second counting hook): the block's own gather and any it
    prefetches. Written as `pf-rank<r>.pt`: {block index: [count per forward]} in the stage's chunks' order."""

    def __init__(self, folder):
        self.folder, self.calls, self.seen = folder, 0, {}

    def on_train_start(self, trainer, pl_module):
        real = torch.distributed.all_gather_single

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        torch.distributed.all_gather_single = counted  # this worker process only
        stage = trainer.strategy.cut.stage
        self.chunks = [list(range(*stage.chunk_bounds[c])) for c in sorted(stage.chunk_bounds)]
        for index, block in stage.blocks().items():
            if isinstance(block, FSDPModule):
                block.register_forward_pre_hook(lambda *_: setattr(self, "before", self.calls), prepend=True)
                block.register_forward_pre_hook(lambda m, a, i=index: self.record(m, i))

    def record(self, block, index):
        if block.training and torch.is_grad_enabled():
            self.seen.setdefault(index, []).append(self.calls - self.before)

    def on_train_end(self, trainer, pl_module):
        torch.save(dict(seen=self.seen, chunks=self.chunks), os.path.join(self.folder, f"pf-rank{trainer.global_rank}.pt"))


# FSDP2's forward prefetch (reshard="microbatch"): a block's pre-forward gathers its own weights and starts the next
# block's of its chunk, whose own pre-forward then issues none; reshard="step" gathers once a step, nothing to prefetch
@pytest.mark.parametrize(
    "schedule,options,reshard", [("1f1b", {}, "microbatch"), ("interleaved", {"chunks": 2}, "microbatch"), ("1f1b", {}, "step")]
)
def test_each_block_prefetches_the_next_of_its_chunk_in_the_forward(tmp_path, schedule, options, reshard):
    ref, _ = single(3)
    model = LitSeq()
    pipelined(model, 3, callbacks=[GathersAtForward(tmp_path)], schedule=schedule, shard="full", reshard=reshard, **options)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    for rank in range(4):
        out = torch.load(os.path.join(tmp_path, f"pf-rank{rank}.pt"))
        assert any(len([b for b in chunk if b in out["seen"]]) >= 2 for chunk in out["chunks"]), out  # something to prefetch
        for chunk in out["chunks"]:
            held = [b for b in chunk if b in out["seen"]]
            for position, block in enumerate(held):
                counts = out["seen"][block]
                if reshard == "step":  # each step's first forward gathers (m = 2), the other finds the weights held
                    assert counts == [1, 0] * 3, (rank, block, counts)
                    continue
                want = (1 if position == 0 else 0) + (1 if position < len(held) - 1 else 0)
                assert counts == [want] * len(counts), (rank, position, counts)


# zero bubble over FSDP2: BI runs before W has accumulated any weight gradient, so each block's gradients are
# reduce-scattered by hand after the step's last W of its chunk (once a step), never by FSDP2's own post-backward
# after BI (weights then off by a step's missing gradients), and the clipped norm spans every rank's shards
@pytest.mark.parametrize(
    "schedule,reshard", [("zb-h1", "microbatch"), ("zb-v", "microbatch"), ("zb-h1", "step"), ("zb-auto", "microbatch")]
)
def test_fully_sharded_replicas_under_zero_bubble_equal_one_process(tmp_path, schedule, reshard):
    steps = 3
    ref, _ = single(steps, gradient_clip_val=0.05)
    model = LitSeq()
    callbacks = [CountCollective(tmp_path, "reduce_scatter_single", "rs"), CountCollective(tmp_path, "all_gather_single", "ag")]
    val = DataLoader(dataset(n=N), batch_size=PER_REPLICA) if reshard == "step" else None  # an evaluation between steps
    pipelined(model, steps, callbacks=callbacks, schedule=schedule, shard="full", gradient_clip_val=0.05, reshard=reshard, val=val)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    unclipped, _ = single(steps)
    assert max_rel_diff(unclipped.state_dict(), model.state_dict()) > 1e-6  # the clip took effect
    for rank in range(4):
        counts = torch.load(os.path.join(tmp_path, f"rs-rank{rank}.pt"))
        assert counts["blocks"] > 0 and counts["per_step"] == [counts["blocks"]] * steps, counts
        gathers = torch.load(os.path.join(tmp_path, f"ag-rank{rank}.pt"))
        if reshard == "step":  # gathered once a step, kept through every BI and W
            assert gathers["per_step"] == [gathers["blocks"]] * steps, gathers
        else:  # each of the 2 micro-batches' forward and BI, and its W again where a forward freed them between
            assert all(2 * 2 * gathers["blocks"] <= n <= 3 * 2 * gathers["blocks"] for n in gathers["per_step"]), gathers


def moved_apart(got, want, start):
    """How far `got` is from `want`, relative to how far training moved `want` from `start` (L2 over all tensors)."""
    apart = sum(((got[k].double() - want[k].double()) ** 2).sum() for k in want) ** 0.5
    moved = sum(((want[k].double() - start[k].double()) ** 2).sum() for k in want) ** 0.5
    return float(apart / moved)


class RecordDtypes(Callback):
    """Each rank writes the dtypes of its sharded blocks' weights as their training forwards see them (a forward
    pre-hook, after FSDP2's own has gathered them), and of its parameters and optimizer state at the end."""

    def __init__(self, folder):
        self.folder, self.seen = folder, set()

    def on_train_start(self, trainer, pl_module):
        for block in [m for m in pl_module.modules() if isinstance(m, FSDPModule)]:
            block.register_forward_pre_hook(self.record)

    def record(self, block, args):
        if block.training and torch.is_grad_enabled():
            self.seen |= {p.dtype for p in block.parameters()}

    def on_train_end(self, trainer, pl_module):
        state = trainer.optimizers[0].state.values()
        out = dict(
            forward=self.seen,
            params={p.dtype for p in pl_module.parameters()},
            sharded=all(isinstance(p, DTensor) for p in pl_module.parameters()),
            state={s[k].dtype for s in state for k in ("exp_avg", "exp_avg_sq")},
        )
        torch.save(out, os.path.join(self.folder, f"dtypes-rank{trainer.global_rank}.pt"))


# precision="bf16-mixed": FSDP2 gathers each block's weights in bf16 (its forward and backward compute in bf16),
# keeps the shards and Adam's moments fp32 and reduce-scatters in fp32; the weights stay near one process's run in
# the same precision (autocast over fp32 weights), within bf16's rounding. shard_mixed_precision=False: gathered in
# fp32, autocast alone casting, as in that one process. Under zero bubble too (bf16 weight gradients of each W added
# into fp32 ones before the reduce-scatter by hand)
@pytest.mark.parametrize("policy,schedule", [(True, "1f1b"), (False, "1f1b"), (True, "zb-h1")])
def test_fully_sharded_bf16_mixed_gathers_in_bf16_and_keeps_fp32_master_weights(tmp_path, policy, schedule):
    steps = 3
    ref, _ = single(steps, dtype="float32", precision="bf16-mixed")
    fp32, _ = single(steps, dtype="float32")
    model = LitSeq(dtype="float32")
    train = DataLoader(dataset(n=N, dtype=torch.float32), batch_size=PER_REPLICA)
    callbacks = [
        RecordDtypes(tmp_path),
        CountCollective(tmp_path, "reduce_scatter_single", "rs"),
        CountCollective(tmp_path, "all_gather_single", "ag"),
    ]
    settings = dict(shard="full", schedule=schedule, shard_mixed_precision=policy)
    pipelined(model, steps, train=train, callbacks=callbacks, precision="bf16-mixed", **settings)
    start = LitSeq(dtype="float32").state_dict()
    # bf16's tolerance: the pipelined run's weights off one process's by 3% of how far training moved them; fp32
    # training lands 10% off, so the bound tells the precisions apart (Adam's sign-like first steps amplify rounding)
    assert moved_apart(model.state_dict(), ref.state_dict(), start) <= 0.05
    assert moved_apart(fp32.state_dict(), ref.state_dict(), start) > 0.05
    for rank in range(4):
        dtypes = torch.load(os.path.join(tmp_path, f"dtypes-rank{rank}.pt"))
        gathered = torch.bfloat16 if policy else torch.float32
        assert dtypes["forward"] == {gathered}, "the weights a forward sees"
        assert dtypes["sharded"] and dtypes["params"] == {torch.float32}, "fp32 shards: the master weights"
        assert dtypes["state"] == {torch.float32}
        assert torch.load(os.path.join(tmp_path, f"ag-rank{rank}.pt"))["dtypes"] == {gathered}
        assert torch.load(os.path.join(tmp_path, f"rs-rank{rank}.pt"))["dtypes"] == {torch.float32}, "reduced in fp32"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def single_2bw(steps, clip=None, n=N):
    """PipeDream-2BW's rule on one process (test_two_bw_strategy.reference_2bw) over the global batches of `n` rows:
    batch b's gradient taken at W(max(b - 1, 0)), applied to W(b) (clipped by its global norm)."""
    data, batches, sampler = dataset(n=n), [], EpochPerm(n)
    while len(batches) < steps:
        batches += list(DataLoader(data, batch_size=2 * PER_REPLICA, sampler=sampler))
    return reference_2bw(steps, clip=clip, batches=batches)[0]


# PipeDream-2BW over FSDP2: each rank stashes its shard of the older version, and FSDP2 gathers a micro-batch's
# version for its forward and again for its backward; a batch's gradients are reduce-scattered once, at its own
# last backward (stage 0 keeps one forward ahead: batch t completes in step t + 1, the last batch in the drain at
# the end; the last stage completes each batch in its own step), and kept apart from the batch before it until
# that one's update
@pytest.mark.parametrize("recompute", [False, True])  # a recomputed block's replay gathers its batch's version too
def test_2bw_over_fully_sharded_replicas_follows_its_rule_and_reduces_once_a_batch(tmp_path, recompute):
    steps = 5
    ref = single_2bw(steps, clip=0.05)
    model = LitSeq()
    callbacks = [RecordState(tmp_path), CountCollective(tmp_path, "reduce_scatter_single", "rs")]
    pipelined(model, steps, callbacks=callbacks, schedule="2bw", shard="full", gradient_clip_val=0.05, recompute=recompute)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    assert max_rel_diff(single_2bw(steps).state_dict(), model.state_dict()) > 1e-6  # the clip took effect
    flush, _ = single(steps, gradient_clip_val=0.05)
    assert max_rel_diff(flush.state_dict(), model.state_dict()) > 1e-6  # 1-stale: not the flushing update
    for rank in range(4):
        counts = torch.load(os.path.join(tmp_path, f"rs-rank{rank}.pt"))
        blocks, stage = counts["blocks"], rank // 2
        first = [0] if stage == 0 else []  # stage 0's step 0 completes no batch
        assert blocks > 0 and counts["per_step"] == first + [blocks] * (steps - len(first)), counts
        state = torch.load(os.path.join(tmp_path, f"state-rank{rank}.pt"))
        assert state["weights"] < sum(state["stage"].values())


def test_the_2bw_planner_plans_over_fully_sharded_replicas_and_runs_exactly(tmp_path):
    # planner=2bw with shard=full on 4 processes: widths of at least 2 (something to shard over), each candidate
    # priced with FSDP2's gathers and reduce-scatter and its memory sharded; a global batch of 10 leaves w = 2, d = 2,
    # and 2BW (m >= d) micro-batches of 1, the collectives measured on the job's processes. It trains by PipeDream-2BW's
    # rule on the global batch
    model = LitSeq()
    pipelined(model, 5, schedule="2bw", shard="full", planner="2bw", global_batch=10, width=1, default_root_dir=str(tmp_path))
    (path,) = glob.glob(os.path.join(tmp_path, "**", "plan_2bw.json"), recursive=True)
    plan = json.load(open(path))
    assert (plan["chosen"]["width"], plan["chosen"]["depth"], plan["chosen"]["shard"]) == (2, 2, "full")
    assert all(c["width"] >= 2 and c["shard"] == "full" for c in plan["candidates"]) and plan["mesh"]["searched"] is False
    assert plan["hardware"]["intra_collectives"]["source"] == "measured on 4 ranks (cpu)"  # its gathers priced as measured
    assert max_rel_diff(single_2bw(5).state_dict(), model.state_dict()) <= 1e-10


# schedule="auto" over FSDP2: every candidate is planned and simulated on the blocks' profiled costs plus FSDP2's
# all-gather of each block's weights over the replicas (measured on the run's data-parallel group) before each
# forward and each backward, or once a step; the chosen schedule trains as one process. With a tied embedding and
# head (FSDP2 shards each block on its own) the candidates that place both on one rank (a V's first and last chunk)
# cannot run
@pytest.mark.parametrize("reshard,tied", [("microbatch", False), ("step", True)])
def test_schedule_auto_prices_fsdp2_gathers_and_trains_as_one_process(tmp_path, reshard, tied):
    ref, _ = single(5, tied=tied, gradient_clip_val=0.05)
    model = LitSeq(tied=tied)
    train = DataLoader(dataset(n=N, tied=tied), batch_size=PER_REPLICA)
    kw = dict(schedule="auto", shard="full", reshard=reshard, partition="uniform", gradient_clip_val=0.05)
    pipelined(model, 5, train=train, default_root_dir=str(tmp_path), **kw)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    (path,) = glob.glob(os.path.join(tmp_path, "**", "plan.json"), recursive=True)
    plan = json.load(open(path))
    gathers = plan["gathers"]["seconds_per_block"]
    assert plan["gathers"]["collectives"].startswith("measured on 2 ranks") and all(g > 0 for g in gathers)
    profile = Profile.load(os.path.join(os.path.dirname(path), "profile.json"))
    costs = profile.costs(*link_model(PipelineConfig(), "cpu"))
    assert len(gathers) == costs.num_blocks
    # the rule written here: each gather before every forward and backward, or once a step (over its m = 2 forwards)
    forward = [f + (g / 2 if reshard == "step" else g) for f, g in zip(costs.forward, gathers)]
    backward = [b + (0 if reshard == "step" else g) for b, g in zip(costs.backward, gathers)]
    gathered = dataclasses.replace(costs, forward=tuple(forward), backward=tuple(backward), weight=(), backward_input=())
    candidates = plan["schedule_choice"]["candidates"]
    (one,) = [c for c in candidates if c["schedule"] == "1f1b"]
    bounds = [tuple(b) for b in one["bounds"]]
    assert one["iteration_time"] == pytest.approx(simulate(one_f_one_b(2, 2), gathered, bounds).iteration_time, rel=1e-9)
    assert one["iteration_time"] > simulate(one_f_one_b(2, 2), costs, bounds).iteration_time
    apart = {c["schedule"] + str(c["options"]): c["verdict"] for c in candidates if "share a weight" in c["verdict"]}
    if not tied:
        assert not apart
        return
    assert model.seq[0].emb.weight is model.seq[-1].weight
    assert all(f"blocks 0 and {costs.num_blocks - 1} share a weight" in v for v in apart.values()), apart
    assert "zb-v{}" in apart and "wave{'waves': 1}" in apart and "1f1b{}" not in apart  # the V shapes, not a straight line


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_2bw_over_fully_sharded_replicas_resumes_bit_for_bit(tmp_path, layout):
    # the checkpoint holds the stashed W(2) that batch 3 reads, whole (every rank's shard gathered)
    def resumable():
        return StatefulDataLoader(dataset(n=N), batch_size=PER_REPLICA)

    whole = LitSeq()
    pipelined(whole, 5, train=resumable(), schedule="2bw", shard="full")
    saver = ModelCheckpoint(dirpath=tmp_path / "first", every_n_train_steps=3, save_top_k=-1)
    pipelined(LitSeq(), 3, train=resumable(), callbacks=[saver], checkpoint=layout, schedule="2bw", shard="full")
    (path,) = glob.glob(os.path.join(tmp_path, "first", "*step=3.ckpt"))
    full = torch.load(path, weights_only=False) if layout == "full" else consolidate(path, tmp_path / "full.ckpt")
    stashes = {n: s["autopipe_2bw_previous"] for n, s in full["optimizer_states"][0]["state"].items()}
    w2 = single_2bw(2).state_dict()
    assert set(stashes) == set(w2) and max_rel_diff(w2, stashes) <= 1e-10
    resumed = LitSeq(seed=5)
    pipelined(resumed, 5, train=resumable(), ckpt_path=path, checkpoint=layout, schedule="2bw", shard="full")
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    assert max_rel_diff(single_2bw(5).state_dict(), resumed.state_dict()) <= 1e-10


# the embedding on stage 0 and the head on stage 1 share one weight: its gradient is summed across the stages
# (shard-wise under FSDP2, after zero bubble's reduce-scatter by hand) and counts once in the clipped norm
@pytest.mark.parametrize("shard,schedule", [("optimizer", "1f1b"), ("full", "1f1b"), ("full", "zb-h1")])
def test_a_weight_tied_across_stages_with_sharded_replicas(shard, schedule):
    ref, _ = single(5, tied=True, gradient_clip_val=0.05)
    model = LitSeq(tied=True)
    train = DataLoader(dataset(n=N, tied=True), batch_size=PER_REPLICA)
    pipelined(model, 5, train=train, shard=shard, schedule=schedule, partition=[2, 3], gradient_clip_val=0.05)
    assert model.seq[0].emb.weight is model.seq[-1].weight
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


def adam_state_by_name(module, optimizer):
    names = {p: n for n, p in module.named_parameters()}
    return {names[p]: s for p, s in optimizer.state.items()}


@pytest.mark.parametrize("shard", ["optimizer", "full"])
@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_checkpoint_holds_the_whole_state_and_resumes_bit_for_bit(tmp_path, layout, shard):
    def resumable():
        return StatefulDataLoader(dataset(n=N), batch_size=PER_REPLICA)

    whole = LitSeq()
    pipelined(whole, 5, train=resumable(), shard=shard)
    saver = ModelCheckpoint(dirpath=tmp_path / "first", every_n_train_steps=2, save_top_k=-1)
    pipelined(LitSeq(), 2, train=resumable(), callbacks=[saver], checkpoint=layout, shard=shard)
    (path,) = glob.glob(os.path.join(tmp_path, "first", "*step=2.ckpt"))
    # the file is shard="none"'s: every parameter's Adam state, equal to one process's after 2 steps
    full = torch.load(path, weights_only=False) if layout == "full" else consolidate(path, tmp_path / "full.ckpt")
    ref, trainer = single(2)
    want = adam_state_by_name(ref, trainer.optimizers[0])
    got = full["optimizer_states"][0]["state"]
    assert set(want) <= set(got)
    for name, state in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(got[name][key], state[key], rtol=1e-10, atol=1e-14), (name, key)
    assert max_rel_diff(ref.state_dict(), {k: full["state_dict"][k] for k in ref.state_dict()}) <= 1e-10
    resumed = LitSeq(seed=5)
    pipelined(resumed, 5, train=resumable(), ckpt_path=path, checkpoint=layout, shard=shard)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_a_checkpoint_resumes_under_another_shard_setting(tmp_path):
    # written by FSDP2 (shard="full"), resumed by ZeRO-1 and by whole replicas on the same pp2 x dp2 mesh
    def resumable():
        return StatefulDataLoader(dataset(n=N), batch_size=PER_REPLICA)

    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    pipelined(LitSeq(), 2, train=resumable(), callbacks=[saver], shard="full")
    (path,) = glob.glob(os.path.join(tmp_path, "*step=2.ckpt"))
    want, _ = single(5)
    for shard in ("optimizer", "none"):
        resumed = LitSeq(seed=5)
        pipelined(resumed, 5, train=resumable(), ckpt_path=path, shard=shard)
        assert max_rel_diff(want.state_dict(), resumed.state_dict()) <= 1e-10, shard


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
@pytest.mark.parametrize(
    "first,then", [(dict(width=2, shard="full"), dict(width=1, shard="none")), (dict(width=1, shard="none"), dict(width=2, shard="full"))]
)
def test_a_checkpoint_resumes_on_another_mesh(tmp_path, first, then, schedule):
    # pp2 x dp2 with FSDP2 -> pp4, and back: the checkpoint holds whole tensors by name (2BW's stashed version too),
    # so it continues on another mesh. Every step trains on all 10 rows (one batch an epoch): pp4's one replica reads
    # them at once, pp2 x dp2's two replicas 5 each, so both layouts step on one process's batch whatever order their
    # samplers deal it in
    rows = 2 * PER_REPLICA

    def loader_for(settings):
        return DataLoader(dataset(n=rows), batch_size=rows // settings["width"])

    if schedule == "2bw":
        want = single_2bw(8, n=rows)
    else:
        want = LitSeq()
        L.Trainer(devices=1, **trainer_kwargs(max_steps=8)).fit(want, DataLoader(dataset(n=rows), batch_size=rows))
    m = 4 if schedule == "2bw" else 2  # 2BW on pp4: m >= d
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    pipelined(LitSeq(), 4, train=loader_for(first), callbacks=[saver], partition="uniform", schedule=schedule, microbatches=m, **first)
    (path,) = glob.glob(os.path.join(tmp_path, "*step=4.ckpt"))
    resumed = LitSeq(seed=5)
    pipelined(resumed, 8, train=loader_for(then), ckpt_path=path, partition="uniform", schedule=schedule, microbatches=m, **then)
    assert max_rel_diff(want.state_dict(), resumed.state_dict()) <= 1e-10
