"""Full checkpoints reach rank 0 one stage and one tensor at a time, into files that are gone at once."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning.checkpoint.full import gather_to_zero
from lightning_pipe.lightning.checkpoint.io import StreamedCheckpointIO
from lightning_pipe.lightning.context import RankContext
from lightning_pipe.topology import ProcessGroups, Topology


def stage_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    shared = torch.randn(3, 4, generator=g)
    return {
        "weights": {"a": torch.randn(5, generator=g), "tied": shared, "tied again": shared},
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7.0 + rank),
        "empty": torch.zeros(0, 4),
        "groups": [{"lr": 0.1 * (rank + 1), "params": [f"p{rank}", "q"]}],
        "ids": (torch.arange(4) * rank, "text"),
    }


def _gather(rank: int, world: int, folder: str) -> object:
    topology = Topology(world, 1)
    ctx = RankContext(PipelineConfig(), topology, ProcessGroups(topology, rank), rank, torch.device("cpu"), None, Path(folder))
    parts = gather_to_zero(ctx, stage_state(rank))
    torch.distributed.barrier()  # a sender's last send completes before the receiver leaves
    if parts is None:
        return None
    return parts, os.listdir(folder)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_stage_arrives_whole_shared_tensors_once_and_no_file_is_left(tmp_path):
    results = run_distributed(_gather, 3, str(tmp_path), timeout=90)
    assert results[1] is None and results[2] is None
    parts, left = results[0]
    assert left == [], "the memory-mapped files are unlinked once mapped"
    assert len(parts) == 3
    for rank, part in enumerate(parts):
        expected = stage_state(rank)
        assert part["groups"] == expected["groups"] and part["ids"][1] == "text"
        tied = part["weights"]["tied"], part["weights"]["tied again"]
        assert tied[0].data_ptr() == tied[1].data_ptr(), "a tensor that appears twice comes once"
        for got, want in [
            *zip(part["weights"].values(), expected["weights"].values()),
            (part["bf16"], expected["bf16"]),
            (part["step"], expected["step"]),
            (part["empty"], expected["empty"]),
            (part["ids"][0], expected["ids"][0]),
        ]:
            assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)


def test_checkpoint_file_is_written_without_a_buffer_and_atomically(tmp_path):
    io = StreamedCheckpointIO()
    target = tmp_path / "deep" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(6.0)}, "step": 3}, target)
    assert torch.equal(torch.load(target)["state_dict"]["w"], torch.arange(6.0))
    with pytest.raises((pickle.PicklingError, AttributeError)):  # a lambda cannot be pickled: the save fails half-way
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "bad": lambda: 0}, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"], "nothing half-written is left"
    assert torch.load(target)["step"] == 3, "the previous checkpoint is untouched"
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, target, storage_options={"x": 1})
    assert isinstance(AutoPipeStrategy().checkpoint_io, StreamedCheckpointIO)
