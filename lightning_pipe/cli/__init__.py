"""Hydra entry points: `python -m lightning_pipe.train` (console script `lightning-pipe-train`)."""
