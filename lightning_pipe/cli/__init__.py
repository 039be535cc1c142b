"""Hydra entry points: `python -m lightning_pipe.train` (console script `lightning-pipe-train`)
and `python -m lightning_pipe.plan`. Importing this package registers the config schema."""

from . import schema  # noqa: F401  (ConfigStore: pipeline_schema)
