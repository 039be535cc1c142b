"""A user's script as a cluster runs it, for tests/test_cluster.py:
`python cluster_job.py <processes per node> <nodes> <pipelines or 0> <out.pt> [separate]` under torchrun
(every node one agent) or with the environment srun gives each task. AvgPipe's pipelines share each
node's devices (processes / pipelines of them) unless `separate` gives every process its own. Global rank 0 saves the model it got
back and the cluster environment Lightning detected."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import LitSeq, loader, trainer_kwargs  # noqa: E402

from lightning_pipe import AutoPipeStrategy  # noqa: E402

if __name__ == "__main__":
    processes, nodes, pipelines, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    shared = pipelines > 0 and sys.argv[5:] != ["separate"]
    devices = processes // pipelines if shared else processes
    strategy = AutoPipeStrategy(microbatches=2, partition="uniform", pipelines=pipelines or None, share_devices=shared)
    trainer = L.Trainer(devices=devices, num_nodes=nodes, strategy=strategy, **trainer_kwargs())
    model = LitSeq()
    trainer.fit(model, loader())
    if trainer.global_rank == 0:
        environment = type(trainer.strategy.cluster_environment).__name__
        torch.save({"state": model.state_dict(), "environment": environment, "world": trainer.world_size}, out)
