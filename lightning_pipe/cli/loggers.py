"""The logger groups' packages (`logger=tensorboard|wandb|mlflow`, conf/logger/).

An entry of a callbacks / logger group may say which package it needs:

- ``_if_installed_: <module>``: optional; the entry is skipped when the module is missing (the default
  `logger=csv` writes TensorBoard logs as well when `tensorboard` happens to be installed);
- ``_requires_: <module>``: asked for; a missing module is one `error: ...` line naming the setting
  and the pip command, before anything is instantiated or any process starts.

The three packages are the `loggers` extra: ``pip install 'lightning-pipe[loggers]'``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

from ..errors import SettingError

# module -> the pip package that provides it (Lightning's MLFlowLogger needs only the client: mlflow-skinny)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_required(group: Optional[Any], name: str) -> None:
    """Every non-null entry's ``_requires_`` module is installed, else a `SettingError` such as
    ``logger=wandb needs the wandb package: pip install 'lightning-pipe[loggers]' (or pip install wandb)``."""
    for key, entry in (group or {}).items():
        module = entry.get("_requires_") if entry is not None else None
        if module and not installed(module):
            pip = PACKAGES.get(module, module)
            raise SettingError(f"{name}={key} needs the {module} package: pip install 'lightning-pipe[loggers]' (or pip install {pip})")


def mlflow_logger(**kwargs: Any) -> Any:
    """Lightning's MLFlowLogger. With a file store (``tracking_uri: file:<run folder>/mlruns``) MLflow >= 3.x
    refuses to start unless told the file backend is wanted: say so (MLFLOW_ALLOW_FILE_STORE), unless the
    environment already decided."""
    from lightning.pytorch.loggers import MLFlowLogger

    uri = kwargs.get("tracking_uri") or ""
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLFlowLogger(**kwargs)
