"""One line per failure for the command-line tools.

`run(main)` calls a Hydra main function so that whatever goes wrong — a bad override while Hydra
composes the config, a bad setting or file found before the processes start, an error raised on
any rank after they started — ends with a single `error: ...` line on stderr and exit code 2, and
a lost peer (killed, stopped, unreachable) with exit code 1. `LIGHTNING_PIPE_DEBUG=1` shows the
traceback instead. Each rank runs this wrapper (Lightning's launcher re-runs the command), and
`lightning_pipe.faults` makes sure the job ends once.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Callable, Optional

from hydra.errors import HydraException, InstantiationException
from omegaconf.errors import OmegaConfBaseException

from .. import faults
from ..config import PipelineConfig

USER_ERROR = 2  # the run was refused or failed with an error (a setting, a file, the model's code)
FAULT = 1  # a peer was lost: killed, stopped or unreachable

_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed", "timed out", "timeout")

_PIPELINE_FIELDS = set(PipelineConfig.__dataclass_fields__)

rank: Optional[int] = None  # this process's global rank once the processes run (set by the CLI)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _hydra_message(err: BaseException) -> str:
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0].removeprefix("In 'config': ") if lines else type(err).__name__
    options = []  # "Available options in 'recipe':\n\tname\n\tname\n\n"
    if "Available options" in text:
        after = text.split("Available options", 1)[1].splitlines()[1:]
        options = after[: next((i for i, line in enumerate(after) if not line.startswith("\t")), len(after))]
    if options:
        head += f" (available: {', '.join(o.strip() for o in options)})"
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException):
        head += f": {_first_line(str(cause))}"
    return head


def _is_peer_lost(err: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())) and not isinstance(err, getattr(dist, "DistStoreError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("gloo" in text or "nccl" in text) and any(s in text for s in _PEER_LOST)


def describe(err: BaseException) -> str:
    """The one line for `err`: the message users act on, naming the setting or file."""
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__  # the model's or data module's own message, not Hydra's wrapper
    if isinstance(err, (HydraException, OmegaConfBaseException)):
        return _hydra_message(err)
    message = _first_line(str(err))
    setting = getattr(err, "setting", None)  # a SettingError of a PipelineConfig field
    if setting in _PIPELINE_FIELDS and f"pipeline.{setting}" not in message:
        message += f" (pipeline.{setting})"
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in message:
        message += f": {err.filename}"
    if isinstance(err, (ValueError, OSError)) and message:
        return message
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def report(err: BaseException) -> None:
    """End this process for `err` (never returns)."""
    # After the launch every process has LOCAL_RANK (Lightning sets it); before, this is the only one.
    me = rank if rank is not None else (int(os.environ["LOCAL_RANK"]) if os.environ.get("LOCAL_RANK", "").isdigit() else None)
    node = os.environ.get("NODE_RANK", "0")
    prefix = "" if me is None else (f"rank {me}: " if node in ("", "0") else f"node {node}, local rank {me}: ")
    from ..runtime.elastic import ReferenceLost

    if isinstance(err, ReferenceLost):  # AvgPipe's reference process: a lost peer, named
        if not err.first_hand:  # its starter (which knows the exit code) or rank 0's watcher speaks first
            found = faults.failed_child(wait=3.0)
            if found is not None:
                faults.end_for_child(*found)
            if me not in (None, 0):
                time.sleep(3.0)
        faults.end(FAULT, f"error: {prefix}{describe(err)}")
    if _is_peer_lost(err):
        # Most often the consequence of another rank's failure, which that rank reports: give the
        # watcher of the workers (rank 0) a moment to see it; a child waits to be stopped by rank 0.
        found = faults.failed_child(wait=3.0)
        if found is not None:
            faults.end_for_child(*found)
        if me not in (None, 0):
            time.sleep(3.0)
        faults.end(FAULT, f"error: {prefix}lost contact with a peer ({describe(err)}); the job stops")
    faults.end(USER_ERROR, f"error: {prefix}{describe(err)}")


def reported(task: Callable[..., Any]) -> Callable[..., Any]:
    """For the task function under `@hydra.main`: its failures become one line here, before Hydra
    adds its own "Error executing job" report."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if faults.debug():
            return task(*args, **kwargs)
        try:
            return task(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as err:  # noqa: BLE001 - every failure becomes one line
            report(err)

    return wrapper


def run(main: Callable[[], Any]) -> Any:
    """Call a `@hydra.main` function with one-line errors (see the module docstring)."""
    if faults.debug():
        return main()
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report: we print one line
    try:
        return main()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        faults.end(130, "error: interrupted")
    except BaseException as err:  # noqa: BLE001 - every failure becomes one line
        report(err)
    finally:
        sys.stdout.flush()
