import os
import sys

# Child processes started by `spawn` import test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Hugging Face models are built from configs here: nothing may reach for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Trainers write logs, plans and checkpoints under the working directory: keep it per test."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _a_port_of_its_own(monkeypatch):
    """Each test's Trainer picks a free port (Lightning keeps the first one it picked in MASTER_PORT): a test
    whose workers hung and still hold that port fails alone, not every later test with it."""
    monkeypatch.delenv("MASTER_PORT", raising=False)


@pytest.fixture(autouse=True)
def _no_process_group_left_in_pytest():
    """A process group left open in pytest's own process is inherited by every later test's forked
    workers, whose collectives then wait forever on a stale group: fail the test that left it."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group open in pytest's process")
