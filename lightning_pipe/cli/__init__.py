"""Hydra entry points: `python -m lightning_pipe.train` (console script `lightning-pipe-train`)
and `python -m lightning_pipe.plan`. Importing this package registers the config schema and the run folder's resolver."""

from . import run_id, schema  # noqa: F401  (the ${run_id:} resolver; ConfigStore: pipeline_schema)
