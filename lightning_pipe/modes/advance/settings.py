"""AvgPipe's advance forward propagation (§4.2): a fixed advance_num, checked on its own and, once the
depth is known, against [K - 1, M]. Which schedules take it is the legality table's (`config.py`)."""

from __future__ import annotations

from typing import Any

from ...errors import SettingError
from ...schedules.advance import advance_bounds


def check_config(config: Any) -> None:
    value = config.advance_num
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SettingError(f"advance_num={value!r}: an integer in [K - 1, M], or None for the adaptive rule", "advance_num")


def check_world(config: Any, stages: int) -> None:
    """A fixed advance_num must lie in [K - 1, M] on this depth."""
    if config.advance_num is None:
        return
    low, high = advance_bounds(stages, config.microbatches)
    if not low <= config.advance_num <= high:
        raise SettingError(
            f"advance_num={config.advance_num} is outside [K - 1, M] = [{low}, {high}] for K={stages} stages and "
            f"microbatches={config.microbatches} ({low}: 1F1B, {high}: all forwards first)",
            "advance_num",
        )
