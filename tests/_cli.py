"""`python -m <module> <args>` for the command-line tests, without paying for a new interpreter each time.

A fresh interpreter imports torch, Lightning and Hydra again before the command does anything:
4-10 s per command on 2 loaded cores, most of a refused command's run. `run_module` forks the
command instead from a fork server (multiprocessing's "forkserver": one process started once per
test session that imported those packages (conftest's FORKSERVER_PRELOAD) and nothing else; not pytest's process, so nothing a
test left there reaches the command). The forked process is a fresh one as far as the command can
tell: it gets the arguments as `sys.argv`, the working directory and the environment, runs the
module as `__main__` (runpy, as `python -m` does) and exits with the command's exit code; its
stdout and stderr come back in a `subprocess.CompletedProcess`, as `subprocess.run(...,
capture_output=True, text=True)` returns them.

Only for commands that start no worker processes (a refused setting, the planner): a training run
starts its ranks by re-running the command line, which needs a real `python -m` (those tests keep
`subprocess.run`). One refused command in test_cli.py also stays a real `python -m` run, so the
interpreter's own start stays covered.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _command(module: str, args: list, cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked process: `python -m module *args` in `cwd` with `env`, output to files."""
    import atexit
    import runpy

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *map(str, args)]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # what the interpreter does at exit (logging's flush of the run's log files ...)
        sys.stdout.flush()
        sys.stderr.flush()


def run_module(module: str, args: list, cwd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)`, forked from the fork server (see the module docstring)."""
    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="cli_") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        proc = ctx.Process(
            target=_command, args=(module, list(args), str(cwd), dict(os.environ if env is None else env), str(out), str(err))
        )
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], proc.exitcode, out.read_text(), err.read_text())
