import os
import sys

# Child processes started by `spawn` import test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Hugging Face models are built from configs here: nothing may reach for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import multiprocessing

import pytest
import torch.distributed as dist

# The tests' workers and commands are forked from one fork server (multiprocessing's "forkserver": a
# fresh interpreter started at the first use that imports these and nothing else), not from pytest's
# own process. pytest's process picks up threads as the suite runs (tqdm's monitor, wandb's service,
# the profiler's, TCPStore servers); a fork copies whatever lock such a thread holds, and a worker
# forked at the wrong moment hangs. The fork server has no threads.
FORKSERVER_PRELOAD = ["lightning_pipe.cli.train", "lightning_pipe.cli.plan", "models", "strategies_pipeline"]
multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)

# Processes a test may start and leave for later tests: a module's pool of workers (tests/strategies_pipeline.py)
LONG_LIVED = ("pool rank",)


def _kill(children) -> None:
    for child in children:
        child.kill()
    for child in children:
        child.join(5)


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
def _no_worker_outlives_its_test():
    """A worker the test started and left alive (its test hit the timeout while a launcher waited on it)
    is killed and fails that test. Left running, it would hold its port and cores and block pytest's
    exit (multiprocessing joins every live child at exit)."""
    before = {child.pid for child in multiprocessing.active_children()}
    yield
    left = [c for c in multiprocessing.active_children() if c.pid not in before and not c.name.startswith(LONG_LIVED)]
    if left:
        _kill(left)
        pytest.fail(f"this test left {len(left)} worker process(es) alive ({', '.join(c.name for c in left)}): killed")


def pytest_sessionfinish(session, exitstatus):
    """Nothing outlives the session: pools and anything a failure left behind are ended before
    multiprocessing's exit handler would wait on them."""
    _kill(multiprocessing.active_children())


@pytest.fixture(autouse=True)
def _no_process_group_left_in_pytest():
    """A process group left open in pytest's own process is inherited by every later test's forked
    workers, whose collectives then wait forever on a stale group: fail the test that left it."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group open in pytest's process")
