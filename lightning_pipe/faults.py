"""Ending a multi-process job once, with one line, when any of its processes fails.

A pipeline cannot go on without any of its ranks, so the first rank (or watcher thread) that knows
the job is lost ends this process through `end()`: it prints at most one `error: ...` line, stops
the worker processes this process started, runs the cleanups registered with `on_end` (the CLI
removes the folder of a run that never trained) and exits with the code given. A second failure
seen meanwhile (the peer's broken socket in the main thread, a watcher thread) waits for the first
to finish instead of printing its own consequence of the same fault.

No Lightning and no torch.distributed here: the launcher registers its children, the heartbeat and
the CLI call `end`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional, Protocol

DEBUG_ENV = "LIGHTNING_PIPE_DEBUG"  # 1: tracebacks instead of one-line errors


class _Child(Protocol):
    pid: int

    def poll(self) -> Optional[int]: ...


_lock = threading.Lock()
_children: list[_Child] = []
_cleanups: list[Callable[[], None]] = []


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0", "false", "False")


def add_children(children: list[_Child]) -> None:
    """Worker processes this process started: `end` stops them."""
    _children.extend(children)


def on_end(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` when the job ends through `end` (errors in it are ignored)."""
    _cleanups.append(cleanup)


def failed_child(wait: float = 0.0) -> Optional[tuple[int, int]]:
    """(local rank, exit code) of a started worker that exited with an error, waiting up to `wait` s."""
    deadline = time.monotonic() + wait
    while True:
        for local_rank, child in enumerate(_children, start=1):
            code = child.poll()
            if code:  # None: running, 0: finished fine
                return local_rank, code
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def end_for_child(local_rank: int, code: int) -> None:
    """A started worker failed: it printed its own one-line error (exit code 1 or 2); a killed one
    could not, so that is said here. Never returns."""
    silent = code < 0 or code not in (1, 2)
    end(code if code > 0 else 1, f"error: local rank {local_rank} {describe_exit(code)}; the job stops" if silent else None)


def end(code: int, line: Optional[str] = None) -> None:
    """Print `line` (if any), stop the workers, clean up, exit with `code`. Never returns; if
    another thread is already ending the process, wait for it."""
    if not _lock.acquire(blocking=False):
        while True:  # the first caller exits the process
            time.sleep(60)
    try:
        if line:
            print(line, file=sys.stderr, flush=True)
        for child in _children:
            if child.poll() is None:
                try:
                    os.kill(child.pid, signal.SIGKILL)  # also ends a stopped (SIGSTOP) worker; SIGTERM would not
                except ProcessLookupError:
                    pass
        for cleanup in _cleanups:
            try:
                cleanup()
            except Exception:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    finally:
        # Not sys.exit: other threads (gloo, the data loader) may be blocked forever on the lost peer.
        os._exit(code)
