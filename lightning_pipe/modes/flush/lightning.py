"""Flush in Lightning: one weight version, nothing outlives a step, nothing to refuse."""

from __future__ import annotations

from typing import Any

from ..engine import Versions
from ..lightning import VersionsLayer
from .engine import Flush


class FlushLayer(VersionsLayer):
    def make_runner(self, settings: dict[str, Any]) -> Versions:
        return Flush(**settings, slicing=self.ctx.config.slicing)
