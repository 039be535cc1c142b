"""RankContext: what this rank's part of the run is, handed to the bridge's helpers instead of the strategy.

Built by the strategy in setup once the topology and process groups exist; `cut` is set when the
model is cut (and replaced by a live switch), `optimizers` and `lr_scheduler_configs` once Lightning
has built them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import PipelineConfig
from ..topology import ProcessGroups, Topology
from .choice_2bw import TwoBWChoice
from .cut import Cut


@dataclass
class RankContext:
    config: PipelineConfig
    topology: Topology
    groups: ProcessGroups
    global_rank: int
    device: torch.device
    module: Any  # the LightningModule (after the cut it holds this rank's stage)
    out_dir: Path  # where plans, profiles and traces are written (the trainer's log_dir)
    main_address: str = "127.0.0.1"  # the job's TCPStore (AvgPipe's reference processes join it)
    main_port: int = 0
    resume_path: Optional[str] = None  # fit's ckpt_path
    checkpoint_io: Optional[Any] = None  # reads a checkpoint ahead of Lightning
    shape: Optional[TwoBWChoice] = None  # planner=...: the run's shape chosen at setup
    cut: Optional[Cut] = None
    optimizers: list[Any] = field(default_factory=list)
    lr_scheduler_configs: list[Any] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return self.topology.depth

    @property
    def stage_index(self) -> int:
        return self.topology.stage_of(self.global_rank)

    @property
    def replica_index(self) -> int:
        return self.topology.replica_of(self.global_rank)

    @property
    def tensor_index(self) -> int:
        """This rank's place in its tensor-parallel group (0 without tensor parallelism)."""
        return self.topology.tensor_of(self.global_rank)

    def pipeline_rank(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline (at this rank's tensor index)."""
        return self.topology.global_rank(self.replica_index, stage, self.tensor_index)

    @property
    def pipeline_group(self) -> Optional[Any]:
        """The pipeline's process group; None with one stage (nothing to exchange)."""
        return self.groups.pipeline if self.topology.depth > 1 else None

    @property
    def trainer(self) -> Any:
        return self.module.trainer
