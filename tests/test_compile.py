"""compile=True: every block torch.compile'd once, trained through the Trainer on 2 processes in float32,
ends within 1e-5 of one eager process (the flush schedules) or of 2BW's rule run eagerly in one process;
the schedules it cannot run are refused before any process starts; graph breaks are reported."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from models import START, LitSeq, loader, max_rel_diff
from test_strategy import pipelined, single
from test_two_bw_strategy import reference_2bw
from test_zero import CountCollective, single_2bw
from test_zero import pipelined as pipelined_dp
from test_zero import single as single_global
from torch import nn

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.lightning.compiling import COMPILED, compile_blocks, graph_breaks, uncompile_blocks

TOL = 1e-5  # float32: compiled kernels may fuse and reorder what eager computes op by op


class RecordCompiled(Callback):
    """Each rank writes how many of its stage's blocks are compiled and whether their calls ran under
    torch.compile (a forward hook, traced with the block, sees `torch.compiler.is_compiling()`)."""

    def __init__(self, folder, hooks: bool):
        self.folder, self.hooks, self.seen = folder, hooks, []

    def on_train_start(self, trainer, pl_module):
        if self.hooks:  # a hook added after compiling makes Dynamo trace the blocks again: one schedule checks it
            for block in pl_module.seq.blocks().values():
                block.register_forward_hook(lambda module, args, out: self.seen.append(torch.compiler.is_compiling()))

    def on_train_end(self, trainer, pl_module):
        blocks = list(pl_module.seq.blocks().values())
        out = dict(blocks=len(blocks), compiled=sum(bool(getattr(b, COMPILED, False)) for b in blocks), traced=any(self.seen))
        torch.save(out, os.path.join(self.folder, f"compiled-rank{trainer.global_rank}.pt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "schedule,options", [("gpipe", {}), ("1f1b", {}), ("interleaved", {"chunks": 2}), ("hanayo", {"waves": 1}), ("advance", {})]
)
def test_compiled_blocks_train_like_one_eager_process(tmp_path, schedule, options):
    # 46 samples in batches of 10: the last batch of 6 splits into micro-batches of 2, 2, 1, 1 (another shape)
    ref = LitSeq(dtype="float32")
    single(ref, steps=5, train=loader(dtype=torch.float32))
    model = LitSeq(dtype="float32")
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=4, partition="uniform", compile=True, start_method=START, **options)
    pipelined(
        model, 2, steps=5, train=loader(dtype=torch.float32), strategy=strategy, callbacks=[RecordCompiled(tmp_path, schedule == "1f1b")]
    )
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= TOL
    untrained = LitSeq(dtype="float32")
    assert max_rel_diff(untrained.state_dict(), model.state_dict()) > 100 * TOL  # it trained
    for rank in range(2):  # every block of every stage ran compiled
        seen = torch.load(os.path.join(tmp_path, f"compiled-rank{rank}.pt"))
        assert seen["blocks"] > 0 and seen["compiled"] == seen["blocks"], seen
        assert seen["traced"] or schedule != "1f1b", seen


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compiled_blocks_follow_the_2bw_rule():
    ref, _ = reference_2bw(5, "float32")
    model = LitSeq(dtype="float32")
    strategy = AutoPipeStrategy(schedule="2bw", microbatches=2, partition="uniform", compile=True, start_method=START)
    pipelined(model, 2, steps=5, train=loader(dtype=torch.float32), strategy=strategy)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= TOL


# compiled blocks sharded by FSDP2 (torchtitan's order: compiled, then fully_shard): FSDP2's gathers around each
# compiled forward and backward, 1F1B exact to one process and 2BW to its rule (fp64); on global rank 0, which
# shards a copy of each block to hand the trained model back, the copy is compiled too
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_compiled_blocks_under_fully_sharded_replicas_train_exactly(tmp_path, schedule):
    ref = single_2bw(5) if schedule == "2bw" else single_global(5)[0]
    model = LitSeq()
    gathers = CountCollective(tmp_path, "all_gather_single", "ag")
    pipelined_dp(model, 5, schedule=schedule, shard="full", compile=True, callbacks=[RecordCompiled(tmp_path, True), gathers])
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    for rank in range(4):
        seen = torch.load(os.path.join(tmp_path, f"compiled-rank{rank}.pt"))
        assert seen["blocks"] > 0 and seen["compiled"] == seen["blocks"] and seen["traced"], (rank, seen)
        counts = torch.load(os.path.join(tmp_path, f"ag-rank{rank}.pt"))  # gathered for each of 2 forwards and 2 backwards
        first, *steady = counts["per_step"]  # (2BW's first step on stage 0 leaves one backward to the next)
        assert steady == [4 * counts["blocks"]] * 4 and 3 * counts["blocks"] <= first <= 4 * counts["blocks"], (rank, counts)


def test_what_compile_cannot_run_is_refused_before_spawning():
    for settings, words in [
        (dict(schedule="zb-h1"), "schedule='zb-h1'"),
        (dict(schedule="zb-auto"), "schedule='zb-auto'"),
    ]:
        with pytest.raises(SettingError, match="compile=True") as err:
            PipelineConfig(compile=True, **settings)
        assert words in str(err.value) and err.value.setting == "compile"
    for bad in ("yes", 1):
        with pytest.raises(SettingError, match=f"compile={bad!r}: True .*, False or 'auto'"):
            PipelineConfig(compile=bad)
    for settings in (dict(), dict(schedule="1f1b"), dict(schedule="zb-h1")):  # 'auto' weighs within schedule='auto' only
        with pytest.raises(SettingError, match="compile='auto' .* set schedule='auto'") as err:
            AutoPipeStrategy(compile="auto", **settings)
        assert err.value.setting == "compile" and "\n" not in str(err.value)
    PipelineConfig(compile="auto", schedule="auto")  # legal
    PipelineConfig(compile="auto", schedule="auto", width=2, shard="full")  # FSDP2's gathers priced in both plans
    assert PipelineConfig(compile=True, width=2, shard="full", schedule="2bw").compile is True  # FSDP2 over compiled blocks runs


class Probe(nn.Module):
    """Says whether each call ran under torch.compile (True while Dynamo traces it, replayed on each call)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(torch.compiler.is_compiling())
        return x + 1


