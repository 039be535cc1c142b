"""Zero-bubble schedules composed with the other layers, each against its one-process rule (fp64):
replicas (all-reduce across width), adaptive switches (blocks moving between stages mid-run) and
AvgPipe's elastic averaging with zero-bubble pipelines."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import lightning as L
import pytest
from models import START, EpochPerm, LitSeq, dataset, max_rel_diff, trainer_kwargs
from test_adaptive import SwitchAt, gpt_data, make, partitions_over_time, single_process
from test_avgpipe import fit, parallel_models, saved
from test_avgpipe import simulate as elastic_rule
from test_strategy import pipelined, single
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_replicas_of_a_zero_bubble_pipeline_equal_one_process(schedule):
    # 2 replicas x 2 stages; each step's global batch is the two replicas' halves (DistributedSampler)
    n, per_replica = 40, 5
    ds = dataset(n=n)
    ref = LitSeq()
    single(ref, steps=4, train=DataLoader(ds, batch_size=2 * per_replica, sampler=EpochPerm(n)))
    model = LitSeq()
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=3, width=2, start_method=START)
    pipelined(model, 4, steps=4, train=DataLoader(ds, batch_size=per_replica), strategy=strategy)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


SWITCHES = {
    # GPT tiny, 3 layers = 8 blocks; ZB-V puts chunks 0 and 3 (tied embedding and head) on rank 0
    "zb-h1": ([4, 4], {2: [[0, 2], [2, 8]], 4: [[0, 5], [5, 8]]}),
    "zb-v": ([2, 2, 2, 2], {2: [[0, 3], [3, 4], [4, 5], [5, 8]], 4: [[0, 1], [1, 4], [4, 7], [7, 8]]}),
}


@pytest.mark.parametrize("schedule", list(SWITCHES))
def test_adaptive_switches_under_zero_bubble_keep_one_process_weights(tmp_path, schedule):
    partition, plan = SWITCHES[schedule]
    ref = single_process(3, 6)
    model = make(3)
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=4, partition=partition, start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, callbacks=[SwitchAt(plan)], **trainer_kwargs(max_steps=6, default_root_dir=tmp_path))
    trainer.fit(model, gpt_data())
    assert model.model[-1].weight is model.model[0].token.weight
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    seen = json.loads(Path("held-0.json").read_text())
    assert [bounds for bounds, _ in seen] == partitions_over_time(plan, partition, 6, 1)  # the switches happened


def test_avgpipe_with_zero_bubble_pipelines_follows_the_elastic_rule(tmp_path):
    # 2 pipelines x 2 stages of ZB-H1; the reference and each pipeline follow AvgPipe's rule as with 1F1B
    model = LitSeq()
    fit(model, 5, callbacks=[saved(tmp_path, 5)], enable_checkpointing=True, schedule="zb-h1", default_root_dir=tmp_path)
    want_parallel, want_ref = elastic_rule(5, 2, 0.5, 0)
    (path,) = glob.glob(os.path.join(tmp_path, "*step=5.ckpt"))
    reference, parallel = parallel_models(path)
    assert max_rel_diff(want_ref, reference) <= 1e-10 and max_rel_diff(want_ref, model.state_dict()) <= 1e-10
    for n in range(2):
        assert max_rel_diff(want_parallel[n], parallel[n]) <= 1e-10
