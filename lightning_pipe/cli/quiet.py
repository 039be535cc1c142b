"""Our CLI prints our lines (progress, plan, metrics, errors). Lightning's own start-up lines (the
accelerator banner, logger tips, "Initializing distributed", the process-group banner, "fit
stopped") are shown only with `verbose=true` or LIGHTNING_PIPE_DEBUG=1. Warnings and errors always
pass, and so does what our code logs through Lightning's rank-zero helpers (they log at the caller);
train.log gets those too (`lightning_lines_to_file`)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parents[1])


class _OursOrWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.pathname.startswith(PACKAGE)


def quiet_lightning(verbose: bool) -> None:
    """Keep Lightning's info lines off the console unless `verbose` (or LIGHTNING_PIPE_DEBUG=1)."""
    if verbose or os.environ.get("LIGHTNING_PIPE_DEBUG") == "1":
        return
    # torch 2.13 deprecates a class Lightning's pytree helper still checks for: not the user's to act on
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    keep = _OursOrWarnings()
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(keep)


class _ToFiles(logging.Handler):
    """Hands a record to file handlers that belong to another logger (the root's)."""

    def __init__(self, files: list[logging.Handler]):
        super().__init__()
        self.files = files

    def emit(self, record: logging.LogRecord) -> None:
        for handler in self.files:
            handler.handle(record)


def lightning_lines_to_file(verbose: bool) -> None:
    """What the strategy says through Lightning's rank-zero helpers (plans, adaptive switches) goes to
    the run's train.log too: Lightning's logger, made before Hydra's logging, does not propagate to
    the root logger, whose file handler Hydra set up. Lightning's own lines as on the console."""
    lightning = logging.getLogger("lightning.pytorch")
    for old in [h for h in lightning.handlers if isinstance(h, _ToFiles)]:
        lightning.removeHandler(old)  # a multirun's earlier job: Hydra gave this job a file of its own
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if lightning.propagate or not files:
        return
    forward = _ToFiles(files)
    if not (verbose or os.environ.get("LIGHTNING_PIPE_DEBUG") == "1"):
        forward.addFilter(_OursOrWarnings())
    lightning.addHandler(forward)