def test_uncompiled_blocks_run_eager_again():
    torch._dynamo.reset()
    pipeline = nn.Sequential(nn.Linear(4, 4), Probe())
    compile_blocks(pipeline)
    pipeline(torch.ones(2, 4))
    assert pipeline[1].seen[-1] is True
    uncompile_blocks(pipeline)
    assert not any(hasattr(block, COMPILED) for block in pipeline)
    pipeline(torch.ones(2, 4))
    assert pipeline[1].seen[-1] is False
    assert compile_blocks(pipeline) == 2  # and can be compiled again
    torch._dynamo.reset()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compile_auto_plans_both_and_runs_the_faster_exactly(tmp_path):
    # schedule='auto' with compile='auto': eager and compiled blocks each profiled and planned (the
    # compiled plan without zero bubble), the faster simulated step kept on every rank
    ref = LitSeq(dtype="float32")
    single(ref, steps=5, train=loader(dtype=torch.float32))
    model = LitSeq(dtype="float32")
    strategy = AutoPipeStrategy(schedule="auto", microbatches=4, compile="auto", start_method=START)
    pipelined(model, 2, steps=5, train=loader(dtype=torch.float32), strategy=strategy, callbacks=[RecordCompiled(tmp_path, False)],
              default_root_dir=tmp_path)  # fmt: skip
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= TOL
    weighed = json.loads((tmp_path / "plan.json").read_text())["compile"]
    times = {k: weighed[k]["chosen"]["iteration_time"] for k in ("eager", "compiled")}
    chosen = "compiled" if times["compiled"] < times["eager"] else "eager"
    assert weighed["chosen"] == chosen, weighed
    assert not any(c["schedule"].startswith("zb") for c in weighed["compiled"]["candidates"])  # what compiled blocks cannot run
    assert any(c["schedule"].startswith("zb") for c in weighed["eager"]["candidates"])
    for rank in range(2):  # every rank runs its blocks as rank 0 chose
        seen = torch.load(os.path.join(tmp_path, f"compiled-rank{rank}.pt"))
        assert seen["compiled"] == (seen["blocks"] if chosen == "compiled" else 0), (seen, chosen)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compile_auto_over_fully_sharded_replicas_runs_the_faster_exactly(tmp_path):
    # the same weighing on pp2 x dp2 with shard='full' (fp64): both plans priced with FSDP2's gathers, the blocks
    # kept (compiled or eager, on every rank as rank 0 chose) then sharded, and training as one process
    ref = single_global(5)[0]
    model = LitSeq()
    callbacks = [RecordCompiled(tmp_path, False)]
    pipelined_dp(model, 5, schedule="auto", shard="full", compile="auto", callbacks=callbacks, default_root_dir=str(tmp_path))
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    (path,) = glob.glob(os.path.join(tmp_path, "**", "plan.json"), recursive=True)
    plan = json.loads(open(path).read())
    weighed, gathers = plan["compile"], plan["gathers"]
    assert gathers["collectives"].startswith("measured on 2 ranks") and all(g > 0 for g in gathers["seconds_per_block"])
    times = {k: weighed[k]["chosen"]["iteration_time"] for k in ("eager", "compiled")}
    chosen = "compiled" if times["compiled"] < times["eager"] else "eager"
    assert weighed["chosen"] == chosen, weighed
    for rank in range(4):
        seen = torch.load(os.path.join(tmp_path, f"compiled-rank{rank}.pt"))
        assert seen["compiled"] == (seen["blocks"] if chosen == "compiled" else 0), (rank, seen, chosen)


class Breaks(nn.Module):
    def forward(self, x):
        x = x * 2
        torch._dynamo.graph_break()  # Python in the middle of the block: Dynamo splits it here
        return x + 1


def test_blocks_compile_once_and_graph_breaks_are_reported():
    torch._dynamo.reset()
    pipeline = nn.Sequential(nn.Linear(4, 4), Breaks())
    assert compile_blocks(pipeline) == 2 and compile_blocks(pipeline) == 0  # a second fit finds them compiled
    assert all(getattr(block, COMPILED) for block in pipeline)
    assert list(dict(pipeline.named_parameters())) == ["0.weight", "0.bias"]  # the state dict's names unchanged
    out = pipeline(torch.ones(2, 4))
    assert torch.allclose(out, nn.Sequential(*[b for b in pipeline])(torch.ones(2, 4)))
    line = graph_breaks()
    assert line is not None and line.startswith("compile=True: ") and "graph break" in line
    torch._dynamo.reset()
