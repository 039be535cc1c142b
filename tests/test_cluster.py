"""Cluster launchers on one host: torchrun across 2 "nodes" (c10d rendezvous; 1 and 2 processes per
node), the environment `srun` gives 2 tasks (Lightning's SLURMEnvironment detected), and AvgPipe
with its reference processes on one node serving the pipeline of the other. Each trains to the
one-process weights (AvgPipe: to the rule of tests/test_avgpipe.py's one-process simulation).
The "On a cluster" commands of docs/guide/scale.md are these."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from _dist import free_port
from models import LitSeq, loader, max_rel_diff, trainer_kwargs
from test_avgpipe import simulate

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
HERE = Path(__file__).resolve().parent
JOB = HERE / "cluster_job.py"


def environment(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("LOCAL_RANK", "RANK")}
    return dict(env, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1", **extra)


def start(cmd: list, cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def all_succeed(procs: list, timeout: float = 200) -> None:
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-4000:]


def torchrun_nodes(tmp_path: Path, per_node: int, pipelines: int = 0, *layout: str) -> dict:
    """Two torchrun agents (two "nodes" of `per_node` processes) meeting at one c10d endpoint."""
    out, endpoint = tmp_path / "out.pt", f"127.0.0.1:{free_port()}"
    rendezvous = ["--nnodes=2", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=job"]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, JOB, per_node, 2, pipelines, out, *layout]
    all_succeed([start(command, tmp_path, environment()) for _ in range(2)])
    return torch.load(out)


def one_process() -> dict:
    ref = LitSeq()
    L.Trainer(devices=1, **trainer_kwargs()).fit(ref, loader())
    return ref.state_dict()


@pytest.mark.parametrize("per_node", [1, 2])
def test_torchrun_two_nodes(tmp_path, per_node):
    saved = torchrun_nodes(tmp_path, per_node)
    assert saved["environment"] == "TorchElasticEnvironment" and saved["world"] == 2 * per_node
    assert max_rel_diff(one_process(), saved["state"]) <= 1e-10


def test_slurm_tasks(tmp_path):
    # what `srun --ntasks-per-node=2 python cluster_job.py 2 1 0 out.pt` sets in each task's environment
    out, port = tmp_path / "out.pt", str(free_port())
    common = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_ID="4242",
                  SLURM_JOB_NAME="train", SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    tasks = [environment(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **common) for r in range(2)]
    procs = [start([sys.executable, JOB, 2, 1, 0, out], tmp_path, env) for env in tasks]
    all_succeed(procs)
    saved = torch.load(out)
    assert saved["environment"] == "SLURMEnvironment" and saved["world"] == 2
    assert max_rel_diff(one_process(), saved["state"]) <= 1e-10


@pytest.mark.parametrize("layout", [(), ("separate",)])
def test_avgpipe_references_serve_the_other_node(tmp_path, layout):
    # 2 nodes x 2 processes, pipelines=2. Shared devices (the paper's layout): each node's one device runs
    # its stage of both pipelines (stage 0 on node 0, stage 1 on node 1), so every pipeline crosses the
    # nodes. Separate: node 0 holds pipeline 0 and starts both stages' reference processes; node 1's
    # pipeline reaches them through the job's store.
    saved = torchrun_nodes(tmp_path, 2, 2, *layout)
    _, reference = simulate(4, 2, 0.5, 0)
    assert max_rel_diff(reference, saved["state"]) <= 1e-10
