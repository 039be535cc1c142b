"""Flush in Lightning: one weight version, nothing outlives a step, nothing to refuse."""

from __future__ import annotations

from typing import Any

from ...layers import Flush, Versions
from .base import VersionsLayer


class FlushLayer(VersionsLayer):
    def make_runner(self, settings: dict[str, Any]) -> Versions:
        return Flush(**settings, slicing=self.ctx.config.slicing)
