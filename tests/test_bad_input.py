"""Bad settings fail fast with the setting's name and allowed values, before processes start."""

from __future__ import annotations

import multiprocessing
import time

import lightning as L
import pytest
import torch
from models import START, LitSeq, loader, trainer_kwargs
from torch import nn

from lightning_pipe import AutoPipeStrategy


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(schedule="zigzag"),
            r"schedule='zigzag' is not a known schedule; allowed values: \['1f1b', '2bw', 'advance', 'gpipe', 'hanayo', 'interleaved', 'wave', 'zb-auto', 'zb-h1', 'zb-v', 'flush', 'auto'\]",
        ),
        (dict(microbatches=0), r"microbatches=0: .* integer >= 1"),
        (dict(width=0), r"width=0: .* integer >= 1"),
        (
            dict(partition="magic"),
            r"partition='magic' is not a known method; allowed: \['autopipe', 'autopipe\+refine', 'dp', 'exhaustive', 'parameters', 'uniform'\]",
        ),
        (dict(slicer=9, microbatches=4), r"slicer=9: True \(the simulator chooses\), False, or a count 0..microbatches=4"),
        (dict(partition=[2, 0, 4]), r"partition=\[2, 0, 4\]: a list of blocks per stage must hold integers >= 1"),
        (dict(start_method="thread"), r"start_method='thread'; allowed values"),
        (dict(schedule="wave", waves=0), r"waves=0: must be an integer >= 1"),
        (dict(schedule="interleaved", chunks=0), r"chunks=0: must be an integer >= 1"),
        (dict(schedule="wave", slicer=True), r"slicer=True works with schedule='gpipe' or '1f1b', not 'wave'"),
        (dict(schedule="auto", partition=[3, 3]), r"schedule='auto' plans its own partition .* partition=\[3, 3\] must be a method name"),
        (dict(schedule="auto", memory_limit=-1), r"memory_limit=-1: bytes per device, a number > 0 or a size such as 16GB"),
    ],
)
def test_strategy_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoPipeStrategy(**kwargs)


def test_width_must_divide_world_size():
    with pytest.raises(ValueError, match=r"width=3 does not divide the world size 4 .*allowed widths: \[1, 2, 4\]"):
        L.Trainer(devices=4, strategy=AutoPipeStrategy(width=3, start_method=START), **trainer_kwargs())


class NoPipeline(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)


class TwoPipelines(LitSeq):
    def __init__(self):
        super().__init__()
        self.other = nn.Sequential(nn.Linear(2, 2))


class OutsideParameter(LitSeq):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))


def fails_before_spawn(model, devices, match, **strategy_kwargs):
    trainer = L.Trainer(devices=devices, strategy=AutoPipeStrategy(start_method=START, **strategy_kwargs), **trainer_kwargs())
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, loader(batch_size=strategy_kwargs.pop("batch_size", 10)))
    assert not multiprocessing.active_children(), "no worker process may have been started"
    assert time.perf_counter() - start < 5


def test_partition_must_sum_to_block_count():
    fails_before_spawn(LitSeq(), 2, r"partition=\[2, 2\] sums to 4 blocks but the model has 6 blocks", partition=[2, 2])


def test_partition_length_must_match_stages():
    fails_before_spawn(LitSeq(), 2, r"partition=\[1, 2, 3\] lists 3 stages but the pipeline has 2 stages", partition=[1, 2, 3])


def test_more_stages_than_blocks():
    fails_before_spawn(LitSeq(blocks=2), 4, r"the pipeline has 4 stages but the model only 2 blocks")


def test_waves_that_do_not_fit_the_model():
    fails_before_spawn(
        LitSeq(),
        2,
        r"schedule='wave' with waves=2 on 2 ranks cuts the model into 2 x 2 x 2 = 8 chunks, "
        r"more than its 6 blocks: use waves <= 1",
        schedule="wave",
        waves=2,
    )


def test_more_interleaved_chunks_than_blocks():
    fails_before_spawn(
        LitSeq(),
        2,
        r"schedule='interleaved' with chunks=4 on 2 ranks cuts the model into 8 chunks, more "
        r"than its 6 blocks: use chunks <= 3",
        schedule="interleaved",
        chunks=4,
    )


