"""The run folder's name, the same in every process of a job (`${run_id:}` in conf/hydra/output).

Each process of a multi-node job resolves Hydra's run folder itself, so a time stamp would differ
between nodes. The job's own id is shared: SLURM's job id (which a requeued job keeps, so
`ckpt_path=last` finds the last checkpoint again), torchrun's rendezvous id; elsewhere the start time.
"""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

_chosen: list[str] = []  # resolved once per process: Hydra reads run.dir more than once


def run_id() -> str:
    if not _chosen:
        slurm, rendezvous = os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHELASTIC_RUN_ID")
        if slurm:
            _chosen.append(f"slurm-{slurm}")
        elif rendezvous and rendezvous != "none":  # torchrun --rdzv-id (a static launch has none)
            _chosen.append(f"torchrun-{rendezvous}")
        else:
            _chosen.append(time.strftime("%Y-%m-%d_%H-%M-%S"))
    return _chosen[0]


OmegaConf.register_new_resolver("run_id", run_id, replace=True)
