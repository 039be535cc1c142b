import os
import sys

# Child processes started by `spawn` import test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Trainers write logs, plans and checkpoints under the working directory: keep it per test."""
    monkeypatch.chdir(tmp_path)