def test_microbatches_interleaved_cannot_use():
    # known as soon as the Trainer knows its devices: it refuses to be built
    with pytest.raises(ValueError, match=r"microbatches=3: interleaved 1F1B needs a multiple of the 2 stages \(e.g. 4\)"):
        L.Trainer(devices=2, strategy=AutoPipeStrategy(schedule="interleaved", microbatches=3, start_method=START), **trainer_kwargs())


def test_module_without_pipeline():
    fails_before_spawn(
        NoPipeline(),
        2,
        r"NoPipeline has no pipeline: no nn.Sequential child, no configure_pipeline\(\) and no nn.ModuleList of repeated blocks",
    )


def test_module_with_two_sequentials_must_choose():
    fails_before_spawn(TwoPipelines(), 2, r"several nn.Sequential children \(seq, other\): define configure_pipeline\(\)")


def test_parameters_outside_the_pipeline():
    fails_before_spawn(OutsideParameter(), 2, r"trainable parameters outside its pipeline 'seq': temperature")


def test_batch_smaller_than_microbatches():
    trainer = L.Trainer(devices=2, strategy=AutoPipeStrategy(microbatches=4, start_method=START), **trainer_kwargs())
    with pytest.raises(ValueError, match=r"batch_size=3 is smaller than microbatches=4"):
        trainer.fit(LitSeq(), loader(batch_size=3))
    assert not multiprocessing.active_children()


@pytest.mark.multiprocess
def test_short_last_batch_fails_clearly_in_the_workers():
    # 41 samples in batches of 10: the last batch holds 1 sample, fewer than 2 micro-batches
    trainer = L.Trainer(devices=2, strategy=AutoPipeStrategy(microbatches=2, start_method=START), **trainer_kwargs(max_steps=10))
    with pytest.raises(Exception, match=r"a batch of 1 samples cannot be split into microbatches=2"):
        trainer.fit(LitSeq(), loader(n=41))


def test_saved_profile_must_match_the_model(tmp_path):
    from lightning_pipe.profiling import Profile

    path = Profile.synthetic([1.0] * 4).save(tmp_path / "profile.json")
    fails_before_spawn(LitSeq(), 2, r"the profile synthetic-mbs1-synthetic-synthetic has 4 blocks but the model has 6", profile=str(path))


# ---- issue 10: the interleaved schedule's micro-batch error names pipeline.microbatches ---------
def _cli(module, args, cwd):
    """`python -m module args`; refused before any process starts: forked from the tests' fork server (tests/_cli.py)."""
    import os
    from pathlib import Path

    from _cli import run_module

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    env.pop("LOCAL_RANK", None)
    return run_module(module, [*args, f"hydra.run.dir={cwd / 'run'}"], cwd, env, timeout=120)


def test_interleaved_microbatch_error_names_the_microbatches_setting():
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.errors import SettingError
    from lightning_pipe.planning import plan
    from lightning_pipe.profiling import Profile

    for m, world in [(3, 2), (1, 2), (6, 4)]:
        with pytest.raises(SettingError, match=rf"microbatches={m}: interleaved 1F1B needs a multiple of the {world} stages") as err:
            PipelineConfig(schedule="interleaved", microbatches=m).check_model(world, 10)
        assert err.value.setting == "microbatches"
        # the planner builds the schedule itself (the plan command): the same setting
        with pytest.raises(SettingError, match=rf"microbatches={m}: interleaved") as err:
            plan(Profile.synthetic([1.0] * 10).costs(), world, m, schedule="interleaved", options={"chunks": 2})
        assert err.value.setting == "microbatches"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", ["lightning_pipe.train", "lightning_pipe.plan"])
@pytest.mark.parametrize("m,devices", [(3, 2), (6, 4)])
def test_interleaved_microbatch_error_in_the_cli_names_pipeline_microbatches(tmp_path, module, m, devices):
    args = ["pipeline.schedule=interleaved", f"pipeline.microbatches={m}", f"trainer.devices={devices}", "trainer.max_steps=1"]
    proc = _cli(module, args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: microbatches={m}: interleaved 1F1B needs a multiple of the {devices} stages"), line
    assert "(pipeline.microbatches" in line and "pipeline.partition" not in line, line
