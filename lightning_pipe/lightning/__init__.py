"""The bridge to Lightning: the strategy, its host for the user's steps, logs and stages."""

from .strategy import AutoPipeStrategy

__all__ = ["AutoPipeStrategy"]
