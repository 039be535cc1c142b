"""`strategy="autopipe"` from a plain script (Lightning's launcher) and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch
from _dist import free_port
from models import LitSeq, loader, max_rel_diff, trainer_kwargs

pytestmark = pytest.mark.multiprocess

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import lightning as L
    import lightning_pipe  # registers "autopipe"
    from models import LitSeq, loader, trainer_kwargs

    if __name__ == "__main__":
        model = LitSeq()
        trainer = L.Trainer(devices=2, strategy="autopipe", **trainer_kwargs())
        trainer.fit(model, loader())
        if trainer.global_rank == 0:
            torch.save(model.state_dict(), sys.argv[1])
    """
)


def run(cmd, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]


def reference():
    ref = LitSeq()
    L.Trainer(devices=1, **trainer_kwargs()).fit(ref, loader())
    return ref.state_dict()


@pytest.mark.timeout(240)
def test_plain_script_with_lightnings_launcher(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / "weights.pt"
    run([sys.executable, "train.py", str(out)], tmp_path)
    assert max_rel_diff(reference(), torch.load(out)) <= 1e-10


@pytest.mark.timeout(240)
def test_torchrun(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / "weights.pt"
    run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "train.py", str(out)],
        tmp_path,
    )
    assert max_rel_diff(reference(), torch.load(out)) <= 1e-10
