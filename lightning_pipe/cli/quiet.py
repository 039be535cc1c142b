"""Our CLI prints our lines (progress, plan, metrics, errors). Lightning's own start-up lines (the
accelerator banner, logger tips, "Initializing distributed", the process-group banner, "fit
stopped") are shown only with `verbose=true` or LIGHTNING_PIPE_DEBUG=1. Warnings and errors always
pass, and so does what our code logs through Lightning's rank-zero helpers (they log at the caller)."""

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
