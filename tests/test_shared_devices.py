"""AvgPipe's N pipelines share the devices (the paper's layout, §3): N processes per device, each
pipeline spanning every device once; `share_devices=False` keeps a device per process."""

from __future__ import annotations

import glob
import os

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.plugins.environments import LightningEnvironment
from models import START, LitSeq, dataset, max_rel_diff, trainer_kwargs
from test_avgpipe import parallel_models, saved, simulate
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.topology import Topology


@settings(deadline=None, max_examples=60)
@given(nodes=st.integers(1, 3), devices=st.integers(1, 4), pipelines=st.integers(1, 4))
def test_shared_layout_puts_each_pipeline_once_on_every_device(nodes, devices, pipelines):
    # Lightning numbers ranks node by node: global = node * (N x devices) + local, device = local % devices
    processes = devices * pipelines
    topology = PipelineConfig(pipelines=pipelines).topology(nodes * processes, devices)
    assert topology.depth == nodes * devices and topology.width == pipelines
    seen = set()
    for rank in range(nodes * processes):
        node, local = divmod(rank, processes)
        stage, replica = topology.stage_of(rank), topology.replica_of(rank)
        assert topology.global_rank(replica, stage) == rank
        seen.add((replica, stage))
        # the node holds its devices' stages of every pipeline, stage k on its device k
        assert stage // devices == node and stage % devices == local % devices
    assert len(seen) == nodes * processes  # a bijection ranks <-> (pipeline, stage)


def test_one_node_orders_shared_devices_pipeline_by_pipeline_and_the_default_grid_stage_by_stage():
    # shared devices: Lightning's local ranks fill every device once per pipeline; a device per process:
    # a stage's replicas are consecutive (pipeline outermost)
    assert [Topology(6, 2, 3).stage_of(r) for r in range(6)] == [0, 1, 2] * 2
    assert [Topology(6, 2).stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [Topology(6, 2).replica_of(r) for r in range(6)] == [0, 1] * 3


def test_local_ranks_fill_every_device_before_any_doubles_up(monkeypatch):
    # no GPU needed: the devices are names here; processes, device of each, and the backends
    cuda = [torch.device("cuda", i) for i in range(2)]
    strategy = AutoPipeStrategy(pipelines=3, parallel_devices=cuda, cluster_environment=LightningEnvironment())
    assert strategy.num_processes == 6
    devices = []
    for local in range(6):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        devices.append(strategy.root_device)
    assert devices == [cuda[0], cuda[1]] * 3
    assert strategy.group_backend == "nccl"  # the pipelines' groups; the world is gloo (NCCL: one rank per GPU)
    separate = AutoPipeStrategy(pipelines=3, share_devices=False, parallel_devices=cuda, cluster_environment=LightningEnvironment())
    assert separate.num_processes == 2 and separate.group_backend is None


def test_share_devices_is_checked():
    with pytest.raises(SettingError, match=r"share_devices='yes': true .* or false"):
        PipelineConfig(pipelines=2, share_devices="yes")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices,share", [(2, True), (4, False)])
def test_both_layouts_follow_the_avgpipe_rule(tmp_path, devices, share):
    # 2 pipelines x 2 stages either way: 2 devices shared by both pipelines, or 4 devices, one per process
    model = LitSeq()
    strategy = AutoPipeStrategy(microbatches=2, partition="uniform", start_method=START, pipelines=2, share_devices=share)
    trainer = L.Trainer(
        devices=devices, strategy=strategy, callbacks=[saved(tmp_path, 5)], **trainer_kwargs(max_steps=5, enable_checkpointing=True)
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=10))
    assert trainer.strategy.num_processes == 4
    want_parallel, want_ref = simulate(5, 2, 0.5, 0)
    (path,) = glob.glob(os.path.join(tmp_path, "*step=5.ckpt"))
    reference, parallel = parallel_models(path)
    assert max_rel_diff(want_ref, reference) <= 1e-10
    for n in range(2):
        assert max_rel_diff(want_parallel[n], parallel[n]) <= 1e-10
